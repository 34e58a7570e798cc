"""The runtime stands alone: importing it (and loading an export) pulls in no exporter stack."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("torch", "transformers", "onnx", "onnxscript", "onnx_ir", "safetensors")


def imported_forbidden(code: str) -> list[str]:
    probe = (
        f"import sys\n{code}\nimport json\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(FORBIDDEN)!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_runtime_pulls_no_exporter_stack() -> None:
    assert imported_forbidden("import kvforge.runtime\nfrom kvforge.runtime import Generator") == []


def test_probe_detects_a_forbidden_import() -> None:
    # The probe itself must be able to fail.
    assert imported_forbidden("import onnx") == ["onnx"]


def test_running_an_export_pulls_no_exporter_stack(tmp_path) -> None:
    # Build the toy export in this process (that needs onnx), then generate in a clean one.
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    try:
        from test_runtime_toy_export import build_export
    finally:
        sys.path.pop(0)
    build_export(tmp_path / "toy")
    code = (
        "from kvforge.runtime import Generator\n"
        f"result = Generator({str(tmp_path / 'toy')!r}).generate('w5 w6', max_new_tokens=3)\n"
        "assert len(result.tokens[0]) >= 1"
    )
    assert imported_forbidden(code) == []
