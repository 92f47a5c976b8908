"""Training a drafter: online target features, anchored blocks, teacher forcing, the curriculum.

One optimiser step:
  1. the step's sequences (split across ranks) go through the frozen target once, padded, for
     the feature-layer hidden states (or come from the optional on-disk feature cache);
  2. per sequence, up to `anchors` block anchors are sampled among positions whose token and
     next token are both supervised; all its blocks run in one drafter forward
     (`Drafter.forward_blocks`, mask: context before the anchor + its own block);
  3. the head runs teacher-forced on the true block tokens, so every slot trains in parallel;
  4. the loss is normalised by the step's total position weight over all ranks, so one process
     and N processes compute the same gradient.

With a validator (validate.py), every `val_every` steps and at the end the drafter's greedy
acceptance on held-out samples is measured; the best drafter by validation tau is what gets
exported, with its acceptance.json.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import pickle
import random
import shutil
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..drafter import Drafter
from ..drafter.checkpoint import ACCEPTANCE_NAME, CONFIG_NAME, check_state, read_checkpoint, save_checkpoint
from ..errors import DominoError, flag
from ..io import ensure_writable_dir, exclusive_lock, write_json_atomic, write_lines_atomic
from ..log import log
from ..targets.features import FeatureCache
from .blocks import (
    IGNORE,
    dense_or_sampled_anchors,
    first_misses,
    make_blocks,
    position_weights,
    replay_anchors,
    sample_anchors,
    simulated_tau,
    teacher_forced_blocks,
    teacher_forced_packed,
)
from .distributed import Dist
from .objectives import POSITION_WEIGHTS, acceptance_loss, dpace_factors, entropy_selection, greedy_labels
from .plots import plot_metrics
from .validate import BestSoFar, Validator

# the flag that sets each drafter config field (the rest follow from the target)
_DRAFTER_FLAGS = {
    "head": "--head",
    "num_layers": "--layers",
    "block_size": "--block-size",
    "intermediate_size": "--intermediate-size",
    "gru_hidden_size": "--gru-hidden-size",
    "rank": "--rank",
    "confidence_head": "--confidence-head",
    "mask_token_id": "--mask-token-id",
    "draft_vocab_size": "--draft-vocab",
    "target_layer_ids": "--layer-ids",
    "target_name": "--target",
}


@dataclass
class TrainConfig:
    max_steps: int = 0  # 0: derive from epochs
    epochs: float = 1.0
    batch_size: int = 4  # sequences per optimiser step, over all ranks
    anchors: int = 32  # blocks per sequence (0: every supervised position, "dense")
    distill: float = 0.0  # weight of the soft-label KL to the target's distribution (0: the token CE only)
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    gamma: float | None = None  # position-decay; default 7 for block 16, scaled with the block
    lambda_start: float = 1.0  # domino curriculum: weight of CE(base) at the start ...
    lambda_decay: float = 1.0  # ... decaying to 0 over this fraction of the run
    position_weighting: str = "decay"  # "decay": exp(-k/gamma); "dpace": 0.5 + 0.5 * survival (objectives.py)
    accept_loss: float = 0.0  # weight of the LK-style -log(expected acceptance) loss (objectives.py)
    entropy_keep: float = 1.0  # train on this fraction of slots, those of highest target entropy
    greedy_labels: bool = False  # token loss on the target's greedy token at each slot instead of the data's
    replay: float = 0.0  # share of a sample's anchors drawn where the drafter's draft was last rejected (packed)
    max_seq_len: int = 2048
    seed: int = 0
    save_every: int = 50
    log_every: int = 5
    val_every: int = 50  # validation interval in steps (with a validator)
    val_anchors: int = 64  # validation blocks per held-out sample (evenly spaced; 0: all)
    val_walk: bool = True  # validate at the anchors a greedy decode visits (validate.walked_rows); else val_anchors
    packed: bool = True  # all the step's blocks in one drafter forward; False: today's per-sequence step
    bf16: bool = False  # bf16 autocast of the drafter's forward (packed only; for CPUs with native bf16)

    # how often to checkpoint or log does not change the trained drafter; every other field does
    CHANGEABLE_ON_RESUME = ("save_every", "log_every")
    # what a checkpoint written before a field existed ran with
    BEFORE_FIELD = {
        "packed": False,
        "bf16": False,
        "val_walk": False,
        "position_weighting": "decay",
        "accept_loss": 0.0,
        "entropy_keep": 1.0,
        "replay": 0.0,
        "greedy_labels": False,
    }

    def __post_init__(self):
        """Every number checked once, the message naming its flag: a bad one fails before any work."""

        def finite(x) -> bool:
            return isinstance(x, (int, float)) and math.isfinite(x)

        rules = [
            ("max_steps", isinstance(self.max_steps, int) and self.max_steps >= 0, "an integer >= 0"),
            ("epochs", finite(self.epochs) and self.epochs > 0, "a finite number > 0"),
            ("batch_size", isinstance(self.batch_size, int) and self.batch_size >= 1, "an integer >= 1"),
            ("anchors", isinstance(self.anchors, int) and self.anchors >= 0, "an integer >= 0 (0: all)"),
            ("distill", finite(self.distill) and 0 <= self.distill <= 1, "in [0, 1]"),
            ("lr", finite(self.lr) and self.lr > 0, "a finite number > 0"),
            ("warmup", finite(self.warmup) and 0 <= self.warmup <= 1, "a fraction in [0, 1]"),
            ("weight_decay", finite(self.weight_decay) and self.weight_decay >= 0, "a finite number >= 0"),
            ("clip", finite(self.clip) and self.clip > 0, "a finite number > 0"),
            ("gamma", self.gamma is None or (finite(self.gamma) and self.gamma > 0), "a finite number > 0"),
            ("lambda_start", finite(self.lambda_start) and 0 <= self.lambda_start <= 1, "in [0, 1]"),
            ("lambda_decay", finite(self.lambda_decay) and 0 <= self.lambda_decay <= 1, "a fraction in [0, 1]"),
            ("max_seq_len", isinstance(self.max_seq_len, int) and self.max_seq_len >= 2, "an integer >= 2"),
            ("save_every", isinstance(self.save_every, int) and self.save_every >= 1, "an integer >= 1"),
            ("log_every", isinstance(self.log_every, int) and self.log_every >= 1, "an integer >= 1"),
            ("val_every", isinstance(self.val_every, int) and self.val_every >= 1, "an integer >= 1"),
            ("val_anchors", isinstance(self.val_anchors, int) and self.val_anchors >= 0, "an integer >= 0 (0: all)"),
            ("bf16", not self.bf16 or self.packed, "off with the per-sequence step (--no-packed)"),
            ("position_weighting", self.position_weighting in POSITION_WEIGHTS, f"one of {POSITION_WEIGHTS}"),
            ("accept_loss", finite(self.accept_loss) and 0 <= self.accept_loss <= 1, "in [0, 1]"),
            ("entropy_keep", finite(self.entropy_keep) and 0 < self.entropy_keep <= 1, "a fraction in (0, 1]"),
            ("replay", finite(self.replay) and 0 <= self.replay < 1, "a fraction in [0, 1)"),
            ("replay", self.replay == 0 or (self.packed and self.anchors > 0), "off with --no-packed or --anchors 0"),
        ]
        for name, ok, want in rules:
            if not ok:
                raise DominoError(f"{flag(name)} must be {want}, got {getattr(self, name)!r}")

    def position_weights(self, block: int) -> torch.Tensor:
        """The fixed weight of each slot; D-PACE's are 1 here, times its per-block factors in the loss."""
        if self.position_weighting == "dpace":
            return torch.ones(block)
        # published: gamma 7 at block 16; scaled with the block when not given
        return position_weights(block, self.gamma if self.gamma is not None else 7.0 * block / 16)

    def curriculum_lambda(self, step: int, total: int) -> float:
        span = max(1.0, self.lambda_decay * total)
        return self.lambda_start * max(0.0, 1.0 - step / span)


STEP_STATS = ("tau_greedy", "tau_sampled", "blocks", "tokens")  # summed over a step's micro-batches, by name


def lr_factor(step: int, total: int, warmup: int) -> float:
    """The learning rate at `step` as a fraction of the peak: linear warm-up over `warmup` steps, then a
    cosine down to 0 at step `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


def _glibc():
    """glibc through ctypes, or None (not Linux, or another C library)."""
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def keep_large_blocks_on_the_heap() -> bool:
    """Tell glibc's malloc to serve every block from the heap and keep freed memory (Linux only).

    By default a block over 32 MB (a step's [N*B, 8192] logits) is mmap-ed fresh and returned on
    free, so each use pays a page fault per 4 KB: measured 5x on the loss ops of a packed step.
    Process-wide; the holes it leaves go back with `return_free_heap`. False where not glibc.
    """
    libc = _glibc()
    if libc is None:
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**30))


def return_free_heap() -> bool:
    """Give the free pages inside the heap back to the system (glibc's malloc_trim; False elsewhere).

    With every block on the heap (above), blocks of many sizes (each sample's features, a step's logits)
    leave holes that the heap keeps resident. Trimming every TRIM_EVERY steps returns them; the blocks a step
    needs are faulted in again once per TRIM_EVERY steps. (A packed run over the full data set reached 16.6 GB
    resident at step ~730 without it; with it, peaks still rose to 10.7 GB by step 400 while the in-memory
    features filled their budget: not yet shown to plateau.)"""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


TRIM_EVERY = 25  # steps between heap trims of the packed CPU step
PACKED_BLOCKS = 128  # blocks per packed forward: large ops, yet the [N*B, V'] logits stay near the caches


def samples_fingerprint(samples: list[dict]) -> str:
    """What a checkpoint was trained on, in order: a resumed run may add samples after these, never change them."""
    h = hashlib.sha256()
    for sample in samples:
        h.update(json.dumps([sample.get("id"), sample["input_ids"], sample["loss_mask"]]).encode())
    return h.hexdigest()


def read_train_state(out: Path, device="cpu") -> tuple[Path, dict, tuple] | None:
    """The checkpoint `--resume` continues: (its directory, trainer.pt's dict, its drafter as read_checkpoint
    gives it), or None when OUT holds none. A damaged one (truncated or emptied by a crash or a full disk)
    is a DominoError naming the file and what to do; nothing in OUT is touched."""
    d = out / "train_state"
    if not d.exists() and (out / "train_state.old").exists():
        d = out / "train_state.old"  # killed between the two renames
    if not (d / "trainer.pt").exists():
        return None
    return read_state_dir(d, device)


def read_state_dir(d: Path, device="cpu") -> tuple[Path, dict, tuple]:
    """A checkpoint directory (trainer.pt and drafter/, as OUT/train_state holds them; or a copy of one kept
    elsewhere, such as in a repository, that `--resume-from` continues): (d, trainer.pt's dict, its drafter)."""
    if not (d / "trainer.pt").exists():
        raise DominoError(f"cannot resume: {d} holds no trainer.pt (a copy of a run's OUT/train_state is expected)")
    st = read_trainer_pt(d / "trainer.pt", device)
    try:
        drafter = read_checkpoint(d / "drafter")
    except DominoError as exc:
        raise DominoError(f"cannot resume: {exc}. {_damaged_advice(d)}") from None
    return d, st, drafter


def read_trainer_pt(path: Path, device="cpu") -> dict:
    """OUT/train_state/trainer.pt, or a DominoError saying it is damaged and what to do."""
    try:
        st = torch.load(path, map_location=device, weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError) as exc:
        why = f"{type(exc).__name__}: {str(exc).split('. ')[0] or 'empty'}"
        raise DominoError(f"cannot resume: {path} is damaged ({why}). {_damaged_advice(path.parent)}") from None
    if not isinstance(st, dict) or "step" not in st:
        raise DominoError(f"cannot resume: {path} is not a training checkpoint. {_damaged_advice(path.parent)}")
    return st


def _damaged_advice(state_dir: Path) -> str:
    return (
        f"Restore {state_dir} from a copy, or remove it to train from the start (the drafter exported in "
        f"{state_dir.parent}, if any, is kept)"
    )


class Trainer:
    def __init__(
        self,
        target,
        drafter: Drafter,
        samples: list[dict],
        out: Path,
        cfg: TrainConfig,
        dist: Dist | None = None,
        feature_cache: Path | None = None,
        progress: bool = True,
        save_dtype: torch.dtype | None = None,
        validator: Validator | None = None,
        memory_gb: float = 4.0,
    ):
        self.target, self.drafter, self.samples, self.out, self.cfg = target, drafter, samples, Path(out), cfg
        self.dist = dist or Dist()
        self.feature_cache = FeatureCache(feature_cache, target) if feature_cache else None
        self.progress = progress and self.dist.main
        self.save_dtype = save_dtype
        self.validator, self.best, self.last_val = validator, BestSoFar(), None
        self.device = target.device
        self.head = drafter.head  # says what its loss needs
        self.block = drafter.config.block_size
        self.weights = cfg.position_weights(self.block).to(self.device)
        self.steps_per_epoch = max(1, math.ceil(len(samples) / cfg.batch_size))
        self.total = cfg.max_steps or max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        # phases of the data: (first step, samples, first epoch); a resumed run on a grown data set adds one
        self.phases: list[tuple[int, int, int]] = [(0, len(samples), 0)]
        drafter.float().train()
        drafter.to(self.device)
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self._on_heap = False  # every block on the heap, trimmed every TRIM_EVERY steps (packed CPU step)
        if cfg.packed and self.device.type == "cpu":
            self._on_heap = keep_large_blocks_on_the_heap()
        # fused: one kernel for all parameters instead of a dozen ops per tensor (same update)
        fused = cfg.packed and self.device.type in ("cpu", "cuda")
        self.opt = torch.optim.AdamW(
            self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay, fused=fused or None
        )
        self.timing: dict[str, float] | None = None  # CPU seconds per part of a step (scripts/train_profile.py)
        self._in_memory: dict[int, tuple] = {}  # the packed step's fp16 features, read or computed once
        self._memory_left = int(memory_gb * 2**30)
        self._lse: dict[int, torch.Tensor] = {}  # per sample: the target's log-normaliser at every position
        self.missed: dict[int, list[int]] = {}  # per sample: where its blocks' first drafts were last rejected
        self.positions = 0  # supervised block slots trained by this process so far (the throughput unit)
        self.warmup_steps = max(1, int(cfg.warmup * self.total))  # fixed at the start; total may grow on resume
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda step: self.lr_factor(step))
        self.step = 0

    def lr_factor(self, step: int) -> float:
        """The learning rate of `step` over cfg.lr (read at every step: a resumed run on grown data moves total)."""
        return lr_factor(step, self.total, self.warmup_steps)

    # ----- data order: a pure function of (seed, epoch), so a resumed run sees the same batches -----
    @functools.cached_property
    def samples_sha256(self) -> str:
        """The training samples' fingerprint, once: every checkpoint records it."""
        return samples_fingerprint(self.samples)

    def epoch_of(self, step: int) -> tuple[int, int, int]:
        """(epoch, step within it, samples in play) of a step: its data phase's first n samples."""
        start, n, first_epoch = next(p for p in reversed(self.phases) if p[0] <= step)
        epoch, within = divmod(step - start, max(1, math.ceil(n / self.cfg.batch_size)))
        return first_epoch + epoch, within, n

    def batch_indices(self, step: int) -> list[int]:
        epoch, within, n = self.epoch_of(step)
        order = list(range(n))
        random.Random(self.cfg.seed * 1000003 + epoch).shuffle(order)
        chosen = order[within * self.cfg.batch_size : (within + 1) * self.cfg.batch_size]
        return chosen[self.dist.rank :: self.dist.world]

    # ----- target features -----
    @property
    def needs_target_probs(self) -> bool:
        cfg = self.cfg
        return (
            self.head.needs_target_probs
            or cfg.distill > 0
            or cfg.accept_loss > 0
            or cfg.entropy_keep < 1
            or cfg.greedy_labels
        )

    def features(self, idx: list[int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each sample's (layer features, final hidden state where the objective reads it, else None): read from
        the cache, else computed (and stored)."""
        need_final = self.needs_target_probs
        result: dict[int, tuple] = {}
        todo = []
        for i in idx:
            cached = self._cache_read(i) if self.feature_cache else None
            if cached is not None and (cached[1] is not None or not need_final):
                result[i] = cached
            else:
                todo.append(i)
        result.update(self._compute_features(todo, need_final))
        return [result[i] for i in idx]

    def _compute_features(self, idx: list[int], need_final: bool, store: bool = True) -> dict[int, tuple]:
        """The target's features of samples idx, one forward for all, stored in the cache where there is one
        (and `store`)."""
        if not idx:
            return {}
        feats, final = self.target.sequence_features(
            [self.samples[i]["input_ids"] for i in idx], self.drafter.config.target_layer_ids
        )
        out = {}
        for r, i in enumerate(idx):
            out[i] = (feats[r], final[r] if need_final else None)
            if self.feature_cache and store:
                self._cache_write(i, out[i])
        return out

    def fill_feature_cache(self) -> tuple[int, int]:
        """Stores the target features (the final hidden state too, so any objective can read them) of every
        training sample of this process that the cache lacks, in data set order, a batch at a time; returns
        (computed, already cached). `train --features-only`: one pass that trainings sharing the cache then
        read instead of each computing the same features."""
        if self.feature_cache is None:
            raise DominoError("--features-only fills a feature cache: pass --feature-cache DIR")
        from tqdm import tqdm

        layers = self.drafter.config.target_layer_ids
        mine = list(range(self.dist.rank, len(self.samples), self.dist.world))
        missing = [i for i in mine if not self.feature_cache.holds(layers, self.samples[i]["input_ids"], lse=True)]
        bar = tqdm(total=len(missing), desc="features", unit="sample", disable=not self.progress)
        for b in range(0, len(missing), self.cfg.batch_size):
            chunk = missing[b : b + self.cfg.batch_size]
            got = {i: self._cache_read(i) for i in chunk}  # a file with the final state lacks only the normaliser
            fresh = [i for i in chunk if got[i] is None or got[i][1] is None]
            got.update(self._compute_features(fresh, need_final=True, store=False))
            for i in chunk:  # the normaliser of the stored (fp16) final state: what every reader gets
                feats, final = (t.to(torch.float16) for t in got[i])
                self._cache_write(i, (feats, final, self._log_normaliser(final)))
            bar.update(len(chunk))
        bar.close()
        return len(missing), len(mine) - len(missing)

    def _cache_lse(self, i: int) -> torch.Tensor | None:
        return self.feature_cache.read_lse(self.drafter.config.target_layer_ids, self.samples[i]["input_ids"])

    def _cache_path(self, i: int) -> Path:
        return self.feature_cache.path(self.drafter.config.target_layer_ids, self.samples[i]["input_ids"])

    def _cache_read(self, i: int):
        """The cached features of sample i, or None (FeatureCache: keyed by content, damaged files remade)."""
        return self.feature_cache.read(self.drafter.config.target_layer_ids, self.samples[i]["input_ids"], self.device)

    def _cache_write(self, i: int, item) -> None:
        self.feature_cache.write(self.drafter.config.target_layer_ids, self.samples[i]["input_ids"], *item)

    @contextmanager
    def _part(self, name: str):
        """Adds the CPU time of the block to self.timing[name] when profiling (one torch thread: thread time)."""
        self._part_start(name)
        yield
        self._part_stop(name)

    def _part_start(self, name: str) -> None:
        if self.timing is not None:
            self.timing[name] = self.timing.get(name, 0.0) - time.thread_time()

    def _part_stop(self, name: str) -> None:
        if self.timing is not None:
            self.timing[name] += time.thread_time()

    def features_in_memory(self, idx: list[int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """`features`, kept in memory as fp16 (the cache's precision) up to the memory budget: after the
        first epoch a step reads no file and runs no target pass."""
        got = {i: self._in_memory[i] for i in idx if i in self._in_memory}
        missing = [i for i in idx if i not in got]
        for i, (f, fin) in zip(missing, self.features(missing) if missing else []):
            item = got[i] = (f.to(torch.float16), None if fin is None else fin.to(torch.float16))
            size = sum(t.numel() * 2 for t in item if t is not None)
            if size <= self._memory_left:  # past the budget a sample is read (or computed) every epoch
                self._memory_left -= size
                self._in_memory[i] = item
        dt = self.drafter.dtype
        return [(f.to(dt), None if fin is None else fin.to(dt)) for f, fin in (got[i] for i in idx)]

    @torch.no_grad()
    def _log_normaliser(self, final: torch.Tensor) -> torch.Tensor:
        """logsumexp of the target's logits over its whole vocabulary at every position [S] (fp32)."""
        return torch.logsumexp(self.target.lm_head(final.to(self.target.dtype)).float(), -1)

    def _target_probs_packed(self, idx, finals, blocks) -> torch.Tensor:
        """[N, B, V'] the target's distribution at every block slot, on the draft vocabulary (mass
        outside it left out): draft-vocabulary logits minus the full log-normaliser, which is
        computed once per sample (the full LM head over 49k rows is the dearest op of a step), each
        at the distinct positions only (blocks overlap: dense anchors read every position B times)."""
        d = self.drafter
        rows, lse, where, offset = [], [], [], 0
        for i, fin, (a, _, _) in zip(idx, finals, blocks):
            if i not in self._lse:
                stored = self._cache_lse(i) if self.feature_cache else None
                self._lse[i] = stored.to(fin.device) if stored is not None else self._log_normaliser(fin)
            pos = (a.unsqueeze(1) + torch.arange(self.block, device=a.device)).clamp(max=fin.shape[0] - 1)
            distinct, inverse = torch.unique(pos, return_inverse=True)
            gaps = distinct[torch.isnan(self._lse[i][distinct])]  # captured at generation: no logits at a prompt's
            if gaps.numel():  # positions (an earlier turn's answer), computed here once, where a block reads them
                self._lse[i][gaps] = self._log_normaliser(fin[gaps]).to(self._lse[i].dtype)
            rows.append(fin[distinct])  # [U_r, H]
            lse.append(self._lse[i][distinct])
            where.append(inverse + offset)  # [N_r, B] -> row of the distinct positions
            offset += distinct.shape[0]
        h, lse, where = torch.cat(rows), torch.cat(lse), torch.cat(where)
        with torch.no_grad():
            if d.config.draft_vocab_size:
                head = self.target.output_embeddings()
                bias = getattr(head, "bias", None)
                logits = F.linear(
                    h.to(head.weight.dtype), head.weight[d.draft_vocab], None if bias is None else bias[d.draft_vocab]
                )
            else:
                logits = self.target.lm_head(h.to(self.target.dtype))
            return torch.exp(logits.float() - lse.unsqueeze(-1))[where]  # [N, B, V']

    def _draft_labels(self, labels: torch.Tensor, p_t: torch.Tensor | None) -> torch.Tensor:
        """Teacher-forced labels [N, B] as the loss reads them: draft-vocabulary ids (a token outside it cannot be
        proposed: unsupervised), or with --greedy-labels the target's most likely draft token at each such slot."""
        d = self.drafter
        if d.config.draft_vocab_size:
            sub = d.to_draft_ids(labels.clamp_min(0))
            labels = torch.where((labels == IGNORE) | (sub < 0), torch.full_like(labels, IGNORE), sub)
        return greedy_labels(labels, p_t, IGNORE) if self.cfg.greedy_labels else labels

    def _loss(self, tf, p_t, lam: float, w: torch.Tensor, labels: torch.Tensor):
        """The head's loss (+ distillation, + confidence) of teacher-forced blocks; (loss, terms)."""
        d, cfg = self.drafter, self.cfg
        z, prev_emb, base, final = tf.z, tf.prev_emb, tf.base, tf.final
        if cfg.position_weighting == "dpace":
            w = w * dpace_factors(final, labels, IGNORE)
        if cfg.entropy_keep < 1:
            w = entropy_selection(p_t, w, cfg.entropy_keep)

        def ce(logits):
            per = F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=IGNORE, reduction="none"
            ).view_as(labels)
            return (per * w).sum()

        loss, terms = self.head.loss(base, final, ce, p_t, w, lam)
        if self.cfg.distill > 0:  # soft labels: KL(target || draft) on the draft vocabulary, renormalised there
            q = p_t / p_t.sum(-1, keepdim=True).clamp_min(1e-12)
            kl = (q * (q.clamp_min(1e-12).log() - torch.log_softmax(final.float(), -1))).sum(-1)  # [N, B]
            terms["kl"] = (kl * w).sum()
            loss = (1 - self.cfg.distill) * loss + self.cfg.distill * terms["kl"]
        if cfg.accept_loss > 0:  # LK-style: the log of the chance the target keeps the draft
            terms["lk"] = acceptance_loss(final, p_t, w)
            loss = (1 - cfg.accept_loss) * loss + cfg.accept_loss * terms["lk"]
        if d.confidence is not None:
            # its label: the greedy hit, or the sampled acceptance for heads trained on the target's distribution
            terms["bce"] = d.confidence.loss(
                z, prev_emb, final, labels, p_t if self.head.needs_target_probs else None, w
            )
            loss = loss + terms["bce"]
        return loss, terms

    def train_step(self) -> dict:
        """One optimizer step over the step's micro-batches: packed (the default), a few large drafter
        forwards of at most PACKED_BLOCKS blocks each, a sequence's blocks split where they exceed it;
        --no-packed, one micro-batch per sequence. Each runs its forward and backward; the loss terms and
        stats are summed by name, reduced over ranks, and the update follows."""
        lam = self.cfg.curriculum_lambda(self.step, self.total) if self.head.uses_curriculum else 0.0
        micro_batches, den = self._packed_batches(lam) if self.cfg.packed else self._sequence_batches(lam)
        self.opt.zero_grad(set_to_none=True)
        terms: dict[str, float] = {}
        stats = dict.fromkeys(STEP_STATS, 0.0)
        for run in micro_batches:
            t, st = run(den)
            for k, v in t.items():
                terms[k] = terms.get(k, 0.0) + v
            for k, v in st.items():
                stats[k] += v
        with self._part("optimizer"):
            self.dist.all_sum_grads(self.params)
            gnorm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip))
        return self._finish_step(terms, stats, den, gnorm, lam)

    def _packed_batches(self, lam: float):
        """The packed step's micro-batches (callables of den) and the step's loss normaliser."""
        cfg = self.cfg
        idx = self.batch_indices(self.step)
        epoch = self.epoch_of(self.step)[0]
        with self._part("data"):
            pieces = []  # (sample index, (anchors [n], tokens [n, B], labels [n, B])), n <= PACKED_BLOCKS
            for i in idx:
                s = self.samples[i]
                mask = torch.tensor(s["loss_mask"])
                if cfg.replay and i in self.missed:  # on-policy replay: where its drafts were rejected last time
                    rng = random.Random(f"{cfg.seed}-epoch{epoch}-{i}-replay")
                    a = replay_anchors(mask, cfg.anchors, self.missed[i], cfg.replay, rng)
                else:
                    a = dense_or_sampled_anchors(mask, cfg.anchors, cfg.seed, epoch, i)
                if cfg.replay:  # this step's blocks record the sample's misses afresh (_record_misses)
                    self.missed[i] = []
                if a.numel():
                    tokens, labels = make_blocks(torch.tensor(s["input_ids"]), mask, a, self.block)
                    parts = (t.to(self.device).split(PACKED_BLOCKS) for t in (a, tokens, labels))
                    pieces += [(i, piece) for piece in zip(*parts)]
            batches, size = [], PACKED_BLOCKS
            for piece in pieces:  # consecutive pieces fill micro-batches of up to PACKED_BLOCKS blocks
                n = piece[1][0].shape[0]
                if size + n > PACKED_BLOCKS:
                    batches.append([])
                    size = 0
                batches[-1].append(piece)
                size += n
            valid = sum(int((lab != IGNORE).sum()) for _, (_, _, lab) in pieces)
            self.positions += valid
            den = sum(((self.weights * (lab != IGNORE).float()).sum() for _, (_, _, lab) in pieces), torch.zeros(()))
            den = self.dist.all_sum(den.to(self.device)).clamp_min(1e-8)
        first = {}  # a sample's tokens count once, in the micro-batch holding its first piece
        for b, batch in enumerate(batches):
            for i, _ in batch:
                first.setdefault(i, b)

        def micro_batch(b: int, batch: list):
            def run(den):
                terms, (g, s_sampled) = self._packed_terms(batch, den, lam)
                own = [i for i in dict.fromkeys(i for i, _ in batch) if first[i] == b]
                tokens = sum(len(self.samples[i]["input_ids"]) for i in own)
                n = sum(piece[0].shape[0] for _, piece in batch)
                return terms, {"tau_greedy": g, "tau_sampled": s_sampled, "blocks": n, "tokens": tokens}

            return run

        return [micro_batch(b, batch) for b, batch in enumerate(batches)], den

    def _packed_terms(self, batch: list, den: torch.Tensor, lam: float) -> tuple[dict, tuple[float, float]]:
        """Forward and backward of one micro-batch; its loss terms and (greedy, sampled) tau x blocks."""
        d = self.drafter
        idx = [i for i, _ in batch]
        blocks = [piece for _, piece in batch]
        with self._part("features"):
            feats = self.features_in_memory(idx)
        with self._part("target_probs"):
            p_t = self._target_probs_packed(idx, [fin for _, fin in feats], blocks) if self.needs_target_probs else None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.cfg.bf16 and self.device.type == "cpu"):
            with self._part("forward"):
                tf = teacher_forced_packed(d, [f for f, _ in feats], blocks)
                labels = self._draft_labels(tf.labels, p_t)
                w = self.weights.unsqueeze(0) * (labels != IGNORE).float()
            with self._part("loss"):
                loss, terms = self._loss(tf, p_t, lam, w, labels)
        with self._part("backward"):
            (loss / den).backward()
        with self._part("metrics"), torch.no_grad():
            final = tf.final.detach().float()
            g, s = simulated_tau(final, labels, p_t)
            n = labels.shape[0]
            if self.cfg.replay:
                self._record_misses(batch, final, labels)
            return {k: float(v.detach()) for k, v in terms.items()}, (g * n, (s or 0.0) * n)

    def _record_misses(self, batch: list, final: torch.Tensor, labels: torch.Tensor) -> None:
        """Add to each sample's record (emptied when its step began) the positions where this micro-batch's blocks
        of it had their first drafts rejected; the rows of final / labels follow the batch's pieces in order, and
        a sample's pieces may fall in several micro-batches."""
        row = 0
        for i, (anchors, _, _) in batch:
            n = anchors.shape[0]
            self.missed[i] += first_misses(final[row : row + n], labels[row : row + n], anchors.to(final.device))
            row += n

    # ----- one sequence's loss (the per-sequence step, --no-packed) -----
    def sequence_terms(self, i: int, feats: torch.Tensor, final_hidden, anchors: torch.Tensor, lam: float):
        """Weighted loss numerators for one sequence's blocks, and its stats. feats: [S, n*H]."""
        sample = self.samples[i]
        ids = torch.tensor(sample["input_ids"], device=self.device)
        mask = torch.tensor(sample["loss_mask"], device=self.device)
        anchors = anchors.to(self.device)
        d = self.drafter
        with self._part("forward"):
            tf = teacher_forced_blocks(d, feats, ids, mask, anchors)
        z, final = tf.z, tf.final
        p_t = None
        if self.needs_target_probs:  # the target's distribution at each slot, from its final hidden state
            pos = (anchors.unsqueeze(1) + torch.arange(self.block, device=self.device)).clamp(max=ids.shape[0] - 1)
            with torch.no_grad(), self._part("target_probs"):
                p_t = torch.softmax(self.target.lm_head(final_hidden[pos]).to(z.dtype), -1)
                if d.config.draft_vocab_size:
                    p_t = p_t[..., d.draft_vocab]  # mass outside the draft vocabulary adds 1 - sum
        labels = self._draft_labels(tf.labels, p_t)
        w = self.weights.unsqueeze(0) * (labels != IGNORE).float()  # [N, B]
        with self._part("loss"):
            loss, terms = self._loss(tf, p_t, lam, w, labels)
        with torch.no_grad(), self._part("metrics"):
            g, s = simulated_tau(final.detach(), labels, p_t)
        return (
            loss,
            terms,
            {"tau_greedy": g, "tau_sampled": s, "blocks": int(anchors.numel()), "tokens": int(ids.shape[0])},
        )

    def _sequence_batches(self, lam: float):
        """The per-sequence step's micro-batches (one per sequence with anchors) and the loss normaliser."""
        cfg = self.cfg
        idx = self.batch_indices(self.step)
        # the normaliser first, summed over ranks, so every rank divides by the same number
        den = torch.zeros((), device=self.device)
        anchors = {}
        with self._part("data"):
            for i in idx:
                mask = torch.tensor(self.samples[i]["loss_mask"])
                # anchors depend on (seed, step, sample) only: resumed and multi-process runs agree
                a = sample_anchors(mask, cfg.anchors, random.Random(f"{cfg.seed}-{self.step}-{i}"))
                anchors[i] = a
                if a.numel():
                    ids = torch.tensor(self.samples[i]["input_ids"])
                    _, labels = make_blocks(ids, mask, a, self.block)
                    self.positions += int((labels != IGNORE).sum())
                    den += (self.weights.cpu() * (labels != IGNORE).float()).sum().to(self.device)
            den = self.dist.all_sum(den).clamp_min(1e-8)
        with self._part("features"):
            feats = self.features(idx)  # all sequences of the step in one target pass

        def micro_batch(i: int, f, fin):
            def run(den):
                loss, terms, st = self.sequence_terms(i, f, fin, anchors[i], lam)
                with self._part("backward"):
                    (loss / den).backward()
                n = st["blocks"]
                stats = {"tau_greedy": st["tau_greedy"] * n, "tau_sampled": (st["tau_sampled"] or 0.0) * n}
                stats.update(blocks=n, tokens=st["tokens"])
                return {k: float(v.detach()) for k, v in terms.items()}, stats

            return run

        return [micro_batch(i, f, fin) for i, (f, fin) in zip(idx, feats) if anchors[i].numel()], den

    def _finish_step(self, terms: dict, stats: dict, den, gnorm: float, lam: float) -> dict:
        """Metrics reduced over ranks by name (before the update, so every rank sees a bad loss and stops
        alike), then the update; the step's metrics record. terms: loss numerators; stats: STEP_STATS sums
        (tau_greedy / tau_sampled weighted by blocks)."""
        names = sorted(terms) + list(STEP_STATS)
        vec = torch.tensor([terms.get(k, stats.get(k)) for k in names], dtype=torch.float64, device=self.device)
        total = dict(zip(names, self.dist.all_sum(vec).tolist()))
        if not (math.isfinite(gnorm) and all(math.isfinite(v) for v in total.values())):
            self._stop_diverged({k: total[k] for k in sorted(terms)}, gnorm)
        with self._part("optimizer"):
            self.opt.step()
        self.sched.step()
        self.step += 1
        if self._on_heap and self.step % TRIM_EVERY == 0:
            return_free_heap()
        dn = float(den)
        rec = {k: total[k] / dn for k in sorted(terms)}
        blocks = max(1.0, total["blocks"])
        rec.update(
            step=self.step,
            lr=self.sched.get_last_lr()[0],
            grad_norm=gnorm,
            tau_greedy=total["tau_greedy"] / blocks,
            tokens=int(total["tokens"]),
        )
        if self.needs_target_probs:
            rec["tau_sampled"] = total["tau_sampled"] / blocks
        if self.head.uses_curriculum:
            rec["lambda"] = lam
        return rec

    def _stop_diverged(self, losses: dict, gnorm: float) -> None:
        """The loss or gradient is NaN/inf: stop before the update, leaving the last checkpoint as it is."""
        saved = self._saved_step()
        kept = (
            f"the last good checkpoint (step {saved}) is kept in {self.state_dir}"
            if saved is not None
            else "no checkpoint had been saved yet"
        )
        terms = ", ".join(f"{k}={v:.4g}" for k, v in losses.items())
        raise DominoError(
            f"training stopped at step {self.step + 1}: the loss is not finite ({terms}, gradient "
            f"norm {gnorm:.4g}); {kept} and no drafter was exported. A lower --lr usually helps; "
            "resuming needs the same settings, so start again with a new --out"
        )

    def _saved_step(self) -> int | None:
        path = self.state_dir / "trainer.pt"
        if not self.dist.main or not path.exists():
            return None
        return int(read_trainer_pt(path, "cpu")["step"])

    # ----- checkpoints -----
    @property
    def state_dir(self) -> Path:
        return self.out / "train_state"

    def save_checkpoint(self) -> None:
        if not self.dist.main:
            return
        tmp = self.out / f"train_state.tmp{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a killed save
        tmp.mkdir(parents=True)
        self.drafter.save_pretrained(tmp / "drafter")
        torch.save(
            {
                "opt": self.opt.state_dict(),
                "sched": self.sched.state_dict(),
                "step": self.step,
                "train_config": asdict(self.cfg),
                "num_samples": len(self.samples),
                "samples_sha256": self.samples_sha256,
                "phases": self.phases,
                "torch_rng": torch.get_rng_state(),
                "best": self.best.state_dict(),
            },
            tmp / "trainer.pt",
        )
        old = self.out / "train_state.old"
        if self.state_dir.exists():
            os.replace(self.state_dir, old)
        os.replace(tmp, self.state_dir)
        if old.exists():
            shutil.rmtree(old)

    def load_checkpoint(self, source: Path | None = None) -> bool:
        """Continue from OUT/train_state, or from `source`, a copy of one kept elsewhere (a repository: a run
        that outlives its machine; the feature cache is not part of it and is recomputed); False when OUT has
        none. Refuses a checkpoint made with other settings (every TrainConfig field that changes the result,
        the drafter's config, the data size), naming each setting with its stored and its new value."""
        found = read_train_state(self.out, self.device) if source is None else read_state_dir(Path(source), self.device)
        if found is None:
            return False
        d, st, (config, state, w_path) = found
        changed = []
        phases = [tuple(p) for p in st.get("phases", [(0, st["num_samples"], 0)])]
        had = st["num_samples"]
        stored_sha = st.get("samples_sha256")  # None: a checkpoint written before fingerprints
        same_start = stored_sha is None or stored_sha == (
            self.samples_sha256 if had == len(self.samples) else samples_fingerprint(self.samples[:had])
        )
        grown = len(self.samples) > had and stored_sha is not None and same_start
        if len(self.samples) != had and not grown:
            why = (
                ""
                if len(self.samples) < had
                else " (a grown data set resumes only where its first samples are unchanged)"
            )
            changed.append(f"--data: {len(self.samples)} samples now, {had} in the checkpoint{why}")
        elif not same_start:
            changed.append(f"--data: the first {had} training samples differ from the checkpoint's")
        stored = st["train_config"]
        for key, now in asdict(self.cfg).items():
            was = stored.get(key, TrainConfig.BEFORE_FIELD.get(key))
            if key not in TrainConfig.CHANGEABLE_ON_RESUME and was != now:
                changed.append(f"{flag(key)}: {now!r} now, {was!r} in the checkpoint")
        mine = self.drafter.config.to_dict()
        for key, was in config.to_dict().items():
            if mine.get(key) != was:
                changed.append(f"{_DRAFTER_FLAGS.get(key, key)}: {mine.get(key)!r} now, {was!r} in the checkpoint")
        if changed:
            raise DominoError(
                f"cannot resume {d} with other settings than it was made with ("
                + "; ".join(changed)
                + "). Rerun with the checkpoint's values, or use a new --out"
            )
        check_state(state, self.drafter.state_dict(), w_path, d / "drafter" / CONFIG_NAME)
        self.drafter.load_state_dict(state)
        self.drafter.refresh_head_rows()
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.step = st["step"]
        torch.set_rng_state(st["torch_rng"].cpu())
        self.best.load_state_dict(st.get("best"))
        self.phases = phases
        if grown:
            self.grow(had)
        else:
            self._set_total()
        return True

    def grow(self, had: int) -> None:
        """Continue on a data set grown from `had` samples: from this step on, each epoch draws all of
        them (a new epoch starts here), and what is left of --epochs is counted over the grown set."""
        start, n, first = self.phases[-1]
        spe = max(1, math.ceil(n / self.cfg.batch_size))
        done = first + (self.step - start) / spe  # epochs trained so far, a fraction where one was cut
        self.phases.append((self.step, len(self.samples), first + math.ceil((self.step - start) / spe)))
        self._set_total(done)
        log(
            f"resuming on a grown data set: {had} -> {len(self.samples)} training samples from step {self.step} "
            f"({done:.2f} epochs done); {self.total} steps in all"
        )

    def _set_total(self, epochs_done: float | None = None) -> None:
        """The run's length from its phases: --max-steps, or --epochs with the last phase's epoch size."""
        if self.cfg.max_steps:
            return
        start, n, first = self.phases[-1]
        if len(self.phases) == 1:
            return
        spe = max(1, math.ceil(n / self.cfg.batch_size))
        if epochs_done is None:  # a resume after the growth: the epochs done when it happened
            prev_start, prev_n, prev_first = self.phases[-2]
            epochs_done = prev_first + (start - prev_start) / max(1, math.ceil(prev_n / self.cfg.batch_size))
        self.total = max(start + 1, start + math.ceil((self.cfg.epochs - epochs_done) * spe))

    # ----- the loop -----
    def fit(self, on_step: Callable[[int], None] | None = None) -> dict:
        """Train to the last step, checkpointing every save_every steps; export the drafter at the end.

        The main process holds OUT/.lock throughout: a second run into the same directory stops
        with a clear error instead of interleaving metrics and checkpoints.
        on_step(step) runs after each step and its checkpoint (tests use it to die like kill -9).
        """
        if not self.dist.main:
            return self._fit(on_step)
        ensure_writable_dir(self.out)
        with exclusive_lock(self.out, "train"):
            return self._fit(on_step)

    def _fit(self, on_step: Callable[[int], None] | None) -> dict:
        metrics_path = self.out / "metrics.jsonl"
        if self.dist.main:
            if self.step == 0 and metrics_path.exists():
                metrics_path.unlink()
            elif metrics_path.exists():  # drop records past the checkpoint we resumed from
                kept = [l for l in metrics_path.read_text().splitlines() if l and json.loads(l)["step"] <= self.step]
                write_lines_atomic(metrics_path, kept)
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(
                total=self.total,
                initial=self.step,
                desc=f"train {self.drafter.config.head}",
                unit="step",
                dynamic_ncols=True,
                file=sys.stderr,
            )
        t0, tokens0, cpu0 = time.perf_counter(), 0, time.process_time()
        last = {}
        while self.step < self.total:
            rec = self.train_step()
            tokens0 += rec["tokens"]
            rec["tokens_per_s"] = tokens0 / max(1e-9, time.perf_counter() - t0)
            rec["cpu_s"] = time.process_time() - cpu0  # this process's CPU time so far (validation included)
            last = rec
            if self.dist.main:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            if self.validator is not None and self._validate_now():
                val = self.validate()
                if self.dist.main:
                    with open(metrics_path, "a") as f:
                        f.write(json.dumps(val) + "\n")
            if bar:
                bar.update(1)
                if self.step % self.cfg.log_every == 0 or self.step == self.total:
                    bar.set_postfix_str(_postfix(rec, self.last_val))
            if self.step % self.cfg.save_every == 0 or self.step == self.total:
                self.save_checkpoint()
            if on_step is not None:
                on_step(self.step)
        if bar:
            bar.close()
        if self.dist.main:
            self.write_drafter()
            plot_metrics(metrics_path, self.out / "training.png")
        return last

    def _validate_now(self) -> bool:
        """Validate every val_every steps and at the last step, but not at an interval's step a tenth of an
        interval or less before the last one: the final validation follows it a few steps later."""
        if self.step == self.total:
            return True
        return self.step % self.cfg.val_every == 0 and self.total - self.step > self.cfg.val_every // 10

    def validate(self) -> dict:
        """Measure the held-out acceptance now, keep the drafter if it is the best so far; the metrics record."""
        res = self.last_val = self.validator.evaluate(self.drafter, self.dist)
        self.best.offer(self.step, res, self.drafter)
        return {
            "kind": "val",
            "step": self.step,
            "val_tau": res.tau,
            "val_accept": res.conditional,
            "val_blocks": res.blocks,
            "best_step": self.best.step,
        }

    def write_drafter(self) -> None:
        """The trained drafter itself: config.json + model.safetensors in --out; with validation, the
        best drafter by validation tau and its acceptance.json (the in-memory drafter stays the last)."""
        state = self.drafter.state_dict() if self.best.state is None else self.best.state
        if self.save_dtype is not None:
            state = {k: v.to(self.save_dtype) if v.is_floating_point() else v for k, v in state.items()}
        save_checkpoint(self.drafter.config, state, self.out)
        if self.best.result is not None:
            acceptance = self.best.acceptance() | {"target_precision": getattr(self.target, "precision", None)}
            write_json_atomic(self.out / ACCEPTANCE_NAME, acceptance, indent=2)  # measured on this weight format


def _postfix(rec: dict, val=None) -> str:
    parts = [f"{k}={rec[k]:.3f}" for k in ("ce_final", "ce_base", "ce", "l1", "kl", "bce") if k in rec]
    if "lambda" in rec:
        parts.append(f"λ={rec['lambda']:.2f}")
    parts.append(f"tau={rec['tau_greedy']:.2f}")
    if "tau_sampled" in rec:
        parts.append(f"tauT1={rec['tau_sampled']:.2f}")
    if val is not None:
        parts.append(f"val_tau={val.tau:.2f}")
    parts.append(f"{rec.get('tokens_per_s', 0):.0f} tok/s")
    return " ".join(parts)
