"""Per-position AUC of two acceptance confidences on the same draft cycles: the drafter's trained confidence
head, and the draft's own top probability (raw, and through the online calibration the cost policy uses,
decode/schedule.py TopCalibration, replayed in cycle order so each cycle is scored before its outcome is
learnt). Every draft is verified (fixed policy), greedy, so each position's outcome is known whenever the
drafts before it were accepted. No timing: any machine, any load.

  python scripts/confidence_auc.py --prompts prompts/eval-chat.jsonl prompts/eval-code.jsonl --limit 6

Defaults: the bundled smollm2-135m target with its shipped drafter (it has a confidence head).
`--tiny` runs a random tiny target and drafter (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse

import torch

from dominospec.bench.runner import load_prompt_sets
from dominospec.decode.proposers import DrafterProposer
from dominospec.decode.schedule import TopCalibration, VerifyPolicy
from dominospec.decode.single import decode
from dominospec.drafter import Drafter, DrafterConfig, shipped_drafter_dir
from dominospec.sampling import SamplingConfig
from dominospec.targets import Target


def auc(scores: list[float], labels: list[bool]) -> float | None:
    """P(a random accepted draft scores above a random rejected one), ties counting half; None without both."""
    pos = [s for s, y in zip(scores, labels) if y]
    neg = [s for s, y in zip(scores, labels) if not y]
    if not pos or not neg:
        return None
    ranked = sorted((s, i) for i, s in enumerate(scores))
    ranks, i = [0.0] * len(scores), 0
    while i < len(ranked):  # average ranks over ties
        j = i
        while j + 1 < len(ranked) and ranked[j + 1][0] == ranked[i][0]:
            j += 1
        for t in range(i, j + 1):
            ranks[ranked[t][1]] = (i + j) / 2 + 1
        i = j + 1
    pos_rank = sum(r for r, y in zip(ranks, labels) if y)
    return (pos_rank - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def tiny_pair():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, eos_token_id=127,
    )  # fmt: skip
    target = Target(LlamaForCausalLM(cfg).float(), tokenizer=None, name="tiny", backend="native")
    config = DrafterConfig.for_target(target, num_layers=1, intermediate_size=128, block_size=4, confidence_head=True)
    drafter = Drafter(config).eval().attach(target)
    with torch.no_grad():
        torch.nn.init.normal_(drafter.confidence.proj.weight, std=0.2)
    prompts = {"random": [torch.randint(0, 127, (12,)).tolist() for _ in range(3)]}
    return target, drafter, prompts


@torch.inference_mode()
def collect(target, drafter, prompts: dict, max_new_tokens: int) -> list[tuple]:
    """(head confidence logits [b] or None, top probabilities [b], verified, accepted) per cycle, in order."""
    cycles = []
    proposer = DrafterProposer(drafter, drafter.config.block_size)

    def on_cycle(proposal, verified, accepted):
        conf = proposal.confidence_logits
        cycles.append((None if conf is None else conf.tolist(), proposal.draft_top.tolist(), verified, accepted))

    for ids_list in prompts.values():
        for ids in ids_list:
            decode(target, proposer, VerifyPolicy(), ids, max_new_tokens, SamplingConfig(), 0, on_cycle=on_cycle)
    return cycles


def table(cycles: list[tuple], b: int) -> list[dict]:
    calibration = TopCalibration()
    per = [{"head": [], "top": [], "calibrated": [], "label": []} for _ in range(b)]
    for conf, top, verified, accepted in cycles:
        calibrated = calibration(torch.tensor(top)).tolist()  # scored before its outcome is learnt
        for k in range(min(verified, accepted + 1, len(top))):  # positions judged in this cycle
            per[k]["label"].append(k < accepted)
            per[k]["top"].append(top[k])
            per[k]["calibrated"].append(calibrated[k])
            if conf is not None:
                per[k]["head"].append(conf[k])
        calibration.record(torch.tensor(top), verified, accepted)
    rows = []
    for k, p in enumerate(per):
        labels = p["label"]
        rows.append(
            {
                "position": k + 1,
                "judged": len(labels),
                "accepted": sum(labels),
                "head": auc(p["head"], labels) if p["head"] else None,
                "top": auc(p["top"], labels),
                "calibrated": auc(p["calibrated"], labels),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--drafter", default=None, help="drafter directory (default: the target's shipped drafter)")
    ap.add_argument("--prompts", nargs="+", default=["prompts/eval-chat.jsonl", "prompts/eval-code.jsonl"])
    ap.add_argument("--limit", type=int, default=6, help="prompts per file")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--tiny", action="store_true", help="a random tiny target and drafter: a smoke test only")
    args = ap.parse_args()
    if args.tiny:
        target, drafter, prompts = tiny_pair()
    else:
        target = Target.load(args.target, device="cpu")
        drafter = Drafter.from_pretrained(args.drafter or shipped_drafter_dir(target.name), target=target)
        prompts = load_prompt_sets(args.prompts, target, args.limit)
    cycles = collect(target, drafter, prompts, args.max_new_tokens)
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    print(f"{len(cycles)} cycles; AUC of P(draft k accepted | drafts < k were), greedy, every draft verified")
    print("| position | judged | accepted | confidence head | top probability | calibrated top (online) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in table(cycles, drafter.config.block_size):
        print(
            f"| {r['position']} | {r['judged']} | {r['accepted']} | {fmt(r['head'])} | {fmt(r['top'])} | "
            f"{fmt(r['calibrated'])} |"
        )


if __name__ == "__main__":
    main()
