"""The drafter directory, in one place: its file names, its readers and writers, the shipped drafters.

A drafter directory holds config.json + model.safetensors and, optionally, two sidecar files that
decoding reads: acceptance.json (conditional acceptance by block position; `--block-size auto`) and
calibration.json (STS temperatures by block position; `--verify static|cost`).

The target's embedding table and LM head are never saved here: a drafter borrows them at load.
Reading checks everything a damaged or mismatched directory can get wrong and names the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..errors import DominoError
from ..io import atomic_path, ensure_writable_dir, read_json_object, write_atomic
from ..log import log
from .config import FORMAT, DrafterConfig

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
ACCEPTANCE_NAME = "acceptance.json"  # conditional acceptance by block position
CALIBRATION_NAME = "calibration.json"  # STS temperatures by block position
SIDECAR_NAMES = (ACCEPTANCE_NAME, CALIBRATION_NAME)

SHIPPED_ROOT = Path(__file__).resolve().parent.parent / "shipped_drafters"


def shipped_drafter_dir(target_name: str) -> Path:
    """Where the package keeps the default drafter of a target (it may not ship one)."""
    return SHIPPED_ROOT / target_name


def named_drafter_dir(name: str | os.PathLike, target_name: str | None = None) -> Path:
    """The directory a drafter name means, as the command line reads --drafter: "shipped" (the drafter shipped for
    `target_name`, by default the bundled target) or a target alias the package ships a drafter for (when no
    directory of that name exists here); anything else is a directory path."""
    word = str(name)
    if word == "shipped":
        from ..targets.load import DEFAULT_TARGET

        word = target_name or DEFAULT_TARGET
        if not (shipped_drafter_dir(word) / CONFIG_NAME).exists():
            raise DominoError(
                f"no drafter is shipped for {word!r}: the package ships one for {DEFAULT_TARGET!r}; "
                "train one with `dominospec train` and load its directory"
            )
        return shipped_drafter_dir(word)
    if not Path(word).exists() and (shipped_drafter_dir(word) / CONFIG_NAME).exists():
        return shipped_drafter_dir(word)
    return Path(name)


def is_shipped(directory: str | os.PathLike) -> bool:
    """True for a directory inside the installed package's shipped drafters (never written to by default)."""
    try:
        return Path(directory).resolve().is_relative_to(SHIPPED_ROOT)
    except OSError:
        return False


def sidecar_path(drafter, name: str) -> Path | None:
    """DIR/name for a drafter loaded from DIR (None for one built in memory); name is a SIDECAR_NAMES entry."""
    if name not in SIDECAR_NAMES:
        raise ValueError(f"{name!r} is not a drafter sidecar file ({', '.join(SIDECAR_NAMES)})")
    directory = getattr(drafter, "directory", None)
    return Path(directory) / name if directory is not None else None


def save_checkpoint(config: DrafterConfig, state: dict[str, torch.Tensor], directory: str | os.PathLike) -> None:
    """config.json + model.safetensors, each written atomically (weights first); an acceptance.json or
    calibration.json already there is removed, since it was measured on other weights."""
    from safetensors.torch import save_file

    out = ensure_writable_dir(directory, "drafter directory")
    # the sidecars describe the weights they were measured with: new weights make them wrong, so they
    # go first (a crash then leaves a drafter without sidecars, never new weights with old ones)
    for name in SIDECAR_NAMES:
        stale = out / name
        if stale.is_file() or stale.is_symlink():
            stale.unlink()
            log(f"removed {stale}: it was measured on the weights this drafter replaces")
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    with atomic_path(out / WEIGHTS_NAME) as tmp:
        save_file(tensors, str(tmp), metadata={"format": FORMAT})
    write_atomic(out / CONFIG_NAME, json.dumps(config.to_dict(), indent=2) + "\n")


def read_checkpoint(directory: str | os.PathLike) -> tuple[DrafterConfig, dict[str, torch.Tensor], Path]:
    """(config, tensors, weights path) of a drafter directory, with clear errors for what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(directory)
    if d.is_file():
        raise DominoError(f"drafter {d} is a file; a drafter is a directory holding {CONFIG_NAME} and {WEIGHTS_NAME}")
    if not d.is_dir():
        raise DominoError(f"drafter {d}: no such directory")
    cfg_path, w_path = d / CONFIG_NAME, d / WEIGHTS_NAME
    if not cfg_path.exists():
        raise DominoError(f"drafter {d}: missing {CONFIG_NAME}")
    if not w_path.exists():
        raise DominoError(f"drafter {d}: missing {WEIGHTS_NAME}")
    data = read_json_object(cfg_path, "a drafter config")
    config = DrafterConfig.from_dict(data, source=str(cfg_path))
    try:
        state = load_file(str(w_path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise DominoError(f"{w_path}: not a readable safetensors file ({exc})") from None
    return config, state, w_path


def check_state(
    state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], w_path: Path, cfg_path: Path
) -> None:
    """The stored tensors are exactly the ones the config implies, with the same shapes, all finite."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DominoError(
            f"{w_path} does not match {cfg_path}: missing tensors {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected tensors {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''}"
        )
    for k, v in state.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise DominoError(
                f"{w_path}: tensor {k} has shape {tuple(v.shape)}, config implies {tuple(expected[k].shape)}"
            )
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            bad = int((~torch.isfinite(v)).sum())
            raise DominoError(
                f"{w_path}: tensor {k} holds {bad} NaN/inf value(s); the drafter is damaged (a diverged training run?)"
            )


def check_draft_vocab(draft_vocab: torch.Tensor, vocab_size: int, w_path: Path) -> None:
    dv = draft_vocab
    if int(dv.min()) < 0 or int(dv.max()) >= vocab_size or dv.unique().numel() != dv.numel():
        raise DominoError(f"{w_path}: draft_vocab must hold {dv.numel()} distinct ids in 0..{vocab_size - 1}")
