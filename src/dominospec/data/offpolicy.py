"""Off-policy data: text the target did not write, labelled by one prefill pass of the target.

Generating an answer costs one decode step per token; reading a text the target did not write
costs one prefill pass for all its tokens (about 2x cheaper per token on one CPU core with
SmolLM2-135M, see docs/data.md), or nothing at all with "text" labels. The text
here is what every Python machine has: the docstrings and source of the standard library (read
with `ast`, nothing imported), each piece put in a chat as the answer to a short question
("What does `json.dumps` do?" -> its docstring), so the drafter sees chat-shaped context as it
will when it serves.

Two label kinds (`pydoc:N` or `pydoc:N:text` on the command line):
  target-argmax  the target reads the whole chat once; an answer token is supervised exactly when
                 it is the target's own greedy choice there. A drafter trained on these positions
                 learns the target's greedy next token (what acceptance at T=0 checks), never a
                 token the target would not have picked; the rest of the text is context only.
  text           every answer token is supervised with the text's own next token, and no target
                 pass is spent here: data costs nothing to make. Train with `train --distill 1` so
                 the drafter fits the target's own distribution (soft labels from the target's
                 final hidden state, computed in the trainer's feature pass, as EAGLE-1 trained).
The trainer reads both as any other sample (input_ids + loss_mask).

Samples carry "labels" (their kind; JSONL key, compact shards' "labels" array), so a reader can
keep them out of what it validates on. Conversation.kind is the label kind for these: turns =
(question, answer text). Both are stored in the part's prompts.jsonl.gz, so the held-out-prompt
exclusion test reads them like any prompt.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import random
import sys
import textwrap
from collections import Counter
from functools import lru_cache
from pathlib import Path

import torch

from .prompts import Conversation

ARGMAX, TEXT = "target-argmax", "text"  # off-policy label kinds: Conversation.kind and sample["labels"]
LABEL_KINDS = {"argmax": ARGMAX, "text": TEXT}  # the spelling on the command line (pydoc:N:argmax)
MIN_CHARS, MAX_CHARS = 200, 2400
TEXT_COUNTS = ("text_tokens", "agreeing_tokens", "texts_over_context")  # a run's counts of its off-policy texts
SKIP_MODULES = {"this", "antigravity", "idlelib", "lib2to3", "test", "tkinter", "turtledemo", "pydoc_data"}


def is_off_policy(conv: Conversation) -> bool:
    return conv.kind in (ARGMAX, TEXT)


def pydoc_texts(n: int, seed: int = 0, labels: str = ARGMAX) -> list[Conversation]:
    """n (question, text) chats from the standard library's docstrings and source, picked by seed.

    Ids are "pydoc:<k>" with k the piece's place in the machine's whole (sorted) list, so the same
    piece has the same id whatever n and seed pick it.
    """
    pool = _pieces()
    order = list(range(len(pool)))
    random.Random(seed).shuffle(order)
    return [Conversation(pool[k], f"pydoc:{k}", kind=labels) for k in order[:n]]


@lru_cache(maxsize=1)
def _pieces() -> tuple[tuple[str, str], ...]:
    """Every usable (question, text) pair, in a fixed order (module name, then source order)."""
    out = []
    for name, path in _stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        doc = ast.get_docstring(tree)
        if doc:
            out.append((f"What is the `{name}` module for?", inspect.cleandoc(doc)))
        for node in tree.body:
            for obj, qual in _documented(node, name):
                doc = ast.get_docstring(obj)
                if doc:
                    out.append((f"What does `{qual}` do?", inspect.cleandoc(doc)))
                segment = textwrap.dedent("\n".join(lines[obj.lineno - 1 : obj.end_lineno]))  # whole lines
                if segment:
                    out.append((f"Show me the source of `{qual}`.", f"```python\n{segment}\n```"))
    return tuple((q, t) for q, t in out if MIN_CHARS <= len(t) <= MAX_CHARS)


def _documented(node, module: str):
    """Top-level public functions and classes, and the public methods of those classes."""
    if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
        return
    yield node, f"{module}.{node.name}"
    if isinstance(node, ast.ClassDef):
        for child in node.body:
            if isinstance(child, ast.FunctionDef) and not child.name.startswith("_"):
                yield child, f"{module}.{node.name}.{child.name}"


def _stdlib_files() -> list[tuple[str, Path]]:
    out = []
    for name in sorted(getattr(sys, "stdlib_module_names", ())):
        if name.startswith("_") or name in SKIP_MODULES:
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin and spec.origin.endswith(".py"):
            out.append((name, Path(spec.origin)))
    return out


# ----- labels: one target pass per chat -----


@torch.inference_mode()
def label_texts(target, codec, conversations: list[Conversation], batch_size: int, max_answer_tokens: int):
    """Samples for off-policy chats: (input_ids, loss_mask), the answer supervised by its label kind.

    A chat's tokens are the template render of its question followed by its text (codec.encode_text),
    the text cut to max_answer_tokens and the whole to the target's context; batch_size chats go
    through the target per pass. Returns (samples, counts: text_tokens, agreeing_tokens, ...).
    """
    stats = Counter(conversations=len(conversations))
    rows, samples = [], []
    limit = target.max_positions or 1 << 30
    for c in conversations:
        prompt = codec.encode([{"role": "user", "content": c.turns[0]}])
        ids = (prompt + codec.encode_text(c.turns[1])[:max_answer_tokens])[:limit]
        if len(ids) - len(prompt) < 2:
            stats["texts_over_context"] += 1
            continue
        if c.kind == TEXT:  # the text's own tokens are the labels: no target pass
            mask = [0] * len(prompt) + [1] * (len(ids) - len(prompt))
            samples.append({"id": c.id, "input_ids": ids, "loss_mask": mask, "labels": TEXT})
            stats["text_tokens"] += len(ids) - len(prompt)
        else:
            rows.append((c.id, prompt, ids))
    for first in range(0, len(rows), batch_size):
        batch = rows[first : first + batch_size]
        _, finals = target.sequence_features([ids for _, _, ids in batch], [0])
        for (cid, prompt, ids), final in zip(batch, finals):
            n = len(prompt)
            greedy = target.lm_head(final[n - 1 : -1]).argmax(-1).tolist()  # the target's pick for each answer token
            mask = [0] * n + [int(t == g) for t, g in zip(ids[n:], greedy)]
            stats["text_tokens"] += len(ids) - len(prompt)
            stats["agreeing_tokens"] += sum(mask)
            if sum(mask):
                samples.append({"id": cid, "input_ids": ids, "loss_mask": mask, "labels": ARGMAX})
    stats.update(
        samples=len(samples),
        tokens=sum(len(s["input_ids"]) for s in samples),
        supervised_tokens=sum(sum(s["loss_mask"]) for s in samples),
    )
    return samples, stats
