"""Prompt files: the user turns of JSONL conversations, and a Hugging Face dataset.

Only the user turns are kept; the target writes every answer itself (on-policy data).

JSONL layouts, one JSON object per line:
    {"turns": ["user turn 1", "user turn 2"]}
    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}  (ShareGPT;
        "role"/"content" keys work too; user/human turns are taken in order)
    {"messages": [{"role": "user", "content": "..."}, ...]}  (OpenAI style; text parts are joined)
    {"prompt": "..."}
A malformed line (bad JSON, unknown layout, empty text) is reported as FILE:LINE on stderr and
skipped, or stops the run with on_error="fatal"; the number skipped is reported per file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import DominoError
from ..log import log

USER_ROLES = {"user", "human"}


@dataclass(frozen=True)
class Conversation:
    """The user side of one conversation; `id` ("<source>:<index>") names it in the data set."""

    turns: tuple[str, ...]
    id: str
    kind: str = "chat"  # "chat": the target answers every turn; else off-policy, its label kind (offpolicy.py)


# ----- JSONL files -----


def user_turns(obj) -> list[str]:
    """The user turns of one parsed line, in order; ValueError says why the line is unusable."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list):
            raise ValueError('"turns" must be a list of strings')
    elif "conversations" in obj or "messages" in obj:
        key = "conversations" if "conversations" in obj else "messages"
        if not isinstance(obj[key], list) or not all(isinstance(m, dict) for m in obj[key]):
            raise ValueError(f'"{key}" must be a list of objects')
        turns = [_message_text(m) for m in obj[key] if str(m.get("from", m.get("role", ""))).lower() in USER_ROLES]
        if not turns:
            raise ValueError(f'"{key}" has no user/human turn')
    elif "prompt" in obj:
        turns = [obj["prompt"]]
    else:
        raise ValueError(f"unknown layout: keys {sorted(obj)[:6]}, expected turns, conversations, messages or prompt")
    if not turns:
        raise ValueError("no user turns")
    for i, t in enumerate(turns):
        if not isinstance(t, str) or not t.strip():
            raise ValueError(f"user turn {i + 1} is empty or not text")
    return turns


def _message_text(message: dict):
    content = message.get("value", message.get("content"))
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content


def check_prompt_file(path: str | Path) -> Path:
    """A prompt file that exists and is a file; the error says which of the two it is not."""
    path = Path(path)
    if path.is_dir():
        raise DominoError(f"--prompts {path} is a directory; give a JSONL file (one prompt per line)")
    if path.exists() and not path.is_file():
        raise DominoError(f"--prompts {path} is not a regular file (a device or pipe?); give a JSONL file")
    if not path.is_file():
        raise DominoError(
            f"--prompts {path}: no such file (a JSONL file; prepare-data also takes builtin:N and hf:NAME)"
        )
    return path


def read_prompt_file(
    path: str | Path, on_error: str = "skip", source: str | None = None, report=None
) -> list[Conversation]:
    """Conversations of a JSONL file; ids are "<source>:<line number>" (source: the file stem).

    Read as utf-8-sig: a byte-order mark some editors put at the start is not part of line 1. A
    line that is not UTF-8 is reported by file and line like any other malformed line.
    """
    report = report or log
    if on_error not in ("skip", "fatal"):
        raise DominoError(f"on_error must be 'skip' or 'fatal', got {on_error!r}")
    path = check_prompt_file(path)
    source = source or path.stem
    conversations, skipped = [], 0
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                if not line.strip():
                    continue
                turns = user_turns(json.loads(line))
            except (UnicodeDecodeError, json.JSONDecodeError, ValueError) as exc:
                if isinstance(exc, UnicodeDecodeError):  # not silently turned into U+FFFD
                    reason = f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
                elif isinstance(exc, json.JSONDecodeError):
                    reason = f"bad JSON ({exc.msg})"
                else:
                    reason = str(exc)
                if on_error == "fatal":
                    raise DominoError(f"{path}:{lineno}: {reason}") from None
                report(f"{path}:{lineno}: {reason}; line skipped")
                skipped += 1
                continue
            conversations.append(Conversation(tuple(turns), f"{source}:{lineno}"))
    if skipped:
        report(f"{path}: skipped {skipped} malformed line(s), kept {len(conversations)}")
    if not conversations:
        raise DominoError(f"prompt file {path} has no usable prompts")
    return conversations


def load_hf_dataset(name: str, split: str = "train", on_error: str = "skip", report=None) -> list[Conversation]:
    """Rows of a Hugging Face hub dataset in any layout `user_turns` reads (needs `datasets` and a hub)."""
    report = report or log
    if importlib.util.find_spec("datasets") is None:
        raise DominoError(
            f"hf:{name} needs the `datasets` package (pip install datasets) and access to the "
            "Hugging Face hub; offline, use a JSONL file or --prompts builtin"
        )
    import datasets

    try:
        rows = datasets.load_dataset(name, split=split)
    except Exception as exc:  # datasets raises many types for "no network", "no such dataset", ...
        raise DominoError(
            f"cannot load dataset {name!r} (split {split!r}) from the hub: {type(exc).__name__}: {exc}"
        ) from None
    conversations, skipped = [], 0
    for index, row in enumerate(rows):
        try:
            conversations.append(Conversation(tuple(user_turns(row)), f"{name}:{index}"))
        except ValueError as exc:
            if on_error == "fatal":
                raise DominoError(f"dataset {name} row {index}: {exc}") from None
            skipped += 1
    if skipped:
        report(f"dataset {name}: skipped {skipped} unusable row(s), kept {len(conversations)}")
    if not conversations:
        raise DominoError(f"dataset {name!r} has no usable prompts")
    return conversations


def prompts_fingerprint(conversations: list[Conversation]) -> str:
    """sha256 of the ordered conversations: two runs agree on it exactly when they see the same prompts."""
    h = hashlib.sha256()
    for c in conversations:
        record = [c.id, list(c.turns)] + ([c.kind] if c.kind != "chat" else [])  # chat runs hash as before
        h.update(json.dumps(record, ensure_ascii=False).encode())
        h.update(b"\n")
    return h.hexdigest()


def read_first_turns(path) -> list[str]:
    """The first user turn of each conversation in a prompt file (benchmark prompts)."""
    return [c.turns[0] for c in read_prompt_file(path) if c.turns]
