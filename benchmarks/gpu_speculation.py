"""benchmarks/gpu_check.py's `speculation` section: the draft-model and EAGLE-3 paths on the GPU backend, each
against plain greedy decoding on the same backend (same tokens), and the head's first drafts against the same
export run on the CPU (parity of the head graph on the device).

    python benchmarks/gpu_check.py --only speculation --work .gpu/work --out $OUT     # ort-cuda
    python benchmarks/gpu_check.py --only speculation --backend ort-cpu                # the script's own test

The exports are made in --prepare-only (or on first use): llama-tiny fp16 as the target, its int4 fp16 export
(MatMulNBits on CUDA) as the draft, and a 4-layer llama-tiny with a random speculators-form EAGLE-3 head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

PROMPTS = [[1, 17, 230, 41, 9, 77, 12], [1, 5, 6, 7, 8, 9, 10, 11]]


def draft_export(work: Path, target_hf: Path, dtype: str) -> Path:
    """llama-tiny's int4 export (the draft of self-speculation by quantisation), made when missing."""
    from kvforge.exporter.export import export_model

    folder = work / "exports" / f"llama-tiny-int4-{dtype}"
    if not (folder / "kvforge.json").is_file():
        export_model(target_hf, folder, target="ort", dtype=dtype, quantize="int4", force=True)
    return folder


def eagle_export(work: Path, dtype: str) -> Path:
    """A 4-layer llama-tiny with a random EAGLE-3 head (speculators' form), exported with it, made when missing."""
    import torch
    import transformers

    from kvforge.exporter.export import export_model
    from kvforge.models.eagle3_checkpoint import write_random_head
    from kvforge.models.recipes import get_recipe

    root = work / "eagle3"
    folder = root / f"ort-{dtype}"
    if (folder / "kvforge.json").is_file():
        return folder
    spec = get_recipe("llama-tiny")
    config = transformers.AutoConfig.for_model(spec.model_type, **{**spec.config, "num_hidden_layers": 4})
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).eval().save_pretrained(root / "hf")
    write_random_head(root / "hf", root / "head", draft_vocab_size=96, aux_layer_ids=[0, 1, 3], seed=5)
    export_model(root / "hf", folder, target="ort", dtype=dtype, eagle=root / "head", force=True)
    return folder


def _same(generator: Any, method: str, draft_len: int = 4) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for i, prompt in enumerate(PROMPTS):
        plain = generator.generate([prompt], max_new_tokens=24, greedy=True, ignore_eos=True)
        spec = generator.generate([prompt], max_new_tokens=24, greedy=True, ignore_eos=True, speculate=method,
                                  draft_len=draft_len)
        out[f"prompt{i}"] = {"same_tokens": spec.tokens == plain.tokens,
                             "accepted": f"{spec.accepted_tokens}/{spec.draft_tokens}", "steps": spec.steps}
    return out


def _head_parity(folder: Path, backend: str) -> float:
    """Largest difference between the head's logits on `backend` and on ort-cpu for the same chain of drafts
    (one prompt's catch-up, then chained positions), through the head proposer's own runner."""
    import numpy as np

    from kvforge.runtime import LoadedExport
    from kvforge.runtime.drivers.head_proposer import export_head

    outs = []
    for name in (backend, "ort-cpu"):
        export = LoadedExport(folder, name)
        runner = export_head(export, "eagle")
        slot = runner.allocate(1, 64)
        dt, h = runner.target_width, runner.width
        rng = np.random.default_rng(0)
        hidden = rng.standard_normal((1, 7, dt)).astype(np.float32)
        ids = np.array([PROMPTS[0][1:] + [3]], dtype=np.int64)
        logits, out = runner.run(slot, ids, hidden, np.zeros((1, 7, h), np.float32), np.array([0], np.int32))
        chain = [np.array(logits, dtype=np.float32)]
        logits, out = runner.run(slot, np.array([[5]], np.int64), np.zeros((1, 1, dt), np.float32),
                                 np.asarray(out)[:, -1:].astype(np.float32), np.array([7], np.int32))
        chain.append(np.array(logits, dtype=np.float32))
        outs.append(chain)
    return float(max(np.abs(a - b).max() for a, b in zip(*outs, strict=True)))


def speculation(run: Any, backend: str, hf_folder: Any, export: Any) -> dict[str, Any]:
    """The section: `hf_folder(run, recipe)` and `export(run, recipe, target, dtype)` are gpu_check.py's."""
    from kvforge.runtime import Generator

    dtype = "fp16" if backend == "ort-cuda" else "fp32"
    target = export(run, "llama-tiny", "ort", dtype)
    draft = draft_export(run.work, hf_folder(run, "llama-tiny"), dtype)
    result: dict[str, Any] = {"draft": _same(Generator(target, backend=backend, draft=draft), "draft")}
    eagle = eagle_export(run.work, dtype)
    result["eagle"] = _same(Generator(eagle, backend=backend), "eagle")
    result["eagle_head_max_abs_diff_vs_cpu"] = _head_parity(eagle, backend)
    same = all(p["same_tokens"] for key in ("draft", "eagle") for p in result[key].values())
    # fp16 on the device against the CPU's run of the same fp16 graph: half-precision rounding, not a bug
    result["passed"] = same and result["eagle_head_max_abs_diff_vs_cpu"] < (2e-2 if dtype == "fp16" else 1e-4)
    return result
