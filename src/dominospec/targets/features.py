"""Which target layers feed the drafter: the published spacing rule and its validation.

Layer j means the output of decoder layer j (before the final norm); in transformers' outputs
that is hidden_states[j + 1], because index 0 holds the embeddings. The last decoder layer is
never used: transformers replaces its entry with the post-final-norm state.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import torch

from ..errors import DominoError
from ..io import atomic_path
from ..log import log_once


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


class FeatureCache:
    """Target features of whole sequences, one fp16 safetensors file per sequence, in a directory.

    A file holds "features" [S, n*H] (the feature layers side by side, as `sequence_features` gives
    them) and, where it was stored, "final" [S, H] (the post-norm final hidden state the LM head reads).
    Files are keyed by content: the target (its weights' fingerprint, dtype and weight format), the layers and the
    token ids, so another target, layer choice or sample never reads another's rows, and the trainer
    and prepare-data (which fills the cache while generating) share one directory. Writes are atomic
    with pid-named temporaries: processes may share a cache.
    """

    def __init__(self, root: str | os.PathLike, target):
        self.root = Path(root)
        self.target = target

    def path(self, layer_ids: Sequence[int], input_ids: Sequence[int]) -> Path:
        t = self.target
        identity = [getattr(t, "fingerprint", getattr(t, "name", None)), str(t.dtype)]
        if getattr(t, "precision", None) not in (None, str(t.dtype).replace("torch.", "")):
            identity.append(t.precision)  # bf16 / int8 weights: other features (fp32 keys stay as they were)
        key = json.dumps([identity, [int(i) for i in layer_ids], [int(i) for i in input_ids]])
        return self.root / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.safetensors"

    def read(self, layer_ids: Sequence[int], input_ids: Sequence[int], device=None):
        """(features, final or None) in the target's dtype, or None; a damaged or mis-shaped file is removed."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        p = self.path(layer_ids, input_ids)
        if not p.exists():
            return None
        try:
            t = load_file(str(p), device=str(device or self.target.device))
            feats, final = t["features"], t.get("final")
        except (SafetensorError, OSError, ValueError, KeyError, RuntimeError):
            feats = final = None
        rows, width = len(input_ids), len(layer_ids) * self.target.hidden_size
        if feats is None or tuple(feats.shape) != (rows, width) or (final is not None and final.shape[0] != rows):
            log_once(f"feature cache: {p} is damaged (a write cut short?); remaking it")
            p.unlink(missing_ok=True)
            return None
        dt = self.target.dtype
        return feats.to(dt), (final.to(dt) if final is not None else None)

    def holds(self, layer_ids: Sequence[int], input_ids: Sequence[int], final: bool = False, lse: bool = False) -> bool:
        """Whether a file for the sequence is there (with the final state and the log-normaliser, if asked),
        from its header alone; an unreadable header counts as absent (read() would remake it)."""
        from safetensors import safe_open

        p = self.path(layer_ids, input_ids)
        if not p.exists():
            return False
        try:
            with safe_open(str(p), framework="pt") as f:
                keys = set(f.keys())
        except Exception:  # a header cut short or not safetensors at all
            return False
        return "features" in keys and (not final or "final" in keys) and (not lse or "lse" in keys)

    def read_lse(self, layer_ids: Sequence[int], input_ids: Sequence[int]) -> torch.Tensor | None:
        """The stored log-normaliser of the target's logits at every position ([S] fp32), or None: the one
        tensor of a distilling step that costs the full LM head, read alone from the file."""
        from safetensors import safe_open

        p = self.path(layer_ids, input_ids)
        try:
            with safe_open(str(p), framework="pt") as f:
                lse = f.get_tensor("lse") if "lse" in f.keys() else None
        except Exception:  # absent, or damaged (read() remakes it)
            return None
        return lse if lse is not None and tuple(lse.shape) == (len(input_ids),) else None

    def write(self, layer_ids: Sequence[int], input_ids: Sequence[int], features, final=None, lse=None) -> None:
        """Stores a sequence's features, its final hidden state and the log-normaliser of the logits read
        from that state (fp16, fp16 and fp32; the last two where given)."""
        from safetensors.torch import save_file

        tensors = {"features": features.to(torch.float16).cpu().contiguous()}
        if final is not None:
            tensors["final"] = final.to(torch.float16).cpu().contiguous()
        if lse is not None:
            tensors["lse"] = lse.to(torch.float32).cpu().contiguous()
        self.root.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.path(layer_ids, input_ids)) as tmp:
            save_file(tensors, str(tmp))
