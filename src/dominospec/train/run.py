"""One training run from prepared data to an exported drafter: what `dominospec train` calls.

    job = TrainJob(data="data/smollm2-135m", out="runs/d1", config=TrainConfig(epochs=2), arch={"num_layers": 1})
    job.check_outputs()           # optional: fail on an unwritable --out before loading the target
    trainer = train_drafter(target, job)

Under torchrun each process calls `train_drafter` with the same job; one process is world 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..data.dataset import load_dataset_dir
from ..drafter import Drafter
from ..errors import DominoError
from ..io import ensure_writable_dir
from ..log import log
from ..targets.features import FeatureCache
from .distributed import init_distributed
from .samples import (
    draft_vocab_coverage,
    frequent_tokens,
    fresh_drafter,
    init_from_target_layer,
    validate_samples,
)
from .trainer import TrainConfig, Trainer, read_state_dir, read_train_state
from .validate import Validator, shared_sequences, split_validation

TRAIN_LABELS = ("all", "on-policy", "off-policy")


@dataclass(kw_only=True)
class TrainJob:
    """Where the data comes from and goes to, and how the drafter starts; the optimisation is `config`."""

    data: str | Path  # a prepare-data directory
    out: str | Path  # the drafter, metrics.jsonl, training.png, train_state/
    config: TrainConfig = field(default_factory=TrainConfig)
    arch: dict = field(default_factory=dict)  # DrafterConfig fields for a fresh drafter (head, num_layers, ...)
    # score only the N most frequent supervised tokens (0: the full vocabulary); None: a fresh drafter's 0,
    # --init's own vocabulary (given with --init, the vocabulary is chosen again from this data)
    draft_vocab: int | None = None
    init: str | Path | None = None  # start from this drafter directory instead of a fresh one
    init_head: dict | None = None  # with init: a new untrained head on its backbone (head + head fields)
    init_layers: int | None = None  # with init: grow the drafter to this many backbone layers (Drafter.with_layers)
    init_fuse: bool = False  # with init: add the fused last context row, starting at zero (Drafter.with_fusion)
    init_from_layer: int | None = None  # a fresh drafter's layers start from the target's layers J, J+1, ...
    val_data: str | Path | None = None  # validate on this directory instead of a held-out part of `data`
    val_fraction: float = 0.05  # conversations held out for validation, by id hash
    # train on the first N training samples only (after the split), or (N, M): the first N on-policy and M off-policy
    train_samples: int | tuple[int, int] | None = None
    train_labels: str = "all"  # train on these samples only: all, on-policy, off-policy (validation is unchanged)
    feature_cache: str | Path | None = None  # target features cached here (fp16) for multi-epoch runs
    features_only: bool = False  # fill feature_cache for every training sample, then stop (no training)
    resume: bool = False  # continue from the checkpoint in `out`
    resume_from: str | Path | None = None  # continue from this copy of a run's train_state (kept in a repository)
    save_dtype: torch.dtype | None = None  # of the exported weights (None: float32)
    allow_other_target: bool = False  # accept data written by another model with the same tokenizer
    memory_gb: float = 4.0  # the packed step keeps at most this much of the samples' fp16 features in memory

    def __post_init__(self):
        if self.draft_vocab is not None and (not isinstance(self.draft_vocab, int) or self.draft_vocab < 0):
            raise DominoError(f"--draft-vocab must be at least 0, got {self.draft_vocab}")
        if not 0 <= self.val_fraction < 1:
            raise DominoError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.train_labels not in TRAIN_LABELS:
            raise DominoError(f"--train-labels must be one of {', '.join(TRAIN_LABELS)}, got {self.train_labels!r}")
        if isinstance(self.train_samples, tuple) and self.train_labels != "all":
            raise DominoError("--train-samples N,M counts on- and off-policy samples: it needs --train-labels all")
        if not (isinstance(self.memory_gb, (int, float)) and 0 <= self.memory_gb < float("inf")):
            raise DominoError(f"--memory-gb must be a finite number >= 0, got {self.memory_gb}")
        if self.train_samples is not None and min(_as_tuple(self.train_samples)) < 1:
            raise DominoError(f"--train-samples must be at least 1, got {self.train_samples}")
        if self.init_head and not self.init:
            raise DominoError("a new head on a trained backbone needs --init DIR")
        if self.init_layers is not None and not self.init:
            raise DominoError("growing a drafter by layers needs --init DIR")
        if self.init_fuse and not self.init:
            raise DominoError("adding a context fusion to a trained drafter needs --init DIR")
        if self.features_only and not self.feature_cache:
            raise DominoError("--features-only fills a feature cache: pass --feature-cache DIR")
        if self.init and self.init_from_layer is not None:
            raise DominoError("--init-from-layer starts a fresh drafter; it cannot be combined with --init")

    def check_outputs(self) -> tuple[Path, Path | None]:
        """The output directory and feature cache, created and writable (before anything slow runs)."""
        out = ensure_writable_dir(self.out)
        cache = ensure_writable_dir(self.feature_cache, "--feature-cache") if self.feature_cache else None
        if (out / "train_state").exists() and not self.resume and not self.resume_from:
            raise DominoError(
                f"{out} already holds a training checkpoint; pass --resume to continue it or choose another --out"
            )
        if self.resume_from:
            if (out / "train_state").exists():
                raise DominoError(
                    f"{out} already holds a training checkpoint: continue it with --resume, or give --resume-from "
                    "a new --out"
                )
            read_state_dir(Path(self.resume_from))  # a missing or damaged one is named now
        elif self.resume:
            read_train_state(out)  # a damaged checkpoint is named now, not after the target loads
        return out, cache


def _as_tuple(n) -> tuple:
    return n if isinstance(n, tuple) else (n,)


def training_subset(samples: list[dict], labels: str, n, where: str, held_out: int, asked: str = "") -> list[dict]:
    """The training samples of one labels kind (`all`, `on-policy`, `off-policy`), the first `n` in data set
    order: the points of a scaling curve are prefixes of one another, judged on the same held-out set.
    n = (N, M): the first N on-policy and the first M off-policy samples, in data set order (a mix).
    asked: the flag the user gave, for the messages (default: --train-labels / --train-samples N)."""
    if isinstance(n, tuple):
        flag = f"--train-samples {n[0]},{n[1]}"
        on = training_subset(samples, "on-policy", n[0], where, held_out, f"{flag} (its on-policy count)")
        off = training_subset(samples, "off-policy", n[1], where, held_out, f"{flag} (its off-policy count)")
        chosen = {id(s) for s in on + off}
        return [s for s in samples if id(s) in chosen]
    if labels != "all":
        on = labels == "on-policy"
        samples = [s for s in samples if (s.get("labels", "on-policy") == "on-policy") == on]
        if not samples:
            raise DominoError(f"{asked or f'--train-labels {labels}'}: {where} holds no {labels} training sample")
    if n is not None:
        if n > len(samples):
            raise DominoError(
                f"{asked or f'--train-samples {n}'}: {where} has only {len(samples)} training samples "
                f"({labels}, after holding out {held_out} for validation)"
            )
        samples = samples[:n]
    return samples


def new_draft_vocab(drafter, target, samples: list[dict], n: int, source) -> Drafter:
    """--init DIR --draft-vocab N: DIR's drafter scoring the N most frequent supervised tokens of this data
    (0: the full vocabulary); the head's rows follow their tokens, new tokens start at the mean row."""
    if n > target.vocab_size:
        raise DominoError(f"--draft-vocab {n} exceeds the target's vocabulary of {target.vocab_size}")
    before = draft_vocab_coverage(drafter, samples)
    ids = frequent_tokens(samples, n, target.vocab_size, target.eos_ids) if n else None
    old = set(drafter.draft_vocab.tolist()) if drafter.config.draft_vocab_size else None
    fresh = drafter.with_draft_vocab(ids).attach(target)
    added = n - len(old & set(ids.tolist())) if old is not None and ids is not None else None
    after = draft_vocab_coverage(fresh, samples)
    log(
        f"draft vocabulary of {source} chosen again from this data: {drafter.config.out_vocab} -> "
        f"{fresh.config.out_vocab} tokens, covering {before:.1%} -> {after:.1%} of the supervised training tokens"
        + (f"; {added} tokens new to it start at the mean head row" if added is not None else "")
    )
    return fresh


def train_drafter(target, job: TrainJob, progress: bool = True) -> Trainer:
    """Load and check the data, build or load the drafter, train, export the best; returns the Trainer."""
    cfg = job.config
    out, cache = job.check_outputs()
    meta, samples = load_dataset_dir(job.data, target=target, allow_other_target=job.allow_other_target)
    samples = validate_samples(samples, target, cfg.max_seq_len, str(job.data))
    if job.val_data:
        val_samples = load_dataset_dir(job.val_data, target=target, allow_other_target=job.allow_other_target)[1]
        val_samples = validate_samples(val_samples, target, cfg.max_seq_len, str(job.val_data))
        shared = shared_sequences(samples, val_samples)
        if shared:
            log(
                f"warning: {shared} of the {len(val_samples)} samples in {job.val_data} also appear in {job.data}; "
                f"validation on them overstates acceptance"
            )
    else:
        samples, val_samples = split_validation(samples, job.val_fraction)
    samples = training_subset(samples, job.train_labels, job.train_samples, f"{job.data}", len(val_samples))
    dev = target.device
    dist = init_distributed(dev)
    if dist.world > 1 and dev.type == "cuda":
        torch.cuda.set_device(dist.rank % torch.cuda.device_count())
    if job.init:
        drafter = Drafter.from_pretrained(job.init, target=target)
        if job.init_head and job.init_head["head"] != drafter.config.head:
            old_head = drafter.config.head
            drafter = drafter.with_head(**job.init_head).attach(target)
            new_head = drafter.config.head
            log(f"kept the backbone of {job.init} and replaced its {old_head} head by an untrained {new_head} head")
        if job.init_layers not in (None, drafter.config.num_layers):  # fewer are refused by with_layers
            old_layers = drafter.config.num_layers
            drafter = drafter.with_layers(job.init_layers).attach(target)
            log(f"grew {job.init} from {old_layers} to {job.init_layers} backbone layers (the new add nothing yet)")
        if job.init_fuse and drafter.fuse is None:
            drafter = drafter.with_fusion().attach(target)
            log(f"{job.init} now fuses the last context row into its block inputs (the projection starts at zero)")
        if job.draft_vocab is not None:
            drafter = new_draft_vocab(drafter, target, samples, job.draft_vocab, job.init)
    else:
        drafter = fresh_drafter(target, samples, job.arch, job.draft_vocab or 0, cfg.seed)
        if job.init_from_layer is not None:
            copied = init_from_target_layer(drafter, target, job.init_from_layer)
            log(f"draft layers start from target layer(s) {job.init_from_layer}..: {len(copied)} weights copied")
        if job.draft_vocab and dist.main:
            log(
                f"draft vocabulary: {job.draft_vocab} tokens cover {draft_vocab_coverage(drafter, samples):.1%} "
                f"of the supervised training tokens"
            )
    if meta.get("enable_thinking") is not None:  # generate says so when used in the other mode
        drafter.config.extra["enable_thinking"] = meta["enable_thinking"]
    validator = None
    if val_samples:
        val_cache = FeatureCache(cache, target) if cache else None
        validator = Validator(target, val_samples, cfg.val_anchors, walk=cfg.val_walk, feature_cache=val_cache)
    trainer = Trainer(
        target,
        drafter,
        samples,
        out,
        cfg,
        dist=dist,
        feature_cache=cache,
        progress=progress,
        save_dtype=job.save_dtype,
        validator=validator,
        memory_gb=job.memory_gb,
    )
    if cache and dist.main:
        tokens = sum(len(s["input_ids"]) for s in samples)
        # + the final hidden state where the objective reads it (--features-only always stores it)
        rows = len(drafter.config.target_layer_ids) + (trainer.needs_target_probs or job.features_only)
        per_token = 2 * target.hidden_size * rows
        log(
            f"feature cache {cache}: {tokens} tokens x {per_token} bytes = {tokens * per_token / 1e9:.2f} GB "
            f"(fp16, {len(drafter.config.target_layer_ids)} layers)"
        )
    if job.features_only:
        computed, cached = trainer.fill_feature_cache()
        held_out = validator.fill_cache(drafter.config.target_layer_ids, dist) if validator else 0
        if dist.main:
            log(
                f"feature cache {cache}: {computed} training samples computed, {cached} already there, "
                f"{held_out} held-out samples computed; "
                f"trainings with the same layers read them (--features-only: nothing trained)"
            )
        return trainer
    if job.resume_from:
        trainer.load_checkpoint(Path(job.resume_from))
        if dist.main:
            log(f"resumed {job.resume_from} at step {trainer.step}/{trainer.total}; checkpoints go to {out}")
    elif job.resume:
        resumed = trainer.load_checkpoint()
        if dist.main:
            log(
                f"resumed {out} at step {trainer.step}/{trainer.total}"
                if resumed
                else f"--resume: no checkpoint found in {out / 'train_state'}, starting fresh"
            )
    if dist.main:
        n = drafter.num_trainable_parameters()
        log(
            f"training a {drafter.config.head} drafter ({n / 1e6:.2f}M parameters) on {len(samples)} samples "
            f"for {trainer.total} steps ({trainer.steps_per_epoch} per epoch), {dist.world} process(es) on {dev}"
        )
        if val_samples:
            where = job.val_data or f"held out by conversation id hash (--val-fraction {job.val_fraction})"
            log(
                f"validation: {len(val_samples)} samples ({where}) every {cfg.val_every} steps; "
                f"the best drafter by validation tau is exported"
            )
        else:
            log("validation: none (no sample held out at this --val-fraction); the last step is exported")
    last = trainer.fit()
    if dist.main and last:
        log(f"done: {out} (simulated greedy tau {last['tau_greedy']:.2f}); metrics in {out / 'metrics.jsonl'}")
    if dist.main and trainer.best.result is not None:
        log(
            f"exported the best drafter by validation: step {trainer.best.step}, validation tau "
            f"{trainer.best.result.tau:.2f}; acceptance by position in {out / 'acceptance.json'}"
        )
    if dist.world > 1:
        torch.distributed.destroy_process_group()
    return trainer
