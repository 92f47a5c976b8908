"""How close bf16 and int8 weights (`--dtype bfloat16` / `int8`, fp32 activations), and the dot-product formats
(`--formats ...,bfloat16-dot,int8-dot`: activations rounded too), stay to the fp32 model.

    taskset -c 1 python scripts/quant_agreement.py --json runs/quant_agreement.json

For each weight format, against the fp32 target (the bundled SmolLM2-135M by default):
  greedy    on the prompts of prompts/eval-*.jsonl (--limit of each), plain greedy decoding of
            --new-tokens tokens: the share of answers identical to fp32's, and the mean share of
            each answer before its first differing token
  forced    teacher-forced on fp32's greedy answers: the share of positions where the format's
            argmax is fp32's token (no divergence compounding)
  ppl       perplexity on the supervised tokens of held-out conversations of --data (the trainer's
            own --val-fraction 0.05 split; at most --conversations of them, each cut at --max-tokens)
fp32 runs first; then one format at a time is loaded (one extra model in memory). Nothing is timed.
Note: the bundled fp32 weights are themselves the dequantised Q4_1 GGUF, so fp32 here *is* that
4-bit model computed in fp32; the formats are roundings of it.
Smoke run: `--limit 1 --new-tokens 8 --conversations 2 --max-tokens 64`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from dominospec.bench.runner import load_prompt_sets
from dominospec.data.dataset import load_dataset_dir
from dominospec.decode.single import generate_autoregressive
from dominospec.targets import Target
from dominospec.train.validate import split_validation


def greedy_answers(target, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    return [generate_autoregressive(target, p, new_tokens, eos_ids=target.eos_ids).tokens for p in prompts]


@torch.inference_mode()
def logits_of(target, ids: list[int]) -> torch.Tensor:
    """[S, V] next-token logits of every position of one sequence, one cached forward."""
    return target.forward(torch.tensor([ids]), target.new_cache(len(ids)), with_features=False).logits[0].float()


def forced_agreement(target, prompts, answers) -> float:
    """Share of answer positions where the target's argmax is the given (fp32 greedy) token."""
    hits = total = 0
    for p, a in zip(prompts, answers):
        if not a:
            continue
        pred = logits_of(target, p + a)[len(p) - 1 : -1].argmax(-1)  # [len(a)]
        hits += int((pred == torch.tensor(a)).sum())
        total += len(a)
    return hits / max(total, 1)


def perplexity(target, conversations: list[dict]) -> float:
    """exp of the mean NLL of the supervised (loss_mask) tokens, each conversation one teacher-forced pass."""
    nll = count = 0.0
    for s in conversations:
        ids, mask = s["input_ids"], torch.tensor(s["loss_mask"][1:], dtype=torch.bool)
        logp = F.log_softmax(logits_of(target, ids)[:-1], dim=-1)  # [S-1, V]: predicts ids[1:]
        picked = logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
        nll -= float(picked[mask].sum())
        count += int(mask.sum())
    return math.exp(nll / max(count, 1))


def agreement(ref: list[list[int]], got: list[list[int]]) -> tuple[float, float]:
    """(share of identical answers, mean share of each answer before its first difference)."""
    same, prefix = 0, 0.0
    for a, b in zip(ref, got):
        same += a == b
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += n / max(len(a), 1) if a != b else 1.0
    return same / max(len(ref), 1), prefix / max(len(ref), 1)


def measure(target, prompts, ref_answers, conversations, new_tokens: int) -> dict:
    """One format's row; ref_answers None: the fp32 reference itself (perplexity only)."""
    row = {"precision": target.precision, "ppl": perplexity(target, conversations)}
    if ref_answers is None:
        return row
    answers = greedy_answers(target, prompts, new_tokens)
    row["identical_answers"], row["prefix_agreement"] = agreement(ref_answers, answers)
    row["forced_agreement"] = forced_agreement(target, prompts, ref_answers)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--formats", default="bfloat16,int8", help="comma list of weight formats to compare with fp32")
    ap.add_argument("--prompts", nargs="*", default=sorted(str(p) for p in Path("prompts").glob("eval-*.jsonl")))
    ap.add_argument("--limit", type=int, default=None, help="prompts per set (default: all)")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--data", default="data/smollm2-135m")
    ap.add_argument("--conversations", type=int, default=64, help="held-out conversations for perplexity")
    ap.add_argument("--max-tokens", type=int, default=1024, help="each conversation cut at this many tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    fp32 = Target.load(args.target, device="cpu", dtype="float32", backend="native")
    sets = load_prompt_sets(args.prompts, fp32, limit=args.limit)
    prompts = [p for ps in sets.values() for p in ps]
    _, held_out = split_validation(load_dataset_dir(args.data, target=fp32, allow_other_target=True)[1], 0.05)
    conversations = [
        {"input_ids": s["input_ids"][: args.max_tokens], "loss_mask": s["loss_mask"][: args.max_tokens]}
        for s in held_out[: args.conversations]
    ]
    print(f"{len(prompts)} prompts from {len(sets)} sets x {args.new_tokens} tokens; {len(conversations)} held-out")
    ref_answers = greedy_answers(fp32, prompts, args.new_tokens)
    rows = {"float32": measure(fp32, prompts, None, conversations, args.new_tokens)}
    del fp32
    for fmt in args.formats.split(","):
        target = Target.load(args.target, device="cpu", dtype=fmt, backend="native")
        rows[fmt] = measure(target, prompts, ref_answers, conversations, args.new_tokens)
        del target

    print("| weights | identical answers | prefix agreement | teacher-forced top-1 | held-out ppl |")
    print("|---|---:|---:|---:|---:|")
    for r in rows.values():
        cells = [f"{r[k]:.3f}" if k in r else "(ref)" for k in ("identical_answers", "prefix_agreement")]
        forced = f"{r['forced_agreement']:.4f}" if "forced_agreement" in r else "(ref)"
        print(f"| {r['precision']} | {cells[0]} | {cells[1]} | {forced} | {r['ppl']:.3f} |")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
