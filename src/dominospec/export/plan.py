"""What an export can be: the engine kind, and every refusal and approximation, decided from the config alone.

`plan_export` is the one place that knows which (head, vocabulary, mask, confidence) combinations an
engine runs exactly, approximately, or not at all; `arch_for_engine` makes `init`/`train --serve-with`
choose only what exports exactly. The facts behind each rule are cited in contracts.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..drafter import DrafterConfig
from ..errors import DominoError
from .contracts import FORMATS, MARKOV_TYPES

ENGINES = ("sglang", "vllm")  # --serve-with

MASK_HOWTO = (
    "choose a token the target's chat never produces, e.g. an added or reserved one listed by "
    "tokenizer.added_tokens_decoder (not its end-of-text or end-of-turn token; for smollm2-135m, 16 <empty_output>)"
)


@dataclass
class Plan:
    fmt: str  # sglang | vllm | speculators | specforge
    kind: str  # domino | dspark (contracts.py)
    mask_token_id: int
    mask_file: bool  # write mask_embedding.pt (a learned mask vector, SGLang DFLASH only)
    reduced_vocab: bool  # keep the draft vocabulary exactly: lm_head rows + d2t (vLLM dspark)
    widen_vocab: bool  # scatter the draft vocabulary's rows into the full vocabulary (approximate)
    confidence: bool  # the confidence head is exported
    proposals: int  # drafts the engine proposes per block
    approximations: list[str] = field(default_factory=list)  # what makes the export differ from the drafter
    notes: list[str] = field(default_factory=list)  # exact, but worth knowing

    @property
    def status(self) -> str:
        return "approximate" if self.approximations else "exact"


def _engine_kind(c: DrafterConfig, fmt: str) -> str:
    if c.head == "domino":
        return "domino"
    if c.head in ("markov", "rnn"):
        return "dspark"
    # head none: a zero correction; DSpark proposes all B slots, but only Domino (SGLang DFLASH) reads a
    # learned mask vector
    if fmt in ("vllm", "speculators") or c.mask_token_id is not None:
        return "dspark"
    return "domino"


def plan_export(c: DrafterConfig, fmt: str, mask_token_id: int | None = None, allow_approx: bool = False) -> Plan:
    """How drafter config `c` exports to `fmt`; DominoError naming the reason and the option when it cannot."""
    if fmt not in FORMATS:
        raise DominoError(f"--to {fmt!r}: expected one of {', '.join(FORMATS)}")
    if not c.qk_norm:
        raise DominoError(
            "the drafter was built with qk_norm false, but every engine's draft layer applies q_norm/k_norm "
            "(SGLang models/dflash.py, vLLM qwen3_dflash.py); it cannot be exported"
        )
    if c.head == "path":
        raise DominoError(
            f"--to {fmt}: no serving engine has a path-selector head (SGLang and vLLM load Domino and DSpark heads); "
            "export a drafter trained with --head domino, markov or rnn"
        )
    if c.fuse_context:
        raise DominoError(
            f"--to {fmt}: the drafter fuses the target's last context row into its block inputs (fuse_context), "
            "and no serving engine's DFlash or DSpark model reads that projection; export a drafter trained "
            "without --fuse-context"
        )
    kind = _engine_kind(c, fmt)
    if kind == "domino" and fmt in ("vllm", "speculators"):
        raise DominoError(
            f"--to {fmt}: vLLM 0.34 and speculators 0.9.0 have no Domino head; export this drafter --to sglang, "
            "or train one for vLLM with --serve-with vllm (a Markov head)"
        )
    if kind == "dspark" and c.head == "rnn" and "rnn" not in MARKOV_TYPES[fmt]:
        raise DominoError(
            f"--to {fmt}: vLLM's Qwen3 DSpark model has the vanilla Markov head only (a joint_proj tensor is a "
            "load error); export this rnn drafter --to sglang, or train with --head markov"
        )

    approximations: list[str] = []
    notes: list[str] = []
    # ----- the mask -----
    if mask_token_id is not None and not 0 <= mask_token_id < c.vocab_size:
        raise DominoError(f"--mask-token-id {mask_token_id} is outside the vocabulary 0..{c.vocab_size - 1}")
    mask_file = False
    if c.mask_token_id is not None:
        if mask_token_id is not None and mask_token_id != c.mask_token_id:
            raise DominoError(
                f"--mask-token-id {mask_token_id}: the drafter was trained with mask token {c.mask_token_id}; "
                "drop the option (its own id is exported)"
            )
        mask = c.mask_token_id
    elif mask_token_id is None:
        raise DominoError(
            "the drafter uses a learned mask vector (mask_token_id null) and the engines need a real token id: "
            "pass --mask-token-id N: " + MASK_HOWTO + " (a drafter trained with --serve-with exports without it)"
        )
    elif kind == "dspark":
        raise DominoError(
            f"--to {fmt}: the drafter uses a learned mask vector, and no DSpark loader reads mask_embedding.pt "
            "(only SGLang DFLASH does); retrain with --mask-token-id N (or --serve-with), or export a Domino head "
            "--to sglang"
        )
    else:
        mask, mask_file = mask_token_id, True
        approximations.append(
            f"learned mask vector: SGLang copies mask_embedding.pt into row {mask} of the TARGET's embedding "
            f"table, so the target's own output changes wherever token {mask} appears in a context"
        )
    # ----- the vocabulary -----
    reduced = widen = False
    if c.draft_vocab_size:
        if fmt in ("vllm", "speculators"):
            reduced = True
            notes.append(
                f"draft vocabulary of {c.draft_vocab_size} kept exactly (lm_head rows and d2t, ids sorted ascending)"
            )
        elif not allow_approx:
            via_vllm = "export --to vllm (exact via d2t), " if kind == "dspark" and c.head != "rnn" else ""
            raise DominoError(
                f"--to {fmt}: the drafter scores a draft vocabulary of {c.draft_vocab_size} tokens and {fmt} has "
                f"none (its head matrices span all {c.vocab_size}); pass --allow-approx to widen it (drafts may "
                f"then leave the draft vocabulary), {via_vllm}or retrain with --serve-with sglang"
            )
        else:
            widen = True
            approximations.append(
                f"draft vocabulary {c.draft_vocab_size} widened to the full {c.vocab_size}: base logits span every "
                "token and the head's rows outside the draft vocabulary are zero, so drafts can leave it"
            )
    # ----- the confidence head -----
    confidence = False
    if c.confidence_head:
        if kind == "dspark" and c.confidence_inputs == "z":
            confidence = True
            notes.append("confidence head exported as DSpark's (enable_confidence_head, without the Markov input)")
        else:
            why = (
                "SGLang DFLASH has no confidence head"
                if kind == "domino"
                else "it reads [z ; target embedding of the previous token] and DSpark's reads [z ; markov_w1(prev)] "
                "or z alone"
            )
            approximations.append(
                f"confidence head dropped ({why}); the engine verifies every draft and calibration.json does not apply"
            )
    # ----- the block -----
    if kind == "domino":
        proposals = c.block_size - 1
        notes.append(
            f"SGLang Domino proposes B-1 = {proposals} of the {c.block_size} slots (the last is unused); "
            "it drafts greedily, in bf16 on CUDA; serve with --speculative-domino-candidate-pool-size 0 for the "
            "exact rollout (the default 2048-token pool limits the correction)"
        )
    else:
        proposals = c.block_size
        notes.append(f"DSpark with sample_from_anchor proposes all {proposals} slots")
        if fmt == "sglang" and not confidence:
            # sglang 0.5.23 models/dspark.py L487-507, L687-696: outside static mode the confidence head is
            # built whatever enable_confidence_head says, and missing tensors raise
            notes.append(
                "serve in SGLang's default static verify mode (SGLANG_RAGGED_VERIFY_MODE=static): other modes "
                "build a confidence head and refuse an export without one"
            )
    if c.head == "none":
        notes.append(f"head none exported as {kind} with an all-zero correction")
    if fmt == "specforge" and kind == "dspark":
        if not allow_approx:
            raise DominoError(
                "--to specforge: SpecForge's own DSpark generation reads block slots 1..B-1 (the DFlash layout), "
                "not this drafter's; pass --allow-approx to write it anyway, or export --to sglang (exact)"
            )
        approximations.append("SpecForge's DSpark generation reads slots 1..B-1; SGLang DSPARK reads these exactly")
    return Plan(fmt, kind, mask, mask_file, reduced, widen, confidence, proposals, approximations, notes)


def why_not_exact(c: DrafterConfig, engine: str) -> str | None:
    """None when `c` exports exactly to `engine`; else the first reason it does not (a refusal or an approximation)."""
    try:
        plan = plan_export(c, engine)
    except DominoError as exc:
        return str(exc)
    return plan.approximations[0] if plan.approximations else None


def arch_for_engine(
    engine: str,
    head: str | None,
    mask_token_id: int | None,
    confidence_head: bool,
    draft_vocab: int = 0,
    fuse_context: bool = False,
) -> dict:
    """DrafterConfig fields for `init`/`train --serve-with ENGINE`: only what exports exactly.

    head None takes the engine's default (domino for SGLang, markov for vLLM); a flag that cannot export
    exactly is refused with the alternative.
    """
    if engine not in ENGINES:
        raise DominoError(f"--serve-with {engine!r}: expected one of {', '.join(ENGINES)}")
    head = head or ("domino" if engine == "sglang" else "markov")
    if head == "path":
        raise DominoError(
            f"--serve-with {engine} --head path: no serving engine has a path-selector head; use --head domino "
            "(SGLang) or markov (SGLang and vLLM)"
        )
    if engine == "vllm" and head != "markov":
        raise DominoError(
            f"--serve-with vllm --head {head}: vLLM's Qwen3 DSpark model has the vanilla Markov head only; "
            "use --head markov (the default with --serve-with vllm), or --serve-with sglang"
        )
    if mask_token_id is None:
        raise DominoError(
            f"--serve-with {engine} needs a real mask token, --mask-token-id N (no DSpark loader reads a learned "
            "mask vector, and SGLang writes Domino's into a row of the target's embedding table): " + MASK_HOWTO
        )
    if engine == "sglang" and draft_vocab:
        raise DominoError(
            f"--serve-with sglang --draft-vocab {draft_vocab}: SGLang scores the full vocabulary; drop "
            "--draft-vocab, or use --serve-with vllm (which keeps a draft vocabulary exactly)"
        )
    if fuse_context:
        raise DominoError(
            f"--serve-with {engine} --fuse-context: no serving engine reads the fused context row; drop one of them"
        )
    if confidence_head and head == "domino":
        raise DominoError(
            "--serve-with sglang --confidence-head: SGLang DFLASH (Domino) has no confidence head; drop "
            "--confidence-head, or use --head markov (DSpark's confidence head exports exactly)"
        )
    return dict(head=head, mask_token_id=mask_token_id, confidence_inputs="z")
