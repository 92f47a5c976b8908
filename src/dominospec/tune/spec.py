"""The decoding configuration of a run, in one record: who proposes drafts, and how many the target checks.

  proposer  none | lookup | drafter | hybrid      (PROPOSERS)
  verify    fixed | static | cost                 (decode/schedule.py VERIFY_MODES; a plain run has none)

with the drafts per cycle, the static policy's threshold, the hybrid's lookup minimum match and the
sampling seed. As vLLM builds every proposer from one speculative_config and llama.cpp keeps one
`common_params_speculative`, every surface (generate, serve, bench, bench --concurrency, the
transformers hook, Engine) turns its user's words into a SpecConfig with `parse_spec`, the one place a
configuration that cannot run is refused, and runs what `build(config, target)` returns: the proposer
and the verify policy. `describe()` names the run. What each surface runs when its user names nothing is
one row of SURFACE_DEFAULTS; a row that differs from generate's says why.

The user's words for the proposer: a drafter word (None: the surface's default; "none"; "lookup";
"shipped": the drafter shipped for the bundled target; a drafter directory; a Drafter object) and a
lookup switch (None: the surface's default; True: the hybrid; False: the drafter alone). A drafter
directory is read and checked here, before any target loads (a damaged one is named in seconds, not
after the target's load); `bind(config, target)` then attaches it to the target.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from ..decode.lookup import HYBRID_MIN_MATCH
from ..decode.proposers import make_proposer
from ..decode.result import GenerationResult
from ..decode.schedule import DEFAULT_THRESHOLD, VERIFY_MODES, VerifyPolicy, check_threshold
from ..decode.single import decode
from ..devices import threads_to_use
from ..drafter import Drafter, shipped_drafter_dir
from ..errors import DominoError
from ..log import log_once
from ..sampling import SamplingConfig
from ..targets import DEFAULT_TARGET
from .policy import make_policy

PROPOSERS = {
    "none": "plain decoding, one token per target step",
    "lookup": "prompt lookup alone: copy the continuation of the latest earlier match of the last tokens",
    "drafter": "the trained drafter alone",
    "hybrid": "prompt lookup where the last --lookup-min-match tokens occurred before, the drafter otherwise",
}
NONE, LOOKUP, SHIPPED = "none", "lookup", "shipped"  # drafter words that name no directory
DRAFTS = ("drafter", "hybrid")  # the proposers that need a trained drafter


@dataclass(frozen=True)
class Surface:
    """What a surface runs when its user names nothing."""

    proposer: str  # no drafter named
    verify: str  # no verify mode named
    with_drafter: str  # a drafter named, the lookup switch not: "hybrid" or "drafter"
    why: str  # the reason, where the row differs from generate's


# The one table of defaults. generate's row: prompt lookup with cost-scheduled verification measured best
# of every batch-1 configuration on the held-out prompts/eval-* sets with the shipped SmolLM2 drafter
# (1 thread, AMD EPYC, 2026-12-04; docs/speed.md). A drafter that beats it changes this row.
SURFACE_DEFAULTS = {
    "generate": Surface("lookup", "cost", "hybrid", "the measured best at batch 1 (docs/speed.md)"),
    "serve": Surface("lookup", "cost", "hybrid", "as generate"),
    "bench": Surface("lookup", "cost", "hybrid", "as generate; its --verify default runs every mode side by side"),
    "bench-concurrency": Surface("lookup", "cost", "hybrid", "as generate; --policies chooses proposers to compare"),
    "hook": Surface(
        "none",
        "fixed",
        "drafter",
        "model.generate(custom_generate=...) without drafter= is plain, as transformers' own generate; fixed: a "
        "caller's first call measures nothing on the device; a drafter alone, as transformers' assistant_model",
    ),
    "engine": Surface(
        "none",
        "fixed",
        "drafter",
        "a library object does what its caller names and nothing more: plain until given a proposer, no device "
        "measurement unless cost is asked for",
    ),
}


@dataclass(frozen=True)
class SpecConfig:
    """One decoding configuration (see the module doc). drafter: the Drafter of drafter / hybrid runs."""

    proposer: str = NONE
    verify: str | None = None  # None for proposer none
    drafter: object = None
    block_size: int | None = None  # drafts per cycle (None: the drafter's, lookup alone: LOOKUP_BLOCK_SIZE)
    threshold: float = DEFAULT_THRESHOLD  # verify static
    lookup_min_match: int = HYBRID_MIN_MATCH  # hybrid
    seed: int | None = 0  # the sampling seed of a batch-1 run (a server's requests bring their own)
    use_head: bool = True  # False: the drafter's base logits only (bench's ablation)

    @property
    def speculative(self) -> bool:
        return self.proposer != NONE

    @property
    def uses_lookup(self) -> bool:
        return self.proposer in (LOOKUP, "hybrid")

    @property
    def layers(self):
        """The target feature layers the drafter reads (None without one)."""
        return self.drafter.config.target_layer_ids if self.proposer in DRAFTS else None

    def describe(self) -> str:
        """The run's name: 'plain', 'lookup, verify cost', 'hybrid, verify fixed', ..."""
        return "plain" if not self.speculative else f"{self.proposer}, verify {self.verify}"


def parse_spec(
    surface: str,
    *,
    drafter=None,
    lookup: bool | None = None,
    verify: str | None = None,
    block_size: int | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    lookup_min_match: int = HYBRID_MIN_MATCH,
    seed: int | None = 0,
    target_name: str | None = None,
    flags: bool = True,
) -> SpecConfig:
    """The configuration a surface's user asked for, or a DominoError saying why it cannot run.

    drafter / lookup: the user's words (module doc). target_name: the target the run will load, when known
    (the shipped drafter is found for it before it loads). flags: name settings as command-line flags
    (--verify) rather than keywords (verify=). A drafter directory is loaded and checked now, unattached."""
    if surface not in SURFACE_DEFAULTS:
        raise ValueError(f"unknown surface {surface!r}: one of {', '.join(SURFACE_DEFAULTS)}")
    row = SURFACE_DEFAULTS[surface]
    name, said = _namer(flags), _sayer(flags)
    if verify is not None and verify not in VERIFY_MODES:
        raise DominoError(f"{said('verify', verify)}: choose from {', '.join(VERIFY_MODES)}")
    check_threshold(threshold, name("confidence_threshold"))
    if isinstance(lookup_min_match, bool) or not isinstance(lookup_min_match, int) or lookup_min_match < 1:
        raise DominoError(f"{said('lookup_min_match', lookup_min_match)}: must be at least 1")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise DominoError(f"{said('block_size', block_size)}: a positive integer, or None for the drafter's")
    word = row.proposer if drafter is None else drafter
    if isinstance(word, (str, os.PathLike)) and str(word) in (NONE, LOOKUP):
        proposer, loaded = str(word), None
        if proposer == LOOKUP and lookup is False:
            raise DominoError(
                f"{name('no_lookup', 'lookup=False')} leaves nothing to draft with: name a trained drafter "
                f"({name('drafter')} shipped or a directory)"
            )
        if proposer == NONE and lookup:
            proposer = LOOKUP  # plain decoding asked to look up: prompt lookup alone
    else:
        loaded = load_drafter(word, target_name, name("drafter"))
        proposer = "hybrid" if (lookup if lookup is not None else row.with_drafter == "hybrid") else "drafter"
    if proposer == NONE and verify is not None:
        raise DominoError(
            f"{said('verify', verify)} schedules drafts, and this run proposes none (plain decoding): name a "
            f"drafter or prompt lookup ({name('drafter')} lookup|shipped|DIR), or leave {name('verify')} out"
        )
    mode = None if proposer == NONE else (verify or row.verify)
    return SpecConfig(proposer, mode, loaded, block_size, threshold, lookup_min_match, seed)


def _namer(flags: bool):
    """A setting's name as the user wrote it: a flag (--block-size) or a keyword (block_size)."""

    def name(key: str, keyword: str | None = None) -> str:
        return "--" + key.replace("_", "-") if flags else keyword or key

    return name


def _sayer(flags: bool):
    """A setting with its value as the user wrote it: `--verify fast` or `verify='fast'`."""

    def said(key: str, value) -> str:
        return f"--{key.replace('_', '-')} {value}" if flags else f"{key}={value!r}"

    return said


def load_drafter(word, target_name: str | None, flag: str = "--drafter"):
    """The Drafter a drafter word names, read and checked without a target: a Drafter object as given, a
    directory loaded now (DominoError naming what is wrong with it), "shipped" loaded when the target's name
    says which; "shipped" for a target not yet known stays the word (bind resolves it)."""
    if isinstance(word, Drafter):
        return word
    if str(word) == SHIPPED:
        return SHIPPED if target_name is None else Drafter.from_pretrained(shipped_dir(target_name, flag))
    return Drafter.from_pretrained(word)


def shipped_dir(target_name: str, flag: str = "--drafter"):
    """The directory of the drafter shipped for the bundled target (the only target one ships for)."""
    directory = shipped_drafter_dir(DEFAULT_TARGET)
    if target_name != DEFAULT_TARGET or not (directory / "config.json").exists():
        raise DominoError(
            f"{flag} shipped: no drafter is shipped for {target_name!r} (train one with `dominospec train` and "
            f"pass {flag} DIR, or use {flag} lookup or {flag} none)"
        )
    return directory


def bind(config: SpecConfig, target) -> SpecConfig:
    """The configuration with its drafter attached to the loaded target (the fit to the target checked)."""
    if config.drafter is None:
        return config
    drafter = config.drafter
    if drafter == SHIPPED:
        drafter = Drafter.from_pretrained(shipped_dir(target.name))
    return replace(config, drafter=drafter.attach(target))


def build(
    config: SpecConfig,
    target,
    *,
    rows: int | None = None,
    max_len: int = 0,
    costs=None,
    report=log_once,
) -> tuple[object, VerifyPolicy]:
    """(proposer, verify policy) of a bound configuration: at batch 1 (rows None) or for an engine of `rows`
    slots of `max_len` positions. costs: a cost table to use instead of the device profile (tests, bench)."""
    drafter = config.drafter if config.proposer in DRAFTS else None
    proposer = make_proposer(
        drafter,
        config.uses_lookup,
        config.block_size,
        rows,
        max_len,
        use_head=config.use_head,
        vocab_size=target.vocab_size,
        device=target.device,
        min_match=config.lookup_min_match,
    )
    return proposer, policy_of(config, target, rows=rows, costs=costs, report=report, block_size=proposer.block_size)


def policy_of(
    config: SpecConfig,
    target,
    *,
    rows: int | None = None,
    costs=None,
    report=log_once,
    block_size: int | None = None,
) -> VerifyPolicy:
    """The verify policy of a bound configuration (tune/policy.py make_policy), at batch 1 or for `rows` slots;
    block_size: the drafts its proposer proposes (default: the configuration's, else the drafter's or lookup's)."""
    if not config.speculative:
        return VerifyPolicy()
    return make_policy(
        config.verify,
        config.drafter if config.proposer in DRAFTS else None,
        target,
        threshold=config.threshold,
        costs=costs,
        block_size=block_size or config.block_size,
        lookup=config.uses_lookup,
        rows=rows,
        report=report,
    )


@torch.inference_mode()
def run_spec(
    config: SpecConfig,
    target,
    prompt_ids,
    max_new_tokens: int,
    sampling: SamplingConfig,
    *,
    eos_ids=None,
    on_tokens=None,
    marks: bool = False,
    costs=None,
    report=log_once,
) -> GenerationResult:
    """One reply at batch 1 with a bound configuration: its proposer and policy, then the batch-1 loop
    (decode/single.py decode). marks: on_tokens(tokens, sources)."""
    proposer, policy = build(config, target, costs=costs, report=report)
    return decode(
        target,
        proposer,
        policy,
        prompt_ids,
        max_new_tokens,
        sampling,
        config.seed,
        eos_ids,
        on_tokens,
        layers=config.layers,
        marks=marks,
    )


def generate(
    target,
    prompt,
    max_new_tokens: int = 128,
    *,
    drafter=None,
    lookup: bool | None = None,
    verify: str | None = None,
    block_size: int | None = None,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int | None = 0,
    threads: int | None = None,
    on_tokens=None,
) -> GenerationResult:
    """One reply as `dominospec generate` makes it: the same configuration record (SURFACE_DEFAULTS["generate"]
    for what is not named, parse_spec with keyword names) and the same CPU threads (threads_to_use: the
    command line's --threads default). prompt: a user message (the chat template applied) or token ids.
    drafter / lookup / verify / block_size: the command line's words (drafter "shipped", "lookup", "none", a
    directory or a Drafter). Use Target.load's default dtype ("auto") for the command line's weight format."""
    n, note = threads_to_use(threads)
    if note:
        log_once(note)
    torch.set_num_threads(n)
    spec = parse_spec(
        "generate",
        drafter=drafter,
        lookup=lookup,
        verify=verify,
        block_size=block_size,
        seed=seed,
        target_name=target.name,
        flags=False,
    )
    ids = target.encode_chat(prompt) if isinstance(prompt, str) else list(prompt)
    return run_spec(bind(spec, target), target, ids, max_new_tokens, sampling, on_tokens=on_tokens)
