"""README's and docs/models.md's coverage table, rendered from kvforge/data/coverage.json."""

from __future__ import annotations

from typing import Any

from kvforge.models.coverage_data import load_coverage
from kvforge.tools.coverage_fixtures import SWEEP_TARGETS


def coverage_table(coverage: dict[str, Any] | None = None) -> str:
    """README's coverage table, from coverage.json."""
    coverage = coverage or load_coverage()
    rows = coverage["types"]
    passing = sorted(t for t, r in rows.items() if r["status"] == "pass")
    refused = sorted(t for t, r in rows.items() if r["status"] == "refused")
    scope = sorted(t for t, r in rows.items() if r["status"] == "out of scope")
    lines = [f"{len(passing)} model types pass, {len(refused)} are refused, {len(scope)} are out of scope "
             f"(transformers {coverage.get('transformers', '?')}, {len(rows)} causal-LM and multimodal types).", "",
             "| model_type | " + " | ".join(f"`{t}`" for t in SWEEP_TARGETS)
             + " | TensorRT-RTX build | max logit error | real layer shape (hidden, heads, MLP) |",
             "|---|" + "---|" * len(SWEEP_TARGETS) + "---|---|---|"]
    def cell(result: dict[str, Any] | None) -> str:
        return {"pass": "✓", "fail": "✗"}.get(result["status"], "–") if result else "–"

    def real(summary: dict[str, Any] | None) -> str:
        if not summary:
            return "not run"
        if summary["status"] == "pass":
            return f"✓ {summary['shape']}"
        if summary["status"] == "unbuilt":
            return f"– transformers cannot build the default config: {summary['shape']}"
        marks = {"pass": "✓", "fail": "✗", "memory": "out of memory here"}
        per_target = ", ".join(f"{marks[kind]} `{target}`" if target != "all" else marks[kind]
                               for target, kind in summary["targets"].items())
        return f"{per_target}: {summary['shape']}"

    def rtx(entry: dict[str, Any] | None) -> str:
        return {"built": "✓", "fail": "✗", "refused": "refused"}.get(entry["status"], "–") if entry else "not run"

    for name in passing:
        targets = rows[name]["targets"]
        error = max(targets[t]["max_abs_err"] for t in targets if targets[t]["status"] == "pass")
        lines.append(f"| `{name}` | " + " | ".join(cell(targets.get(t)) for t in SWEEP_TARGETS)
                     + f" | {rtx(rows[name].get('rtx'))} | {error:.1e} | {real(rows[name].get('real'))} |")
    # What the RTX column's marks mean: engines built from the tiny `onnx` export (not run: that needs an RTX GPU).
    unbuilt = {rows[name]["rtx"]["error"]: [] for name in passing
               if rows[name].get("rtx", {}).get("status") in ("fail", "refused")}
    for name in passing:
        if rows[name].get("rtx", {}).get("error") in unbuilt:
            unbuilt[rows[name]["rtx"]["error"]].append(f"`{name}`")
    lines += ["", "TensorRT-RTX build: TensorRT for RTX's engines (prefill and decode, fp32, batch 2, 64 positions) "
                  "built on this CPU from the type's tiny `onnx` export; built, not run (that needs an RTX GPU)."]
    if unbuilt:
        lines += ["", "| Not built with TensorRT-RTX | Why |", "|---|---|"]
        lines += [f"| {', '.join(names)} | {why} |" for why, names in unbuilt.items()]
    if any(rows[name]["targets"].get("trt", {}).get("status") == "untested" for name in passing):
        lines += ["", "–: not tested on `trt` at the sweep's size (its head size is outside the kernel's; "
                      "`--target trt` checks each model's own at export)."]
    trt_refused = [name for name in passing if rows[name].get("trt_reason")]
    if trt_refused:
        lines += ["", "| Passes, but refused on `trt` | Why |", "|---|---|"]
        lines += [f"| `{name}` | {rows[name]['trt_reason']} |" for name in trt_refused]
    lines += ["", "| Refused model_type | Why |", "|---|---|"]
    lines += [f"| `{name}` | {rows[name]['reason']} |" for name in refused]
    lines += ["", "| Out of scope | Why |", "|---|---|"]
    by_reason: dict[str, list[str]] = {}
    for name in scope:
        by_reason.setdefault(rows[name]["reason"], []).append(f"`{name}`")
    lines += [f"| {', '.join(names)} | {reason} |" for reason, names in by_reason.items()]
    return "\n".join(lines)
