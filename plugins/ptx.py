"""Ahead-of-time PTX for the fused attention kernel, compiled on a machine without a GPU.

TensorRT's ahead-of-time plugin path takes PTX plus the launch facts (kernel name, warps, shared
memory, grid); nothing else of the plugin's attributes reaches the engine, so the head layout, scale,
softcap, window and block sizes are compiled in as constants (see plugins/attention_launch.py).

    compile_kernel(KernelVariant(arch="sm_90", dtype="float16", head_dim=128, attrs=AttentionAttrs(32, 8, s)))
    compile_kernel(arch="sm_90", dtype="float16", head_dim=128, num_heads=32, kv_num_heads=8)  (the same)
        -> CompiledKernel(name, ptx, num_warps, shared_mem, block_m, ..., params)
    compile_ptx(...) -> {kernel name: PTX text}
    compile_kernels([variant, ...]) -> [CompiledKernel, ...]   (several at once)

Results are cached in memory and on disk (KVFORGE_PTX_CACHE, default ~/.cache/kvforge/ptx), keyed by
every parameter, the triton version and the kernel's source, so a cache hit does not import triton.

The PTX entry takes the kernel's runtime parameters in plugins/attention_launch.RUNTIME_PARAMS order,
then the two pointers triton appends to every kernel (global scratch, profile scratch; pass null: this
kernel asks for no scratch, which compile_kernel checks).

TRITON_INTERPRET: when triton was (or would be) imported in interpreter mode, its standard library is
wrapped for the interpreter and cannot be compiled; the compile then runs in a child process without
that variable. Everything else about the result is the same.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from kvforge.core.contract import AttentionAttrs
from kvforge.plugins import attention_launch as launch

ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
# PTX ISA 8.7 (CUDA 12.8): the driver JIT-compiles PTX only up to its own CUDA version, and newer
# triton releases target newer ISAs (triton 3.9 writes 9.4 for sm_90, which r580 drivers refuse).
DEFAULT_PTX_VERSION = 87
_TRUTHY = ("1", "true", "yes", "on", "y")


@dataclass(frozen=True)
class CompiledKernel:
    """One compiled variant and what a launcher needs to run it."""

    name: str  # PTX entry name
    ptx: str
    arch: str  # e.g. "sm_90" (the PTX .target may add a suffix: sm_90a)
    dtype: str  # triton spelling: fp16, bf16, fp32
    num_warps: int
    num_stages: int
    shared_mem: int  # bytes of dynamic shared memory to launch with
    block_m: int
    block_n: int
    num_splits: int  # grid z; > 1 needs the workspace (attention_launch.workspace_shape)
    constants: dict  # the constexprs compiled in, by name
    params: tuple  # runtime parameters in order (the PTX appends two scratch pointers)
    ptx_param_count: int  # .param entries of the PTX entry, scratch pointers included
    triton_version: str

    def grid(self, batch: int, seq: int) -> tuple[int, int, int]:
        group = self.constants["NUM_HEADS"] // self.constants["KV_HEADS"]
        return launch.launch_grid(
            batch, seq, self.constants["KV_HEADS"], group, self.num_splits, self.block_m
        )

    def workspace_shape(self, batch: int, seq: int) -> tuple[int, int]:
        group = self.constants["NUM_HEADS"] // self.constants["KV_HEADS"]
        return launch.workspace_shape(
            batch,
            seq,
            self.constants["KV_HEADS"],
            group,
            self.constants["HEAD_DIM"],
            self.num_splits,
            self.block_m,
        )


def _arch_number(arch: str | int) -> int:
    match = re.fullmatch(r"(?:sm_?)?(\d+)a?", str(arch).strip().lower())
    if not match:
        raise ValueError(f"arch must look like 'sm_90' or 90; got {arch!r}")
    return int(match.group(1))


def _triton_version() -> str:
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        raise ImportError(
            "compiling the attention kernel needs triton (pip install triton); no GPU is required"
        ) from None


def _source_digest() -> str:
    # Edits to the kernel or its launch arithmetic must miss the on-disk cache.
    here = Path(__file__).parent
    h = hashlib.sha256()
    for name in ("triton_attention.py", "attention_launch.py", "ptx.py"):
        h.update((here / name).read_bytes())
    return h.hexdigest()[:16]


def kernel_identity() -> dict[str, str]:
    """What a compiled kernel depends on besides its variant: the kernel's source and Triton's version
    (engines embedding its PTX are rebuilt when either changes)."""
    return {"kernel_source": _source_digest(), "triton": _triton_version()}


def _cache_dir() -> Path:
    return Path(os.environ.get("KVFORGE_PTX_CACHE") or Path.home() / ".cache" / "kvforge" / "ptx")


def _stdlib_compilable() -> bool:
    """False when triton's standard library is (or would be, on import) wrapped for the interpreter."""
    triton = sys.modules.get("triton")
    if triton is None:
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() not in _TRUTHY
    from triton.runtime.jit import JITFunction

    return isinstance(triton.language.standard.cdiv, JITFunction)


@dataclass(frozen=True)
class KernelVariant:
    """One variant of the kernel to compile: the op's attributes (compiled in as constants), the target
    and the launch choices. Hashable and plain, so a plan can hand it over and a cache can key on it."""

    arch: str | int = "sm_90"  # sm_80, sm_86, sm_89, sm_90, ... (or 90)
    dtype: str = "float16"
    head_dim: int = 128
    attrs: AttentionAttrs | None = None  # None: 32 query heads over 8 KV heads, scale 1/sqrt(head_dim)
    # "decode" (a few tokens, long cache: rows = the GQA group, padded to 16) or "prefill" (flash tiles).
    regime: str = "decode"
    num_splits: int = 1  # > 1: the flash-decoding variant, which needs the workspace
    block_m: int | None = None  # None: the regime's choice (block_n, num_warps, num_stages likewise)
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    # The PTX ISA (87 = 8.7, loadable by CUDA 12.8+ drivers); None: the newest triton's ptxas supports.
    ptx_version: int | None = DEFAULT_PTX_VERSION
    assume_aligned: bool = True
    fit_shared: bool = True  # shrink stages / blocks until the shared memory fits the arch
    tensorrt: bool = False  # TensorRT's ahead-of-time launch: num_splits=1, no workspace, no scratch
    max_shared_kib: int | None = None  # a lower shared memory limit than the arch's (48: no opt-in)

    @classmethod
    def of(cls, **fields: Any) -> KernelVariant:
        """From flat keywords: this class's fields, with AttentionAttrs' own fields accepted in place of
        `attrs` (each missing one takes attention()'s default; scale=None is 1/sqrt(head_dim))."""
        given = {name: fields.pop(name) for name in AttentionAttrs.names() if name in fields}
        if given:
            if fields.get("attrs") is not None:
                raise TypeError(f"pass attrs or {', '.join(given)}, not both")
            base = cls(head_dim=fields.get("head_dim", cls.head_dim)).attention().as_dict()
            fields["attrs"] = AttentionAttrs(**{**base, **{k: v for k, v in given.items() if v is not None}})
        return cls(**fields)

    def attention(self) -> AttentionAttrs:
        """The attributes compiled in."""
        return self.attrs if self.attrs is not None else AttentionAttrs(32, 8, 1.0 / math.sqrt(self.head_dim))

    def request(self) -> dict:
        """The JSON-able request that keys the cache and feeds the compile (arguments checked here)."""
        if self.tensorrt and self.num_splits != 1:
            raise ValueError("the TensorRT variant has no workspace, so it runs num_splits=1")
        cap = self.max_shared_kib
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                raise ValueError(f"max_shared_kib must be a positive number of KiB, got {cap!r}")
            if not self.fit_shared:
                raise ValueError("max_shared_kib caps the shared memory by shrinking the tiles: it needs fit_shared=True")
        if self.dtype not in launch.TRITON_DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; expected one of float16, bfloat16, float32")
        if self.regime not in ("decode", "prefill"):
            raise ValueError(f"regime must be 'decode' or 'prefill'; got {self.regime!r}")
        attrs = self.attention()
        group = launch.check_shapes(attrs.num_heads, attrs.kv_num_heads, self.head_dim)
        # Block sizes for a representative shape of the regime; the kernel is correct for any shape.
        seq = 1 if self.regime == "decode" else 4096
        config = launch.choose_config(1, seq, attrs.kv_num_heads, group, self.head_dim, 1 << 20, self.num_splits)
        config = dataclasses.replace(
            config,
            block_m=self.block_m or config.block_m,
            block_n=self.block_n or config.block_n,
            num_warps=self.num_warps or config.num_warps,
            num_stages=self.num_stages or config.num_stages,
        )
        return {
            "arch": _arch_number(self.arch),
            "dtype": launch.TRITON_DTYPES[self.dtype],
            "constants": launch.constexprs(attrs, self.head_dim, config),
            "num_warps": config.num_warps,
            "num_stages": config.num_stages,
            "ptx_version": self.ptx_version,
            "assume_aligned": bool(self.assume_aligned),
            "fit_shared": bool(self.fit_shared),
            "tensorrt": bool(self.tensorrt),
            "max_shared": cap * 1024 if cap is not None else None,
        }


def _compile_here(request: dict) -> dict:
    """Run triton's compiler in this process (needs a compilable triton standard library)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from kvforge.plugins.triton_attention import compiled_kernel

    fn = compiled_kernel()
    constants = request["constants"]
    signature = launch.signature(request["dtype"])
    signature.update({name: "constexpr" for name in constants})
    if request.get("tensorrt"):
        # No workspace: the pointers become None constants and leave the entry's parameter list.
        constants = {**constants, **{name: None for name in launch.WORKSPACE_PARAMS}}
        signature.update({name: "constexpr" for name in launch.WORKSPACE_PARAMS})
    attrs = {}
    if request["assume_aligned"]:
        # Every buffer TensorRT or torch hands over starts 16-byte aligned: allow vector loads.
        attrs = {
            (fn.arg_names.index(name),): [["tt.divisibility", 16]]
            for name, ty in signature.items()
            if ty.startswith("*")
        }
    target = GPUTarget("cuda", request["arch"], 32)
    config = launch.KernelConfig(
        constants["BLOCK_M"],
        constants["BLOCK_N"],
        constants["NUM_SPLITS"],
        request["num_warps"],
        request["num_stages"],
    )
    # What the launch may use: the arch's opt-in limit, or less when asked (e.g. 48 KiB, the most a kernel gets
    # without opting in, which a launcher such as TensorRT's ahead-of-time plugin path may not do).
    limit = launch.max_shared_bytes(request["arch"])
    if request.get("max_shared"):
        limit = min(limit, request["max_shared"])
    while True:
        constants = {**constants, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n}
        source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages, "enable_fp_fusion": True}
        if request["ptx_version"] is not None:
            options["ptx_version"] = request["ptx_version"]
        options = make_backend(target).parse_options(options)
        compiled = triton.compile(source, target=target, options=options.__dict__)
        meta = compiled.metadata
        # A variant needing more shared memory than the arch offers would fail at launch: shrink it.
        smaller = launch.shrink_config(config) if request["fit_shared"] else None
        if meta.shared <= limit or smaller is None:
            break
        config = smaller
    if request.get("max_shared") and meta.shared > limit:
        raise ValueError(
            f"the attention kernel needs {meta.shared} bytes of shared memory even at its smallest tiles, more "
            f"than the {request['max_shared'] // 1024} KiB asked for; allow more"
        )
    constants = {name: value for name, value in constants.items() if name in launch.CONSTEXPR_PARAMS}
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if getattr(meta, scratch, 0):
            raise RuntimeError(
                f"the kernel asks for {scratch}={getattr(meta, scratch)}; the AOT path cannot supply it"
            )
    ptx = compiled.asm["ptx"]
    if request.get("tensorrt"):
        ptx = drop_scratch_params(ptx)
    entry = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.DOTALL)
    return {
        "name": meta.name,
        "ptx": ptx,
        "shared_mem": int(meta.shared),
        "num_warps": int(meta.num_warps),
        "ptx_param_count": entry.group(1).count(".param") if entry else -1,
        "triton_version": triton.__version__,
        "constants": {name: constants[name] for name in launch.CONSTEXPR_PARAMS},
        "num_stages": config.num_stages,
    }


def _compile_in_child(requests: list[dict]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The child must import kvforge the way this process did (installed or from a source path).
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run(
        [sys.executable, "-m", "kvforge.plugins.ptx"],
        input=json.dumps(requests),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"compiling the attention kernel in a child process failed:\n{proc.stderr[-4000:]}"
        )
    return json.loads(proc.stdout)


def _kernel(request: dict, result: dict) -> CompiledKernel:
    constants = result["constants"]  # the request's, or smaller blocks if they had to fit
    return CompiledKernel(
        name=result["name"],
        ptx=result["ptx"],
        arch=f"sm_{request['arch']}",
        dtype=request["dtype"],
        num_warps=result["num_warps"],
        num_stages=result["num_stages"],
        shared_mem=result["shared_mem"],
        block_m=constants["BLOCK_M"],
        block_n=constants["BLOCK_N"],
        num_splits=constants["NUM_SPLITS"],
        constants=constants,
        params=launch.TENSORRT_PARAMS if request.get("tensorrt") else launch.RUNTIME_PARAMS,
        ptx_param_count=result["ptx_param_count"],
        triton_version=result["triton_version"],
    )


_MEMORY: dict[str, CompiledKernel] = {}


def _variant(variant: KernelVariant | Mapping[str, Any]) -> KernelVariant:
    return variant if isinstance(variant, KernelVariant) else KernelVariant.of(**variant)


def compile_kernels(
    variants: Iterable[KernelVariant | Mapping[str, Any]], cache: bool = True
) -> list[CompiledKernel]:
    """Compile several variants (each a KernelVariant, or a dict of KernelVariant.of's keywords) in one go.

    Cache misses compile together: in this process, or in one child process when TRITON_INTERPRET
    is in force (one triton import for all of them).
    """
    requests = [variant.request() for variant in map(_variant, variants)]
    triton_version = _triton_version()
    source = _source_digest()
    keys = [
        hashlib.sha256(
            json.dumps({"request": r, "triton": triton_version, "source": source}, sort_keys=True).encode()
        ).hexdigest()[:32]
        for r in requests
    ]
    results: dict[str, dict] = {}
    for key in keys:
        path = _cache_dir() / f"attention-{key}.json"
        if cache and key not in _MEMORY and path.is_file():
            try:
                results[key] = json.loads(path.read_text())
            except (OSError, ValueError):
                pass  # a damaged entry is compiled again
    missing = {}
    for key, request in zip(keys, requests, strict=True):
        if not (cache and key in _MEMORY) and key not in results:
            missing[key] = request
    if missing:
        todo = list(missing.values())
        done = [_compile_here(r) for r in todo] if _stdlib_compilable() else _compile_in_child(todo)
        for key, result in zip(missing, done, strict=True):
            results[key] = result
            if cache:
                # Write then rename: a concurrent reader never sees half a file.
                path = _cache_dir() / f"attention-{key}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(result))
                os.replace(tmp, path)
    kernels = []
    for key, request in zip(keys, requests, strict=True):
        kernel = _MEMORY[key] if cache and key in _MEMORY else _kernel(request, results[key])
        if cache:
            _MEMORY[key] = kernel
        kernels.append(kernel)
    return kernels


def compile_kernel(
    variant: KernelVariant | None = None, /, *, cache: bool = True, **fields: Any
) -> CompiledKernel:
    """Compile one variant to PTX for its arch (sm_80, sm_86, sm_89, sm_90, ...) without a GPU: `variant`,
    or one made of `fields` (KernelVariant.of: `arch=`, `dtype=`, `head_dim=`, `num_heads=`, ...).

    `fit_shared` shrinks stages / blocks until the kernel's shared memory fits the arch (sm_86 and
    sm_89 offer 99 KiB); the CompiledKernel reports the sizes it was compiled with. `max_shared_kib`
    lowers that limit (48: no opt-in above the default 48 KiB is needed to launch it), and raises
    ValueError if even the smallest tiles do not fit.
    `tensorrt` compiles the variant TensorRT's ahead-of-time plugin path launches: num_splits=1, no
    workspace parameters, and the entry takes exactly plugins/attention_launch.TENSORRT_PARAMS (inputs,
    int32 scalars, outputs): TensorRT passes those and nothing else, so triton's two scratch pointers,
    unused by this kernel, are removed from the PTX (drop_scratch_params checks they are unused).
    """
    if variant is not None and (fields or not isinstance(variant, KernelVariant)):
        raise TypeError("compile_kernel takes a KernelVariant or its fields as keywords (arch=, dtype=, ...), not both")
    return compile_kernels([variant if variant is not None else KernelVariant.of(**fields)], cache=cache)[0]


def compile_ptx(variant: KernelVariant | None = None, /, **fields: Any) -> dict[str, str]:
    """{kernel name: PTX text} for one variant; see compile_kernel."""
    kernel = compile_kernel(variant, **fields)
    return {kernel.name: kernel.ptx}


def drop_scratch_params(ptx: str, count: int = 2) -> str:
    """Remove the last `count` parameters of the PTX entry (triton's global and profile scratch
    pointers), after checking that the body never reads them; raises if it does."""
    match = re.search(r"(\.entry\s+\w+\s*\()(.*?)(\))", ptx, re.DOTALL)
    if not match:
        raise ValueError("no .entry in the PTX")
    params = [p.strip() for p in match.group(2).split(",") if p.strip()]
    if len(params) < count:
        raise ValueError(f"the entry has {len(params)} parameters, fewer than {count}")
    body = ptx[match.end():]
    for param in params[-count:]:
        name = param.split()[-1]
        if re.search(rf"\b{re.escape(name)}\b", body):
            raise RuntimeError(f"the kernel reads {name}; it cannot be dropped for TensorRT's launch")
    kept = ",\n\t".join(params[:-count])
    return ptx[: match.start(2)] + "\n\t" + kept + "\n" + ptx[match.end(2):]


def ptx_target(ptx: str) -> str:
    """The `.target` of a PTX text (e.g. 'sm_90a')."""
    match = re.search(r"^\s*\.target\s+([\w]+)", ptx, re.MULTILINE)
    return match.group(1) if match else ""


def _main() -> None:
    # Child-process entry of _compile_in_child: requests as a JSON list on stdin, results on stdout.
    requests = json.loads(sys.stdin.read())
    json.dump([_compile_here(r) for r in requests], sys.stdout)


if __name__ == "__main__":
    _main()
