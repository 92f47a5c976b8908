"""A target directory's tokenizer: transformers' the first time, then its saved state without transformers.

Why: AutoTokenizer imports transformers, ~1.5 s of one core at every start, to build a `tokenizers` backend and
render a jinja2 chat template. The first load goes through transformers and saves what its tokenizer is: the
backend's whole state as transformers left it (tokenizers' JSON: added tokens, post-processor), the special
tokens a chat template sees, and the ids Target reads. A later load rebuilds that backend from the state
(`tokenizers.Tokenizer.from_str`) and renders the template in a sandboxed jinja2 environment set up as
transformers sets up its own (trim_blocks, lstrip_blocks, loop controls, a tojson that does not escape HTML,
raise_exception, strftime_now), so encoding, decoding and the chat text are the same.

Only the common calls are answered this way: encoding a string, decoding ids, the vocabulary, and a chat of
plain {role, content} messages rendered to text. Any other call or attribute goes to the transformers
tokenizer, loaded at that moment. Tokenizer classes of their own (with code that changes how they encode) and
decoders that clean up spaces are not saved: they always load through transformers.

The state is keyed by the directory's files (name, size, modification time) and the transformers and tokenizers
versions; a stale or unreadable one is simply written again.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from datetime import datetime
from importlib import metadata
from pathlib import Path

from ..io import cache_dir, directory_files, write_atomic, write_json_atomic

STATE_VERSION = 3
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")  # tokenizer.json used as it is
PLAIN_VALUES = (str, int, float, bool, type(None))


def _state_path(directory: Path) -> tuple[Path, dict]:
    directory = directory.resolve()
    key = {
        "version": STATE_VERSION,
        "directory": str(directory),
        "files": directory_files(directory),
        "transformers": _version("transformers"),
        "tokenizers": _version("tokenizers"),
    }
    name = hashlib.sha256(str(directory).encode()).hexdigest()[:12]
    return cache_dir() / "tokenizer-states" / f"{directory.name}-{name}.json", key


def _backend_path(state_path: Path) -> Path:
    """The backend's state (tokenizers' JSON), beside the small state file (tokenizers reads it natively)."""
    return state_path.with_suffix(".tokenizer.json")


def vocab_fingerprint(tok) -> str:
    """sha256 of the sorted (token, id) vocabulary, added tokens included (a SavedTokenizer has it saved: sorting
    and hashing ~50k entries costs ~0.2 s)."""
    if isinstance(tok, SavedTokenizer):
        return tok.vocab_sha256
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def longest_token(tok) -> int | None:
    """The most characters one vocabulary entry has (targets/context.py; a SavedTokenizer has it saved)."""
    if isinstance(tok, SavedTokenizer):
        return tok.longest_token
    return max((len(t) for t in tok.get_vocab()), default=None)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def load_tokenizer(directory: Path):
    """The directory's tokenizer, None where it has none: from its saved state where one is saved, else through
    transformers (its state saved for the next load)."""
    path, key = _state_path(directory)
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    if state.get("key") == key and state.get("absent"):
        return None
    if state.get("key") == key and state.get("supported"):
        with contextlib.suppress(Exception):  # an unreadable backend file: loaded through transformers again
            return SavedTokenizer(directory, state, _backend_path(path))
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError):
        tok = None
    _save_state(path, key, tok)
    return tok


def _save_state(path: Path, key: dict, tok) -> None:
    """What a transformers tokenizer is (or that there is none), for the next load; never fails a load."""
    template = getattr(tok, "chat_template", None)
    supported = (
        type(tok).__name__ in GENERIC_CLASSES
        and hasattr(tok, "backend_tokenizer")
        and isinstance(template, (str, type(None)))
        and not getattr(tok, "clean_up_tokenization_spaces", False)
    )
    state = {"key": key, "supported": supported, "absent": tok is None}
    if supported:
        state |= {
            "vocab_sha256": vocab_fingerprint(tok),
            "longest_token": longest_token(tok),
            "split_special_tokens": bool(getattr(tok, "split_special_tokens", False)),
            "chat_template": template,
            "special_tokens_map": tok.special_tokens_map,
            "ids": {f"{n}_token_id": getattr(tok, f"{n}_token_id", None) for n in ("bos", "eos", "pad", "unk")},
            "tokens": {f"{n}_token": getattr(tok, f"{n}_token", None) for n in ("bos", "eos", "pad", "unk")},
        }
    with contextlib.suppress(OSError, TypeError, ValueError):
        path.parent.mkdir(parents=True, exist_ok=True)
        if supported:  # first: a state file that matches always has its backend beside it
            write_atomic(_backend_path(path), tok.backend_tokenizer.to_str())
        write_json_atomic(path, state, indent=None)


class SavedTokenizer:
    """A tokenizer rebuilt from its saved state (see the module's docstring); what it does not answer itself
    goes to the transformers tokenizer of the same directory (`full`)."""

    def __init__(self, directory: Path, state: dict, backend_file: Path):
        from tokenizers import Tokenizer

        self.directory = directory
        self.name_or_path = str(directory)
        self.backend = Tokenizer.from_file(str(backend_file))
        self.vocab_sha256, self.longest_token = state["vocab_sha256"], state["longest_token"]
        self.backend.no_truncation()  # transformers' call without truncation or padding does the same
        self.backend.no_padding()
        self.backend.encode_special_tokens = state["split_special_tokens"]
        self.chat_template = state["chat_template"]
        self.special_tokens_map = state["special_tokens_map"]
        self.__dict__.update(state["ids"])
        self.__dict__.update(state["tokens"])

    @functools.cached_property
    def full(self):
        """The transformers tokenizer of this directory (loaded on first need)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.directory))

    def __getattr__(self, name: str):
        if name.startswith("__") or "directory" not in self.__dict__:  # (not yet built: nothing to ask)
            raise AttributeError(name)
        return getattr(self.full, name)

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __call__(self, text, add_special_tokens: bool = True, **kwargs):
        if kwargs or not isinstance(text, str):
            return self.full(text, add_special_tokens=add_special_tokens, **kwargs)
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if kwargs:
            return self.full.decode(ids, skip_special_tokens=skip_special_tokens, **kwargs)
        ids = [ids] if isinstance(ids, int) else list(ids)
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def apply_chat_template(self, conversation, tokenize: bool = True, add_generation_prompt: bool = False, **kwargs):
        plain = (
            not tokenize
            and isinstance(self.chat_template, str)
            and isinstance(conversation, list)
            and all(_plain_message(m) for m in conversation)
            and all(isinstance(v, PLAIN_VALUES) for v in kwargs.values())
            and not set(kwargs) & {"tools", "documents", "chat_template", "continue_final_message"}
            and not any(k.startswith("return_") for k in kwargs)
        )
        template = _compiled(self.chat_template) if plain else None
        if template is None:
            return self.full.apply_chat_template(
                conversation, tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs
            )
        values = {**self.special_tokens_map, **kwargs}
        messages = [dict(m) for m in conversation]
        return template.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **values
        )


def _plain_message(m) -> bool:
    return isinstance(m, dict) and set(m) <= {"role", "content"} and all(isinstance(v, str) for v in m.values())


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    """The template in transformers' kind of environment, or None where it needs more (its {% generation %} tag)."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError:
        return None
