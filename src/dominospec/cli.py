"""The `dominospec` command line: generate, init (and the stages registered in SUBCOMMANDS)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import DominoError


def log(msg: str) -> None:
    print(f"[dominospec] {msg}", file=sys.stderr, flush=True)


def add_target_args(p: argparse.ArgumentParser) -> None:
    from .target import DEFAULT_TARGET

    p.add_argument("--target", default=DEFAULT_TARGET,
                   help=f"HF hub id, local model directory, or the bundled alias (default: {DEFAULT_TARGET})")
    p.add_argument("--device", default="auto", help="auto (cuda > mps > cpu), cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")


def add_sampling_args(p: argparse.ArgumentParser, temperature: float = 0.0) -> None:
    p.add_argument("--temperature", type=float, default=temperature, help="0 = greedy (default %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (default: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")


def load_target(args):
    from .target import Target

    return Target.load(args.target, device=args.device, dtype=args.dtype, progress=log)


def shipped_drafter_dir(target_name: str) -> Path:
    """Where the package keeps the default drafter of a target (it may not ship one)."""
    return Path(__file__).parent / "drafters" / target_name


def resolve_drafter(target, drafter_arg: str | None, no_draft: bool = False):
    """The drafter to use: --drafter DIR, else the drafter shipped for the bundled target, else None."""
    from .drafter import Drafter
    from .target import DEFAULT_TARGET

    if no_draft:
        return None
    if drafter_arg:
        return Drafter.from_pretrained(drafter_arg, target=target)
    shipped = shipped_drafter_dir(DEFAULT_TARGET)
    if target.name == DEFAULT_TARGET and (shipped / "config.json").exists():
        return Drafter.from_pretrained(shipped, target=target)
    return None


# ----- generate -----

def cmd_generate(args) -> int:
    from .decoding import SamplingConfig, generate_autoregressive, generate_speculative

    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    target = load_target(args)
    drafter = resolve_drafter(target, args.drafter, args.no_draft)
    if drafter is None and not args.no_draft:
        log("no drafter given and none is shipped for this target: plain decoding "
            "(train one with `dominospec train`, or pass --drafter DIR)")
    prompt_ids = target.encode_chat(args.prompt) if not args.raw else target.tokenizer(args.prompt)["input_ids"]
    stream = None
    if not args.json:
        def stream(tokens, _state={"ids": [], "printed": 0}):
            _state["ids"].extend(tokens)
            text = target.decode(_state["ids"])
            sys.stdout.write(text[_state["printed"]:])
            sys.stdout.flush()
            _state["printed"] = len(text)
    if drafter is None:
        res = generate_autoregressive(target, prompt_ids, args.max_new_tokens, sampling, args.seed, on_tokens=stream)
    else:
        res = generate_speculative(target, drafter, prompt_ids, args.max_new_tokens, sampling, args.seed,
                                   block_size=args.block_size, on_tokens=stream)
    text = target.decode(res.tokens)
    if args.json:
        print(json.dumps(res.to_dict(text)))
    else:
        tau = f", tau {res.tau:.2f} over {res.cycles} cycles (block {res.block_size})" if res.cycles else ""
        mode = "speculative" if drafter is not None else "plain"
        print(f"\n\n[{mode}] {res.new_tokens} tokens in {res.total_s:.2f}s = {res.tokens_per_s:.1f} tok/s{tau}",
              file=sys.stderr)
        if res.cycles:
            print(f"[{mode}] draft {res.draft_s:.2f}s, verify {res.verify_s:.2f}s, prefill {res.prefill_s:.2f}s; "
                  f"accepted per position {res.accepted_per_position}", file=sys.stderr)
    return 0


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text with speculative decoding",
                       description="Generate a reply to PROMPT (chat template applied) with Domino speculative "
                                   "decoding; prints the text, tokens/s and tau.")
    p.add_argument("prompt", help="the user message")
    add_target_args(p)
    p.add_argument("--drafter", help="drafter directory (default: the one shipped for the bundled target)")
    p.add_argument("--no-draft", action="store_true", help="plain autoregressive decoding")
    p.add_argument("--block-size", type=int, default=None, help="draft tokens per cycle (at most the drafter's)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="default %(default)s")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)


# ----- init -----

def cmd_init(args) -> int:
    from .drafter import Drafter, DrafterConfig

    target = load_target(args)
    if args.layer_ids:
        from .target import check_layer_ids
        target.layer_ids = check_layer_ids([int(x) for x in args.layer_ids.split(",")], target.num_layers)
    cfg = DrafterConfig.for_target(target, head=args.head, num_layers=args.layers, block_size=args.block_size,
                                   intermediate_size=args.intermediate_size, gru_hidden_size=args.gru_hidden_size,
                                   rank=args.rank, confidence_head=args.confidence_head,
                                   mask_token_id=args.mask_token_id)
    drafter = Drafter(cfg)
    with __import__("torch").no_grad():
        if drafter.mask_embedding is not None:  # start the learned mask at the mean embedding
            drafter.mask_embedding.copy_(target.embed_weight.float().mean(0).to(drafter.mask_embedding.dtype))
    drafter.save_pretrained(args.out)
    n = drafter.num_trainable_parameters()
    log(f"wrote an untrained {cfg.head} drafter ({n / 1e6:.2f}M parameters, {cfg.num_layers} layers, "
        f"block {cfg.block_size}, feature layers {cfg.target_layer_ids}) to {args.out}")
    return 0


def add_arch_args(p: argparse.ArgumentParser) -> None:
    from .drafter import HEADS

    p.add_argument("--head", default="domino", choices=HEADS, help="sequential head (default %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="draft backbone layers (default %(default)s)")
    p.add_argument("--block-size", type=int, default=8, help="draft slots per block (default %(default)s)")
    p.add_argument("--intermediate-size", type=int, default=None, help="MLP width (default: the target's)")
    p.add_argument("--gru-hidden-size", type=int, default=256, help="Domino GRU width (default %(default)s)")
    p.add_argument("--rank", type=int, default=64, help="low-rank correction rank (default %(default)s)")
    p.add_argument("--confidence-head", action="store_true", help="add a DSpark confidence head")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="an unused vocabulary id as MASK (default: a learned mask vector)")
    p.add_argument("--layer-ids", default=None, help="target feature layers, e.g. 1,8,14,20,27 (default: evenly spaced)")


def add_init(sub) -> None:
    p = sub.add_parser("init", help="write an untrained drafter for a target",
                       description="Write an untrained drafter (config.json + model.safetensors) that fits TARGET; "
                                   "this is what `dominospec train` starts from.")
    add_target_args(p)
    p.add_argument("--out", required=True, help="output directory")
    add_arch_args(p)
    p.set_defaults(func=cmd_init)


def _stage_parsers():
    from .bench import add_bench_parser
    from .data import add_prepare_parser
    from .train import add_train_parser

    return [add_prepare_parser, add_train_parser, add_bench_parser]


SUBCOMMANDS = [add_generate, add_init]


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="dominospec", description="Domino speculative decoding for Hugging Face "
                                     "causal LMs: faster generation, identical output.")
    parser.add_argument("--version", action="version", version=f"dominospec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS + _stage_parsers():
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except DominoError as exc:
        print(f"dominospec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dominospec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
