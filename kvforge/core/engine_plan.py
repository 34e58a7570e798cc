"""TensorRT engines as plain data: build options, optimization profiles, the engine folder's manifest,
binding plans and CUDA-graph keys. No TensorRT or CUDA import here, so all of it is tested on the CPU;
the build (kvforge/engines/trt_build.py) and the TensorRT backend (runtime/backends/trt_backend.py) only act on it.

Engine folder (default EXPORT_DIR/engines), written atomically by `kvforge build`:

    prefill.engine, decode.engine     (or prefill.engine alone with --single-engine: two profiles)
    timing.cache                      TensorRT's timing cache, reused by the next build
    engines.json                      what was built from what, on which GPU, with which limits

engines.json records each engine file's sha256 and bytes, and a sha256 of its own content
(RECORD_DIGEST), so a corrupted, replaced or edited engine folder is told apart from the one
`kvforge build` wrote: the build reuses engines only when all of it matches, `kvforge inspect --verify`
checks all of it, and the TensorRT backend hashes the very bytes it loads.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvforge.core.contract import (
    INPUT_IDS,
    LOGITS,
    LOGITS_INDEX,
    PAST_LENS,
    KVLayout,
    ModelSpec,
    buffer_name,
    cache_input,
    cache_output,
    capacity_buckets,
)
from kvforge.core.errors import InputError, ManifestError
from kvforge.core.manifest import MANIFEST_NAME, io_names, sha256_file
from kvforge.core.targets import Target

# /2: TensorRT recorded as {flavor, version}, the compute target, per-engine build records.
ENGINES_FORMAT = "kvforge-engines/2"
ENGINES_MANIFEST = "engines.json"
ENGINE_DIR_NAME = "engines"
TIMING_CACHE = "timing.cache"
# engines.json's sha256 of its own content (kvforge 0.x engine folders written before it have none).
RECORD_DIGEST = "record_sha256"
DEFAULT_MAX_SEQ_LEN = 4096
# The prefill engines return logits for up to this many positions per row (speculative verification).
MAX_POSITIONS = 16


@dataclass(frozen=True)
class BuildOptions:
    dtype: str
    max_batch: int
    max_input_len: int
    max_seq_len: int
    single_engine: bool
    plugin_shared_kib: int | None = None  # trt target: the attention plugin's shared memory cap (KiB)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name} must be a positive integer, got {value!r}")
    return value


def resolve_build_options(
    manifest: dict[str, Any], target: Target, dtype: str | None = None, max_batch: int = 1,
    max_input_len: int | None = None, max_seq_len: int | None = None, single_engine: bool = False,
    plugin_shared_kib: int | None = None,
) -> BuildOptions:
    """Check `kvforge build`'s flags against the export (`target`: its manifest's, resolved by the caller that read
    it) and fill in the defaults."""
    export_dtype = manifest["dtype"]
    if not target.buildable:
        raise InputError(f"an export of --target {target.name} cannot be built into TensorRT engines ({target.build_refusal})")
    if dtype is not None and dtype != export_dtype:
        raise InputError(
            f"--dtype {dtype} but the export is {export_dtype}: engines are strongly typed, built in the export's "
            f"dtype; re-export with --dtype {dtype}"
        )
    limit = KVLayout.from_manifest(manifest).max_capacity
    max_seq_len = _positive("--max-seq-len", max_seq_len if max_seq_len is not None else min(limit, DEFAULT_MAX_SEQ_LEN))
    if max_seq_len > limit:
        raise InputError(f"--max-seq-len {max_seq_len} exceeds the model's {limit} positions")
    max_input_len = _positive("--max-input-len", max_input_len if max_input_len is not None else max_seq_len)
    if max_input_len > max_seq_len:
        raise InputError(f"--max-input-len {max_input_len} exceeds --max-seq-len {max_seq_len}")
    if plugin_shared_kib is not None:
        _positive("--plugin-shared-mem", plugin_shared_kib)
        if target.plugin is None:
            raise InputError(f"--plugin-shared-mem sizes kvforge's attention plugin, which an export for "
                             f"the {target.name} target does not use; drop it (or export with --target trt)")
    return BuildOptions(export_dtype, _positive("--max-batch", max_batch), max_input_len, max_seq_len,
                        bool(single_engine), plugin_shared_kib)


Shape = tuple[int, ...]


def static_capacity(target: Target) -> bool:
    """Whether the engines fix the cache capacity at --max-seq-len. The `onnx` target's TensorScatter
    becomes TensorRT's KV-cache-update layer, which needs the capacity dimension static at build time
    (a dynamic one fails to parse); kvforge's plugin (`trt` target) takes any capacity."""
    return target.static_engine_capacity


def engine_capacity_buckets(target: Target, options: BuildOptions) -> tuple[int, ...]:
    """The capacities the runtime may allocate for these engines: every bucket up to --max-seq-len, or
    --max-seq-len alone where the engines fix it."""
    if static_capacity(target):
        return (options.max_seq_len,)
    return capacity_buckets(options.max_seq_len)


def profile_shapes(manifest: dict[str, Any], target: Target, options: BuildOptions,
                   phase: str) -> dict[str, tuple[Shape, Shape, Shape]]:
    """(min, opt, max) per dynamic input for the `phase` profile: batch 1..max_batch, query length
    1..max_input_len for prefill and 1 for decode, cache capacity 1..max_seq_len (or --max-seq-len
    alone where it is static). The optimum is the largest bucket the runtime allocates at and the full
    batch."""
    kv = KVLayout.from_manifest(manifest)
    b, c = options.max_batch, options.max_seq_len
    s = options.max_input_len if phase == "prefill" else 1
    opt_c = engine_capacity_buckets(target, options)[-1]
    low_c = c if static_capacity(target) else 1
    shapes: dict[str, tuple[Shape, Shape, Shape]] = {
        INPUT_IDS: ((1, 1), (b, s), (b, s)) if phase == "prefill" else ((1, 1), (b, 1), (b, 1)),
        PAST_LENS: ((1,), (b,), (b,)),
    }
    if phase == "prefill" or options.single_engine:
        positions = MAX_POSITIONS if phase == "prefill" else 1
        shapes[LOGITS_INDEX] = ((1, 1), (b, 1), (b, positions))
    for layer, kind in kv.buffers():
        shapes[cache_input(kind, layer)] = (kv.shape(1, low_c, layer), kv.shape(b, opt_c, layer), kv.shape(b, c, layer))
    return shapes


def engine_layout(options: BuildOptions) -> dict[str, dict[str, Any]]:
    """Which engine file and profile serve each phase, and from which graph each engine is built."""
    if options.single_engine:
        return {"prefill": {"file": "prefill.engine", "graph": "prefill", "profile": 0},
                "decode": {"file": "prefill.engine", "graph": "prefill", "profile": 1}}
    return {"prefill": {"file": "prefill.engine", "graph": "prefill", "profile": 0},
            "decode": {"file": "decode.engine", "graph": "decode", "profile": 0}}


def build_key(export_manifest: dict[str, Any], options: BuildOptions, tensorrt: dict[str, str],
              compute_target: str, kvforge_version: str, plugin: dict[str, str] | None = None) -> str:
    """Everything an engine depends on, hashed: the graphs and weights (their sha256 from the export's
    manifest), the build options, TensorRT's flavour and version, the compute target (the build GPU's
    capability, or TensorRT-RTX's portable set), kvforge's version and, for the `trt` target, the
    plugin kernel's source digest and Triton version (the PTX inside the engine comes from them)."""
    files = export_manifest["files"]
    inputs = {
        "files": {name: files[name]["sha256"] for name in sorted(files)},
        "options": asdict(options),
        "tensorrt": dict(tensorrt),
        "gpu": compute_target,
        "kvforge": kvforge_version,
        "plugin": dict(plugin) if plugin else None,
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def engines_manifest(
    export_dir: Path, export_manifest: dict[str, Any], target: Target, options: BuildOptions, key: str,
    tensorrt: dict[str, str],
    gpu: dict[str, str], files: dict[str, dict[str, Any]], build_seconds: float, kvforge_version: str,
    builds: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The engine folder's engines.json. `gpu`: {name, compute_capability} of the build GPU, or of the
    portable target of an ahead-of-time build; `builds`: per engine file, its build seconds, bytes and
    how its attention was built."""
    weights = int(export_manifest.get("weights_sharing", {}).get("weights_bytes", 0))
    engines = engine_layout(options)
    buckets = engine_capacity_buckets(target, options)
    kv = KVLayout.from_manifest(export_manifest)
    return sealed({
        "format": ENGINES_FORMAT,
        "kvforge_version": kvforge_version,
        "key": key,
        "export": {"folder": str(Path(export_dir).resolve()), "target": export_manifest["target"],
                   "manifest_sha256": sha256_file(Path(export_dir) / MANIFEST_NAME)},
        "tensorrt": dict(tensorrt),
        "gpu": gpu,
        "options": asdict(options),
        "static_capacity": static_capacity(target),
        "capacity_buckets": list(buckets),
        # The KV cache a request of --max-batch rows holds at the largest capacity (both K and V, all layers).
        "kv_cache_bytes_at_max": kv.bytes(options.max_batch, buckets[-1]),
        "engines": engines,
        "profiles": {phase: {name: [list(s) for s in shapes] for name, shapes in
                             profile_shapes(export_manifest, target, options, phase).items()} for phase in engines},
        # The export's weights, and what the engine files hold (about what they take on the GPU): two engines
        # hold a copy each; one engine with two profiles, built by TensorRT-RTX 1.7, holds most weights once
        # per profile too (docs/tensorrt-and-gpus.md, "One engine or two").
        "weights_bytes": weights,
        "engine_bytes": sum(int(entry.get("bytes", 0)) for entry in (builds or {}).values()),
        "files": files,
        "builds": builds or {},
        "build_seconds": round(build_seconds, 2),
    })


def record_digest(record: dict[str, Any]) -> str:
    """sha256 of an engines.json record without its own RECORD_DIGEST field, over sorted keys: the same
    for the dict written and the dict read back, whatever the file's indentation."""
    body = {key: value for key, value in record.items() if key != RECORD_DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def sealed(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with RECORD_DIGEST set to the sha256 of the rest of it."""
    body = {key: value for key, value in record.items() if key != RECORD_DIGEST}
    return {**body, RECORD_DIGEST: record_digest(body)}


def record_problem(record: dict[str, Any], path: Path) -> str | None:
    """Why the engines.json at `path` cannot be trusted, or None. A record without RECORD_DIGEST (written
    before kvforge recorded one) is let through: its engine files are still checked against it, and
    `kvforge inspect --verify` says it is unverified."""
    if RECORD_DIGEST in record and record[RECORD_DIGEST] != record_digest(record):
        return f"{path} was modified after `kvforge build` wrote it (its content no longer matches its {RECORD_DIGEST})"
    return None


def engine_file_problem(engine_dir: Path, name: Any, entry: Any, data: bytes | None = None,
                        check_sha256: bool = True) -> str | None:
    """Why engines.json's engine file `name` is not the one `kvforge build` wrote, or None. The build
    writes each engine as a regular file directly in the engine folder, so a name with a folder in it, a
    symbolic link (wherever it points), a missing file, another size or (`check_sha256`) another sha256
    all mean it was changed. `data`: the file's bytes, already read (what is hashed is what is loaded)."""
    record = Path(engine_dir) / ENGINES_MANIFEST
    if (not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\:")
            or any(ord(c) < 32 or ord(c) == 127 for c in name)):
        return f"{record} names the engine file {name!r}, which is not a file name inside the engine folder"
    if not isinstance(entry, dict):
        return f"{record} records no sha256 and size for {name}"
    path = Path(engine_dir) / name
    if path.is_symlink():
        return f"{path} is a symbolic link, not the file `kvforge build` wrote"
    if not path.exists():
        return f"{path} is missing"
    if not path.is_file():
        return f"{path} is not a regular file"
    size = len(data) if data is not None else path.stat().st_size
    if size != entry.get("bytes"):
        return f"{path} has {size} bytes, not the {entry.get('bytes')} {ENGINES_MANIFEST} records (truncated or modified)"
    if check_sha256:
        digest = hashlib.sha256(data).hexdigest() if data is not None else sha256_file(path)
        if digest != entry.get("sha256"):
            return f"{path} does not match its sha256 in {ENGINES_MANIFEST} (modified or corrupted)"
    return None


def load_engines_manifest(engine_dir: Path, export_dir: Path) -> dict[str, Any]:
    """engines.json, checked: its format and own sha256, that it was built from this export (not a
    modified or other one), and that its engine files are regular files inside the folder with the
    recorded sizes (their sha256 is checked where they are read: the backend, `inspect --verify`)."""
    path = engine_dir / ENGINES_MANIFEST
    if not path.is_file():
        raise ManifestError(
            f"{engine_dir} has no {ENGINES_MANIFEST}: no TensorRT engines were built there; run "
            f"`kvforge build {export_dir}`"
        )
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise ManifestError(f"{path} is not valid JSON ({err}); run `kvforge build {export_dir} --force`") from err
    if not isinstance(data, dict) or data.get("format") != ENGINES_FORMAT:
        raise ManifestError(f"{path} is not a kvforge engine manifest ({ENGINES_FORMAT}); rebuild with `kvforge build`")
    problem = record_problem(data, path)
    if problem is not None:
        raise ManifestError(f"{problem}; rebuild with `kvforge build {export_dir} --force`")
    _check_engines_sections(data, path, export_dir)
    current = sha256_file(Path(export_dir) / MANIFEST_NAME)
    if data["export"].get("manifest_sha256") != current:
        raise ManifestError(
            f"the engines in {engine_dir} were built from another export (or this one before it changed); "
            f"run `kvforge build {export_dir}` again"
        )
    for name, record in data.get("files", {}).items():
        problem = engine_file_problem(engine_dir, name, record, check_sha256=False)
        if problem is not None:
            raise ManifestError(f"{problem}; run `kvforge build {export_dir} --force`")
    return data


def _check_engines_sections(data: dict[str, Any], path: Path, export_dir: Path) -> None:
    """The types of the engines.json sections the backend reads, so a crafted or damaged file fails
    in one line naming the field (not with an AttributeError deep in the TensorRT backend)."""
    def bad(field: str, wanted: str, value: Any) -> ManifestError:
        return ManifestError(f"{path}: {field} must be {wanted}, got {value!r}; rebuild with "
                             f"`kvforge build {export_dir} --force`")

    def count(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0

    if not isinstance(data.get("export"), dict):
        raise bad("'export'", "an object", data.get("export"))
    for section in ("files", "tensorrt", "gpu", "options", "engines", "profiles", "builds"):
        if section in data and not isinstance(data[section], dict):
            raise bad(repr(section), "an object", data[section])
    for name, record in data.get("files", {}).items():
        if not isinstance(record, dict) or not isinstance(record.get("sha256"), str) or not count(record.get("bytes")):
            raise bad(f"files[{name!r}]", "an object with 'sha256' and 'bytes'", record)
    options = data.get("options", {})
    for key in ("max_batch", "max_input_len", "max_seq_len"):
        if key in options and not (count(options[key]) and options[key] > 0):
            raise bad(f"options.{key}", "a positive integer", options[key])
    buckets = data.get("capacity_buckets", [1])
    if not isinstance(buckets, list) or not buckets or not all(count(c) and c > 0 for c in buckets):
        raise bad("'capacity_buckets'", "a non-empty list of positive integers", buckets)
    for phase, entry in data.get("engines", {}).items():
        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str) or not count(entry.get("profile", 0)):
            raise bad(f"engines[{phase!r}]", "an object with 'file' and 'profile'", entry)
        if entry["file"] not in data.get("files", {}):
            raise ManifestError(f"{path}: the {phase} engine {entry['file']!r} is not listed in 'files', so it could "
                                f"not be verified; rebuild with `kvforge build {export_dir} --force`")


def check_runtime_matches(engines: dict[str, Any], tensorrt: dict[str, str], compute_capability: str) -> None:
    """Engines run only on the TensorRT flavour and version that built them, and (standard TensorRT) on
    the GPU architecture they were built on; TensorRT-RTX engines are specialised for the GPU at load."""
    built = engines.get("tensorrt", {})
    if built != dict(tensorrt):
        def name(record: dict[str, str]) -> str:
            return f"{record.get('flavor', '?')} {record.get('version', '?')}"

        raise ManifestError(
            f"the engines were built with {name(built)}, this is {name(tensorrt)}; rebuild them with `kvforge build`"
        )
    if tensorrt.get("flavor") == "tensorrt-rtx":
        return
    target = engines.get("gpu", {}).get("compute_capability")
    if target != compute_capability:
        raise ManifestError(
            f"the engines were built for compute capability {target}, this GPU is {compute_capability}; "
            "rebuild them on this machine with `kvforge build`"
        )


@dataclass(frozen=True)
class Binding:
    """One engine IO tensor of a step: its shape now and which of the slot's buffers it uses."""

    name: str
    shape: Shape
    buffer: str  # a key of the slot's buffers: "key.3", "input_ids", "logits", ...
    is_input: bool


def binding_plan(manifest: dict[str, Any], phase: str, batch: int, capacity: int, seq: int,
                 single_engine: bool, positions: int = 1) -> list[Binding]:
    """The tensors of one prefill or decode run and their buffers. past_key.i and present_key.i
    name the same buffer: TensorRT writes the new rows in place. `positions`: logits per row
    (prefill; decode has one)."""
    kv = KVLayout.from_manifest(manifest)
    vocab = ModelSpec.from_manifest(manifest).vocab_size
    graph = "prefill" if phase == "prefill" or single_engine else "decode"
    # Buffer names: the IO name where one buffer serves it; decode's own inputs have their own buffers.
    ids = INPUT_IDS if phase == "prefill" else "decode_ids"
    plan = [Binding(INPUT_IDS, (batch, seq), ids, True), Binding(PAST_LENS, (batch,), PAST_LENS, True)]
    per_position = graph == "prefill"
    if LOGITS_INDEX in io_names(manifest["graphs"][graph], "inputs"):
        index = LOGITS_INDEX if phase == "prefill" else "decode_index"
        plan.append(Binding(LOGITS_INDEX, (batch, positions if phase == "prefill" else 1), index, True))
    if per_position:
        plan.append(Binding(LOGITS, (batch, positions if phase == "prefill" else 1, vocab), LOGITS, False))
    else:
        plan.append(Binding(LOGITS, (batch, vocab), LOGITS, False))
    for layer, kind in kv.buffers():
        shape = kv.shape(batch, capacity, layer)
        plan.append(Binding(cache_input(kind, layer), shape, buffer_name(kind, layer), True))
        plan.append(Binding(cache_output(kind, layer), shape, buffer_name(kind, layer), False))
    return plan


def graph_key(batch: int, capacity: int) -> tuple[int, int]:
    """Decode steps of one slot have fixed shapes and buffer addresses, so one CUDA graph per
    (batch, capacity) slot replays every step; a new shape is a new slot and a new capture."""
    return (batch, capacity)
