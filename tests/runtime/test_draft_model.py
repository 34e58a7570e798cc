"""A draft export drafting for its target (runtime/drivers/draft_model.py): greedy output identical to plain
greedy decoding, one row and a batch, every draft length; the draft's own rows roll back with the target's;
a draft that cannot draft for the target is refused in one line naming the difference."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kvforge.core.errors import InputError  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402
from kvforge.runtime.drivers.draft_checks import _check_tokens  # noqa: E402

PROMPTS = [[1, 17, 230, 41, 9, 77, 12], [1, 5, 6], [1, 300, 2, 301, 44, 45, 46, 47, 48, 49, 50]]


def test_draft_model_greedy_equals_plain_greedy_one_row(exported, draft_export) -> None:
    generator = Generator(exported("llama-tiny", "ort"), draft=draft_export("ort"))
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain = generator.generate([prompt], max_new_tokens=24, greedy=True, ignore_eos=True)
        for draft_len in (1, 3, 6):
            spec = generator.generate([prompt], max_new_tokens=24, greedy=True, ignore_eos=True, speculate="draft",
                                      draft_len=draft_len)
            assert spec.tokens == plain.tokens, (prompt, draft_len)
            # every step verifies a draft, but a last one that has no room for a draft
            assert spec.steps - 1 <= spec.verify_steps <= spec.steps and spec.drafted_at[0] == spec.verify_steps
            drafted, accepted = drafted + spec.draft_tokens, accepted + spec.accepted_tokens
    # int4 of the same weights agrees with fp32 most of the time: drafts are kept, steps are saved
    assert accepted > drafted / 4, (accepted, drafted)


def test_draft_model_greedy_equals_plain_greedy_batch_on_onnx(exported, draft_export) -> None:
    # The onnx target verifies (and the draft catches up) every row in one call.
    generator = Generator(exported("llama-tiny", "onnx"), draft=draft_export("onnx"))
    plain = generator.generate(PROMPTS, max_new_tokens=20, greedy=True, ignore_eos=True)
    spec = generator.generate(PROMPTS, max_new_tokens=20, greedy=True, ignore_eos=True, speculate="draft", draft_len=4)
    assert spec.tokens == plain.tokens
    assert spec.steps < plain.steps


def test_draft_rows_stop_inside_an_accepted_run(exported, draft_export) -> None:
    generator = Generator(exported("llama-tiny", "ort"), draft=draft_export("ort"))
    for n in range(1, 9):
        plain = generator.generate([PROMPTS[0]], max_new_tokens=n, greedy=True, ignore_eos=True)
        spec = generator.generate([PROMPTS[0]], max_new_tokens=n, greedy=True, ignore_eos=True, speculate="draft",
                                  draft_len=5)
        assert spec.tokens == plain.tokens and spec.finish_reason == ["length"], n


def test_a_draft_that_cannot_draft_for_the_target_is_refused(exported, draft_export, tmp_path) -> None:
    target = exported("llama-tiny", "ort")
    with pytest.raises(InputError, match=r"^--draft .*: its vocabulary has \d+ ids and the target's \d+; a draft must "
                                         r"share the target's vocabulary$"):
        Generator(target, draft=exported("llava-tiny", "ort"))
    with pytest.raises(InputError, match=r"is the target export itself"):
        Generator(target, draft=target)
    with pytest.raises(InputError, match=r"^--draft .*: not a kvforge export folder \(no kvforge.json\)"):
        Generator(target, draft=tmp_path)
    # The export's files are hashed, so a tokenizer that differs at one size is compared directly: two ids swapped.
    vocab = {"<pad>": 0, "a": 68, "b": 69}
    swapped = {"<pad>": 0, "a": 69, "b": 68}
    with pytest.raises(InputError, match=r"^--draft d: its vocabulary differs from the target's \(4 token/id pairs, "
                                         r"first 'a' = 68\); a draft must share the target's token ids$"):
        _check_tokens("--draft d", (swapped, {}), (vocab, {}))
    with pytest.raises(InputError, match=r"^--draft d: its special tokens differ from the target's \(id 0: "
                                         r"'<unk>' vs '<pad>'\)$"):
        _check_tokens("--draft d", (vocab, {0: "<unk>"}), (vocab, {0: "<pad>"}))


@pytest.mark.slow  # the real model exported three ways (test_real_model's tier)
def test_the_real_models_int4_export_drafts_for_its_fp32_and_fp16_exports(real, tmp_path) -> None:
    # Self-speculation by quantisation on the real SmolLM2-135M-Instruct: kvforge's default int4 export (HQQ,
    # 8-bit lm_head) drafts; greedy answers equal plain greedy decoding's, and most drafts are kept.
    from kvforge.exporter.export import export_model

    draft = tmp_path / "int4"
    export_model(real["hf"], draft, quantize="int4")
    fp16 = tmp_path / "fp16"
    export_model(real["hf"], fp16, dtype="fp16")
    question = [{"role": "user", "content": "Explain how photosynthesis works in plants."}]
    for target in (real["ort"], fp16):
        generator = Generator(target, draft=draft)
        ids = generator.chat_ids(question)
        plain = generator.generate([ids], max_new_tokens=48, greedy=True)
        spec = generator.generate([ids], max_new_tokens=48, greedy=True, speculate="draft", draft_len=4)
        assert spec.tokens == plain.tokens, target
        assert spec.accepted_tokens > 0.6 * spec.draft_tokens, (spec.accepted_tokens, spec.draft_tokens)


def _spins(export) -> str:
    try:
        return export.backend.sessions["prefill"].get_session_options().get_session_config_entry(
            "session.intra_op.allow_spinning")
    except Exception:  # noqa: BLE001 (ONNX Runtime raises where the entry was never set: its default, spinning)
        return "default"


def test_a_target_loaded_to_speculate_with_a_second_session_does_not_spin(exported, draft_export, tmp_path) -> None:
    # A spinning target holds the cores its draft's calls need between verifications (1.42x -> 1.63x on SmolLM2):
    # loaded with a draft (or for a head) on ONNX Runtime its threads sleep, unless the caller says otherwise.
    from kvforge.runtime.drivers.speculation_checks import target_options

    target = exported("llama-tiny", "ort")
    assert _spins(Generator(target, draft=draft_export("ort")).export) == "0"
    assert _spins(Generator(target, draft=draft_export("ort"), spinning=True).export) == "default"
    assert _spins(Generator(target).export) == "default"
    assert target_options(target, None, "eagle", {"threads": 1}) == {"threads": 1, "spinning": False}
    assert target_options(target, None, "prompt-lookup", {}) == {}  # one session: nothing takes turns with it
    assert target_options(target, "emulate", "draft", {}) == {}  # not ONNX Runtime's threads
    assert target_options(tmp_path, None, "draft", {}) == {}  # not an export: the load says so in its words
