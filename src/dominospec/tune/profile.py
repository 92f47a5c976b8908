"""What decoding costs on this device: the verify-cost profile, the draft cost, the block choice.

Verifying b drafts is one forward over b+1 tokens after a cached context. How that cost grows
with k decides how many drafts are worth verifying. `dominospec profile` measures it (with the
same forward call the decoding loop uses, features on) and stores the table in the cache
directory keyed by a device fingerprint; `--block-size auto` and the benchmark read it.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..decode.result import expected_tokens
from ..decode.rollout import draft_block
from ..decode.schedule import profile_drafter_label
from ..devices import cpu_model, describe_device, synchronize
from ..drafter.checkpoint import ACCEPTANCE_NAME, sidecar_path
from ..drafter.model import DraftCache
from ..errors import DominoError
from ..io import cache_dir, probabilities, read_json_object, write_json_atomic
from ..log import log
from ..sampling import SamplingConfig


@torch.inference_mode()
def profile_verify_cost(
    target, context: int = 256, max_k: int = 16, repeats: int = 7, seed: int = 0, progress: bool = True
) -> dict:
    """Median time of one target forward over k new tokens after a cached context, k = 1..max_k.

    Repeats are interleaved over k so a slow spell on the machine spreads over all sizes instead
    of inflating one.
    """
    from tqdm import tqdm

    if context < 1 or max_k < 1 or repeats < 1:
        raise DominoError(f"profile needs context, max_k and repeats >= 1 (got {context}, {max_k}, {repeats})")
    limit = target.max_positions
    if limit and context + max_k > limit:
        raise DominoError(f"--context {context} + {max_k} tokens exceeds the target's {limit} positions")
    dev = target.device
    gen = torch.Generator().manual_seed(seed)
    ks = list(range(1, max_k + 1))
    ctx = torch.randint(0, target.vocab_size, (1, context), generator=gen).to(dev)
    blocks = {k: torch.randint(0, target.vocab_size, (1, k), generator=gen).to(dev) for k in ks}
    cache = target.new_cache()
    target.forward(ctx, cache, last_logits_only=True, with_features=False)
    for k in ks:  # warm-up, uncounted
        target.forward(blocks[k], cache)
        target.crop_cache(cache, context)
    times: dict[int, list[float]] = {k: [] for k in ks}
    with tqdm(total=repeats * len(ks), desc="profile", unit="fwd", disable=not progress, dynamic_ncols=True) as bar:
        for _ in range(repeats):
            for k in ks:
                synchronize(dev)
                t0 = time.perf_counter()
                target.forward(blocks[k], cache)
                synchronize(dev)
                times[k].append(time.perf_counter() - t0)
                target.crop_cache(cache, context)
                bar.update()
    seconds = [statistics.median(times[k]) for k in ks]
    fastest = [min(times[k]) for k in ks]
    return {
        "device": describe_device(dev),
        "context": context,
        "k": ks,
        "seconds": seconds,
        "relative_to_1": [s / seconds[0] for s in seconds],
        "sps": [1.0 / s for s in seconds],
        # the model by content: `tiny/`, `tiny` and its absolute path share one profile
        "target": getattr(target, "fingerprint", None) or getattr(target, "name", "model"),
        "dtype": precision(target),
        "repeats": repeats,
        "statistic": "median",
        # noise only ever adds time: on a shared machine the minimum is the steadier estimate
        "min_seconds": fastest,
        "min_relative_to_1": [s / fastest[0] for s in fastest],
    }


# ----- the device profile: what the rest of the system reads to size its verify blocks -----


def precision(target) -> str:
    """The target's dtype, or the weight format its forward streams ("int8-weights": Target.run_precision)."""
    return getattr(target, "run_precision", None) or str(target.dtype).replace("torch.", "")


def device_fingerprint(target) -> dict:
    """What a cost table is only valid for: the hardware, threads, torch, the target, its backend and
    precision (a weight format streams other bytes: each has its own profile), and for the native forward on
    the CPU the small-row kernel's build (another kernel source prices verify and decode otherwise)."""
    from ..targets import kernels

    dev = target.device
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model()
    backend = getattr(target, "backend", "hf")
    return {
        "kernel": kernels.active_build() if dev.type == "cpu" and backend == "native" else "off",
        "device": dev.type,
        "hardware": hw,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        # the model by content: `tiny/`, `tiny` and its absolute path share one profile
        "target": getattr(target, "fingerprint", None) or getattr(target, "name", "model"),
        "backend": backend,
        "dtype": precision(target),
    }


def profile_path(fingerprint: dict) -> Path:
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "profiles" / f"{key}.json"


DRAFT_METHOD = "extend-2+draft"  # what a draft-cycle timing covers; profiles timed otherwise are measured again


@torch.inference_mode()
def profile_draft_cost(target, drafter, context: int = 256, repeats: int = 7, seed: int = 0) -> dict:
    """Median time of one draft cycle as decoding pays it, for b = 1..block_size drafts: the drafter's
    cache takes the target features of two committed positions (the anchor and one accepted draft),
    then the backbone pass and the head's rollout. Greedy (`seconds`) and sampled at T=1
    (`seconds_sampled`: the rollout draws from the draft distribution)."""
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, target.vocab_size, (1, context), generator=gen).to(target.device)
    cache = target.new_cache(max_len=context + 1)
    out = target.forward(ctx, cache, last_logits_only=True, layer_ids=drafter.config.target_layer_ids)
    dcache = drafter.new_cache()
    drafter.extend_cache(dcache, out.features[:, :-2])
    committed, base = out.features[:, -2:], dcache.length
    anchor = ctx[0, -1:]
    draw = torch.Generator(device=target.device).manual_seed(seed)
    kinds = {"seconds": SamplingConfig(), "seconds_sampled": SamplingConfig(1.0)}
    bs = list(range(1, drafter.config.block_size + 1))

    def cycle(b: int, sampling: SamplingConfig) -> None:
        dcache.rows.set_length(dcache.slot, base)
        drafter.extend_cache(dcache, committed)
        draft_block(drafter, dcache, anchor, b, sampling, None if sampling.greedy else draw)

    for b in bs:  # warm-up
        for sampling in kinds.values():
            cycle(b, sampling)
    times = {(kind, b): [] for kind in kinds for b in bs}
    for _ in range(repeats):
        for b in bs:
            for kind, sampling in kinds.items():
                synchronize(target.device)
                t0 = time.perf_counter()
                cycle(b, sampling)
                synchronize(target.device)
                times[kind, b].append(time.perf_counter() - t0)
    table = {"context": context, "b": bs, "method": DRAFT_METHOD}
    for kind in kinds:
        table[kind] = [statistics.median(times[kind, b]) for b in bs]
    return table


@torch.inference_mode()
def profile_batch_cost(
    target,
    drafter=None,
    rows: Sequence[int] = (1, 2, 4, 8),
    context: int = 256,
    max_k: int = 8,
    repeats: int = 5,
    seed=0,
) -> dict:
    """SPS(B) for the engine: median seconds of one ragged forward with R rows of k new tokens each
    (B = R * k), R in `rows`, k = 1..max_k, every row after its own `context`-token prefix; and, with a
    drafter, one draft pass for R rows. Repeats are interleaved over (R, k)."""
    from ..decode.rollout import draft_rows

    gen = torch.Generator().manual_seed(seed)
    dev, V = target.device, target.vocab_size
    layers = drafter.config.target_layer_ids if drafter is not None else None
    out = {"context": context, "rows": list(rows), "k": list(range(1, max_k + 1)), "seconds": [], "draft_seconds": []}
    times = {(r, k): [] for r in rows for k in out["k"]}
    caches = {}
    for r in rows:
        cache = target.new_row_cache(r, context + max_k + 1)
        dcache = drafter.new_row_cache(r, context + 1) if drafter is not None else None
        for row in range(r):
            ids = torch.randint(0, V, (1, context), generator=gen).to(dev)
            res = target.forward_rows(
                ids, cache, start=row, logits="none", layer_ids=layers, with_features=dcache is not None
            )
            if dcache is not None:
                drafter.extend_cache(DraftCache(dcache, row), res.features)
        caches[r] = (cache, dcache)
    blocks = {(r, k): torch.randint(0, V, (r, k), generator=gen).to(dev) for r in rows for k in out["k"]}
    for rep in range(repeats + 1):  # the first round is a warm-up
        for r in rows:
            cache = caches[r][0]
            for k in out["k"]:
                synchronize(dev)
                t0 = time.perf_counter()
                target.forward_rows(blocks[r, k], cache, layer_ids=layers, with_features=drafter is not None)
                synchronize(dev)
                if rep:
                    times[r, k].append(time.perf_counter() - t0)
                cache.lengths[:] = [context] * r
    out["seconds"] = [[statistics.median(times[r, k]) for k in out["k"]] for r in rows]
    if drafter is not None:
        greedy, b = SamplingConfig(), drafter.config.block_size
        for r in rows:
            dcache, anchors, draft_times = caches[r][1], torch.zeros(r, dtype=torch.long, device=dev), []
            for rep in range(repeats + 1):
                synchronize(dev)
                t0 = time.perf_counter()
                draft_rows(drafter, dcache, list(range(r)), anchors, [b] * r, [greedy] * r, [None] * r)
                synchronize(dev)
                if rep:
                    draft_times.append(time.perf_counter() - t0)
            out["draft_seconds"].append(statistics.median(draft_times))
    return out


def profile_device(
    target,
    drafter=None,
    contexts: Sequence[int] = (256, 1024),
    max_k: int = 17,
    repeats: int = 7,
    seed: int = 0,
    progress: bool = True,
    batch_rows: Sequence[int] = (),
) -> dict:
    """The device profile: verify cost of k = 1..max_k new tokens at each context (k = 1 is one
    decode step) and, with a drafter, its draft cost per block size. With batch_rows (native backend),
    also the engine's table: forwards over R rows of k new tokens each ("batch")."""
    limit = target.max_positions
    usable = [c for c in contexts if not limit or c + max_k <= limit]
    if not usable:
        raise DominoError(
            f"no context in {list(contexts)} leaves room for {max_k} tokens in the target's {limit} positions"
        )
    table = {
        "fingerprint": device_fingerprint(target),
        "max_k": max_k,
        "repeats": repeats,
        "verify": {str(c): profile_verify_cost(target, c, max_k, repeats, seed, progress) for c in usable},
    }
    if drafter is not None:
        table["draft"] = profile_draft_cost(target, drafter, min(usable), repeats, seed)
        table["draft"]["drafter"] = profile_drafter_label(drafter)
    if batch_rows and target.supports_rows:
        table["batch"] = profile_batch_cost(target, drafter, batch_rows, min(usable), min(max_k, 9), repeats, seed)
        table["batch"]["drafter"] = profile_drafter_label(drafter) if drafter is not None else None
    return table


def save_profile(table: dict) -> Path:
    path = profile_path(table["fingerprint"])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, table, indent=2)
    return path


def _check_timings(path: Path, where: str, sizes, seconds) -> None:
    if not isinstance(sizes, list) or not isinstance(seconds, list) or not sizes or len(sizes) != len(seconds):
        raise DominoError(f"{path}: {where} needs equally long, non-empty size and seconds lists")
    for s in seconds:
        if not isinstance(s, (int, float)) or not math.isfinite(s) or s <= 0:
            raise DominoError(f"{path}: {where} has a timing of {s!r} seconds (each must be a finite number > 0)")


def read_profile(path: Path) -> dict:
    """A stored device profile, checked; a damaged one raises DominoError naming the file and the fault."""
    if path.is_dir():
        raise DominoError(f"{path}: the device profile is a directory, not a JSON file")
    try:
        table = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise DominoError(f"{path}: the device profile is unreadable or truncated ({exc})") from None
    if not isinstance(table, dict) or not isinstance(table.get("verify"), dict) or not table["verify"]:
        raise DominoError(f"{path}: the device profile has no 'verify' table")
    for c, row in table["verify"].items():
        if not str(c).isdigit() or not isinstance(row, dict):
            raise DominoError(f"{path}: verify entry {c!r} is not a context length with a table")
        _check_timings(path, f"verify at context {c}", row.get("k"), row.get("seconds"))
        if row["k"][0] != 1:
            raise DominoError(f"{path}: verify at context {c} must start at k = 1 (one decode step)")
    if "draft" in table:
        d = table["draft"]
        if not isinstance(d, dict):
            raise DominoError(f"{path}: the 'draft' entry is not a table")
        _check_timings(path, "draft", d.get("b"), d.get("seconds"))
    return table


def load_profile(target) -> dict | None:
    """The stored profile for this target on this device, backend, dtype and thread count; None if there is
    none. A damaged file raises DominoError (see read_profile)."""
    path = profile_path(device_fingerprint(target))
    return read_profile(path) if path.exists() else None


def profile_reach(table: dict) -> int:
    """The most new tokens every context of a profile's verify table was timed for."""
    return min(len(row["k"]) for row in table["verify"].values())


QUICK_CONTEXTS = (256, 1024)
QUICK_REPEATS = 3


def ensure_profile(
    target,
    drafter=None,
    max_k: int = 9,
    report=log,
    contexts: Sequence[int] = QUICK_CONTEXTS,
    batch_rows: Sequence[int] = (),
) -> dict:
    """The device profile, measured now (a short one) when none is stored or the stored one is damaged.

    A quick profile covers k = 1..max_k at `contexts` with QUICK_REPEATS repeats (a few seconds)
    and, with a drafter, its draft cost; `dominospec profile` measures the full table. A stored
    profile timed for fewer than max_k new tokens is measured again (a quick one); one that lacks this
    drafter's draft cost gets it added; with batch_rows (the engine), one that lacks the batched table
    (or has it for another drafter) gets a quick one.
    """
    path = profile_path(device_fingerprint(target))
    table = None
    try:
        table = load_profile(target)
    except DominoError as exc:
        report(f"{exc}: measuring it again")
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    limit = target.max_positions
    usable = [c for c in contexts if not limit or c + max_k <= limit] or [max(1, limit - max_k)]
    reach = profile_reach(table) if table is not None else 0
    if table is not None and reach < max_k and (not limit or limit > max_k):
        # a table measured for a smaller block would silently cap every cycle at reach - 1 drafts
        report(
            f"{path}: the stored device profile reaches {reach} new tokens and this run verifies up to {max_k}: "
            f"measuring a quick one to k = {max_k} (`dominospec profile --max-k {max_k}` measures the full table)"
        )
        table = None
    elif table is None:
        report(
            f"no device profile for {target.name} ({getattr(target, 'backend', 'hf')}, {torch.get_num_threads()} "
            "threads) yet: measuring a quick one (a few seconds; `dominospec profile` measures the full table)"
        )
    if table is None:
        table = profile_device(target, drafter, usable, max_k, QUICK_REPEATS, progress=False)
        table["quick"] = True
        save_profile(table)
    elif drafter is not None and (
        table.get("draft", {}).get("drafter") != profile_drafter_label(drafter)
        or table["draft"].get("method") != DRAFT_METHOD
    ):
        usable = sorted(int(c) for c in table["verify"])
        table["draft"] = profile_draft_cost(target, drafter, usable[0], QUICK_REPEATS)
        table["draft"]["drafter"] = profile_drafter_label(drafter)
        save_profile(table)
    label = profile_drafter_label(drafter) if drafter is not None else None
    batch = table.get("batch") or {}
    owner = batch.get("drafter", (table.get("draft") or {}).get("drafter"))  # older tables: the profile's drafter
    stale = not batch or (label is not None and owner != label)  # without a drafter any table's forwards do
    if batch_rows and target.supports_rows and stale:
        report(
            f"measuring the engine's batched cost table for {list(batch_rows)} rows, once for this machine and "
            "thread count (stored; from under a minute on a free core to a few minutes on a busy one; "
            "`dominospec profile --batch-rows` measures the full one)"
        )
        context = min(int(c) for c in table["verify"])
        start = time.perf_counter()
        table["batch"] = profile_batch_cost(target, drafter, batch_rows, context, min(max_k, 9), QUICK_REPEATS)
        table["batch"]["drafter"] = label
        save_profile(table)
        report(f"batched cost table measured in {time.perf_counter() - start:.0f} s and stored in {path}")
    return table


def best_block_size(profile: dict, acceptance: Sequence[float], max_b: int, context: int = 256) -> tuple[int, dict]:
    """The b in 0..max_b that maximises expected tokens per second = tau(b) / (draft(b) + verify(b + 1)).

    b = 0 means plain decoding is faster than any speculation this drafter can offer on this device.
    Uses the profiled context closest to `context`; returns (b, {b: tokens/s}).
    """
    ctxs = sorted(profile["verify"], key=lambda c: abs(int(c) - context))
    verify = dict(zip(profile["verify"][ctxs[0]]["k"], profile["verify"][ctxs[0]]["seconds"]))
    draft = dict(zip(profile["draft"]["b"], profile["draft"]["seconds"])) if "draft" in profile else {}
    rates = {0: 1.0 / verify[1]}  # b = 0: plain decoding, one token per decode step
    for b in range(1, max_b + 1):
        if b + 1 not in verify or (draft and b not in draft) or b > len(acceptance):
            continue
        rates[b] = expected_tokens(acceptance, b) / (draft.get(b, 0.0) + verify[b + 1])
    if len(rates) == 1:
        raise DominoError(
            "the device profile and the drafter's acceptance share no block size; rerun "
            "`dominospec profile` with a larger --max-k"
        )
    return max(rates, key=rates.get), rates


def read_acceptance(path: Path) -> list[float]:
    """The "conditional" list of an acceptance.json: one probability in [0, 1] per block position."""
    data = read_json_object(path, "a drafter's acceptance by position")
    if data.get("conditional") == []:
        raise DominoError(
            f"{path}: 'conditional' is empty: the run that wrote it measured no draft cycle; remove it or "
            "rerun `dominospec bench --save-acceptance` on longer answers"
        )
    return probabilities(data.get("conditional"), f"{path} 'conditional'")


def auto_block_size(target, drafter, context: int = 256) -> tuple[int, str]:
    """--block-size auto: the block size with the most expected tokens/s on this device (0: plain
    decoding wins), and a note saying what it was chosen from (or why the drafter's own is used)."""
    own = drafter.config.block_size
    acc_path = sidecar_path(drafter, ACCEPTANCE_NAME)
    if acc_path is None or not acc_path.exists():
        return (
            own,
            f"--block-size auto: the drafter has no {ACCEPTANCE_NAME} (`train` writes one when it "
            f"validates, `bench --save-acceptance` from a live run); using its block size {own}",
        )
    profile = ensure_profile(target, drafter, max_k=own + 1)
    acceptance = read_acceptance(acc_path)
    b, rates = best_block_size(profile, acceptance, own, context)
    shown = ", ".join(f"{k}: {v:.1f}" for k, v in sorted(rates.items()))
    unmeasured = [k for k in range(1, own + 1) if k not in rates]
    beats = "no measured block size beats it here" if unmeasured else "no block size beats it here"
    chosen = f"plain decoding ({beats})" if b == 0 else str(b)
    note = f"--block-size auto chose {chosen}; expected tokens/s by block size (0 = plain): {shown}"
    if unmeasured:
        note += (
            f"; block sizes {_span(unmeasured)} were not considered (the device profile or the acceptance does not "
            f"cover them: rerun `dominospec profile --max-k {own + 1}`)"
        )
    return b, note


def _span(ks: list[int]) -> str:
    return f"{ks[0]}..{ks[-1]}" if len(ks) > 1 and ks[-1] - ks[0] == len(ks) - 1 else ",".join(map(str, ks))
