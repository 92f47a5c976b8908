"""Every shell command a user can copy from README.md and docs/*.md still runs as written.

Commands are read from the fenced shell blocks (no language, bash, sh, console). A `dominospec ...` line is
parsed by the real argparse parser (a stale flag or value fails here, no model loads); a `python
scripts/X.py` or `pytest tests/...` names files that must exist; a curl that posts JSON must say so in its
Content-Type (the server answers 415 otherwise). Synopses (lines with [optional] brackets) are not
commands. What is not checked is in SKIPPED, each with its reason, and that list is itself checked: a
program no document runs any more must leave it.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from dominospec.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCKS = ("", "bash", "sh", "shell", "console")
SKIPPED = {  # program -> why its lines are not run here
    "pip": "installs from the package registry (network)",
    "kill": "stops a server a previous line started in the background",
    "cp": "copies a user's own files",
    "ruff": "the linter, run by CI itself",
    "reap": "not a command: a step of the engine's loop, drawn as a list",
    "admit": "not a command: a step of the engine's loop, drawn as a list",
    "prefill": "not a command: a step of the engine's loop, drawn as a list",
    "decode": "not a command: a step of the engine's loop, drawn as a list",
    "proposes": "not a command: a step of the engine's loop, drawn as a list",
    "scripts/grow_data.sh": "hours of data generation (the script's own test runs it small)",
}
PREFIXES = {"taskset": 3, "nice": 3, "env": 1}  # wrappers of a command: how many words they take first


def shell_lines(path: Path):
    """(line number, command) of each command in the shell blocks: continuation lines joined, comments cut,
    variables assigned earlier in the block substituted."""
    in_block, lang, pending, start, env = False, "", "", 0, {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", raw)
        if fence:
            in_block, lang, pending, env = not in_block, fence.group(1), "", {}
            continue
        if not in_block or lang not in SHELL_BLOCKS:
            continue
        line = raw.strip()
        if line.startswith("$ "):
            line = line[2:]
        if not pending:
            start = n
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        command, pending = (pending + line).strip(), ""
        try:
            shlex.split(command, comments=True)
        except ValueError:  # a quote still open: the value goes on on the next line
            pending = command + " "
            continue
        if not command or command.startswith("#"):
            continue
        assigned = re.fullmatch(r'([A-Z_]+)="([^"]*)"', command)
        if assigned:
            env[assigned.group(1)] = assigned.group(2)
            continue
        for name, value in env.items():
            command = command.replace(f"${{{name}}}", value).replace(f"${name}", value)
        yield start, command


def words_of(command: str) -> list[str]:
    words = shlex.split(command, comments=True)
    while words and (re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]) or words[0] in PREFIXES):
        words = words[PREFIXES.get(words[0], 1) :]  # VAR=value, or a wrapper and its own arguments
    if words and words[-1] == "&":
        words = words[:-1]
    if words[:3] in (["python", "-m", "dominospec.cli"], ["python3", "-m", "dominospec.cli"]):
        words = ["dominospec", *words[3:]]
    return words


def is_synopsis(command: str) -> bool:
    return bool(re.search(r"\s\[-", command)) or " | " in command and "[" in command


def commands():
    for path in DOCS:
        for n, command in shell_lines(path):
            if not is_synopsis(command) and not command.startswith(("{", '"', "[", "...")):
                yield f"{path.name}:{n}", command


COMMANDS = list(commands())


def test_the_documents_hold_commands():
    dominospec_lines = [c for _, c in COMMANDS if words_of(c)[:1] == ["dominospec"]]
    assert len(dominospec_lines) > 30


@pytest.mark.parametrize("where,command", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_doc_command_runs_as_written(where, command):
    for part in re.split(r"\s&&?\s|\s;\s", command):
        words = words_of(part)
        if not words or words[0] in SKIPPED or words[0].startswith("."):  # `. .venv/bin/activate`
            continue
        program = words[0]
        # a value the user's shell supplies ($SERVER, $((...))) stands as 1, a value left out ("...") as x;
        # `dominospec bench ...` leaves out every argument: its subcommand is checked
        words = ["1" if "$" in w else "x" if w == "..." else w for w in words]
        if words[2:] == ["x"]:
            words = [*words[:2], "--help"]
        if program == "dominospec":
            try:
                build_parser().parse_args(words[1:])
            except SystemExit as exc:
                if exc.code:
                    pytest.fail(f"{where}: `{part}` is refused by the parser (exit {exc.code})")
        elif program in ("python", "python3"):
            check_python(where, words[1:])
        elif program == "pytest":
            check_paths(where, words[1:])
        elif program == "curl":
            check_curl(where, part, words)
        else:
            pytest.fail(f"{where}: `{part}`: no check knows {program!r}; run it here, or add it to SKIPPED with why")


def check_python(where: str, args: list[str]) -> None:
    if args[:2] == ["-m", "pytest"]:
        check_paths(where, args[2:])
    elif args[:1] == ["-m"]:
        assert args[1].split(".")[0] in ("venv", "dominospec", "pytest"), f"{where}: python -m {args[1]}"
    elif args and args[0] != "-c":
        assert (ROOT / args[0]).exists(), f"{where}: {args[0]} does not exist"


def check_paths(where: str, args: list[str]) -> None:
    for a in args:
        if a.startswith("tests/"):
            assert (ROOT / a.split("::")[0]).exists(), f"{where}: {a} does not exist"


def check_curl(where: str, part: str, words: list[str]) -> None:
    if any(w in ("-d", "--data", "--json") or w.startswith("--data") for w in words) and "--json" not in words:
        assert "content-type: application/json" in part.lower(), f"{where}: curl posts JSON without its Content-Type"


def test_every_skipped_program_is_still_in_the_documents():
    programs = {words_of(p)[0] for _, c in COMMANDS for p in re.split(r"\s&&?\s|\s;\s", c) if words_of(p)}
    stale = sorted(set(SKIPPED) - programs)
    assert not stale, f"SKIPPED names programs no document runs any more: {stale}"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_examples_answer_against_a_real_server():
    """Each documented curl, as written, against a server on a tiny chat model (its address swapped in)."""
    from conftest import serve_in_thread, tiny_chat_target

    from dominospec.engine import Engine

    curls = [(w, c) for w, c in COMMANDS if words_of(c)[:1] == ["curl"]]
    assert curls
    target = tiny_chat_target()
    with serve_in_thread(Engine(target, max_batch=1), target) as base:
        for where, command in curls:
            words = [re.sub(r"^(https?://)?localhost:8000", base, w) for w in words_of(command)]
            done = subprocess.run([*words, "--fail-with-body"], capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, f"{where}: {done.stdout} {done.stderr}"
            assert json.loads(done.stdout)["choices"], where
