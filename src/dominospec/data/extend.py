"""`prepare-data --extend`: adding a finished prepare-data run to a data set as its next part (see store.py)."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
from pathlib import Path

from ..errors import DominoError
from ..io import ensure_writable_dir, exclusive_lock, is_temporary, json_field, write_json_atomic
from .dataset import iter_shard, other_precision, read_meta, same_target, target_record
from .prompts import prompts_fingerprint
from .store import (
    FORMAT,
    MANIFEST,
    PART_SETTINGS,
    SHARED,
    check_no_unlisted_parts,
    is_dataset,
    read_manifest,
    stale_temporaries,
    write_npz_shard,
)


def add_part(dataset: str | Path, run_dir: str | Path, conversations=None, exist_ok: bool = False, report=None) -> dict:
    """Append a complete prepare-data directory to `dataset` (created if new) as its next compact part.

    conversations: the run's prompts (Conversation list, after prompts too long for the context were
    left out) to store with it; checked against the run's prompt fingerprint. Returns the part's
    manifest entry (with exist_ok, the entry of the part that already holds this very run, if one does).

    The whole add holds the data set's lock (a second add waits its turn, saying so through
    `report`), and the part is built under a temporary name unique to this process and renamed into
    place only when complete: two runs extending one data set at once both land, whole.
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
    json_field(meta, "counts", dict, str(run_dir / "meta.json"))  # a part records its run's counts
    run_sha256 = run_fingerprint(run_dir)
    ensure_writable_dir(dataset, "--extend")
    with exclusive_lock(dataset, "prepare-data --extend", wait=True, report=report):
        if not is_dataset(dataset):
            check_extendable(dataset)  # a folder that holds other things is not taken over
        manifest = (
            read_manifest(dataset)
            if is_dataset(dataset)
            else {
                "format": FORMAT,
                "parts": [],
                **{k: meta.get(k) for k in SHARED},
                "target_sha256": meta.get("target_sha256"),
                "target_precision": meta.get("target_precision"),
            }
        )
        diffs = _shared_differences(manifest, meta, f"in {dataset}", f"in {run_dir}")
        if diffs:
            raise DominoError(
                f"cannot add {run_dir} to {dataset}: it was made by another target or tokenizer ({diffs})"
            )
        same = [p for p in manifest["parts"] if all(p["settings"].get(k) == meta.get(k) for k in PART_SETTINGS)]
        held = [p for p in same if _holds_run(p, meta, run_sha256)]
        if held and exist_ok:
            return held[0]
        if held:
            name = held[0]["name"]
            raise DominoError(f"{run_dir} is already in {dataset} as {name} (same prompts, settings and samples)")
        if same and report:
            report(
                f"{run_dir} has the settings of {same[0]['name']} in {dataset} but other samples (another "
                "device, dtype or model weights?): adding it as a part of its own"
            )
        name = f"part-{len(manifest['parts']):03d}"
        part = dataset / name
        # we hold the lock, so what an add killed earlier left is nobody's work in progress
        for stale in stale_temporaries(dataset):
            _remove(stale)
        if part.exists():
            if report:
                report(f"removing {part}: an add killed after writing it but before recording it in {MANIFEST}")
            _remove(part)
        check_no_unlisted_parts(dataset, manifest)
        tmp = dataset / f".{name}.tmp{os.getpid()}"
        tmp.mkdir()
        try:
            files = _write_part(tmp, run_dir, meta, conversations)
            entry = {
                "name": name,
                "settings": {k: meta.get(k) for k in PART_SETTINGS},
                "prompt_sources": meta.get("prompt_sources", []),
                "counts": meta["counts"],
                "files": files,
                "run_sha256": run_sha256,
                "created": meta.get("created"),
                "dominospec_version": meta.get("dominospec_version"),
            }
            os.rename(tmp, part)
        finally:
            _remove(tmp)
        manifest["parts"].append(entry)
        manifest["counts"] = {
            k: sum(p["counts"].get(k, 0) for p in manifest["parts"])
            for k in ("conversations", "samples", "tokens", "supervised_tokens", "generated_tokens")
        }
        write_json_atomic(dataset / MANIFEST, manifest, indent=1)
    return entry


def _write_part(tmp: Path, run_dir: Path, meta: dict, conversations) -> dict:
    """The part's files in `tmp` (meta.json, prompts, compact shards), each fsynced; {name: sha256}."""
    shutil.copyfile(run_dir / "meta.json", tmp / "meta.json")
    if conversations is not None:
        lines = "".join(json.dumps(_prompt_record(c), ensure_ascii=False) + "\n" for c in conversations)
        with gzip.GzipFile(tmp / "prompts.jsonl.gz", "wb", mtime=0) as f:  # mtime 0: same bytes every time
            f.write(lines.encode("utf-8"))
    for shard in sorted(run_dir.glob("samples-*.jsonl")):
        write_npz_shard(tmp / (shard.stem + ".npz"), list(iter_shard(shard, meta["vocab_size"])), meta["vocab_size"])
    files = {}
    for p in sorted(tmp.iterdir()):
        with open(p, "rb") as f:
            os.fsync(f.fileno())
        files[p.name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return files


def _prompt_record(c) -> dict:
    """A conversation as prompts.jsonl.gz keeps it; off-policy ones say so (kind: their labels; question, text)."""
    return {"id": c.id, "turns": list(c.turns), **({"kind": c.kind} if c.kind != "chat" else {})}


def run_fingerprint(run_dir: Path) -> str:
    """sha256 of a prepare-data run's sample shards, in order: what tells two runs with equal settings apart."""
    h = hashlib.sha256()
    for shard in sorted(Path(run_dir).glob("samples-*.jsonl")):
        h.update(shard.name.encode() + b"\0" + shard.read_bytes())
    return h.hexdigest()


def _holds_run(entry: dict, meta: dict, run_sha256: str) -> bool:
    """The part was made from this very run: same samples (parts from before run_sha256 was kept: same counts)."""
    if "run_sha256" in entry:
        return entry["run_sha256"] == run_sha256
    return entry["counts"] == meta["counts"]


def _remove(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def check_extendable(dataset: str | Path, target=None) -> None:
    """Before any generation: refuse to extend a data set made by another target or tokenizer,
    or a folder that holds other things."""
    dataset = Path(dataset)
    if dataset.exists() and not dataset.is_dir():
        raise DominoError(f"--extend {dataset} exists and is not a directory")
    if not is_dataset(dataset):
        if dataset.exists() and any(p.name != ".lock" and not is_temporary(p) for p in dataset.iterdir()):
            raise DominoError(f"--extend {dataset} is not empty and holds no {MANIFEST}; refusing to add parts there")
        return
    manifest = read_manifest(dataset)
    if target is None:
        return
    mine = {
        **target_record(target),
        "vocab_size": target.vocab_size,
        "tokenizer_sha256": target.tokenizer_fingerprint,
        "chat_template_sha256": target.chat_template_fingerprint,
        "eos_ids": list(target.eos_ids),
    }
    diffs = _shared_differences(manifest, mine, "there", "now")
    if diffs:
        raise DominoError(f"--extend {dataset} was made by another target or tokenizer ({diffs})")


def _shared_differences(manifest: dict, other: dict, there: str, here: str) -> str:
    """The fields every part of a data set shares (SHARED) where `other` differs, one clause each; "" if none.

    The target is compared by content (same_target): another spelling of its path is no difference.
    """
    diffs = [
        f"{k}: {manifest.get(k)!r} {there}, {other.get(k)!r} {here}"
        for k in SHARED
        if k != "target" and manifest.get(k) != other.get(k)
    ]
    if other_precision(manifest, other):
        theirs, ours = manifest.get("target_precision"), other.get("target_precision")
        diffs.insert(0, f"target precision (--dtype): {theirs!r} {there}, {ours!r} {here}")
    elif not same_target(manifest, other):
        diffs.insert(0, f"target: {manifest.get('target')!r} {there}, {other.get('target')!r} {here}")
    return "; ".join(diffs)
