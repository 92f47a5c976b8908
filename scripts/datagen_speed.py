"""Generated tokens/s of batched on-policy regeneration: transformers generate vs the native sampler."""

import sys
import time

import torch

from dominospec import Target
from dominospec.data.builtin import builtin_prompts

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
convs = builtin_prompts(16, seed=5)
for backend in ("hf", "native", "hf", "native"):
    t = Target.load("smollm2-135m", backend=backend)
    prompts = [t.encode_chat(c.turns[0]) for c in convs]
    t0 = time.perf_counter()
    out = t.sample_batch(prompts, 128, temperature=0.7, top_p=0.8, seed=1)
    dt = time.perf_counter() - t0
    n = sum(len(a) for a in out)
    print(f"{backend}: {len(prompts)} prompts, {n} tokens in {dt:.1f}s = {n / dt:.1f} generated tok/s", flush=True)
