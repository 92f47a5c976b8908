"""How many drafts to verify: the verify-length policy the speculative loop asks once per cycle.

A policy reads a Proposal (drafts, confidence logits) and answers k in 0..len(proposal); the loop
then runs the target over [anchor, d_1..d_k] (k+1 positions). Three policies:

  fixed   verify every draft (the block size decides)
  static  stop before the first slot whose calibrated confidence is below a threshold
  cost    DSpark's Algorithm 1 at batch 1: walk k = 1, 2, ... while the expected committed tokens
          per second, (1 + sum_{j<=k} a_j) / (draft + verify(k+1)), keeps rising; stop at its
          first drop. a_j = prod_{i<=j} c_i are the calibrated survival products.

Why they are lossless: slot k's confidence c_k reads z_k and the token before slot k, so both
rules decide about slot k from the drafts before it only. Whether d_k itself is right can never
move the cut (the rejection sampler's guarantee needs exactly that). A search that looked past
the first drop would let c_{k+1}, which reads d_k, decide whether d_k is verified; tests/test_schedule.py
shows on DSpark's counterexample that this changes the output distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..drafter.checkpoint import CALIBRATION_NAME, sidecar_path
from ..errors import DominoError
from ..io import positive_numbers, read_json_object
from ..log import log_once
from .cost import load_profile, profile_drafter_label
from .propose import Proposal

VERIFY_MODES = ("fixed", "static", "cost")
DEFAULT_THRESHOLD = 0.5


def calibrated_confidence(logits: torch.Tensor, temperatures: Sequence[float] | None) -> torch.Tensor:
    """c_k = sigmoid(logit_k / T_k) for the k = 1..b slots of one proposal ([b] -> [b])."""
    logits = logits.double()
    if temperatures is not None:
        t = torch.tensor(list(temperatures)[: logits.shape[0]], dtype=logits.dtype, device=logits.device)
        logits = logits / t
    return torch.sigmoid(logits)


@dataclass
class CostTable:
    """What one cycle costs on this device: target forwards over k new tokens, and the draft cycle.

    verify_s[context] = [seconds for 1, 2, ... new tokens]; draft_s = seconds of drafting the block
    (a cost each cycle pays whatever k is; 0 when unknown).
    """

    verify_s: dict[int, list[float]]
    draft_s: float = 0.0

    @classmethod
    def from_profile(cls, profile: dict, drafter=None, block_size: int | None = None) -> CostTable:
        """From a `dominospec profile` table; its draft cost counts only if it was profiled for this drafter."""
        verify = {int(c): [float(s) for s in v["seconds"]] for c, v in profile["verify"].items()}
        draft = 0.0
        d = profile.get("draft")
        if d and drafter is not None and d.get("drafter") == profile_drafter_label(drafter):
            by_b = dict(zip(d["b"], d["seconds"]))
            draft = float(by_b.get(block_size or drafter.config.block_size, 0.0))
        return cls(verify, draft)

    def verify_seconds(self, context: int) -> list[float]:
        """The verify row of the profiled context nearest to `context`."""
        nearest = min(self.verify_s, key=lambda c: abs(c - context))
        return self.verify_s[nearest]


class VerifyPolicy:
    """fixed: verify every draft. Subclasses cut the block; all see only what precedes the verify."""

    name = "fixed"

    def verify_length(self, proposal: Proposal, context: int = 0) -> int:
        """How many of the proposal's drafts to verify; `context` = committed tokens before the anchor."""
        return len(proposal)

    def describe(self) -> dict:
        return {"verify": self.name}


@dataclass
class ConfidencePolicy(VerifyPolicy):
    """Shared part of static and cost: calibrated conditional confidences c_k of a proposal.

    Proposals from a drafter carry raw confidence logits and get the STS temperatures; a proposal
    whose logits are already estimates (the lookup proposer's running acceptance) is used as is.
    """

    temperatures: list[float] | None = None
    note: str = ""  # where the temperatures came from

    def confidences(self, proposal: Proposal) -> torch.Tensor | None:
        if proposal.confidence_logits is None:
            return None
        temps = self.temperatures if proposal.source == "drafter" else None
        return calibrated_confidence(proposal.confidence_logits, temps)


@dataclass
class StaticPolicy(ConfidencePolicy):
    threshold: float = DEFAULT_THRESHOLD
    name = "static"

    def verify_length(self, proposal: Proposal, context: int = 0) -> int:
        c = self.confidences(proposal)
        if c is None:
            return len(proposal)
        low = (c < self.threshold).nonzero()
        return int(low[0]) if low.numel() else len(proposal)

    def describe(self) -> dict:
        return {"verify": self.name, "confidence_threshold": self.threshold, "calibration": self.note}


@dataclass
class CostPolicy(ConfidencePolicy):
    costs: CostTable = field(default_factory=lambda: CostTable({0: [1.0]}))
    name = "cost"

    def rates(self, survival: Sequence[float], context: int = 0) -> list[float]:
        """Expected committed tokens per second when verifying k = 0, 1, ... drafts (while the table reaches).

        survival[j-1] = a_j = P(drafts 1..j all accepted); rate_k = (1 + sum_{j<=k} a_j) / (draft + verify(k+1)).
        """
        verify = self.costs.verify_seconds(context)
        out, tau = [], 1.0
        for k in range(0, min(len(survival), len(verify) - 1) + 1):
            if k:
                tau += survival[k - 1]
            out.append(tau / (self.costs.draft_s + verify[k]))
        return out

    def verify_length(self, proposal: Proposal, context: int = 0) -> int:
        c = self.confidences(proposal)
        if c is None:
            return len(proposal)
        rates = self.rates(torch.cumprod(c, 0).tolist(), context)
        k = 0
        while k + 1 < len(rates) and rates[k + 1] > rates[k]:  # stop at the first drop: see the module doc
            k += 1
        return k

    def describe(self) -> dict:
        return {
            "verify": self.name,
            "calibration": self.note,
            "draft_s": self.costs.draft_s,
            "profiled_contexts": sorted(self.costs.verify_s),
        }


# ----- building a policy for a drafter -----


def load_calibration(drafter) -> tuple[list[float] | None, str]:
    """(STS temperatures, a note) from calibration.json next to the drafter; (None, why) when absent."""
    path = sidecar_path(drafter, CALIBRATION_NAME)
    if path is None or not path.exists():
        return None, (
            f"no {CALIBRATION_NAME} next to the drafter: raw confidences are used (temperatures 1); "
            "run `dominospec calibrate` to calibrate them"
        )
    data = read_json_object(path, "a calibration file")
    temps = positive_numbers(data.get("temperatures"), f"{path} 'temperatures'")
    if len(temps) < drafter.config.block_size:
        need = drafter.config.block_size
        raise DominoError(f"{path}: needs {need} temperatures (one per block position), got {len(temps)}")
    return temps, f"STS temperatures from {path}"


def make_policy(
    mode: str,
    drafter=None,
    target=None,
    threshold: float = DEFAULT_THRESHOLD,
    costs: CostTable | None = None,
    block_size: int | None = None,
    lookup: bool = False,
    report=log_once,
) -> VerifyPolicy:
    """The verify-length policy for `--verify MODE`.

    static and cost read the drafter's confidence head (a drafter without one is refused) or, for prompt
    lookup alone (drafter None, lookup True), the lookup's running acceptance. cost also needs the
    device's cost table (`costs`, or the stored `dominospec profile` of `target`). Without calibration.json
    the raw confidences are used, and `report` says so (once per process by default).
    """
    if mode not in VERIFY_MODES:
        raise DominoError(f"--verify {mode!r}: choose from {', '.join(VERIFY_MODES)}")
    if not 0 < threshold < 1 or not math.isfinite(threshold):
        raise DominoError(f"--confidence-threshold must be in (0, 1), got {threshold}")
    if mode == "fixed":
        return VerifyPolicy()
    if (drafter is None and not lookup) or (drafter is not None and getattr(drafter, "confidence", None) is None):
        what = "no drafter" if drafter is None else "a drafter without a confidence head"
        raise DominoError(
            f"--verify {mode} reads the drafter's confidence head, and this run has {what}; use "
            "--verify fixed, or a drafter made with --confidence-head"
        )
    temps, note = None, "prompt lookup: running acceptance by position"
    if drafter is not None:
        temps, note = load_calibration(drafter)
        if temps is None:
            report(note)
    if mode == "static":
        return StaticPolicy(temps, note, threshold=threshold)
    if costs is None:
        profile = load_profile(target) if target is not None else None
        if profile is None:
            raise DominoError(
                "--verify cost needs this device's cost table: run `dominospec profile` first (it is "
                "stored per device, backend, dtype and thread count)"
            )
        costs = CostTable.from_profile(profile, drafter, block_size)
        widest = max(len(v) for v in costs.verify_s.values())
        b = block_size or (drafter.config.block_size if drafter is not None else widest)
        if widest < b + 1:
            report(
                f"--verify cost: the device profile reaches {widest} new tokens, so at most {widest - 1} drafts "
                f"are verified per cycle (rerun `dominospec profile --max-k {b + 1}`)"
            )
    return CostPolicy(temps, note, costs=costs)
