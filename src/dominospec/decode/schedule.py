"""How many drafts to verify: the verify-length policy the speculative loop asks once per cycle.

A policy reads a Proposal (drafts, confidence logits) and answers k in 0..len(proposal); the loop
then runs the target over [anchor, d_1..d_k] (k+1 positions). Three policies:

  fixed   verify every draft (the block size decides)
  static  stop before the first slot whose calibrated confidence is below a threshold
  cost    DSpark's Algorithm 1 at batch 1: walk k = 1, 2, ... while the expected committed tokens
          per second, (1 + sum_{j<=k} a_j) / (draft + verify(k+1)), keeps rising; stop at its
          first drop. a_j = prod_{i<=j} c_i are the calibrated survival products. Greedy decoding
          takes the best k of the whole curve instead (see below). Before drafting, cost also
          asks whether drafting pays at all (`wants_draft`, from the acceptance of earlier cycles):
          when it does not, the cycle is one plain decode step, with a probe now and then.

Why they are lossless: slot k's confidence c_k reads z_k and the token before slot k, so both
rules decide about slot k from the drafts before it only. Whether d_k itself is right can never
move the cut (the rejection sampler's guarantee needs exactly that). A search that looked past
the first drop would let c_{k+1}, which reads d_k, decide whether d_k is verified; tests/test_schedule.py
shows on DSpark's counterexample that this changes the output distribution. At T=0 the output is
the target's argmax whatever is verified, so greedy decoding may search the whole curve. Skipping
the drafter is decided from earlier cycles only, so it is lossless when sampling too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..drafter.checkpoint import ACCEPTANCE_NAME, CALIBRATION_NAME, sidecar_path
from ..errors import DominoError
from ..io import positive_numbers, read_json_object
from ..log import log_once
from .cost import ensure_profile, profile_drafter_label, read_acceptance
from .lookup import LOOKUP_BLOCK_SIZE
from .propose import Proposal

VERIFY_MODES = ("fixed", "static", "cost")
DEFAULT_THRESHOLD = 0.5
ENGINE_PROFILE_ROWS = (1, 2, 4, 8)  # the batched cost table measured on first use by the engine's cost policy


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
    def from_profile(
        cls, profile: dict, drafter=None, block_size: int | None = None, sampled: bool = False
    ) -> CostTable:
        """From a `dominospec profile` table; its draft cost counts only if it was profiled for this drafter.
        sampled: the draft cycle's cost when the rollout samples (T > 0), where the profile has it."""
        verify = {int(c): [float(s) for s in v["seconds"]] for c, v in profile["verify"].items()}
        draft = 0.0
        d = profile.get("draft")
        if d and drafter is not None and d.get("drafter") == profile_drafter_label(drafter):
            by_b = dict(zip(d["b"], d["seconds_sampled"] if sampled and d.get("seconds_sampled") else d["seconds"]))
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

    def start(self) -> None:
        """A new generation begins (policies with running estimates forget them)."""

    def wants_draft(self, context: int = 0) -> bool:
        """Asked before the drafter runs: False makes this cycle a plain decode step (no drafts)."""
        return True

    def observe(self, proposal: Proposal, verified: int, accepted: int) -> None:
        """The outcome of a cycle whose drafts came from the drafter."""

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


class RunningAcceptance:
    """P(draft k accepted | drafts < k were), per block position, from recent drafter cycles.

    Counts decay by `decay` per observed cycle (a window of about 1 / (1 - decay) cycles), on top of a
    prior worth two cycles: `prior[k]` (the drafter's measured acceptance.json) or 0.5 (uniform, as
    the lookup proposer's running acceptance); a position never judged reads its prior.
    """

    def __init__(self, decay: float = 0.95, prior: Sequence[float] | None = None):
        self.decay = decay
        self.prior = list(prior or [])
        self.judged: list[float] = []
        self.passed: list[float] = []

    def record(self, verified: int, accepted: int) -> None:
        self.judged = [j * self.decay for j in self.judged]
        self.passed = [p * self.decay for p in self.passed]
        while len(self.judged) < verified:
            self.judged.append(0.0)
            self.passed.append(0.0)
        for k in range(min(verified, accepted + 1)):  # positions up to the first rejection were judged
            self.judged[k] += 1.0
            self.passed[k] += float(k < accepted)

    def conditional(self, b: int) -> list[float]:
        out = []
        for k in range(b):
            judged = self.judged[k] if k < len(self.judged) else 0.0
            passed = self.passed[k] if k < len(self.passed) else 0.0
            p = self.prior[k] if k < len(self.prior) else 0.5
            out.append((passed + 2.0 * p) / (judged + 2.0))
        return out

    def survival(self, b: int) -> list[float]:
        """a_k = P(drafts 1..k all accepted) for k = 1..b: running products of the conditionals."""
        out, a = [], 1.0
        for p in self.conditional(b):
            a *= p
            out.append(a)
        return out


@dataclass
class CostPolicy(ConfidencePolicy):
    costs: CostTable = field(default_factory=lambda: CostTable({0: [1.0]}))
    greedy: bool = False  # T=0: every verify length is lossless, so take the best k of the whole curve
    block_size: int = 8  # drafts a drafter cycle proposes (for the skip decision)
    probe_every: int = 16  # while skipping, draft once every this many cycles to refresh the estimate
    prior: list[float] | None = None  # the drafter's acceptance.json, the running estimate's starting point
    name = "cost"

    def __post_init__(self):
        self.start()

    def start(self) -> None:
        self.acceptance = RunningAcceptance(prior=self.prior)
        self.skipped_in_a_row = 0
        self.skipped = 0

    def rates(self, survival: Sequence[float], context: int = 0, draft_s: float | None = None) -> list[float]:
        """Expected committed tokens per second when verifying k = 0, 1, ... drafts (while the table reaches).

        survival[j-1] = a_j = P(drafts 1..j all accepted); rate_k = (1 + sum_{j<=k} a_j) / (draft + verify(k+1)).
        """
        verify = self.costs.verify_seconds(context)
        draft = self.costs.draft_s if draft_s is None else draft_s
        out, tau = [], 1.0
        for k in range(0, min(len(survival), len(verify) - 1) + 1):
            if k:
                tau += survival[k - 1]
            out.append(tau / (draft + verify[k]))
        return out

    def verify_length(self, proposal: Proposal, context: int = 0) -> int:
        c = self.confidences(proposal)
        if c is None:
            return len(proposal)
        rates = self.rates(torch.cumprod(c, 0).tolist(), context)
        if self.greedy:  # lossless at T=0 whatever k is: the best of the whole curve
            return max(range(len(rates)), key=lambda k: (rates[k], -k))
        k = 0
        while k + 1 < len(rates) and rates[k + 1] > rates[k]:  # stop at the first drop: see the module doc
            k += 1
        return k

    def drafting_pays(self, context: int = 0) -> bool:
        """Whether a drafter cycle, at the running acceptance, beats one plain decode step."""
        with_draft = self.rates(self.acceptance.survival(self.block_size), context)
        plain = 1.0 / self.costs.verify_seconds(context)[0]
        return max(with_draft[1:], default=0.0) > plain

    def wants_draft(self, context: int = 0) -> bool:
        if self.costs.draft_s <= 0 or self.drafting_pays(context) or self.skipped_in_a_row + 1 >= self.probe_every:
            self.skipped_in_a_row = 0
            return True
        self.skipped_in_a_row += 1
        self.skipped += 1
        return False

    def observe(self, proposal: Proposal, verified: int, accepted: int) -> None:
        if proposal.source == "drafter":
            self.acceptance.record(verified, accepted)

    def describe(self) -> dict:
        return {
            "verify": self.name,
            "calibration": self.note,
            "draft_s": self.costs.draft_s,
            "profiled_contexts": sorted(self.costs.verify_s),
            "search": "whole curve (greedy)" if self.greedy else "first drop",
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
    greedy: bool = False,
) -> VerifyPolicy:
    """The verify-length policy for `--verify MODE`.

    static and cost read the drafter's confidence head (a drafter without one is refused) or, for prompt
    lookup alone (drafter None, lookup True), the lookup's running acceptance. cost also needs the
    device's cost table (`costs`, or the stored profile of `target`, measured now when missing).
    Without calibration.json the raw confidences are used, and `report` says so (once per process by
    default). greedy (T=0): the cost policy searches the whole expected-tokens/s curve.
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
        if target is None:
            raise DominoError("--verify cost needs the target, to read or measure this device's cost table")
        widest_b = block_size or (drafter.config.block_size if drafter is not None else LOOKUP_BLOCK_SIZE)
        profile = ensure_profile(target, drafter, max_k=widest_b + 1, report=report)
        costs = CostTable.from_profile(profile, drafter, block_size, sampled=not greedy)
        widest = max(len(v) for v in costs.verify_s.values())
        if widest < widest_b + 1:
            report(
                f"--verify cost: the device profile reaches {widest} new tokens, so at most {widest - 1} drafts "
                f"are verified per cycle (rerun `dominospec profile --max-k {widest_b + 1}`)"
            )
    b = block_size or (drafter.config.block_size if drafter is not None else LOOKUP_BLOCK_SIZE)
    return CostPolicy(temps, note, costs=costs, greedy=greedy, block_size=b, prior=acceptance_prior(drafter))


def acceptance_prior(drafter) -> list[float] | None:
    """The drafter's measured acceptance by position (acceptance.json), where it has one: what the
    cost policy's running estimate starts from (else 0.5 at every position)."""
    path = sidecar_path(drafter, ACCEPTANCE_NAME) if drafter is not None else None
    return read_acceptance(path) if path is not None and path.exists() else None


# ----- over a whole batch: one verify budget for every running sequence -----


def allocate_verify(survival: Sequence[Sequence[float]], step_seconds: Callable[[int], float]) -> list[int]:
    """DSpark's Algorithm 1: drafts to verify per sequence in one batched forward.

    survival[r][j-1] = a_{r,j} = P(sequence r's drafts 1..j all accepted) (non-increasing in j).
    step_seconds(B) = what one step costs with B new tokens in the target forward (drafting included).
    Every sequence verifies its anchor (B starts at R). Candidates (r, j) are taken by falling a_{r,j}
    while the expected committed tokens per second, tau(B) / step_seconds(B) with
    tau = R + sum of the taken a's, rises; the first drop stops the search (never look past it: the
    next candidate's a reads the draft a later one would decide about; see the module doc).
    """
    R = len(survival)
    cands = sorted(((-float(a), j, r) for r, row in enumerate(survival) for j, a in enumerate(row)))
    ks = [0] * R
    tau, B = float(R), R
    rate = tau / step_seconds(B)
    for neg_a, j, r in cands:
        if j != ks[r]:  # a row's drafts are verified as a prefix (ties broken by position)
            break
        nxt = (tau - neg_a) / step_seconds(B + 1)
        if not nxt > rate:
            break
        tau, B, rate = tau - neg_a, B + 1, nxt
        ks[r] += 1
    return ks


@dataclass
class BatchCostTable:
    """What one engine step costs: seconds of a target forward by row count and new tokens per row.

    seconds[rows] = [s for 1, 2, ... new tokens per row] (profiled at one context), draft_s[rows] =
    one drafter pass for that many rows. Between profiled points the cost is interpolated by the
    total new tokens B; a batch-1 CostTable stands in when no batched table exists.
    """

    seconds: dict[int, list[float]]
    draft_s: dict[int, float] = field(default_factory=dict)
    context: int = 0

    @classmethod
    def from_profile(cls, profile: dict) -> BatchCostTable | None:
        b = profile.get("batch")
        if not b:
            return None
        return cls(
            {int(r): [float(s) for s in v] for r, v in zip(b["rows"], b["seconds"])},
            {int(r): float(s) for r, s in zip(b["rows"], b.get("draft_seconds") or [])},
            int(b.get("context", 0)),
        )

    @classmethod
    def from_single(cls, costs: CostTable) -> BatchCostTable:
        verify = costs.verify_seconds(256)
        return cls({1: verify}, {1: costs.draft_s})

    def step_seconds(self, rows: int, tokens: int, draft: bool = True) -> float:
        """Forward over `tokens` new tokens in `rows` rows (plus the draft pass), interpolated over B."""
        r = min(self.seconds, key=lambda x: (abs(math.log(x / rows)), -x))
        curve = self.seconds[r]
        pts = [(r * (k + 1), s) for k, s in enumerate(curve)]  # (B, seconds)
        if r == 1 and rows > 1:  # a batch-1 table: B tokens in one row stands in for B tokens in R rows
            pts = [(k + 1, s) for k, s in enumerate(curve)]
        draft = self.draft_s.get(r, 0.0) * rows / r if draft else 0.0
        if tokens <= pts[0][0]:
            return draft + pts[0][1] * tokens / pts[0][0]
        for (b0, s0), (b1, s1) in zip(pts, pts[1:]):
            if tokens <= b1:
                return draft + s0 + (s1 - s0) * (tokens - b0) / (b1 - b0)
        (b0, s0), (b1, s1) = pts[-2:] if len(pts) > 1 else (pts[0], (pts[0][0] * 2, pts[0][1] * 2))
        slope = max(0.0, (s1 - s0) / (b1 - b0))  # past the table: its last slope, never falling (noise)
        return draft + s1 + slope * (tokens - b1)


class BatchPolicy:
    """Verify lengths for every running sequence of one engine step; each sees only its own proposal.

    cost also decides, before each step, whether the drafter pass pays at all: from the running
    acceptance of earlier steps (never this step's drafts: lossless when sampling), Algorithm 1's
    expected tokens/s with a draft pass is compared with a plain step of the same rows; while it
    loses, the step is plain decoding, and every probe_every-th such step drafts anyway.
    """

    def __init__(
        self,
        mode: str,
        single: VerifyPolicy,
        costs: BatchCostTable | None = None,
        probe_every: int = 16,
        prior: Sequence[float] | None = None,
    ):
        self.name, self.single, self.costs, self.probe_every = mode, single, costs, probe_every
        self.acceptance = RunningAcceptance(prior=prior)
        self.skipped = 0  # steps that ran without a drafter pass
        self._skipped_in_a_row = 0

    def drafting_pays(self, rows: int, block_size: int) -> bool:
        """Whether a step with a drafter pass, at the running acceptance, beats a plain step of `rows` rows."""
        survival = self.acceptance.survival(block_size)
        ks = allocate_verify([survival] * rows, lambda B: self.costs.step_seconds(rows, B))
        tau = rows + sum(sum(survival[:k]) for k in ks)
        with_draft = tau / self.costs.step_seconds(rows, rows + sum(ks))
        return with_draft > rows / self.costs.step_seconds(rows, rows, draft=False)

    def wants_draft(self, rows: int, block_size: int) -> bool:
        """Whether this step runs the drafter (always, except for cost while drafting does not pay)."""
        if self.name != "cost" or self.costs is None or not any(self.costs.draft_s.values()):
            return True
        if self.drafting_pays(rows, block_size) or self._skipped_in_a_row + 1 >= self.probe_every:
            self._skipped_in_a_row = 0
            return True
        self._skipped_in_a_row += 1
        self.skipped += 1
        return False

    def observe(self, proposal: Proposal | None, verified: int, accepted: int) -> None:
        if proposal is not None and proposal.source == "drafter":
            self.acceptance.record(verified, accepted)

    def survival(self, proposal: Proposal) -> list[float]:
        """a_j for one proposal: calibrated confidences, else the draft's own probability of its token."""
        c = self.single.confidences(proposal) if isinstance(self.single, ConfidencePolicy) else None
        if c is None:
            c = draft_confidence(proposal)
        return torch.cumprod(c.double().cpu(), 0).tolist()

    def verify_lengths(self, proposals: Sequence[Proposal | None], contexts: Sequence[int]) -> list[int]:
        if self.name != "cost":
            return [0 if p is None else self.single.verify_length(p, c) for p, c in zip(proposals, contexts)]
        survival = [[] if p is None else self.survival(p) for p in proposals]
        rows = len(proposals)
        return allocate_verify(survival, lambda B: self.costs.step_seconds(rows, B))

    def describe(self) -> dict:
        return {**self.single.describe(), "verify": self.name}


def draft_confidence(proposal: Proposal) -> torch.Tensor:
    """Confidences without a confidence head: lookup's running acceptance, else the drafter's largest
    probability at each slot (at greedy, the probability of the token it chose). Not the probability of
    a sampled token itself: that would let the draft decide about its own verification and bias T > 0."""
    if proposal.confidence_logits is not None:
        return torch.sigmoid(proposal.confidence_logits.double())
    if proposal.draft_top is not None:
        return proposal.draft_top.double()
    return torch.full((len(proposal),), 0.5, dtype=torch.float64)


def make_batch_policy(
    mode: str,
    drafter=None,
    target=None,
    block_size: int | None = None,
    costs=None,
    lookup: bool = False,
    threshold: float | None = None,
    report=log_once,
) -> BatchPolicy:
    """The engine's policy: fixed, static or cost (DSpark Algorithm 1 over all rows).

    static needs confidences (a confidence head, or lookup's running acceptance); cost falls back to the
    draft's own probability of its token for a drafter without a head. cost reads `costs` (a
    BatchCostTable or CostTable) or the stored `dominospec profile` of the target.
    """
    if mode not in VERIFY_MODES:
        raise DominoError(f"engine policy {mode!r}: choose from plain, {', '.join(VERIFY_MODES)}")
    has_conf = (drafter is None and lookup) or (drafter is not None and getattr(drafter, "confidence", None))
    thr = DEFAULT_THRESHOLD if threshold is None else threshold
    if mode == "fixed" or (mode == "cost" and not has_conf):
        single = VerifyPolicy()
    else:
        single = make_policy("static", drafter, target, thr, block_size=block_size, lookup=lookup, report=report)
    if mode != "cost":
        return BatchPolicy(mode, single)
    if isinstance(costs, CostTable):
        costs = BatchCostTable.from_single(costs)
    if costs is None:
        if target is None:
            raise DominoError("engine policy cost needs the target, to read or measure this device's cost table")
        widest_b = block_size or (drafter.config.block_size if drafter is not None else LOOKUP_BLOCK_SIZE)
        profile = ensure_profile(target, drafter, max_k=widest_b + 1, report=report, batch_rows=ENGINE_PROFILE_ROWS)
        costs = BatchCostTable.from_profile(profile) or BatchCostTable.from_single(CostTable.from_profile(profile))
        if drafter is None:  # prompt lookup alone: no draft pass to pay for
            costs.draft_s = {}
    return BatchPolicy(mode, single, costs, prior=acceptance_prior(drafter))
