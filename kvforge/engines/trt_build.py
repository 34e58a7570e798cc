"""`kvforge build`: an export folder's graphs -> TensorRT engines (prefill + decode, or one engine with two
profiles), written atomically into the engine folder with engines.json (kvforge/core/engine_plan.py).

Works with standard TensorRT (>= 10.15, on a GPU) or TensorRT for RTX (ahead of time, on any machine,
CPU included), through kvforge/core/tensorrt_flavor.py.

- `onnx` target: standard Attention + TensorScatter, imported natively as TensorRT's attention and
  KV-cache-update layers. The KV-cache-update layer needs the cache's capacity static, so the graphs'
  capacity dimension is fixed to --max-seq-len while parsing (in memory: the weights file is read
  where it lies, never copied). Attention that TensorRT has no dedicated kernel for (fp32, small head
  dims) is marked decomposable and rebuilt; engines.json says which engines needed it.
- `trt` target: kvforge's plugin (registered before parsing, its PTX compiled for the GPU) through
  `tensorrt.plugin`; TensorRT-RTX has no such module, so there it is refused in one line.

Engines are reused when nothing they depend on changed (kvforge/engine_plan.build_key) and the engine
folder is still what the last build wrote (engines.json's own sha256, every engine's sha256).

TensorRT prints some of its errors on file descriptor 2 itself, not through the logger: the first,
fused attempt runs with fd 2 captured, and what it printed is shown only if the build then fails.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvforge.core import __version__
from kvforge.core.contract import KVLayout, ModelSpec
from kvforge.core.engine_plan import (
    ENGINE_DIR_NAME,
    ENGINES_MANIFEST,
    RECORD_DIGEST,
    TIMING_CACHE,
    BuildOptions,
    build_key,
    engine_file_problem,
    engine_layout,
    engines_manifest,
    profile_shapes,
    record_problem,
    resolve_build_options,
    static_capacity,
)
from kvforge.core.errors import BackendUnavailableError, ExportError, InputError, UnsupportedModelError
from kvforge.core.manifest import file_record, load_manifest, read_graph
from kvforge.core.output_folder import StagedFolder, check_output, naming_a_full_disk
from kvforge.core.targets import Target, get_target
from kvforge.core.tensorrt_flavor import RTX_PORTABLE, TensorRT, gpu_refusal, load_tensorrt
from kvforge.engines.native_stderr import fd2_captured, write_stderr
from kvforge.engines.trt_graph import tensorrt_graph

# TensorRT's builder says this when an attention layer has no dedicated kernel for its shape and dtype.
NEEDS_DECOMPOSABLE = "not supported by a dedicated kernel"


def local_gpu() -> dict[str, str] | None:
    """This machine's first GPU ({name, compute_capability}), or None (none, or no cuda-python to ask)."""
    try:
        from kvforge.core import cuda

        return cuda.device_info(0) if cuda.device_count() else None
    except Exception:  # no cuda-python, no driver: nothing to say about a GPU
        return None


def build_target(trt: TensorRT, say: Callable[[str], None] = lambda _msg: None) -> dict[str, str]:
    """The GPU the engines are built for: this machine's (standard TensorRT, which needs one), or
    TensorRT-RTX's portable set (its ahead-of-time build needs none; where this machine has a GPU
    TensorRT-RTX cannot run, say so, and build for the portable set all the same)."""
    if trt.builds_without_gpu:
        here = local_gpu()
        refusal = gpu_refusal(trt.flavor, here) if here is not None else None
        if refusal is not None:
            say(f"note: {refusal}. Building for the portable set (compute capability {RTX_PORTABLE}) anyway")
        return {"name": "any supported GPU (ahead-of-time build)", "compute_capability": RTX_PORTABLE}
    try:
        from kvforge.core import cuda

        count = cuda.device_count()
    except BackendUnavailableError as err:
        raise BackendUnavailableError(
            f"kvforge build with {trt.label} needs cuda-python (cuda.bindings) and an NVIDIA GPU: pip install "
            "-e '.[trt]' on a GPU machine, or build on any machine with TensorRT-RTX (pip install -e '.[trt-rtx]')"
        ) from err
    if count == 0:
        raise BackendUnavailableError(
            f"kvforge build with {trt.label} needs an NVIDIA GPU to build for; CUDA reports none (TensorRT-RTX "
            "builds without one: pip install -e '.[trt-rtx]')"
        )
    gpu = cuda.device_info(0)
    refusal = gpu_refusal(trt.flavor, gpu)
    if refusal is not None:
        raise BackendUnavailableError(refusal)
    return gpu


def _plugin_identity(trt: TensorRT, target: Target) -> dict[str, str] | None:
    """For the `trt` target: refuse where the plugin cannot be built, else what its PTX depends on."""
    if target.plugin is None:
        return None
    if trt.plugin_module() is None:
        raise BackendUnavailableError(
            f"an export of --target {target.name} cannot be built with {trt.label}: kvforge's attention plugin is embedded "
            "through tensorrt.plugin (ahead-of-time kernels), which TensorRT-RTX does not have; export with "
            "--target onnx (TensorRT's own attention), or build on a GPU machine with TensorRT >= 10.15"
        )
    from kvforge.plugins.ptx import kernel_identity

    return kernel_identity()


def _check_plugin_arch(target: Target, arch: str) -> str:
    from kvforge.plugins import trt_plugin

    if target.plugin is None:
        raise InputError(f"--arch picks the attention plugin's GPU architecture; an export for the "
                         f"{target.name} target does not use the plugin")
    try:
        return trt_plugin.check_arch(arch)
    except ValueError as err:
        raise InputError(f"--arch: {err}") from None


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
    tensorrt: str = "auto",
    plugin_shared_kib: int | None = None,
    plugin_arch: str | None = None,
) -> dict[str, Any]:
    """Build (or reuse) the engines of an export folder; returns engines.json's content. `tensorrt`:
    "auto", "tensorrt" or "tensorrt-rtx" (kvforge/core/tensorrt_flavor.py). `plugin_shared_kib` (trt target):
    cap the attention plugin's dynamic shared memory (e.g. 48). `plugin_arch` (trt target): the GPU
    architecture to compile the plugin's kernel for (e.g. sm_90; default: the build GPU's)."""
    say = progress or (lambda _msg: None)
    export_dir = Path(export_dir)
    manifest = load_manifest(export_dir)
    if KVLayout.from_manifest(manifest).states:
        raise UnsupportedModelError(f"{export_dir}: this model's recurrent layers keep a state, which kvforge's "
                                    "TensorRT engines do not carry yet; run the export on ONNX Runtime "
                                    "(kvforge generate without --backend tensorrt)")
    target = get_target(manifest["target"])  # resolved once, where the build reads the manifest
    options = resolve_build_options(manifest, target, dtype, max_batch, max_input_len, max_seq_len, single_engine,
                                    plugin_shared_kib)
    if plugin_arch is not None:
        plugin_arch = _check_plugin_arch(target, plugin_arch)
    engine_dir = _engine_folder(export_dir, engine_dir)
    check_output(engine_dir, [], force=True, marker=ENGINES_MANIFEST, what="kvforge engine folder")
    trt = load_tensorrt(tensorrt)
    plugin = _plugin_identity(trt, target)
    if plugin is not None and plugin_arch is not None:
        plugin = {**plugin, "arch": plugin_arch}  # PTX for another architecture: other engines
    gpu = build_target(trt, say)
    key = build_key(manifest, options, trt.record(), gpu["compute_capability"], __version__, plugin)
    if not force:
        existing, why_not = _up_to_date(engine_dir, key)
        if existing is not None:
            say(f"engines in {engine_dir} are up to date (same graphs, options, TensorRT and GPU); --force rebuilds")
            return existing
        if why_not is not None:
            say(f"{why_not}: rebuilding")
    replaced = _other_options(engine_dir, options)
    if replaced is not None:  # e.g. --single-engine over the two engines of the line before: never silently
        changes = ", ".join(f"{name} {old} -> {new}" for name, (old, new) in replaced.items())
        say(f"replacing the engines in {engine_dir}, built with other options ({changes}); --engine-dir keeps both")
    if plugin is not None:
        from kvforge.plugins import trt_plugin

        trt_plugin.register(max_shared_kib=options.plugin_shared_kib, arch=plugin_arch)
    started = time.perf_counter()
    timing = (engine_dir / TIMING_CACHE).read_bytes() if (engine_dir / TIMING_CACHE).is_file() else b""
    builds: dict[str, dict[str, Any]] = {}  # engine file -> seconds, bytes, attention
    # A full disk names the engine folder (the OSError would name a hidden staging file).
    with (naming_a_full_disk(engine_dir, "choose another --engine-dir"),
          StagedFolder(engine_dir, ENGINES_MANIFEST, what="kvforge engine folder", say=say) as staged):
        staging = staged.path
        assert staging is not None
        timing = _build_all(trt, export_dir, manifest, target, options, staging, gpu, timing, builds, say)
        if timing:
            (staging / TIMING_CACHE).write_bytes(timing)
        files = {name: file_record(staging / name) for name in sorted(builds)}
        record = engines_manifest(export_dir, manifest, target, options, key, trt.record(), gpu, files,
                                  time.perf_counter() - started, __version__, builds)
        (staging / ENGINES_MANIFEST).write_text(json.dumps(record, indent=2) + "\n")
        staged.publish()
    say(f"built {', '.join(sorted(builds))} in {time.perf_counter() - started:.1f}s into {engine_dir}")
    if replaced is not None:  # reported (`build --json`), not recorded: engines.json describes these engines
        return {**record, "replaced": {"options": {name: list(pair) for name, pair in replaced.items()}}}
    return record


def _engine_folder(export_dir: Path, engine_dir: str | Path | None) -> Path:
    """The engine folder (default: the export's `engines/`), never the export folder or one holding it."""
    folder = Path(engine_dir) if engine_dir is not None else export_dir / ENGINE_DIR_NAME
    if folder.resolve() == export_dir.resolve() or folder.resolve() in export_dir.resolve().parents:
        raise InputError(
            f"the engine folder {folder} must not be the export folder or contain it (default "
            f"{export_dir / ENGINE_DIR_NAME})"
        )
    return folder


def _build_all(trt: Any, export_dir: Path, manifest: dict[str, Any], target: Target, options: BuildOptions,
               staging: Path, gpu: dict[str, Any], timing: bytes, builds: dict[str, dict[str, Any]],
               say: Callable[[str], None]) -> bytes:
    """Build each engine of the layout once into `staging`, recording it in `builds`; the timing cache after."""
    for entry in engine_layout(options).values():
        if entry["file"] in builds:
            continue
        say(f"building {entry['file']} from {entry['graph']}.onnx for {gpu['name']} ({trt.label})")
        one = time.perf_counter()
        data, timing, attention = _build_one(trt, export_dir, manifest, target, options, entry["graph"], timing, say)
        (staging / entry["file"]).write_bytes(data)
        builds[entry["file"]] = {"seconds": round(time.perf_counter() - one, 2), "bytes": len(data),
                                 "attention": attention}
        say(f"built {entry['file']}: {len(data) / 1e6:.1f} MB in {builds[entry['file']]['seconds']:.1f}s "
            f"(attention: {attention})")
    return timing


def _other_options(engine_dir: Path, options: BuildOptions) -> dict[str, tuple[Any, Any]] | None:
    """The options the engines in `engine_dir` were built with, where they differ from `options`: {name: (old,
    new)}; None when there are no engines there, their engines.json is unreadable, or the options are the same."""
    try:
        built = json.loads((engine_dir / ENGINES_MANIFEST).read_text()).get("options")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(built, dict):
        return None
    changed = {name: (built.get(name), new) for name, new in asdict(options).items() if built.get(name) != new}
    return changed or None


def _up_to_date(engine_dir: Path, key: str) -> tuple[dict[str, Any] | None, str | None]:
    """engines.json's record when the engines can be reused, else None and why not (None when there is
    nothing to explain: no engines yet, or built from other inputs). Reused only when engines.json is
    unchanged (its own sha256) and every engine is a regular file in the folder with its sha256."""
    path = engine_dir / ENGINES_MANIFEST
    if not path.is_file():
        return None, None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None, f"{path} is not readable JSON"
    if not isinstance(record, dict) or record.get("key") != key:
        return None, None
    if RECORD_DIGEST not in record:
        return None, f"{path} records no sha256 of itself, so it cannot be checked"
    problem = record_problem(record, path)
    if problem is not None:
        return None, problem
    files = record.get("files")
    if not isinstance(files, dict) or not files:
        return None, f"{path} lists no engine files"
    for name, entry in files.items():
        problem = engine_file_problem(engine_dir, name, entry)
        if problem is not None:
            return None, problem
    return record, None


class _Log:
    """TensorRT's logger for one build: warnings and errors kept, to explain a failed build in one line."""

    def __init__(self, trt: TensorRT) -> None:
        base = trt.module.ILogger
        messages: list[str] = []
        severity = trt.module.ILogger.Severity

        class Logger(base):  # type: ignore[misc, valid-type]
            def __init__(self) -> None:
                base.__init__(self)

            def log(self, level: Any, msg: str) -> None:
                if level in (severity.INTERNAL_ERROR, severity.ERROR):
                    messages.append(msg)

        self.logger = Logger()
        self.errors = messages


def _network(trt: TensorRT, builder: Any, log: _Log, export_dir: Path, manifest: dict[str, Any], target: Target,
             options: BuildOptions, graph: str) -> tuple[Any, Any, int]:
    """Parse `graph` into a strongly typed network (every tensor keeps the export's dtype, plugin IO
    included), as kvforge/engines/trt_graph.py rewrites it for TensorRT; also how many softcapped attention
    nodes had to be decomposed. The weights stay in the export's file; the parser reads them there."""
    read_graph(export_dir, manifest, graph)  # checks the file's sha256 before TensorRT reads it
    path = export_dir / manifest["graphs"][graph]["file"]
    kv = KVLayout.from_manifest(manifest)
    caches = set(kv.cache_inputs()) | set(kv.cache_outputs())
    proto, decomposed = tensorrt_graph(path, caches, options.max_seq_len if static_capacity(target) else None,
                                       ModelSpec.from_manifest(manifest).num_heads, kv.num_kv_heads,
                                       None if kv.layers else kv.head_dim)
    network = builder.create_network(1 << int(trt.module.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.module.OnnxParser(network, log.logger)
    if not parser.parse(proto.SerializeToString(), str(path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ExportError(f"{trt.label} could not parse {graph}.onnx: {errors}")
    return network, parser, decomposed


def _attention_layers(trt: TensorRT, network: Any) -> list[Any]:
    layers = []
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.type == trt.module.LayerType.ATTENTION_INPUT:
            layer.__class__ = trt.module.IAttentionInputLayer  # the Python binding's way to downcast
            layers.append(layer)
    return layers


def _build_one(trt: TensorRT, export_dir: Path, manifest: dict[str, Any], target: Target, options: BuildOptions,
               graph: str, timing: bytes, say: Callable[[str], None]) -> tuple[bytes, bytes, str]:
    """One engine's bytes, the updated timing cache, and how its attention was built: "fused"
    (TensorRT's dedicated kernels), "decomposed" (no dedicated kernel for this shape and dtype: marked
    decomposable and rebuilt) or "plugin" (kvforge's kernel)."""
    log = _Log(trt)
    builder = trt.module.Builder(log.logger)
    network, _parser, softcapped = _network(trt, builder, log, export_dir, manifest, target, options, graph)
    # TensorRT's attention layer cannot softcap: those layers are plain ops (kvforge/engines/trt_graph.py).
    attention = "plugin" if target.plugin is not None else "decomposed (softcap)" if softcapped else "fused"
    fused_output = ""  # what the library printed on fd 2 during the fused attempt
    for attempt in ("fused", "decomposed"):
        if attempt == "decomposed":
            say(f"  {trt.label} has no dedicated attention kernel for {graph} ({options.dtype}, head_dim "
                f"{manifest['kv_cache']['head_dim']}): marking attention decomposable and building again")
            for layer in _attention_layers(trt, network):
                layer.attention.decomposable = True
            attention = "decomposed"
        log.errors.clear()
        if attempt == "fused":
            # TensorRT-RTX prints "Internal Error: MyelinCheckException ..." itself when attention has no
            # dedicated kernel, though the decomposed attempt then builds: kept unless the build fails.
            # Progress said meanwhile would land in the capture too: held, and said after it.
            held: list[str] = []
            with fd2_captured() as captured:
                config = _config(trt, builder, manifest, target, options, graph, timing, held.append)
                serialized = builder.build_serialized_network(network, config)
            fused_output = captured.text
            for message in held:
                say(message)
        else:
            config = _config(trt, builder, manifest, target, options, graph, timing, say)
            serialized = builder.build_serialized_network(network, config)
        if serialized is not None:
            if trt.has_timing_cache:
                timing = bytes(config.get_timing_cache().serialize())
            return bytes(serialized), timing, attention
        needs_decomposable = any(NEEDS_DECOMPOSABLE in message for message in log.errors)
        if attempt == "decomposed" or not needs_decomposable or not _attention_layers(trt, network):
            break
    if fused_output.strip():
        write_stderr(f"{trt.label}'s own output while building the {graph} engine with fused attention:\n"
                      f"{fused_output.rstrip()}\n")
    detail = log.errors[-1] if log.errors else "see TensorRT's log above"
    raise ExportError(f"{trt.label} failed to build the {graph} engine: {detail}")


def _config(trt: TensorRT, builder: Any, manifest: dict[str, Any], target: Target, options: BuildOptions, graph: str,
            timing: bytes, say: Callable[[str], None]) -> Any:
    config = builder.create_builder_config()
    if target.plugin is not None:
        # The plugin's present_* outputs alias past_* (in-place cache update).
        feature = getattr(trt.module.PreviewFeature, "ALIASED_PLUGIN_IO_10_03", None)
        if feature is not None:
            config.set_preview_feature(feature, True)
    if trt.has_timing_cache:
        config.set_timing_cache(config.create_timing_cache(timing), False)
    phases = ["prefill", "decode"] if options.single_engine else [graph]
    for phase in phases:
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in profile_shapes(manifest, target, options, phase).items():
            profile.set_shape(name, low, opt, high)
        config.add_optimization_profile(profile)
    monitor = _progress_monitor(trt.module, say)
    if monitor is not None:
        config.progress_monitor = monitor
    return config


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
