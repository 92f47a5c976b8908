"""`dominospec generate`: one reply, streamed, with speculative decoding."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from ..errors import DominoError
from ..log import log
from ..targets.context import encode_if_fits
from ..tune.profile import auto_block_size
from ..tune.spec import SpecConfig, bind, run_spec
from .common import (
    add_sampling_args,
    add_spec_args,
    add_target_args,
    block_size_arg,
    check_verify_args,
    require_at_least,
    sampling_from_args,
    spec_from_args,
    target_from_args,
    warn_if_reduced_precision,
)

# ANSI colours of the token sources in a terminal; the target's own tokens stay plain
COLOURS = {"drafter": "\x1b[32m", "lookup": "\x1b[36m", "target": ""}
RESET = "\x1b[0m"
LEGEND = (
    f"{COLOURS['drafter']}accepted drafter draft{RESET}, {COLOURS['lookup']}prompt-lookup copy{RESET}, "
    "the target's own token"
)


def cmd_generate(args) -> int:
    # arguments first: a mistake is reported before any model loads
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as exc:  # bytes the shell passed that are not UTF-8 (kept as surrogates)
        raise DominoError(f"PROMPT is not UTF-8 text (an undecodable byte at character {exc.start})") from None
    if not args.prompt.strip():
        raise DominoError('PROMPT is empty: give the message to answer, e.g. dominospec generate "Hello"')
    require_at_least(args, 1, "max_new_tokens", *(["block_size"] if args.block_size != "auto" else []))
    check_verify_args(args)
    sampling = sampling_from_args(args)
    auto = args.block_size == "auto"
    spec = spec_from_args(args, "generate", None if auto else args.block_size)
    target = target_from_args(args)
    spec = bind(spec, target)
    warn_if_reduced_precision(target)
    trained = spec.drafter.config.extra.get("enable_thinking") if spec.drafter is not None else None
    if trained is not None and trained != args.enable_thinking:
        log(
            f"note: this drafter was trained on data made with thinking {'on' if trained else 'off'}, and this run "
            f"has it {'on' if args.enable_thinking else 'off'}: the output is the same, acceptance may be lower"
        )
    if auto and spec.drafter is not None:
        block_size, note = auto_block_size(target, spec.drafter)
        log(note)
        spec = replace(spec, block_size=block_size) if block_size else SpecConfig(seed=spec.seed)
    elif auto and spec.speculative:
        log("--block-size auto: prompt lookup has no acceptance table; using its default block size")

    def encode_chat(text):
        return target.encode_chat(text, enable_thinking=args.enable_thinking)

    prompt_ids, too_long = encode_if_fits(
        args.prompt, target.encode_raw if args.raw else encode_chat, target.max_positions, target.max_token_chars
    )
    if too_long:
        raise DominoError(f"PROMPT {too_long}")
    stream = None
    colour = not args.json and not args.no_color and sys.stdout.isatty() and "NO_COLOR" not in os.environ
    if not args.json:
        stream = MarkedPrinter(target.decode, sys.stdout, colour)
    res = run_spec(spec, target, prompt_ids, args.max_new_tokens, sampling, on_tokens=stream, marks=stream is not None)
    if stream is not None:
        stream.finish()
    text = target.decode(res.tokens)
    for note in res.notes:
        log(note)
    mode, configuration = spec.proposer if spec.speculative else "plain", spec.describe()
    drawn = {"temperature": sampling.temperature, "seed": spec.seed}
    if args.json:
        print(json.dumps({**res.to_dict(text), "configuration": configuration, **drawn}))
        return 0
    tau = f", tau {res.tau:.2f} over {res.cycles} cycles (block {res.block_size})" if res.cycles else ""
    skipped = f", {res.draft_skipped} cycles without drafting" if res.draft_skipped else ""
    print(
        f"\n\n[{configuration}] {res.new_tokens} tokens in {res.total_s:.2f}s = {res.tokens_per_s:.1f} tok/s"
        + tau
        + skipped
        + f"; temperature {sampling.temperature:g}, seed {spec.seed}",
        file=sys.stderr,
    )
    undrafted = undrafted_note(spec, res)
    if undrafted:
        print(f"[{mode}] {undrafted}", file=sys.stderr)
    if colour:
        print(f"[{mode}] colours: {LEGEND}", file=sys.stderr)
    if res.cycles:
        print(
            f"[{mode}] draft {res.draft_s:.2f}s, verify {res.verify_s:.2f}s, prefill {res.prefill_s:.2f}s; "
            f"accepted per position {res.accepted_per_position}; verify {spec.verify}: "
            f"{res.verified_per_cycle:.2f} drafts verified, {res.wasted_per_cycle:.2f} rejected per cycle"
            + (f"; {res.lookup_cycles} lookup cycles" if spec.uses_lookup else ""),
            file=sys.stderr,
        )
    return 0


def undrafted_note(spec, res) -> str | None:
    """A run that copied or accepted no draft, in words (its speed was plain decoding's), else None."""
    if not spec.speculative or not res.cycles or sum(res.accepted_per_position):
        return None
    if spec.proposer == "lookup":
        if res.lookup_cycles:
            return "prompt lookup found copies, but the target accepted none of them; the drafter was not used"
        return (
            "prompt lookup found nothing to copy; the drafter was not used (the default has none: "
            "--drafter shipped runs it)"
        )
    return "the target accepted no draft in this answer (drafts cost a verify each; none paid)"


class MarkedPrinter:
    """Prints tokens as they come, each in its source's colour when `colour` (a terminal).

    Called as on_tokens(tokens) (plain decoding: every token is the target's) or
    on_tokens(tokens, sources). A token's text is what decoding it adds to a short window of the
    tokens before it (so a long answer costs O(tokens)); a token that ends inside a UTF-8 character
    waits for the one that completes it, which then carries the character."""

    WINDOW = 8  # tokens decoded before the new one, as context for the decoder

    def __init__(self, decode, out, colour: bool):
        self.decode, self.out, self.colour = decode, out, colour
        self.ids: list[int] = []
        self.written = 0  # tokens whose text is written

    def __call__(self, tokens: list[int], sources: list[str] | None = None) -> None:
        for tok, source in zip(tokens, sources or ["target"] * len(tokens)):
            self.ids.append(tok)
            self._write_new(source, final=False)
        self.out.flush()

    def finish(self) -> None:
        self._write_new("target", final=True)
        self.out.flush()

    def _write_new(self, source: str, final: bool) -> None:
        start = max(0, self.written - self.WINDOW)
        before = self.decode(self.ids[start : self.written])
        window = self.decode(self.ids[start:])
        if window.endswith("\ufffd") and not final:
            return
        piece = window[len(before) :]
        if piece and self.colour and COLOURS.get(source):
            piece = f"{COLOURS[source]}{piece}{RESET}"
        self.out.write(piece)
        self.written = len(self.ids)


def add_parser(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text with speculative decoding",
        description="Generate a reply to PROMPT (chat template applied) with Domino speculative "
        "decoding; prints the text, tokens/s, tau and the configuration that ran. Default: prompt lookup "
        "alone with verify cost (drafts verified only where they pay on this device), the configuration that "
        "measured fastest at batch 1 (docs/speed.md); it drafts only where the prompt or the answer repeats. "
        "--drafter shipped runs the trained drafter shipped for the bundled target, --drafter DIR your own "
        "(with lookup: the hybrid).",
    )
    p.add_argument("prompt", help="the user message")
    add_target_args(p)
    add_spec_args(p, "generate")
    p.add_argument(
        "--block-size",
        type=block_size_arg,
        default=None,
        help="draft tokens per cycle (at most the drafter's), or auto: the best for this device from "
        "`dominospec profile` and the drafter's acceptance.json (default: the drafter's)",
    )
    p.add_argument("--max-new-tokens", type=int, default=128, help="default %(default)s")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument(
        "--enable-thinking",
        action="store_true",
        help="switch the chat template's thinking mode on (Qwen3: the model writes a <think> block first); "
        "off by default, and templates without the switch ignore it",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument(
        "--no-color",
        action="store_true",
        help="plain text even on a terminal (by default a terminal shows accepted drafter drafts in green and "
        "prompt-lookup copies in cyan; $NO_COLOR does the same)",
    )
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)
