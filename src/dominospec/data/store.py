"""Data that accumulates: a data set made of parts, each one prepare-data run, stored compactly.

On disk (DIR):
    manifest.json          format "dominospec-dataset/1": the target, vocabulary size, tokenizer and
                           chat-template fingerprints and EOS ids every part shares, and one entry per
                           part (its prompt sources, sampling settings, counts, file checksums)
    part-000/meta.json     the prepare-data meta.json of that run, as it was
    part-000/prompts.jsonl.gz   the run's conversations (id and user turns), so anyone can check
                           what the data was made from (held-out prompts, for one)
    part-000/samples-00000.npz  token ids as uint16 (uint32 for larger vocabularies), loss masks as
                           packed bits, sample lengths and ids; zlib-compressed. A shard holding
                           off-policy samples also has "labels" (per sample: "on-policy" or
                           "target-argmax"); shards without it are all on-policy

A part, once added, is never rewritten: extending a data set adds part-001, part-002, ... and
leaves the earlier files byte for byte as they were. Every part must come from the same target
and tokenizer; adding one from another is refused, naming what differs.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
import zipfile
from pathlib import Path

import numpy as np

from ..errors import DominoError
from ..io import atomic_path, is_temporary, json_field, read_json_object

MANIFEST = "manifest.json"
ON_POLICY = "on-policy"  # a sample's labels when it says nothing else: the target wrote its supervised tokens
FORMAT = "dominospec-dataset/1"
SHARED = ("target", "vocab_size", "tokenizer_sha256", "chat_template_sha256", "eos_ids")
PART_SETTINGS = (
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "batch_size",
    "enable_thinking",
    "sampler",
    "prompts_sha256",
    "conversations_total",
)
PART_NAME = re.compile(r"part-\d{3,}")
SHARD_NAME = re.compile(r"samples-\d{5}\.npz")
SHA256 = re.compile(r"[0-9a-f]{64}")


def is_dataset(d: Path) -> bool:
    return (Path(d) / MANIFEST).exists()


def read_manifest(d: Path) -> dict:
    """DIR/manifest.json, checked: every kind of damage is refused with its own message."""
    path = Path(d) / MANIFEST
    manifest = read_json_object(path, "a data set manifest")
    if manifest.get("format") != FORMAT:
        raise DominoError(f"{path}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    parts = json_field(manifest, "parts", list, str(path))
    names = set()
    for i, entry in enumerate(parts):
        where = f"{path}, part {i}"
        if not isinstance(entry, dict):
            raise DominoError(f"{where}: expected an object, found {type(entry).__name__}")
        name = json_field(entry, "name", str, where)
        if not PART_NAME.fullmatch(name) or name in names:
            raise DominoError(f"{where}: name {name!r} is not a new part-NNN name")
        names.add(name)
        where = f"{path}, {name}"
        json_field(entry, "settings", dict, where)
        counts = json_field(entry, "counts", dict, where)
        json_field(counts, "samples", int, f"{where} counts")
        files = json_field(entry, "files", dict, where)
        if not files:
            raise DominoError(f"{where}: 'files' lists no file, so nothing could be checked; the part is damaged")
        if not any(SHARD_NAME.fullmatch(f) for f in files):
            raise DominoError(f"{where}: 'files' lists no samples-NNNNN.npz shard")
        for f, digest in files.items():
            if Path(f).name != f or f.startswith(".") or not (isinstance(digest, str) and SHA256.fullmatch(digest)):
                raise DominoError(f"{where}: file entry {f!r}: {digest!r} is not a file name and its sha256")
    return manifest


def write_npz_shard(path: Path, samples: list[dict], vocab_size: int) -> None:
    dtype = np.uint16 if vocab_size <= 2**16 else np.uint32
    ids = np.concatenate([np.asarray(s["input_ids"], dtype=dtype) for s in samples]) if samples else np.zeros(0, dtype)
    mask = (
        np.concatenate([np.asarray(s["loss_mask"], dtype=np.uint8) for s in samples])
        if samples
        else np.zeros(0, np.uint8)
    )
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            lengths = np.asarray([len(s["input_ids"]) for s in samples], dtype=np.int64)
            names = np.asarray([s["id"] for s in samples])
            kinds = [s.get("labels", ON_POLICY) for s in samples]
            # only shards holding off-policy samples get the array: on-policy shards stay as they were
            extra = {"labels": np.asarray(kinds)} if any(k != ON_POLICY for k in kinds) else {}
            np.savez_compressed(f, ids=ids, mask=np.packbits(mask), length=lengths, sample_id=names, **extra)


def read_npz_shard(path: Path) -> list[dict]:
    try:
        with np.load(path, allow_pickle=False) as z:
            ids, packed, lengths, names = z["ids"], z["mask"], z["length"], z["sample_id"]
            kinds = z["labels"].tolist() if "labels" in z.files else [ON_POLICY] * len(names)
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as exc:
        raise DominoError(f"{path}: not a readable compact shard ({exc})") from None
    if int(lengths.sum()) != ids.shape[0] or len(names) != len(lengths) or len(kinds) != len(names):
        raise DominoError(
            f"{path}: lengths ({int(lengths.sum())} tokens, {len(names)} ids) do not match its {ids.shape[0]} token ids"
        )
    if ids.ndim != 1 or lengths.ndim != 1 or packed.shape[0] * 8 < ids.shape[0] or (lengths < 0).any():
        raise DominoError(f"{path}: not a readable compact shard (arrays of the wrong shape)")
    mask = np.unpackbits(packed)[: ids.shape[0]]
    out, start = [], 0
    for name, n, kind in zip(names.tolist(), lengths.tolist(), kinds):
        sample = {"id": name, "input_ids": ids[start : start + n].tolist()}
        sample["loss_mask"] = mask[start : start + n].tolist()
        if kind != ON_POLICY:
            sample["labels"] = kind  # off-policy: how its loss mask was chosen (offpolicy.py)
        out.append(sample)
        start += n
    return out


def check_part_files(dataset: Path, entry: dict) -> None:
    """A part's files are exactly the ones the manifest recorded: none edited, lost or added since."""
    part = dataset / entry["name"]
    if not part.is_dir():
        raise DominoError(f"{part} is listed in {dataset / MANIFEST} but is not a directory")
    for name, digest in entry["files"].items():
        path = part / name
        if not path.exists():
            raise DominoError(f"{path} is listed in {dataset / MANIFEST} but missing")
        if not path.is_file():
            raise DominoError(f"{path} is listed in {dataset / MANIFEST} as a file but is a {_kind(path)}")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise DominoError(
                f"{path} differs from the checksum in {dataset / MANIFEST}: the part was changed after it was added"
            )
    extra = sorted(p.name for p in part.iterdir() if p.name not in entry["files"])
    if extra:
        raise DominoError(
            f"{part / extra[0]} is not listed in {dataset / MANIFEST}"
            f"{f' (nor {len(extra) - 1} more)' if len(extra) > 1 else ''}: a part holds only the files it was "
            "added with; remove what was put there since"
        )


def check_no_unlisted_parts(dataset: Path, manifest: dict) -> None:
    """Every part-NNN directory of a data set is in its manifest (one that is not was never checked)."""
    listed = {p["name"] for p in manifest["parts"]}
    for p in sorted(Path(dataset).iterdir()):
        if PART_NAME.fullmatch(p.name) and p.name not in listed:
            raise DominoError(
                f"{p} is not listed in {Path(dataset) / MANIFEST}, so its samples could not be checked "
                "(an add that was killed before it was recorded?); remove it, then rerun that prepare-data --extend"
            )


def _kind(path: Path) -> str:
    return "directory" if path.is_dir() else "special file"


def stale_temporaries(dataset: Path) -> list[Path]:
    """Leftovers of adds killed before their rename (only safe to remove while holding the data set's lock)."""
    return [p for p in Path(dataset).iterdir() if is_temporary(p)]


def dataset_prompts(dataset: Path) -> list[dict]:
    """Every stored conversation ({id, turns, part}) of a data set's parts."""
    out = []
    for entry in read_manifest(dataset)["parts"]:
        path = Path(dataset) / entry["name"] / "prompts.jsonl.gz"
        if path.exists():
            with gzip.open(path, "rt", encoding="utf-8") as f:
                out += [{**json.loads(line), "part": entry["name"]} for line in f if line.strip()]
    return out
