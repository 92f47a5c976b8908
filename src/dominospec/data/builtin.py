"""The built-in offline prompt source (`builtin` or `builtin:N` on the command line).

It needs no network and is deterministic given a seed. It draws from what every Python machine has:
  * code (40%): public functions and classes of a fixed list of standard-library modules
    (`CODE_MODULES`): "write a function that <first docstring sentence>", "explain this source
    snippet", "what does `module.name` do?", unit tests, usage scripts, code review;
  * math (35%): templated arithmetic word problems (totals, differences, rates, percentages,
    ratios, averages, ages, multi-step) with random names, items and quantities;
  * chat (25%): "explain X in simple terms" style prompts on the first sentence of every
    standard-library module docstring (read with `ast`, never imported), a small hand-written
    list of general topics, and man-page NAME lines from /usr/share/man (skipped if absent).
The built-in list is prefix-stable: builtin_prompts(n) == builtin_prompts(m)[:n] for n <= m.
"""

from __future__ import annotations

import ast
import gzip
import importlib
import importlib.util
import inspect
import random
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .prompts import Conversation

MAX_PROMPT_CHARS = 1500


# Fixed so the built-in set is the same on every machine with the same Python version.
CODE_MODULES = [
    "argparse",
    "base64",
    "bisect",
    "calendar",
    "colorsys",
    "collections",
    "configparser",
    "contextlib",
    "copy",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "enum",
    "filecmp",
    "fnmatch",
    "fractions",
    "functools",
    "glob",
    "graphlib",
    "gzip",
    "hashlib",
    "heapq",
    "html",
    "ipaddress",
    "itertools",
    "json",
    "keyword",
    "linecache",
    "math",
    "mimetypes",
    "operator",
    "os.path",
    "pathlib",
    "pprint",
    "queue",
    "quopri",
    "random",
    "re",
    "sched",
    "secrets",
    "shlex",
    "shutil",
    "statistics",
    "string",
    "tempfile",
    "textwrap",
    "tokenize",
    "typing",
    "urllib.parse",
    "uuid",
    "zipfile",
]
MIX = {"code": 8, "math": 7, "chat": 5}  # slots out of 20: 40% / 35% / 25%

GENERAL_TOPICS = [
    "photosynthesis",
    "compound interest",
    "inflation",
    "the water cycle",
    "plate tectonics",
    "how vaccines train the immune system",
    "black holes",
    "the greenhouse effect",
    "supply and demand",
    "natural selection",
    "how a bill becomes a law",
    "the Pythagorean theorem",
    "probability",
    "DNA replication",
    "electric circuits",
    "how the internet routes packets",
    "public-key cryptography",
    "machine learning",
    "the placebo effect",
    "opportunity cost",
    "the scientific method",
    "ocean tides",
    "the Doppler effect",
    "how batteries store energy",
    "entropy",
    "the stock market",
    "recursion",
    "version control",
    "cloud computing",
    "the French Revolution",
    "the Renaissance",
    "the Silk Road",
    "how airplanes fly",
    "the immune system",
    "nutrition labels",
    "sleep cycles",
    "climate versus weather",
    "renewable energy",
    "nuclear fission",
    "the speed of light",
    "exponential growth",
    "statistics sampling bias",
    "how search engines rank pages",
    "blockchains",
    "a balanced budget",
    "the periodic table",
    "gravity",
    "magnetism",
    "volcanoes",
    "antibiotic resistance",
    "how credit scores work",
    "the difference between a virus and a bacterium",
    "time zones",
    "how compilers work",
    "databases and indexes",
    "the Fibonacci sequence",
    "prime numbers",
    "the Big Bang",
    "how memory works in the brain",
    "interest rates",
]

NAMES = [
    "Ava",
    "Liam",
    "Noah",
    "Mia",
    "Omar",
    "Priya",
    "Chen",
    "Sofia",
    "Mateo",
    "Zara",
    "Kenji",
    "Amara",
    "Lucas",
    "Ines",
    "Ravi",
    "Elena",
    "Tariq",
    "Hana",
    "Diego",
    "Freya",
    "Kwame",
    "Yuki",
    "Nadia",
    "Samuel",
    "Leila",
    "Oscar",
    "Maya",
    "Felix",
    "Aisha",
    "Jonas",
]
ITEMS = [
    ("apple", "apples"),
    ("notebook", "notebooks"),
    ("marble", "marbles"),
    ("cupcake", "cupcakes"),
    ("pencil", "pencils"),
    ("sticker", "stickers"),
    ("book", "books"),
    ("orange", "oranges"),
    ("toy car", "toy cars"),
    ("seashell", "seashells"),
    ("cookie", "cookies"),
    ("stamp", "stamps"),
    ("plant", "plants"),
    ("comic", "comics"),
    ("balloon", "balloons"),
    ("candle", "candles"),
]
ASK = [
    "Solve it step by step.",
    "Show your reasoning step by step, then give the final answer.",
    "Work through the problem step by step.",
    "Explain each step of your solution.",
    "Think step by step and state the answer at the end.",
]


def builtin_prompts(n: int, seed: int = 0) -> list[Conversation]:
    """n distinct single-turn prompts, mixed 40% code / 35% math / 25% chat, deterministic in seed."""
    rng = random.Random(seed)
    pools = {
        "code": iter(_shuffled(_code_prompts(), rng)),
        "math": _math_prompts(rng),
        "chat": iter(_shuffled(_chat_prompts(), rng)),
    }
    pattern = [kind for kind, slots in MIX.items() for _ in range(slots)]
    rng.shuffle(pattern)
    seen: set[str] = set()
    out: list[Conversation] = []
    while len(out) < n:
        kind = pattern[len(out) % len(pattern)]
        text = _next_unseen(pools[kind], seen)
        if text is None:  # a finite pool ran out: math problems never do
            pattern = [k for k in pattern if k != kind]
            continue
        seen.add(text)
        out.append(Conversation((text,), f"builtin-{kind}:{len(out)}"))
    return out


def _next_unseen(pool: Iterator[str], seen: set[str]) -> str | None:
    for text in pool:
        if text not in seen and len(text) <= MAX_PROMPT_CHARS:
            return text
    return None


def _shuffled(items: list[str], rng: random.Random) -> list[str]:
    items = list(items)
    rng.shuffle(items)
    return items


# -- code --


@dataclass(frozen=True)
class _StdlibObject:
    module: str
    name: str
    kind: str  # "function" or "class"
    sentence: str  # first sentence of the docstring
    signature: str  # "(a, b=1)" or ""
    source: str  # truncated source, "" for objects written in C


@lru_cache(maxsize=1)
def _code_prompts() -> tuple[str, ...]:
    """Two prompts per public stdlib object, templates picked by a fixed seed (material, not order).

    Objects with Python source get one source-reading prompt: reading real code is the rarest
    and most useful kind.
    """
    rng = random.Random(1234)
    prompts = []
    for obj in _stdlib_objects():
        reading = [t for t in _CODE_TEMPLATES if t.needs == "source" and t.applies(obj)]
        others = [t for t in _CODE_TEMPLATES if t.needs != "source" and t.applies(obj)]
        picks = [rng.choice(reading)] + rng.sample(others, 1) if reading else rng.sample(others, min(2, len(others)))
        prompts += [template.render(obj) for template in picks]
    return tuple(prompts)


def _stdlib_objects() -> list[_StdlibObject]:
    objects = []
    for module_name in CODE_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:  # a trimmed Python build; the other modules still give plenty
            continue
        declared = getattr(module, "__all__", None)  # trusted; otherwise skip what was imported from elsewhere
        names = declared or [n for n in dir(module) if not n.startswith("_")]
        for name in sorted(set(names)):
            obj = _describe(module, module_name, name, check_origin=declared is None)
            if obj is not None:
                objects.append(obj)
    return objects


def _describe(module, module_name: str, name: str, check_origin: bool) -> _StdlibObject | None:
    value = getattr(module, name, None)
    if not (inspect.isfunction(value) or inspect.isbuiltin(value) or inspect.isclass(value)):
        return None
    if check_origin and getattr(value, "__module__", None) not in (module.__name__, "_" + module.__name__):
        return None
    sentence = _first_sentence(inspect.getdoc(value) or "")
    if sentence is None or "deprecated" in sentence.lower():
        return None
    try:
        signature = _stable_signature(str(inspect.signature(value))) if not inspect.isclass(value) else ""
    except (TypeError, ValueError):
        signature = ""
    return _StdlibObject(
        module_name,
        name,
        "class" if inspect.isclass(value) else "function",
        sentence,
        signature,
        _source_snippet(value),
    )


_ADDRESS = r" at 0x[0-9a-fA-F]+"
_DEFAULT_REPR = re.compile(rf"<(?:function|built-in function|class) ([\w.]+)(?:{_ADDRESS})?>")


def _stable_signature(signature: str) -> str:
    """Defaults shown by name, not by repr: `<function copy2 at 0x7f..>` differs in every process,
    and a prompt that differs between runs would make prepare-data's resume refuse its own output."""
    signature = _DEFAULT_REPR.sub(r"\1", signature)
    return "" if re.search(_ADDRESS, signature) else signature


def _first_sentence(doc: str) -> str | None:
    paragraph = " ".join(doc.strip().split("\n\n", 1)[0].split())
    if not paragraph or re.match(r"^[\w.]+\(", paragraph):  # a signature line, not prose
        return None
    if re.search(r"[=~*#-]{3,}", paragraph):  # a reST heading or banner
        return None
    match = re.match(r"(.+?[.!?])(\s|$)", paragraph)
    sentence = match.group(1) if match else paragraph
    return sentence if 15 <= len(sentence) <= 300 else None


def _source_snippet(value, max_lines: int = 40, max_chars: int = 1100) -> str:
    if not inspect.isfunction(value):  # classes: inspect re-parses the whole module per call (slow)
        return ""
    try:
        lines = inspect.getsource(value).splitlines()
    except (OSError, TypeError):
        return ""
    kept, size = [], 0
    for line in lines[:max_lines]:
        if size + len(line) + 1 > max_chars:
            break
        kept.append(line)
        size += len(line) + 1
    if len(kept) < len(lines):
        kept.append("    ...")
    return "\n".join(kept)


_VERBS = {
    "return",
    "compute",
    "convert",
    "create",
    "make",
    "get",
    "set",
    "remove",
    "read",
    "write",
    "split",
    "join",
    "check",
    "test",
    "find",
    "build",
    "calculate",
    "encode",
    "decode",
    "parse",
    "format",
    "generate",
    "open",
    "copy",
    "add",
    "apply",
    "construct",
    "call",
    "load",
    "search",
    "match",
    "replace",
    "sort",
    "insert",
    "update",
    "wrap",
    "translate",
    "normalize",
    "escape",
    "quote",
    "unquote",
    "compare",
    "count",
    "pack",
    "unpack",
    "register",
    "determine",
    "extract",
    "produce",
    "choose",
    "shuffle",
    "merge",
    "indent",
    "dedent",
    "fill",
    "strip",
    "expand",
    "collapse",
    "delete",
    "move",
    "rename",
    "yield",
    "raise",
    "decorate",
    "transform",
    "estimate",
    "locate",
    "list",
}


def _third_person(sentence: str) -> str | None:
    """'Return the sum.' -> 'returns the sum.'; None when the sentence does not start with a known verb."""
    first, _, rest = sentence.partition(" ")
    verb = first.lower()
    if verb not in _VERBS or not rest:
        return None
    if verb.endswith(("s", "sh", "ch", "x", "z")):
        verb += "es"
    elif verb.endswith("y") and verb[-2] not in "aeiou":
        verb = verb[:-1] + "ies"
    else:
        verb += "s"
    return f"{verb} {rest}"


@dataclass(frozen=True)
class _CodeTemplate:
    text: str
    needs: str = ""  # "source", "verb", "function", "class" or ""

    def applies(self, obj: _StdlibObject) -> bool:
        if self.needs == "source":
            return bool(obj.source)
        if self.needs == "verb":
            return obj.kind == "function" and _third_person(obj.sentence) is not None
        return self.needs in ("", obj.kind)

    def render(self, obj: _StdlibObject) -> str:
        return self.text.format(
            module=obj.module,
            name=obj.name,
            sentence=obj.sentence,
            src=obj.source,
            sig=obj.signature or "(...)",
            does=_third_person(obj.sentence) or "",
        )


_CODE_TEMPLATES = [
    _CodeTemplate("Write a Python function that {does}", "verb"),
    _CodeTemplate("Write a Python function `{name}{sig}` for this task: {sentence}", "function"),
    _CodeTemplate(
        "Without importing `{module}`, implement your own version of `{name}`. Its documentation "
        'says: "{sentence}" Include a short docstring and an example call.',
        "function",
    ),
    _CodeTemplate(
        "Implement a small Python class in the spirit of `{module}.{name}`, whose documentation "
        'reads: "{sentence}" Keep it under 40 lines.',
        "class",
    ),
    _CodeTemplate("Explain what this Python function does:\n```python\n{src}\n```", "source"),
    _CodeTemplate(
        "Here is code from the Python standard library module `{module}`:\n```python\n{src}\n```\n"
        "Walk me through it and point out any edge cases a caller should know about.",
        "source",
    ),
    _CodeTemplate("What does `{module}.{name}` do? Give an example."),
    _CodeTemplate("Show a short, practical Python script that uses `{module}.{name}`, with comments."),
    _CodeTemplate("Write pytest unit tests for `{module}.{name}` covering typical input and edge cases."),
]


# -- math --


def _math_prompts(rng: random.Random) -> Iterator[str]:
    """An endless stream of word problems; numbers come from rng, so repeats are rare (and filtered)."""
    while True:
        problem = rng.choice(_MATH_TEMPLATES)(rng)
        yield f"{problem} {rng.choice(ASK)}"


def _people(rng, k):
    return rng.sample(NAMES, k)


def _total(rng):
    name = _people(rng, 1)[0]
    (_, a), (_, b) = rng.sample(ITEMS, 2)
    na, nb, pa, pb = rng.randint(2, 12), rng.randint(2, 12), rng.randint(1, 9), rng.randint(2, 15)
    return f"{name} buys {na} {a} at ${pa} each and {nb} {b} at ${pb} each. How much does {name} spend in total?"


def _difference(rng):
    x, y = _people(rng, 2)
    _, items = rng.choice(ITEMS)
    n, d = rng.randint(20, 90), rng.randint(3, 19)
    word = rng.choice(["fewer", "more"])
    return f"{x} has {n} {items}. {y} has {d} {word} {items} than {x}. How many {items} do {x} and {y} have together?"


def _rate(rng):
    name = _people(rng, 1)[0]
    vehicle = rng.choice(["cyclist", "train", "bus", "runner", "boat"])
    speed, hours, minutes = rng.randint(8, 120), rng.randint(1, 5), rng.choice([15, 20, 30, 40, 45])
    if rng.random() < 0.5:
        return (
            f"A {vehicle} moves at a steady {speed} km per hour. How far does it travel in {hours} hours "
            f"and {minutes} minutes?"
        )
    task, unit = rng.choice([("paint", "fence panels"), ("pack", "boxes"), ("type", "pages"), ("bake", "loaves")])
    per_hour = rng.randint(3, 12)
    total = per_hour * rng.randint(3, 11) + rng.randint(0, per_hour - 1)
    return (
        f"{name} can {task} {per_hour} {unit} per hour. How many hours does it take {name} to {task} "
        f"{total} {unit}, and how many full hours is that?"
    )


def _percentage(rng):
    name = _people(rng, 1)[0]
    item, _ = rng.choice(ITEMS)
    price, off = rng.randint(12, 240), rng.choice([5, 10, 15, 20, 25, 30, 40])
    if rng.random() < 0.5:
        tax = rng.choice([5, 8, 10])
        return (
            f"A {item} costs ${price}. The shop takes {off}% off, then adds {tax}% sales tax to the "
            f"discounted price. What does {name} pay?"
        )
    right, total = rng.randint(10, 47), rng.choice([50, 60, 80])
    return f"{name} answered {right} of {total} quiz questions correctly. What percentage is that?"


def _ratio(rng):
    x, y = _people(rng, 2)
    _, items = rng.choice(ITEMS)
    r1, r2 = rng.randint(1, 6), rng.randint(1, 6)
    total = (r1 + r2) * rng.randint(3, 15)
    return f"{x} and {y} share {total} {items} in the ratio {r1}:{r2}. How many {items} does each of them get?"


def _average(rng):
    name = _people(rng, 1)[0]
    scores = [rng.randint(55, 98) for _ in range(rng.randint(3, 5))]
    goal = rng.randint(70, 90)
    return (
        f"{name}'s test scores so far are {', '.join(map(str, scores))}. What score does {name} need on "
        f"the next test for an average of {goal}?"
    )


def _ages(rng):
    x, y = _people(rng, 2)
    age, k, later = rng.randint(4, 15), rng.randint(2, 4), rng.randint(2, 12)
    return (
        f"{x} is {age} years old and {y} is {k} times as old as {x}. In {later} years, what will the sum of "
        f"their ages be?"
    )


def _multi_step(rng):
    name = _people(rng, 1)[0]
    (a, _), (b, _) = rng.sample(ITEMS, 2)
    money = rng.randint(4, 20) * 10
    fraction = rng.choice([("a quarter", 4), ("a fifth", 5), ("half", 2), ("a tenth", 10)])
    spend, earn = rng.randint(3, 25), rng.randint(5, 40)
    return (
        f"{name} starts the week with ${money}. {name} spends {fraction[0]} of it on a {a}, then ${spend} on "
        f"a {b}, and later earns ${earn} helping a neighbour. How much money does {name} have now?"
    )


def _unit_price(rng):
    x, y = _people(rng, 2)
    _, items = rng.choice(ITEMS)
    n1, n2 = rng.randint(3, 9), rng.randint(10, 24)
    p1, p2 = rng.randint(5, 30), rng.randint(20, 70)
    return (
        f"{x} pays ${p1} for {n1} {items}, and {y} pays ${p2} for {n2} {items}. Who got the better price per "
        f"item, and by how much per item?"
    )


_MATH_TEMPLATES = [_total, _difference, _rate, _percentage, _ratio, _average, _ages, _multi_step, _unit_price]


# -- chat --

_TOPIC_TEMPLATES = [
    "Explain {t} in simple terms.",
    "Tell me about {t}, explained as if I were twelve years old.",
    "Give me a short overview of {t}, with one everyday example.",
    "What are the most common misconceptions about {t}?",
    "Why does {t} matter? Answer in a few short paragraphs.",
    "I keep hearing about {t}. Can you explain the basic idea and why people care?",
]


@lru_cache(maxsize=1)
def _chat_prompts() -> tuple[str, ...]:
    rng = random.Random(4321)
    prompts = [t.format(t=topic) for topic in GENERAL_TOPICS for t in rng.sample(_TOPIC_TEMPLATES, 3)]
    for module, sentence in _module_sentences():
        prompts.append(
            f'The Python module `{module}` is described as "{sentence}" Explain in simple terms '
            "what it is for and one situation where you would use it."
        )
        concept = _concept(sentence)
        if concept:
            prompts.append(rng.choice(_TOPIC_TEMPLATES).format(t=concept))
    for command, summary in _man_page_names():
        template = rng.choice(
            [
                "What is the `{c}` command used for ({s})? Give two short examples of using it.",
                'Explain in simple terms what `{c}` does; its manual describes it as "{s}".',
            ]
        )
        prompts.append(template.format(c=command, s=summary))
    return tuple(prompts)


def _concept(sentence: str) -> str | None:
    """A short noun phrase ("Bisection algorithms.") usable as a topic; None for longer prose."""
    words = sentence.rstrip(".").split()
    if not 2 <= len(words) <= 7 or words[0].lower() in {"this", "the", "a", "an", "module", "python", "support"}:
        return None
    return " ".join([words[0].lower() if not words[0].isupper() else words[0]] + words[1:])


def _module_sentences() -> list[tuple[str, str]]:
    """First docstring sentence of every pure-Python stdlib module, read with ast (nothing is imported)."""
    out = []
    for name in sorted(getattr(sys, "stdlib_module_names", CODE_MODULES)):
        if name.startswith("_") or name in ("this", "antigravity"):
            continue
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        try:
            doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8")))
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        sentence = _first_sentence(doc or "")
        if sentence:
            out.append((name, sentence))
    return out


def _man_page_names(root: Path = Path("/usr/share/man"), most: int = 400) -> list[tuple[str, str]]:
    """(command, one-line summary) from NAME sections of section 1 and 8 pages; [] if there are none.

    Pages with "_" in the file name are skipped: they are per-subcommand pages (gcloud ships
    thousands) that would drown out everything else.
    """
    files = sorted(p for section in ("man1", "man8") for p in (root / section).glob("*.gz") if "_" not in p.name)
    step = max(1, len(files) // most)
    out = []
    for path in files[::step]:
        entry = _man_name_line(path)
        if entry is not None:
            out.append(entry)
    return out


def _man_name_line(path: Path) -> tuple[str, str] | None:
    """The NAME line of a troff man page ("ls \\- list directory contents") as (command, summary)."""
    try:
        with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
            lines = [line.strip() for line, _ in zip(f, range(300))]
    except (OSError, EOFError):
        return None
    starts = [i for i, line in enumerate(lines) if re.fullmatch(r'\.S[Hh]\s+"?NAME"?', line)]
    if not starts:
        return None
    text = next((line for line in lines[starts[0] + 1 :] if line and not line.startswith(".")), "")
    text = re.sub(r"\\f[BIRP]|\\&|\\\(..", "", text).replace("\\-", "-")
    command, sep, summary = text.partition(" - ")
    command = command.split(",")[0].strip()
    if sep and re.fullmatch(r"[\w.+-]+", command) and 10 <= len(summary) <= 160:
        return command, summary.strip()
    return None
