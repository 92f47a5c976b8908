"""`dominospec profile`: measure decode, verify and draft cost on this device; store the table."""

from __future__ import annotations

from ..bench.report import format_device_profile, plot_device_profile
from ..errors import DominoError
from ..io import cache_dir, ensure_writable_dir, write_json_atomic
from ..log import log
from ..tune.profile import profile_device, save_profile
from .common import add_target_args, resolve_drafter, target_from_args

DEFAULT_CONTEXTS = "256,1024"


def cmd_profile(args) -> int:
    given = args.contexts is not None
    try:
        contexts = [int(c) for c in (args.contexts if given else DEFAULT_CONTEXTS).split(",") if c.strip()]
    except ValueError:
        raise DominoError(f"--contexts {args.contexts!r}: expected comma-separated integers, e.g. 256,1024") from None
    for name, v in (("--max-k", args.max_k), ("--repeats", args.repeats), ("--contexts", min(contexts or [0]))):
        if v < 1:
            raise DominoError(f"{name} must be >= 1, got {v}")
    try:
        batch_rows = [int(r) for r in args.batch_rows.split(",") if r.strip()]
    except ValueError:
        raise DominoError(f"--batch-rows {args.batch_rows!r}: expected comma-separated integers, e.g. 1,4") from None
    if any(r < 1 for r in batch_rows):
        raise DominoError(f"--batch-rows {args.batch_rows!r}: row counts must be >= 1")
    out = ensure_writable_dir(args.out) if args.out else None
    ensure_writable_dir(cache_dir() / "profiles", "the profile cache (DOMINOSPEC_CACHE)")
    target = target_from_args(args)
    limit = target.max_positions
    too_long = [c for c in contexts if limit and c + args.max_k > limit]
    if too_long and not given and limit - args.max_k >= 1:  # the defaults follow the target's context
        fit = limit - args.max_k
        contexts = sorted({min(c, fit) for c in contexts})
        log(
            f"note: the default contexts {DEFAULT_CONTEXTS} clipped to {','.join(map(str, contexts))}: the target's "
            f"context of {limit} positions must hold --max-k {args.max_k} new tokens after them"
        )
    elif too_long:
        raise DominoError(
            f"--contexts {','.join(map(str, too_long))}: the target's context of {limit} positions leaves no room "
            f"for --max-k {args.max_k} new tokens after it (contexts of at most {limit - args.max_k} fit)"
        )
    drafter = resolve_drafter(target, args.drafter, args.no_draft)
    log(
        f"profiling {target.name} ({target.backend}, {target.run_precision}): verify of "
        f"1..{args.max_k} tokens at contexts {contexts}"
        + (", and the drafter's cost per block size" if drafter else "")
    )
    table = profile_device(target, drafter, contexts, args.max_k, args.repeats, args.seed, batch_rows=batch_rows)
    path = save_profile(table)
    print(format_device_profile(table))
    log(f"stored {path} (read by --block-size auto)")
    if out is not None:
        write_json_atomic(out / "profile.json", table, indent=2)
        if plot_device_profile(table, out / "profile.png"):
            log(f"wrote {out / 'profile.json'} and {out / 'profile.png'}")
        else:
            log(f"wrote {out / 'profile.json'} (matplotlib is not installed: no plot)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "profile",
        help="measure decode / verify / draft cost on this device",
        description="Measure one decode step, one verify of k = 1..K new tokens at a few context "
        "lengths and (with a drafter) the draft cost per block size, for this device, "
        "backend, precision (--dtype) and thread count. The table is stored in the cache directory, "
        "keyed by that fingerprint; `--block-size auto` reads it.",
    )
    add_target_args(p)
    p.add_argument("--drafter", help="drafter directory (default: the one shipped for the bundled target)")
    p.add_argument("--no-draft", action="store_true", help="profile the target only")
    p.add_argument(
        "--contexts",
        default=None,
        help=f"context lengths (default {DEFAULT_CONTEXTS}, clipped to what the target's context holds)",
    )
    p.add_argument("--max-k", type=int, default=17, help="largest number of new tokens (default %(default)s)")
    p.add_argument(
        "--repeats", type=int, default=7, help="timed repeats per size; medians are kept (default %(default)s)"
    )
    p.add_argument(
        "--batch-rows",
        default="1,2,4,8",
        help="row counts for the engine's batched cost table (R rows of k new tokens; native backend); "
        "empty to skip (default %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write profile.json and profile.png here")
    p.set_defaults(func=cmd_profile)
