"""`dominospec prepare-data`: prompts in, the target's own answers out (training data)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..data.extend import add_part, check_extendable
from ..data.prepare import SHARD_BATCHES, ChatCodec, FeatureCapture, PrepareConfig, fit_to_context, prepare_data
from ..data.sources import check_prompt_specs, is_self_written, load_prompts
from ..data.store import read_manifest
from ..errors import DominoError
from ..io import check_free_space, ensure_writable_dir
from ..log import log
from ..targets.features import FeatureCache, parse_layer_ids
from .common import add_target_args, require_at_least, target_from_args


def cmd_prepare(args) -> int:
    # every argument is checked before anything is loaded or written
    shard_size = args.shard_size if args.shard_size is not None else SHARD_BATCHES * args.batch_size
    cfg = PrepareConfig(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        batch_size=args.batch_size,
        shard_size=shard_size,
        enable_thinking=args.enable_thinking,
        sampler=args.sampler or "batch",
    )
    require_at_least(args, 1, "limit")
    require_at_least(args, 0, "skip")
    if args.layer_ids and not args.feature_cache:
        raise DominoError(
            f"--layer-ids {args.layer_ids} chooses the layers kept in --feature-cache, and there is none: add "
            "--feature-cache DIR, or give --layer-ids to `train` instead"
        )
    if args.feature_cache:
        ensure_writable_dir(args.feature_cache, "--feature-cache")
    check_prompt_specs(args.prompts)
    ensure_writable_dir(args.out)
    if args.extend:
        check_extendable(args.extend)  # a damaged manifest or a folder of other things: refused before any work
        ensure_writable_dir(args.extend, "--extend")
    target = None
    if is_self_written(args.prompts):  # the target writes some prompts itself: load it first
        target = target_from_args(args)
    conversations, sources = load_prompts(
        args.prompts,
        seed=args.seed,
        limit=args.limit,
        skip=args.skip,
        on_error=args.on_error,
        report=log,
        target=target,
        keep_in=Path(args.out),
    )
    turns = sum(len(c.turns) for c in conversations)
    log(f"{len(conversations)} conversations ({turns} user turns) from {len(sources)} source(s)")
    # a full disk found now, not after hours of generation: about 8 bytes per JSONL token, a quarter compacted
    need = len(conversations) * (cfg.max_new_tokens + 512) * 8
    check_free_space(args.out, need)
    if args.extend:
        check_free_space(args.extend, need // 4, "--extend")
    target = target or target_from_args(args)
    if args.sampler is None:  # the faster one wherever the target runs natively
        cfg = replace(cfg, sampler="slots" if target.supports_rows else "batch")
    if args.extend:
        check_extendable(args.extend, target)
    capture = None
    if args.feature_cache:
        if cfg.sampler != "slots":
            raise DominoError(
                "--feature-cache: the features are captured by the slots sampler, which needs the native forward "
                "(--backend native, Llama-family models) and --sampler slots"
            )
        layer_ids = parse_layer_ids(args.layer_ids, target.num_layers) if args.layer_ids else list(target.layer_ids)
        capture = FeatureCapture(FeatureCache(args.feature_cache, target), layer_ids)
        log(f"feature cache {args.feature_cache}: layers {layer_ids} and the final state, kept while generating")
    prepare_data(target, conversations, args.out, cfg, sources=sources, on_error=args.on_error, capture=capture)
    if args.extend:
        # the run was made from the prompts that fit the context; those are the ones its part records
        kept, _ = fit_to_context(conversations, ChatCodec.for_target(target), target.max_positions, report=_quiet)
        entry = add_part(args.extend, args.out, kept, exist_ok=True, report=log)
        total = read_manifest(args.extend)["counts"]
        log(
            f"{args.extend}: {entry['name']} holds this run ({entry['counts']['samples']} samples); the data set now "
            f"has {total['samples']} samples, {total['tokens']} tokens ({total['supervised_tokens']} supervised)"
        )
    return 0


def _quiet(_message: str) -> None:
    """prepare_data already reported the prompts it left out."""


def add_parser(sub) -> None:
    p = sub.add_parser(
        "prepare-data",
        help="regenerate prompts' answers with the target (on-policy training data)",
        description="Let TARGET answer every user turn of the prompts (chat template, sampled; thinking off "
        "unless --enable-thinking) "
        "and write token ids with an assistant-only loss mask to OUT, ready for `dominospec train`. "
        "Killed runs resume where they stopped when rerun with the same arguments.",
    )
    add_target_args(p)
    p.add_argument(
        "--prompts",
        action="append",
        required=True,
        metavar="SOURCE",
        help="a JSONL file (turns / ShareGPT conversations / messages / prompt layouts), "
        "builtin:N (offline prompts from the Python stdlib, math templates, man pages), "
        "self:N (questions the target writes itself, deduplicated, degenerate ones dropped), "
        "pydoc:N (off-policy: stdlib docstrings and source as answers the target did not write, supervised "
        "where the target's greedy pick agrees; one prefill pass each, see docs/data.md), "
        "mix:DIR:N (the first N prompts imported into DIR by `dominospec import-prompts`, categories taking "
        "turns, shuffled by --seed) or hf:NAME[:SPLIT]; repeat to mix sources",
    )
    p.add_argument("--out", required=True, help="output directory (created; an existing one is resumed)")
    p.add_argument(
        "--extend",
        default=None,
        metavar="DATASET",
        help="when the run is complete, add it to this data set (created if new) as its next compact part "
        "(uint16 token ids in compressed shards, the prompts, a manifest); earlier parts stay byte "
        "for byte as they were, and a run made by another target or tokenizer is refused. Runs extending "
        "one data set at once take turns (DATASET/.lock). `train --data DATASET` reads every part",
    )
    p.add_argument(
        "--skip",
        type=int,
        default=0,
        help="drop the first N conversations of the sources, to continue a draw an earlier run began: "
        "--prompts builtin:3072 --seed 11 --skip 1024 gives the 2,048 builtin prompts after those of "
        "builtin:1024 --seed 11, none repeated (default %(default)s)",
    )
    p.add_argument("--limit", type=int, default=None, help="keep the first N conversations overall (after --skip)")
    p.add_argument(
        "--feature-cache",
        default=None,
        metavar="DIR",
        help="keep the target's states that generation computes anyway (feature layers and final state, fp16) "
        "in this training feature cache, so `train --feature-cache DIR` runs no target pass on these samples "
        "(slots sampler only; about 7 KB per token for SmolLM2-135M)",
    )
    p.add_argument(
        "--layer-ids",
        default=None,
        help="with --feature-cache: the target layers the drafter will read, as `train --layer-ids` "
        "(default: the target's evenly spaced default, what train uses without --layer-ids)",
    )
    p.add_argument("--max-new-tokens", type=int, default=512, help="per answer (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default %(default)s)")
    p.add_argument("--top-p", type=float, default=0.8, help="nucleus sampling mass (default %(default)s)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=8, help="conversations generated together (default %(default)s)")
    p.add_argument(
        "--sampler",
        choices=("slots", "batch"),
        default=None,
        help="slots: a fixed number of cache rows (--batch-size), each refilled with the next prompt as soon "
        "as its answer ends, one random stream per answer (native backend); batch: static batches, one "
        "stream per batch (how runs were made before). Part of the run's identity (default: slots where "
        "the target runs natively, else batch)",
    )
    p.add_argument(
        "--shard-size",
        type=int,
        default=None,
        help=f"conversations per shard file, a multiple of --batch-size (default {SHARD_BATCHES} batches)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed, also picks the builtin prompts (default 0)")
    p.add_argument(
        "--enable-thinking",
        action="store_true",
        help="render prompts with the chat template's thinking mode on (Qwen3: answers start with a <think> "
        "block, supervised like the rest of the answer); recorded in meta.json, part of the run's identity",
    )
    p.add_argument(
        "--on-error",
        choices=("skip", "fatal"),
        default="skip",
        help="malformed prompt lines and prompts too long for the target's context: report and skip (default), or stop",
    )
    p.set_defaults(func=cmd_prepare)
