"""Speculation with the export's own head through the Generator: EAGLE-3 heads (random weights, both published
forms) and checkpoints' MTP layers keep greedy output identical to plain greedy decoding, on the ort and onnx
targets, one row and (onnx) a batch; seeded sampling repeats; a request for a head the export lacks is one line.
The heads' graphs against their torch references: tests/test_eagle3_export.py, tests/test_mtp_export.py."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from kvforge.core.errors import InputError  # noqa: E402
from kvforge.runtime import Generator  # noqa: E402

pytestmark = pytest.mark.xdist_group("head-speculation")

LAYERS = 4
PROMPTS = [[1, 17, 230, 41, 9, 77, 12], [1, 5, 6], [1, 300, 2, 301, 44, 45, 46, 47, 48]]


def _target(recipe: str, folder) -> None:
    import torch
    import transformers

    from kvforge.models.recipes import get_recipe

    spec = get_recipe(recipe)
    config = transformers.AutoConfig.for_model(spec.model_type, **{**spec.config, "num_hidden_layers": LAYERS})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)


@pytest.fixture(scope="module")
def eagle_exports(tmp_path_factory):
    """(recipe, form, target) -> the target exported with a random EAGLE-3 head."""
    from kvforge.exporter.export import export_model
    from kvforge.models.eagle3_checkpoint import write_random_head

    made: dict = {}

    def get(recipe: str, form: str, target: str):
        key = (recipe, form, target)
        if key not in made:
            root = tmp_path_factory.mktemp(f"{recipe}-{form}")
            _target(recipe, root / "hf")
            write_random_head(root / "hf", root / "head", form=form, draft_vocab_size=96, seed=5,
                              aux_layer_ids=[0, 1, 3] if form == "speculators" else None)
            made[key] = root / target
            export_model(root / "hf", made[key], target=target, eagle=root / "head")
        return made[key]

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
    assert ("  speculation head: EAGLE-3 head, reads layers [0, 1, 3], draft vocabulary 96, in draft.onnx "
            "(--speculate eagle)") in shown.output.splitlines()
    assert "  draft: draft.onnx (" in shown.output  # the graph, checked like prefill and decode
    plain = CliRunner().invoke(main, ["inspect", str(exported("llama-tiny", "ort")), "--json"])
    assert json.loads(plain.output)["proposer"] is None
