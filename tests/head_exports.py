"""Speculation-head exports shared by the test files (built once per run through tests/conftest.py's fixtures
`eagle_export`, `eagle_plain` and `mtp_export`; read-only to the tests): EAGLE-3 targets (the recipes' configs with
LAYERS layers, seeded random weights) with seeded random heads in speculators' form (Llama, explicit aux ids) and
EAGLE's form (Qwen3, the default aux ids), and tiny MTP checkpoints (models/mtp_fixture.py) per family.
Used by tests/exporter/test_eagle3_export.py, tests/exporter/test_mtp_export.py, tests/runtime/test_head_runtime.py and
tests/runtime/test_head_speculation.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

LAYERS = 8  # EAGLE's default aux layers (2, L // 2, L - 3) are distinct from 7 layers on
EAGLE_FORMS = {"llama-tiny": "speculators", "qwen3-tiny": "eagle"}
SPECULATORS_AUX = [1, 3, 6]  # speculators' form names its aux layers; EAGLE's takes the default (2, 4, 5)
MTP_FAMILIES = ("deepseek_v3", "glm4_moe", "qwen3_next")


def make_eagle_target(recipe: str, root: Path) -> None:
    """root/hf: the recipe's model with LAYERS layers; root/head: its random EAGLE-3 head (EAGLE_FORMS[recipe])."""
    import torch
    import transformers

    from kvforge.models.eagle3_checkpoint import write_random_head
    from kvforge.models.recipes import get_recipe

    spec = get_recipe(recipe)
    config = transformers.AutoConfig.for_model(spec.model_type, **{**spec.config, "num_hidden_layers": LAYERS})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(root / "hf")
    form = EAGLE_FORMS[recipe]
    write_random_head(root / "hf", root / "head", form=form, draft_vocab_size=96, seed=5,
                      aux_layer_ids=SPECULATORS_AUX if form == "speculators" else None,
                      norm_before_residual=form == "speculators")


def mtp_registry(folder: Path) -> Any:
    """The families registry that exports the tiny checkpoint at `folder` (its type's trial family)."""
    import transformers

    from kvforge.models.families import trial_registry

    config = transformers.AutoConfig.from_pretrained(folder)
    return trial_registry(config.model_type, config.architectures[0], config)


def make_mtp_export(family: str, root: Path) -> None:
    """root/hf: the family's tiny seeded checkpoint with one seeded MTP layer added; root/mtp: its ort export."""
    from kvforge.exporter.export import export_model
    from kvforge.models.mtp_fixture import add_mtp_layers
    from kvforge.tools.coverage_fixtures import build_tiny

    build_tiny(family, root / "hf")
    add_mtp_layers(root / "hf", seed=7)
    export_model(root / "hf", root / "mtp", target="ort", families=mtp_registry(root / "hf"))


def load_hf(folder: Path) -> Any:
    """The HF model saved at `folder`, in fp32 eval mode (the tests' torch reference)."""
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def one_thread_session(path: Path) -> Any:
    """An ONNX Runtime CPU session of the graph at `path`, one intra-op thread."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class BoundHead:
    """An export's draft.onnx with its KV cache of `capacity` positions bound in place (past and present one
    OrtValue), as the runtime binds it; called per step: (past, tokens, target_hidden, draft_hidden) -> (logits,
    hidden_out, token_map) of the one row."""

    def __init__(self, folder: Path, capacity: int) -> None:
        import numpy as np
        import onnxruntime as ort

        from kvforge.core.manifest import load_manifest

        self.session = one_thread_session(folder / "draft.onnx")
        self.record = load_manifest(folder)["draft"]  # the record and graph checked as the runtime loads them
        cache = self.record["kv_cache"]
        shape = [1, cache["num_kv_heads"], capacity, cache["head_dim"]]
        self.cache = {kind: ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, np.float32)) for kind in ("key", "value")}

    def __call__(self, past: int, tokens: list[int], target: Any, draft: Any) -> tuple[Any, Any, Any]:
        import numpy as np

        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", np.array([tokens], np.int64))
        binding.bind_cpu_input("target_hidden", np.ascontiguousarray(target[None], np.float32))
        binding.bind_cpu_input("draft_hidden", np.ascontiguousarray(draft[None], np.float32))
        binding.bind_cpu_input("past_lens", np.array([past], np.int32))
        for name in ("logits", "hidden_out", "token_map"):  # bound first: copy_outputs_to_cpu keeps binding order
            binding.bind_output(name, "cpu")
        for kind, value in self.cache.items():
            binding.bind_ortvalue_input(f"past_{kind}.0", value)
            binding.bind_ortvalue_output(f"present_{kind}.0", value)
        self.session.run_with_iobinding(binding)
        logits, hidden, token_map = binding.copy_outputs_to_cpu()[:3]
        return logits[0], hidden[0], token_map
