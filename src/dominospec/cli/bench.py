"""`dominospec bench`: every method on the same prompts, side by side; and the verify-cost profile."""

from __future__ import annotations

import torch

from ..bench.concurrency import (
    bench_concurrency,
    format_concurrency_table,
    parse_concurrency,
    write_concurrency,
)
from ..bench.methods import DEFAULT_METHODS, DRAFTER_GROUPS, build_methods
from ..bench.report import format_method_table, format_verify_cost, write_verify_cost
from ..bench.runner import (
    PROMPT_TIME_LIMIT_S,
    benchmark,
    load_prompt_sets,
    parse_choices,
    parse_methods,
    parse_verify,
    save_acceptance,
)
from ..data.prompts import check_prompt_file
from ..drafter.checkpoint import ACCEPTANCE_NAME, is_shipped, sidecar_path
from ..drafter.fast import DRAFTER_FORMATS
from ..errors import DominoError
from ..io import ensure_writable_dir
from ..log import log
from ..tune.profile import auto_block_size, profile_verify_cost
from ..tune.spec import DRAFTS, LOOKUP, NONE, PROPOSERS, SHIPPED, load_drafter, parse_spec
from .common import (
    add_sampling_args,
    add_target_args,
    add_verify_list_arg,
    block_size_arg,
    check_verify_args,
    require_at_least,
    resolve_drafter,
    sampling_from_args,
    target_from_args,
    warn_if_reduced_precision,
)
from .serve import need_serve_extra


def cmd_bench(args) -> int:
    if args.server or args.compare:
        return _bench_server(args)
    if not args.prompts and not args.profile:
        raise DominoError("nothing to do: give --prompts FILE.jsonl (one or more), --profile, or both")
    # arguments and the output directory first: nothing is loaded or run before they are sound
    require_at_least(
        args,
        1,
        "max_new_tokens",
        "limit",
        "context",
        "max_k",
        "repeats",
        *(["block_size"] if args.block_size != "auto" else []),
    )
    if not args.prompt_time_limit >= 0:
        raise DominoError(f"--prompt-time-limit must be >= 0 seconds (0: no limit), got {args.prompt_time_limit}")
    levels = parse_concurrency(args.concurrency) if args.concurrency is not None else None
    proposers = parse_choices(args.proposers, "--proposers", tuple(PROPOSERS)) if levels else None
    if levels and not args.prompts:
        raise DominoError("--concurrency needs --prompts FILE.jsonl")
    groups = parse_methods(args.methods)
    verify = parse_verify(args.verify)
    drafter_weights = (
        parse_choices(args.drafter_weights, "--drafter-weights", DRAFTER_FORMATS) if args.drafter_weights else None
    )
    check_verify_args(args)
    for p in args.prompts:
        check_prompt_file(p)
    sampling = sampling_from_args(args)
    if LOOKUP in args.drafter:
        raise DominoError(
            "bench takes no --drafter lookup: prompt lookup alone is the `lookup` method "
            "(--methods ar,lookup), and `hybrid` pairs it with each drafter"
        )
    if args.save_acceptance:
        _check_save_acceptance_args(args, groups, verify, sampling)
    # drafter directories are read and checked before the target loads
    specs = concurrency_specs(args, proposers, verify) if levels else None
    named = [(d, load_drafter(d, args.target)) for d in args.drafter] if not levels else []
    out = ensure_writable_dir(args.out)  # a benchmark's results are never lost to a bad --out
    target = target_from_args(args)
    warn_if_reduced_precision(target)

    if args.profile:
        log(
            f"profiling verify cost: 1..{args.max_k} new tokens after a {args.context}-token context, "
            f"median of {args.repeats}"
        )
        table = profile_verify_cost(target, args.context, args.max_k, args.repeats, args.seed)
        write_verify_cost(table, out, plots=not args.no_plots)
        print(format_verify_cost(table))
        log(f"wrote {out / 'verify_cost.json'}")
    if not args.prompts:
        return 0
    if levels:
        return _bench_concurrency(args, target, levels, specs, sampling, out)

    drafters = []
    if named:
        drafters = [(d, drafter.attach(target)) for d, drafter in named]
    elif any(g in groups for g in DRAFTER_GROUPS):
        shipped = resolve_drafter(target, None)
        if shipped is not None:
            drafters = [("shipped default", shipped)]
    if drafter_weights:  # one copy of each drafter per format (each keeps its own packed copies)
        drafters = [
            (f"{source} @{fmt}", with_weight_format(resolve_drafter(target, d.directory and str(d.directory)), fmt))
            for source, d in drafters
            for fmt in drafter_weights
        ]
    block_size = args.block_size
    if block_size == "auto":
        block_size = {}
        for source, d in drafters:
            b, note = auto_block_size(target, d)
            block_size[source] = max(1, b)  # the benchmark measures the drafter even where plain wins
            log(f"{source}: {note}")
    methods, notes = build_methods(
        groups,
        drafters,
        block_size,
        verify,
        target,
        threshold=args.confidence_threshold,
        lookup_min_match=args.lookup_min_match,
        gguf=args.gguf,
    )
    for n in notes:
        log(n)
    if args.save_acceptance:
        _check_acceptance_destinations(drafters, block_size, args.into_package)
    datasets = load_prompt_sets(args.prompts, target, args.limit, report=log)
    log(
        f"benchmarking {', '.join(m.name for m in methods)} on "
        + ", ".join(f"{d} ({len(p)})" for d, p in datasets.items())
    )
    results = benchmark(
        target,
        datasets,
        methods,
        out,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=args.seed,
        warmup=not args.no_warmup,
        plots=not args.no_plots,
        notes=notes,
        time_limit_s=args.prompt_time_limit or None,
        config={
            "prompt_files": [str(p) for p in args.prompts],
            "limit": args.limit,
            "block_size": args.block_size,
            "verify": verify,
        },
    )
    for m in results["methods"].values():
        for x in m.get("mismatched_prompts", []):
            log(
                f"MISMATCH {x['method']}: {x['dataset']} prompt {x['prompt_index']} differs from ar at token "
                f"{x['first_diff']}"
            )
    saved = save_acceptance(results, methods, report=log) if args.save_acceptance else []
    for path in saved:
        log(f"wrote {path} (read by --block-size auto)")
    print(format_method_table(results["methods"]))
    log(f"wrote {out / 'results.json'} and {out / 'report.md'}")
    if args.save_acceptance and not saved:
        raise DominoError(f"--save-acceptance: no {ACCEPTANCE_NAME} was written (see the reasons above)")
    bad = {n: m["not_near_tie"] for n, m in results["methods"].items() if m.get("not_near_tie")}
    if bad:
        raise DominoError(
            f"outputs differ from the target's own choices by more than a near-tie: {bad} tokens "
            "(a bug, not rounding); see report.md"
        )
    return 0


def concurrency_specs(args, proposers, verify) -> dict:
    """label -> SpecConfig for --concurrency: each proposer with each --verify mode and each --drafter (default:
    the shipped one), parsed by the one parser (tune/spec.py), labelled as the batch-1 methods are."""
    words = args.drafter or [SHIPPED]
    block_size = args.block_size if isinstance(args.block_size, int) else None
    specs = {}
    for proposer in proposers:
        if proposer == NONE:
            specs["plain"] = spec_for(args, NONE, None, None, block_size)
            continue
        for word in words if proposer in DRAFTS else [LOOKUP]:
            for mode in verify:
                spec = spec_for(args, word, proposer == "hybrid" if proposer in DRAFTS else None, mode, block_size)
                named = f" {word}" if proposer in DRAFTS and len(words) > 1 else ""
                specs[f"{proposer}-{mode}{named}"] = spec
    return specs


def spec_for(args, word, lookup, mode, block_size):
    return parse_spec(
        "bench-concurrency",
        drafter=word,
        lookup=lookup,
        verify=mode,
        block_size=block_size,
        threshold=args.confidence_threshold,
        lookup_min_match=args.lookup_min_match,
        seed=args.seed,
        target_name=args.target,
    )


def _bench_concurrency(args, target, levels, specs, sampling, out) -> int:
    """The engine under closed-loop load: every configuration at every concurrency level."""
    datasets = load_prompt_sets(args.prompts, target, args.limit, report=log)
    log(f"engine under load: {', '.join(specs)} at concurrency {', '.join(map(str, levels))}")
    results = bench_concurrency(target, specs, datasets, levels, args.max_new_tokens, sampling, args.seed, progress=log)
    written = write_concurrency(results, out, plots=not args.no_plots)
    print(format_concurrency_table(results))
    log("wrote " + ", ".join(str(p) for p in written))
    return 0


def _bench_server(args) -> int:
    """Running servers under load per category and concurrency, and/or earlier runs, in one report."""
    need_serve_extra()
    from ..bench.loadtest import check_loopback
    from ..bench.server import ServerBenchConfig, bench_server, load_runs, read_categories, write_report

    require_at_least(args, 1, "max_new_tokens", "limit")
    for url in args.server:
        check_loopback(url, "--server")
    if args.server and not args.prompts:
        raise DominoError("--server needs --prompts FILE.jsonl (one or more)")
    if len(args.label) > len(args.server):
        raise DominoError(f"{len(args.label)} --label for {len(args.server)} --server: give at most one per server")
    levels = parse_concurrency(args.concurrency or "1")
    runs = [run for p in args.compare for run in load_runs(p)]
    earlier = len(runs)
    categories = read_categories(args.prompts, args.limit) if args.server else {}
    out = ensure_writable_dir(args.out)
    for i, url in enumerate(args.server):
        cfg = ServerBenchConfig(
            url=url,
            categories=categories,
            levels=levels,
            label=args.label[i] if i < len(args.label) else "",
            max_tokens=args.max_new_tokens,
            temperature=args.temperature,
            seed=args.seed,
            spec_metrics=not args.no_spec_metrics,
            api_key=args.api_key,
            level_timeout_s=args.level_timeout,
        )
        log(f"bench --server {url}: {', '.join(categories)} at concurrency {', '.join(map(str, levels))}")
        runs.append(bench_server(cfg, progress=log))
    written = write_report(runs, out, plots=not args.no_plots)
    print((out / "server.md").read_text(), end="")
    log("wrote " + ", ".join(str(p) for p in written))
    failed = sum(sum(row["errors"].values()) for run in runs[earlier:] for row in run["rows"])
    return 1 if failed else 0


def _check_save_acceptance_args(args, groups, verify, sampling) -> None:
    """--save-acceptance records greedy, full-block, every-draft runs: refuse what would write nothing."""
    why = []
    if sampling.temperature != 0:
        why.append(f"it needs greedy runs (--temperature 0), not --temperature {args.temperature}")
    if "fixed" not in verify:
        why.append(f"it needs the `fixed` verify policy in --verify (got {','.join(verify)})")
    if "drafters" not in groups:
        why.append("it needs the `drafters` group in --methods")
    if not args.prompts:
        why.append("it needs --prompts to run the drafters on")
    if why:
        raise DominoError("--save-acceptance would write nothing: " + "; ".join(why))


def with_weight_format(drafter, fmt: str):
    """The drafter, its packed path streaming weights in `fmt` (packed now, not inside a timed cycle)."""
    drafter.weight_format = fmt
    with torch.no_grad():
        drafter.fast()
    return drafter


def _check_acceptance_destinations(drafters, block_size, into_package: bool) -> None:
    """Before the benchmark: each drafter's acceptance.json can be written, and is allowed to be."""
    if not drafters:
        raise DominoError("--save-acceptance: no drafter to measure (pass --drafter DIR)")
    for source, d in drafters:
        directory = sidecar_path(d, ACCEPTANCE_NAME).parent
        b = block_size.get(source) if isinstance(block_size, dict) else block_size
        if b is not None and b != d.config.block_size:
            raise DominoError(
                f"--save-acceptance: {source} would run at block size {b}, not its own {d.config.block_size}; "
                "acceptance.json records the full block (drop --block-size)"
            )
        if is_shipped(directory) and not into_package:
            raise DominoError(
                f"--save-acceptance would write into the installed package ({directory}); copy the drafter "
                f"(cp -r {directory} my-drafter) and pass --drafter my-drafter, or pass --into-package"
            )
        ensure_writable_dir(directory, "--save-acceptance: drafter directory")
        existing = directory / ACCEPTANCE_NAME
        if existing.exists() and not existing.is_file():
            raise DominoError(f"--save-acceptance: {existing} exists and is not a file")


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="benchmark speedup, tau, acceptance and losslessness against plain decoding",
        description="Run plain decoding (ar, the reference), transformers generate (hf), transformers prompt lookup "
        "(pld), each drafter with each --verify policy and without its sequential head, dominospec's "
        "own prompt lookup and the drafter + lookup hybrid on the same prompts, interleaved per prompt "
        "after a warm-up; write DIR/results.json, report.md and plots. With --profile, also measure "
        "the target's verify cost for 1..K new tokens (DIR/verify_cost.json).",
    )
    p.add_argument(
        "--prompts",
        action="extend",
        nargs="+",
        default=[],
        metavar="FILE.jsonl",
        help="prompt file(s), one or more after the flag and the flag repeatable (so prompts/eval-*.jsonl works); "
        "one dataset per file, named after its stem; the first user turn of each conversation is the prompt",
    )
    add_target_args(p)
    p.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="DIR",
        help="drafter directory (repeatable; default: the one shipped for the bundled target)",
    )
    p.add_argument(
        "--drafter-weights",
        default=None,
        metavar="FORMATS",
        help="comma list of weight formats the drafters stream on the packed path (float32, bfloat16, "
        "bfloat16-dot, int8, int8-dot): each drafter runs once per format, side by side, its methods named "
        "...@FORMAT; default: the target's own format, int8 as int8-dot where the CPU has an int8 dot product (or "
        "DOMINOSPEC_DRAFTER_WEIGHTS)",
    )
    p.add_argument(
        "--methods",
        default=DEFAULT_METHODS,
        help="comma list of ar, hf, pld, drafters, ablation (drafters without their head), lookup "
        "(prompt lookup alone, on the native path), hybrid (each drafter + prompt lookup), sweep "
        "(each drafter at every smaller fixed block size), llamacpp (llama.cpp through llama-cpp-python on "
        "--gguf, plain; skipped when not installed), llamacpp-pld (its prompt lookup) (default %(default)s)",
    )
    p.add_argument(
        "--gguf",
        default=None,
        metavar="FILE",
        help="the GGUF the llamacpp method decodes (default: for the bundled target, the Q4_1 file it ships)",
    )
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts of each file")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default %(default)s")
    p.add_argument(
        "--prompt-time-limit",
        type=float,
        default=PROMPT_TIME_LIMIT_S,
        metavar="S",
        help="seconds one method may take on one prompt (its warm-up too); past it that method is stopped, "
        "the prompt counted as timed out in the table, and its later prompts skipped; 0 = no limit "
        "(default %(default)s)",
    )
    p.add_argument(
        "--block-size",
        type=block_size_arg,
        default=None,
        help="drafts per cycle: a number, or auto (per drafter, from `dominospec profile` and its "
        "acceptance.json); default: each drafter's own",
    )
    p.add_argument(
        "--save-acceptance",
        action="store_true",
        help="write each drafter's measured conditional acceptance by position into its directory "
        "(acceptance.json, what --block-size auto reads); needs greedy runs (--temperature 0) with the "
        "drafters group, the fixed policy and each drafter's own block size, all checked before the run; "
        "a drafter that measured no cycle is not written",
    )
    p.add_argument(
        "--into-package",
        action="store_true",
        help="let --save-acceptance write into the shipped drafter inside the installed package (refused by default)",
    )
    add_verify_list_arg(p)
    add_sampling_args(p)
    p.add_argument("--no-warmup", action="store_true", help="skip the uncounted warm-up run of each method")
    p.add_argument("--no-plots", action="store_true", help="do not draw PNG plots")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory")
    c = p.add_argument_group("the batched engine under load")
    c.add_argument(
        "--concurrency",
        default=None,
        metavar="LIST",
        help="comma list of concurrency levels, e.g. 1,2,4,8,16: closed-loop clients over the prompts "
        "through the batched engine (instead of the batch-1 methods); writes DIR/concurrency.json/.md/.png",
    )
    c.add_argument(
        "--proposers",
        default="none,drafter",
        help=f"comma list of proposers for --concurrency ({', '.join(PROPOSERS)}); each one that drafts runs with "
        "every --verify mode and every --drafter (a mode a drafter cannot run is skipped with a note); cost reads "
        "this device's batched cost table, measured on first use when missing (default %(default)s)",
    )
    s = p.add_argument_group(
        "a running server (any OpenAI-compatible one on this machine)",
        "Streaming chat clients per prompt category (a line's `category`, as in Spec-Bench and SPEED-Bench, "
        "else the file's name) at each --concurrency level; writes DIR/server.json, server.md and server.png. "
        "Nothing is loaded here: the server answers.",
    )
    s.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="URL",
        help="the server's root, e.g. http://127.0.0.1:8000 (repeatable: each runs in turn, compared side by side, "
        "the first as the baseline)",
    )
    s.add_argument("--label", action="append", default=[], help="a name for each --server in the report")
    s.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="SERVER.json",
        help="an earlier run's server.json (repeatable), reported beside the others (listed first)",
    )
    s.add_argument("--api-key", default=None, help="the server's API key")
    s.add_argument(
        "--no-spec-metrics",
        action="store_true",
        help="do not ask for dominospec's spec_metrics extension (for servers that refuse unknown fields)",
    )
    s.add_argument(
        "--level-timeout",
        type=float,
        default=600.0,
        help="seconds after which a category at one concurrency starts no new request (default %(default)s)",
    )
    g = p.add_argument_group("verify cost profile")
    g.add_argument(
        "--profile",
        action="store_true",
        help="measure one target forward over k = 1..K new tokens after a cached context "
        "(the cost table a scheduler uses); runs before the benchmark when --prompts is given too",
    )
    g.add_argument("--context", type=int, default=256, help="context length for --profile (default %(default)s)")
    g.add_argument("--max-k", type=int, default=16, help="largest k for --profile (default %(default)s)")
    g.add_argument(
        "--repeats", type=int, default=7, help="timed repeats per k; the median is kept (default %(default)s)"
    )
    p.set_defaults(func=cmd_bench)
