"""`kvforge doctor`: what this machine can run, and why not.

It reports the GPUs (name, compute capability, memory, driver) and the CUDA runtime, the CUDA
libraries the dynamic loader finds, ONNX Runtime's version and execution providers (and whether a
session really lands on CUDA), each installed TensorRT flavour (can it build here, can it run here),
and for every backend of the registry: runs here, or the one reason it does not.

Nothing here needs a GPU or imports torch; every probe that fails is reported, never raised.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from kvforge.core.errors import KvforgeError

# A one-node ONNX model (Identity, float[1]; ir 8, opset 13): what `onnx.helper` writes for it. A session
# over it shows whether ONNX Runtime's CUDA provider really loads (it falls back to the CPU, with a
# warning, when a CUDA library is missing) without needing the onnx package.
PROBE_MODEL = (b'\x08\x08:;\n\x10\n\x01x\x12\x01y"\x08Identity\x12\x05probeZ\x0f\n\x01x\x12\n\n\x08\x08\x01\x12\x04'
               b'\n\x02\x08\x01b\x0f\n\x01y\x12\n\n\x08\x08\x01\x12\x04\n\x02\x08\x01B\x04\n\x00\x10\r')
# The shared libraries the GPU backends load by name (onnxruntime-gpu: CUDA 12 or 13 builds).
CUDA_LIBRARIES = {
    "cudart": ("libcudart.so.13", "libcudart.so.12"),
    "cublas": ("libcublas.so.13", "libcublas.so.12"),
    "cublasLt": ("libcublasLt.so.13", "libcublasLt.so.12"),
    "cudnn": ("libcudnn.so.9",),
    "nvrtc": ("libnvrtc.so.13", "libnvrtc.so.12"),
    "tensorrt": ("libnvinfer.so.10",),
    "tensorrt-rtx": ("libtensorrt_rtx.so.1",),
}


# NVIDIA's driver makes this device for the first GPU whatever tools are installed: a GPU is seen through it
# where neither nvidia-smi nor cuda-python can describe one (a container without them).
GPU_DEVICE = Path("/dev/nvidia0")


def _library_dirs() -> list[Path]:
    """Where the dynamic loader looks, plus the lib folders of pip's nvidia-* packages."""
    dirs = [Path(d) for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    spec = importlib.util.find_spec("nvidia")
    if spec is not None and spec.submodule_search_locations:
        for root in spec.submodule_search_locations:
            dirs += sorted(Path(root).glob("*/lib"))
    for module in ("tensorrt_libs", "tensorrt_rtx_libs", "tensorrt_rtx"):
        found = importlib.util.find_spec(module)
        if found is not None and found.submodule_search_locations:
            dirs += [Path(p) for p in found.submodule_search_locations]
    dirs += [Path(p) for p in ("/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/local/nvidia/lib64",
                               "/usr/lib64")]
    return dirs


def _ldconfig() -> dict[str, str]:
    ldconfig = shutil.which("ldconfig") or "/sbin/ldconfig"
    try:
        out = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found = {}
    for line in out.splitlines():
        name, _, path = line.strip().partition(" => ")
        if path:
            found.setdefault(name.split(" ")[0], path)
    return found


def cuda_libraries() -> dict[str, str | None]:
    """Each library's path where one of its names is found, else None."""
    dirs, cached = _library_dirs(), _ldconfig()
    out: dict[str, str | None] = {}
    for label, names in CUDA_LIBRARIES.items():
        out[label] = next((str(d / n) for n in names for d in dirs if (d / n).exists()),
                          next((cached[n] for n in names if n in cached), None))
    return out


def gpus() -> tuple[list[dict[str, Any]], str | None]:
    """The GPUs (index, name, compute capability, memory, driver) from nvidia-smi, else cuda-python;
    and why there are none, when there are none."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        query = "index,name,compute_cap,memory.total,driver_version"
        try:
            out = subprocess.run([smi, f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError) as err:
            return [], f"nvidia-smi failed: {err}"
        if out.returncode == 0:
            rows = [[part.strip() for part in line.split(",")] for line in out.stdout.splitlines() if line.strip()]
            return [{"index": int(r[0]), "name": r[1], "compute_capability": r[2], "memory_mib": int(float(r[3])),
                     "driver": r[4]} for r in rows if len(r) == 5], None
        return [], f"nvidia-smi: {' '.join((out.stderr or out.stdout).split())[:200]}"
    try:
        from kvforge.core import cuda

        count = cuda.device_count()
        return [{"index": i, **cuda.device_info(i)} for i in range(count)], None if count else "CUDA reports no GPU"
    except KvforgeError:
        return [], "no nvidia-smi on PATH and no cuda-python to ask"


def cuda_runtime() -> str | None:
    """The CUDA runtime's version, through cuda-python, or None."""
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    status, version = runtime.cudaRuntimeGetVersion()
    if status != runtime.cudaError_t.cudaSuccess:
        return None
    return f"{version // 1000}.{version % 1000 // 10}"


def onnxruntime_info(have_gpu: bool) -> dict[str, Any]:
    import onnxruntime as ort

    info: dict[str, Any] = {"version": ort.__version__, "providers": ort.get_available_providers(),
                            "cuda_session": None}
    if "CUDAExecutionProvider" in info["providers"]:
        if not have_gpu:
            info["cuda_session"] = "not tried: no GPU"
        else:
            options = ort.SessionOptions()
            options.log_severity_level = 4
            try:
                session = ort.InferenceSession(PROBE_MODEL, options, providers=["CUDAExecutionProvider"])
                landed = session.get_providers()[0]
                info["cuda_session"] = "ok" if landed == "CUDAExecutionProvider" else \
                    f"fell back to {landed} (a CUDA library ONNX Runtime needs did not load)"
            except Exception as err:  # onnxruntime's own error types
                info["cuda_session"] = " ".join(str(err).split())[:300]
    return info


def tensorrt_info(gpu: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    from kvforge.core.tensorrt_flavor import FLAVORS, gpu_refusal, installed_flavors, load_tensorrt

    out: dict[str, dict[str, Any]] = {}
    found = installed_flavors()
    for flavor in FLAVORS:
        entry: dict[str, Any] = {"installed": flavor in found}
        if flavor in found:
            try:
                trt = load_tensorrt(flavor)
                entry["version"] = trt.version
                entry["builds_here"] = trt.builds_without_gpu or gpu is not None
                if not entry["builds_here"]:
                    entry["build_reason"] = "standard TensorRT builds on the GPU it builds for; there is none"
            except KvforgeError as err:
                entry.update(version=None, builds_here=False, build_reason=str(err))
        if gpu is None:
            entry.update(runs_here=False, run_reason="no GPU")
        else:
            refusal = gpu_refusal(flavor, gpu)
            entry.update(runs_here=refusal is None and flavor in found, run_reason=refusal if refusal is not None
                         else (None if flavor in found else "not installed"))
        out[flavor] = entry
    return out


def backend_verdicts(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """For every registered backend: runs here (True) or the one-line reason it does not."""
    from kvforge.runtime.backends.backend import REGISTRY

    have = {name: importlib.util.find_spec(name) is not None
            for name in ("onnxruntime_extensions", "torch", "triton", "cuda")}
    gpu = report["gpus"][0] if report["gpus"] else None
    ort = report["onnxruntime"]
    reasons: dict[str, str | None] = {}
    reasons["ort-cpu"] = None
    device = report.get("gpu_device")
    if gpu is None and device is None:  # first: onnxruntime-gpu would not help a machine without a GPU
        reasons["ort-cuda"] = f"no GPU ({report['gpu_problem'] or 'none found'})"
    elif "CUDAExecutionProvider" not in ort["providers"]:
        reasons["ort-cuda"] = ("this onnxruntime has no CUDAExecutionProvider: pip install onnxruntime-gpu "
                               "(in place of onnxruntime)")
    elif gpu is None:
        reasons["ort-cuda"] = f"{device} is there, but no GPU could be described ({report['gpu_problem']})"
    elif ort["cuda_session"] != "ok":
        reasons["ort-cuda"] = f"a CUDA session does not start: {ort['cuda_session']}"
    else:
        reasons["ort-cuda"] = None
    reasons["emulate"] = None if have["onnxruntime_extensions"] else \
        "needs onnxruntime-extensions: pip install -e '.[emulate]'"
    trt = report["tensorrt"]
    runnable = [flavor for flavor, entry in trt.items() if entry.get("runs_here")]
    if not any(entry["installed"] for entry in trt.values()):
        reasons["tensorrt"] = "TensorRT is not installed: pip install -e '.[trt]' on a GPU machine"
    elif gpu is None:
        reasons["tensorrt"] = "no GPU to run engines on"
    elif not runnable:
        reasons["tensorrt"] = "; ".join(e["run_reason"] for e in trt.values() if e["installed"] and e["run_reason"])
    elif not have["cuda"]:
        reasons["tensorrt"] = "needs cuda-python: pip install -e '.[trt]'"
    else:
        reasons["tensorrt"] = None
    verdicts = {}
    for name in REGISTRY:
        reason = reasons.get(name, "not probed by kvforge doctor")
        verdicts[name] = {"runs_here": reason is None, "reason": reason}
    if verdicts["ort-cuda"]["runs_here"] and not have["cuda"]:
        verdicts["ort-cuda"]["note"] = "serving (row copies on the GPU) needs cuda-python: pip install -e '.[gpu]'"
    if verdicts["emulate"]["runs_here"] and not (have["torch"] and have["triton"]):
        verdicts["emulate"]["note"] = "only --emulation reference (the Triton mode needs torch and triton)"
    return verdicts


def diagnose() -> dict[str, Any]:
    """Everything `kvforge doctor` prints, as data."""
    from kvforge.core import __version__

    found, problem = gpus()
    report: dict[str, Any] = {"kvforge": __version__, "gpus": found, "gpu_problem": problem,
                              "gpu_device": str(GPU_DEVICE) if GPU_DEVICE.exists() else None,
                              "cuda_runtime": cuda_runtime(), "cuda_libraries": cuda_libraries()}
    report["onnxruntime"] = onnxruntime_info(bool(found))
    report["tensorrt"] = tensorrt_info(found[0] if found else None)
    report["backends"] = backend_verdicts(report)
    return report


def format_report(report: dict[str, Any]) -> str:
    lines = [f"kvforge {report['kvforge']}"]
    if report["gpus"]:
        for gpu in report["gpus"]:
            memory = f", {gpu['memory_mib']} MiB" if "memory_mib" in gpu else ""
            driver = f", driver {gpu['driver']}" if "driver" in gpu else ""
            lines.append(f"gpu {gpu['index']}:     {gpu['name']} (compute capability {gpu['compute_capability']}"
                         f"{memory}{driver})")
    else:
        seen = f"; {report['gpu_device']} is there" if report.get("gpu_device") else ""
        lines.append(f"gpu:       none ({report['gpu_problem'] or 'none found'}{seen})")
    lines.append(f"cuda:      runtime {report['cuda_runtime'] or 'unknown (no cuda-python)'}")
    libraries = report["cuda_libraries"]
    lines.append("libraries: " + ", ".join(f"{name} {'found' if path else 'missing'}" for name, path in libraries.items()))
    ort = report["onnxruntime"]
    session = f"; CUDA session: {ort['cuda_session']}" if ort["cuda_session"] is not None else ""
    lines.append(f"onnxruntime {ort['version']}: {', '.join(ort['providers'])}{session}")
    for flavor, entry in report["tensorrt"].items():
        if not entry["installed"]:
            lines.append(f"{flavor}: not installed")
            continue
        build = "builds here" if entry.get("builds_here") else f"cannot build here ({entry.get('build_reason')})"
        run = "runs here" if entry["runs_here"] else f"cannot run here ({entry['run_reason']})"
        lines.append(f"{flavor} {entry.get('version')}: {build}; {run}")
    lines.append("backends:")
    width = max(map(len, report["backends"]))
    for name, verdict in report["backends"].items():
        state = "runs here" if verdict["runs_here"] else f"no: {verdict['reason']}"
        note = f" ({verdict['note']})" if verdict.get("note") else ""
        lines.append(f"  {name:<{width}}  {state}{note}")
    return "\n".join(lines)
