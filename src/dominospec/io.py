"""Files: atomic writes, directory locks, the cache directory, writability and free-space checks,
and reading JSON with one clear message per kind of damage (`read_json`, `json_field`, ...).

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


def directory_files(directory: Path) -> list[list]:
    """[name, size, mtime_ns] of each file in a directory (hidden ones aside): what a cache of something read from
    a model directory is keyed by."""
    files = sorted(f for f in Path(directory).iterdir() if f.is_file() and not f.name.startswith("."))
    return [[f.name, st.st_size, st.st_mtime_ns] for f in files for st in [f.stat()]]


def is_temporary(path: Path) -> bool:
    """True for the leftovers of a write that was killed before its rename."""
    return path.name.startswith(".") and (".tmp" in path.name or ".old" in path.name)


@contextmanager
def exclusive_lock(directory: str | os.PathLike, what: str, wait: bool = False, report=None) -> Iterator[None]:
    """Hold DIR/.lock (fcntl.flock) for the duration, so two runs never write DIR at once.

    `what` names the kind of run, for the message ("prepare-data", "train"). Without `wait` a second
    holder gets a clear error; with it, it waits its turn (saying so through `report`), which is
    what short critical sections such as adding a part to a data set want.
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
            if not wait:
                raise DominoError(f"another {what} run is writing {d} (it holds {d / '.lock'})") from None
            if report:
                report(f"waiting for another {what} run to finish writing {d}")
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


_CREATED: list[Path] = []  # directories ensure_writable_dir made in this process, outermost first


@contextmanager
def shared_lock(directory: str | os.PathLike) -> Iterator[None]:
    """Read DIR while no exclusive_lock holder writes it (waits for one to finish); readers share.

    Needs no write access: without a DIR/.lock nobody has ever written under the lock.
    """
    lock = Path(directory) / ".lock"
    try:
        import fcntl

        handle = open(lock)  # noqa: SIM115 (held for the duration)
    except (ImportError, OSError):
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        yield


def ensure_writable_dir(directory: str | os.PathLike, flag: str = "--out") -> Path:
    """Create `directory` if needed and prove a file can be written there, before any work starts.

    What it creates is remembered: `remove_unused_dirs` takes it away again when the run is refused
    before writing anything, so a rejected command leaves no empty folder behind.
    """
    d = Path(directory)
    if d.exists() and not d.is_dir():
        raise DominoError(f"{flag} {d} exists and is not a directory")
    missing = [p for p in reversed([d, *d.parents]) if not p.exists()]
    try:
        d.mkdir(parents=True, exist_ok=True)
        _CREATED.extend(p for p in missing if p not in _CREATED)
        probe = d / f".write-test.{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise DominoError(f"{flag} {d} is not writable ({exc.strerror or exc})") from None
    return d


def forget_created_dirs() -> None:
    """Start a new command: what earlier commands in this process created is theirs."""
    _CREATED.clear()


def remove_unused_dirs() -> None:
    """Remove the directories ensure_writable_dir created that are still empty (a lock file aside)."""
    for d in reversed(_CREATED):
        try:
            if d.is_dir() and all(p.name == ".lock" for p in d.iterdir()):
                shutil.rmtree(d)
        except OSError:
            pass  # best effort: never hide the error that brought us here
    _CREATED.clear()


def check_free_space(directory: str | os.PathLike, needed_bytes: int, flag: str = "--out") -> None:
    """Refuse up front when the file system holding `directory` has less than `needed_bytes` free."""
    d = Path(directory)
    while not d.exists() and d != d.parent:
        d = d.parent
    free = shutil.disk_usage(d).free
    if free < needed_bytes:
        raise DominoError(
            f"{flag} {directory}: only {free / 2**20:.1f} MiB free on its disk, this needs about "
            f"{needed_bytes / 2**20:.1f} MiB"
        )


# ----- reading JSON the program relies on: one clear message per kind of damage -----


def read_json(path: str | os.PathLike, what: str = "") -> object:
    """The parsed content of a JSON file, or a DominoError naming the file and what is wrong with it.

    `what` says what the file should be ("a data set manifest"), for the message.
    """
    p = Path(path)
    kind = f" ({what})" if what else ""
    if p.is_dir():
        raise DominoError(f"{p} is a directory, expected a JSON file{kind}")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise DominoError(f"{p}: no such file{kind}") from None
    except OSError as exc:
        raise DominoError(f"{p} cannot be read ({exc.strerror or exc}){kind}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DominoError(f"{p} is not UTF-8 text (byte {exc.start}){kind}: damaged?") from None
    if not text.strip():
        raise DominoError(f"{p} is empty{kind}: a write that never finished?")
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise DominoError(f"{p} is not valid JSON{kind}: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None


def read_json_object(path: str | os.PathLike, what: str = "") -> dict:
    """read_json, refusing anything but a JSON object."""
    data = read_json(path, what)
    if not isinstance(data, dict):
        raise DominoError(f"{path}: expected a JSON object{f' ({what})' if what else ''}, found {_json_kind(data)}")
    return data


def json_field(obj: dict, key: str, kinds: type | tuple, where: str, optional: bool = False):
    """obj[key] checked to be one of `kinds` (bool is never taken for a number); `where` names the file/entry."""
    if key not in obj or obj[key] is None:
        if optional:
            return None
        raise DominoError(f"{where}: missing {key!r}" if key not in obj else f"{where}: {key!r} is null")
    value = obj[key]
    kinds = kinds if isinstance(kinds, tuple) else (kinds,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = " or ".join(_KIND_NAMES.get(k, k.__name__) for k in kinds)
        raise DominoError(f"{where}: {key!r} must be {names}, found {_json_kind(value)}")
    return value


def probabilities(values, where: str) -> list[float]:
    """A non-empty list of finite numbers in [0, 1] (acceptance rates, confidences), or a clear refusal."""
    if not isinstance(values, list) or not values:
        raise DominoError(f"{where}: expected a non-empty list of probabilities, found {_json_kind(values)}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:  # NaN fails both
            raise DominoError(f"{where}: entry {i} is {v!r}; each must be a number in [0, 1]")
        out.append(float(v))
    return out


def positive_numbers(values, where: str) -> list[float]:
    """A non-empty list of finite numbers > 0 (temperatures, timings), or a clear refusal."""
    if not isinstance(values, list) or not values:
        raise DominoError(f"{where}: expected a non-empty list of positive numbers, found {_json_kind(values)}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 < v < float("inf"):
            raise DominoError(f"{where}: entry {i} is {v!r}; each must be a finite number above 0")
        out.append(float(v))
    return out


_KIND_NAMES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true/false",
}


def _json_kind(value) -> str:
    if value is None:
        return "null"
    return _KIND_NAMES.get(type(value), type(value).__name__)
