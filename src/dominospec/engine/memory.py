"""Whether the engine's preallocated slot caches fit in memory, checked before they are allocated."""

from __future__ import annotations

from ..devices import available_bytes
from ..errors import DominoError

HEADROOM = 0.9  # of the memory available now: activations and the allocator need the rest


def kv_bytes(layers: int, kv_heads: int, head_dim: int, positions: int, dtype) -> int:
    """K and V of `positions` positions over `layers` layers."""
    return 2 * layers * kv_heads * positions * head_dim * dtype.itemsize


def slot_bytes_needed(target, drafter, max_len: int) -> int:
    """What one slot preallocates: the target's cache row, plus the drafter's when it drafts."""
    n = target.row_bytes_per_position * max_len
    if drafter is not None:
        c = drafter.config
        n += kv_bytes(len(drafter.layers), c.num_key_value_heads, c.head_dim, max_len, drafter.dtype)
        if c.fuse_context:  # its context rows, kept for the fused last one
            n += max_len * c.hidden_size * drafter.dtype.itemsize
    return n


def check_slots_fit(target, drafter, max_batch: int, max_len: int) -> None:
    """Refuse, naming what fits, a max_batch x max_len whose caches exceed the memory available now."""
    if not target.supports_rows:
        return  # the transformers backend is refused by new_row_cache, with its own message
    free = available_bytes(target.device)
    if free is None:
        return
    per_slot = slot_bytes_needed(target, drafter, max_len)
    need = max_batch * per_slot
    if need > HEADROOM * free:
        fits = int(HEADROOM * free // per_slot)
        raise DominoError(
            f"max_batch {max_batch} slots of {max_len} positions need {need / 2**30:.1f} GiB of K/V cache "
            f"({per_slot / 2**20:.2f} MiB per slot), but {free / 2**30:.1f} GiB are available on {target.device}: "
            f"at most {fits} slots of {max_len} positions fit (lower --max-batch or --max-len)"
        )
