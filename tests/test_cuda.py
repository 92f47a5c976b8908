"""The library on a CUDA device: the same forward, the same greedy tokens, reproducible sampling.

Every test here needs a CUDA device and skips without one (`pytest -m cuda` selects them). The
reference is the CPU: a tiny random target in float64 on transformers' path; the device copy of the
same weights runs on each backend. DOMINOSPEC_TEST_DEVICE=cpu runs the module's logic on the CPU
instead (a dry run of the tests themselves where no GPU is at hand).
"""

import copy
import os

import pytest
import torch
from conftest import PROMPTS, tiny_drafter, tiny_target

from dominospec import SamplingConfig, Target, generate_autoregressive, generate_speculative
from dominospec.decode import PromptLookup
from dominospec.engine import Engine, EngineRequest

DEVICE = torch.device(os.environ.get("DOMINOSPEC_TEST_DEVICE", "cuda"))

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEVICE.type == "cuda" and not torch.cuda.is_available(),
        reason="needs a CUDA device (this torch build sees none)",
    ),
]

GREEDY, T1 = SamplingConfig(), SamplingConfig(1.0)
# Relative to the largest reference logit. float64 is held to 1e-6, not 1e-9: transformers computes the
# rotary tables in fp32 whatever the model's dtype (the native path copies it), and CUDA's fp32 sin/cos
# round differently from the CPU's; on an H200 that alone left 3-4e-7 on both backends.
TOL = {torch.float64: 1e-6 if DEVICE.type == "cuda" else 1e-9, torch.float32: 1e-4}


def on_device(reference: Target, dtype, backend: str) -> Target:
    """The reference's weights copied to DEVICE in `dtype`, behind a new adapter on `backend`."""
    model = copy.deepcopy(reference.model).to(device=DEVICE, dtype=dtype)
    return Target(model, name=f"{reference.name}-{DEVICE.type}", backend=backend)


def full_pass(reference: Target, seq: list[int]):
    """Logits [S, V] and feature-layer states [S, n*H] of one uncached CPU float64 pass over seq."""
    out = reference.forward(torch.tensor([seq]), reference.new_cache())
    return out.logits[0], out.features[0]


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    scale = max(1.0, want.abs().max().item())
    err = (got.detach().to("cpu", torch.float64) - want).abs().max().item()
    assert err <= TOL[dtype] * scale, f"max error {err:.3g} over a scale of {scale:.3g} ({dtype})"


# ----- the forward -----


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_device_forward_equals_the_cpu_float64_reference(family, backend, dtype):
    """Protects: on the device, a prefill, one-token steps, a 5-token verify after a cached prefix and a
    verify after rollback give the CPU float64 logits and features (to the dtype's rounding)."""
    reference = tiny_target(family, seed=3)
    target = on_device(reference, dtype, backend)
    assert target.backend == backend and target.device.type == DEVICE.type
    seq = torch.randint(0, reference.vocab_size, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    ref_logits, ref_feats = full_pass(reference, seq)
    cache = target.new_cache(max_len=32)

    def run(start: int, stop: int) -> None:
        out = target.forward(torch.tensor([seq[start:stop]], device=DEVICE), cache)
        assert out.logits.device.type == DEVICE.type and target.cache_length(cache) == stop
        assert_close(out.logits[0], ref_logits[start:stop], dtype)
        assert_close(out.features[0], ref_feats[start:stop], dtype)

    run(0, 8)  # prefill
    run(8, 9)  # decode steps
    run(9, 10)
    run(10, 15)  # verify 5 tokens after a cached prefix
    target.crop_cache(cache, 12)  # reject the last 3
    run(12, 17)  # and verify again from there
    last = target.forward(torch.tensor([seq[17:20]], device=DEVICE), cache, last_logits_only=True)
    assert_close(last.logits[0, -1], ref_logits[19], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ragged_rows_on_the_device_equal_each_sequence_on_the_cpu(dtype):
    """Protects: one ragged forward over cache rows of different lengths and different numbers of new
    tokens (the engine's verify) gives every row its own CPU float64 logits and features."""
    reference = tiny_target("qwen3", seed=4)
    target = on_device(reference, dtype, "native")
    g = torch.Generator().manual_seed(2)
    stages = [[5, 9, 2], [3, 1, 4], [1, 1, 1]]  # new tokens per row, per forward
    seqs = [torch.randint(0, reference.vocab_size, (sum(st[r] for st in stages),), generator=g) for r in range(3)]
    refs = [full_pass(reference, s.tolist()) for s in seqs]
    cache = target.new_row_cache(3, 32)
    done = [0, 0, 0]
    for st in stages:
        ids = torch.randint(0, reference.vocab_size, (3, max(st)), generator=g)  # padding: random ids
        for r in range(3):
            ids[r, : st[r]] = seqs[r][done[r] : done[r] + st[r]]
        out = target.forward_rows(ids.to(DEVICE), cache, st, with_features=True)
        for r in range(3):
            ref_logits, ref_feats = refs[r]
            assert_close(out.logits[r, : st[r]], ref_logits[done[r] : done[r] + st[r]], dtype)
            assert_close(out.features[r, : st[r]], ref_feats[done[r] : done[r] + st[r]], dtype)
        done = [d + n for d, n in zip(done, st)]
        assert cache.lengths == done


# ----- greedy decoding is lossless -----


@pytest.fixture(scope="module", params=["native", "hf"])
def fp32_target(request):
    return on_device(tiny_target("llama", seed=0), torch.float32, request.param)


@pytest.fixture(scope="module")
def fp32_drafter(fp32_target):
    return tiny_drafter(fp32_target, head="domino", block_size=4)


def test_greedy_speculative_equals_plain_greedy_on_the_device_in_fp32(fp32_target, fp32_drafter):
    """Protects: the batch-1 speculative loop (drafter, and drafter + prompt lookup) writes plain greedy's
    tokens on the device. Control: some drafts are accepted, so verify blocks longer than one token count."""
    accepted = 0
    for prompt in PROMPTS + [[4, 4, 4, 4, 9, 9, 9, 9, 4, 4, 4, 4]]:
        plain = generate_autoregressive(fp32_target, prompt, 40, eos_ids=[]).tokens
        for lookup in (None, PromptLookup()):
            res = generate_speculative(fp32_target, fp32_drafter, prompt, 40, eos_ids=[], lookup=lookup)
            assert res.tokens == plain, (prompt, lookup is not None)
            accepted += sum(res.accepted)
    assert accepted > 0, "no draft was ever accepted: the test did not exercise multi-token verification"


@pytest.mark.parametrize("policy", ["plain", "fixed", "hybrid"])
def test_engine_gives_every_greedy_request_its_plain_greedy_output_on_the_device(policy, fp32_target, fp32_drafter):
    """Protects: requests of different lengths batched in the engine's ragged forward on the device each
    get the plain batch-1 greedy tokens (rows join mid-run; one leaves at its EOS)."""
    if fp32_target.backend != "native":
        pytest.skip("the engine runs on the native backend only")
    kw = dict(max_batch=3, prefill_chunk=4)
    if policy == "plain":
        engine = Engine(fp32_target, **kw)
    else:
        engine = Engine(fp32_target, fp32_drafter, lookup=policy == "hybrid", policy="fixed", **kw)
    eos_stop = generate_autoregressive(fp32_target, [2, 6, 2, 6], 30, eos_ids=[]).tokens[9]
    reqs = [([1, 2, 3], 20, ()), ([5, 9, 11, 2, 7, 8, 30, 4, 4, 17], 9, ()), ([4, 4, 4, 4, 4, 4], 30, ())]
    reqs += [([9, 8, 7, 6, 5, 4, 3, 2, 1, 12], 25, ()), ([2, 6, 2, 6], 30, (eos_stop,))]
    handles = [engine.submit(EngineRequest(p, m, GREEDY, eos_ids=list(e))) for p, m, e in reqs[:3]]
    for _ in range(4):
        engine.step()
    handles += [engine.submit(EngineRequest(p, m, GREEDY, eos_ids=list(e))) for p, m, e in reqs[3:]]
    engine.run_until_idle()
    for (prompt, budget, eos), h in zip(reqs, handles):
        got = h.wait(0)
        assert got.tokens == generate_autoregressive(fp32_target, prompt, budget, eos_ids=list(eos)).tokens, prompt
        assert got.finish_reason == ("stop" if eos else "length")


# ----- sampling -----


def test_sampling_on_the_device_is_reproducible_per_seed(fp32_target, fp32_drafter):
    """Protects: a seed fixes the sampled tokens on the device (the generators live there).
    Control: other seeds give other outputs, so the sampler really draws."""
    prompt = PROMPTS[1]

    def run(seed):
        return generate_speculative(fp32_target, fp32_drafter, prompt, 24, T1, seed=seed, eos_ids=[]).tokens

    first = run(3)
    assert all(0 <= t < fp32_target.vocab_size for t in first) and len(first) == 24
    assert run(3) == first
    assert len({tuple(run(s)) for s in range(4)}) > 1, "four seeds gave one output"
    plain = generate_autoregressive(fp32_target, prompt, 24, T1, seed=3, eos_ids=[]).tokens
    assert generate_autoregressive(fp32_target, prompt, 24, T1, seed=3, eos_ids=[]).tokens == plain


@pytest.mark.parametrize("policy", ["plain", "fixed"])
def test_one_sampled_request_through_the_engine_equals_the_batch1_loop_on_the_device(policy, fp32_target, fp32_drafter):
    """Protects: the engine draws a request's tokens from that request's own device generator in the
    batch-1 loop's order, so the same seed gives the same sampled tokens in both."""
    if fp32_target.backend != "native":
        pytest.skip("the engine runs on the native backend only")
    prompt = [5, 9, 11, 2, 7, 8, 30, 4, 4, 17, 5, 9, 11]
    if policy == "plain":
        engine = Engine(fp32_target, max_batch=2)
        ref = generate_autoregressive(fp32_target, prompt, 30, T1, seed=7, eos_ids=[])
    else:
        engine = Engine(fp32_target, fp32_drafter, policy="fixed", max_batch=2)
        ref = generate_speculative(fp32_target, fp32_drafter, prompt, 30, T1, seed=7, eos_ids=[])
    h = engine.submit(EngineRequest(prompt, 30, T1, seed=7, eos_ids=[]))
    engine.run_until_idle()
    got = h.wait(0)
    assert got.tokens == ref.tokens
    if policy == "fixed":
        assert got.accepted == ref.accepted and got.cycles == ref.cycles > 0
