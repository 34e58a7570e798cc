"""Hugging Face Hub ids (`org/name`) as model sources, as optimum-cli and onnxruntime-genai's builder take them:
the snapshot folder `huggingface_hub` keeps in its cache, downloaded only when the network is allowed
(`HF_HUB_OFFLINE` unset), and the id and commit a cached folder came from (for the manifest).

huggingface_hub is imported only when an id is given: a local folder never needs it."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvforge.core.errors import InputError

# What a Hub id looks like (`owner/name`); one is taken as such only when no such local path exists.
HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
# Weight formats kvforge does not read (it reads safetensors and GGUF): never downloaded for an export.
NOT_READ = ["*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.msgpack", "*.h5", "*.ot", "*.tflite", "*.onnx",
            "*.onnx_data", "onnx/*", "original/*", "coreml/*", "openvino/*"]
OFF = ("", "0", "false", "no", "off")


def is_hub_id(source: str | Path) -> bool:
    """Whether `source` names a Hub repository: `org/name`, and no such local path exists."""
    return not Path(source).exists() and HUB_ID.fullmatch(str(source)) is not None


def resolve_model(source: str | Path, revision: str | None = None,
                  say: Callable[[str], None] | None = None) -> Path:
    """The local folder for `source`: itself when it is a local path (or not an id: the path checks say what is
    wrong with it), else the Hub repository's snapshot, from the cache first, downloaded only when allowed."""
    if not is_hub_id(source):
        if revision is not None:
            raise InputError(f"--revision {revision} goes with a Hugging Face Hub id (org/name), and {source} is "
                             "a local path; drop --revision")
        return Path(source)
    return _snapshot(str(source), revision, say or (lambda _msg: None))


def hub_cache() -> Path:
    """The cache huggingface_hub uses, read from the environment now (HF_HUB_CACHE, else HF_HOME/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE as huggingface_hub reads it (1/true/yes/on), asked now rather than at its import."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in OFF


def _snapshot(repo_id: str, revision: str | None, say: Callable[[str], None]) -> Path:
    cache, at = hub_cache(), "" if revision is None else f" at revision {revision}"
    # Offline and never cached: said without importing huggingface_hub (a second on a busy machine).
    cached = (cache / ("models--" + repo_id.replace("/", "--"))).is_dir()
    if cached or not hub_offline():
        try:
            from huggingface_hub import snapshot_download
            from huggingface_hub.errors import LocalEntryNotFoundError
        except ImportError:
            raise InputError(f"{repo_id} looks like a Hugging Face Hub id, and huggingface_hub is not installed: "
                             "pip install 'kvforge[export]', or pass a local model folder") from None
    if cached:
        try:
            return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True))
        except LocalEntryNotFoundError:
            pass  # not this revision: downloaded below, where the network is allowed
    if hub_offline():
        raise InputError(f"{repo_id}{at}: no such local path, and not in the Hugging Face cache ({cache}); "
                         f"HF_HUB_OFFLINE is set, so nothing is downloaded: run `hf download {repo_id}` where the "
                         "network is allowed, or pass a local model folder")
    say(f"{repo_id}{at}: not in the Hugging Face cache, downloading it into {cache}")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, ignore_patterns=NOT_READ))
    except Exception as err:  # huggingface_hub's errors (not found, gated, revision, network) have no one base
        reason = " ".join(str(err).split()) or type(err).__name__
        raise InputError(f"{repo_id}{at}: no such local path, and it could not be downloaded from the Hugging Face Hub "
                         f"({type(err).__name__}: {reason[:300]}); check the id and the network, or pass a local "
                         "model folder") from None


def hub_record(path: str | Path) -> dict[str, Any] | None:
    """{"id": "org/name", "revision": COMMIT} when `path` is (in) a snapshot of huggingface_hub's cache
    (.../models--org--name/snapshots/COMMIT/...), else None."""
    parts = Path(os.path.abspath(path)).parts
    for at in range(len(parts) - 2, 0, -1):
        if parts[at] == "snapshots" and parts[at - 1].startswith("models--"):
            return {"id": parts[at - 1][len("models--"):].replace("--", "/"), "revision": parts[at + 1]}
    return None
