"""Resolving --prompts values (FILE, builtin[:N], self:N, pydoc:N, mix:DIR:N, hf:NAME[:SPLIT]) into conversations."""

from __future__ import annotations

import hashlib
import sys
from collections import Counter
from pathlib import Path

from ..errors import DominoError
from ..io import read_json_object, write_json_atomic
from .builtin import builtin_prompts
from .imports import mixed_order, read_imported
from .offpolicy import LABEL_KINDS, pydoc_texts
from .prompts import Conversation, check_prompt_file, load_hf_dataset, read_prompt_file
from .selfwritten import self_written_prompts


def load_prompts(
    specs: list[str],
    seed: int = 0,
    limit: int | None = None,
    skip: int = 0,
    on_error: str = "skip",
    report=None,
    target=None,
    keep_in: Path | None = None,
) -> tuple[list[Conversation], list[dict]]:
    """Resolve --prompts values (FILE, builtin[:N], self:N, pydoc:N, hf:NAME[:SPLIT]) into conversations and
    source records.

    pydoc:N is off-policy text (offpolicy.py): stdlib docstrings and source the target reads but did
    not write; its record says so ("kind": "off-policy", "labels": "target-argmax" or "text"), every
    other source's says "labels": "on-policy".

    self:N (prompts the target writes itself) needs `target`; with `keep_in` (the run's output
    directory) the questions are kept there and reused when the run is resumed, not written again.
    Sources are concatenated in the order given; `skip` drops the first N conversations overall (a
    source's draw continued where an earlier run stopped: builtin:3072 with skip 1024 is the 2,048
    prompts after builtin:1024 of the same seed) and `limit` then keeps the first N. A source record
    counts the conversations it gave after the skip, and says how many it skipped.
    """
    conversations, sources, names, categories = [], [], set(), {}
    for spec in specs:
        if spec.startswith("mix:"):
            convs, record, cats = _mix(spec, seed)
            categories.update(cats)
        elif spec == "builtin" or spec.startswith("builtin:"):
            n = _builtin_count(spec, limit)
            convs, record = builtin_prompts(n, seed), {"spec": spec, "kind": "builtin", "seed": seed}
        elif spec.startswith("self:"):
            if target is None:
                raise DominoError(f"--prompts {spec}: prompts written by the target need the target loaded")
            n = _count(spec)
            convs = _self_written(target, n, seed, report, keep_in)
            record = {"spec": spec, "kind": "self", "seed": seed}
        elif spec.startswith("pydoc:"):
            n, labels = _pydoc_spec(spec)
            convs = pydoc_texts(n, seed, labels)
            record = {"spec": spec, "kind": "off-policy", "text": "pydoc", "seed": seed, "python": _python()}
            record["labels"] = labels
        elif spec.startswith("hf:"):
            name, _, split = spec[3:].partition(":")
            convs, record = load_hf_dataset(name, split or "train", on_error, report), {"spec": spec, "kind": "hf"}
        else:
            path = Path(spec)
            source = _unique_name(path.stem, names)
            convs = read_prompt_file(path, on_error, source=source, report=report)
            record = {"spec": spec, "kind": "file", "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        names.update(c.id.rsplit(":", 1)[0] for c in convs)
        record.setdefault("labels", "on-policy")
        record["conversations"] = len(convs)
        conversations.extend(convs)
        sources.append(record)
    if skip:
        if skip >= len(conversations):
            raise DominoError(f"--skip {skip}: the prompt sources give only {len(conversations)} conversations")
        conversations = conversations[skip:]
        left = skip
        for record in sources:
            record["skipped"] = min(left, record["conversations"])
            record["conversations"] -= record["skipped"]
            left -= record["skipped"]
    if limit is not None:
        conversations = conversations[:limit]
    for record in sources:
        if record["kind"] == "mix":
            _count_mix(record, conversations, categories)
    ids = [c.id for c in conversations]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DominoError(f"conversation id {dup!r} appears twice: give each prompt source once")
    return conversations, sources


def _mix(spec: str, seed: int) -> tuple[list[Conversation], dict, dict[str, str]]:
    """mix:DIR:N: the first N prompts of DIR's imported sources, categories taking turns (imports.py)."""
    folder, n = _mix_spec(spec)
    manifest, rows = read_imported(folder)
    order = mixed_order(rows, seed)
    if n > len(order):
        raise DominoError(f"--prompts {spec}: {folder} holds only {len(order)} prompts")
    order = order[:n]
    convs = [Conversation(tuple(turns), cid) for cid, turns, _ in order]
    record = {"spec": spec, "kind": "mix", "seed": seed, "sources": manifest["sources"]}
    return convs, record, {cid: category for cid, _, category in order}


def _count_mix(record: dict, conversations: list[Conversation], categories: dict[str, str]) -> None:
    """A mix record's counts of the conversations the run keeps, by source and by category."""
    kept = [c.id for c in conversations if c.id in categories]
    by_source = Counter(cid.rsplit(":", 1)[0] for cid in kept)
    record["sources"] = {
        name: {key: v for key, v in entry.items() if key in ("licence", "url", "commit", "file", "sha256")}
        | {"conversations": by_source[name]}
        for name, entry in record["sources"].items()
    }
    record["categories"] = dict(sorted(Counter(categories[cid] for cid in kept).items()))


def _mix_spec(spec: str) -> tuple[str, int]:
    folder, _, n = spec[4:].rpartition(":")
    if not folder or not n.isdigit() or int(n) < 1:
        raise DominoError(f"--prompts {spec!r}: expected mix:DIR:N (a folder of imported prompts, a count >= 1)")
    return folder, int(n)


SELF_PROMPTS_PREFIX = ".self-prompts-"  # OUT/.self-prompts-N-seedS.json: a run's self-written questions


def _self_written(target, n: int, seed: int, report, keep_in: Path | None) -> list[Conversation]:
    if keep_in is None:
        return self_written_prompts(target, n, seed, report=report)
    path = Path(keep_in) / f"{SELF_PROMPTS_PREFIX}{n}-seed{seed}.json"
    who = getattr(target, "fingerprint", None) or target.name
    if getattr(target, "precision", "float32") != "float32":
        who = f"{who}/{target.precision}"  # another weight format writes other questions
    if path.exists():
        try:
            kept = read_json_object(path)
            convs = [Conversation(tuple(c["turns"]), c["id"]) for c in kept["conversations"]]
        except (DominoError, KeyError, TypeError):
            kept, convs = {}, []  # damaged: written again
        if kept.get("target") == who and convs:
            if report:
                report(f"self:{n}: the {len(convs)} questions the target wrote for this run, kept in {path}")
            return convs
    convs = self_written_prompts(target, n, seed, report=report)
    conversations = [{"id": c.id, "turns": list(c.turns)} for c in convs]
    write_json_atomic(path, {"target": who, "conversations": conversations})
    return convs


def _builtin_count(spec: str, limit: int | None) -> int:
    if spec == "builtin":
        if limit is None:
            raise DominoError("--prompts builtin needs a size: builtin:N, or pass --limit N")
        return limit
    return _count(spec)


def check_prompt_specs(specs: list[str]) -> None:
    """Every --prompts value well-formed (builtin:N / self:N counts, files that exist), before anything loads."""
    for spec in specs:
        if spec.startswith("mix:"):
            folder, _ = _mix_spec(spec)
            if not Path(folder).is_dir():
                raise DominoError(f"--prompts {spec}: {folder} is not a folder of imported prompts")
        elif spec.startswith(("builtin:", "self:")):
            _count(spec)
        elif spec.startswith("pydoc:"):
            _pydoc_spec(spec)
        elif spec.startswith("hf:"):
            if not spec[3:].partition(":")[0]:
                raise DominoError(f"--prompts {spec!r}: expected hf:NAME[:SPLIT]")
        elif spec != "builtin":
            check_prompt_file(spec)


def _pydoc_spec(spec: str) -> tuple[int, str]:
    """pydoc:N[:argmax|text] -> (N, label kind)."""
    head, _, labels = spec.rpartition(":") if spec.count(":") == 2 else (spec, "", "argmax")
    if labels not in LABEL_KINDS:
        raise DominoError(f"--prompts {spec!r}: expected pydoc:N or pydoc:N:LABELS with LABELS one of argmax, text")
    return _count(head), LABEL_KINDS[labels]


def _python() -> str:
    """The Python whose standard library the pydoc texts come from (another version, other texts)."""
    return ".".join(map(str, sys.version_info[:3]))


def is_self_written(specs: list[str]) -> bool:
    return any(spec.startswith("self:") for spec in specs)


def _count(spec: str) -> int:
    kind = spec.split(":", 1)[0]
    try:
        n = int(spec.split(":", 1)[1])
    except ValueError:
        raise DominoError(f"--prompts {spec!r}: expected {kind}:N with an integer N") from None
    if n < 1:
        raise DominoError(f"--prompts {spec!r}: N must be at least 1")
    return n


def _unique_name(stem: str, taken: set[str]) -> str:
    name, k = stem, 2
    while name in taken:
        name, k = f"{stem}-{k}", k + 1
    return name
