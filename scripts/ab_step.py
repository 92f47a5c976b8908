"""A/B of the one shared step (issue 29) against the loops it replaced, interleaved in one process.

"before" is the package as it stood at a git commit (`--before REF`, e.g. the last main commit
before the step landed), extracted with `git archive` into a temporary directory and imported as
`dominospec_before` (the package imports itself relatively, so a copy runs under any name);
"after" is this checkout's `dominospec`. Each loads the bundled SmolLM2-135M and the shipped drafter
itself. Every repeat runs every (path, side) pair once, the two sides in alternating order, so a
slow spell on a shared machine hits both.

Paths: at batch 1 `ar` (plain), `lookup-cost` (prompt lookup, cost-scheduled) and `hybrid-cost` (the
shipped drafter + lookup, cost-scheduled), each over the prompts one after another; the engine at
concurrency 1 and 4 with `plain`, `lookup-cost` and `hybrid-cost` (all prompts submitted at once).
Greedy decoding. Prints generated tokens/s per path and side (median over repeats), after / before,
and whether both sides produced the same tokens for every prompt (they must).

Run on an idle CPU, pinned: `taskset -c 1 python scripts/ab_step.py --before REF --threads 1`.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
BATCH1 = ("ar", "lookup-cost", "hybrid-cost")
ENGINE = ("plain", "lookup-cost", "hybrid-cost")


def import_before(ref: str, into: Path):
    """The package at git `ref`, importable as dominospec_before."""
    blob = subprocess.run(
        ["git", "-C", str(REPO), "archive", ref, "src/dominospec"], check=True, capture_output=True
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    (into / "src" / "dominospec").rename(into / "dominospec_before")
    sys.path.insert(0, str(into))
    return importlib.import_module("dominospec_before")


def policy_factory(pkg):
    """make_policy(mode, drafter, target, lookup) across the old (decode.make_policy) and new (tune) APIs."""
    try:
        make = importlib.import_module(pkg.__name__ + ".tune.policy").make_policy

        def build(mode, drafter, target, lookup):
            return make(mode, drafter, target, lookup=lookup)

    except ModuleNotFoundError:
        make = importlib.import_module(pkg.__name__ + ".decode").make_policy

        def build(mode, drafter, target, lookup):
            return make(mode, drafter, target, lookup=lookup, greedy=True)

    return build


class Side:
    """One package (before or after): its target, drafter and the ways to run each path."""

    def __init__(self, pkg, prompt_texts: list[str], max_new: int):
        self.pkg, self.max_new = pkg, max_new
        drafter_mod = importlib.import_module(pkg.__name__ + ".drafter")
        self.decode = importlib.import_module(pkg.__name__ + ".decode")
        self.engine = importlib.import_module(pkg.__name__ + ".engine")
        self.target = pkg.Target.load("smollm2-135m")
        self.drafter = pkg.Drafter.from_pretrained(drafter_mod.shipped_drafter_dir("smollm2-135m"), target=self.target)
        self.prompts = [self.target.encode_chat(t) for t in prompt_texts]
        build = policy_factory(pkg)
        self.policies = {
            "lookup-cost": build("cost", None, self.target, True),
            "hybrid-cost": build("cost", self.drafter, self.target, True),
        }

    def batch1(self, path: str) -> list[list[int]]:
        d = self.decode
        out = []
        for ids in self.prompts:
            if path == "ar":
                res = d.generate_autoregressive(self.target, ids, self.max_new)
            else:
                drafter = self.drafter if path == "hybrid-cost" else None
                res = d.generate_speculative(
                    self.target,
                    drafter,
                    ids,
                    self.max_new,
                    lookup=d.PromptLookup(),
                    verify=self.policies[path],
                )
            out.append(res.tokens)
        return out

    def engine_run(self, path: str, concurrency: int) -> list[list[int]]:
        kw = {"max_batch": concurrency, "max_queue": len(self.prompts)}
        if path == "plain":
            eng = self.engine.Engine(self.target, **kw)
        else:
            drafter = self.drafter if path == "hybrid-cost" else None
            eng = self.engine.Engine(self.target, drafter, lookup=True, policy="cost", **kw)
        req = self.engine.EngineRequest
        handles = [eng.submit(req(ids, self.max_new, seed=0)) for ids in self.prompts]
        eng.run_until_idle()
        return [h.wait(0).tokens for h in handles]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="git ref of the code to compare with (today's loops)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompts", default="prompts/eval-chat.jsonl,prompts/eval-code.jsonl,prompts/eval-math.jsonl")
    ap.add_argument("--per-set", type=int, default=2, help="prompts taken from each file (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--json", help="also write the table here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    texts = []
    for f in args.prompts.split(","):
        lines = [json.loads(line) for line in (REPO / f).read_text().splitlines() if line.strip()]
        texts += [rec["turns"][0] for rec in lines[: args.per_set]]
    levels = [int(c) for c in args.concurrency.split(",")]

    import dominospec

    with tempfile.TemporaryDirectory() as tmp:
        before = import_before(args.before, Path(tmp))
        sides = {
            "before": Side(before, texts, args.max_new_tokens),
            "after": Side(dominospec, texts, args.max_new_tokens),
        }
        paths = [(p, lambda s, p=p: s.batch1(p)) for p in BATCH1]
        paths += [(f"engine-{p}-c{c}", lambda s, p=p, c=c: s.engine_run(p, c)) for c in levels for p in ENGINE]
        rates = {(name, side): [] for name, _ in paths for side in sides}
        outputs: dict[tuple[str, str], list[list[int]]] = {}
        for rep in range(args.repeats + 1):  # the first round warms up (kernels, profile) and is not counted
            order = list(sides) if rep % 2 else list(reversed(sides))
            for name, run in paths:
                for side in order:
                    t0 = time.perf_counter()
                    toks = run(sides[side])
                    dt = time.perf_counter() - t0
                    outputs[(name, side)] = toks
                    if rep:
                        rates[(name, side)].append(sum(map(len, toks)) / dt)
            print(f"repeat {rep}/{args.repeats} done", file=sys.stderr)

    rows = []
    print(f"| path | before tok/s | after tok/s | after / before | same tokens |  (threads {args.threads})")
    print("|---|---|---|---|---|")
    for name, _ in paths:
        b = statistics.median(rates[(name, "before")]) if args.repeats else float("nan")
        a = statistics.median(rates[(name, "after")]) if args.repeats else float("nan")
        same = outputs[(name, "before")] == outputs[(name, "after")]
        rows.append({"path": name, "before": b, "after": a, "ratio": a / b if b else None, "same_tokens": same})
        print(f"| {name} | {b:.1f} | {a:.1f} | {a / b if b else float('nan'):.3f} | {'yes' if same else 'NO'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if not all(r["same_tokens"] for r in rows):
        sys.exit("outputs differ between before and after (see the table)")


if __name__ == "__main__":
    main()
