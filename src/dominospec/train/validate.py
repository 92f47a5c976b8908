"""Validation during training: a held-out split, teacher-forced acceptance, the best checkpoint.

The benchmark measures tokens per cycle (tau) and the conditional acceptance by block position
of live greedy decoding. Here they are estimated without decoding: supervised anchors of each
held-out sample (all of them, or a fixed evenly spaced subset) make one block each, run exactly
as training runs them (`blocks.teacher_forced_blocks`), and slot k counts as accepted when its
argmax is the true next token and every slot before it was accepted too. At the anchors a live
greedy run visits, these hits equal its accepted counts cycle by cycle (tests/test_audit.py
replays one), so the estimate differs from the benchmark only in which anchors are visited and
in the data (sampled answers here, greedy ones there).

The split is by conversation: a sample is held out when the hash of its conversation id
("<source>:<index>", the part before any "/<turn>") falls below the fraction. It depends on the
id alone, so it is the same in every run and on every rank, and the parts of one conversation
never land on both sides. At least one conversation is held out, and none while fraction x
samples < 1 (the default 0.05 starts validating at 20 samples).
"""

from __future__ import annotations

import bisect
import hashlib
from dataclasses import dataclass

import torch

from ..decode.result import expected_tokens
from ..errors import DominoError
from ..targets.features import FeatureCache
from .blocks import IGNORE, TeacherForced, anchor_candidates, teacher_forced_blocks
from .distributed import Dist

ANCHOR_CHUNK = 64  # blocks per drafter forward: bounds the [N, B, V] logits in memory


# ----- the split -----


def conversation_of(sample: dict) -> str:
    return str(sample.get("id", sample["input_ids"])).split("/")[0]


def held_out_score(conversation: str) -> float:
    """A stable number in [0, 1) per conversation id."""
    return int.from_bytes(hashlib.sha256(conversation.encode()).digest()[:8], "big") / 2**64


def split_validation(samples: list[dict], fraction: float) -> tuple[list[dict], list[dict]]:
    """(training, validation) samples: conversations whose score is below `fraction` are held out.

    Only on-policy conversations (answers the target wrote) are candidates: off-policy samples
    (`labels` other than on-policy, e.g. pydoc texts) always train, since validation must measure
    acceptance on what the target itself would write. A set with no on-policy sample validates on all.
    """
    if not 0 <= fraction < 1:
        raise DominoError(f"--val-fraction must be in [0, 1), got {fraction}")
    if fraction * len(samples) < 1:
        return list(samples), []
    on_policy = {conversation_of(s) for s in samples if s.get("labels", "on-policy") == "on-policy"}
    score = {c: held_out_score(c) for c in on_policy or {conversation_of(s) for s in samples}}
    held = {c for c, x in score.items() if x < fraction} or {min(score, key=score.get)}
    train = [s for s in samples if conversation_of(s) not in held]
    val = [s for s in samples if conversation_of(s) in held]
    if not train:
        raise DominoError(f"--val-fraction {fraction} holds out all {len(samples)} samples; lower it")
    return train, val


def greedy_answer_samples(target, prompts: list[list[int]], max_new_tokens: int, name: str = "p") -> list[dict]:
    """Validation samples that read like a benchmark: each prompt with the target's own greedy answer.

    Walked validation (`Validator(walk=True)`) on these is what greedy speculative decoding of the
    prompts measures (scripts/val_gap.py: within 1.5% of `bench` on prompts drawn like its sets).
    """
    from ..decode.single import generate_autoregressive

    out = []
    for k, prompt in enumerate(prompts):
        answer = generate_autoregressive(target, prompt, max_new_tokens, eos_ids=target.eos_ids).tokens
        ids, mask = list(prompt) + list(answer), [0] * len(prompt) + [1] * len(answer)
        out.append({"id": f"{name}:{k}", "input_ids": ids, "loss_mask": mask})
    return out


def shared_sequences(train: list[dict], val: list[dict]) -> int:
    """How many validation samples are token for token a training sample (a separate --val-data may overlap)."""
    seen = {tuple(s["input_ids"]) for s in train}
    return sum(tuple(s["input_ids"]) in seen for s in val)


# ----- counting acceptance -----


def validation_anchors(loss_mask: torch.Tensor, cap: int) -> torch.Tensor:
    """All anchor candidates, or `cap` of them evenly spaced (the same ones at every evaluation)."""
    cand = anchor_candidates(loss_mask)
    n = cand.shape[0]
    if cap <= 0 or n <= cap:
        return cand
    if cap == 1:
        return cand[:1]
    return cand[torch.tensor([i * (n - 1) // (cap - 1) for i in range(cap)])]


def greedy_hits(drafter, tf: TeacherForced) -> tuple[torch.Tensor, torch.Tensor]:
    """(hit, has_label), both [N, B]: slot k's greedy draft equals x_{a+1+k}; slot k has a true token.

    A label outside a draft vocabulary is a miss (the drafter cannot propose it), not a missing label.
    """
    has_label = tf.labels != IGNORE
    hit = (drafter.to_target_ids(tf.final.argmax(-1)) == tf.labels) & has_label
    return hit, has_label


def walked_rows(anchors: torch.Tensor, hit: torch.Tensor) -> list[int]:
    """The blocks a greedy decode visits on this text: rows of `anchors` [N] (every candidate, sorted).

    The first cycle anchors at the first candidate; a cycle accepting L drafts commits them plus the
    target's own token, so the next anchors L + 1 further on; past the end of one answer the walk
    starts again at the next answer's first candidate (a later turn). Decoding does not choose where
    to start a block: it starts right after a miss, at the positions the drafter found hard, which
    evenly spaced anchors pass over as often as the easy ones.
    """
    cands = anchors.tolist()
    row_of = {a: r for r, a in enumerate(cands)}
    lengths = accepted_lengths(hit).tolist()
    rows, a = [], cands[0] if cands else None
    while a is not None:
        if a not in row_of:  # past this answer: the next one, if any
            j = bisect.bisect_left(cands, a)
            a = cands[j] if j < len(cands) else None
            continue
        rows.append(row_of[a])
        a += lengths[row_of[a]] + 1
    return rows


def accepted_lengths(hit: torch.Tensor) -> torch.Tensor:
    """[N]: how many leading slots of each block hit, i.e. the drafts a greedy verify would accept."""
    return hit.long().cumprod(-1).sum(-1)


def acceptance_counts(hit: torch.Tensor, has_label: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(judged [B], passed [B]): slot k is judged when every slot before it hit and it has a label."""
    reached = torch.cat([torch.ones_like(hit[:, :1]), hit[:, :-1].long().cumprod(-1).bool()], dim=1)
    judged = reached & has_label
    return judged.sum(0), (judged & hit).sum(0)


@dataclass
class ValResult:
    judged: list[int]  # per block position k = 1..B: blocks whose drafts 1..k-1 were all accepted
    passed: list[int]  # ... of which draft k was accepted too
    samples: int = 0  # held-out samples measured

    @property
    def conditional(self) -> list[float | None]:
        """P(accept k | 1..k-1 accepted); None where no block reached position k."""
        return [p / j if j else None for j, p in zip(self.judged, self.passed)]

    @property
    def tau(self) -> float:
        """Expected tokens per cycle at the full block: 1 + sum_k prod_{i<=k} p_i (bonus included)."""
        return expected_tokens([p or 0.0 for p in self.conditional], len(self.judged))

    @property
    def blocks(self) -> int:
        return self.judged[0] if self.judged else 0


# ----- the evaluation -----


class Validator:
    """Greedy acceptance of a drafter on held-out samples, measured the training way."""

    def __init__(
        self,
        target,
        samples: list[dict],
        max_anchors: int = 64,
        batch_size: int = 8,
        walk: bool = False,
        feature_cache: FeatureCache | None = None,
    ):
        """walk: count the blocks a greedy decode of each answer would visit (`walked_rows`), as the
        benchmark does; else `max_anchors` evenly spaced anchors per sample (0: all). feature_cache: the
        held-out samples' target features are read from it, or computed once and stored there (fp16, the
        precision training reads them at), so a run's validations after the first make no target pass."""
        if not samples:
            raise DominoError("validation needs at least one sample")
        self.target, self.samples, self.batch_size, self.walk = target, samples, max(1, batch_size), walk
        self.cache = feature_cache
        cap = 0 if walk else max_anchors
        self.anchors = [validation_anchors(torch.tensor(s["loss_mask"]), cap) for s in samples]

    @torch.no_grad()
    def evaluate(self, drafter, dist: Dist | None = None) -> ValResult:
        """Counts over this rank's share of the samples, summed over ranks: every rank gets the same result."""
        dist = dist or Dist()
        dev = self.target.device
        counts = torch.zeros(2, drafter.config.block_size, dtype=torch.float64, device=dev)
        mine = [i for i in range(dist.rank, len(self.samples), dist.world) if self.anchors[i].numel()]
        for lo in range(0, len(mine), self.batch_size):
            chunk = mine[lo : lo + self.batch_size]
            for i, f in zip(chunk, self._features(chunk, drafter.config.target_layer_ids)):
                ids = torch.tensor(self.samples[i]["input_ids"], device=dev)
                mask = torch.tensor(self.samples[i]["loss_mask"], device=dev)
                hits = [
                    greedy_hits(drafter, teacher_forced_blocks(drafter, f, ids, mask, part))
                    for part in self.anchors[i].to(dev).split(ANCHOR_CHUNK)
                ]
                hit, has_label = torch.cat([h for h, _ in hits]), torch.cat([h for _, h in hits])
                if self.walk:
                    rows = walked_rows(self.anchors[i], hit)
                    hit, has_label = hit[rows], has_label[rows]
                judged, passed = acceptance_counts(hit, has_label)
                counts[0] += judged.to(counts.dtype)
                counts[1] += passed.to(counts.dtype)
        counts = dist.all_sum(counts)
        return ValResult([int(x) for x in counts[0].tolist()], [int(x) for x in counts[1].tolist()], len(self.samples))

    def fill_cache(self, layer_ids: list[int], dist: Dist | None = None) -> int:
        """Stores the features of this rank's held-out samples that the cache lacks (`train --features-only`);
        returns how many were computed."""
        dist = dist or Dist()
        mine = range(dist.rank, len(self.samples), dist.world)
        missing = [i for i in mine if not self.cache.holds(layer_ids, self.samples[i]["input_ids"])]
        for lo in range(0, len(missing), self.batch_size):
            self._features(missing[lo : lo + self.batch_size], layer_ids)
        return len(missing)

    def _features(self, chunk: list[int], layer_ids: list[int]) -> list[torch.Tensor]:
        """The target features of samples `chunk`: from the cache where it holds them, the rest computed in
        one batch (and, with a cache, stored and rounded to its fp16 as every later read will be)."""
        ids = [self.samples[i]["input_ids"] for i in chunk]
        found = [self.cache.read(layer_ids, x) if self.cache else None for x in ids]
        missing = [k for k, got in enumerate(found) if got is None]
        if missing:
            computed, _ = self.target.sequence_features([ids[k] for k in missing], layer_ids)
            for k, f in zip(missing, computed):
                if self.cache:
                    self.cache.write(layer_ids, ids[k], f)
                    f = f.to(torch.float16).to(f.dtype)
                found[k] = (f, None)
        return [got[0] for got in found]


class BestSoFar:
    """The drafter weights with the highest validation tau so far (the earliest on ties).

    Lives in the training checkpoint, so a resumed run keeps it; the trainer exports it.
    """

    def __init__(self):
        self.step: int | None = None
        self.result: ValResult | None = None
        self.state: dict[str, torch.Tensor] | None = None

    def offer(self, step: int, result: ValResult, drafter) -> bool:
        if self.result is not None and result.tau <= self.result.tau:
            return False
        self.step, self.result = step, result
        self.state = {k: v.detach().to("cpu", copy=True) for k, v in drafter.state_dict().items()}
        return True

    def state_dict(self) -> dict | None:
        if self.result is None:
            return None
        return {
            "step": self.step,
            "judged": self.result.judged,
            "passed": self.result.passed,
            "samples": self.result.samples,
            "state": self.state,
        }

    def load_state_dict(self, d: dict | None) -> None:
        if d is None:
            self.__init__()
            return
        self.step, self.state = d["step"], d["state"]
        self.result = ValResult(d["judged"], d["passed"], d["samples"])

    def acceptance(self) -> dict:
        """What acceptance.json holds (drafter/checkpoint.py ACCEPTANCE_NAME; --block-size auto reads "conditional")."""
        r = self.result
        return {
            "conditional": [p or 0.0 for p in r.conditional],
            "tau": r.tau,
            "measured_by": "train validation",
            "step": self.step,
            "blocks": r.blocks,
            "judged": r.judged,
            "samples": r.samples,
            "note": "greedy, teacher-forced at held-out anchors of the training data's answers",
        }
