"""Where one draft cycle goes, per part: the drafter's library path, and its packed path (drafter/fast.py) per format.

One cycle as decoding pays it: the drafter's cache takes the target features of the committed positions (the
anchor and `--accepted` drafts: "context"), the backbone pass over the block ("backbone"), the base logits over
the (draft) vocabulary ("base logits"), the head's left-to-right rollout ("rollout" = the whole rollout minus
base logits and confidence) and the confidence head ("confidence"; the library path calls it once per slot, the
packed path once per cycle). The paths run in one process, interleaved per repeat; medians in ms, for each
thread count. Run pinned on a quiet machine, e.g.

  taskset -c 1 python scripts/draft_cycle.py --threads 1 --cpu-clock
  taskset -c 0,1 python scripts/draft_cycle.py --threads 2

Defaults: the bundled smollm2-135m target with its shipped drafter, block 8, one row, context 130.
`--tiny` runs a random tiny target and drafter (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from dominospec.decode.rollout import rollout
from dominospec.devices import cpu_model
from dominospec.drafter import DraftCache, Drafter, DrafterConfig, shipped_drafter_dir
from dominospec.drafter.fast import ENV_SWITCH
from dominospec.sampling import SamplingConfig
from dominospec.targets import Target

PATHS = {
    "library": ("off", "float32"),
    "packed": ("on", "float32"),
    "packed int8": ("on", "int8"),
    "packed bf16-dot": ("on", "bfloat16-dot"),
    "packed int8-dot": ("on", "int8-dot"),
}
PARTS = ("context", "backbone", "base logits", "rollout", "confidence", "cycle")


def tiny_pair():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
    )  # fmt: skip
    target = Target(LlamaForCausalLM(cfg).float(), tokenizer=None, name="tiny", backend="native")
    config = DrafterConfig.for_target(
        target, num_layers=1, intermediate_size=128, gru_hidden_size=32, rank=16, block_size=8,
        confidence_head=True, draft_vocab_size=128,
    )  # fmt: skip
    return target, Drafter(config).eval().attach(target)


def load_pair(args):
    if args.tiny:
        return tiny_pair()
    target = Target.load(args.target, device="cpu")
    directory = args.drafter or shipped_drafter_dir(target.name)
    return target, Drafter.from_pretrained(directory, target=target)


def timed(fn, clock) -> float:
    t0 = clock()
    fn()
    return clock() - t0


def one_cycle(drafter, rows, committed, base_len, anchors, b, greedy, clock):
    """The parts of one cycle, each timed on its own (the cache is reset to the same length first)."""
    R = len(anchors)
    times = {}

    def context():
        for r in range(R):
            rows.set_length(r, base_len)
            drafter.extend_cache(DraftCache(rows, r), committed)

    times["context"] = timed(context, clock)
    z = None

    def backbone():
        nonlocal z
        z = drafter.backbone_rows(rows, list(range(R)), anchors)[:, :b]

    times["backbone"] = timed(backbone, clock)
    times["base logits"] = timed(lambda: drafter.base_logits(z), clock)
    conf = drafter.confidence

    def confidence():
        if conf is None:
            return
        emb = drafter.embed(anchors.repeat(b, 1).t())  # the slots' previous tokens (values do not matter)
        fast = drafter.fast()
        if fast is not None:
            fast.conf(torch.cat([z, emb], -1))
        else:
            for k in range(b):
                conf(z[:, k], emb[:, k])

    times["confidence"] = timed(confidence, clock)
    whole = timed(lambda: rollout(drafter, z, anchors, [b] * R, [greedy] * R, [None] * R), clock)
    times["rollout"] = max(0.0, whole - times["base logits"] - times["confidence"])
    times["cycle"] = times["context"] + times["backbone"] + whole
    return times


@torch.inference_mode()
def measure(target, drafter, args) -> dict:
    R, b = args.rows, args.block
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, args.context + args.accepted + 1), generator=gen)
    feats = target.forward(ids, target.new_cache(), layer_ids=drafter.config.target_layer_ids).features
    rows = drafter.new_row_cache(R, args.context + 64)
    for r in range(R):
        rows.claimed[r] = True
        drafter.extend_cache(DraftCache(rows, r), feats[:, : args.context])
    committed = feats[:, args.context :]  # the anchor and the accepted drafts
    anchors = ids[0, -1:].repeat(R)
    greedy = SamplingConfig()
    samples = {(p, part): [] for p in PATHS for part in PARTS}
    packs = {}  # each format's packed copies, made once (switching formats would repack every cycle)
    for _, weights in PATHS.values():
        drafter.weight_format = weights
        packs[weights] = drafter.fast()
    for rep in range(args.repeats + 2):  # two warm-up rounds
        for path, (switch, weights) in PATHS.items():
            os.environ[ENV_SWITCH] = switch
            drafter.weight_format, drafter._packed = weights, packs[weights]
            times = one_cycle(drafter, rows, committed, args.context, anchors, b, greedy, args.clock)
            if rep >= 2:
                for part, t in times.items():
                    samples[path, part].append(t)
    os.environ.pop(ENV_SWITCH, None)
    return {key: 1e3 * statistics.median(v) for key, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="drafter directory (default: the target's shipped drafter)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default %(default)s)")
    ap.add_argument("--block", type=int, default=8, help="drafts per cycle (default %(default)s)")
    ap.add_argument("--rows", type=int, default=1, help="sequences drafted together, as the engine does")
    ap.add_argument("--context", type=int, default=130, help="committed positions before the cycle")
    ap.add_argument("--accepted", type=int, default=1, help="drafts accepted by the cycle before (context rows)")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--tiny", action="store_true", help="a random tiny target and drafter: a smoke test only")
    ap.add_argument("--cpu-clock", action="store_true", help="count this thread's CPU time (with --threads 1)")
    args = ap.parse_args()
    if args.cpu_clock and args.threads != "1":
        ap.error("--cpu-clock measures one thread; use --threads 1")
    args.clock = time.thread_time if args.cpu_clock else time.perf_counter
    target, drafter = load_pair(args)
    with torch.no_grad():
        packed = drafter.fast() is not None
    print(f"CPU: {cpu_model()}; target {target.name}; drafter {drafter.config.head}-{drafter.config.num_layers}L")
    print(f"block {args.block}, rows {args.rows}, context {args.context}, median of {args.repeats}; ms per part")
    if not packed:
        print("(the packed path is not available here: every column runs the library path)")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        ms = measure(target, drafter, args)
        print(
            f"\n{threads} thread(s)\n| part | "
            + " | ".join(PATHS)
            + " | "
            + " | ".join(f"library / {p}" for p in list(PATHS)[1:])
            + " |"
        )
        print("|---|" + "---:|" * (2 * len(PATHS) - 1))
        for part in PARTS:
            row = [ms[p, part] for p in PATHS]
            ratios = [row[0] / x if x else float("nan") for x in row[1:]]
            print(
                f"| {part} | "
                + " | ".join(f"{x:.2f}" for x in row)
                + " | "
                + " | ".join(f"{r:.2f}x" for r in ratios)
                + " |"
            )


if __name__ == "__main__":
    main()
