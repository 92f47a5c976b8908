"""Prompt tokens per second of one prefill, by prompt length, per weight format (and llama.cpp's, on its GGUF).

One prompt of N random token ids (fixed seed) through the bundled target's forward into an empty cache, only the
last position's logits (as decoding's prefill asks), median of --repeats after a warm-up; llama.cpp: the same ids
through `Llama.eval` after a reset, its batch threads equal to its threads. Run pinned and alone:
`taskset -c 0 python scripts/prefill_speed.py --dtypes int8,int8-dot --lengths 64,256,700 --llamacpp`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dominospec.bench.methods import default_gguf, llamacpp_available
from dominospec.devices import cpu_model
from dominospec.targets import DEFAULT_TARGET, Target


def time_target(dtype: str, ids: dict[int, torch.Tensor], repeats: int) -> dict[int, float]:
    target = Target.load(DEFAULT_TARGET, dtype=dtype)
    seconds = {}
    with torch.inference_mode():
        for n, prompt in ids.items():
            runs = []
            for _ in range(repeats + 1):  # the first is a warm-up
                cache = target.new_cache(max_len=n + 16)
                t0 = time.perf_counter()
                target.forward(prompt, cache, last_logits_only=True, with_features=False)
                runs.append(time.perf_counter() - t0)
            seconds[n] = statistics.median(runs[1:])
    return seconds


def time_llamacpp(ids: dict[int, torch.Tensor], repeats: int) -> dict[int, float]:
    import llama_cpp

    threads = torch.get_num_threads()
    llm = llama_cpp.Llama(
        model_path=str(default_gguf(DEFAULT_TARGET)),
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    seconds = {}
    for n, prompt in ids.items():
        tokens = prompt[0].tolist()
        runs = []
        for _ in range(repeats + 1):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(tokens)
            runs.append(time.perf_counter() - t0)
        seconds[n] = statistics.median(runs[1:])
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", default="int8,int8-dot")
    ap.add_argument("--lengths", default="64,256,700")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--llamacpp", action="store_true", help="add llama.cpp's prompt evaluation of the GGUF")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in args.lengths.split(",")]
    ids = {n: torch.randint(100, 40000, (1, n), generator=g) for n in lengths}
    rows = {dtype: time_target(dtype, ids, args.repeats) for dtype in args.dtypes.split(",")}
    if args.llamacpp and llamacpp_available() and default_gguf(DEFAULT_TARGET) is not None:
        rows["llama.cpp (Q4_1 GGUF)"] = time_llamacpp(ids, args.repeats)
    print(f"# {cpu_model()}, {args.threads} thread(s), median of {args.repeats}: ms (prompt tokens/s)")
    print("| weights | " + " | ".join(f"{n} tokens" for n in lengths) + " |")
    print("|---|" + "---:|" * len(lengths))
    for name, seconds in rows.items():
        cells = " | ".join(f"{1000 * seconds[n]:.0f} ({n / seconds[n]:.0f})" for n in lengths)
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
