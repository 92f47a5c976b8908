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
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .drafter import Drafter, DrafterConfig
from .errors import DominoError

IGNORE = -100


@dataclass
class TrainConfig:
    max_steps: int = 0            # 0: derive from epochs
    epochs: float = 1.0
    batch_size: int = 4           # sequences per optimiser step, over all ranks
    anchors: int = 32             # blocks per sequence
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.0
    clip: float = 1.0
    gamma: float | None = None    # position-decay; default 7 for block 16, scaled with the block
    lambda_start: float = 1.0     # domino curriculum: weight of CE(base) at the start ...
    lambda_decay: float = 1.0     # ... decaying to 0 over this fraction of the run
    max_seq_len: int = 2048
    seed: int = 0
    save_every: int = 50
    log_every: int = 5

    def position_weights(self, block: int) -> torch.Tensor:
        gamma = self.gamma if self.gamma is not None else 7.0 * block / 16
        return torch.exp(-torch.arange(block, dtype=torch.float32) / gamma)

    def curriculum_lambda(self, step: int, total: int) -> float:
        span = max(1.0, self.lambda_decay * total)
        return self.lambda_start * max(0.0, 1.0 - step / span)


# ----- blocks: anchors, labels, teacher-forced inputs (the one place these layouts are defined) -----

def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a with the token at a and at a+1 both supervised (assistant tokens)."""
    m = loss_mask.bool()
    return torch.nonzero(m[:-1] & m[1:]).squeeze(-1)


def make_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block: int):
    """For anchors [N]: block input tokens x_{a+k} [N, B] and labels x_{a+1+k} [N, B].

    Slot k reads x_{a+k} (teacher forcing; slot 0 is the anchor) and predicts x_{a+1+k}; labels
    past the sequence end or on unsupervised tokens are IGNORE.
    """
    s = input_ids.shape[0]
    offs = torch.arange(block)
    pos_in = anchors.unsqueeze(1) + offs           # [N, B]
    pos_lab = pos_in + 1
    tokens = input_ids[pos_in.clamp(max=s - 1)]
    labels = input_ids[pos_lab.clamp(max=s - 1)].clone()
    valid = (pos_lab < s) & loss_mask[pos_lab.clamp(max=s - 1)].bool()
    labels[~valid] = IGNORE
    return tokens, labels


def sample_anchors(loss_mask: torch.Tensor, n: int, rng: random.Random) -> torch.Tensor:
    cand = anchor_candidates(loss_mask).tolist()
    if len(cand) > n:
        cand = sorted(rng.sample(cand, n))
    return torch.tensor(cand, dtype=torch.long)


def acceptance_rate(p_d: torch.Tensor, p_t: torch.Tensor) -> torch.Tensor:
    """1 - TV(p_d, p_t): the chance rejection sampling keeps a draft. p_t may be restricted to the
    draft vocabulary, its missing mass then counts as disagreement."""
    return 1 - 0.5 * ((p_d - p_t).abs().sum(-1) + (1 - p_t.sum(-1)))


def simulated_tau(final_logits: torch.Tensor, labels: torch.Tensor,
                  target_probs: torch.Tensor | None = None) -> tuple[float, float | None]:
    """Expected tokens per cycle if these blocks were verified: greedy and (with p_t) sampling.

    greedy: 1 + sum_k prod_{i<=k} [argmax == label]; sampling: 1 + sum_k prod_{i<=k} (1 - TV_i).
    """
    valid = labels != IGNORE
    acc = ((final_logits.argmax(-1) == labels) & valid).float()
    greedy = float((1 + acc.cumprod(-1).sum(-1)).mean())
    sampled = None
    if target_probs is not None:
        p_d = torch.softmax(final_logits.float(), -1)
        keep = acceptance_rate(p_d, target_probs)
        keep = keep * valid.float()
        sampled = float((1 + keep.cumprod(-1).sum(-1)).mean())
    return greedy, sampled


# ----- distributed helpers -----

@dataclass
class Dist:
    rank: int = 0
    world: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            torch.distributed.all_reduce(t)
        return t

    def all_sum_grads(self, params) -> None:
        if self.world == 1:
            return
        for p in params:
            if p.grad is not None:
                torch.distributed.all_reduce(p.grad)


def init_distributed(device: torch.device) -> Dist:
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return Dist()
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend)
    return Dist(torch.distributed.get_rank(), torch.distributed.get_world_size())


# ----- the trainer -----

class Trainer:
    def __init__(self, target, drafter: Drafter, samples: list[dict], out: Path, cfg: TrainConfig,
                 dist: Dist | None = None, feature_cache: Path | None = None, progress: bool = True,
                 save_dtype: torch.dtype | None = None):
        self.target, self.drafter, self.samples, self.out, self.cfg = target, drafter, samples, Path(out), cfg
        self.dist = dist or Dist()
        self.feature_cache = Path(feature_cache) if feature_cache else None
        self.progress = progress and self.dist.main
        self.save_dtype = save_dtype
        self.device = target.device
        self.head = drafter.config.head
        self.block = drafter.config.block_size
        self.weights = cfg.position_weights(self.block).to(self.device)
        self.steps_per_epoch = max(1, math.ceil(len(samples) / cfg.batch_size))
        self.total = cfg.max_steps or max(1, math.ceil(cfg.epochs * self.steps_per_epoch))
        drafter.float().train()
        drafter.to(self.device)
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        warm = max(1, int(cfg.warmup * self.total))

        def schedule(step):
            if step < warm:
                return (step + 1) / warm
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, self.total - warm))))

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule)
        self.step = 0

    # ----- data order: a pure function of (seed, epoch), so a resumed run sees the same batches -----
    def batch_indices(self, step: int) -> list[int]:
        epoch, within = divmod(step, self.steps_per_epoch)
        order = list(range(len(self.samples)))
        random.Random(self.cfg.seed * 1000003 + epoch).shuffle(order)
        chosen = order[within * self.cfg.batch_size:(within + 1) * self.cfg.batch_size]
        return chosen[self.dist.rank::self.dist.world]

    # ----- target features -----
    def features(self, idx: list[int]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        need_final = self.head in ("markov", "rnn")
        result: dict[int, tuple] = {}
        todo = []
        for i in idx:
            cached = self._cache_read(i) if self.feature_cache else None
            if cached is not None:
                result[i] = cached
            else:
                todo.append(i)
        if todo:
            lens = [len(self.samples[i]["input_ids"]) for i in todo]
            width = max(lens)
            ids = torch.zeros(len(todo), width, dtype=torch.long)
            att = torch.zeros(len(todo), width, dtype=torch.long)
            for r, i in enumerate(todo):
                ids[r, :lens[r]] = torch.tensor(self.samples[i]["input_ids"])
                att[r, :lens[r]] = 1
            feats, final = self.target.features_and_logits(ids.to(self.device), att.to(self.device),
                                                           layer_ids=self.drafter.config.target_layer_ids)
            for r, i in enumerate(todo):
                item = (feats[r, :lens[r]].clone(), final[r, :lens[r]].clone() if need_final else None)
                result[i] = item
                if self.feature_cache:
                    self._cache_write(i, item)
        return [result[i] for i in idx]

    def _cache_path(self, i: int) -> Path:
        return self.feature_cache / f"{i:07d}.safetensors"

    def _cache_read(self, i: int):
        from safetensors.torch import load_file

        p = self._cache_path(i)
        if not p.exists():
            return None
        t = load_file(str(p), device=str(self.device))
        dt = self.target.dtype
        return t["features"].to(dt), (t["final"].to(dt) if "final" in t else None)

    def _cache_write(self, i: int, item) -> None:
        from safetensors.torch import save_file

        tensors = {"features": item[0].to(torch.float16).cpu().contiguous()}
        if item[1] is not None:
            tensors["final"] = item[1].to(torch.float16).cpu().contiguous()
        tmp = self._cache_path(i).with_suffix(f".tmp{os.getpid()}")  # runs may share one cache
        save_file(tensors, str(tmp))
        os.replace(tmp, self._cache_path(i))

    # ----- one sequence's loss -----
    def sequence_terms(self, i: int, feats: torch.Tensor, final_hidden, anchors: torch.Tensor, lam: float):
        """Weighted loss numerators for one sequence's blocks, and its stats. feats: [S, n*H]."""
        sample = self.samples[i]
        ids = torch.tensor(sample["input_ids"], device=self.device)
        mask = torch.tensor(sample["loss_mask"], device=self.device)
        anchors = anchors.to(self.device)
        tokens, labels = make_blocks(ids, mask, anchors, self.block)
        d = self.drafter
        z = d.forward_blocks(feats.unsqueeze(0), anchors, tokens[:, 0])        # [N, B, H]
        base = d.base_logits(z)                                                # [N, B, V'], frozen head
        prev_emb = d.embed(tokens).to(z.dtype)
        delta = d.head.teacher_forced(z, prev_emb, tokens)
        final = base if delta is None else base + delta
        if d.config.draft_vocab_size:  # labels outside the draft vocabulary cannot be proposed
            sub = d.to_draft_ids(labels.clamp_min(0))
            labels = torch.where((labels == IGNORE) | (sub < 0), torch.full_like(labels, IGNORE), sub)
        valid = labels != IGNORE
        w = self.weights.unsqueeze(0) * valid.float()                          # [N, B]

        def ce(logits):
            per = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                  ignore_index=IGNORE, reduction="none").view_as(labels)
            return (per * w).sum()

        terms = {}
        p_t = None
        if self.head in ("markov", "rnn"):
            pos = (anchors.unsqueeze(1) + torch.arange(self.block, device=self.device)).clamp(max=ids.shape[0] - 1)
            with torch.no_grad():
                p_t = torch.softmax(self.target.lm_head(final_hidden[pos]).to(z.dtype), -1)
                if d.config.draft_vocab_size:
                    p_t = p_t[..., d.draft_vocab]  # mass outside the draft vocabulary adds 1 - sum
            p_d = torch.softmax(final, -1)
            l1 = (2 * (1 - acceptance_rate(p_d, p_t)) * w).sum()  # L1 incl. mass outside a draft vocab
            terms["ce"] = ce(final)
            terms["l1"] = l1
            loss = 0.1 * terms["ce"] + 0.9 * l1
        elif self.head == "domino":
            terms["ce_final"], terms["ce_base"] = ce(final), ce(base)
            loss = (1 - lam) * terms["ce_final"] + lam * terms["ce_base"]
        else:
            terms["ce"] = ce(base)
            loss = terms["ce"]
        if d.confidence is not None:
            conf = d.confidence(z, prev_emb)
            with torch.no_grad():
                if p_t is None:  # label: analytic acceptance; without p_t, the greedy hit
                    label = (final.argmax(-1) == labels).float()
                else:
                    label = acceptance_rate(torch.softmax(final, -1), p_t)
            terms["bce"] = (F.binary_cross_entropy_with_logits(conf, label, reduction="none") * w).sum()
            loss = loss + terms["bce"]
        with torch.no_grad():
            g, s = simulated_tau(final.detach(), labels, p_t)
        return loss, terms, {"tau_greedy": g, "tau_sampled": s, "blocks": int(anchors.numel()),
                             "tokens": int(ids.shape[0])}

    def train_step(self) -> dict:
        cfg = self.cfg
        idx = self.batch_indices(self.step)
        lam = self.cfg.curriculum_lambda(self.step, self.total) if self.head == "domino" else 0.0
        # the normaliser first, summed over ranks, so every rank divides by the same number
        den = torch.zeros((), device=self.device)
        anchors = {}
        for i in idx:
            mask = torch.tensor(self.samples[i]["loss_mask"])
            # anchors depend on (seed, step, sample) only: resumed and multi-process runs agree
            a = sample_anchors(mask, cfg.anchors, random.Random(f"{cfg.seed}-{self.step}-{i}"))
            anchors[i] = a
            if a.numel():
                ids = torch.tensor(self.samples[i]["input_ids"])
                _, labels = make_blocks(ids, mask, a, self.block)
                den += (self.weights.cpu() * (labels != IGNORE).float()).sum().to(self.device)
        den = self.dist.all_sum(den).clamp_min(1e-8)
        self.opt.zero_grad(set_to_none=True)
        feats = self.features(idx)
        sums: dict[str, float] = {}
        stats = []
        for i, (f, fin) in zip(idx, feats):
            if anchors[i].numel() == 0:
                continue
            loss, terms, st = self.sequence_terms(i, f, fin, anchors[i], lam)
            (loss / den).backward()
            for k, v in terms.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach())
            stats.append(st)
        self.dist.all_sum_grads(self.params)
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.clip))
        self.opt.step()
        self.sched.step()
        self.step += 1
        # metrics, reduced over ranks
        keys = sorted(sums)
        vec = torch.tensor([sums[k] for k in keys] + [
            sum(s["tau_greedy"] * s["blocks"] for s in stats),
            sum((s["tau_sampled"] or 0.0) * s["blocks"] for s in stats),
            sum(s["blocks"] for s in stats), sum(s["tokens"] for s in stats)], dtype=torch.float64,
            device=self.device)
        vec = self.dist.all_sum(vec)
        dn = float(den)
        rec = {k: float(vec[j]) / dn for j, k in enumerate(keys)}
        blocks = max(1.0, float(vec[-2]))
        rec.update(step=self.step, lr=self.sched.get_last_lr()[0], grad_norm=gnorm,
                   tau_greedy=float(vec[-4]) / blocks, tokens=int(vec[-1]))
        if self.head in ("markov", "rnn"):
            rec["tau_sampled"] = float(vec[-3]) / blocks
        if self.head == "domino":
            rec["lambda"] = lam
        return rec

    # ----- checkpoints -----
    @property
    def state_dir(self) -> Path:
        return self.out / "train_state"

    def save_checkpoint(self) -> None:
        if not self.dist.main:
            return
        tmp = self.out / f"train_state.tmp{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        self.drafter.save_pretrained(tmp / "drafter")
        torch.save({"opt": self.opt.state_dict(), "sched": self.sched.state_dict(), "step": self.step,
                    "train_config": asdict(self.cfg), "num_samples": len(self.samples),
                    "torch_rng": torch.get_rng_state()}, tmp / "trainer.pt")
        old = self.out / "train_state.old"
        if self.state_dir.exists():
            os.replace(self.state_dir, old)
        os.replace(tmp, self.state_dir)
        if old.exists():
            shutil.rmtree(old)

    def load_checkpoint(self) -> bool:
        from safetensors.torch import load_file

        d = self.state_dir
        if not d.exists() and (self.out / "train_state.old").exists():
            d = self.out / "train_state.old"  # killed between the two renames
        if not (d / "trainer.pt").exists():
            return False
        st = torch.load(d / "trainer.pt", map_location=self.device, weights_only=False)
        if st["num_samples"] != len(self.samples):
            raise DominoError(f"{d}: checkpoint was made on {st['num_samples']} samples, the data now has "
                              f"{len(self.samples)}; use a new --out or the original data")
        for k in ("batch_size", "seed", "anchors", "max_steps", "epochs"):
            if st["train_config"].get(k) != getattr(self.cfg, k):
                raise DominoError(f"{d}: cannot resume with {k}={getattr(self.cfg, k)!r}; "
                                  f"the checkpoint used {st['train_config'].get(k)!r}")
        self.drafter.load_state_dict(load_file(str(d / "drafter" / "model.safetensors"), device=str(self.device)))
        self.drafter.refresh_head_rows()
        self.opt.load_state_dict(st["opt"])
        self.sched.load_state_dict(st["sched"])
        self.step = st["step"]
        torch.set_rng_state(st["torch_rng"].cpu())
        return True

    # ----- the loop -----
    def fit(self, stop_after: int | None = None) -> dict:
        metrics_path = self.out / "metrics.jsonl"
        if self.dist.main:
            self.out.mkdir(parents=True, exist_ok=True)
            if self.step == 0 and metrics_path.exists():
                metrics_path.unlink()
            elif metrics_path.exists():  # drop records past the checkpoint we resumed from
                kept = [l for l in metrics_path.read_text().splitlines() if l and json.loads(l)["step"] <= self.step]
                metrics_path.write_text("".join(l + "\n" for l in kept))
        bar = None
        if self.progress:
            from tqdm import tqdm
            bar = tqdm(total=self.total, initial=self.step, desc=f"train {self.head}", unit="step",
                       dynamic_ncols=True, file=sys.stderr)
        t0, tokens0 = time.perf_counter(), 0
        last = {}
        while self.step < self.total:
            rec = self.train_step()
            tokens0 += rec["tokens"]
            rec["tokens_per_s"] = tokens0 / max(1e-9, time.perf_counter() - t0)
            last = rec
            if self.dist.main:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")
            if bar:
                bar.update(1)
                if self.step % self.cfg.log_every == 0 or self.step == self.total:
                    bar.set_postfix_str(_postfix(rec))
            if self.step % self.cfg.save_every == 0 or self.step == self.total:
                self.save_checkpoint()
            if stop_after is not None and self.step >= stop_after:
                os._exit(137)  # test hook: die like kill -9, no cleanup
        if bar:
            bar.close()
        if self.dist.main:
            self.export()
            plot_metrics(metrics_path, self.out / "training.png")
        return last

    def export(self) -> None:
        """The trained drafter itself: config.json + model.safetensors in --out."""
        d = self.drafter
        if self.save_dtype is not None:
            import copy
            d = copy.deepcopy(d).to(self.save_dtype)
            d._borrowed = self.drafter._borrowed
        d.save_pretrained(self.out)


def _postfix(rec: dict) -> str:
    parts = [f"{k}={rec[k]:.3f}" for k in ("ce_final", "ce_base", "ce", "l1", "bce") if k in rec]
    if "lambda" in rec:
        parts.append(f"λ={rec['lambda']:.2f}")
    parts.append(f"tau={rec['tau_greedy']:.2f}")
    if "tau_sampled" in rec:
        parts.append(f"tauT1={rec['tau_sampled']:.2f}")
    parts.append(f"{rec.get('tokens_per_s', 0):.0f} tok/s")
    return " ".join(parts)


def plot_metrics(metrics_path: Path, png: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    recs = [json.loads(l) for l in metrics_path.read_text().splitlines() if l.strip()]
    if not recs:
        return False
    steps = [r["step"] for r in recs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for k in ("ce_final", "ce_base", "ce", "l1", "bce"):
        if k in recs[0]:
            a.plot(steps, [r[k] for r in recs], label=k)
    a.set_xlabel("step"), a.set_ylabel("loss (per weighted slot)"), a.legend(), a.set_title("losses")
    b.plot(steps, [r["tau_greedy"] for r in recs], label="greedy")
    if "tau_sampled" in recs[0]:
        b.plot(steps, [r["tau_sampled"] for r in recs], label="T=1")
    b.set_xlabel("step"), b.set_ylabel("simulated tau"), b.legend(), b.set_title("simulated tau")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def frequent_tokens(samples: list[dict], n: int, vocab_size: int, always: list[int]) -> torch.Tensor:
    """The n most frequent supervised tokens (plus `always`, e.g. EOS), sorted: a draft vocabulary.

    Ties and unseen slots are filled by ascending id (BPE ids roughly follow merge frequency).
    """
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in samples:
        ids = torch.tensor(s["input_ids"])
        counts.index_add_(0, ids, torch.tensor(s["loss_mask"], dtype=torch.float64))
    counts -= torch.arange(vocab_size, dtype=torch.float64) * 1e-9  # ties: lower id first
    counts[torch.tensor(always, dtype=torch.long)] = float("inf")
    return counts.topk(n).indices.sort().values


def validate_samples(samples: list[dict], target, max_len: int, source: str) -> None:
    """Fail before anything is written: lengths, vocabulary, masks."""
    if not samples:
        raise DominoError(f"{source}: no samples to train on")
    limit = min(max_len, int(getattr(target.model.config, "max_position_embeddings", max_len) or max_len))
    usable = 0
    for n, s in enumerate(samples):
        ids, mask = s["input_ids"], s["loss_mask"]
        where = s.get("id", f"sample {n}")
        if len(ids) != len(mask):
            raise DominoError(f"{source}: {where}: {len(ids)} tokens but {len(mask)} loss-mask entries")
        if len(ids) > limit:
            raise DominoError(f"{source}: {where} has {len(ids)} tokens, longer than the context limit {limit} "
                              f"(--max-seq-len / the target's max_position_embeddings)")
        if ids and max(ids) >= target.vocab_size:
            raise DominoError(f"{source}: {where} has token id {max(ids)} outside the target's vocabulary "
                              f"({target.vocab_size}); was the data made for another target?")
        usable += any(a and b for a, b in zip(mask[:-1], mask[1:]))
    if usable == 0:
        raise DominoError(f"{source}: every sample is fully masked (no two consecutive supervised tokens)")


# ----- command line -----

def cmd_train(args) -> int:
    from .cli import load_target, log
    from .data import load_dataset_dir

    target = load_target(args)
    out = Path(args.out)
    meta, samples = load_dataset_dir(args.data, target=target)
    cfg = TrainConfig(max_steps=args.max_steps, epochs=args.epochs, batch_size=args.batch_size, anchors=args.anchors,
                      lr=args.lr, gamma=args.gamma, lambda_start=args.lambda_start, lambda_decay=args.lambda_decay,
                      max_seq_len=args.max_seq_len, seed=args.seed, save_every=args.save_every)
    validate_samples(samples, target, cfg.max_seq_len, str(args.data))
    dev = target.device
    dist = init_distributed(dev)
    if dist.world > 1 and dev.type == "cuda":
        torch.cuda.set_device(dist.rank % torch.cuda.device_count())
    if (out / "train_state").exists() and not args.resume:
        raise DominoError(f"{out} already holds a training checkpoint; pass --resume to continue it "
                          f"or choose another --out")
    if args.init:
        drafter = Drafter.from_pretrained(args.init, target=target)
    else:
        if args.layer_ids:
            from .target import check_layer_ids
            target.layer_ids = check_layer_ids([int(x) for x in args.layer_ids.split(",")], target.num_layers)
        torch.manual_seed(args.seed)
        drafter = Drafter(DrafterConfig.for_target(
            target, head=args.head, num_layers=args.layers, block_size=args.block_size,
            intermediate_size=args.intermediate_size, gru_hidden_size=args.gru_hidden_size, rank=args.rank,
            confidence_head=args.confidence_head, mask_token_id=args.mask_token_id,
            draft_vocab_size=args.draft_vocab))
        with torch.no_grad():
            if drafter.mask_embedding is not None:
                drafter.mask_embedding.copy_(target.embed_weight.float().mean(0))
            if args.draft_vocab:
                drafter.draft_vocab.copy_(frequent_tokens(samples, args.draft_vocab, target.vocab_size,
                                                          target.eos_ids))
        drafter.attach(target)
        if args.draft_vocab and dist.main:
            dv = set(drafter.draft_vocab.tolist())
            sup = [t for s in samples for t, m in zip(s["input_ids"], s["loss_mask"]) if m]
            log(f"draft vocabulary: {args.draft_vocab} tokens cover {sum(t in dv for t in sup) / max(1, len(sup)):.1%} "
                f"of the supervised training tokens")
    cache = Path(args.feature_cache) if args.feature_cache else None
    if cache and dist.main:
        tokens = sum(len(s["input_ids"]) for s in samples)
        per_token = 2 * target.hidden_size * (len(drafter.config.target_layer_ids) + (drafter.config.head in ("markov", "rnn")))
        log(f"feature cache {cache}: {tokens} tokens x {per_token} bytes = {tokens * per_token / 1e9:.2f} GB "
            f"(fp16, {len(drafter.config.target_layer_ids)} layers)")
        cache.mkdir(parents=True, exist_ok=True)
    save_dtype = {"float32": None, "float16": torch.float16, "bfloat16": torch.bfloat16}[args.save_dtype]
    trainer = Trainer(target, drafter, samples, out, cfg, dist=dist, feature_cache=cache, save_dtype=save_dtype)
    if args.resume and trainer.load_checkpoint() and dist.main:
        log(f"resumed {out} at step {trainer.step}/{trainer.total}")
    if dist.main:
        n = drafter.num_trainable_parameters()
        log(f"training a {drafter.config.head} drafter ({n / 1e6:.2f}M parameters) on {len(samples)} samples "
            f"for {trainer.total} steps ({trainer.steps_per_epoch} per epoch), {dist.world} process(es) on {dev}")
    last = trainer.fit(stop_after=args.stop_after_step)
    if dist.main and last:
        log(f"done: {out} (simulated greedy tau {last['tau_greedy']:.2f}); metrics in {out / 'metrics.jsonl'}")
    if dist.world > 1:
        torch.distributed.destroy_process_group()
    return 0


def add_train_parser(sub) -> None:
    import argparse

    from .cli import add_arch_args, add_target_args

    p = sub.add_parser("train", help="train a drafter on prepared data",
                       description="Train a drafter for TARGET on data from `dominospec prepare-data`, with target "
                                   "features computed online. Works under torchrun (DDP: gloo on CPU, NCCL on GPU).")
    add_target_args(p)
    p.add_argument("--data", required=True, help="directory written by prepare-data")
    p.add_argument("--out", required=True, help="output directory: the drafter, metrics.jsonl, training.png")
    add_arch_args(p)
    p.add_argument("--init", help="start from this drafter directory instead of a fresh one")
    p.add_argument("--draft-vocab", type=int, default=0,
                   help="score only the N most frequent supervised tokens of the data (0: full vocabulary); "
                        "lossless, and much cheaper per draft on CPU")
    p.add_argument("--max-steps", type=int, default=0, help="optimiser steps (default: from --epochs)")
    p.add_argument("--epochs", type=float, default=1.0, help="default %(default)s")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per step, all processes (default %(default)s)")
    p.add_argument("--anchors", type=int, default=32, help="blocks per sequence (default %(default)s)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate (default %(default)s)")
    p.add_argument("--gamma", type=float, default=None, help="position-decay constant (default 7*block/16)")
    p.add_argument("--lambda-start", type=float, default=1.0, help="domino curriculum start (default %(default)s)")
    p.add_argument("--lambda-decay", type=float, default=1.0,
                   help="fraction of the run over which lambda falls to 0 (default %(default)s)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="longest sample accepted (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-every", type=int, default=50, help="checkpoint interval in steps (default %(default)s)")
    p.add_argument("--save-dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                   help="dtype of the exported drafter weights (default %(default)s)")
    p.add_argument("--feature-cache", default=None, help="cache target features here (fp16) for multi-epoch runs")
    p.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    p.add_argument("--stop-after-step", type=int, default=None, help=argparse.SUPPRESS)  # crash test hook
    p.set_defaults(func=cmd_train)
