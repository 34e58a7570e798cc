"""int4 on a GPU (issue 44, 4): the int4 forms with fp16 activations, checked by `kvforge parity` on ONNX
Runtime CUDA.

    python benchmarks/gpu_int4.py --prepare-only --work .gpu/int4        # here, on the CPU: the exports
    python benchmarks/gpu_int4.py --work .gpu/int4 --out $OUT            # on the GPU machine

The exports (llama-tiny, fp16 activations, all made on the CPU): round to nearest (symmetric, no zero
points), AutoRound's calibrated integers (asymmetric: integer zero points), and an imported AutoRound
checkpoint in its GPTQ packing (the import path). Each is held to its fp32 reference (Hugging Face fp16
eager on the model the export traced) with `run_parity(..., backend="ort-cuda")`; the results go to
OUT/gpu_int4.json. `--backend ort-cpu` runs the same on the CPU (how this script is tested).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

CASES = ("rtn", "autoround", "import-gptq")


def prepare(work: Path) -> dict[str, str]:
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvforge.exporter.export import export_model
    from kvforge.models.recipes import materialize

    hf = work / "hf"
    if not (hf / "config.json").is_file():
        materialize("llama-tiny", hf, force=True)
    made = {}
    for case in ("rtn", "autoround"):
        folder = work / f"int4-{case}-fp16"
        if not (folder / "kvforge.json").is_file():
            export_model(hf, folder, quantize="int4", quant_method=case, dtype="fp16", force=True)
        made[case] = str(folder)
    checkpoint = work / "autoround-gptq"
    if not checkpoint.is_dir():
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(hf)
        AutoRound(model, tokenizer, scheme="W4A16", bits=4, group_size=32, sym=True, iters=20, nsamples=4, seqlen=64,
                  dataset=["the quick brown fox jumps over the lazy dog " * 16] * 4, batch_size=2, device_map="cpu",
                  enable_torch_compile=False).quantize_and_save(str(checkpoint), format="auto_round")
    source = next(p.parent for p in checkpoint.rglob("config.json"))
    folder = work / "int4-import-gptq-fp16"
    if not (folder / "kvforge.json").is_file():
        export_model(source, folder, dtype="fp16", force=True)
    made["import-gptq"] = str(folder)
    return made


def check(work: Path, backend: str) -> dict[str, Any]:
    from kvforge.core.manifest import load_manifest
    from kvforge.tools.parity import run_parity

    results = {}
    for case in CASES:
        folder = work / f"int4-{case}-fp16"
        began = time.perf_counter()
        try:
            reference = Path(load_manifest(folder)["model"]["source"])  # the model the export traced
            report = run_parity(reference, folder, new_tokens=32, backend=backend, perplexity_tokens=512)
            results[case] = {"passed": report.passed, "max_abs_err": round(float(report.max_abs_err), 4),
                             "perplexity": report.perplexity, "summary": report.summary().splitlines()[0]}
        except Exception as err:  # noqa: BLE001 - each case is recorded, the next one runs
            results[case] = {"error": f"{type(err).__name__}: {err}"}
        results[case]["seconds"] = round(time.perf_counter() - began, 1)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default=".gpu/int4")
    parser.add_argument("--out", default="gpu_int4_out")
    parser.add_argument("--prepare-only", action="store_true")
    parser.add_argument("--backend", default="ort-cuda", choices=["ort-cuda", "ort-cpu"])
    args = parser.parse_args()
    work = Path(args.work).absolute()
    work.mkdir(parents=True, exist_ok=True)
    if args.prepare_only:
        print(json.dumps(prepare(work), indent=2))
        return
    results = check(work, args.backend)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_int4.json").write_text(json.dumps({"backend": args.backend, "results": results}, indent=2, default=str))
    print(json.dumps({case: r.get("passed", r.get("error")) for case, r in results.items()}))


if __name__ == "__main__":
    main()
