"""Generated tokens per CPU-second of prepare-data's answer writing, old and new paths side by side.

Runs the library's own shard generator (data/prepare.py) on the same builtin prompts with:
  hf-batch      transformers' generate in static batches (how data/smollm2-135m was made)
  native-batch  the native forward in static batches (prepare-data's path before --sampler slots)
  native-slots  the native forward, cache rows refilled as answers end (--sampler slots)
  native-slots-capture  the same, keeping the target states it computes in a feature cache
                (prepare-data --feature-cache), so training needs no feature pass
With --features, every other path also pays the trainer's feature pass over its samples (what
`train --feature-cache` computes on first reading them): tokens ready to train on per CPU-second.
And, with --pydoc N, the off-policy labelling pass (supervised tokens per CPU-second).
Rounds are interleaved in one process and timed with this thread's CPU clock, so a core shared
with another job slows every path alike; run pinned, e.g.
    taskset -c 0 python scripts/datagen_speed.py --batch-sizes 8,16 --max-new-tokens 384
Each run answers one default-sized shard (8 batches) of the same builtin prompts, as prepare-data does.
"""

import argparse
import json
import tempfile
import time
from collections import Counter
from dataclasses import replace

import torch

from dominospec import Target
from dominospec.data.builtin import builtin_prompts
from dominospec.data.offpolicy import label_texts, pydoc_texts
from dominospec.data.prepare import ChatCodec, FeatureCapture, PrepareConfig, _generate_shard
from dominospec.targets.features import FeatureCache

p = argparse.ArgumentParser()
p.add_argument("--target", default="smollm2-135m")
p.add_argument("--batch-sizes", default="8,16,32")
p.add_argument("--methods", default="hf-batch,native-batch,native-slots")
p.add_argument("--batches", type=int, default=8, help="prompts per run, in batches (prepare-data's default shard)")
p.add_argument("--max-new-tokens", type=int, default=256)
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--pydoc", type=int, default=0, help="also time labelling this many off-policy texts")
p.add_argument("--threads", type=int, default=1)
p.add_argument("--json", default=None, help="write the per-run numbers here")
p.add_argument("--features", action="store_true", help="count the feature pass training needs (see above)")
args = p.parse_args()

torch.set_num_threads(args.threads)
targets = {b: Target.load(args.target, backend=b) for b in ("hf", "native")}
codec = ChatCodec.for_target(targets["native"])
sizes = [int(b) for b in args.batch_sizes.split(",")]
convs = builtin_prompts(args.batches * max(sizes), seed=5)
base = PrepareConfig(max_new_tokens=args.max_new_tokens, temperature=0.7, top_p=0.8, seed=1)
methods = args.methods.split(",")

_generate_shard(targets["native"], codec, convs[:2], 0, 2, replace(base, batch_size=2), lambda c: None, None)  # warm-up
rows = []
for rnd in range(args.rounds):
    for bs in sizes:
        for method in methods:
            backend, sampler, *capturing = method.split("-")
            n_prompts = args.batches * bs  # one shard of prepare-data's default size
            cfg = replace(base, batch_size=bs, shard_size=n_prompts, sampler=sampler)
            target = targets[backend]
            with tempfile.TemporaryDirectory() as tmp:
                capture = FeatureCapture(FeatureCache(tmp, target), list(target.layer_ids)) if capturing else None
                cpu0, wall0 = time.thread_time(), time.perf_counter()
                samples, stats = _generate_shard(target, codec, convs, 0, n_prompts, cfg, lambda c: None, capture)
                cpu_gen = time.thread_time() - cpu0
                if args.features and not capturing:  # the pass `train --features-only` runs, 4 samples at a time:
                    for lo in range(0, len(samples), 4):  # features, final state and its log-normaliser (distilling)
                        ids = [s["input_ids"] for s in samples[lo : lo + 4]]
                        feats, final = targets["native"].sequence_features(ids, target.layer_ids)
                        for f, g in zip(feats, final):
                            f.to(torch.float16), torch.logsumexp(target.lm_head(g.to(torch.float16).float()), -1)
                cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
            n = stats["generated_tokens"]
            rows.append(
                dict(round=rnd, method=method, batch=bs, tokens=n, samples=len(samples), cpu_s=cpu, gen_cpu_s=cpu_gen)
            )
            rate = f"{n / cpu:6.1f} tok/CPU-s, {n / wall:6.1f} tok/s wall"
            per = f"{cpu_gen / len(samples):.3f} CPU-s a sample generating, {(cpu - cpu_gen) / len(samples):.3f} after"
            print(f"round {rnd} {method:13s} B={bs:3d}: {n} tokens, {rate}; {per}", flush=True)
    if args.pydoc:
        texts = pydoc_texts(args.pydoc, seed=rnd)
        cpu0 = time.thread_time()
        _, stats = label_texts(targets["native"], codec, texts, 8, args.max_new_tokens)
        cpu = time.thread_time() - cpu0
        s = Counter(stats)
        rows.append(dict(round=rnd, method="pydoc-label", batch=8, tokens=s["text_tokens"], cpu_s=cpu))
        print(
            f"round {rnd} pydoc-label: {s['text_tokens']} text tokens ({s['agreeing_tokens']} supervised) in "
            f"{cpu:.1f} CPU-s = {s['text_tokens'] / cpu:.0f} text tok/CPU-s, "
            f"{s['agreeing_tokens'] / cpu:.0f} supervised tok/CPU-s",
            flush=True,
        )

print(f"\nmedian generated tokens per CPU-second (ratio to {methods[0]} at the same batch size):")
for bs in sizes:
    line = []
    for method in methods:
        rates = sorted(r["tokens"] / r["cpu_s"] for r in rows if r["method"] == method and r["batch"] == bs)
        line.append((method, rates[len(rates) // 2]))
    ref = line[0][1]
    print(f"B={bs:3d}: " + ", ".join(f"{m} {v:.1f} ({v / ref:.2f}x)" for m, v in line))
if args.json:
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
