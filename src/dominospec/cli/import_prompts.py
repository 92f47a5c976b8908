"""`dominospec import-prompts`: a public data set's rows in, a compact prompt file and its licence record out."""

from __future__ import annotations

from pathlib import Path

from ..data.imports import SOURCES, import_prompts
from ..data.overlap import default_benchmarks
from ..log import log


def cmd_import_prompts(args) -> int:
    benchmarks = list(args.benchmark or [])
    if not args.no_eval_sets:
        benchmarks = default_benchmarks(args.repo) + benchmarks
    entry = import_prompts(
        args.source,
        args.raw,
        args.out,
        args.commit,
        benchmarks,
        drop_overlapping=args.drop_overlapping,
        on_error=args.on_error,
        report=log,
    )
    overlap = entry["overlap"]
    log(
        f"{args.source} ({entry['licence']}, {entry['url']} at {entry['commit'][:12]}): {entry['count']} prompts, "
        f"{entry['malformed_rows']} malformed row(s) skipped, {overlap['overlapping']} overlapping "
        f"{len(overlap['benchmarks'])} benchmark file(s) ({overlap['dropped']} dropped)"
    )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "import-prompts",
        help="import a public prompt source (licence recorded, benchmark overlap refused) for prepare-data",
        description="Read RAW (the source's files as its authors publish them) into OUT/SOURCE.jsonl.gz and "
        "record the source's licence, URL, commit and counts in OUT/sources.json; `prepare-data --prompts "
        "mix:OUT:N` then draws N prompts with the categories taking turns. Prompts sharing an 8-word n-gram "
        "with prompts/eval-*.jsonl or a --benchmark file refuse the source. Sources: "
        + "; ".join(f"{s.name} ({s.licence}, {s.raw})" for s in SOURCES.values()),
    )
    p.add_argument("source", choices=sorted(SOURCES), help="which public data set RAW holds")
    p.add_argument("raw", help="the source's file, or a folder of its files")
    p.add_argument(
        "--commit",
        required=True,
        help="the commit of the source's repository the files were read from (or a release version)",
    )
    p.add_argument("--out", default="prompts/train", help="folder of imported prompts (default %(default)s)")
    p.add_argument(
        "--benchmark",
        action="append",
        metavar="FILE",
        help="another benchmark file to check overlap against (JSONL: every string in it; else its lines); repeat",
    )
    p.add_argument("--repo", default=".", type=Path, help="where prompts/eval-*.jsonl live (default: here)")
    p.add_argument("--no-eval-sets", action="store_true", help="do not check against prompts/eval-*.jsonl")
    p.add_argument(
        "--drop-overlapping",
        action="store_true",
        help="import the source without its overlapping prompts (recorded) instead of refusing it",
    )
    p.add_argument(
        "--on-error",
        choices=("skip", "fatal"),
        default="skip",
        help="malformed rows: report FILE:LINE and skip (default), or stop",
    )
    p.set_defaults(func=cmd_import_prompts)
