"""`dominospec export`: a drafter as SGLang, vLLM, speculators or SpecForge load it."""

from __future__ import annotations

import json
from pathlib import Path

from ..drafter import Drafter, shipped_drafter_dir
from ..errors import DominoError
from ..export import FORMATS, export_drafter, plan_export
from ..export.convert import DTYPES, check_out
from ..log import log
from ..targets import Target


def cmd_export(args) -> int:
    src = Path(args.drafter)
    if not src.is_dir() and shipped_drafter_dir(args.drafter).is_dir():
        src = shipped_drafter_dir(args.drafter)  # the drafter shipped for a bundled target, by its alias
    check_out(args.out, src)  # refuse before anything loads
    drafter = Drafter.from_pretrained(src)
    plan_export(drafter.config, args.to, args.mask_token_id, args.allow_approx)  # refuse before the target loads
    name = args.target or drafter.config.target_name
    if not name:
        raise DominoError(f"{src} does not name its target; pass --target")
    target = Target.load(name, device="cpu", dtype="float32", progress=log)
    drafter.attach(target)
    report = export_drafter(
        drafter, args.to, args.out, target, args.mask_token_id, args.dtype, args.allow_approx, source=src
    )
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    log(f"wrote {args.out}: {args.to} {report['architecture']} ({report['dtype']}), {report['status']}")
    for line in report["approximations"]:
        log(f"warning: {line}")
    for line in report["notes"]:
        log(f"note: {line}")
    if report["serve_command"]:
        print(report["serve_command"])
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "export",
        help="convert a drafter for SGLang, vLLM, speculators or SpecForge",
        description="Write DRAFTER in the format a serving engine loads (config.json, model.safetensors, "
        "export_report.json), refusing what the engine cannot run as trained, and print the serve command.",
    )
    p.add_argument(
        "drafter", metavar="DRAFTER", help="drafter directory, or a bundled target's alias (its shipped drafter)"
    )
    p.add_argument("--to", required=True, choices=FORMATS, help="the engine's format")
    p.add_argument(
        "--out",
        required=True,
        help="output directory: new or empty, or one an earlier export wrote (only the files its "
        "export_report.json lists are replaced; anything else there is left alone)",
    )
    p.add_argument("--target", default=None, help="the target (default: the one named in the drafter's config)")
    p.add_argument(
        "--mask-token-id",
        type=int,
        default=None,
        help="a real token id for a drafter trained with a learned mask vector (see docs/export.md)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(DTYPES),
        help="weight dtype (default: bf16 for SGLang Domino, else the drafter's)",
    )
    p.add_argument(
        "--allow-approx",
        action="store_true",
        help="write exports that differ from the drafter (a draft vocabulary widened for SGLang; SpecForge DSpark)",
    )
    p.add_argument("--json", action="store_true", help="print export_report.json instead of the serve command")
    p.set_defaults(func=cmd_export)
