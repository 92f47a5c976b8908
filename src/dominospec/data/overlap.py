"""Word n-gram overlap between training prompts and benchmark prompts (contamination check).

A training prompt overlaps a benchmark when it shares one word n-gram (lower-cased words, n=8 by
default) with any benchmark text. Eight words is long enough that ordinary phrases ("what is the
difference between") do not match, short enough that a copied benchmark sentence always does.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import DominoError

NGRAM = 8
_WORD = re.compile(r"\w+")


def ngrams(text: str, n: int = NGRAM) -> set[tuple[str, ...]]:
    words = _WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


@dataclass(frozen=True)
class Reference:
    """Benchmark texts indexed by their n-grams; `where` names the file and line of each text."""

    index: dict[tuple[str, ...], int]
    where: list[str]
    n: int = NGRAM

    def first_match(self, text: str) -> str | None:
        """Where the first benchmark text sharing an n-gram with `text` lives, or None."""
        for gram in ngrams(text, self.n):
            if gram in self.index:
                return self.where[self.index[gram]]
        return None


def benchmark_texts(path: str | Path) -> list[tuple[str, str]]:
    """(FILE:LINE, text) for every string in a benchmark file.

    A JSONL file gives every string value of each line (questions, passages, answers alike: any of
    them copied into a training prompt is contamination); any other file gives its non-empty lines.
    """
    path = Path(path)
    if not path.is_file():
        raise DominoError(f"benchmark file {path}: no such file")
    out = []
    with path.open(encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            texts = [line]
            if path.suffix == ".jsonl":
                try:
                    texts = list(_strings(json.loads(line)))
                except json.JSONDecodeError:
                    pass  # not JSON after all: the line itself is the text
            out.extend((f"{path}:{lineno}", t) for t in texts)
    return out


def _strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def build_reference(files: list[str | Path], n: int = NGRAM) -> Reference:
    index, where = {}, []
    for path in files:
        for location, text in benchmark_texts(path):
            where.append(location)
            for gram in ngrams(text, n):
                index.setdefault(gram, len(where) - 1)
    return Reference(index, where, n)


def default_benchmarks(repo_root: str | Path) -> list[Path]:
    """The project's held-out evaluation prompts: prompts/eval-*.jsonl."""
    return sorted(Path(repo_root, "prompts").glob("eval-*.jsonl"))


def find_overlaps(prompts: list[tuple[str, list[str]]], reference: Reference) -> list[tuple[str, str]]:
    """(prompt location, benchmark location) for each prompt sharing an n-gram with the reference.

    prompts: (location, turns) pairs.
    """
    hits = []
    for location, turns in prompts:
        match = reference.first_match("\n".join(turns))
        if match is not None:
            hits.append((location, match))
    return hits
