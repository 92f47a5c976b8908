"""The `dominospec` command line: one module per subcommand, each thin (parse, call the library, print).

common.py     flags several subcommands share (target, sampling, drafter shape, verify) -> library objects
generate.py   dominospec generate
init.py       dominospec init
prepare.py    dominospec prepare-data
import_prompts.py  dominospec import-prompts
train.py      dominospec train (over train/run.py)
calibrate.py  dominospec calibrate
bench.py      dominospec bench
profile.py    dominospec profile
export.py     dominospec export
custom_generate.py  dominospec custom-generate
serve.py      dominospec serve
loadtest.py   dominospec loadtest

Nothing outside this package imports it.
"""

from __future__ import annotations

import argparse
import os
import sys

from ..errors import DominoError
from ..io import forget_created_dirs, remove_unused_dirs
from ..version import __version__
from . import (
    bench,
    calibrate,
    custom_generate,
    export,
    generate,
    import_prompts,
    init,
    loadtest,
    prepare,
    profile,
    serve,
    train,
)
from .common import check_environment

SUBCOMMANDS = [
    generate,
    init,
    import_prompts,
    prepare,
    train,
    calibrate,
    bench,
    profile,
    export,
    custom_generate,
    serve,
    loadtest,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dominospec",
        description="Domino speculative decoding for Hugging Face causal LMs: faster generation, identical output.",
    )
    parser.add_argument("--version", action="version", version=f"dominospec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in SUBCOMMANDS:
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    forget_created_dirs()
    try:
        check_environment()  # the DOMINOSPEC_* switches, with the arguments, before anything loads
        return int(args.func(args) or 0)
    except DominoError as exc:
        remove_unused_dirs()  # a refused run leaves no empty --out behind
        print(f"dominospec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dominospec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # output piped into `head` and the reader left: stop quietly, and keep Python from
        # complaining again when it flushes stdout at exit
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # stdout replaced by something without a descriptor
            pass
        return 141


if __name__ == "__main__":
    sys.exit(main())
