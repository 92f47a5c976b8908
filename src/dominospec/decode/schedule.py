"""How many drafts to verify: the verify-length policy the step asks once per step, for all its rows.

One family, batched methods, the same at batch 1 and in the engine:

  wants_draft(rows)                 before proposing: False makes the step plain decoding (no drafter pass)
  verify_lengths(proposals, rows)   k_r in 0..len(proposal_r) per row; the target then runs [anchor, d_1..d_k]
  observe(proposal, verified, accepted)   a cycle's outcome (the running acceptance learns from it)

Modes (VERIFY_MODES, the table every surface reads; plain decoding is a proposer, tune/spec.py):

  fixed   verify every draft (the block size decides)
  static  stop before the first slot whose calibrated confidence is below a threshold
  cost    DSpark's Algorithm 1: take drafts (r, j) by falling survival a_{r,j} = prod_{i<=j} c_{r,i} while
          the expected committed tokens per second, (R + sum of the taken a's) / seconds(step), rises; stop
          at its first drop. Rows decoding greedily search the whole curve instead (see below). Before
          proposing, cost also asks whether drafting pays at all (from the acceptance of earlier cycles):
          when it does not, the step is plain decoding, with a probe now and then.

Why they are lossless: slot k's confidence c_k reads z_k and the token before slot k, so both rules
decide about slot k from the drafts before it only. Whether d_k itself is right can never move the cut
(the rejection sampler's guarantee needs exactly that). A search that looked past the first drop would
let c_{k+1}, which reads d_k, decide whether d_k is verified; tests/test_schedule.py shows on DSpark's
counterexample that this changes the output distribution. At T=0 the output is the target's argmax
whatever is verified, so a greedy row may search the whole curve, in the same batch as sampled rows
(which keep the first-drop rule). Skipping the drafter is decided from earlier cycles only, so it is
lossless when sampling too.

A row (SeqState) gives the policy its context (committed_len) and its sampling settings (greedy or not).
"""

from __future__ import annotations

import itertools
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..errors import DominoError
from .rollout import Proposal

# name -> what it does: the one list of verify modes, with the help text every surface prints
VERIFY_MODES = {
    "fixed": "verify every draft",
    "static": "stop before the first slot whose calibrated confidence is under --confidence-threshold, for a "
    "drafter with a confidence head or prompt lookup",
    "cost": "draft and verify only while the expected tokens/s on this device rises, DSpark's scheduler, with "
    "the device profile measured on first use; greedy requests search the whole curve",
}
DEFAULT_THRESHOLD = 0.5
ENGINE_PROFILE_ROWS = (1, 2, 4, 8)  # the batched cost table measured on first use by the engine's cost policy


def verify_mode_help() -> str:
    """'name: what it does. ...' for --help texts."""
    return " ".join(f"{m}: {mode}." for m, mode in VERIFY_MODES.items())


def check_verify_mode(mode: str, flag: str = "--verify") -> str:
    if mode not in VERIFY_MODES:
        raise DominoError(f"{flag} {mode!r}: choose from {', '.join(VERIFY_MODES)}")
    return mode


def check_threshold(threshold: float, flag: str = "--confidence-threshold") -> float:
    if not 0 < threshold < 1 or not math.isfinite(threshold):
        raise DominoError(f"{flag} must be in (0, 1), got {threshold}")
    return threshold


def profile_drafter_label(drafter) -> str:
    """How a device profile names the drafter whose draft cost it measured (and on which path and weight
    format: a table timed on the library path is measured again for the packed one, fp32 panels for int8)."""
    c = drafter.config
    packed = getattr(drafter, "inference_path", "library") == "packed"
    fmt = getattr(drafter, "weight_format", "float32")
    return (
        c.target_name
        + f"/{c.head}-{c.num_layers}L"
        + ("/packed" if packed else "")
        + (f"-{fmt}" if packed and fmt != "float32" else "")
    )


def calibrated_confidence(logits: torch.Tensor, temperatures: Sequence[float] | None) -> torch.Tensor:
    """c_k = sigmoid(logit_k / T_k) for the k = 1..b slots of one proposal ([b] -> [b])."""
    logits = logits.double()
    if temperatures is not None:
        t = torch.tensor(list(temperatures)[: logits.shape[0]], dtype=logits.dtype, device=logits.device)
        logits = logits / t
    return torch.sigmoid(logits)


def draft_confidence(proposal: Proposal) -> torch.Tensor:
    """Confidences without a confidence head: lookup's running acceptance, else the drafter's largest
    probability at each slot (at greedy, the probability of the token it chose). Not the probability of
    a sampled token itself: that would let the draft decide about its own verification and bias T > 0."""
    if proposal.confidence_logits is not None:
        return torch.sigmoid(proposal.confidence_logits.double())
    if proposal.draft_top is not None:
        return proposal.draft_top.double()
    return torch.full((len(proposal),), 0.5, dtype=torch.float64)


class TopCalibration:
    """P(draft k accepted | drafts < k were) from the draft's own top probability q_k, per position k:
    sigmoid(a_k * logit(q_k) + b_k), fit online by one logistic-loss gradient step per judged position from
    the accept / reject outcomes of earlier cycles (vLLM's confidence for heads without a confidence head).
    Starts at a = 1, b = 0 (the raw top probability). Reads only q (never the drafted token) and past
    outcomes, so a policy on it stays lossless."""

    def __init__(self, lr: float = 0.05, eps: float = 1e-4):
        self.lr, self.eps = lr, eps
        self.a: list[float] = []
        self.b: list[float] = []

    def _logit(self, q: float) -> float:
        q = min(max(q, self.eps), 1 - self.eps)
        return math.log(q / (1 - q))

    def _fit(self, k: int) -> tuple[float, float]:
        return (self.a[k], self.b[k]) if k < len(self.a) else (1.0, 0.0)

    def __call__(self, top: torch.Tensor) -> torch.Tensor:
        """Calibrated conditional confidences [b] for one proposal's top probabilities top [b]."""
        out = []
        for k, q in enumerate(top.double().cpu().tolist()):
            a, b = self._fit(k)
            out.append(1.0 / (1.0 + math.exp(-(a * self._logit(q) + b))))
        return torch.tensor(out, dtype=torch.float64)

    def record(self, top: torch.Tensor, verified: int, accepted: int) -> None:
        """Positions up to the first rejection were judged: label 1 for the accepted ones."""
        qs = top.double().cpu().tolist()
        for k in range(min(verified, accepted + 1, len(qs))):
            while len(self.a) <= k:
                self.a.append(1.0)
                self.b.append(0.0)
            x = self._logit(qs[k])
            p = 1.0 / (1.0 + math.exp(-(self.a[k] * x + self.b[k])))
            g = p - float(k < accepted)  # d(log loss) / d(a x + b)
            self.a[k] -= self.lr * g * x
            self.b[k] -= self.lr * g


class ConfidenceChoice:
    """Which acceptance estimate the cost policy reads for a proposal that carries two: the confidence head's
    (calibrated by its STS temperatures) or the draft's own top probability (TopCalibration). Each is scored
    on every judged position by its log loss against the outcome, before that outcome is learnt, the sums
    decaying by `decay` per cycle; after `warmup` judged positions the one with the lower loss is read, the
    head before. Measured on the bundled target (scripts/confidence_auc.py, 1,881 greedy cycles of the four
    eval sets): AUC at position 1 0.746 for the shipped head, 0.782 for the online-calibrated top probability.
    Reads only estimates and past outcomes, never the drafted tokens: a policy on it stays lossless."""

    SOURCES = ("head", "top")

    def __init__(self, decay: float = 0.995, warmup: int = 32, eps: float = 1e-4):
        self.decay, self.warmup, self.eps = decay, warmup, eps
        self.loss = dict.fromkeys(self.SOURCES, 0.0)
        self.judged = 0

    @property
    def choice(self) -> str:
        if self.judged < self.warmup:
            return "head"
        return min(self.SOURCES, key=lambda s: (self.loss[s], s != "head"))

    def record(self, estimates: dict[str, torch.Tensor], verified: int, accepted: int) -> None:
        """estimates: each source's conditional confidences [b] of one proposal, made before its outcome."""
        for s in self.SOURCES:
            self.loss[s] *= self.decay
        judged = min(verified, accepted + 1)  # positions up to the first rejection were judged
        for s in self.SOURCES:
            qs = estimates[s].double().cpu().tolist()
            for k in range(min(judged, len(qs))):
                q = min(max(qs[k], self.eps), 1 - self.eps)
                self.loss[s] -= math.log(q if k < accepted else 1 - q)
        self.judged += judged


# ----- what a step costs -----


@dataclass
class CostTable:
    """What one cycle costs at batch 1: target forwards over k new tokens by context, and the draft cycle.

    verify_s[context] = [seconds for 1, 2, ... new tokens]; draft_s = seconds of drafting the block
    greedily, draft_sampled_s when the rollout samples (T > 0); a cost each drafting cycle pays whatever
    k is (0 when unknown). Past the profiled token counts a step is unaffordable (the search stops there).
    """

    verify_s: dict[int, list[float]]
    draft_s: float = 0.0
    draft_sampled_s: float | None = None  # None: as draft_s

    @classmethod
    def from_profile(cls, profile: dict, drafter=None, block_size: int | None = None) -> CostTable:
        """From a `dominospec profile` table; its draft cost counts only if it was profiled for this drafter."""
        verify = {int(c): [float(s) for s in v["seconds"]] for c, v in profile["verify"].items()}
        draft, sampled = 0.0, None
        d = profile.get("draft")
        if d and drafter is not None and d.get("drafter") == profile_drafter_label(drafter):
            b = block_size or drafter.config.block_size
            draft = float(dict(zip(d["b"], d["seconds"])).get(b, 0.0))
            if d.get("seconds_sampled"):
                sampled = float(dict(zip(d["b"], d["seconds_sampled"])).get(b, 0.0))
        return cls(verify, draft, sampled)

    @property
    def drafting_costs(self) -> bool:
        return self.draft_s > 0

    def nearest_context(self, context: int) -> int:
        """The profiled context whose prices stand for `context` (one decision holds while this does not move)."""
        return min(self.verify_s, key=lambda c: abs(c - context))

    def verify_seconds(self, context: int) -> list[float]:
        """The verify row of the profiled context nearest to `context`."""
        return self.verify_s[self.nearest_context(context)]

    def step_seconds(self, rows: int, tokens: int, context: int = 0, draft: bool = True, sampled=False) -> float:
        """A forward over `tokens` new tokens (one row: B tokens in a row stand in for B in R rows), plus
        the draft cycle; infinite past the profiled token counts."""
        verify = self.verify_seconds(context)
        if tokens > len(verify):
            return math.inf
        d = (self.draft_s if not sampled or self.draft_sampled_s is None else self.draft_sampled_s) if draft else 0.0
        return d + verify[tokens - 1]


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

    @property
    def drafting_costs(self) -> bool:
        return any(self.draft_s.values())

    def nearest_context(self, context: int) -> int:
        return self.context  # profiled at one context: every context prices alike

    def step_seconds(self, rows: int, tokens: int, context: int = 0, draft: bool = True, sampled=False) -> float:
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


# ----- DSpark's Algorithm 1 over the rows of one step -----


def allocate_verify(
    survival: Sequence[Sequence[float]],
    step_seconds: Callable[[int], float],
    greedy: Sequence[bool] | None = None,
) -> list[int]:
    """Drafts to verify per row in one forward.

    survival[r][j-1] = a_{r,j} = P(row r's drafts 1..j all accepted) (non-increasing in j).
    step_seconds(B) = what one step costs with B new tokens in the target forward (drafting included).
    Every row verifies its anchor (B starts at R). Candidates (r, j) are taken by falling a_{r,j} while
    the expected committed tokens per second, tau(B) / step_seconds(B) with tau = R + sum of the taken
    a's, rises; the first drop stops the search for sampled rows (never look past it: the next
    candidate's a reads the draft a later one would decide about; see the module doc). greedy[r]: row
    r may go on past the first drop; its candidates are walked to the end and the best total kept.
    """
    R = len(survival)
    greedy = list(greedy) if greedy is not None else [False] * R
    cands = sorted(((-float(a), j, r) for r, row in enumerate(survival) for j, a in enumerate(row)))
    ks = [0] * R  # [R]
    tau, B = float(R), R
    rate = tau / step_seconds(B)
    best_rate, best = rate, list(ks)
    dropped = False
    for neg_a, j, r in cands:
        if j != ks[r]:  # a row's drafts are verified as a prefix (ties broken by position)
            if dropped:
                continue
            break
        if dropped and not greedy[r]:
            continue
        nxt = (tau - neg_a) / step_seconds(B + 1)
        if not nxt > rate and not dropped:
            if not any(greedy):
                break
            dropped = True  # sampled rows stay where they are; greedy rows walk on
            if not greedy[r]:
                continue
        tau, B, rate = tau - neg_a, B + 1, nxt
        ks[r] += 1
        if rate > best_rate:
            best_rate, best = rate, list(ks)
    return best if dropped else ks


# ----- the policies -----


class VerifyPolicy:
    """fixed: verify every draft. Subclasses cut blocks; all see only what precedes the verify."""

    name = "fixed"

    def start(self) -> None:
        """A new generation begins (policies with running estimates forget them)."""

    def wants_draft(self, rows: Sequence) -> bool:
        """Asked before proposing: False makes this step plain decoding for every row (no drafter pass)."""
        return True

    def resting(self, row) -> bool:
        """Whether this row decodes plainly for now (proposes nothing): the cost policy's measured-rate rests."""
        return False

    def verify_lengths(self, proposals: Sequence[Proposal | None], rows: Sequence) -> list[int]:
        """k per row ([R]), from the proposals (drafts, confidences) and the rows' state only."""
        return [0 if p is None else len(p) for p in proposals]

    def observe(self, proposal: Proposal, verified: int, accepted: int, row=None) -> None:
        """The outcome of a cycle with a proposal (row: the SeqState it was made for, where known)."""

    def observe_step(
        self, rows: Sequence, seconds: float, committed: Sequence[int], forward_s: float, new_tokens: int
    ) -> None:
        """A whole step: its measured seconds, forward_s of them the target forward over new_tokens tokens, and
        the tokens each row committed (the cost policy's running check)."""

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
    top_calibration: TopCalibration | None = None  # without a confidence head: the draft's top probability, fit online

    def confidences(self, proposal: Proposal) -> torch.Tensor | None:
        if proposal.confidence_logits is None:
            return None
        temps = self.temperatures if proposal.source == "drafter" else None
        return calibrated_confidence(proposal.confidence_logits, temps)

    def survival(self, proposal: Proposal) -> list[float]:
        """a_j for one proposal: calibrated confidences, else the draft's own top probability (no head)."""
        c = self.confidences(proposal)
        if c is None and proposal.draft_top is not None and self.top_calibration is not None:
            c = self.top_calibration(proposal.draft_top)
        if c is None:
            c = draft_confidence(proposal)
        return torch.cumprod(c.double().cpu(), 0).tolist()


@dataclass
class StaticPolicy(ConfidencePolicy):
    threshold: float = DEFAULT_THRESHOLD
    name = "static"

    def cut(self, proposal: Proposal | None) -> int:
        if proposal is None:
            return 0
        c = self.confidences(proposal)
        if c is None:
            return len(proposal)
        low = (c < self.threshold).nonzero()
        return int(low[0]) if low.numel() else len(proposal)

    def verify_lengths(self, proposals, rows) -> list[int]:
        return [self.cut(p) for p in proposals]

    def describe(self) -> dict:
        return {"verify": self.name, "confidence_threshold": self.threshold, "calibration": self.note}


_SERIAL = itertools.count()


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
        self.version = (next(_SERIAL), 0)  # (this estimate, outcomes seen): a decision read from it holds while equal

    def record(self, verified: int, accepted: int) -> None:
        self.version = (self.version[0], self.version[1] + 1)
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


class MeasuredRate:
    """A request's own measured seconds per committed token over its recent steps (decaying by `decay` per
    step, a window of about 1 / (1 - decay) steps), next to what a plain step costs on this machine now: the
    profile's plain step, scaled by how the target forwards of the same steps measured against the profile's
    price of them (a machine busier or slower than when it was profiled moves both alike). The running check
    behind the cost policy's rests: `rest_left` steps of plain decoding for this request, then a fresh window."""

    def __init__(self, decay: float = 0.97):
        self.decay = decay
        self.rest_left = 0
        self.restart()

    def restart(self) -> None:
        self.seconds = self.tokens = self.plain_s = self.forward_s = self.forward_price = self.weight = 0.0
        self.steps = 0

    def record(self, seconds: float, tokens: int, plain_s: float, forward_s: float, forward_price: float) -> None:
        """One step: its measured seconds (forward_s of them the target's forward), the tokens it committed for
        this request, the profile's price of a plain step and of the forward the step ran."""
        d = self.decay
        self.seconds = self.seconds * d + seconds
        self.tokens = self.tokens * d + tokens
        self.plain_s = self.plain_s * d + plain_s
        self.forward_s = self.forward_s * d + forward_s
        self.forward_price = self.forward_price * d + forward_price
        self.weight = self.weight * d + 1.0
        self.steps += 1

    def slower_than_plain(self, warmup: int) -> bool:
        """After `warmup` steps: seconds per committed token above a plain step's (one token per step) as this
        machine runs it now: seconds / tokens > (plain_s / weight) * (forward_s / forward_price)."""
        if self.steps < warmup:
            return False
        return self.seconds * self.weight * self.forward_price > self.plain_s * self.tokens * self.forward_s


def _context(rows: Sequence) -> int:
    """Committed tokens before the anchor (the longest row's): which profiled context a cost reads."""
    return max((r.committed_len - 1 for r in rows), default=0)


def _samples(rows: Sequence) -> bool:
    return any(not r.sampling.greedy for r in rows)


@dataclass
class CostPolicy(ConfidencePolicy):
    """DSpark's Algorithm 1 over the rows of a step, and the skip-and-probe decision before it, from each
    request's own running acceptance (kept by the policy per row while the row lives, from its first drafter
    cycle; the pooled one before).

    costs: a CostTable (batch 1) or BatchCostTable (the engine), anything with step_seconds and
    drafting_costs."""

    costs: CostTable | BatchCostTable = field(default_factory=lambda: CostTable({0: [1.0]}))
    block_size: int = 8  # drafts a drafter cycle proposes (for the skip decision)
    probe_every: int = 16  # while skipping, draft once every this many steps to refresh the estimate
    prior: list[float] | None = None  # the drafter's acceptance.json, the running estimate's starting point
    # steps a request runs before its own measured rate may send it to plain decoding; None: never (the default:
    # on the eval sets, 1 and 2 threads, the rests cost prompt lookup and the hybrid more than they saved)
    fallback_after: int | None = None
    rest_steps: int = 64  # ... for this many steps (no drafter pass, no draft verified), then it measures again
    name = "cost"

    def __post_init__(self):
        self.choice = ConfidenceChoice()  # kept across generations, as the top calibration
        self.own: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # row -> its own RunningAcceptance
        self.measured: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # row -> its own MeasuredRate
        self.start()

    def start(self) -> None:
        self.acceptance = RunningAcceptance(prior=self.prior)
        if self.top_calibration is None:  # kept across generations: it learns the drafter, not the request
            self.top_calibration = TopCalibration()
        self.skipped_in_a_row = 0
        self.skipped = 0
        self.rests = 0  # times a request's measured rate sent it to plain decoding for rest_steps steps
        self._decided = (None, False)  # (what the last skip decision read, its answer)

    def estimates(self, proposal: Proposal) -> dict[str, torch.Tensor] | None:
        """Both conditional confidences of a proposal that carries a head's logits and its top probabilities."""
        head = self.confidences(proposal)
        if head is None or proposal.draft_top is None or proposal.source != "drafter":
            return None
        return {"head": head, "top": self.top_calibration(proposal.draft_top)}

    def survival(self, proposal: Proposal) -> list[float]:
        both = self.estimates(proposal)
        if both is None:
            return super().survival(proposal)
        return torch.cumprod(both[self.choice.choice].double().cpu(), 0).tolist()

    def rates(self, survival: Sequence[float], context: int = 0) -> list[float]:
        """One row's expected committed tokens per second when verifying k = 0, 1, ... drafts (while the
        table reaches): rate_k = (1 + sum_{j<=k} a_j) / seconds(k + 1 new tokens, drafting included)."""
        out, tau = [], 1.0
        for k in range(len(survival) + 1):
            if k:
                tau += survival[k - 1]
            s = self.costs.step_seconds(1, k + 1, context)
            if math.isinf(s):
                break
            out.append(tau / s)
        return out

    def resting(self, row) -> bool:
        """Whether the row's measured rate sent it to plain decoding for now (observe_step)."""
        try:
            rate = self.measured.get(row)
        except TypeError:  # a row without an identity: never rests
            return False
        return rate is not None and rate.rest_left > 0

    def verify_lengths(self, proposals, rows) -> list[int]:
        # [R][len(proposal_r)]; a resting row verifies nothing
        survival = [[] if p is None or self.resting(r) else self.survival(p) for p, r in zip(proposals, rows)]
        R, context, sampled = len(rows), _context(rows), _samples(rows)
        return allocate_verify(
            survival,
            lambda B: self.costs.step_seconds(R, B, context, sampled=sampled),
            [r.sampling.greedy for r in rows],
        )

    def acceptance_of(self, row) -> RunningAcceptance:
        """The row's own running acceptance once it has drafted, else the pooled one (every drafter cycle)."""
        try:
            own = self.own.get(row)
        except TypeError:  # a row without an identity (unhashable, no weak reference): the pooled estimate
            own = None
        return own or self.acceptance

    def drafting_pays(self, rows: Sequence) -> bool:
        """Whether a step with a drafter pass, at each row's own running acceptance, beats a plain step of
        these rows (the best allocation of the whole curves, from earlier cycles' outcomes only)."""
        R, context, sampled = len(rows), _context(rows), _samples(rows)
        survival = [self.acceptance_of(r).survival(self.block_size) for r in rows]  # [R][b]
        ks = allocate_verify(survival, lambda B: self.costs.step_seconds(R, B, context, sampled=sampled), [True] * R)
        if not any(ks):
            return False
        tau = R + sum(sum(s[:k]) for s, k in zip(survival, ks))
        with_draft = tau / self.costs.step_seconds(R, R + sum(ks), context, sampled=sampled)
        return with_draft > R / self.costs.step_seconds(R, R, context, draft=False)

    def pays_now(self, rows: Sequence) -> bool:
        """drafting_pays, computed again only when what it reads moved: the row count, the profiled context that
        prices the step, sampling, or an estimate that learnt an outcome (a cycle that drafts nothing then costs
        a few comparisons, not an allocation over the whole curve)."""
        key = (
            len(rows),
            self.costs.nearest_context(_context(rows)),
            _samples(rows),
            tuple(self.acceptance_of(r).version for r in rows),
        )
        if self._decided[0] != key:
            self._decided = (key, self.drafting_pays(rows))
        return self._decided[1]

    def wants_draft(self, rows) -> bool:
        if all(self.resting(r) for r in rows):  # every row decodes plainly for now: no drafter pass
            return False
        if not self.costs.drafting_costs or self.pays_now(rows) or self.skipped_in_a_row + 1 >= self.probe_every:
            self.skipped_in_a_row = 0
            return True
        self.skipped_in_a_row += 1
        self.skipped += 1
        return False

    def observe(self, proposal: Proposal, verified: int, accepted: int, row=None) -> None:
        if proposal.source != "drafter":
            return
        self.acceptance.record(verified, accepted)
        both = self.estimates(proposal)  # scored before the calibration learns this outcome
        if both is not None:
            self.choice.record(both, verified, accepted)
        if proposal.draft_top is not None:
            self.top_calibration.record(proposal.draft_top, verified, accepted)
        if row is not None:  # the request's own estimate starts from the pooled one (worth two cycles)
            own = self.acceptance_of(row)
            if own is self.acceptance:
                own = self.own[row] = RunningAcceptance(prior=self.acceptance.conditional(self.block_size))
            own.record(verified, accepted)

    def observe_step(
        self, rows: Sequence, seconds: float, committed: Sequence[int], forward_s: float, new_tokens: int
    ) -> None:
        """A step's measured seconds (forward_s of them the target forward over new_tokens tokens) and each row's
        committed tokens. A request whose own measured seconds per token exceed a plain step's of this batch on
        this machine now (MeasuredRate) rests: it decodes plainly for rest_steps steps (no drafter pass for it, no
        draft verified; its context still kept, so it can draft again), then measures afresh. Read from past steps
        only, so it is lossless as the skip decision is."""
        if self.fallback_after is None:
            return
        R, context = len(rows), _context(rows)
        plain = self.costs.step_seconds(R, R, context, draft=False)
        price = self.costs.step_seconds(R, new_tokens, context, draft=False)
        if math.isinf(price):
            return
        for r, n in zip(rows, committed):
            if not r.speculative:
                continue
            rate = self.measured.get(r)
            if rate is None:
                rate = self.measured[r] = MeasuredRate()
            if rate.rest_left > 0:
                rate.rest_left -= 1
                continue
            rate.record(seconds, n, plain, forward_s, price)
            if rate.slower_than_plain(self.fallback_after):
                rate.rest_left = self.rest_steps
                rate.restart()
                self.rests += 1

    def describe(self) -> dict:
        d = {"verify": self.name, "calibration": self.note, "search": "first drop (sampled), whole curve (greedy)"}
        d["confidence"] = (
            f"{self.choice.choice} (log loss head {self.choice.loss['head']:.1f}, top {self.choice.loss['top']:.1f})"
        )
        if isinstance(self.costs, CostTable):
            d.update(draft_s=self.costs.draft_s, profiled_contexts=sorted(self.costs.verify_s))
        else:
            d.update(draft_s=self.costs.draft_s, profiled_rows=sorted(self.costs.seconds))
        return d
