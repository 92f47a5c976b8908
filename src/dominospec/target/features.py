"""Which target layers feed the drafter: the published spacing rule and its validation.

Layer j means the output of decoder layer j (before the final norm); in transformers' outputs
that is hidden_states[j + 1], because index 0 holds the embeddings. The last decoder layer is
never used: transformers replaces its entry with the post-final-norm state.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import DominoError


def default_layer_ids(num_layers: int, count: int = 5) -> list[int]:
    """Evenly spaced feature layers from 1 to L-3 (the published rule; [1,9,17,25,33] for L=36).

    Shallow models get fewer, distinct layers.
    """
    if num_layers < 2:
        raise DominoError(f"a target needs at least 2 decoder layers for context features, got {num_layers}")
    if num_layers < 5:
        return list(range(0, num_layers - 1))[:count]
    n = max(1, min(count, num_layers - 3))
    if n == 1:
        return [(num_layers - 2) // 2]
    ids = [round(1 + i * (num_layers - 4) / (n - 1)) for i in range(n)]
    return sorted(set(ids))


def check_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise DominoError("target_layer_ids is empty; give at least one decoder layer index")
    bad = [i for i in ids if not 0 <= i <= num_layers - 2]
    if bad:
        raise DominoError(
            f"target_layer_ids {ids}: {bad} out of range for a target with {num_layers} decoder layers "
            f"(valid: 0..{num_layers - 2}; the last layer's hidden state is post-norm and cannot be used)"
        )
    if len(set(ids)) != len(ids):
        raise DominoError(f"target_layer_ids {ids} has duplicates")
    return ids


def parse_layer_ids(text: str, num_layers: int) -> list[int]:
    """--layer-ids "1,8,14" -> [1, 8, 14], checked against the target."""
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise DominoError(f"--layer-ids {text!r}: expected comma-separated integers, e.g. 1,8,14") from None
    return check_layer_ids(ids, num_layers)
