"""The packed weights of a CPU target, saved once in the cache and memory-mapped by later loads.

Why: building the native target of the bundled model quantises every linear weight (quant.py, twice:
the format's values, then the kernel's int8 codes) and packs it into the kernel's panels: ~5 s of one
core at every `generate`, `serve` or `bench`. Both results depend only on the weights on disk, the weight
format asked for and the kernel build, so the first load saves them (one torch file per model and format)
and a later load maps the file (torch.load(mmap=True)) instead of recomputing.

A file holds what the two steps produced, in the order they produced it: the format's values of each
covered linear (quant.linear_layers order) with the format step's result, and each PackedLinear's panels
with its weight's shape and panel format. Its key covers the model directory's files (name, size,
modification time), the weights asked for, the kernel build key and the switches that choose a panel
layout. A file that does not load (truncated, damaged) is rebuilt with a note; an entry whose shapes
do not match what is being built is not used (and the file is written again).

Only a Target built from a local directory with the CPU kernel loaded has a session; tiny models built in
memory (the tests) and hub ids are packed as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from ..io import atomic_path, cache_dir, directory_files
from ..log import log

FILE_VERSION = 1  # bump when the saved layout changes
KEEP_PER_MODEL = 3  # saved files kept per model and format (other kernel builds' files beyond that are removed)
SWITCHES = ("DOMINOSPEC_BF16_DOT", "DOMINOSPEC_INT8_DOT_PATH")  # environment that changes a panel's layout

_active: contextvars.ContextVar[Session | None] = contextvars.ContextVar("panel_cache", default=None)


class Session:
    """One target's build: hands out a saved file's results in order, or records fresh ones to save."""

    def __init__(self, path: Path, key: dict, weights: str):
        self.path, self.key, self.weights = path, key, weights
        self.saved = _read(path, key)  # the saved entry, or None
        self.hit = self.saved is not None  # every result came from the file (False once one did not match)
        self.fresh = {"values": [], "format_result": None, "panels": []}  # what this build computed or took
        self._panel = 0

    def formatted(self, model, compute):
        """compute(model) rewrites the covered weights in place (quant.adopt_exact_format_ or apply_weight_format_)
        and returns its result; from a saved entry the values are copied back instead."""
        from .quant import linear_layers

        linears = linear_layers(model)
        saved = self.saved
        if saved is not None and [list(v.shape) for v in saved["values"]] == [list(w.weight.shape) for w in linears]:
            if hasattr(model, "use_weights"):  # a Checkpoint (checkpoint.py): the mapped values, not a copy
                model.use_weights(linears, saved["values"])
            else:
                with torch.no_grad():
                    for linear, values in zip(linears, saved["values"]):
                        linear.weight.copy_(values)
            self.fresh["values"], self.fresh["format_result"] = saved["values"], saved["format_result"]
            return saved["format_result"]
        self.hit = False
        result = compute(model)
        self.fresh["values"] = [w.weight.detach() for w in linears]
        self.fresh["format_result"] = result
        return result

    def take(self, shape: tuple, fmt: str):
        """The next saved (panels, scale, group) when it packs a weight of this shape and format, else None."""
        entries = self.saved["panels"] if self.saved is not None else []
        if self._panel < len(entries):
            e = entries[self._panel]
            if e["shape"] == list(shape) and e["format"] == fmt:
                self._panel += 1
                self.fresh["panels"].append(e)
                return e["panels"], e.get("scale"), e["group"]
        self.hit = False
        self.saved = None  # from here on everything is computed (and the file written again)
        return None

    def keep(self, shape: tuple, fmt: str, panels, scale, group: int) -> None:
        entry = {"shape": list(shape), "format": fmt, "panels": panels, "group": group}
        if scale is not None:
            entry["scale"] = scale
        self.fresh["panels"].append(entry)

    def save(self) -> None:
        """Write what this build computed (once; later loads map it)."""
        if self.hit or not self.fresh["panels"]:
            return
        t0 = time.perf_counter()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        entry = {"key": json.dumps(self.key, sort_keys=True), **self.fresh}
        try:
            with atomic_path(self.path) as tmp:
                torch.save(entry, tmp)
        except OSError as exc:  # a full or read-only cache costs the next start time, never this run
            log(f"could not save the packed weights to {self.path} ({exc}); the next start packs them again")
            return
        mb = self.path.stat().st_size / 2**20
        result = self.fresh["format_result"]  # --dtype auto: the format it chose
        weights = result if self.weights == "auto" and isinstance(result, str) else self.weights
        log(
            f"saved the packed {weights} weights to {self.path} ({mb:.0f} MB, {time.perf_counter() - t0:.1f} s; "
            "later starts map them instead of quantising)"
        )
        _prune(self.path)


def _read(path: Path, key: dict) -> dict | None:
    if not path.exists():
        return None
    try:
        entry = torch.load(path, mmap=True, weights_only=True)
        if entry.get("key") != json.dumps(key, sort_keys=True):
            return None
        if not isinstance(entry.get("values"), list) or not isinstance(entry.get("panels"), list):
            raise ValueError("its entries are missing")
        return entry
    except Exception as exc:  # any damage: rebuild, never fail a load over a cache
        log(f"note: the saved packed weights {path} do not load ({type(exc).__name__}: {exc}); packing them again")
        with contextlib.suppress(OSError):
            path.unlink()
        return None


def _prune(path: Path) -> None:
    """Keep the newest KEEP_PER_MODEL files of this model and format (other kernel builds' files)."""
    prefix = path.name.rsplit("-", 1)[0]
    same = sorted(path.parent.glob(f"{prefix}-*.pt"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in same[KEEP_PER_MODEL:]:
        with contextlib.suppress(OSError):
            old.unlink()


def model_files(model) -> tuple[Path, list] | None:
    """(directory, [name, size, mtime_ns] of each file in it) for a model loaded from a local directory, else None."""
    where = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    directory = Path(where)
    if not where or not directory.is_dir():
        return None
    return directory.resolve(), directory_files(directory)


@contextlib.contextmanager
def saved_packing(model, weights: str | None, kernel_build):
    """While a Target builds its weights and native model: saved results are used, fresh ones saved at the end.
    kernel_build(): the CPU kernel's build key, loading it, or None without one (kernels.py).
    Yields the Session, or None where nothing is cached (not a local directory, no kernel, not an fp32 CPU model)."""
    found = model_files(model)
    head = model.get_output_embeddings()
    cpu_fp32 = head is not None and head.weight.device.type == "cpu" and head.weight.dtype == torch.float32
    build = kernel_build() if found is not None and cpu_fp32 else None
    if build is None:
        yield None
        return
    directory, files = found
    weights = weights or "float32"
    key = {
        "version": FILE_VERSION,
        "model": str(directory),
        "files": files,
        "weights": weights,
        "kernel": build,
        "switches": {name: os.environ.get(name, "") for name in SWITCHES},
    }
    name = hashlib.sha256(str(directory).encode()).hexdigest()[:12]
    full = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    s = Session(cache_dir() / "panels" / f"{directory.name}-{name}-{weights}-{full}.pt", key, weights)
    token = _active.set(s)
    try:
        yield s
    finally:
        _active.reset(token)
    s.save()


def formatted_weights(model, compute):
    """compute(model) (a weight format applied in place), or its saved result inside a session."""
    s = _active.get()
    return compute(model) if s is None else s.formatted(model, compute)


def saved_panels(shape: tuple, fmt: str):
    """PackedLinear's hook: saved (panels, scale, group) for the next weight, or None (pack it, then `keep_panels`)."""
    s = _active.get()
    return None if s is None else s.take(shape, fmt)


def keep_panels(shape: tuple, fmt: str, panels, scale, group: int) -> None:
    s = _active.get()
    if s is not None:
        s.keep(shape, fmt, panels, scale, group)
