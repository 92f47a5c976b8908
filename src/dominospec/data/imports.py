"""Importing public prompt sources into compact prompt files (`dominospec import-prompts`).

Each source below reads the files of one public data set as its authors publish them (RAW: a file
or a folder) and turns every row into one conversation of user turns with a category (what users
ask: chat, code, math, rewrite, summarise, rag, translate, multi-turn). Rows that carry a text
rather than a request (documentation sections, a role-play answer, a dialogue utterance) become a
request about that text, worded by one of a few templates picked per row.

The result is DIR/NAME.jsonl.gz ({"turns": [...], "category": ..., "from": "FILE:LINE"} per line,
gzip with a fixed timestamp, so the same input gives the same bytes) and NAME's entry in
DIR/sources.json: licence, URL, commit, the raw files, counts by category, malformed rows, and the
overlap check against benchmark prompts (overlap.py). A source whose prompts share an 8-word
n-gram with a benchmark prompt is refused, unless the overlapping rows are dropped explicitly
(`drop_overlapping`), which the entry records.

`mix:DIR:N` (sources.py) reads those files back for prepare-data.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import DominoError
from ..io import read_json_object, write_atomic, write_json_atomic
from ..log import log
from .overlap import NGRAM, build_reference, find_overlaps

SOURCES_FILE = "sources.json"
SOURCES_FORMAT = "dominospec-prompt-sources/1"
CATEGORIES = ("chat", "code", "math", "rewrite", "summarise", "rag", "translate", "multi-turn")
# a raw file named like a benchmark's held-out split is refused: those prompts are what we measure on
_HELD_OUT = re.compile(r"(^|[^a-z])(test|eval|heldout|held_out)([^a-z]|$)", re.IGNORECASE)

Row = tuple[str, object]  # (FILE:LINE, the parsed row)
Prompt = tuple[list[str], str]  # (user turns, category)


@dataclass(frozen=True)
class PromptSource:
    """A public data set: where it lives, its licence, which of its files to read, how a row becomes prompts."""

    name: str
    licence: str
    url: str
    raw: str  # the files to pass as RAW, as the repository names them
    note: str
    rows: Callable[[Path], Iterator[Row]]
    convert: Callable[[object, random.Random], list[Prompt]]  # ValueError: a malformed row
    files: str = "*"  # the files of a RAW folder this source reads (its held-out check and provenance cover those)

    def raw_files(self, raw: Path) -> list[Path]:
        return [raw] if raw.is_file() else sorted(p for p in raw.rglob(self.files) if p.is_file())


# ----- reading raw files: (FILE:LINE, row) pairs -----


def _files(raw: Path, pattern: str) -> list[Path]:
    files = [raw] if raw.is_file() else sorted(raw.rglob(pattern))
    if not files:
        raise DominoError(f"{raw}: no {pattern} files")
    return files


def _label(path: Path, raw: Path) -> str:
    """A file's name relative to RAW (no machine paths in what gets committed)."""
    return path.name if raw.is_file() else str(path.relative_to(raw))


def jsonl_rows(raw: Path, pattern: str = "*.jsonl") -> Iterator[Row]:
    """One row per non-empty line; a line that is not JSON comes as its ValueError."""
    for path in _files(raw, pattern):
        with path.open("rb") as f:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield f"{_label(path, raw)}:{lineno}", _parse(line)


def _parse(line: bytes):
    try:
        return json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return ValueError(f"not UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1})")
    except json.JSONDecodeError as exc:
        return ValueError(f"bad JSON ({exc.msg})")


def json_array_rows(raw: Path) -> Iterator[Row]:
    """The items of top-level JSON arrays, each named by the line it starts on."""
    decoder = json.JSONDecoder()
    for path in _files(raw, "*.json"):
        text, label = path.read_text(encoding="utf-8"), _label(path, raw)
        pos = _skip_space(text, 0)
        if not text.startswith("[", pos):
            raise DominoError(f"{path}: expected a JSON array of rows")
        pos = _skip_space(text, pos + 1)
        while pos < len(text) and text[pos] != "]":
            line = text.count("\n", 0, pos) + 1
            try:
                row, pos = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                raise DominoError(
                    f"{label}:{line}: bad JSON ({exc.msg}); the rest of the file cannot be read"
                ) from None
            yield f"{label}:{line}", row
            pos = _skip_space(text, pos)
            if text.startswith(",", pos):
                pos = _skip_space(text, pos + 1)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def rst_sections(raw: Path) -> Iterator[Row]:
    """Sections of reStructuredText sources: {"title", "text", "faq"} named by the title's line.

    Prose only: directives, literal blocks (after `::`) and tables are left out, inline markup
    (:role:`x`, ``x``, `text <url>`_) is reduced to its text.
    """
    for path in _files(raw, "*.rst.txt"):
        lines = path.read_text(encoding="utf-8").splitlines()
        faq = "faq" in path.parts
        title, start, body = None, 0, []
        for i, line in enumerate(lines):
            underline = lines[i + 1] if i + 1 < len(lines) else ""
            if line.strip() and _is_underline(underline, line):
                if title:
                    yield f"{_label(path, raw)}:{start}", _section(title, body, faq)
                title, start, body = line.strip(), i + 1, []
            elif not _is_underline(line, lines[i - 1] if i else ""):
                body.append(line)
        if title:
            yield f"{_label(path, raw)}:{start}", _section(title, body, faq)


def _section(title: str, body: list[str], faq: bool) -> dict:
    return {"title": _inline(title), "text": _prose(body), "faq": faq}


def _is_underline(line: str, above: str) -> bool:
    s = line.strip()
    return len(s) >= 3 and len(set(s)) == 1 and s[0] in "=-~^*+#\"'" and len(s) >= len(above.strip()) > 0


def _prose(lines: list[str]) -> str:
    paragraphs, current, literal = [], [], False
    for line in lines + [""]:
        if not line.strip():
            if current:
                text = " ".join(current)
                literal = text.endswith(":")  # introduces a code example that is left out: so is the intro
                if not literal:
                    paragraphs.append(text)
                current = []
            continue
        indented = line.startswith((" ", "\t"))
        if indented and (literal or not current and paragraphs and paragraphs[-1].startswith("..")):
            continue  # a literal block or a directive's body
        literal = literal and indented
        if line.lstrip().startswith((".. ", "|", "+-", ">>>", "...")):
            paragraphs.append("..")  # marks a directive so its indented body is skipped
            continue
        current.append(line.strip())
    text = "\n\n".join(p for p in paragraphs if p != "..")
    return _inline(text)


def _inline(text: str) -> str:
    text = re.sub(r":[\w:.-]+:`~?([^`<]*?)\s*(<[^>]*>)?`", r"\1", text)  # :func:`x` / :ref:`text <label>`
    text = re.sub(r"`([^`<]+?)\s*<[^>]+>`_+", r"\1", text)  # `text <url>`_
    text = re.sub(r"``(.+?)``", r"\1", text)
    text = re.sub(r"`([^`]+)`_*", r"\1", text)
    return re.sub(r"\*\*?([^*]+)\*\*?", r"\1", text)


# ----- turning rows into prompts -----

FOLLOW_UPS = (
    "Can you make that shorter?",
    "Thanks. Could you explain it in simpler terms?",
    "Give me one more example, please.",
    "Now put that into a bulleted list.",
    "Why? Walk me through your reasoning.",
    "Could you expand on the most important point?",
    "Summarize your answer in one sentence.",
    "What is a common mistake people make here?",
)
MATH_FOLLOW_UPS = (
    "Can you check the answer a different way?",
    "Which step is the easiest to get wrong?",
    "Now change the numbers a little and solve it again.",
    "Explain it as you would to a ten-year-old.",
)
SUMMARISE = (
    "Summarize the following text in {k} sentences.\n\n{text}",
    "Give me a short summary of this:\n\n{text}",
    "{text}\n\nTL;DR: sum up the text above in one paragraph.",
    "Write a bullet-point summary of the key points of this text.\n\nText:\n{text}",
    "Can you condense this passage into two or three sentences?\n\n{text}",
)
REWRITE = (
    "Rewrite the following text so that a twelve-year-old can follow it.\n\n{text}",
    "Make this text more formal:\n\n{text}",
    "Rewrite this paragraph in a friendlier, more casual tone:\n\n{text}",
    "Shorten this text without losing any important information:\n\n{text}",
    "Paraphrase the following in your own words.\n\n{text}",
    "Improve the flow and fix any grammar problems in this text:\n\n{text}",
)
RAG = (
    "Answer the question using only the document below.\n\nDocument:\n{text}\n\nQuestion: {q}",
    "{text}\n\nBased on the text above: {q}",
    "Here is an excerpt from some documentation:\n\n{text}\n\nUsing this excerpt, answer: {q}",
    "Context:\n{text}\n\nQ: {q}\nA:",
)
TOPIC_QUESTIONS = (
    "What does the text say about {t}?",
    "Explain {t}, as the text describes it.",
    "What are the main points about {t} in this text?",
)
READING_QUESTIONS = (
    "What is the main idea of this text?",
    "Who or what is the text about, and what do we learn about them?",
    "List the facts the text states, one per line.",
    "What details in the text describe the setting?",
)
TRANSLATE = (
    "Translate into {lang}: {text}",
    'How would I say this in {lang}? "{text}"',
    "Translate the following sentence to {lang}.\n\n{text}",
    "Please translate this from English to {lang}:\n{text}",
)
LANGUAGES = ("French", "German", "Spanish", "Italian", "Portuguese", "Dutch", "Chinese", "Japanese", "Russian")


def _text(row, *keys: str) -> str:
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    values = []
    for key in keys:
        value = row.get(key, "")
        if not isinstance(value, str):
            raise ValueError(f'"{key}" is not text')
        values.append(value.strip())
    if not values[0]:
        raise ValueError(f'"{keys[0]}" is missing or empty')
    return "\n\n".join(v for v in values if v)


def _with_follow_up(prompt: str, category: str, rng: random.Random, share: float, follow_ups=FOLLOW_UPS) -> Prompt:
    """A single request, or (for `share` of the rows) that request and a follow-up: a multi-turn chat."""
    if rng.random() < share:
        return [prompt, rng.choice(follow_ups)], "multi-turn"
    return [prompt], category


def gsm8k(row, rng) -> list[Prompt]:
    return [_with_follow_up(_text(row, "question"), "math", rng, 0.1, MATH_FOLLOW_UPS)]


def instruction_input(category: str, follow_up_share: float):
    """Rows of {"instruction", "input"} (Alpaca layout): the instruction, then its input if any."""

    def convert(row, rng) -> list[Prompt]:
        return [_with_follow_up(_text(row, "instruction", "input"), category, rng, follow_up_share)]

    return convert


def self_instruct_seed(row, rng) -> list[Prompt]:
    instances = row.get("instances") if isinstance(row, dict) else None
    if not isinstance(instances, list) or not instances or not isinstance(instances[0], dict):
        raise ValueError('"instances" must be a non-empty list of objects')
    prompt = "\n\n".join(t for t in (_text(row, "instruction"), str(instances[0].get("input", "")).strip()) if t)
    return [_with_follow_up(prompt, "chat", rng, 0.2)]


def text_task(text: str, title: str | None, rng: random.Random) -> Prompt:
    """A request about a given text: summarise it, rewrite it, or answer a question from it (about the
    section's title where it has one, else a general reading question)."""
    kind = rng.choice(("summarise", "rewrite", "rag"))
    if kind == "summarise":
        return [rng.choice(SUMMARISE).format(text=text, k=rng.choice(("two", "three", "four")))], kind
    if kind == "rewrite":
        return [rng.choice(REWRITE).format(text=text)], kind
    if title is None:
        question = rng.choice(READING_QUESTIONS)
    elif title.endswith("?"):
        question = title
    else:
        question = rng.choice(TOPIC_QUESTIONS).format(t=title[0].lower() + title[1:])
    return [rng.choice(RAG).format(text=text, q=question)], kind


def role_play(row, rng) -> list[Prompt]:
    """The role-play request as chat, and (long answers) the answer as a text to work on."""
    prompts = [_with_follow_up(_text(row, "instruction", "input"), "chat", rng, 0.15)]
    answer = row.get("response")
    if isinstance(answer, str) and 60 <= len(answer.split()) <= 400:
        prompts.append(text_task(answer.strip(), None, rng))
    return prompts


def doc_section(row, rng) -> list[Prompt]:
    """A documentation section of 40-350 words of prose: FAQ answers are questions over a document, others any
    text task."""
    title, text = row["title"], row["text"]
    if not 40 <= len(text.split()) <= 350 or title.lower().startswith(("table of contents", "footnotes")):
        return []
    if row["faq"] and title.endswith("?"):
        return [([rng.choice(RAG).format(text=text, q=title)], "rag")]
    return [text_task(text, title, rng)]


def sgd_dialogue(row, rng) -> list[Prompt]:
    """A task-oriented dialogue: its first user turns (2-4) as a multi-turn chat, one utterance to translate."""
    if not isinstance(row, dict) or not isinstance(row.get("turns"), list):
        raise ValueError('expected a dialogue with a "turns" list')
    user = [t.get("utterance", "").strip() for t in row["turns"] if isinstance(t, dict) and t.get("speaker") == "USER"]
    user = [u for u in user if u]
    if not user:
        raise ValueError("the dialogue has no user turn")
    prompts = []
    if len(user) >= 2:
        prompts.append((user[: rng.randint(2, 4)], "multi-turn"))
    long = [u for u in user if len(u.split()) >= 6]
    if long:
        text, lang = rng.choice(long), rng.choice(LANGUAGES)
        prompts.append(([rng.choice(TRANSLATE).format(text=text, lang=lang)], "translate"))
    return prompts


# Reading-comprehension rows as P3 (the prompts T0 was trained on) lays them out, one template per data set, as
# the self-instruct repository keeps 200 training rows of each template (data/finetuning/t0_train_50k)
ADVERSARIAL_QA = re.compile(r'Question: "(?P<q>[^\n]+?)"\n\nContext: "(?P<p>.+)"\n\nAnswer:\n?', re.S)
QUOREF = re.compile(r"(?P<q>[^\n]+)\n\nAnswer the above question based on the context below:\n\n(?P<p>.+?)\n?", re.S)
ROPES = re.compile(
    r"Given the background: (?P<p>.+?)\n\nand the situation: (?P<s>.+?)\n\n"
    r"Answer the following question: (?P<q>[^\n]+)\n?",
    re.S,
)


LAYOUT_MISMATCH = "the prompt does not have its template's layout (passage and question)"


def passage_rows(pattern: str, layout: re.Pattern) -> Callable[[Path], Iterator[Row]]:
    """Rows of a reading-comprehension data set grouped by passage: {"text", "questions"} named by the passage's
    first row (the data sets ask several questions about each passage, one row each). A row whose prompt does not
    have the layout comes as its ValueError."""

    def rows(raw: Path) -> Iterator[Row]:
        passages: dict[str, tuple[str, list[str]]] = {}
        for location, row in jsonl_rows(raw, pattern):
            try:
                match = None if isinstance(row, ValueError) else layout.fullmatch(_text(row, "prompt"))
            except ValueError as exc:
                row = exc
            if match is None:
                yield location, row if isinstance(row, ValueError) else ValueError(LAYOUT_MISMATCH)
                continue
            parts = match.groupdict()
            text = "\n\n".join(parts[k].strip() for k in ("p", "s") if parts.get(k))
            question = parts["q"].strip()
            question = question[0].upper() + question[1:]
            questions = passages.setdefault(text, (location, []))[1]
            if question not in questions:
                questions.append(question)
        for text, (location, questions) in passages.items():
            yield location, {"text": text, "questions": questions}

    return rows


def passage_tasks(text_task_too: bool):
    """A passage of 40-400 words and its crowd-written questions: one conversation asking up to three of them in
    turn (rag, or multi-turn with more than one), and (text_task_too) the passage to summarise or rewrite."""

    def convert(row, rng) -> list[Prompt]:
        text, questions = row["text"], row["questions"][:3]
        if not 40 <= len(text.split()) <= 400:
            return []
        turns = [rng.choice(RAG).format(text=text, q=questions[0]), *questions[1:]]
        prompts = [(turns, "rag" if len(turns) == 1 else "multi-turn")]
        if text_task_too:
            if rng.random() < 0.5:
                task = rng.choice(SUMMARISE).format(text=text, k=rng.choice(("two", "three", "four"))), "summarise"
            else:
                task = rng.choice(REWRITE).format(text=text), "rewrite"
            prompts.append(_with_follow_up(*task, rng, 0.15))
        return prompts

    return convert


def p3_source(name: str, licence: str, files: str, layout: re.Pattern, note: str, text_task_too=True) -> PromptSource:
    """A reading-comprehension data set's training rows in P3's layout, one template's file(s), as the
    self-instruct repository keeps them."""
    folder = "data/finetuning/t0_train_50k/data_per_template"
    return PromptSource(
        name,
        licence,
        "https://github.com/yizhongw/self-instruct",
        f"{folder}/{files}",
        f"{note} (train rows in P3's layout)",
        passage_rows(files, layout),
        passage_tasks(text_task_too),
        files=files,
    )


SOURCES = {
    s.name: s
    for s in (
        PromptSource(
            "gsm8k-train",
            "MIT",
            "https://github.com/openai/grade-school-math",
            "grade_school_math/data/train.jsonl",
            "grade-school math word problems, train split (the test split is never imported)",
            jsonl_rows,
            gsm8k,
        ),
        PromptSource(
            "self-instruct-seed",
            "Apache-2.0",
            "https://github.com/yizhongw/self-instruct",
            "data/seed_tasks.jsonl",
            "the 175 human-written seed tasks (instruction and first instance input)",
            jsonl_rows,
            self_instruct_seed,
        ),
        PromptSource(
            "gpteacher-codegen",
            "MIT",
            "https://github.com/teknium1/GPTeacher",
            "Codegen/codegen-instruct.json",
            "code tasks in several languages (instruction and input; the answers are not used)",
            json_array_rows,
            instruction_input("code", 0.1),
        ),
        PromptSource(
            "gpteacher-roleplay",
            "MIT",
            "https://github.com/teknium1/GPTeacher",
            "Roleplay/roleplay-simple-deduped-roleplay-instruct.json",
            "role-play requests as chat; answers of 60-400 words as texts to summarise, rewrite or ask about",
            json_array_rows,
            role_play,
        ),
        PromptSource(
            "python-docs",
            "PSF-2.0",
            "https://github.com/python/cpython/tree/3.11/Doc",
            "Doc/{tutorial,howto,faq,library,reference,using}/*.rst (Debian python3.11-doc: html/_sources)",
            "Python 3.11 tutorial, HOWTO, FAQ, library and language reference sections as documents to "
            "summarise, rewrite and answer questions from (FAQ questions are the questions)",
            rst_sections,
            doc_section,
        ),
        PromptSource(
            "sgd-train",
            "CC-BY-SA-4.0",
            "https://github.com/google-research-datasets/dstc8-schema-guided-dialogue",
            "train/dialogues_*.json",
            "Schema-Guided Dialogue train split: user turns as multi-turn chats, utterances to translate",
            json_array_rows,
            sgd_dialogue,
        ),
        p3_source(
            "adversarialqa-train",
            "CC-BY-SA-3.0",
            "adversarial_qa_*_question_context_answer.jsonl",
            ADVERSARIAL_QA,
            "AdversarialQA (Bartolo et al. 2020; Wikipedia passages): each passage's questions in turn, and the "
            "passage to summarise or rewrite",
        ),
        p3_source(
            "quoref-train",
            "CC-BY-4.0",
            "quoref_Given_Context_Answer_Question.jsonl",
            QUOREF,
            "Quoref (Dasigi et al. 2019; Wikipedia passages): each passage's questions in turn, and the passage to "
            "summarise or rewrite",
        ),
        p3_source(
            "ropes-train",
            "CC-BY-4.0",
            "ropes_given_background_situation.jsonl",
            ROPES,
            "ROPES (Lin et al. 2019; a background passage and a situation): the questions over both in turn",
            text_task_too=False,
        ),
    )
}


# ----- the import -----


@dataclass
class ImportResult:
    prompts: list[dict]
    malformed: list[str]
    overlapping: list[tuple[str, str]]


def convert_rows(source: PromptSource, raw: Path, on_error: str = "skip", report=None) -> ImportResult:
    """Every prompt of RAW's rows; malformed rows are listed as FILE:LINE: reason (or stop the import)."""
    report = report or log
    prompts, malformed = [], []
    for location, row in source.rows(raw):
        try:
            if isinstance(row, ValueError):
                raise row
            converted = source.convert(row, random.Random(f"{source.name}:{location}"))
        except ValueError as exc:
            if on_error == "fatal":
                raise DominoError(f"{location}: {exc}") from None
            report(f"{location}: {exc}; row skipped")
            malformed.append(f"{location}: {exc}")
            continue
        prompts.extend({"turns": turns, "category": cat, "from": location} for turns, cat in converted)
    return ImportResult(prompts, malformed, [])


def import_prompts(
    name: str,
    raw: str | Path,
    out_dir: str | Path,
    commit: str,
    benchmarks: list[str | Path],
    drop_overlapping: bool = False,
    on_error: str = "skip",
    report=None,
) -> dict:
    """Import source NAME from RAW into OUT_DIR/NAME.jsonl.gz and record it in OUT_DIR/sources.json.

    Refused: an unknown source, a raw file named like a held-out split, and (unless drop_overlapping)
    prompts sharing an n-gram with any benchmark file. Returns the source's sources.json entry.
    """
    report = report or log
    if name not in SOURCES:
        raise DominoError(f"unknown prompt source {name!r}; known: {', '.join(sorted(SOURCES))}")
    if not re.fullmatch(r"[0-9a-f]{7,40}|v?\d+(\.\d+)+(-[\w.+]+)?", commit):
        raise DominoError(f"--commit {commit!r}: expected the source's commit hash (hex) or release version")
    source, raw = SOURCES[name], Path(raw)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    if not raw.exists():
        raise DominoError(f"{raw}: no such file or folder")
    raw_files = source.raw_files(raw)
    held_out = [p for p in raw_files if _HELD_OUT.search(p.name)]
    if held_out:
        raise DominoError(f"{held_out[0]}: named like a held-out (test/eval) split; only training data is imported")
    result = convert_rows(source, raw, on_error, report)
    if not result.prompts:
        raise DominoError(f"{raw}: no usable rows for {name}")
    result.overlapping = check_overlap(name, result.prompts, benchmarks, drop_overlapping, report)
    if drop_overlapping:
        dropped = {loc for loc, _ in result.overlapping}
        result.prompts = [p for p in result.prompts if p["from"] not in dropped]
    path = Path(out_dir) / f"{name}.jsonl.gz"
    write_atomic(path, _gzip_jsonl(result.prompts))
    entry = {
        "licence": source.licence,
        "url": source.url,
        "commit": commit,
        "raw": source.raw,
        "raw_files": len(raw_files),
        "raw_sha256": _files_sha256(raw_files, raw),
        "note": source.note,
        "file": path.name,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "count": len(result.prompts),
        "categories": dict(sorted(Counter(p["category"] for p in result.prompts).items())),
        "malformed_rows": len(result.malformed),
        "overlap": {
            "ngram": NGRAM,
            "benchmarks": [Path(b).name for b in benchmarks],
            "overlapping": len(result.overlapping),
            "dropped": len(result.overlapping) if drop_overlapping else 0,
        },
    }
    _record_source(Path(out_dir), name, entry)
    report(f"{name}: {entry['count']} prompts {entry['categories']} -> {path}")
    return entry


def check_overlap(name: str, prompts: list[dict], benchmarks, drop: bool, report=None) -> list[tuple[str, str]]:
    """The prompts sharing an n-gram with a benchmark; any at all refuse the source unless `drop`."""
    report = report or log
    if not benchmarks:
        raise DominoError(f"{name}: no benchmark files to check overlap against (give prompts/eval-*.jsonl at least)")
    hits = find_overlaps([(p["from"], p["turns"]) for p in prompts], build_reference(benchmarks))
    report(f"{name}: {len(hits)} of {len(prompts)} prompts share a {NGRAM}-word n-gram with the benchmarks")
    if hits and not drop:
        shown = "; ".join(f"{loc} ~ {where}" for loc, where in hits[:5])
        raise DominoError(
            f"{name}: {len(hits)} prompt(s) overlap benchmark prompts ({shown}); refused. "
            "Pass --drop-overlapping to import the source without them"
        )
    return hits


def _files_sha256(files: list[Path], raw: Path) -> str:
    """One hash over the raw files' names (relative to RAW) and bytes: the input an import read."""
    h = hashlib.sha256()
    for path in files:
        h.update(_label(path, raw).encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def _gzip_jsonl(rows: list[dict]) -> bytes:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    return gzip.compress(text.encode(), mtime=0)


def read_sources(out_dir: str | Path) -> dict:
    path = Path(out_dir) / SOURCES_FILE
    if not path.exists():
        return {"format": SOURCES_FORMAT, "sources": {}}
    data = read_json_object(path, "a prompt sources manifest")
    if data.get("format") != SOURCES_FORMAT or not isinstance(data.get("sources"), dict):
        raise DominoError(f"{path}: not a {SOURCES_FORMAT} manifest")
    return data


def _record_source(out_dir: Path, name: str, entry: dict) -> None:
    data = read_sources(out_dir)
    data["sources"][name] = entry
    data["sources"] = dict(sorted(data["sources"].items()))
    write_json_atomic(out_dir / SOURCES_FILE, data)


# ----- reading the imported files back: mix:DIR:N -----


def read_imported(out_dir: str | Path) -> tuple[dict, dict[str, list[tuple[str, list[str], str]]]]:
    """sources.json and, per source, its (id, turns, category) rows; each file checked against its sha256."""
    out_dir = Path(out_dir)
    manifest = read_sources(out_dir)
    if not manifest["sources"]:
        raise DominoError(f"{out_dir}: no imported prompt sources ({SOURCES_FILE} missing or empty)")
    rows = {}
    for name, entry in manifest["sources"].items():
        path = out_dir / entry["file"]
        data = path.read_bytes() if path.is_file() else b""
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise DominoError(f"{path}: missing or changed since it was imported (sha256 differs from {SOURCES_FILE})")
        rows[name] = []
        for lineno, line in enumerate(gzip.decompress(data).decode().split("\n")[:-1], 1):
            obj = json.loads(line)
            rows[name].append((f"{name}:{lineno}", obj["turns"], obj["category"]))
    return manifest, rows


def mixed_order(rows: dict[str, list[tuple[str, list[str], str]]], seed: int) -> list[tuple[str, list[str], str]]:
    """Every row once, categories taking turns (and within a category, sources taking turns), each
    source's rows shuffled by `seed`. The order does not depend on how many are taken, so the first
    N of a larger draw are the draw of N: --skip continues a draw."""
    queues: dict[str, dict[str, list]] = {}
    for name in sorted(rows):
        shuffled = list(rows[name])
        random.Random(f"{seed}:{name}").shuffle(shuffled)
        for row in shuffled:
            queues.setdefault(row[2], {}).setdefault(name, []).append(row)
    streams = {cat: _round_robin(list(by_source.values())) for cat, by_source in sorted(queues.items())}
    return _round_robin(list(streams.values()))


def _round_robin(lists: list[list]) -> list:
    out, k = [], 0
    while any(k < len(lst) for lst in lists):
        out.extend(lst[k] for lst in lists if k < len(lst))
        k += 1
    return out
