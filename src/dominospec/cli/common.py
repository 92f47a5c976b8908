"""Arguments several subcommands share, and turning them into library objects."""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from ..decode.lookup import HYBRID_MIN_MATCH
from ..decode.schedule import DEFAULT_THRESHOLD, VERIFY_MODES, check_threshold, verify_mode_help
from ..devices import threads_to_use
from ..drafter import HEADS, Drafter, DrafterConfig, shipped_drafter_dir
from ..errors import DominoError, flag
from ..export import ENGINES, arch_for_engine
from ..log import log, log_once
from ..sampling import MIN_TEMPERATURE, MIN_TOP_P, SamplingConfig, check_sampling
from ..targets import DEFAULT_TARGET, Target, parse_layer_ids
from ..targets.hf import BACKENDS
from ..tune.spec import LOOKUP, NONE, SHIPPED, SURFACE_DEFAULTS, SpecConfig, parse_spec

SWITCH_WORDS = ("on", "off", "1", "0", "true", "false", "yes", "no")  # what the package's on/off switches read


def environment_switches() -> dict[str, tuple[str, ...]]:
    """Every DOMINOSPEC_* switch the package reads that takes a word, with the words it takes (each from the
    module that reads it). DOMINOSPEC_CACHE (a directory) and DOMINOSPEC_API_KEY (serve's key, checked by serve)
    take free text."""
    from ..drafter import fast
    from ..targets import kernels, native

    return {
        kernels.ENV_SWITCH: SWITCH_WORDS,
        kernels.BF16_DOT_SWITCH: SWITCH_WORDS,
        kernels.INT8_DOT_PATH: kernels.INT8_DOT_PATHS,
        native.FUSED_SWITCH: SWITCH_WORDS,
        fast.ENV_SWITCH: SWITCH_WORDS,
        fast.WEIGHTS_SWITCH: (*fast.DRAFTER_FORMATS, "auto"),
    }


def check_environment(environ=None) -> None:
    """Refuse a switch set to a word its reader does not take, naming the variable and the words it takes:
    checked with the arguments, before any model loads (a bad word otherwise surfaced after the load, or never)."""
    environ = os.environ if environ is None else environ
    for name, words in environment_switches().items():
        value = environ.get(name)
        if value is not None and value.strip().lower() not in words:
            raise DominoError(f"{name}={value!r}: expected one of {', '.join(words)}")


def default(cls, name: str):
    """The library's default for a dataclass field, so a flag's default is stated once, in the library."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    if f.default is dataclasses.MISSING:
        raise TypeError(f"{cls.__name__}.{name} has no plain default")
    return f.default


def require_at_least(args, minimum: int, *names: str) -> None:
    """Refuse a numeric flag below `minimum`, naming it (flags left unset, None, are skipped)."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise DominoError(f"{flag(name)} must be at least {minimum}, got {value}")


def add_target_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help=f"HF hub id, local model directory, a .gguf file (llama, mistral, qwen2, qwen3 in Q4_0, Q4_1, Q8_0, F16 "
        f"or BF16), or the bundled alias (default: {DEFAULT_TARGET})",
    )
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, ...")
    p.add_argument(
        "--dtype",
        default="auto",
        help="auto (bf16 on GPU; on the CPU, fp32 activations on the fewest-bytes weight format that holds the "
        "model's weights to fp32 rounding: int8 for the bundled model, bfloat16 for a bf16 checkpoint, else fp32), "
        "float32, bfloat16, float16, int8, int8-dot, bfloat16-dot, q4-dot. On the CPU with the native "
        "backend, bfloat16 and int8 are weight formats (half / about a quarter of fp32's bytes; int8 "
        "scaled per output channel and group of 32 inputs) with fp32 activations; int8-dot and bfloat16-dot "
        "run those weights on the CPU's dot-product instructions, activations rounded too (int8 per row in "
        "blocks of 32, as llama.cpp's Q8_0; bf16): models of their own; q4-dot keeps a GGUF target's own 4-bit "
        "blocks (Q4_0, Q4_1) in 4-bit panels on int8-dot's activations. Speculative output stays "
        "identical to plain decoding of the format",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=list(BACKENDS),
        help="target forward: native (Llama family: fused, pre-packed kernels), hf (transformers), "
        "auto = native where supported (default %(default)s)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: OMP_NUM_THREADS, else every physical core; capped, with a note, "
        "at the CPUs this process may use; on a shared machine, fewer threads than busy cores gives steadier "
        "timings)",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--temperature",
        type=float,
        default=default(SamplingConfig, "temperature"),
        help="0 = greedy (default %(default)s)",
    )
    p.add_argument(
        "--top-p", type=float, default=default(SamplingConfig, "top_p"), help="nucleus sampling mass (default: off)"
    )
    p.add_argument(
        "--top-k",
        type=int,
        default=default(SamplingConfig, "top_k"),
        help="keep the k most likely tokens (default: off)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")


def sampling_from_args(args) -> SamplingConfig:
    """--temperature/--top-k/--top-p, checked with the flags' names in the message."""
    check_sampling(args.temperature, args.top_k, args.top_p, prefix="--")
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    if sampling.greedy and args.temperature > 0:
        log_once(
            f"--temperature {args.temperature} --top-p {args.top_p}: below {MIN_TEMPERATURE} (temperature) or "
            f"{MIN_TOP_P} (top-p) sampling is greedy; decoding greedily"
        )
    return sampling


def add_arch_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--head",
        default=None,
        choices=list(HEADS),
        help="sequential head (default domino; with --serve-with vllm, markov)",
    )
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help=f"draft backbone layers (default {default(DrafterConfig, 'num_layers')}); with --init, more than the "
        "drafter has grows it: each new layer starts as a copy of the one below that adds nothing yet",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=default(DrafterConfig, "block_size"),
        help="draft slots per block (default %(default)s)",
    )
    p.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: the target's)")
    p.add_argument(
        "--gru-hidden-size",
        type=int,
        default=default(DrafterConfig, "gru_hidden_size"),
        help="Domino GRU width (default %(default)s)",
    )
    p.add_argument(
        "--rank",
        type=int,
        default=default(DrafterConfig, "rank"),
        help="low-rank correction rank (default %(default)s)",
    )
    p.add_argument(
        "--path-candidates",
        type=int,
        default=default(DrafterConfig, "path_candidates"),
        help="--head path: candidates per slot the pair scores choose among (default %(default)s)",
    )
    p.add_argument("--confidence-head", action="store_true", help="add a DSpark confidence head")
    p.add_argument(
        "--fuse-context",
        action="store_true",
        help="add a projection of the target's last context row to every block row's input (EAGLE-style; "
        "no serving engine reads it, so export refuses it); with --init, adds one that starts at zero",
    )
    p.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="an unused vocabulary id as MASK (default: a learned mask vector)",
    )
    p.add_argument(
        "--layer-ids", default=None, help="target feature layers, e.g. 1,8,14,20,27 (default: evenly spaced)"
    )
    p.add_argument(
        "--serve-with",
        default=None,
        choices=list(ENGINES),
        help="choose only what `dominospec export` converts exactly for this engine (needs --mask-token-id; "
        "see docs/export.md)",
    )


def check_arch_args(args) -> None:
    """The drafter-shape flags, checked before any model is loaded."""
    require_at_least(args, 1, "layers", "block_size", "intermediate_size", "gru_hidden_size", "rank", "path_candidates")
    require_at_least(args, 0, "mask_token_id")
    if args.serve_with:
        serve_with_arch(args)


def serve_with_arch(args) -> dict:
    """--serve-with: the head, mask and confidence inputs that export exactly (refuses flags that cannot)."""
    return arch_for_engine(
        args.serve_with,
        args.head,
        args.mask_token_id,
        args.confidence_head,
        getattr(args, "draft_vocab", 0),
        args.fuse_context,
    )


def arch_from_args(args, target) -> dict:
    """DrafterConfig fields from --head/--layers/...; --layer-ids also sets the target's feature layers."""
    if args.layer_ids:
        target.layer_ids = parse_layer_ids(args.layer_ids, target.num_layers)
    return dict(
        head=args.head,
        num_layers=args.layers,
        block_size=args.block_size,
        intermediate_size=args.intermediate_size,
        gru_hidden_size=args.gru_hidden_size,
        rank=args.rank,
        path_candidates=args.path_candidates,
        confidence_head=args.confidence_head,
        mask_token_id=args.mask_token_id,
        fuse_context=args.fuse_context,
    ) | (serve_with_arch(args) if args.serve_with else {})


def block_size_arg(text: str) -> int | str:
    """--block-size: a positive integer, or auto (chosen from the device profile and the drafter's acceptance)."""
    if text == "auto":
        return text
    try:
        return int(text)  # its range is checked with the other numbers (require_at_least)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}") from None


def warn_if_reduced_precision(target) -> None:
    if target.dtype not in (torch.float32, torch.float64):
        log_once(
            f"{str(target.dtype).replace('torch.', '')}: greedy speculative output equals plain greedy output "
            "only up to numerics (batch-shape rounding can flip near-tied tokens); use --dtype float32 for "
            "token-identical output"
        )


def target_from_args(args):
    if args.threads is not None and args.threads < 1:
        raise DominoError(f"--threads must be >= 1, got {args.threads}")
    threads, note = threads_to_use(args.threads)
    if note:
        log(note)
    torch.set_num_threads(threads)
    return Target.load(args.target, device=args.device, dtype=args.dtype, progress=log, backend=args.backend)


def resolve_drafter(target, drafter_arg: str | None, no_draft: bool = False):
    """The drafter to use: --drafter DIR, else the drafter shipped for the bundled target, else None."""
    if no_draft:
        return None
    if drafter_arg:
        return Drafter.from_pretrained(drafter_arg, target=target)
    shipped = shipped_drafter_dir(DEFAULT_TARGET)
    if target.name == DEFAULT_TARGET and (shipped / "config.json").exists():
        return Drafter.from_pretrained(shipped, target=target)
    return None


def add_spec_args(p: argparse.ArgumentParser, surface: str) -> None:
    """The decoding configuration's flags (tune/spec.py): --drafter, --lookup / --no-lookup, --no-draft,
    --verify, --confidence-threshold, --lookup-min-match; their defaults are `surface`'s row of
    SURFACE_DEFAULTS."""
    row = SURFACE_DEFAULTS[surface]
    p.add_argument(
        "--drafter",
        default=None,
        help=f"{LOOKUP} (prompt lookup alone, no trained drafter), {SHIPPED} (the drafter shipped for the bundled "
        f"target), a drafter directory, or {NONE} (plain decoding, as --no-draft); a drafter runs with prompt "
        f"lookup (the hybrid) unless --no-lookup (default {row.proposer})",
    )
    p.add_argument(
        "--lookup",
        action="store_true",
        help="hybrid (the default with a drafter, so this flag only states it): copy the continuation from the "
        "prompt and the answer so far when the last --lookup-min-match tokens occurred there, use the drafter "
        "otherwise",
    )
    p.add_argument("--no-lookup", action="store_true", help="the drafter alone, without prompt lookup")
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding (as --drafter none)")
    p.add_argument(
        "--verify",
        default=None,
        choices=tuple(VERIFY_MODES),
        help="how many drafts to verify per cycle. " + verify_mode_help() + f" (default {row.verify})",
    )
    add_policy_args(p)


def add_policy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--confidence-threshold",
        type=float,
        default=DEFAULT_THRESHOLD,
        help="for --verify static, in (0, 1) (default %(default)s)",
    )
    p.add_argument(
        "--lookup-min-match",
        type=int,
        default=HYBRID_MIN_MATCH,
        help="a hybrid (drafter + prompt lookup) copies from the context when the last N tokens "
        "occurred there before (default %(default)s)",
    )


def spec_from_args(args, surface: str, block_size: int | None = None) -> SpecConfig:
    """The decoding configuration the flags ask for, checked (a drafter directory read) before any model loads."""
    if args.lookup and args.no_lookup:
        raise DominoError("--lookup and --no-lookup contradict each other: give one")
    return parse_spec(
        surface,
        drafter=NONE if args.no_draft else args.drafter,
        lookup=True if args.lookup else False if args.no_lookup else None,
        verify=args.verify,
        block_size=block_size,
        threshold=args.confidence_threshold,
        lookup_min_match=args.lookup_min_match,
        seed=getattr(args, "seed", 0),
        target_name=args.target,
    )


def add_verify_list_arg(p: argparse.ArgumentParser) -> None:
    """bench's --verify: a comma list of verify modes, each drafter (and hybrid) run with each."""
    p.add_argument(
        "--verify",
        default=",".join(VERIFY_MODES),
        help="comma list of verify-length policies to run each drafter (and hybrid) with. "
        + verify_mode_help()
        + "; a mode a drafter cannot run is skipped with a note (default %(default)s)",
    )
    add_policy_args(p)


def check_verify_args(args) -> None:
    check_threshold(args.confidence_threshold)
    require_at_least(args, 1, "lookup_min_match")
