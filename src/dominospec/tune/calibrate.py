"""Calibrating the confidence head: live records and Sequential Temperature Scaling (STS).

Records: the drafter runs against the target on held-out prompts with every draft verified; each
cycle leaves the confidence logits of its b slots and how many drafts were accepted. Position k's
event is "drafts 1..k all survived" (accepted >= k), predicted by the survival product
a_k = prod_{i<=k} sigmoid(logit_i / T_i), which is what the cost policy sums.

STS: for k = 1..B in order, T_k is the grid value that minimises the expected calibration error of
a_k with T_1..T_{k-1} already fixed. One positive scale per position keeps each slot's ranking.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..decode.single import generate_speculative
from ..drafter.checkpoint import CALIBRATION_NAME
from ..errors import DominoError
from ..io import read_json_object, write_json_atomic
from ..sampling import SamplingConfig

ECE_BINS = 15
TEMPERATURE_GRID = (0.05, 20.0, 241)  # geometric grid: lowest, highest, points


@dataclass
class ConfidenceRecords:
    logits: torch.Tensor  # [N, B] float64 confidence logits per cycle and slot; NaN where not drafted
    accepted: torch.Tensor  # [N] drafts accepted in the cycle

    def __len__(self) -> int:
        return int(self.accepted.shape[0])


@torch.inference_mode()
def collect_records(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 128,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    progress: bool = True,
) -> ConfidenceRecords:
    """Generate from every prompt with the full block verified and keep (logits, accepted) per cycle."""
    from tqdm import tqdm

    if getattr(drafter, "confidence", None) is None:
        raise DominoError(
            "the drafter has no confidence head: there is nothing to calibrate (make one with "
            "--confidence-head, then train it)"
        )
    if not prompts:
        raise DominoError("no prompts to calibrate on")
    b = drafter.config.block_size
    rows: list[list[float]] = []
    accepted: list[int] = []

    def record(proposal, verified, n):
        if verified == len(proposal):  # only cycles whose every draft was judged
            rows.append(proposal.confidence_logits.double().tolist() + [math.nan] * (b - verified))
            accepted.append(n)

    for i, ids in enumerate(tqdm(prompts, desc="calibrate", unit="prompt", disable=not progress, dynamic_ncols=True)):
        generate_speculative(target, drafter, ids, max_new_tokens, sampling, seed + i, on_cycle=record)
    if not rows:
        raise DominoError("the prompts gave no draft cycles to calibrate on (answers too short?)")
    return ConfidenceRecords(torch.tensor(rows, dtype=torch.float64), torch.tensor(accepted))


# ----- metrics -----


def reliability_bins(probs: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS) -> list[dict]:
    """Equal-width bins over [0, 1]: mean prediction, observed frequency and count of the non-empty ones."""
    idx = (probs * bins).long().clamp(0, bins - 1)
    out = []
    for j in range(bins):
        sel = idx == j
        n = int(sel.sum())
        if n:
            out.append(
                {
                    "bin": j,
                    "predicted": float(probs[sel].mean()),
                    "observed": float(labels[sel].double().mean()),
                    "count": n,
                }
            )
    return out


def expected_calibration_error(probs: torch.Tensor, labels: torch.Tensor, bins: int = ECE_BINS) -> torch.Tensor:
    """ECE of predictions [..., N] against 0/1 labels [N] (leading dims: several candidate predictions)."""
    idx = (probs * bins).long().clamp(0, bins - 1)  # [..., N]
    one_hot = torch.nn.functional.one_hot(idx, bins).to(probs.dtype)  # [..., N, bins]
    gap = (one_hot * (probs - labels.to(probs.dtype)).unsqueeze(-1)).sum(-2)  # [..., bins]: sum of p - y
    return gap.abs().sum(-1) / probs.shape[-1]


def auroc(scores: torch.Tensor, labels: torch.Tensor) -> float | None:
    """Area under the ROC curve (Mann-Whitney, ties averaged); None when only one class occurs."""
    labels = labels.bool()
    pos, neg = int(labels.sum()), int((~labels).sum())
    if not pos or not neg:
        return None
    order = scores.argsort()
    _, inverse, counts = torch.unique_consecutive(scores[order], return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    mean_rank = (ends - counts + 1 + ends) / 2  # 1-based ranks of a tied run, averaged
    ranks = torch.empty_like(scores, dtype=torch.float64)
    ranks[order] = mean_rank[inverse]
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def survival(logits: torch.Tensor, temperatures: Sequence[float]) -> torch.Tensor:
    """a_k = prod_{i<=k} sigmoid(logit_i / T_i): [N, B] -> [N, B] (NaN stays NaN)."""
    t = torch.tensor(list(temperatures), dtype=logits.dtype)
    return torch.cumprod(torch.sigmoid(logits / t), dim=1)


# ----- the fit -----


def fit_sts(
    records: ConfidenceRecords, grid: tuple[float, float, int] = TEMPERATURE_GRID, bins: int = ECE_BINS
) -> dict:
    """Sequential Temperature Scaling; returns temperatures and ECE / AUROC / reliability per position."""
    logits, accepted = records.logits, records.accepted
    positions = logits.shape[1]
    lo, hi, points = grid
    temps_grid = torch.logspace(math.log10(lo), math.log10(hi), points, dtype=torch.float64)  # [G]
    temps = [1.0] * positions
    prefix = torch.ones(logits.shape[0], dtype=torch.float64)  # prod_{i<k} sigmoid(logit_i / T_i)
    out = {
        "temperatures": temps,
        "samples": [],
        "survived": [],
        "ece_before": [],
        "ece_after": [],
        "auroc_before": [],
        "auroc_after": [],
        "reliability_before": [],
        "reliability_after": [],
    }
    raw = survival(logits, [1.0] * positions)
    for k in range(positions):
        seen = ~torch.isnan(logits[:, k])
        labels = (accepted[seen] >= k + 1).double()
        out["samples"].append(int(seen.sum()))
        out["survived"].append(int(labels.sum()))
        if not seen.any():
            for key in ("ece_before", "ece_after", "auroc_before", "auroc_after"):
                out[key].append(None)
            out["reliability_before"].append([])
            out["reliability_after"].append([])
            continue
        candidates = prefix[seen] * torch.sigmoid(logits[seen, k] / temps_grid[:, None])  # [G, N_k]
        ece = expected_calibration_error(candidates, labels, bins)  # [G]
        best = ece.min()
        # among (numerically) equal errors keep the temperature closest to 1: no scaling without evidence
        ties = (ece <= best + 1e-12).nonzero().squeeze(-1)
        pick = int(ties[(temps_grid[ties].log()).abs().argmin()])
        temps[k] = float(temps_grid[pick])
        after = candidates[pick]
        prefix[seen] = after
        before = raw[seen, k]
        out["ece_before"].append(float(expected_calibration_error(before, labels, bins)))
        out["ece_after"].append(float(ece[pick]))
        out["auroc_before"].append(auroc(before, labels))
        out["auroc_after"].append(auroc(after, labels))
        out["reliability_before"].append(reliability_bins(before, labels, bins))
        out["reliability_after"].append(reliability_bins(after, labels, bins))
    out.update(cycles=len(records), bins=bins, grid={"lowest": lo, "highest": hi, "points": points})
    return out


def calibrate(
    target,
    drafter,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int = 128,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Records from live rollouts, then the STS fit; the dict that calibration.json holds."""
    records = collect_records(target, drafter, prompts, max_new_tokens, sampling, seed, progress)
    result = fit_sts(records)
    result.update(
        measured_by="dominospec calibrate",
        target=getattr(target, "name", "model"),
        prompts=len(prompts),
        prompts_fingerprint=prompts_fingerprint(prompts),
        max_new_tokens=max_new_tokens,
        sampling_temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=seed,
        block_size=drafter.config.block_size,
    )
    return result


def prompts_fingerprint(prompts: Sequence[Sequence[int]]) -> str:
    """sha256 of the token-id prompts (chat template applied): equal exactly when the same prompts ran."""
    return hashlib.sha256(json.dumps([list(map(int, p)) for p in prompts]).encode()).hexdigest()


def overall_ece(result: dict) -> tuple[float | None, float | None]:
    """(raw, calibrated) ECE of the survival products over all positions, weighted by their cycles."""
    pairs = [
        (n, before, after)
        for n, before, after in zip(result["samples"], result["ece_before"], result["ece_after"])
        if n and before is not None and after is not None
    ]
    total = sum(n for n, _, _ in pairs)
    if not total:
        return None, None
    return sum(n * b for n, b, _ in pairs) / total, sum(n * a for n, _, a in pairs) / total


def previous_cycles(directory) -> int | None:
    """How many cycles the calibration already next to a drafter rests on (None: none there, or unreadable)."""
    path = Path(directory) / CALIBRATION_NAME
    if not path.exists():
        return None
    try:
        cycles = read_json_object(path).get("cycles")
    except DominoError:
        return None  # a damaged file protects nothing
    return cycles if isinstance(cycles, int) and not isinstance(cycles, bool) else None


def write_calibration(directory, result: dict) -> Path:
    """DIR/calibration.json, written atomically; what `--verify static|cost` reads."""
    path = Path(directory) / CALIBRATION_NAME
    write_json_atomic(path, result, indent=1)
    return path


def format_calibration(result: dict) -> str:
    """Per position: samples, survivals, T_k, ECE and AUROC of the survival product before / after."""

    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"

    def num(x):
        return "-" if x is None else f"{x:.3f}"

    lines = [
        "| k | cycles | all 1..k survived | T_k | ECE raw | ECE calibrated | AUROC raw | AUROC calibrated |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for k in range(len(result["temperatures"])):
        lines.append(
            f"| {k + 1} | {result['samples'][k]} | {result['survived'][k]} | {result['temperatures'][k]:.3g} | "
            f"{pct(result['ece_before'][k])} | {pct(result['ece_after'][k])} | "
            f"{num(result['auroc_before'][k])} | {num(result['auroc_after'][k])} |"
        )
    return "\n".join(lines)
