"""Writing an output folder (an export, a built model, engines) so that no failure loses data.

- The work is written into a hidden staging sibling, `.NAME.kvforge-staging.XXXX`, locked with
  flock while its process lives; `publish()` moves it into place.
- An existing folder is replaced only when it is of the kind being written (its marker file, e.g.
  kvforge.json, says so; an empty folder is fine too) and holds none of the sources; replacement
  swaps the two folders in one atomic `renameat2(RENAME_EXCHANGE)` on Linux, so at every instant
  the path holds the complete old or the complete new folder. Where the filesystem cannot swap,
  the old folder is renamed aside first and put back by the next run if a kill came in between.
- Staging and set-aside folders that no live process holds (a killed run) are deleted by the next
  run that writes the same output.
- A full disk while writing fails in one line naming the output folder (`naming_a_full_disk`),
  however the writing library reports it; the staging folder goes, so nothing half-written stays.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kvforge.core.errors import ExportError, InputError, KvforgeError

try:  # POSIX only; without it staging folders are not locked and stale ones are not cleaned.
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

STAGING = "kvforge-staging"
ASIDE = "kvforge-old"
# Earlier kvforge versions named their staging folders `.NAME.partial.XXXX`; clean those up too.
LEGACY_STAGING = "partial"
# The named steps of a write, where the fault suite (tests/faults/test_kill.py) adds a hook that stops the
# process as a power cut or `kill -9` would. Shipped code adds none: the calls then do nothing.
FAULT_HOOKS: list[Callable[[str], None]] = []


def fault_point(name: str) -> None:
    for hook in FAULT_HOOKS:
        hook(name)


# Below this much free space on the output's filesystem, a write error that gives no reason (numpy's
# "problem writing element N to file", from a short fwrite) is taken to be a full disk.
NEARLY_FULL_BYTES = 64 << 20


def disk_full(err: BaseException, written: Path) -> bool:
    """Whether `err` (or any exception in its chain) says the disk is full: errno ENOSPC or EDQUOT,
    the OS's message for them (safetensors' SafetensorError carries only that text), or a reasonless
    write error while `written`'s filesystem is nearly full."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(current)
        if "No space left on device" in text or "ENOSPC" in text or "Disk quota exceeded" in text:
            return True
        if isinstance(current, OSError) and current.errno is None and "writ" in text:
            try:
                if shutil.disk_usage(written).free < NEARLY_FULL_BYTES:
                    return True
            except OSError:
                pass
        current = current.__cause__ or current.__context__
    return False


def disk_full_error(out_dir: Path, elsewhere: str = "choose another output folder") -> ExportError:
    """The one-line error for a full disk while writing `out_dir`. The writing library's own message
    names a hidden staging file, or no path at all (safetensors), so the output folder is named here."""
    return ExportError(f"no space left on device while writing {out_dir}; the disk is full: free space on that "
                       f"filesystem or {elsewhere}; nothing was changed at the output")


def _size(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def require_free_space(folder: Path, nbytes: int, what: str = "the output") -> None:
    """Refuse, before anything is written, an output of about `nbytes` that the filesystem of `folder` (the
    nearest existing ancestor: the folder itself is usually made later) has no room for, with a 5% margin
    for headers and files written beside it. A full disk found this way costs nothing; found at the end
    of a long export it costs the export."""
    anchor = Path(folder).absolute()
    while not anchor.exists() and anchor != anchor.parent:
        anchor = anchor.parent
    free = shutil.disk_usage(anchor).free
    if free < nbytes * 1.05:
        raise ExportError(f"{what} needs about {_size(nbytes)} and {anchor} has {_size(free)} free; free space on "
                          "that filesystem or choose another output folder; nothing was written")


@contextmanager
def naming_a_full_disk(out_dir: Path, elsewhere: str = "choose another output folder") -> Iterator[None]:
    """Around the writes of a StagedFolder's block: a full disk becomes disk_full_error(out_dir), other
    errors pass unchanged. Put it outside the StagedFolder so the staging folder is gone first."""
    try:
        yield
    except KvforgeError:
        raise
    except Exception as err:
        if disk_full(err, Path(out_dir).absolute().parent):
            raise disk_full_error(out_dir, elsewhere) from err
        raise


def _hidden(out_dir: Path, tag: str) -> str:
    return f".{out_dir.name}.{tag}."


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def check_output(
    out_dir: Path, sources: list[Path], force: bool, marker: str, what: str = "kvforge export"
) -> None:
    """Refuse an output path that would destroy something: one that is or holds a source, lies
    inside a source, or exists and is not a `what` (no `marker` file) unless it is empty."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink():
        raise InputError(f"{out_dir} is a symbolic link; pass the folder it points to, or another -o")
    out = out_dir.resolve()
    for source in sources:
        source = Path(source).resolve()
        if out == source or out in source.parents:
            raise InputError(
                f"the output folder {out} is or contains the source {source}; replacing it would delete the "
                "source: choose another output folder"
            )
        if source in out.parents:
            raise InputError(f"the output folder {out} is inside the source {source}; choose a folder outside it")
    if not out.exists():
        return
    if not out.is_dir():
        raise InputError(f"{out} exists and is not a folder; choose another output folder")
    if _is_empty_dir(out):
        return
    if not (out / marker).is_file():
        raise InputError(
            f"{out} exists and is not a {what} (no {marker}); refusing to replace it: remove it yourself "
            "or choose another output folder"
        )
    if not force:
        raise InputError(f"{out} already exists; pass --force to replace it")


def _lock(path: Path) -> int | None:
    """An exclusive flock on a folder, held until the returned descriptor is closed (or the
    process dies). None if another live process holds it."""
    if fcntl is None:
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def clean_stale(out_dir: Path) -> list[Path]:
    """Delete staging folders of `out_dir` left by killed runs (no live process holds their lock);
    put back a set-aside old folder if a kill came between the two renames of a non-atomic swap.
    Returns what was removed."""
    out_dir = Path(out_dir)
    parent = out_dir.parent
    if not parent.is_dir() or fcntl is None:
        return []
    removed = []
    prefixes = (_hidden(out_dir, STAGING), _hidden(out_dir, LEGACY_STAGING), _hidden(out_dir, ASIDE))
    for entry in sorted(parent.iterdir(), key=lambda p: p.stat().st_mtime if p.exists() else 0, reverse=True):
        if not entry.name.startswith(prefixes) or entry.is_symlink() or not entry.is_dir():
            continue
        fd = _lock(entry)
        if fd is None:
            continue  # a live run is writing it
        try:
            if entry.name.startswith(_hidden(out_dir, ASIDE)) and not out_dir.exists():
                os.rename(entry, out_dir)  # the newest complete old folder goes back
                continue
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
        finally:
            os.close(fd)
    return removed


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2). False where the system or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


class StagedFolder:
    """`with StagedFolder(out_dir, marker) as staging: ...; staging.publish()`

    Writes go to `staging.path`; `publish()` puts it at `out_dir` (replacing an existing folder
    atomically); leaving the block without publishing deletes the staging folder."""

    def __init__(self, out_dir: Path, marker: str, what: str = "kvforge export",
                 sources: list[Path] | None = None, say: Callable[[str], None] | None = None,
                 force: bool = True) -> None:
        # force=False: a folder that appears at out_dir while this run writes (another run's) is not replaced
        self.force = force
        self.out_dir = Path(out_dir).resolve()
        self.marker = marker
        self.what = what
        self.sources = list(sources or [])
        self.say = say or (lambda _msg: None)
        self.path: Path | None = None
        self._fd: int | None = None

    def __enter__(self) -> StagedFolder:
        parent = self.out_dir.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
            for stale in clean_stale(self.out_dir):
                self.say(f"removed {stale.name}, left by an interrupted run")
            self.path = Path(tempfile.mkdtemp(prefix=_hidden(self.out_dir, STAGING), dir=parent))
        except OSError as err:
            raise InputError(
                f"cannot write the output folder {self.out_dir}: {err.strerror or err} ({err.filename or parent}); "
                "choose a writable location"
            ) from err
        self._fd = _lock(self.path)
        return self

    def publish(self) -> Path:
        """Move the staging folder into place; the old folder (if any) is swapped out, then deleted."""
        assert self.path is not None
        # Check again: the path may have changed since the run started.
        if not self.force and self.out_dir.exists():
            raise InputError(f"{self.out_dir} appeared while this run wrote its {self.what} (another run made it); "
                             "it was left as it is and nothing was written: pass --force to replace it")
        check_output(self.out_dir, self.sources, force=True, marker=self.marker, what=self.what)
        self.path.chmod(0o755)  # mkdtemp makes it private; an output folder is an ordinary folder
        fault_point("publish:before")
        if not self.out_dir.exists():
            os.rename(self.path, self.out_dir)
        elif _exchange(self.path, self.out_dir):
            # self.path now holds the old folder; delete it.
            fault_point("publish:swapped")
            self._remove_old(self.path)
        else:
            # No atomic swap here: set the old folder aside, move the new one in. A kill between
            # the two renames leaves the old folder aside, and the next run's clean_stale puts it back.
            aside = self.out_dir.parent / f"{_hidden(self.out_dir, ASIDE)}{secrets.token_hex(4)}"
            os.rename(self.out_dir, aside)
            fault_point("publish:aside")
            os.rename(self.path, self.out_dir)
            self._remove_old(aside)
        self.path = None
        return self.out_dir

    def _remove_old(self, old: Path) -> None:
        weights = sorted((p for p in old.iterdir() if p.is_file()), key=lambda p: -p.stat().st_size)
        if weights:
            weights[0].unlink()  # the largest file first: a kill from here on leaves an invalid folder
        fault_point("publish:deleting-old")
        shutil.rmtree(old, ignore_errors=True)

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.path = None
