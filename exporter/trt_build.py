"""`kvforge build`: an export folder's graphs -> TensorRT engines (prefill + decode, or one engine with two
profiles), written atomically into the engine folder with engines.json (runtime/engine_plan.py).

The `trt` target's attention is kvforge's plugin (registered before parsing, its PTX compiled for this
GPU); the `onnx` target's standard Attention + TensorScatter are imported natively by TensorRT >= 10.15.
Engines are reused when nothing they depend on changed (runtime/engine_plan.build_key).

Written against TensorRT's documented Python API (10.15+ and 11.x); not run here: no machine of this
project has had TensorRT. Everything it decides is plain data from engine_plan, tested on the CPU.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge import __version__
from kvforge.errors import BackendUnavailableError, ExportError, InputError
from kvforge.manifest import file_record, load_manifest, read_graph
from kvforge.output_folder import StagedFolder, check_output
from kvforge.runtime.engine_plan import (
    ENGINE_DIR_NAME,
    ENGINES_MANIFEST,
    TIMING_CACHE,
    BuildOptions,
    build_key,
    engine_layout,
    engines_manifest,
    profile_shapes,
    resolve_build_options,
)

MIN_TENSORRT = (10, 15)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".")[:2] if part.isdigit())


def require_tensorrt_and_gpu() -> tuple[Any, dict[str, str]]:
    """TensorRT's module and the GPU's {name, compute_capability}, or one clear error naming what is
    missing. Nothing is imported from TensorRT before this check."""
    missing = [name for name in ("tensorrt", "cuda") if importlib.util.find_spec(name) is None]
    if missing:
        names = {"tensorrt": "TensorRT's Python package (tensorrt)", "cuda": "cuda-python (cuda.bindings)"}
        raise BackendUnavailableError(
            f"kvforge build needs {' and '.join(names[m] for m in missing)}, not installed here: on a machine "
            "with an NVIDIA GPU, pip install 'kvforge[trt]' (TensorRT >= 10.15; see README, GPU machines)"
        )
    from kvforge.runtime import cuda

    if cuda.device_count() == 0:
        raise BackendUnavailableError("kvforge build needs an NVIDIA GPU to build for; CUDA reports none")
    import tensorrt as trt

    if _version_tuple(trt.__version__) < MIN_TENSORRT:
        raise BackendUnavailableError(
            f"kvforge build needs TensorRT >= {'.'.join(map(str, MIN_TENSORRT))} (its ONNX parser imports "
            f"Attention/TensorScatter and aliased plugin IO), found {trt.__version__}"
        )
    return trt, cuda.device_info(0)


def build_engines(
    export_dir: str | Path,
    engine_dir: str | Path | None = None,
    dtype: str | None = None,
    max_batch: int = 1,
    max_input_len: int | None = None,
    max_seq_len: int | None = None,
    single_engine: bool = False,
    force: bool = False,
    progress: Callable[[str], None] | None = None,
    plugin_shared_kib: int | None = None,
) -> dict[str, Any]:
    """Build (or reuse) the engines of an export folder; returns engines.json's content.
    `plugin_shared_kib` (trt target): cap the attention plugin's dynamic shared memory (e.g. 48)."""
    say = progress or (lambda _msg: None)
    export_dir = Path(export_dir)
    manifest = load_manifest(export_dir)
    options = resolve_build_options(manifest, dtype, max_batch, max_input_len, max_seq_len, single_engine,
                                    plugin_shared_kib)
    engine_dir = Path(engine_dir) if engine_dir is not None else export_dir / ENGINE_DIR_NAME
    if engine_dir.resolve() == export_dir.resolve() or engine_dir.resolve() in export_dir.resolve().parents:
        raise InputError(
            f"the engine folder {engine_dir} must not be the export folder or contain it (default "
            f"{export_dir / ENGINE_DIR_NAME})"
        )
    check_output(engine_dir, [], force=True, marker=ENGINES_MANIFEST, what="kvforge engine folder")
    trt, gpu = require_tensorrt_and_gpu()
    key = build_key(manifest, options, trt.__version__, gpu["compute_capability"], __version__)
    existing = _up_to_date(engine_dir, key)
    if existing is not None and not force:
        say(f"engines in {engine_dir} are up to date (same graphs, options, TensorRT and GPU); --force rebuilds")
        return existing
    if manifest["target"] == "trt":
        from kvforge.plugins import trt_plugin

        trt_plugin.register(max_shared_kib=options.plugin_shared_kib)
    started = time.perf_counter()
    timing = (engine_dir / TIMING_CACHE).read_bytes() if (engine_dir / TIMING_CACHE).is_file() else b""
    with StagedFolder(engine_dir, ENGINES_MANIFEST, what="kvforge engine folder", say=say) as staged:
        staging = staged.path
        assert staging is not None
        built: set[str] = set()
        for entry in engine_layout(options).values():
            if entry["file"] in built:
                continue
            say(f"building {entry['file']} from {entry['graph']}.onnx on {gpu['name']} (TensorRT {trt.__version__})")
            data, timing = _build_one(trt, export_dir, manifest, options, entry["graph"], timing, say)
            (staging / entry["file"]).write_bytes(data)
            built.add(entry["file"])
        (staging / TIMING_CACHE).write_bytes(timing)
        files = {name: file_record(staging / name) for name in sorted(built)}
        record = engines_manifest(export_dir, manifest, options, key, trt.__version__, gpu, files,
                                  time.perf_counter() - started, __version__)
        (staging / ENGINES_MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
        staged.publish()
    say(f"built {', '.join(sorted(built))} in {time.perf_counter() - started:.1f}s into {engine_dir}")
    return record


def _up_to_date(engine_dir: Path, key: str) -> dict[str, Any] | None:
    path = engine_dir / ENGINES_MANIFEST
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("key") != key:
        return None
    for name, entry in record.get("files", {}).items():
        file = engine_dir / name
        if not file.is_file() or file.stat().st_size != entry.get("bytes"):
            return None
    return record


def _build_one(trt: Any, export_dir: Path, manifest: dict[str, Any], options: BuildOptions, graph: str,
               timing: bytes, say: Callable[[str], None]) -> tuple[bytes, bytes]:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    # Strongly typed: every tensor keeps the export's dtype (fp16/bf16/fp32), plugin IO included.
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    read_graph(export_dir, manifest, graph)  # checks the file's sha256 before TensorRT reads it
    if not parser.parse_from_file(str(export_dir / manifest["graphs"][graph]["file"])):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ExportError(f"TensorRT could not parse {graph}.onnx: {errors}")
    config = builder.create_builder_config()
    if manifest["target"] == "trt":
        # The plugin's present_* outputs alias past_* (in-place cache update).
        feature = getattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03", None)
        if feature is not None:
            config.set_preview_feature(feature, True)
    cache = config.create_timing_cache(timing)
    config.set_timing_cache(cache, False)
    phases = ["prefill", "decode"] if options.single_engine else [graph]
    for phase in phases:
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in profile_shapes(manifest, options, phase).items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    monitor = _progress_monitor(trt, say)
    if monitor is not None:
        config.progress_monitor = monitor
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT failed to build the {graph} engine (see its log above)")
    return bytes(serialized), bytes(config.get_timing_cache().serialize())


def _progress_monitor(trt: Any, say: Callable[[str], None]) -> Any:
    base = getattr(trt, "IProgressMonitor", None)
    if base is None:
        return None

    class Monitor(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            base.__init__(self)

        def phase_start(self, phase_name: str, parent_phase: str | None, num_steps: int) -> None:
            if parent_phase is None:
                say(f"  TensorRT: {phase_name} ({num_steps} steps)")

        def step_complete(self, phase_name: str, step: int) -> bool:
            return True  # keep building

        def phase_finish(self, phase_name: str) -> None:
            pass

    return Monitor()
