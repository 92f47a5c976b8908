"""The verify-length policy for a run, built from what this device and this drafter measured.

make_policy is the one factory (batch 1 and the engine): the mode from decode/schedule.py's
VERIFY_MODES, the STS temperatures from the drafter's calibration.json, its measured acceptance
(acceptance.json) as the cost policy's prior, and the device profile (profile.py, measured on first
use) as its cost table.
"""

from __future__ import annotations

from ..decode.lookup import LOOKUP_BLOCK_SIZE
from ..decode.schedule import (
    DEFAULT_THRESHOLD,
    ENGINE_PROFILE_ROWS,
    BatchCostTable,
    CostPolicy,
    CostTable,
    StaticPolicy,
    VerifyPolicy,
    check_threshold,
    check_verify_mode,
)
from ..drafter.checkpoint import ACCEPTANCE_NAME, CALIBRATION_NAME, sidecar_path
from ..errors import DominoError
from ..io import positive_numbers, read_json_object
from ..log import log_once
from .profile import ensure_profile, read_acceptance


def load_calibration(drafter) -> tuple[list[float] | None, str]:
    """(STS temperatures, a note) from calibration.json next to the drafter; (None, why) when absent."""
    path = sidecar_path(drafter, CALIBRATION_NAME)
    if path is None or not path.exists():
        where = f"in {path.parent}" if path is not None else "for a drafter built in memory"
        return None, (
            f"no {CALIBRATION_NAME} {where}: raw confidences are used (temperatures 1); "
            "run `dominospec calibrate` to calibrate them"
        )
    data = read_json_object(path, "a calibration file")
    temps = positive_numbers(data.get("temperatures"), f"{path} 'temperatures'")
    if len(temps) < drafter.config.block_size:
        need = drafter.config.block_size
        raise DominoError(f"{path}: needs {need} temperatures (one per block position), got {len(temps)}")
    return temps, f"STS temperatures from {path}"


def acceptance_prior(drafter) -> list[float] | None:
    """The drafter's measured acceptance by position (acceptance.json), where it has one: what the
    cost policy's running estimate starts from (else 0.5 at every position)."""
    path = sidecar_path(drafter, ACCEPTANCE_NAME) if drafter is not None else None
    return read_acceptance(path) if path is not None and path.exists() else None


def make_policy(
    mode: str,
    drafter=None,
    target=None,
    *,
    threshold: float = DEFAULT_THRESHOLD,
    costs: CostTable | BatchCostTable | None = None,
    block_size: int | None = None,
    lookup: bool = False,
    rows: int | None = None,
    report=log_once,
) -> VerifyPolicy:
    """The verify-length policy for `mode` (VERIFY_MODES), at batch 1 (rows None) or for an engine of
    `rows` slots.

    static reads confidences: the drafter's confidence head (a drafter without one is refused) or, for
    prompt lookup alone (drafter None, lookup True), the lookup's running acceptance. cost reads them
    too, else the draft's own top probability. cost also needs this device's cost table (`costs`, or
    the stored profile of `target`, measured now when missing; the engine's has batched rows). Without
    calibration.json the raw confidences are used, and `report` says so (once per process by default).
    """
    check_verify_mode(mode)
    check_threshold(threshold)
    if mode == "fixed":
        return VerifyPolicy()
    if drafter is None and not lookup:
        raise DominoError(
            f"--verify {mode} schedules drafts, and this run has no drafter and no prompt lookup; use "
            "--verify fixed with a drafter, or prompt lookup"
        )
    if mode == "static" and drafter is not None and getattr(drafter, "confidence", None) is None:
        raise DominoError(
            "--verify static reads the drafter's confidence head, and this run has a drafter without a confidence "
            "head; use --verify fixed or cost, or a drafter made with --confidence-head"
        )
    temps, note = None, "prompt lookup: running acceptance by position"
    if drafter is not None and getattr(drafter, "confidence", None) is not None:
        temps, note = load_calibration(drafter)
        if temps is None:
            report(note)
    elif drafter is not None:
        note = "no confidence head: the draft's own top probability by slot"
    if mode == "static":
        return StaticPolicy(temps, note, threshold=threshold)
    b = block_size or (drafter.config.block_size if drafter is not None else LOOKUP_BLOCK_SIZE)
    if costs is None:
        costs = measured_costs(target, drafter, b, rows, report)
    if rows is not None and isinstance(costs, CostTable):
        costs = BatchCostTable.from_single(costs)
    return CostPolicy(temps, note, costs=costs, block_size=b, prior=acceptance_prior(drafter))


def measured_costs(target, drafter, block_size: int, rows: int | None, report) -> CostTable | BatchCostTable:
    """This device's cost table from the stored profile of `target` (measured now when missing): the
    batch-1 table, or for an engine (rows given) the batched one."""
    if target is None:
        raise DominoError("--verify cost needs the target, to read or measure this device's cost table")
    batch_rows = ENGINE_PROFILE_ROWS if rows is not None else ()
    profile = ensure_profile(target, drafter, max_k=block_size + 1, report=report, batch_rows=batch_rows)
    single = CostTable.from_profile(profile, drafter, block_size)
    if rows is not None:
        costs = BatchCostTable.from_profile(profile) or BatchCostTable.from_single(single)
        if drafter is None:  # prompt lookup alone: no draft pass to pay for
            costs.draft_s = {}
        return costs
    widest = max(len(v) for v in single.verify_s.values())
    if widest < block_size + 1:
        report(
            f"--verify cost: the device profile reaches {widest} new tokens, so at most {widest - 1} drafts "
            f"are verified per cycle (rerun `dominospec profile --max-k {block_size + 1}`)"
        )
    return single
