"""How far training validation is from what decoding measures, and why (the shipped SmolLM2 drafter).

    taskset -c 0 python scripts/val_gap.py --prompts 8 --new-tokens 96

On the held-out conversations of the committed data (the trainer's own --val-fraction split):
  live    greedy speculative decoding of each held-out prompt: tokens per cycle, as `bench` counts
  spread  validation as training ran it until now: 64 evenly spaced anchors of the sampled answers
  walk    validation walking the sampled answers the way greedy decoding walks text (`--val-walk`)
  greedy  both validations on the target's own greedy answers (the text `live` decoded)
Each tau is 1 + sum_k prod_{i<=k} p_i of the acceptance counts, as acceptance.json holds it.

With --eval-like the held-out prompts are drawn like the benchmark's instead: of each
prompts/eval-*.jsonl set, the first --bench-limit prompts are the ones `bench --limit 3` decodes
(live tau there is what bench reports) and the rest are held-out prompts of the same kind, whose
greedy answers by the target (what `--val-data` would hold if prepared at T=0) are validated:

    taskset -c 1 python scripts/val_gap.py --eval-like [--drafter DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dominospec.bench.runner import load_prompt_sets
from dominospec.data.dataset import load_dataset_dir
from dominospec.decode.single import generate_speculative
from dominospec.drafter import Drafter
from dominospec.drafter.checkpoint import shipped_drafter_dir
from dominospec.targets import Target
from dominospec.train.validate import Validator, split_validation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default="data/smollm2-135m")
    ap.add_argument("--prompts", type=int, default=8, help="held-out conversations used")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--drafter", default=None, help="a drafter directory (default: the shipped one)")
    ap.add_argument("--eval-like", action="store_true", help="held-out prompts drawn like the eval sets (above)")
    ap.add_argument("--bench-limit", type=int, default=3, help="with --eval-like: prompts per set bench decodes")
    args = ap.parse_args()
    torch.set_num_threads(1)
    target = Target.load("smollm2-135m", device="cpu", dtype="float32")
    drafter = Drafter.from_pretrained(args.drafter or shipped_drafter_dir("smollm2-135m"), target=target).float()
    if args.eval_like:
        eval_like(target, drafter, args)
        return
    _, val = split_validation(load_dataset_dir(args.data, target=target)[1], 0.05)
    val = val[: args.prompts]

    greedy, tokens, cycles = [], 0, 0
    for s in val:
        start = s["loss_mask"].index(1)
        prompt = s["input_ids"][:start]
        res = generate_speculative(target, drafter, prompt, args.new_tokens, eos_ids=target.eos_ids)
        tokens, cycles = tokens + len(res.tokens), cycles + res.cycles
        greedy.append(
            {"id": s["id"], "input_ids": prompt + res.tokens, "loss_mask": [0] * start + [1] * len(res.tokens)}
        )
    sampled = [{**s, "input_ids": s["input_ids"][: s["loss_mask"].index(1) + args.new_tokens]} for s in val]
    for s in sampled:
        s["loss_mask"] = s["loss_mask"][: len(s["input_ids"])]

    print(f"{len(val)} held-out prompts, {args.new_tokens} new tokens; tau (tokens per cycle)")
    print(f"  live greedy decoding              {tokens / cycles:.3f}")
    for name, data in (("sampled answers", sampled), ("greedy answers ", greedy)):
        for mode, walk in (("spread", False), ("walk  ", True)):
            r = Validator(target, data, 64, walk=walk).evaluate(drafter)
            p = ", ".join(f"{x:.2f}" for x in r.conditional[:4] if x is not None)
            print(f"  validation {mode} on {name}  {r.tau:.3f}   p1..4 {p}   ({r.blocks} blocks)")


def eval_like(target, drafter, args) -> None:
    """Live tau on the bench's prompts against validation on held-out prompts of the same sets."""
    paths = sorted(str(p) for p in Path("prompts").glob("eval-*.jsonl"))
    sets = load_prompt_sets(paths, target)
    print(f"{', '.join(paths)}: live on the first {args.bench_limit} of each, validation on the rest")
    print(f"{'set':<6} {'live (bench prompts)':>21} {'live (held-out)':>16} {'validation (held-out)':>22}")
    totals = {"bench": [0, 0], "held": [0, 0]}
    all_samples = []
    for name, prompts in sets.items():
        live, samples = {}, []
        for part, chunk in (("bench", prompts[: args.bench_limit]), ("held", prompts[args.bench_limit :])):
            tokens = cycles = 0
            for prompt in chunk:
                res = generate_speculative(target, drafter, prompt, args.new_tokens, eos_ids=target.eos_ids)
                tokens, cycles = tokens + len(res.tokens), cycles + res.cycles
                if part == "held":  # lossless: these are the target's own greedy answers
                    mask = [0] * len(prompt) + [1] * len(res.tokens)
                    samples.append(
                        {"id": f"{name}:{len(samples)}", "input_ids": prompt + res.tokens, "loss_mask": mask}
                    )
            live[part] = tokens / cycles
            totals[part][0] += tokens
            totals[part][1] += cycles
        val = Validator(target, samples, walk=True).evaluate(drafter)
        all_samples += samples
        print(f"{name:<6} {live['bench']:>21.3f} {live['held']:>16.3f} {val.tau:>22.3f}")
    val = Validator(target, all_samples, walk=True).evaluate(drafter)
    bench, held = (t / c for t, c in totals.values())
    print(f"{'all':<6} {bench:>21.3f} {held:>16.3f} {val.tau:>22.3f}   validation vs bench {val.tau / bench - 1:+.1%}")


if __name__ == "__main__":
    main()
