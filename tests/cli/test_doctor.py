"""`kvforge doctor`: what this machine can run and why not, on this CPU machine and on described GPU machines."""

from __future__ import annotations

import json

from click.testing import CliRunner

from kvforge.cli import main
from kvforge.tools import doctor

H100 = {"index": 0, "name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0", "memory_mib": 81559,
        "driver": "580.159.04"}


def _report(gpus, providers, cuda_session, tensorrt, device=None) -> dict:
    report = {"gpus": gpus, "gpu_problem": None if gpus else "CUDA reports no GPU", "gpu_device": device,
              "onnxruntime": {"version": "1.31.1", "providers": providers, "cuda_session": cuda_session},
              "tensorrt": tensorrt}
    report["backends"] = doctor.backend_verdicts(report)
    return report


def test_this_machine_runs_the_cpu_backends_and_says_why_not_the_gpu_ones() -> None:
    result = CliRunner().invoke(main, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["backends"]["ort-cpu"] == {"runs_here": True, "reason": None}
    assert set(report["backends"]) == {"ort-cpu", "ort-cuda", "emulate", "tensorrt"}
    if not report["gpus"]:  # CI: no GPU, so neither GPU backend runs, each with its reason
        assert not report["backends"]["ort-cuda"]["runs_here"] and report["backends"]["ort-cuda"]["reason"]
        assert report["backends"]["tensorrt"]["reason"]
    assert report["onnxruntime"]["version"] and "CPUExecutionProvider" in report["onnxruntime"]["providers"]
    text = CliRunner().invoke(main, ["doctor"]).output
    assert "backends:" in text and "ort-cpu" in text and "onnxruntime" in text


def test_an_h100_with_onnxruntime_gpu_and_tensorrt_rtx() -> None:
    rtx = {"tensorrt": {"installed": False, "runs_here": False, "run_reason": "not installed"},
           "tensorrt-rtx": {"installed": True, "version": "1.7.1.116", "builds_here": True, "runs_here": False,
                            "run_reason": "TensorRT-RTX engines cannot run on NVIDIA H100 80GB HBM3 (compute "
                                          "capability 9.0): ..."}}
    report = _report([H100], ["CUDAExecutionProvider", "CPUExecutionProvider"], "ok", rtx)
    assert report["backends"]["ort-cuda"]["runs_here"]
    assert not report["backends"]["tensorrt"]["runs_here"]
    assert "compute capability 9.0" in report["backends"]["tensorrt"]["reason"]
    text = doctor.format_report({**report, "kvforge": "0", "cuda_runtime": "13.0", "cuda_libraries": {"cudart": "/x"}})
    assert "NVIDIA H100 80GB HBM3 (compute capability 9.0, 81559 MiB, driver 580.159.04)" in text
    assert "tensorrt-rtx 1.7.1.116: builds here; cannot run here" in text


def test_ort_cuda_reasons_in_the_order_a_user_fixes_them() -> None:
    none = {"tensorrt": {"installed": False, "runs_here": False, "run_reason": "no GPU"},
            "tensorrt-rtx": {"installed": False, "runs_here": False, "run_reason": "no GPU"}}
    cpu_ort = _report([H100], ["CPUExecutionProvider"], None, none)["backends"]["ort-cuda"]
    assert "pip install onnxruntime-gpu" in cpu_ort["reason"]
    no_gpu = _report([], ["CUDAExecutionProvider", "CPUExecutionProvider"], "not tried: no GPU", none)
    assert no_gpu["backends"]["ort-cuda"]["reason"] == "no GPU (CUDA reports no GPU)"
    fallback = _report([H100], ["CUDAExecutionProvider"], "fell back to CPUExecutionProvider (a CUDA library ONNX "
                       "Runtime needs did not load)", none)["backends"]["ort-cuda"]
    assert fallback["reason"].startswith("a CUDA session does not start: fell back")
    assert "TensorRT is not installed" in _report([H100], [], None, none)["backends"]["tensorrt"]["reason"]
    # No GPU and a CPU onnxruntime: the missing GPU is the reason, not a package to install (issue 43, 22).
    cpu_only = _report([], ["CPUExecutionProvider"], None, none)["backends"]["ort-cuda"]["reason"]
    assert cpu_only == "no GPU (CUDA reports no GPU)"


def test_tensorrt_info_judges_each_flavour_against_the_gpu(monkeypatch) -> None:
    from kvforge.core import tensorrt_flavor

    monkeypatch.setattr(tensorrt_flavor, "installed_flavors", lambda: [])
    info = doctor.tensorrt_info({"name": "NVIDIA L40S", "compute_capability": "8.9"})
    assert info["tensorrt-rtx"] == {"installed": False, "runs_here": False, "run_reason": "not installed"}
    info = doctor.tensorrt_info({"name": "NVIDIA H200", "compute_capability": "9.0"})
    assert "cannot run on NVIDIA H200" in info["tensorrt-rtx"]["run_reason"]


def test_the_probe_model_is_a_valid_onnx_model() -> None:
    import numpy as np
    import onnxruntime as ort

    session = ort.InferenceSession(doctor.PROBE_MODEL, providers=["CPUExecutionProvider"])
    assert session.run(None, {"x": np.array([3.5], np.float32)})[0].tolist() == [3.5]


def test_onnxruntime_gpu_is_suggested_only_where_a_gpu_is_seen(monkeypatch, tmp_path) -> None:
    # doctor told a machine without a GPU to install onnxruntime-gpu (issue 43, 22). Where nothing describes a
    # GPU, /dev/nvidia0 still shows one (a container without nvidia-smi or cuda-python): then the package helps.
    none = {"tensorrt": {"installed": False, "runs_here": False, "run_reason": "no GPU"},
            "tensorrt-rtx": {"installed": False, "runs_here": False, "run_reason": "no GPU"}}
    cpu_ort = ["CPUExecutionProvider"]
    device = _report([], cpu_ort, None, none, device="/dev/nvidia0")["backends"]["ort-cuda"]["reason"]
    assert device == "this onnxruntime has no CUDAExecutionProvider: pip install onnxruntime-gpu (in place of onnxruntime)"
    gpu_ort = _report([], ["CUDAExecutionProvider", *cpu_ort], "not tried: no GPU", none, device="/dev/nvidia0")
    assert gpu_ort["backends"]["ort-cuda"]["reason"] == ("/dev/nvidia0 is there, but no GPU could be described "
                                                        "(CUDA reports no GPU)")
    # The whole command on this machine's onnxruntime, told there is no GPU tool and no device, then a device.
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        return  # an onnxruntime-gpu machine: the package is already there
    monkeypatch.setattr(doctor, "gpus", lambda: ([], "no nvidia-smi on PATH and no cuda-python to ask"))
    monkeypatch.setattr(doctor, "GPU_DEVICE", tmp_path / "nvidia0")
    text = CliRunner().invoke(main, ["doctor"]).output
    assert "gpu:       none (no nvidia-smi on PATH and no cuda-python to ask)\n" in text
    assert "ort-cuda  no: no GPU (no nvidia-smi on PATH and no cuda-python to ask)\n" in text
    assert "onnxruntime-gpu" not in text
    (tmp_path / "nvidia0").touch()
    text = CliRunner().invoke(main, ["doctor"]).output
    assert f"gpu:       none (no nvidia-smi on PATH and no cuda-python to ask; {tmp_path / 'nvidia0'} is there)" in text
    assert "ort-cuda  no: this onnxruntime has no CUDAExecutionProvider: pip install onnxruntime-gpu" in text
