"""KVFORGE_WEIGHT_HASHES=FILE: every in-process export of the run that quantises appends its weights file's sha256
to FILE.<worker>.jsonl, keyed by where it was written. A refactor that must not move a quantised weight records
them before and after (`python tests/weight_hashes.py compare BEFORE AFTER`); CLI exports in a subprocess are not
seen."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any


def _key(out_dir: Path) -> str:
    """The export's folder below the run's temporary root, with pytest's counters and worker folders dropped."""
    parts = [re.sub(r"\d+$", "", part) for part in out_dir.parts if not re.fullmatch(r"popen-gw\d+|pytest-\d+", part)]
    tail = parts[-3:]
    return "/".join(tail)


def install() -> None:
    """Wrap export_model to record its quantised weights' hash (a no-op without KVFORGE_WEIGHT_HASHES)."""
    record = os.environ.get("KVFORGE_WEIGHT_HASHES")
    if not record:
        return
    from kvforge.exporter import export

    original = export.export_model
    log = Path(f"{record}.{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.jsonl")

    def recorded(model_dir: Any, out_dir: Any, *args: Any, **keywords: Any) -> dict[str, Any]:
        manifest = original(model_dir, out_dir, *args, **keywords)
        quantised = {k: manifest.get(k) for k in ("quantization", "kv_cache_quantization") if manifest.get(k)}
        draft = manifest.get("draft") or {}
        if quantised or draft.get("lm_head_bits"):
            digest = hashlib.sha256((Path(out_dir) / "model.weights").read_bytes()).hexdigest()
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0].split("/")[-1].split("@")[0]
            # what was asked, so that a fixture's several exports in one folder keep apart
            quant = manifest.get("quantization") or {}
            asked = "/".join(str(quant.get(k)) for k in ("bits", "quant_method", "lm_head_bits", "block_size",
                                                          "accuracy_level"))
            with log.open("a") as out:
                out.write(json.dumps({"key": f"{test}|{_key(Path(out_dir))}|{asked}", "sha256": digest}) + "\n")
        return manifest

    export.export_model = recorded


def _read(prefix: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for path in Path(prefix).parent.glob(f"{Path(prefix).name}.*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            found.setdefault(row["key"], []).append(row["sha256"])
    return {key: sorted(values) for key, values in found.items()}


if __name__ == "__main__":  # compare BEFORE AFTER: exit 1 where an export both runs made differs
    before, after = _read(sys.argv[2]), _read(sys.argv[3])
    both = sorted(set(before) & set(after))
    differ = [key for key in both if before[key] != after[key]]
    print(json.dumps({"before": len(before), "after": len(after), "compared": len(both), "differ": differ,
                      "only_before": sorted(set(before) - set(after))}, indent=1))
    sys.exit(1 if differ else 0)
