"""Data that accumulates: a data set made of parts, each one prepare-data run, stored compactly.

On disk (DIR):
    manifest.json          format "dominospec-dataset/1": the target, vocabulary size, tokenizer and
                           chat-template fingerprints and EOS ids every part shares, and one entry per
                           part (its prompt sources, sampling settings, counts, file checksums)
    part-000/meta.json     the prepare-data meta.json of that run, as it was
    part-000/prompts.jsonl.gz   the run's conversations (id and user turns), so anyone can check
                           what the data was made from (held-out prompts, for one)
    part-000/samples-00000.npz  token ids as uint16 (uint32 for larger vocabularies), loss masks as
                           packed bits, sample lengths and ids; zlib-compressed

A part, once added, is never rewritten: extending a data set adds part-001, part-002, ... and
leaves the earlier files byte for byte as they were. Every part must come from the same target
and tokenizer; adding one from another is refused, naming what differs.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np

from ..errors import DominoError
from ..io import atomic_path

MANIFEST = "manifest.json"
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
    "prompts_sha256",
    "conversations_total",
)


def is_dataset(d: Path) -> bool:
    return (Path(d) / MANIFEST).exists()


def read_manifest(d: Path) -> dict:
    path = Path(d) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as exc:
        raise DominoError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DominoError(
            f"{path}: format {manifest.get('format') if isinstance(manifest, dict) else None!r}, expected {FORMAT!r}"
        )
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
            np.savez_compressed(f, ids=ids, mask=np.packbits(mask), length=lengths, sample_id=names)


def read_npz_shard(path: Path) -> list[dict]:
    try:
        with np.load(path, allow_pickle=False) as z:
            ids, packed, lengths, names = z["ids"], z["mask"], z["length"], z["sample_id"]
    except (OSError, ValueError, KeyError) as exc:
        raise DominoError(f"{path}: not a readable compact shard ({exc})") from None
    if int(lengths.sum()) != ids.shape[0] or len(names) != len(lengths):
        raise DominoError(
            f"{path}: lengths ({int(lengths.sum())} tokens, {len(names)} ids) do not match its {ids.shape[0]} token ids"
        )
    mask = np.unpackbits(packed)[: ids.shape[0]]
    out, start = [], 0
    for name, n in zip(names.tolist(), lengths.tolist()):
        out.append(
            {"id": name, "input_ids": ids[start : start + n].tolist(), "loss_mask": mask[start : start + n].tolist()}
        )
        start += n
    return out


def check_part_files(dataset: Path, entry: dict) -> None:
    """A part's files are the ones the manifest recorded (nothing edited or lost since)."""
    part = dataset / entry["name"]
    for name, digest in entry["files"].items():
        path = part / name
        if not path.exists():
            raise DominoError(f"{path} is listed in {dataset / MANIFEST} but missing")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise DominoError(
                f"{path} differs from the checksum in {dataset / MANIFEST}: the part was changed after it was added"
            )


def dataset_prompts(dataset: Path) -> list[dict]:
    """Every stored conversation ({id, turns, part}) of a data set's parts."""
    out = []
    for entry in read_manifest(dataset)["parts"]:
        path = Path(dataset) / entry["name"] / "prompts.jsonl.gz"
        if path.exists():
            with gzip.open(path, "rt", encoding="utf-8") as f:
                out += [{**json.loads(line), "part": entry["name"]} for line in f if line.strip()]
    return out
