"""`dominospec calibrate`: fit the confidence head's STS temperatures on held-out prompts."""

from __future__ import annotations

from pathlib import Path

from ..bench.report import plot_reliability
from ..bench.runner import load_prompt_sets
from ..data.prompts import check_prompt_file
from ..drafter import Drafter
from ..drafter.checkpoint import CALIBRATION_NAME, is_shipped
from ..errors import DominoError
from ..io import ensure_writable_dir
from ..log import log
from ..tune.calibrate import calibrate, format_calibration, overall_ece, previous_cycles, write_calibration
from .common import add_sampling_args, add_target_args, require_at_least, sampling_from_args, target_from_args


def cmd_calibrate(args) -> int:
    # arguments, prompt files and the drafter directory first: nothing loads before they are sound
    require_at_least(args, 1, "max_new_tokens", "limit")
    if not args.prompts:
        raise DominoError("give --prompts FILE.jsonl (prompts the drafter was not trained on)")
    for p in args.prompts:
        check_prompt_file(p)
    sampling = sampling_from_args(args)
    if not Path(args.drafter).is_dir():
        raise DominoError(f"--drafter {args.drafter} is not a directory (a drafter made by `dominospec init/train`)")
    if is_shipped(args.drafter) and not args.into_package:
        raise DominoError(
            f"--drafter {args.drafter} is the shipped drafter inside the installed package; copy it "
            f"(cp -r {args.drafter} my-drafter) and calibrate the copy, or pass --into-package"
        )
    out = ensure_writable_dir(args.drafter, "--drafter")
    target = target_from_args(args)
    drafter = Drafter.from_pretrained(args.drafter, target=target)
    if drafter.confidence is None:
        raise DominoError(
            f"--drafter {args.drafter} has no confidence head: nothing to calibrate (make it with "
            "`dominospec init/train --confidence-head`)"
        )
    datasets = load_prompt_sets(args.prompts, target, args.limit, report=log)
    prompts = [ids for ps in datasets.values() for ids in ps]
    log(
        f"calibrating on {len(prompts)} prompts, {args.max_new_tokens} new tokens each, "
        f"T={sampling.temperature}, every draft verified"
    )
    result = calibrate(target, drafter, prompts, args.max_new_tokens, sampling, args.seed)
    result["prompt_files"] = [str(p) for p in args.prompts]
    print(format_calibration(result))
    raw, calibrated = overall_ece(result)
    if raw is not None:
        log(
            f"ECE over all positions (weighted by cycles): raw {100 * raw:.1f}%, calibrated {100 * calibrated:.1f}%"
            + (" (worse than raw: too few cycles to fit?)" if calibrated > raw else "")
        )
    before = previous_cycles(out)
    if before is not None and result["cycles"] < before and not args.force:
        log(
            f"kept {out / CALIBRATION_NAME}: it rests on {before} cycles, this fit on only {result['cycles']} "
            "(more prompts or --max-new-tokens give more; --force replaces it anyway)"
        )
        return 0
    path = write_calibration(out, result)
    log(f"wrote {path} (read by --verify static|cost)")
    if not args.no_plots:
        if plot_reliability(result, out / "calibration.png"):
            log(f"wrote {out / 'calibration.png'}")
        else:
            log("matplotlib is not installed: no reliability plot (pip install matplotlib)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="calibrate a drafter's confidence head (Sequential Temperature Scaling)",
        description="Run the drafter against the target on prompts it was not trained on, with every draft "
        "verified; record each slot's confidence logit and whether the drafts up to it survived; fit "
        "one temperature per block position (STS) so the survival products are calibrated. Writes "
        "calibration.json (temperatures, ECE and AUROC per position before and after, the prompts' "
        "fingerprint) and calibration.png next to the drafter. An existing calibration.json that rests on "
        "more cycles than the new fit is kept unless --force.",
    )
    p.add_argument("--drafter", required=True, metavar="DIR", help="drafter directory with a confidence head")
    p.add_argument(
        "--prompts",
        action="extend",
        nargs="+",
        default=[],
        metavar="FILE.jsonl",
        help="held-out prompt file(s), one or more after the flag and the flag repeatable; the first user turn of "
        "each conversation is used",
    )
    add_target_args(p)
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts of each file")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per prompt (default %(default)s)")
    add_sampling_args(p)
    p.add_argument("--no-plots", action="store_true", help="do not draw calibration.png")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing calibration.json even when it rests on more cycles than this fit",
    )
    p.add_argument(
        "--into-package",
        action="store_true",
        help="allow calibrating the shipped drafter inside the installed package (refused by default)",
    )
    p.set_defaults(func=cmd_calibrate)
