"""Whether a loaded target can speculate by a method, and a --draft folder opened on the target's backend: the
checks the Generator's callers, the command line and the server share, each one InputError of one line (a draft's
vocabulary: runtime/drivers/draft_checks.py; a head's record: runtime/drivers/head_proposer.py)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvforge.core.errors import InputError, KvforgeError
from kvforge.runtime.backends.target_hidden import HEAD_BACKENDS, heads_refused
from kvforge.runtime.controls.speculate import HEAD_METHODS
from kvforge.runtime.drivers.head_proposer import check_head

if TYPE_CHECKING:
    from kvforge.runtime.drivers.loaded_export import LoadedExport

SECOND_SESSION = frozenset({"draft", *HEAD_METHODS})  # methods whose proposer runs its own session between steps


def target_options(folder: str | Path, backend: Any, method: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """The backend options to load a target that speculates by `method` with: where a draft model or a head takes
    turns with it on ONNX Runtime, its threads sleep between runs (unless `spinning` is given). A target's threads
    spinning after its verification hold the cores the draft's next calls need (measured on 2 cores, SmolLM2 fp32
    with its int4 export drafting, k=4: 1.42x plain greedy with the target spinning, 1.63x without; plain
    decoding alone changes within noise)."""
    import json

    from kvforge.core.manifest import MANIFEST_NAME
    from kvforge.core.targets import get_target

    if method not in SECOND_SESSION or options.get("spinning") is not None:
        return options
    if backend is None:
        # Read before the export is loaded (its backend options depend on it), so no LoadedExport to ask yet.
        try:  # an unreadable folder is said by the load that follows, in its own words
            backend = get_target(json.loads((Path(folder) / MANIFEST_NAME).read_text())["target"]).default_backend
        except (OSError, ValueError, KeyError, KvforgeError):
            return options
    if not isinstance(backend, str) or not backend.startswith("ort"):
        return options
    return {**options, "spinning": False}


def check_target(export: LoadedExport, method: str | None, where: str | None = None) -> None:
    """InputError when the loaded target cannot speculate with `method`: a cache that cannot roll back, or a head
    method whose head the export does not carry or whose backend runs no head. `where`: what the message names
    (default: the flag, `--speculate METHOD`)."""
    if method is None or method == "off":
        return
    where = where or f"--speculate {method}"
    export.backend.limits.check_speculation(method)
    if method not in HEAD_METHODS:
        return
    check_head(export.manifest, method, where)
    if export.backend_name not in HEAD_BACKENDS:  # a bad choice of backend for this request: bad input, not a 503
        raise InputError(f"{where}: {heads_refused(export.backend_name)}")


def open_draft(folder: Path, target: LoadedExport, **backend_options: Any) -> LoadedExport:
    """The draft export at `folder` on the target's backend; a folder that is not an export, or one the target's
    backend cannot run (another target type, a broken export), is one InputError naming --draft."""
    from kvforge.core.manifest import MANIFEST_NAME
    from kvforge.runtime.drivers.loaded_export import LoadedExport

    if not (folder / MANIFEST_NAME).is_file():
        raise InputError(f"--draft {folder}: not a kvforge export folder (no {MANIFEST_NAME}); export the draft "
                         "model with `kvforge export` first")
    if target.backend_name.startswith("ort"):
        # The draft's threads must not spin between its runs: they would hold the cores the target's verification
        # needs (measured on 2 cores, SmolLM2 fp32 + int4 draft: 0.84-0.91x plain with spinning, 1.47x without).
        backend_options.setdefault("spinning", False)
    try:
        return LoadedExport(folder, target.backend_name, **backend_options)
    except KvforgeError as err:
        message = f"--draft {folder}: {' '.join(str(err).split())}"
        theirs, ours = _target_of(folder), target.manifest.get("target")
        if theirs != ours:  # the usual cause: the draft runs on the target's backend, so it needs its target type
            message += f" (a draft runs on the target's backend: export it with --target {ours}, as the target was)"
        raise InputError(message) from err


def _target_of(folder: Path) -> Any:
    """The export target (ort, onnx, trt) an export folder's manifest names, None when it cannot be read."""
    import json

    from kvforge.core.manifest import MANIFEST_NAME

    try:
        return json.loads((folder / MANIFEST_NAME).read_text()).get("target")
    except (OSError, ValueError, AttributeError):
        return None
