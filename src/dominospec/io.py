"""Files: atomic writes, directory locks, the cache directory, writability checks.

Every file dominospec writes goes through `atomic_path`: readers see the old file or the whole
new one, never a part, even after kill -9 (write a temporary sibling, fsync, rename).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import DominoError


def cache_dir() -> Path:
    """Where converted models and device profiles are kept; override with DOMINOSPEC_CACHE."""
    root = os.environ.get("DOMINOSPEC_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dominospec"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling of `path` to write; on success it is fsynced and renamed onto `path`.

    Works for files and for directories (a directory replaces an existing one whole).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    _remove(tmp)
    try:
        yield tmp
        if tmp.is_file():
            _fsync_path(tmp)
        if tmp.is_dir() and path.is_dir():
            old = path.with_name(f".{path.name}.old{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old)
        else:
            os.replace(tmp, path)
    finally:
        _remove(tmp)


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    with atomic_path(path) as tmp:
        if isinstance(data, bytes):
            tmp.write_bytes(data)
        else:
            tmp.write_text(data, encoding="utf-8")


def write_json_atomic(path: str | os.PathLike, obj, indent: int | None = 1) -> None:
    """JSON that is always valid: NaN and infinity are refused instead of written."""
    write_atomic(path, json.dumps(obj, indent=indent, allow_nan=False) + "\n")


def write_lines_atomic(path: str | os.PathLike, lines: list[str]) -> None:
    write_atomic(path, "".join(line + "\n" for line in lines))


def is_temporary(path: Path) -> bool:
    """True for the leftovers of a write that was killed before its rename."""
    return path.name.startswith(".") and (".tmp" in path.name or ".old" in path.name)


@contextmanager
def exclusive_lock(directory: str | os.PathLike, what: str) -> Iterator[None]:
    """Hold DIR/.lock for the duration; a second holder gets a clear error instead of a race.

    `what` names the kind of run, for the message ("prepare-data", "train").
    """
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; one run at a time is then the user's job
        yield
        return
    d = Path(directory)
    with open(d / ".lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise DominoError(f"another {what} run is writing {d} (it holds {d / '.lock'})") from None
        yield


def ensure_writable_dir(directory: str | os.PathLike, flag: str = "--out") -> Path:
    """Create `directory` if needed and prove a file can be written there, before any work starts."""
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise DominoError(f"{flag} {d} exists and is not a directory")
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise DominoError(f"{flag} {d} is not writable ({exc.strerror or exc})") from None
    return d
