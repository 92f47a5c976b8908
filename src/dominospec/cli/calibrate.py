"""`dominospec calibrate`: fit the confidence head's STS temperatures on held-out prompts."""

from __future__ import annotations

from pathlib import Path

from ..bench.report import plot_reliability
from ..bench.runner import load_prompt_sets
from ..data.prompts import check_prompt_file
from ..decode.calibrate import calibrate, format_calibration, write_calibration
from ..drafter import Drafter
from ..errors import DominoError
from ..io import ensure_writable_dir
from ..log import log
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
    path = write_calibration(out, result)
    print(format_calibration(result))
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
        "fingerprint) and calibration.png next to the drafter.",
    )
    p.add_argument("--drafter", required=True, metavar="DIR", help="drafter directory with a confidence head")
    p.add_argument(
        "--prompts",
        action="append",
        default=[],
        metavar="FILE.jsonl",
        help="held-out prompt file (repeatable); the first user turn of each conversation is used",
    )
    add_target_args(p)
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts of each file")
    p.add_argument("--max-new-tokens", type=int, default=128, help="per prompt (default %(default)s)")
    add_sampling_args(p)
    p.add_argument("--no-plots", action="store_true", help="do not draw calibration.png")
    p.set_defaults(func=cmd_calibrate)
