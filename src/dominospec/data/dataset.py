"""Reading a prepare-data directory back: the trainer's entry point.

On disk (DIR):
    meta.json              format "dominospec-data/1": target, vocab size, tokenizer and chat
                           template fingerprints, EOS ids, generation settings, prompt sources
                           and, once complete, counts
    samples-00000.jsonl    one sample per line: {"id", "input_ids", "loss_mask"}
    samples-00000.stats.json  counts for that shard (empty answers, truncations, tokens, ...)
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import DominoError
from ..io import json_field, read_json_object, shared_lock
from ..log import log
from .store import (
    SHARD_NAME,
    SHARED,
    check_no_unlisted_parts,
    check_part_files,
    is_dataset,
    read_manifest,
    read_npz_shard,
)

FORMAT = "dominospec-data/1"


def read_meta(data_dir: Path) -> dict | None:
    """DIR/meta.json, checked (None when there is none)."""
    path = data_dir / "meta.json"
    if not path.exists() and not path.is_symlink():
        return None
    meta = read_json_object(path, "a prepare-data meta.json")
    if meta.get("format") != FORMAT:
        raise DominoError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    json_field(meta, "vocab_size", int, str(path))
    counts = json_field(meta, "counts", dict, str(path), optional=True)
    if counts is not None:
        json_field(counts, "samples", int, f"{path} counts")
    return meta


def check_data_dir(data_dir: str | Path, flag: str = "--data") -> None:
    """A quick look before any model loads: DIR is a prepare-data directory or data set whose
    meta.json / manifest.json is sound (the samples are checked when they are read)."""
    d = Path(data_dir)
    if not d.is_dir():
        raise DominoError(f"{flag} {d}: {'not a directory' if d.exists() else 'no such directory'}")
    if is_dataset(d):
        read_manifest(d)
    elif read_meta(d) is None:
        raise DominoError(
            f"{flag} {d} is not a dominospec data directory (no meta.json or manifest.json); make one with "
            "`dominospec prepare-data`"
        )


def load_dataset_dir(data_dir: str | Path, target=None, allow_other_target: bool = False) -> tuple[dict, list[dict]]:
    """(meta, samples) of a prepare-data directory, validated; with a target, checks it is the same tokenizer.

    Data written by another target is refused even when the tokenizer is the same (its answers
    are that model's, not this one's) unless allow_other_target. Files are read as utf-8-sig, so
    a byte-order mark added by an editor is not taken for part of the first line.
    """
    d = Path(data_dir)
    if is_dataset(d):
        with shared_lock(d):  # an add in progress finishes first
            return _load_parts(d, target, allow_other_target)
    if is_dataset(d.parent) and d.name in {p["name"] for p in read_manifest(d.parent)["parts"]}:
        with shared_lock(d.parent):  # one part of a data set (DATASET/part-000): what a drafter trained on then
            return _load_parts(d.parent, target, allow_other_target, only=d.name)
    meta = read_meta(d)
    if meta is None:
        raise DominoError(
            f"{d} is not a dominospec data directory (no meta.json or manifest.json); make one with "
            "`dominospec prepare-data`"
        )
    meta.setdefault("enable_thinking", False)  # runs made before the switch existed had it off
    vocab_size = meta["vocab_size"]
    if target is not None:
        _check_target(meta, target, d, allow_other_target)
        vocab_size = target.vocab_size
    if not meta.get("complete"):
        log(
            f"warning: {d} is incomplete (prepare-data was interrupted); using the finished shards. "
            "Rerun prepare-data with the same arguments to finish it"
        )
    samples, seen = [], set()
    for path in sorted(d.glob("samples-*.jsonl")):
        for where, sample in _read_jsonl(path, vocab_size):
            _add_unique(sample, where, samples, seen)
    if not samples:
        raise DominoError(f"{d} holds no samples")
    return meta, samples


def _load_parts(d: Path, target, allow_other_target: bool, only: str | None = None) -> tuple[dict, list[dict]]:
    """A data set of parts: every part's compact shards (or the part named `only`), sample ids prefixed
    with their part."""
    manifest = read_manifest(d)
    parts = [p for p in manifest["parts"] if only is None or p["name"] == only]
    meta = {
        **{k: manifest.get(k) for k in SHARED},
        "target_sha256": manifest.get("target_sha256"),
        "target_precision": manifest.get("target_precision"),
        "format": manifest["format"],
        "complete": True,
        "parts": [p["name"] for p in parts],
        "counts": manifest.get("counts") if only is None else parts[0].get("counts"),
    }
    modes = {bool(p["settings"].get("enable_thinking")) for p in parts}
    meta["enable_thinking"] = modes.pop() if len(modes) == 1 else None  # None: parts made in both modes
    vocab_size = meta["vocab_size"]
    if target is not None:
        _check_target(meta, target, d, allow_other_target)
        vocab_size = target.vocab_size
    check_no_unlisted_parts(d, manifest)
    samples, seen = [], set()
    for entry in parts:
        check_part_files(d, entry)
        for path in sorted(d / entry["name"] / f for f in entry["files"] if SHARD_NAME.fullmatch(f)):
            for n, sample in enumerate(read_npz_shard(path)):
                sample["id"] = f"{entry['name']}:{sample['id']}"  # ":" keeps "/turn" as the split mark
                _check_sample(sample, vocab_size, f"{path} sample {n}")
                _add_unique(sample, f"{path} sample {n}", samples, seen)
    if not samples:
        raise DominoError(f"{d} holds no samples")
    return meta, samples


def iter_shard(path: Path, vocab_size: int):
    """The samples of one JSONL shard, each checked."""
    for _, sample in _read_jsonl(path, vocab_size):
        yield sample


def _read_jsonl(path: Path, vocab_size: int):
    if not path.is_file():
        raise DominoError(f"{path} is not a file (a shard of samples is a JSONL file)")
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise DominoError(f"{where}: not UTF-8 text (byte {exc.start + 1} of the line); damaged?") from None
            yield where, _parse_sample(line, vocab_size, where)


def _add_unique(sample: dict, where: str, samples: list[dict], seen: set) -> None:
    if sample["id"] in seen:
        raise DominoError(f"{where}: sample id {sample['id']!r} appears twice")
    seen.add(sample["id"])
    samples.append(sample)


def _check_target(meta: dict, target, d: Path, allow_other_target: bool) -> None:
    if meta["vocab_size"] != target.vocab_size:
        raise DominoError(
            f"data {d} was made for a vocabulary of {meta['vocab_size']} tokens "
            f"(target {meta['target']!r}), but target {target.name!r} has {target.vocab_size}"
        )
    ours, theirs = meta.get("tokenizer_sha256"), target.tokenizer_fingerprint
    if ours and theirs and ours != theirs:
        raise DominoError(
            f"data {d} was made with another tokenizer (target {meta['target']!r}, tokenizer "
            f"sha256 {ours[:16]}...) than target {target.name!r} (sha256 {theirs[:16]}...)"
        )
    if not allow_other_target and other_precision(meta, target_record(target)):
        raise DominoError(
            f"data {d} was made by target {meta['target']!r} computing in {meta['target_precision']}, but this "
            f"run's target computes in {target.precision} (--dtype): a drafter learns the model that wrote its "
            "data, weight format included. Make data with the same --dtype, or pass --allow-other-target to "
            "train on it anyway"
        )
    if not allow_other_target and not same_target(meta, target):
        raise DominoError(
            f"data {d} was written by target {meta.get('target')!r}, but this run trains for target "
            f"{target.name!r}: a drafter learns to predict the model that wrote its data. Make data "
            f"with this target (dominospec prepare-data --target {target.name}), or pass "
            "--allow-other-target to train on it anyway"
        )


def same_target(recorded: dict, target) -> bool:
    """A record (meta.json, manifest) names `target` (a Target or another record): the same content
    fingerprint where both have one, else the same name or two spellings of one model directory."""
    other = target if isinstance(target, dict) else target_record(target)
    if other_precision(recorded, other):
        return False
    a, b = recorded.get("target_sha256"), other.get("target_sha256")
    if a and b:
        return a == b
    return _same_model(recorded.get("target"), other.get("target"))


def other_precision(recorded: dict, other: dict) -> bool:
    """Both records say how their target computed (fp32, bf16 or int8 weights, ...), and they differ.
    Data made before targets recorded it matches any."""
    a, b = recorded.get("target_precision"), other.get("target_precision")
    return bool(a and b and a != b)


def target_record(target) -> dict:
    """How data records its target: the name it was loaded under, its content fingerprint (the weights
    as loaded) and the precision it computed in (Target.precision: its weight format)."""
    return {
        "target": target.name,
        "target_sha256": getattr(target, "fingerprint", None),
        "target_precision": getattr(target, "precision", None),
    }


def _same_model(recorded: str | None, name: str | None) -> bool:
    """The same name, or two spellings of the same model directory."""
    if recorded == name:
        return True
    if recorded is None or name is None:
        return False
    a, b = Path(recorded), Path(name)
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()


def _parse_sample(line: str, vocab_size: int, where: str) -> dict:
    try:
        sample = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DominoError(f"{where}: bad JSON ({exc.msg})") from None
    return _check_sample(sample, vocab_size, where)


def _check_sample(sample: dict, vocab_size: int, where: str) -> dict:
    ids, mask = sample.get("input_ids"), sample.get("loss_mask")
    if not isinstance(sample.get("id"), str) or not isinstance(ids, list) or not isinstance(mask, list):
        raise DominoError(f"{where}: a sample needs id (string), input_ids and loss_mask (lists)")
    if len(ids) != len(mask):
        raise DominoError(f"{where}: {len(ids)} input_ids but {len(mask)} loss_mask entries")
    bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise DominoError(f"{where}: token id {bad!r} outside the vocabulary (size {vocab_size})")
    if any(m not in (0, 1) for m in mask):
        raise DominoError(f"{where}: loss_mask must hold only 0 and 1")
    if not any(mask):
        raise DominoError(f"{where}: sample {sample['id']!r} has no supervised token (all of loss_mask is 0)")
    return sample
