"""A vision-language checkpoint's text graphs streamed from its shards (exporter/text_stream.py): the same graphs,
weights and greedy tokens as from the text model loaded whole, with an image, with --text-only and in int4; the
stream path is the one taken, and the tower's tensors are not the text model's."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvforge.tools.vlm_fixtures import TINY_VLMS, build_tiny_vlm  # noqa: E402

GRAPHS = ("prefill.onnx", "decode.onnx")
# One worker takes every test here: each checkpoint is made once.
pytestmark = pytest.mark.xdist_group("vision-streaming")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """checkpoint(family) -> its tiny folder; LLaVA's text model with 4 layers, so its streamed export stamps them."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            recipe = dict(TINY_VLMS[family])
            if family == "llava":
                recipe["text_config"] = {**recipe.get("text_config", {}), "num_hidden_layers": 4}
            with pytest.MonkeyPatch.context() as patch:
                patch.setitem(TINY_VLMS, family, recipe)
                folder = tmp_path_factory.mktemp("vlm-stream") / family
                build_tiny_vlm(family, folder)
            made[family] = folder
        return made[family]

    return get


def _initializers(folder: Path, graph: str) -> dict[str, np.ndarray]:
    import onnx_ir as ir

    return {name: value.const_value.numpy() for name, value in ir.load(folder / graph).graph.initializers.items()}


def _image():
    from PIL import Image

    return Image.fromarray((np.random.RandomState(3).rand(70, 90, 3) * 255).astype(np.uint8))


def _export_both(source: Path, root: Path, **options) -> list[str]:
    """Export `source` streamed (root/streamed) and loaded whole (root/whole); what the streamed export said."""
    from kvforge.exporter.export import export_model

    said: list[str] = []
    export_model(source, root / "streamed", progress=said.append, **options)
    export_model(source, root / "whole", stream=False, **options)
    return said


def _same_graphs(root: Path, graphs: tuple[str, ...]) -> None:
    import onnx_ir as ir

    for graph in graphs:
        ours, theirs = ir.load(root / "streamed" / graph).graph, ir.load(root / "whole" / graph).graph
        assert Counter(n.op_type for n in ours) == Counter(n.op_type for n in theirs), graph
        assert [v.name for v in ours.inputs] == [v.name for v in theirs.inputs], graph
        assert [v.name for v in ours.outputs] == [v.name for v in theirs.outputs], graph
        mine, whole = _initializers(root / "streamed", graph), _initializers(root / "whole", graph)
        named = {name for name in mine if not name.startswith("val_")}  # torch.onnx's numbered constants: by value
        assert named == {name for name in whole if not name.startswith("val_")}, graph
        assert all(np.array_equal(mine[name], whole[name]) for name in named), graph
        assert sorted(a.tobytes() for a in mine.values()) == sorted(a.tobytes() for a in whole.values()), graph


@pytest.mark.parametrize("family", ["llava", "qwen2_5_vl"])
def test_a_vision_exports_text_graphs_stream_and_equal_the_whole_models(checkpoint, tmp_path, family):
    from kvforge.runtime import Generator

    said = _export_both(checkpoint(family), tmp_path)
    assert any(line.startswith("streaming ") for line in said), said
    assert not any(line.startswith("loading the whole model") for line in said), said
    if family == "llava":  # its alike layers: two traced, the others stamped, with the image features' input
        assert any(line.startswith("tracing 2 of the 4 alike layers") for line in said), said
    _same_graphs(tmp_path, (*GRAPHS, "vision.onnx"))
    prompt = "Look at <image> and say"
    outs = [Generator(tmp_path / name).generate(prompt, images=[_image()], max_new_tokens=12, greedy=True,
                                                ignore_eos=True) for name in ("streamed", "whole")]
    assert outs[0].tokens == outs[1].tokens


def test_text_only_of_a_vision_checkpoint_streams(checkpoint, tmp_path):
    from kvforge.runtime import Generator

    said = _export_both(checkpoint("llava"), tmp_path, text_only=True)
    assert any(line.startswith("streaming ") for line in said), said
    assert not (tmp_path / "streamed" / "vision.onnx").exists()
    _same_graphs(tmp_path, GRAPHS)
    prompts = [[1, 50, 60, 70, 80], [1, 33, 44]]
    outs = [Generator(tmp_path / name).generate(prompts, max_new_tokens=12, greedy=True, ignore_eos=True)
            for name in ("streamed", "whole")]
    assert outs[0].tokens == outs[1].tokens


def test_int4_text_graphs_of_a_vision_export_stream(checkpoint, tmp_path):
    said = _export_both(checkpoint("llava"), tmp_path, quantize="int4", quant_method="rtn")
    assert any(line.startswith("streaming ") for line in said), said
    _same_graphs(tmp_path, GRAPHS)


def test_the_text_view_holds_the_text_model_alone(checkpoint):
    from kvforge.exporter.checkpoint import open_checkpoint
    from kvforge.exporter.load import load_hf_config
    from kvforge.exporter.text_stream import text_checkpoint

    folder = checkpoint("llava")
    full = open_checkpoint(folder)
    config, view, cls = text_checkpoint(load_hf_config(folder), full)
    assert cls.__name__ == "LlamaForCausalLM" and config.tie_word_embeddings is False
    assert "model.embed_tokens.weight" in view and "lm_head.weight" in view
    assert view.original["model.layers.3.mlp.down_proj.weight"] == "language_model.model.layers.3.mlp.down_proj.weight"
    assert not any("vision" in name or "projector" in name for name in view.original.values())
    towers = [name for name in full.names if not name.startswith("language_model.")]
    assert towers and len(view) == len(full) - len(towers)
    assert view.nbytes < full.nbytes
    assert torch.equal(view.read("model.norm.weight"), full.read("language_model.model.norm.weight"))
    with pytest.raises(KeyError, match="not a tensor of the text model"):
        view.info("multi_modal_projector.linear_1.weight")
