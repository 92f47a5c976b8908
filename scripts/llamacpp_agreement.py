"""How often our greedy answer equals llama.cpp's own greedy answer from the same GGUF, and how close the miss was.

    taskset -c 1 python scripts/llamacpp_agreement.py --formats q4-dot,int8 --limit 4 --new-tokens 64

llama.cpp (llama-cpp-python) decodes the target's GGUF (the bundled model: its Q4_1 file, llama.cpp's Q4_1 x Q8_1
arithmetic) greedily; each of our --formats decodes the same prompt ids greedily (plain decoding). Per format:
the share of identical answers, the mean share of each answer before its first differing token, and at that
first differing position our top-2 logit margin (top-1 minus top-2 logit, from one teacher-forced forward over
the prompt and the common prefix: prefill's attention path, which may differ from decoding's in the last bits)
and our logit gap to llama.cpp's token (ours minus theirs): small margins mean a near-tie that either arithmetic
may break its own way. Answers are compared up to and including the first EOS. Nothing is timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from dominospec.bench.methods import default_gguf
from dominospec.bench.runner import load_prompt_sets
from dominospec.decode.single import generate_autoregressive
from dominospec.targets import Target


def cut_at_eos(tokens: list[int], eos: set[int], n: int) -> list[int]:
    """The first n tokens, up to and including the first EOS."""
    for i, t in enumerate(tokens[:n]):
        if t in eos:
            return tokens[: i + 1]
    return tokens[:n]


def llamacpp_answers(gguf: Path, prompts: list[list[int]], new_tokens: int, eos: set[int], threads: int):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
    answers = []
    for p in prompts:
        tokens: list[int] = []
        for tok in llm.generate(list(p), temp=0.0, top_k=1, reset=True):
            tokens.append(int(tok))
            if tok in eos or len(tokens) >= new_tokens:
                break
        answers.append(cut_at_eos(tokens, eos, new_tokens))
    return answers


@torch.inference_mode()
def next_logits(target, ids: list[int]) -> torch.Tensor:
    """[V] our logits for the token after ids (one cached forward)."""
    out = target.forward(torch.tensor([ids]), target.new_cache(len(ids) + 1), with_features=False)
    return out.logits[0, -1].float()


def compare(target, prompts, ours, theirs) -> dict:
    """Identical answers, prefix agreement, and at each first difference our top-2 margin and gap to their token."""
    same, prefix, first, margins, gaps = 0, [], [], [], []
    for p, a, b in zip(prompts, ours, theirs):
        if a == b:
            same += 1
            prefix.append(1.0)
            continue
        i = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(i / max(len(b), 1))
        first.append(i)
        if i < min(len(a), len(b)):  # a real token difference (not one answer ending first)
            logits = next_logits(target, p + a[:i])
            top2 = logits.topk(2).values
            margins.append(float(top2[0] - top2[1]))
            gaps.append(float(logits[a[i]] - logits[b[i]]))
    return {
        "precision": target.precision,
        "identical": same,
        "prompts": len(prompts),
        "prefix_agreement": statistics.mean(prefix) if prefix else 1.0,
        "first_difference": first,
        "top2_margin": margins,
        "gap_to_llamacpp_token": gaps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--gguf", default=None, help="default: the GGUF the bundled target ships")
    ap.add_argument("--formats", default="q4-dot,int8", help="our weight formats to compare with llama.cpp")
    ap.add_argument("--prompts", nargs="*", default=sorted(str(p) for p in Path("prompts").glob("eval-*.jsonl")))
    ap.add_argument("--limit", type=int, default=4, help="prompts per set")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gguf = Path(args.gguf) if args.gguf else default_gguf(args.target)
    if gguf is None or not gguf.is_file():
        raise SystemExit("no GGUF of this target: pass --gguf FILE")

    rows = {}
    for fmt in args.formats.split(","):
        target = Target.load(args.target, device="cpu", dtype=fmt, backend="native")
        if not rows:
            sets = load_prompt_sets(args.prompts, target, limit=args.limit)
            prompts = [p for ps in sets.values() for p in ps]
            eos = set(target.eos_ids)
            theirs = llamacpp_answers(gguf, prompts, args.new_tokens, eos, args.threads)
        ours = [
            cut_at_eos(generate_autoregressive(target, p, args.new_tokens, eos_ids=target.eos_ids).tokens, eos, 10**9)
            for p in prompts
        ]
        rows[fmt] = compare(target, prompts, ours, theirs)
        del target

    print(f"{len(prompts)} prompts x {args.new_tokens} new tokens, greedy; llama.cpp on {gguf.name}")
    print("| ours | identical answers | prefix agreement | first difference at | our top-2 margin | ours - theirs |")
    print("|---|---:|---:|---|---|---|")
    for r in rows.values():

        def med(xs):
            return f"median {statistics.median(xs):.2f} (min {min(xs):.2f})" if xs else "-"

        firsts = ", ".join(str(i) for i in sorted(r["first_difference"])) or "-"
        print(
            f"| {r['precision']} | {r['identical']}/{r['prompts']} | {r['prefix_agreement']:.3f} | {firsts} | "
            f"{med(r['top2_margin'])} | {med(r['gap_to_llamacpp_token'])} |"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "gguf": str(gguf), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
