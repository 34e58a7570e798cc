"""Hugging Face Hub ids (`org/name`) as model sources (kvforge.models.hub): taken from a cache laid out as
huggingface_hub writes it (models--org--name/refs, snapshots/COMMIT, blobs), downloaded only where the network is
allowed. No network here: every socket connection fails the test."""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvforge.cli import main
from kvforge.core.errors import InputError

pytest.importorskip("huggingface_hub")
REPO = "kvforge-tests/llama-tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_like_huggingface_hub(cache: Path, repo: str, commit: str, folder: Path) -> Path:
    """`folder` as huggingface_hub caches a download of `repo` at `commit`: the files in blobs/ under their
    sha256, the snapshot's files relative links to them, refs/main naming the commit. Returns the snapshot."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        blob = root / "blobs" / digest
        if not blob.exists():
            shutil.copyfile(path, blob)
        link = snapshot / path.relative_to(folder)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to("../" * (len(path.relative_to(folder).parts) - 1) + f"../../blobs/{digest}")
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def no_network(monkeypatch):
    """Any connection attempt fails the test (huggingface_hub must not try one)."""
    def refuse(*_args, **_kwargs):
        pytest.fail("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.fixture
def hub_cache(tmp_path, monkeypatch, hf_folder, no_network) -> Path:
    """A Hugging Face cache holding REPO at COMMIT (the llama-tiny recipe's folder); offline."""
    cache = tmp_path / "hf-home" / "hub"
    cache_like_huggingface_hub(cache, REPO, COMMIT, hf_folder("llama-tiny"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # HF_HUB_CACHE unset: HF_HOME/hub
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_export_and_parity_take_a_hub_id_from_the_cache(hub_cache, tmp_path) -> None:
    out = tmp_path / "out"
    code, _, err = run("export", REPO, "-o", str(out))
    assert code == 0, err
    model = json.loads((out / "kvforge.json").read_text())["model"]
    assert model["hub"] == {"id": REPO, "revision": COMMIT}
    assert model["source"] == str((hub_cache / "models--kvforge-tests--llama-tiny" / "snapshots" / COMMIT).resolve())
    code, stdout, err = run("parity", REPO, str(out), "--revision", COMMIT, "--new-tokens", "2",
                            "--perplexity-tokens", "0", "--prompt", "hello")
    assert code == 0, err + stdout


def test_a_hub_id_not_in_the_cache_offline_is_one_line(hub_cache, tmp_path) -> None:
    out = tmp_path / "out"
    for args, named in ((["kvforge-tests/absent"], "kvforge-tests/absent"),
                        ([REPO, "--revision", "v2"], f"{REPO} at revision v2")):
        code, _, err = run("export", *args, "-o", str(out))
        assert code == 2 and err.count("\n") == 1, err
        assert (f"{named}: no such local path, and not in the Hugging Face cache ({hub_cache}); HF_HUB_OFFLINE is "
                f"set, so nothing is downloaded: run `hf download {args[0]}` where the network is allowed, or pass a "
                "local model folder") in err, err
        assert not out.exists()


def test_the_python_api_resolves_hub_ids(hub_cache, tmp_path) -> None:
    from kvforge.exporter.export import export_model

    with pytest.raises(InputError, match=r"kvforge-tests/absent at revision main: no such local path, and not in the Hugging Face cache"):
        export_model("kvforge-tests/absent", tmp_path / "out", revision="main")
    with pytest.raises(InputError, match=r"--revision main goes with a Hugging Face Hub id \(org/name\)"):
        export_model(hub_cache, tmp_path / "out", revision="main")  # a local path takes no revision
    assert not (tmp_path / "out").exists()


def test_a_hub_id_is_downloaded_only_when_the_network_is_allowed(hub_cache, monkeypatch, tmp_path) -> None:
    """Without HF_HUB_OFFLINE, an id not cached is downloaded (here: a fake snapshot_download that makes the
    cache as huggingface_hub would), into the cache huggingface_hub uses, without the formats kvforge does not read."""
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    from kvforge.models.hub import NOT_READ, hub_record, resolve_model

    monkeypatch.delenv("HF_HUB_OFFLINE")
    calls = []

    def fake_snapshot_download(repo_id, revision=None, cache_dir=None, local_files_only=False, **kwargs):
        calls.append({"repo_id": repo_id, "local_files_only": local_files_only, "cache_dir": cache_dir, **kwargs})
        if local_files_only:
            raise LocalEntryNotFoundError("not cached")
        commit = "f" * 40 if repo_id != REPO else "e" * 40
        return cache_like_huggingface_hub(Path(cache_dir), repo_id, commit,
                                          hub_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    said: list[str] = []
    folder = resolve_model("kvforge-tests/fresh", say=said.append)  # never cached: straight to the Hub
    assert [c["local_files_only"] for c in calls] == [False]
    assert calls[0]["cache_dir"] == hub_cache and calls[0]["ignore_patterns"] == NOT_READ
    assert said == [f"kvforge-tests/fresh: not in the Hugging Face cache, downloading it into {hub_cache}"]
    assert (folder / "config.json").is_file() and hub_record(folder) == {"id": "kvforge-tests/fresh", "revision": "f" * 40}
    calls.clear()
    resolve_model(REPO, revision="v2", say=said.append)  # cached, but not at this revision: the cache first
    assert [(c["repo_id"], c["local_files_only"]) for c in calls] == [(REPO, True), (REPO, False)]
    assert said[-1] == f"{REPO} at revision v2: not in the Hugging Face cache, downloading it into {hub_cache}"
    assert hub_record(tmp_path) is None
