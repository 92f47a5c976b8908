"""Where a drafter's greedy acceptance is lost: by how sure the target itself is, and how near the miss was.

    taskset -c 1 python scripts/where_lost.py --drafter DIR [--drafter DIR2] --json runs/where.json

On the target's greedy answers to the prompts of prompts/eval-*.jsonl (what `bench` decodes at T=0),
every block a greedy decode visits (the walk of `--val-walk`) is judged slot by slot, as validation
judges it. Two breakdowns of the slots reached (every slot before them accepted):

  by confidence  the target's own probability of its greedy token at that position, in bands: the
                 share of slots in each band and the drafter's acceptance there. A target that is
                 unsure at many positions caps greedy acceptance for any drafter that cannot run it.
  by rank        where the target's token sits in the drafter's distribution: outside the draft
                 vocabulary, at rank 1 (accepted), within the top 2 / 4 / 16. A token the drafter ranks
                 second is a near miss (a better head or a tree of candidates could reach it); one
                 outside its top 16 is a miss of the backbone.

Beside them, what the walk would accept had each block's draft vocabulary been extended by the tokens
already in its context (prompt and answer so far) that the vocabulary lacks, scored by the frozen LM head
plus the head's mean correction: a measure of what a context vocabulary would buy, no training needed.

Reported for the first slot and for all slots together, per drafter, with a line per prompt set; --json keeps
the counts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dominospec.bench.runner import load_prompt_sets
from dominospec.drafter import Drafter
from dominospec.drafter.checkpoint import shipped_drafter_dir
from dominospec.targets import Target
from dominospec.train.blocks import teacher_forced_blocks
from dominospec.train.validate import (
    ANCHOR_CHUNK,
    ValResult,
    acceptance_counts,
    accepted_lengths,
    greedy_answer_samples,
    greedy_hits,
    validation_anchors,
    walked_rows,
)

BANDS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.01)  # the target's probability of its own greedy token
RANKS = ("outside vocab", "rank 1", "rank 2", "rank 3-4", "rank 5-16", "rank > 16")


def rank_class(rank: torch.Tensor, in_vocab: torch.Tensor) -> torch.Tensor:
    """Index into RANKS for each slot: rank is 1-based in the drafter's draft-vocabulary logits."""
    cls = torch.full_like(rank, 5)
    cls[rank <= 16] = 4
    cls[rank <= 4] = 3
    cls[rank == 2] = 2
    cls[rank == 1] = 1
    cls[~in_vocab] = 0
    return cls


def empty_counts(block: int) -> dict:
    n = len(BANDS) - 1
    counts = {
        g: {"band_reached": [0] * n, "band_accepted": [0] * n, "rank": [0] * len(RANKS), "seen": [0]}
        for g in ("first", "all")
    }
    for key in ("walk", "walk_context_vocab"):
        counts[key] = {"judged": [0] * block, "passed": [0] * block}
    return counts


def context_vocab_hits(drafter, target, parts, first_at: dict, anchors, logits, labels, hit) -> torch.Tensor:
    """[N, B] greedy hits had the draft vocabulary been extended, per block, by the context's own tokens.

    A block anchored at a may also propose any token of x_0..x_a outside the draft vocabulary, with the
    frozen LM head's logit on the backbone output plus the mean of the head's correction over the draft
    vocabulary (what a head row set to the mean of its rows gives: `Drafter.with_draft_vocab`'s start).
    first_at: each token of the sequence -> where it first appears; hit: the plain greedy hits.
    """
    tokens = torch.tensor(sorted(first_at))
    extra_t = tokens[drafter.to_draft_ids(tokens) < 0]  # none for a drafter over the whole vocabulary
    if not extra_t.numel():
        return hit
    extra = extra_t.tolist()
    first = torch.tensor([first_at[t] for t in extra])
    z = torch.cat([p.z for p in parts]).float()
    base = torch.cat([p.base for p in parts]).float()
    rows = target.output_embeddings().weight[extra_t].float()
    ext = z @ rows.T + (logits - base).mean(-1, keepdim=True)  # [N, B, E]
    seen = first.unsqueeze(0) <= anchors.unsqueeze(1)  # [N, E]: in the context when block a is drafted
    ext = ext.masked_fill(~seen.unsqueeze(1), float("-inf"))
    best_in, arg_in = logits.max(-1)
    best_ext, arg_ext = ext.max(-1)
    pick = torch.where(best_ext > best_in, extra_t[arg_ext], drafter.to_target_ids(arg_in))
    return pick == labels


def merged(by_set: dict) -> dict:
    """The counts of every set added up."""
    out = None
    for counts in by_set.values():
        if out is None:
            out = {g: {key: list(v) for key, v in c.items()} for g, c in counts.items()}
            continue
        for g, c in counts.items():
            for key, values in c.items():
                out[g][key] = [a + b for a, b in zip(out[g][key], values)]
    return out


def walked(counts: dict, key: str) -> ValResult:
    return ValResult(counts[key]["judged"], counts[key]["passed"])


def judge(drafter, target, samples: list[dict], finals: list[torch.Tensor], feats: list[torch.Tensor]) -> dict:
    """Counts over the walked blocks, per prompt set: [slot group][band] reached/accepted, [slot group][rank class]."""
    block = drafter.config.block_size
    by_set: dict[str, dict] = {}
    for s, f, final in zip(samples, feats, finals):
        ids, mask = torch.tensor(s["input_ids"]), torch.tensor(s["loss_mask"])
        anchors = validation_anchors(mask, 0)
        if not anchors.numel():
            continue
        counts = by_set.setdefault(s["id"].rsplit(":", 1)[0], empty_counts(block))
        conf = torch.softmax(target.lm_head(final).float(), -1).amax(-1)  # [S] the target's top probability
        parts = [teacher_forced_blocks(drafter, f, ids, mask, a) for a in anchors.split(ANCHOR_CHUNK)]
        labels = torch.cat([p.labels for p in parts])
        logits = torch.cat([p.final for p in parts]).float()
        hit, has_label = (torch.cat(x) for x in zip(*(greedy_hits(drafter, p) for p in parts)))
        first_at = {}  # token -> where it first appears in the sequence
        for i, x in enumerate(ids.tolist()):
            first_at.setdefault(x, i)
        ext_hit = context_vocab_hits(drafter, target, parts, first_at, anchors, logits, labels, hit) & has_label
        rows = walked_rows(anchors, hit)
        for key, h, r in (("walk", hit, rows), ("walk_context_vocab", ext_hit, walked_rows(anchors, ext_hit))):
            judged, passed = acceptance_counts(h[r], has_label[r])
            counts[key]["judged"] = [x + int(y) for x, y in zip(counts[key]["judged"], judged)]
            counts[key]["passed"] = [x + int(y) for x, y in zip(counts[key]["passed"], passed)]
        anchors, labels, logits, hit, has_label = anchors[rows], labels[rows], logits[rows], hit[rows], has_label[rows]
        slot = torch.arange(block)
        reached = (slot.unsqueeze(0) <= accepted_lengths(hit).unsqueeze(1)) & has_label  # all slots before it hit
        lab_draft = drafter.to_draft_ids(labels.clamp(min=0))
        lab_logit = logits.gather(-1, lab_draft.clamp(min=0).unsqueeze(-1))
        cls = rank_class((logits > lab_logit).sum(-1) + 1, lab_draft >= 0)
        seen = torch.tensor([[first_at.get(x, ids.numel()) for x in row] for row in labels.clamp(min=0).tolist()])
        seen = seen <= anchors.unsqueeze(1)  # [N, B]: the target's token is already in the block's context
        pos = (anchors.unsqueeze(1) + slot).clamp(max=conf.numel() - 1)  # slot k predicts x_{a+1+k} at a+k
        band = torch.bucketize(conf[pos], torch.tensor(BANDS[1:-1]), right=True)
        for g, sel in (("first", reached & (slot == 0)), ("all", reached)):
            c = counts[g]
            for b in range(len(BANDS) - 1):
                inb = sel & (band == b)
                c["band_reached"][b] += int(inb.sum())
                c["band_accepted"][b] += int((inb & hit).sum())
            for k in range(len(RANKS)):
                c["rank"][k] += int((sel & (cls == k)).sum())
            c["seen"][0] += int((sel & (cls == 0) & seen).sum())
    return by_set


def set_line(name: str, counts: dict) -> str:
    """A set's first drafts: acceptance, where the target is >= 0.9 sure (share, acceptance), near misses."""
    c = counts["first"]
    total = sum(c["band_reached"]) or 1
    sure, sure_hit = c["band_reached"][-1], c["band_accepted"][-1]
    plain, ext = walked(counts, "walk"), walked(counts, "walk_context_vocab")
    return (
        f"    {name:<12} tau {plain.tau:.3f} (context vocabulary {ext.tau:.3f})   "
        f"first draft {sum(c['band_accepted']) / total:.3f}   target >= 0.9 sure at {sure / total:.3f} "
        f"of them, accepted there {sure_hit / max(sure, 1):.3f}   rank 2 {c['rank'][2] / total:.3f}   "
        f"outside vocab {c['rank'][0] / total:.3f}"
    )


def table(name: str, counts: dict) -> str:
    plain, ext = walked(counts, "walk"), walked(counts, "walk_context_vocab")
    out = [
        f"\n{name}",
        f"  walked tau {plain.tau:.3f}, p1 {plain.conditional[0]:.3f}; with the context's tokens added to the draft "
        f"vocabulary: tau {ext.tau:.3f}, p1 {ext.conditional[0]:.3f}",
    ]
    for g, title in (("first", "first draft"), ("all", "every slot reached")):
        c = counts[g]
        total = sum(c["band_reached"])
        if not total:
            continue
        out.append(f"  {title}: {total} slots, accepted {sum(c['band_accepted']) / total:.3f}")
        out.append("    target's p(greedy token)   share   accepted")
        for b in range(len(BANDS) - 1):
            r, a = c["band_reached"][b], c["band_accepted"][b]
            hi = min(BANDS[b + 1], 1.0)
            out.append(
                (f"    [{BANDS[b]:.1f}, {hi:.1f}" + (")" if hi < 1 else "]")).ljust(31)
                + f"{r / total:6.3f}   {a / r if r else 0:.3f}"
            )
        share = [k / total for k in c["rank"]]
        out.append("    the target's token in the drafter: " + ", ".join(f"{n} {x:.3f}" for n, x in zip(RANKS, share)))
        out.append(f"    outside the vocabulary but already in the context: {c['seen'][0] / total:.3f}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafter", action="append", default=None, help="a drafter directory (repeat; default: shipped)")
    ap.add_argument("--prompts", nargs="*", default=None, help="prompt files (default prompts/eval-*.jsonl)")
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy answer length")
    ap.add_argument("--json", type=Path, default=None, help="write the counts here")
    ap.add_argument("--plot", type=Path, default=None, help="draw the first draft's acceptance by band and by rank")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = Target.load("smollm2-135m", device="cpu", dtype="float32")
    paths = args.prompts or sorted(str(p) for p in Path("prompts").glob("eval-*.jsonl"))
    samples = []
    for name, prompts in load_prompt_sets(paths, target).items():
        samples += greedy_answer_samples(target, prompts, args.new_tokens, Path(name).stem)
    print(f"{len(samples)} prompts of {', '.join(paths)}, greedy answers of up to {args.new_tokens} tokens")
    results, passes = {}, {}  # passes: the target's (features, final states) per feature-layer set
    for d in args.drafter or [str(shipped_drafter_dir("smollm2-135m"))]:
        drafter = Drafter.from_pretrained(d, target=target).float()
        layers = tuple(drafter.config.target_layer_ids)
        if layers not in passes:
            out = [target.sequence_features([s["input_ids"]], list(layers)) for s in samples]
            passes[layers] = ([f[0] for f, _ in out], [fin[0] for _, fin in out])
        feats, finals = passes[layers]
        with torch.no_grad():
            results[d] = judge(drafter, target, samples, finals, feats)
        print(table(d, merged(results[d])))
        for name, counts in results[d].items():
            print(set_line(name, counts))
    table_out = {
        "bands": BANDS[:-1],
        "ranks": RANKS,
        "drafters": {d: {"all": merged(r), "by_set": r} for d, r in results.items()},
    }
    if args.json:
        args.json.write_text(json.dumps(table_out, indent=1) + "\n")
    if args.plot:
        plot(table_out, args.plot)


def plot(table_out: dict, path: Path) -> None:
    """Two panels for the first draft: acceptance in each band of the target's confidence (bars: the
    share of first drafts in the band), and where the target's token sat in the drafter's ranking."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = [f"[{lo:.1f}, {hi:.1f}" + (")" if hi < 1 else "]") for lo, hi in zip(BANDS[:-1], (*BANDS[1:-1], 1.0))]
    drafters = table_out["drafters"]
    width = 0.8 / max(1, len(drafters))
    for i, (d, r) in enumerate(drafters.items()):
        c = r["all"]["first"]
        total = sum(c["band_reached"]) or 1
        acc = [x / max(n, 1) for x, n in zip(c["band_accepted"], c["band_reached"])]
        xs = [k + i * width for k in range(len(names))]
        label = Path(d).name
        a.bar(xs, acc, width, label=label)
        b.bar([k + i * width for k in range(len(RANKS))], [x / total for x in c["rank"]], width, label=label)
    first = next(iter(drafters.values()))["all"]["first"]
    share = [x / (sum(first["band_reached"]) or 1) for x in first["band_reached"]]
    a.plot(range(len(names)), share, "k.--", label="share of first drafts in the band")
    a.set_xticks(range(len(names)), names)
    a.set_xlabel("the target's probability of its greedy token")
    a.set_ylabel("first draft accepted")
    a.set_ylim(0, 1)
    a.legend(fontsize=7)
    b.set_xticks(range(len(RANKS)), RANKS, rotation=20, fontsize=8)
    b.set_ylabel("share of first drafts")
    b.set_title("where the target's token sat in the drafter", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
