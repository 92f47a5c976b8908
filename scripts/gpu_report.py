"""What the GPU shows that the CPU cannot: verify cost, engine throughput, and bf16 token identity.

Models are random-weight models built from configs shaped like real ones (no hub access needed):
SmolLM2-135M, Llama-3.2-1B and Qwen3-4B. Three sections, each written to JSON as soon as it ends:

  verify    one target forward over k = 1..max_k new tokens after a cached context, as a multiple
            of one decode step (k = 1), per model, dtype, backend and context (tune/profile.py's
            profile_verify_cost: median of interleaved repeats, features on, as the loop runs it)
  engine    the engine's aggregate generated tokens/s with policy plain at each concurrency C
            (max_batch = C, 2C requests queued, greedy, no EOS)
  identity  greedy speculative decoding (random drafter; drafter + prompt lookup) and the engine's
            batched plain decoding against batch-1 plain greedy, token by token, per dtype. A random
            drafter is almost never right, so most cycles verify a full block and commit the target's
            token read from a (k+1)-row forward where plain decoding read it from a 1-row forward:
            in reduced precision those can round differently and flip a near-tie. Every divergence is
            reported with the position of its first differing token; `--sharpen` scales the final
            norm (so the logits) to show how the count depends on the margins of the random model.

    PYTHONPATH=src python3 scripts/gpu_report.py --out runs/gpu            # on a CUDA machine (5-7 min on an H200)
    PYTHONPATH=src python3 scripts/gpu_report.py --device cpu --tiny --out runs/gpu-dry   # dry run
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dominospec import Drafter, DrafterConfig, SamplingConfig, Target, generate_autoregressive, generate_speculative
from dominospec.decode import PromptLookup
from dominospec.devices import describe_device, synchronize
from dominospec.engine import Engine, EngineRequest
from dominospec.tune.profile import profile_verify_cost

# Published shapes (config.json of each model); weights are random.
SHAPES = {
    "smollm2-135m": dict(
        family="llama",
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
    ),
    "llama-3.2-1b": dict(
        family="llama",
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    "qwen3-4b": dict(
        family="qwen3",
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    ),
    # the dry run's stand-in (--tiny)
    "tiny": dict(
        family="llama",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    ),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_model(shape: str, device: torch.device, seed: int = 0):
    """A random-weight HF causal LM of `shape`, initialised on `device` in fp32 (tied embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    s = dict(SHAPES[shape])
    family, theta = s.pop("family"), s.pop("rope_theta")
    common = dict(
        **s,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        eos_token_id=s["vocab_size"] - 1,
        bos_token_id=0,
        pad_token_id=0,
    )
    cls, cfg = (LlamaForCausalLM, LlamaConfig) if family == "llama" else (Qwen3ForCausalLM, Qwen3Config)
    torch.manual_seed(seed)
    with torch.device(device):  # initialise where it runs: a 4B model on the CPU takes minutes
        model = cls(cfg(**common))
    return model.eval()


def make_target(model, dtype: torch.dtype, backend: str, name: str) -> Target:
    model.to(dtype)
    return Target(model, name=name, backend=backend)


def random_drafter(target: Target, block_size: int, seed: int = 1) -> Drafter:
    """An untrained drafter (2 layers); its head weights are randomised so proposals vary per slot."""
    torch.manual_seed(seed)
    d = Drafter(DrafterConfig.for_target(target, head="domino", block_size=block_size))
    for name, p in d.named_parameters():
        if name.startswith("head.") and name.endswith("w2.weight"):
            torch.nn.init.normal_(p, std=2.0)
    return d.attach(target)


def release(*objs) -> None:
    for o in objs:
        del o
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ----- (a) verify cost -----


def verify_section(args, dev, report, save) -> None:
    rows = report.setdefault("verify", [])
    for shape in args.models:
        model = build_model(shape, dev)
        for dname in args.dtypes:
            for backend in args.backends:
                target = make_target(model, DTYPES[dname], backend, shape)
                for ctx in args.contexts:
                    t0 = time.perf_counter()
                    prof = profile_verify_cost(target, ctx, args.max_k, args.repeats, progress=False)
                    rows.append(
                        dict(
                            model=shape,
                            dtype=dname,
                            backend=target.backend,
                            context=ctx,
                            k=prof["k"],
                            decode_ms=1e3 * prof["seconds"][0],
                            ms=[1e3 * s for s in prof["seconds"]],
                            relative_to_decode=prof["relative_to_1"],
                            min_relative_to_decode=prof["min_relative_to_1"],
                            repeats=args.repeats,
                        )
                    )
                    rel = " ".join(f"{r:.2f}" for r in prof["relative_to_1"])
                    print(f"verify {shape} {dname} {backend} ctx {ctx}: decode {rows[-1]['decode_ms']:.2f} ms; x {rel}")
                    print(f"  ({time.perf_counter() - t0:.1f} s)", flush=True)
                    save()
                release(target)
        release(model)


# ----- (b) engine throughput -----


def run_engine(target, prompts, max_new: int, max_batch: int, drafter=None, policy="plain") -> tuple[list, float]:
    """(tokens per request, wall seconds) for every prompt queued at once into an engine of max_batch slots."""
    max_len = max(len(p) for p in prompts) + max_new + 32
    if policy == "plain":
        engine = Engine(target, max_batch=max_batch, max_queue=len(prompts), max_len=max_len)
    else:
        engine = Engine(target, drafter, policy=policy, max_batch=max_batch, max_queue=len(prompts), max_len=max_len)
    synchronize(target.device)
    t0 = time.perf_counter()
    greedy = SamplingConfig()
    handles = [engine.submit(EngineRequest(p, max_new, greedy, seed=i, eos_ids=[])) for i, p in enumerate(prompts)]
    engine.run_until_idle()
    synchronize(target.device)
    wall = time.perf_counter() - t0
    return [h.wait(0).tokens for h in handles], wall


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab - 1, (n, length), generator=g).tolist()


def engine_section(args, dev, report, save) -> None:
    rows = report.setdefault("engine", [])
    for shape in args.engine_models:
        model = build_model(shape, dev)
        target = make_target(model, DTYPES[args.engine_dtype], "native", shape)
        run_engine(target, random_prompts(2, args.prompt_len, target.vocab_size, 99), 8, 2)  # warm-up
        for c in args.concurrency:
            prompts = random_prompts(2 * c, args.prompt_len, target.vocab_size, c)
            tokens, wall = run_engine(target, prompts, args.engine_tokens, c)
            n = sum(len(t) for t in tokens)
            rows.append(
                dict(
                    model=shape,
                    dtype=args.engine_dtype,
                    policy="plain",
                    concurrency=c,
                    requests=len(prompts),
                    prompt_len=args.prompt_len,
                    new_tokens=args.engine_tokens,
                    tokens=n,
                    wall_s=wall,
                    tokens_per_s=n / wall,
                )
            )
            print(f"engine {shape} {args.engine_dtype} plain C={c}: {n} tokens in {wall:.2f} s = {n / wall:.0f} tok/s")
            save()
        # the same work without the engine: the batch-1 loop over the C=1 prompts, one after the other
        prompts = random_prompts(2, args.prompt_len, target.vocab_size, 1)
        synchronize(dev)
        t0 = time.perf_counter()
        n = sum(len(generate_autoregressive(target, p, args.engine_tokens, eos_ids=[]).tokens) for p in prompts)
        synchronize(dev)
        wall = time.perf_counter() - t0
        rows.append(
            dict(
                model=shape,
                dtype=args.engine_dtype,
                policy="batch-1 loop (generate_autoregressive)",
                concurrency=1,
                requests=2,
                prompt_len=args.prompt_len,
                new_tokens=args.engine_tokens,
                tokens=n,
                wall_s=wall,
                tokens_per_s=n / wall,
            )
        )
        print(f"batch-1 loop {shape}: {n} tokens in {wall:.2f} s = {n / wall:.0f} tok/s", flush=True)
        if args.profile_engine and shape == args.engine_models[0]:
            profile_engine(target, prompts[:1], args.out / "engine_profile.txt")
        save()
        release(target, model)


def profile_engine(target, prompts, path: Path) -> None:
    """cProfile of one engine run and one batch-1 run (C = 1, 32 tokens): where a step's time goes on the host."""
    import cProfile
    import io
    import pstats

    text = io.StringIO()
    for name, work in (
        ("engine, policy plain, C=1", lambda: run_engine(target, prompts, 32, 1)),
        ("batch-1 loop", lambda: [generate_autoregressive(target, p, 32, eos_ids=[]) for p in prompts]),
    ):
        prof = cProfile.Profile()
        prof.enable()
        work()
        synchronize(target.device)
        prof.disable()
        text.write(f"===== {name} =====\n")
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    path.write_text(text.getvalue())


# ----- (c) token identity in reduced precision -----


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarise(name: str, outputs: list[list[int]], plain: list[list[int]]) -> dict:
    firsts = [first_difference(o, p) for o, p in zip(outputs, plain)]
    diverged = [f for f in firsts if f is not None]
    return dict(
        compared=name,
        sequences=len(plain),
        diverged=len(diverged),
        first_divergence=firsts,
        median_first_divergence=statistics.median(diverged) if diverged else None,
    )


@torch.inference_mode()
def top2_margins(target: Target, prompts: list[list[int]]) -> dict:
    """The gap between the top two logits at each prompt's last position (how near the random model's ties are)."""
    gaps = []
    for p in prompts:
        out = target.forward(torch.tensor([p], device=target.device), target.new_cache(), with_features=False)
        top = out.logits[0, -1].float().topk(2).values
        gaps.append(float(top[0] - top[1]))
    gaps.sort()
    return dict(median=statistics.median(gaps), p10=gaps[len(gaps) // 10], min=gaps[0])


def identity_section(args, dev, report, save) -> None:
    rows = report.setdefault("identity", [])
    shape = args.identity_model
    prompts = random_prompts(args.identity_prompts, args.prompt_len, SHAPES[shape]["vocab_size"], 7)
    for dname, sharpen in args.identity_runs:
        model = build_model(shape, dev)
        with torch.no_grad():
            model.model.norm.weight.mul_(sharpen)  # logits scale with the final norm's weight
        target = make_target(model, DTYPES[dname], "native", shape)
        drafter = random_drafter(target, args.block_size)
        t0 = time.perf_counter()
        n = args.identity_tokens
        plain = [generate_autoregressive(target, p, n, eos_ids=[]).tokens for p in prompts]
        spec, hybrid, accepted, cycles = [], [], 0, 0
        for p in prompts:
            res = generate_speculative(target, drafter, p, n, eos_ids=[])
            spec.append(res.tokens)
            res_h = generate_speculative(target, drafter, p, n, eos_ids=[], lookup=PromptLookup())
            hybrid.append(res_h.tokens)
            accepted += sum(res.accepted) + sum(res_h.accepted)
            cycles += res.cycles + res_h.cycles
        batched, _ = run_engine(target, prompts, n, len(prompts))
        row = dict(
            model=shape,
            dtype=dname,
            sharpen=sharpen,
            new_tokens=n,
            block_size=args.block_size,
            top2_logit_gap=top2_margins(target, prompts),
            accepted_per_cycle=accepted / max(cycles, 1),
            results=[
                summarise("speculative (drafter) vs plain", spec, plain),
                summarise("speculative (drafter + lookup) vs plain", hybrid, plain),
                summarise(f"engine plain, {len(prompts)} rows batched, vs plain batch 1", batched, plain),
            ],
            seconds=time.perf_counter() - t0,
        )
        rows.append(row)
        for r in row["results"]:
            print(f"identity {shape} {dname} x{sharpen}: {r['compared']}: {r['diverged']}/{r['sequences']} diverge")
        print(f"  accepted/cycle {row['accepted_per_cycle']:.2f}, {row['seconds']:.1f} s", flush=True)
        save()
        release(drafter, target, model)


# ----- the report -----


def markdown(report: dict) -> str:
    meta = report["meta"]
    out = [f"Device: {meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}.", ""]
    if report.get("verify"):
        ks = report["verify"][0]["k"]
        out += ["### Verify cost: one forward over k new tokens as a multiple of one decode step (k = 1)", ""]
        out.append("| model | dtype | backend | context | decode ms | " + " | ".join(f"k={k}" for k in ks) + " |")
        out.append("|---|---|---|---|---|" + "---|" * len(ks))
        for r in report["verify"]:
            rel = " | ".join(f"{x:.2f}" for x in r["relative_to_decode"])
            head = f"| {r['model']} | {r['dtype']} | {r['backend']} | {r['context']} | {r['decode_ms']:.2f}"
            out.append(f"{head} | {rel} |")
        out.append("")
    if report.get("engine"):
        out += ["### Engine, policy plain: aggregate generated tokens/s", ""]
        out.append("| model | dtype | concurrency | requests | tokens | wall s | tokens/s |")
        out.append("|---|---|---|---|---|---|---|")
        for r in report["engine"]:
            out.append(
                f"| {r['model']} | {r['dtype']} | {r['concurrency']} | {r['requests']} | {r['tokens']} | "
                f"{r['wall_s']:.2f} | {r['tokens_per_s']:.0f} |"
            )
        out.append("")
    if report.get("identity"):
        out += ["### Greedy token identity against batch-1 plain greedy", ""]
        out.append("| model | dtype | logit scale | top-2 gap (median) | compared | diverged | first differing token |")
        out.append("|---|---|---|---|---|---|---|")
        for r in report["identity"]:
            for c in r["results"]:
                firsts = sorted(f for f in c["first_divergence"] if f is not None)
                out.append(
                    f"| {r['model']} | {r['dtype']} | x{r['sharpen']} | {r['top2_logit_gap']['median']:.3f} | "
                    f"{c['compared']} | {c['diverged']}/{c['sequences']} | {', '.join(map(str, firsts)) or '-'} |"
                )
        out.append("")
    return "\n".join(out)


def parse_runs(spec: str) -> list[tuple[str, float]]:
    """'fp32:1,bf16:1,bf16:8' -> [(dtype, final-norm scale), ...]."""
    runs = []
    for part in spec.split(","):
        d, _, s = part.partition(":")
        runs.append((d, float(s or 1)))
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, required=True, help="directory for gpu_report.json and gpu_report.md")
    ap.add_argument("--tiny", action="store_true", help="tiny models and sizes: a dry run of the script itself")
    ap.add_argument("--sections", default="verify,engine,identity")
    ap.add_argument("--models", default="smollm2-135m,llama-3.2-1b,qwen3-4b")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--backends", default="native,hf")
    ap.add_argument("--contexts", default="256,1024")
    ap.add_argument("--max-k", type=int, default=17)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--engine-models", default="smollm2-135m,llama-3.2-1b")
    ap.add_argument("--engine-dtype", default="bf16")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--engine-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--profile-engine", action="store_true", help="write engine_profile.txt (cProfile, C = 1)")
    ap.add_argument("--identity-model", default="smollm2-135m")
    ap.add_argument("--identity-runs", default="fp32:1,bf16:1,bf16:8", help="dtype:final-norm scale, ...")
    ap.add_argument("--identity-prompts", type=int, default=16)
    ap.add_argument("--identity-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=4)
    args = ap.parse_args(argv)
    if args.tiny:
        args.models = args.engine_models = args.identity_model = "tiny"
        args.contexts, args.max_k, args.repeats = "32,64", 5, 2
        args.concurrency, args.engine_tokens, args.prompt_len = "1,2", 8, 8
        args.identity_prompts, args.identity_tokens = 3, 12
    args.models, args.engine_models = args.models.split(","), args.engine_models.split(",")
    args.dtypes, args.backends = args.dtypes.split(","), args.backends.split(",")
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.identity_runs = parse_runs(args.identity_runs)
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 (the default; said here on purpose)
    import transformers

    report = {
        "meta": dict(
            device=describe_device(dev),
            torch=torch.__version__,
            cuda=torch.version.cuda,
            transformers=transformers.__version__,
            python=platform.python_version(),
            argv=sys.argv[1:],
        )
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (args.out / "gpu_report.json").write_text(json.dumps(report, indent=1))
        (args.out / "gpu_report.md").write_text(markdown(report))

    sections = {"verify": verify_section, "engine": engine_section, "identity": identity_section}
    for name in args.sections.split(","):
        t0 = time.perf_counter()
        try:
            sections[name](args, dev, report, save)
        except Exception as exc:  # one broken section must not lose the others' numbers
            report.setdefault("errors", []).append(f"{name}: {type(exc).__name__}: {exc}")
            print(f"section {name} failed: {type(exc).__name__}: {exc}", flush=True)
        report["meta"][f"{name}_seconds"] = time.perf_counter() - t0
        save()
    print(markdown(report))
    return 1 if report.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
