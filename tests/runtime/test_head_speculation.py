"""Speculation with the export's own head through the Generator: EAGLE-3 heads (random weights, both published
forms; ort and onnx, one row and on onnx a batch) and checkpoints' MTP layers (DeepSeek-V3, GLM-4.5; ort) keep
greedy output identical to plain greedy decoding (Qwen3-Next's, beside recurrent layers, is refused); seeded
sampling repeats; a request for a head the export lacks is one line.
The heads' graphs against their torch references: tests/exporter/test_eagle3_export.py, tests/exporter/test_mtp_export.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from kvforge.core.errors import InputError  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402

pytestmark = pytest.mark.xdist_group("head-speculation")

PROMPTS = [[1, 17, 230, 41, 9, 77, 12], [1, 5, 6], [1, 300, 2, 301, 44, 45, 46, 47, 48]]
FORMS = {"llama-tiny": "speculators", "qwen3-tiny": "eagle"}  # tests/head_exports.py's EAGLE_FORMS


@pytest.fixture(scope="module")
def eagle_exports(eagle_export):
    """(recipe, form, target) -> the 8-layer target exported with a random EAGLE-3 head (tests/head_exports.py
    through conftest's eagle_export: made once per run, shared with the exporter's tests)."""

    def get(recipe: str, form: str, target: str):
        assert FORMS[recipe] == form
        return eagle_export(recipe, target)[0]

    return get


def _same_as_plain(generator: Generator, prompts: list[list[int]], method: str, draft_len: int) -> None:
    plain = generator.generate(prompts, max_new_tokens=16, greedy=True, ignore_eos=True)
    spec = generator.generate(prompts, max_new_tokens=16, greedy=True, ignore_eos=True, speculate=method,
                              draft_len=draft_len)
    assert spec.tokens == plain.tokens, (prompts, method, draft_len)
    assert spec.draft_tokens > 0 and spec.verify_steps > 0


@pytest.mark.parametrize(("recipe", "form"), [("llama-tiny", "speculators"), ("qwen3-tiny", "eagle")])
def test_eagle_heads_keep_greedy_output_on_ort(eagle_exports, recipe: str, form: str) -> None:
    generator = Generator(eagle_exports(recipe, form, "ort"))
    for prompt in PROMPTS:
        for draft_len in (1, 4):
            _same_as_plain(generator, [prompt], "eagle", draft_len)


def test_an_eagle_head_keeps_greedy_output_for_a_batch_on_onnx(eagle_exports) -> None:
    generator = Generator(eagle_exports("llama-tiny", "speculators", "onnx"))
    _same_as_plain(generator, PROMPTS, "eagle", 3)


def test_eagle_sampling_is_reproducible_with_a_seed(eagle_exports) -> None:
    generator = Generator(eagle_exports("llama-tiny", "speculators", "ort"))
    runs = [generator.generate([PROMPTS[0]], max_new_tokens=12, temperature=0.9, top_k=20, seed=7, ignore_eos=True,
                               speculate="eagle", draft_len=3).tokens for _ in range(2)]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_heads_keep_greedy_output_on_ort(mtp_export, family: str) -> None:
    generator = Generator(mtp_export(family) / "mtp")
    for prompt in PROMPTS:
        for draft_len in (1, 4):
            _same_as_plain(generator, [prompt], "mtp", draft_len)


def test_an_mtp_head_keeps_greedy_output_for_a_batch_on_onnx(mtp_export) -> None:
    _same_as_plain(Generator(mtp_export("glm4_moe", target="onnx") / "mtp"), PROMPTS, "mtp", 3)


def test_an_mtp_head_beside_recurrent_layers_is_refused_in_one_line(mtp_export) -> None:
    # Qwen3-Next's linear-attention layers cannot drop rejected drafts: its MTP head is exported, not run.
    with pytest.raises(InputError, match=r"^speculative decoding needs a cache that can drop rejected drafts"):
        Generator(mtp_export("qwen3_next") / "mtp").generate([PROMPTS[0]], max_new_tokens=4, speculate="mtp")


def test_a_head_the_export_lacks_is_one_line(eagle_exports, exported) -> None:
    with pytest.raises(InputError, match=r"^speculate='mtp': this export carries no MTP layer but an EAGLE-3 head; "
                                         r"speculate with method eagle$"):
        Generator(eagle_exports("llama-tiny", "speculators", "ort")).generate([PROMPTS[0]], speculate="mtp")
    with pytest.raises(InputError, match=r"^speculate='eagle': this export carries no EAGLE-3 head; export with "
                                         r"--eagle HEAD_DIR"):
        Generator(exported("llama-tiny", "ort")).generate([PROMPTS[0]], speculate="eagle")


def test_inspect_names_the_head(eagle_exports, exported) -> None:
    from click.testing import CliRunner

    from kvforge.cli import main

    shown = CliRunner().invoke(main, ["inspect", str(eagle_exports("llama-tiny", "speculators", "ort"))])
    assert shown.exit_code == 0, shown.output
    assert ("  speculation head: EAGLE-3 head, reads layers [1, 3, 6], draft vocabulary 96, in draft.onnx "
            "(--speculate eagle)") in shown.output.splitlines()
    assert "  draft: draft.onnx (" in shown.output  # the graph, checked like prefill and decode
    plain = CliRunner().invoke(main, ["inspect", str(exported("llama-tiny", "ort")), "--json"])
    assert json.loads(plain.output)["proposer"] is None


@pytest.mark.parametrize(("kind", "target"), [("eagle", "ort"), ("eagle", "onnx"), ("mtp", "ort")])
def test_a_scheduler_mixing_a_head_with_other_proposers_gives_solo_greedy(eagle_exports, mtp_export, kind: str,
                                                                          target: str) -> None:
    # Four rows: the head, prompt lookup and none at once, a fifth request joining as a row frees up.
    from kvforge.runtime import GenerationRequest, Speculation
    from kvforge.runtime.controls.sampling import SamplingConfig
    from kvforge.runtime.drivers.scheduler import Scheduler

    folder = eagle_exports("llama-tiny", "speculators", target) if kind == "eagle" else mtp_export("deepseek_v3") / "mtp"
    generator = Generator(folder)
    specs = [Speculation(kind, 3), None, Speculation("prompt-lookup", 4), Speculation(kind, 2), None]
    prompts = [*PROMPTS, [1, 9, 8, 7, 9, 8, 7, 9, 8], [1, 44, 45]]
    lengths = [14, 10, 16, 12, 9]
    plain = [generator.generate([p], max_new_tokens=n, greedy=True, ignore_eos=True).tokens[0]
             for p, n in zip(prompts, lengths, strict=True)]
    scheduler = Scheduler(generator, max_batch=4, max_seq_len=64, prefill_chunk=4)
    handles = [scheduler.submit(GenerationRequest(p, n, SamplingConfig(greedy=True), ignore_eos=True, speculation=s))
               for p, n, s in zip(prompts, lengths, specs, strict=True)]
    scheduler.start()
    try:
        assert [handle.result()[0] for handle in handles] == plain
        stats = scheduler.snapshot()
    finally:
        scheduler.close()
    assert stats["draft_tokens"] > 0 and stats["verify_steps"] > 0
