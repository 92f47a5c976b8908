"""Drafter shapes judged by expected tokens per second: measured costs on this device, measured acceptance.

For each shape (block size, backbone layers, draft vocabulary, head) the script times one draft cycle of a drafter
of that shape (random weights: a cycle's cost does not depend on their values) and the target's verify curve, both
as decoding pays them (`tune/profile.py`), and combines them with an acceptance by position:

  tokens/s(b) = E[tokens | b drafts] / (draft(b) + verify(b + 1)),   E = 1 + sum_k prod_{i<=k} p_i

reported at the shape's full block ("all b") and at the b that maximises it ("best b", what a fixed verify length
chosen for the device would take). Where the acceptance comes from is a column of its own:

  measured     the reference drafter's acceptance.json (walked validation on held-out conversations)
  truncated    the same, cut at a smaller block
  extrapolated a longer block: the positions past the reference's are given its last measured rate (an estimate)
  coverage     another draft vocabulary: each position's rate scaled by the share of the target's supervised
               tokens the vocabulary holds, relative to the reference's (an estimate: a draft outside the
               vocabulary is always rejected, and the rest are assumed unchanged)
  needed       no trained drafter of the shape: the overall tau it would need to match the reference's tokens/s

--drafter DIR adds trained drafters as measured rows (their own acceptance.json and shape). Run pinned on a quiet
machine (it times), e.g.

  OMP_NUM_THREADS=1 taskset -c 0 python scripts/arch_table.py --threads 1 --json runs/arch.json

`--tiny` runs a random tiny target (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from dominospec.data.dataset import load_dataset_dir
from dominospec.decode.result import expected_tokens
from dominospec.devices import cpu_model
from dominospec.drafter import Drafter, DrafterConfig, shipped_drafter_dir
from dominospec.train.samples import frequent_tokens
from dominospec.tune.profile import profile_draft_cost, profile_verify_cost

BLOCKS, LAYERS, VOCABS, HEADS = (4, 8, 16), (1, 2), (4096, 8192, 16384), ("domino", "path", "none")


def rate_at(acc: list[float], k: int) -> float:
    return acc[k] if k < len(acc) else acc[-1]


def best(acc, draft_s, verify_s, b_max):
    """(tokens/s at all b drafts, best tokens/s, its b) for conditional acceptance `acc`."""
    rates = {b: expected_tokens(acc, b) / (draft_s[b - 1] + verify_s[b + 1]) for b in range(1, b_max + 1)}
    top = max(rates, key=rates.get)
    return rates[b_max], rates[top], top


def coverage(samples, vocab_ids: set[int]) -> float:
    sup = [t for s in samples for t, m in zip(s["input_ids"], s["loss_mask"]) if m]
    return sum(t in vocab_ids for t in sup) / max(1, len(sup))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reference", default=None, help="drafter whose shape and acceptance anchor the table (shipped)")
    ap.add_argument("--drafter", action="append", default=[], help="trained drafters to add as measured rows")
    ap.add_argument("--data", default="data/smollm2-135m", help="for the draft-vocabulary coverage")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None, help="also write the table here")
    ap.add_argument("--tiny", action="store_true", help="a random tiny target: smoke test, not a measurement")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from dominospec.targets import Target

    if args.tiny:
        import draft_cycle  # the sibling script's tiny pair

        target, ref = draft_cycle.tiny_pair()
        ref_acc, samples = [0.5, 0.45, 0.4, 0.4, 0.35, 0.35, 0.3, 0.3], None
        vocabs, context, repeats = (64, 128, 256), 64, 2
    else:
        target = Target.load("smollm2-135m", dtype=args.dtype)
        ref = Drafter.from_pretrained(args.reference or shipped_drafter_dir("smollm2-135m"), target=target)
        ref_acc = json.loads((ref.directory / "acceptance.json").read_text())["conditional"]
        _, samples = load_dataset_dir(args.data, target)
        vocabs, context, repeats = VOCABS, args.context, args.repeats
    rc = ref.config
    verify = profile_verify_cost(target, context=context, max_k=max(BLOCKS) + 1, repeats=repeats)
    verify_s = [0.0] + verify["seconds"]  # verify_s[k]: a forward over k tokens
    step = verify_s[1]
    ref_cov = None
    if samples is not None and rc.draft_vocab_size:
        ref_cov = coverage(samples, set(ref.draft_vocab.tolist()))

    def shape(**change):
        cfg = DrafterConfig.from_dict({**rc.to_dict(), **change})
        torch.manual_seed(0)
        d = Drafter(cfg).eval()
        if cfg.draft_vocab_size:
            ids = (
                frequent_tokens(samples, cfg.draft_vocab_size, target.vocab_size, target.eos_ids)
                if samples is not None
                else torch.randperm(target.vocab_size)[: cfg.draft_vocab_size].sort().values
            )
            d.draft_vocab.copy_(ids)
        d.attach(target)
        return d

    rows = []

    def add(name, change, source, acc=None, cov=None, drafter=None):
        d = drafter or shape(**change)
        b = d.config.block_size
        draft = profile_draft_cost(target, d, context=context, repeats=repeats)["seconds"]
        row = {
            "shape": name,
            "block": b,
            "layers": d.config.num_layers,
            "draft_vocab": d.config.draft_vocab_size,
            "head": d.config.head,
            "draft_ms": round(1000 * draft[-1], 3),
            "draft_steps": round(draft[-1] / step, 3),
            "acceptance": source,
        }
        if cov is not None:
            row["coverage"] = round(cov, 4)
        if acc is not None:
            full, top, top_b = best(acc, draft, verify_s, b)
            row |= {
                "tau": round(expected_tokens(acc, b), 3),
                "tok_s": round(full, 1),
                "x_plain": round(full * step, 3),
                "best_b": top_b,
                "best_tok_s": round(top, 1),
                "best_x_plain": round(top * step, 3),
            }
        rows.append(row)
        return row

    reference = add("reference", {}, "measured", ref_acc, ref_cov, drafter=ref)
    for b in BLOCKS:
        if b != rc.block_size:
            acc = [rate_at(ref_acc, k) for k in range(b)]
            add(f"block {b}", {"block_size": b}, "truncated" if b < len(ref_acc) else "extrapolated", acc)
    for v in vocabs:
        if v != rc.draft_vocab_size and v <= target.vocab_size:
            d = shape(draft_vocab_size=v)
            cov = coverage(samples, set(d.draft_vocab.tolist())) if samples is not None else None
            scale = cov / ref_cov if cov is not None and ref_cov else 1.0
            add(f"vocab {v}", None, "coverage", [min(1.0, a * scale) for a in ref_acc], cov, drafter=d)
    for n in LAYERS:
        if n != rc.num_layers:
            row = add(f"{n} layers", {"num_layers": n}, "needed")
            # the tau at which this shape's tokens/s at all b drafts equals the reference's
            row["tau_needed"] = round(reference["tok_s"] * (row["draft_ms"] / 1000 + verify_s[row["block"] + 1]), 3)
    for h in HEADS:
        if h != rc.head:
            row = add(f"head {h}", {"head": h}, "needed")
            row["tau_needed"] = round(reference["tok_s"] * (row["draft_ms"] / 1000 + verify_s[row["block"] + 1]), 3)
    for path in args.drafter:
        d = Drafter.from_pretrained(path, target=target)
        acc = json.loads((Path(path) / "acceptance.json").read_text())["conditional"]
        add(f"trained {Path(path).name}", None, "measured", acc, drafter=d)

    out = {
        "cpu": cpu_model(),
        "threads": args.threads,
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "precision": verify["dtype"],
        "context": context,
        "plain_step_ms": round(1000 * step, 3),
        "verify_steps": [round(s / step, 3) for s in verify_s[1:]],
        "rows": rows,
    }
    print(
        f"{out['cpu']}, {args.threads} thread(s), {out['precision']}, context {context}: step {out['plain_step_ms']} ms"
    )
    cols = ["shape", "acceptance", "draft_ms", "draft_steps", "tau", "x_plain", "best_b", "best_x_plain", "tau_needed"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
