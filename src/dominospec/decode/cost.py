"""The verify-cost profile: what one target forward over k new tokens costs on this device.

Verifying b drafts is one forward over b+1 tokens after a cached context. How that cost grows
with k decides how many drafts are worth verifying; the benchmark reports it and a verify-length
policy reads it. Measured with the same forward call the decoding loop uses (features on).
"""

from __future__ import annotations

import statistics
import time

import torch

from ..devices import describe_device, synchronize
from ..errors import DominoError


@torch.inference_mode()
def profile_verify_cost(target, context: int = 256, max_k: int = 16, repeats: int = 7, seed: int = 0,
                        progress: bool = True) -> dict:
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
    return {"device": describe_device(dev), "context": context, "k": ks, "seconds": seconds,
            "relative_to_1": [s / seconds[0] for s in seconds], "sps": [1.0 / s for s in seconds],
            "target": getattr(target, "name", "model"), "dtype": str(target.dtype).replace("torch.", ""),
            "repeats": repeats, "statistic": "median",
            # noise only ever adds time: on a shared machine the minimum is the steadier estimate
            "min_seconds": fastest, "min_relative_to_1": [s / fastest[0] for s in fastest]}
