"""`prepare-data --extend`: adding a finished prepare-data run to a data set as its next part (see store.py)."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
from pathlib import Path

from ..errors import DominoError
from ..io import write_json_atomic
from .dataset import iter_shard, read_meta
from .prompts import prompts_fingerprint
from .store import FORMAT, MANIFEST, PART_SETTINGS, SHARED, is_dataset, read_manifest, write_npz_shard


def add_part(dataset: str | Path, run_dir: str | Path, conversations=None, exist_ok: bool = False) -> dict:
    """Append a complete prepare-data directory to `dataset` (created if new) as its next compact part.

    conversations: the run's prompts (Conversation list) to store with it; checked against the
    run's prompt fingerprint. Returns the part's manifest entry (with exist_ok, the entry of the
    part that already holds this run, if one does).
    """
    dataset, run_dir = Path(dataset), Path(run_dir)
    meta = read_meta(run_dir)
    if meta is None or not meta.get("complete"):
        raise DominoError(
            f"{run_dir} is not a complete prepare-data directory; finish it before adding it to {dataset}"
        )
    if conversations is not None and prompts_fingerprint(conversations) != meta["prompts_sha256"]:
        raise DominoError(
            f"the prompts given for {run_dir} are not the ones it was made from (prompt fingerprint differs)"
        )
    manifest = (
        read_manifest(dataset)
        if is_dataset(dataset)
        else {"format": FORMAT, "parts": [], **{k: meta.get(k) for k in SHARED}}
    )
    diffs = _shared_differences(manifest, meta, f"in {dataset}", f"in {run_dir}")
    if diffs:
        raise DominoError(f"cannot add {run_dir} to {dataset}: it was made by another target or tokenizer ({diffs})")
    same = [p["name"] for p in manifest["parts"] if all(p["settings"].get(k) == meta.get(k) for k in PART_SETTINGS)]
    if same and exist_ok:
        return next(p for p in manifest["parts"] if p["name"] == same[0])
    if same:
        raise DominoError(f"{run_dir} is already in {dataset} as {same[0]} (same prompts and settings)")
    name = f"part-{len(manifest['parts']):03d}"
    part = dataset / name
    if part.exists():
        raise DominoError(f"{part} exists but is not in {dataset / MANIFEST}; remove it (a killed earlier add)")
    tmp = dataset / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    shutil.copyfile(run_dir / "meta.json", tmp / "meta.json")
    if conversations is not None:
        lines = "".join(
            json.dumps({"id": c.id, "turns": list(c.turns)}, ensure_ascii=False) + "\n" for c in conversations
        )
        with gzip.GzipFile(tmp / "prompts.jsonl.gz", "wb", mtime=0) as f:  # mtime 0: same bytes every time
            f.write(lines.encode("utf-8"))
    for shard in sorted(run_dir.glob("samples-*.jsonl")):
        write_npz_shard(tmp / (shard.stem + ".npz"), list(iter_shard(shard, meta["vocab_size"])), meta["vocab_size"])
    files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(tmp.iterdir())}
    entry = {
        "name": name,
        "settings": {k: meta.get(k) for k in PART_SETTINGS},
        "prompt_sources": meta.get("prompt_sources", []),
        "counts": meta["counts"],
        "files": files,
        "created": meta.get("created"),
        "dominospec_version": meta.get("dominospec_version"),
    }
    tmp.rename(part)
    manifest["parts"].append(entry)
    manifest["counts"] = {
        k: sum(p["counts"].get(k, 0) for p in manifest["parts"])
        for k in ("conversations", "samples", "tokens", "supervised_tokens", "generated_tokens")
    }
    write_json_atomic(dataset / MANIFEST, manifest, indent=1)
    return entry


def check_extendable(dataset: str | Path, target) -> None:
    """Before any generation: refuse to extend a data set made by another target or tokenizer."""
    dataset = Path(dataset)
    if not is_dataset(dataset):
        if dataset.exists() and any(p.name != ".lock" for p in dataset.iterdir()):
            raise DominoError(f"--extend {dataset} is not empty and holds no {MANIFEST}; refusing to add parts there")
        return
    mine = {
        "target": target.name,
        "vocab_size": target.vocab_size,
        "tokenizer_sha256": target.tokenizer_fingerprint,
        "chat_template_sha256": target.chat_template_fingerprint,
        "eos_ids": list(target.eos_ids),
    }
    diffs = _shared_differences(read_manifest(dataset), mine, "there", "now")
    if diffs:
        raise DominoError(f"--extend {dataset} was made by another target or tokenizer ({diffs})")


def _shared_differences(manifest: dict, other: dict, there: str, here: str) -> str:
    """The fields every part of a data set shares (SHARED) where `other` differs, one clause each; "" if none."""
    return "; ".join(
        f"{k}: {manifest.get(k)!r} {there}, {other.get(k)!r} {here}" for k in SHARED if manifest.get(k) != other.get(k)
    )
