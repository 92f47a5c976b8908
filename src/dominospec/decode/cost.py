"""What decoding costs on this device: the verify-cost profile, the draft cost, the block choice.

Verifying b drafts is one forward over b+1 tokens after a cached context. How that cost grows
with k decides how many drafts are worth verifying. `dominospec profile` measures it (with the
same forward call the decoding loop uses, features on) and stores the table in the cache
directory keyed by a device fingerprint; `--block-size auto` and the benchmark read it.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..devices import cpu_model, describe_device, synchronize
from ..drafter.checkpoint import ACCEPTANCE_NAME, sidecar_path
from ..errors import DominoError
from ..io import cache_dir, probabilities, read_json_object, write_json_atomic
from ..sampling import SamplingConfig
from .propose import draft_block


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
        "dtype": str(target.dtype).replace("torch.", ""),
        "repeats": repeats,
        "statistic": "median",
        # noise only ever adds time: on a shared machine the minimum is the steadier estimate
        "min_seconds": fastest,
        "min_relative_to_1": [s / fastest[0] for s in fastest],
    }


# ----- the device profile: what the rest of the system reads to size its verify blocks -----


def device_fingerprint(target) -> dict:
    """What a cost table is only valid for: the hardware, threads, torch, the target and its backend."""
    dev = target.device
    hw = torch.cuda.get_device_name(dev) if dev.type == "cuda" else cpu_model()
    return {
        "device": dev.type,
        "hardware": hw,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        # the model by content: `tiny/`, `tiny` and its absolute path share one profile
        "target": getattr(target, "fingerprint", None) or getattr(target, "name", "model"),
        "backend": getattr(target, "backend", "hf"),
        "dtype": str(target.dtype).replace("torch.", ""),
    }


def profile_path(fingerprint: dict) -> Path:
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "profiles" / f"{key}.json"


@torch.inference_mode()
def profile_draft_cost(target, drafter, context: int = 256, repeats: int = 7, seed: int = 0) -> dict:
    """Median time of one draft cycle (backbone pass + head rollout) for b = 1..block_size drafts."""
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, target.vocab_size, (1, context), generator=gen).to(target.device)
    cache = target.new_cache(max_len=context + 1)
    out = target.forward(ctx, cache, last_logits_only=True, layer_ids=drafter.config.target_layer_ids)
    dcache = drafter.new_cache()
    drafter.extend_cache(dcache, out.features)
    anchor = ctx[0, -1:]
    greedy = SamplingConfig()
    bs = list(range(1, drafter.config.block_size + 1))
    for b in bs:  # warm-up
        draft_block(drafter, dcache, anchor, b, greedy, None)
    times: dict[int, list[float]] = {b: [] for b in bs}
    for _ in range(repeats):
        for b in bs:
            synchronize(target.device)
            t0 = time.perf_counter()
            draft_block(drafter, dcache, anchor, b, greedy, None)
            synchronize(target.device)
            times[b].append(time.perf_counter() - t0)
    return {"context": context, "b": bs, "seconds": [statistics.median(times[b]) for b in bs]}


def profile_device(
    target,
    drafter=None,
    contexts: Sequence[int] = (256, 1024),
    max_k: int = 17,
    repeats: int = 7,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """The device profile: verify cost of k = 1..max_k new tokens at each context (k = 1 is one
    decode step) and, with a drafter, its draft cost per block size."""
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
    return table


def profile_drafter_label(drafter) -> str:
    """How a device profile names the drafter whose draft cost it measured."""
    c = drafter.config
    return c.target_name + f"/{c.head}-{c.num_layers}L"


def save_profile(table: dict) -> Path:
    path = profile_path(table["fingerprint"])
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, table, indent=2)
    return path


def load_profile(target) -> dict | None:
    """The stored profile for this target on this device, backend, dtype and thread count, if any."""
    path = profile_path(device_fingerprint(target))
    return json.loads(path.read_text()) if path.exists() else None


def expected_tokens(acceptance: Sequence[float], b: int) -> float:
    """tau for b drafts: 1 + sum_k prod_{i<=k} p_i, with p_i the conditional acceptance at position i."""
    tau, survive = 1.0, 1.0
    for p in list(acceptance)[:b]:
        survive *= p
        tau += survive
    return tau


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
    profile = load_profile(target)
    if profile is None:
        return own, (
            "--block-size auto: no device profile for this target, backend, dtype and thread count "
            f"(run `dominospec profile`); using the drafter's block size {own}"
        )
    acceptance = read_acceptance(acc_path)
    b, rates = best_block_size(profile, acceptance, own, context)
    shown = ", ".join(f"{k}: {v:.1f}" for k, v in sorted(rates.items()))
    chosen = "plain decoding (no block size beats it here)" if b == 0 else str(b)
    return b, f"--block-size auto chose {chosen}; expected tokens/s by block size (0 = plain): {shown}"
