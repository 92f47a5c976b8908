"""The native target forward (targets/native.py) against transformers, on tiny random models built offline."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import fused_vs_python

from dominospec.targets.native import KVCache, Linear, NativeModel, _packing_available, native_support

TOL = {torch.float64: 1e-9, torch.float32: 1e-4}
L = 4  # decoder layers of the tiny models
FEATS = [0, 2, L - 1]  # includes the last layer, whose HF hidden_states entry is post-norm


def tiny(kind: str, dtype=torch.float32):
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    if kind == "llama":  # SmolLM2-like: tied embeddings; llama3 rope scaling exercises HF's inv_freq
        cfg = transformers.LlamaConfig(
            **common,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":  # q/k/v bias, no o bias
        cfg, cls = transformers.Qwen2Config(**common, tie_word_embeddings=False), transformers.Qwen2ForCausalLM
    elif kind == "qwen3":  # per-head q/k RMSNorm
        cfg, cls = transformers.Qwen3Config(**common, tie_word_embeddings=False), transformers.Qwen3ForCausalLM
    elif kind == "mistral":
        cfg, cls = transformers.MistralConfig(**common, sliding_window=None), transformers.MistralForCausalLM
    else:
        raise ValueError(kind)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():  # O(1) logits and non-trivial norm weights / biases, so mistakes show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model.to(dtype)


def hf_reference(model, ids):
    """Logits [S, V] and {layer j: output of decoder layer j [S, H]} from one uncached HF pass."""
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.update(last=o))
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    hook.remove()
    feats = {j: out.hidden_states[j + 1][0] for j in range(L - 1)}
    last = captured["last"]
    feats[L - 1] = (last[0] if isinstance(last, tuple) else last)[0]  # pre-norm, unlike hidden_states[-1]
    return out.logits[0], feats


def check_rows(model, full_ids, logits, feats, start, tol):
    """Rows start.. of the native outputs (batch row 0) equal HF on the whole sequence."""
    ref_logits, ref_feats = hf_reference(model, full_ids)
    S = logits.shape[1]
    assert (logits[0] - ref_logits[start : start + S]).abs().max().item() <= tol
    want = torch.cat([ref_feats[j][start : start + S] for j in FEATS], dim=-1)
    assert feats.shape == (1, S, len(FEATS) * 64)
    assert (feats[0] - want).abs().max().item() <= tol


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_matches_transformers_prefill_steps_verify_rollback(kind, dtype, linear_path):
    """Protects: native logits and feature layers equal HF's for prefill, 1-token steps, a k-token
    verify on a cached prefix, and after rollback + re-extension with different tokens."""
    model = tiny(kind, dtype)
    assert native_support(model) is None
    native = NativeModel.from_hf(model)
    tol = TOL[dtype]
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 256, (24,), generator=g).tolist()
    cache = native.new_cache(1, max_len=64)

    def run(new, start):
        logits, feats = native(torch.tensor([new]), cache, logits="all", feature_layers=FEATS)
        check_rows(model, seq[: start + len(new)], logits, feats, start, tol)
        assert cache.length() == start + len(new)
        return logits

    run(seq[:8], 0)  # prefill
    for i in range(8, 11):  # single-token decode steps
        run(seq[i : i + 1], i)
    logits = run(seq[11:16], 11)  # verify 5 tokens after a cached prefix
    cache.crop(13)  # rollback: reject the last 3 verified tokens
    seq[13:17] = torch.randint(0, 256, (4,), generator=g).tolist()  # re-extend with other tokens
    run(seq[13:17], 13)
    cache.set_length(0, 17)
    last, none = native(torch.tensor([seq[17:20]]), cache, logits="last")
    ref_logits, _ = hf_reference(model, seq[:20])
    assert none is None and last.shape == (1, 256)
    assert (last[0] - ref_logits[19]).abs().max().item() <= tol
    assert logits.shape == (1, 5, 256)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_ragged_batch_equals_rows_alone(dtype, linear_path):
    """Protects: in a batch with different cached lengths and different numbers of new tokens,
    padding columns change nothing and every real column equals that sequence run alone
    (ragged prefill, ragged multi-token verify, then a 1-token step at different lengths)."""
    model = tiny("qwen3", dtype)
    native = NativeModel.from_hf(model)
    tol = TOL[dtype]
    g = torch.Generator().manual_seed(2)
    stages = [[5, 9, 2], [3, 1, 4], [1, 1, 1]]  # new tokens per row, per call
    seqs = [torch.randint(0, 256, (sum(st[b] for st in stages),), generator=g) for b in range(3)]

    cache = native.new_cache(3, max_len=32)
    batched, done = [], [0, 0, 0]
    for st in stages:
        width = max(st)
        ids = torch.randint(0, 256, (3, width), generator=g)  # padding = random ids
        for b in range(3):
            ids[b, : st[b]] = seqs[b][done[b] : done[b] + st[b]]
        lg, ft = native(ids, cache, num_new=st, feature_layers=FEATS)
        cache.lengths = list(done)  # roll back and redo asking for last-token logits only
        last, _ = native(ids, cache, num_new=st, logits="last")
        done = [d + n for d, n in zip(done, st)]
        assert cache.lengths == done
        batched.append((lg, ft, last))
    for b in range(3):
        alone, pos = native.new_cache(1, max_len=32), 0
        for st, (lg, ft, last) in zip(stages, batched):
            n = st[b]
            a, f = native(seqs[b][None, pos : pos + n], alone, feature_layers=FEATS)
            pos += n
            assert (lg[b, :n] - a[0]).abs().max().item() <= tol
            assert (ft[b, :n] - f[0]).abs().max().item() <= tol
            assert (last[b] - a[0, -1]).abs().max().item() <= tol


def test_batch_equal_lengths_decode_without_mask():
    """Protects: the unmasked batch path (equal lengths, 1 new token per row, grouped-query SDPA)
    keeps rows independent and equal to each row run alone."""
    model = tiny("llama", torch.float32)
    native = NativeModel.from_hf(model)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 256, (2, 7), generator=g)
    cache = native.new_cache(2, max_len=16)
    native(ids[:, :6], cache, logits="none")
    step, _ = native(ids[:, 6:], cache, logits="last")
    for b in range(2):
        alone = native.new_cache(1, max_len=16)
        ref, _ = native(ids[b : b + 1], alone, logits="last")
        assert (step[b] - ref[0]).abs().max().item() <= 1e-4


@pytest.mark.skipif(not _packing_available(), reason="oneDNN packing not in this torch build")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_equals_f_linear(bias, linear_path):
    """Protects: the kernel / packed / transposed / plain fp32 paths all compute x @ W^T + b, every row count."""
    torch.manual_seed(3)
    for out_f, in_f in [(96, 64), (64, 96), (960, 576), (576, 1536)]:  # both M=1 paths
        w = torch.randn(out_f, in_f) / in_f**0.5
        b = torch.randn(out_f) if bias else None
        lin = Linear(w, b)
        assert (lin.kernel is not None) == (linear_path == "kernels-on")
        assert (lin.packed is not None) == (linear_path == "kernels-off")
        for m in [1, 2, 9, 17, 64]:
            x = torch.randn(1, m, in_f)
            assert (lin(x) - F.linear(x, w, b)).abs().max().item() <= 1e-4
    assert Linear(w.double()).packed is None and Linear(w.double()).kernel is None  # other dtypes: F.linear


@pytest.mark.parametrize("bias", [False, True])
def test_kernel_linear_equals_f_linear_at_every_small_row_count(bias):
    """Protects: the small-M kernel computes x @ W^T + b to fp32 rounding for M = 1..17 on odd
    shapes (N not a multiple of the panel width, K odd), and a row's result does not depend on
    the other rows in the call (same bits alone and in a batch of 17)."""
    from dominospec.targets.kernels import PackedLinear, load_kernels

    module = load_kernels()
    if module is None:
        pytest.skip("the small-M kernel does not build here (no compiler)")
    g = torch.Generator().manual_seed(7)
    for out_f, in_f in [(1, 1), (5, 3), (33, 17), (100, 37), (960, 576), (576, 1536)]:
        w = torch.randn(out_f, in_f, generator=g) / in_f**0.5
        b = torch.randn(out_f, generator=g) if bias else None
        lin = PackedLinear(module, w, b)
        x = torch.randn(17, in_f, generator=g)
        batch = lin(x)
        for m in range(1, 18):
            y = lin(x[:m])
            assert y.shape == (m, out_f)
            assert (y - F.linear(x[:m], w, b)).abs().max().item() <= 1e-4 * max(1.0, in_f**0.5)
            assert torch.equal(y, batch[:m])
        assert lin(x[None, 3:7]).shape == (1, 4, out_f)  # leading dimensions pass through
    control = w.clone()
    control[0, 0] += 1.0  # a wrong weight is caught by the same comparison
    assert (PackedLinear(module, control, b)(x) - F.linear(x, w, b)).abs().max().item() > 1e-2


def test_native_support_refuses_other_families():
    """Protects: unsupported models are refused with a sentence instead of silently mis-computed."""
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64))
    why = native_support(gpt2)
    assert isinstance(why, str) and "gpt2" in why
    with pytest.raises(ValueError):
        NativeModel.from_hf(gpt2)
    common = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    mistral = transformers.MistralForCausalLM(transformers.MistralConfig(**common, sliding_window=16))
    assert "sliding" in native_support(mistral)
    dyn = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **common, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
        )
    )
    assert "dynamic" in native_support(dyn)


def test_cache_grows_past_max_len():
    """Protects: a forward that overruns max_len doubles the buffers and stays exact."""
    model = tiny("llama", torch.float64)
    native = NativeModel.from_hf(model)
    cache = native.new_cache(1, max_len=4)
    seq = torch.randint(0, 256, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    lg, ft = native(torch.tensor([seq[:6]]), cache, feature_layers=FEATS)
    check_rows(model, seq[:6], lg, ft, 0, 1e-9)
    for i in range(6, 21, 5):
        lg, ft = native(torch.tensor([seq[i : i + 5]]), cache, feature_layers=FEATS)
    check_rows(model, seq, lg, ft, 16, 1e-9)
    assert cache.max_len >= 21 and cache.length() == 21 and isinstance(cache, KVCache)


# ----- the native backend behind the Target adapter -----


def test_target_on_native_backend_decodes_exactly_like_transformers():
    """Protects: greedy speculative decoding through the native path equals plain greedy through the
    native path and through transformers (float64, so ties cannot flip)."""
    from conftest import tiny_drafter

    from dominospec import Target, generate_autoregressive, generate_speculative

    hf_model = tiny("llama", torch.float64)
    hf, nat = Target(hf_model, name="hf"), Target(hf_model, name="native", backend="native")
    assert hf.backend == "hf" and nat.backend == "native"
    drafter = tiny_drafter(nat, head="domino", block_size=4)
    for prompt in ([1, 5, 9, 2], [7] * 11):
        ref = generate_autoregressive(hf, prompt, 24, eos_ids=[]).tokens
        assert generate_autoregressive(nat, prompt, 24, eos_ids=[]).tokens == ref
        for b in (1, 4):
            spec = generate_speculative(nat, drafter, prompt, 24, block_size=b, eos_ids=[])
            assert spec.tokens == ref and spec.cycles > 0


def test_greedy_speculative_equals_plain_greedy_in_fp32_on_each_linear_path(linear_path):
    """Protects: in fp32 on the native path (kernel or library GEMMs), greedy speculative output is
    token for token the plain greedy output of the same path, for every block size."""
    from conftest import tiny_drafter

    from dominospec import Target, generate_autoregressive, generate_speculative

    nat = Target(tiny("llama", torch.float32), name="native", backend="native")
    assert (nat.native.lm_head.kernel is not None) == (linear_path == "kernels-on")
    drafter = tiny_drafter(nat, head="domino", block_size=4).to(torch.float32)
    for prompt in ([1, 5, 9, 2], [7] * 11, list(range(3, 40, 2))):
        ref = generate_autoregressive(nat, prompt, 32, eos_ids=[]).tokens
        for b in (1, 2, 4):
            spec = generate_speculative(nat, drafter, prompt, 32, block_size=b, eos_ids=[])
            assert spec.tokens == ref and spec.cycles > 0


def test_family_outside_the_native_set_runs_on_transformers_and_says_so():
    from dominospec import Target, generate_autoregressive

    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=3, n_head=2, n_positions=64)
    ).eval()
    target = Target(gpt2, name="tiny-gpt2", backend="native")
    assert target.backend == "hf" and "transformers path" in target.backend_note and "gpt2" in target.backend_note
    assert len(generate_autoregressive(target, [1, 2, 3], 5, eos_ids=[]).tokens) == 5
    assert Target(gpt2, backend="auto").backend_note is None  # auto falls back without a word


def test_native_batched_sampling_matches_single_sequences():
    """Protects: batched data generation on the native path gives each prompt the answer it would get
    alone (greedy: the plain greedy continuation; sampled: independent of its batch mates), stops at
    EOS, and keeps working as finished rows leave the batch."""
    from dominospec import Target, generate_autoregressive

    model = tiny("llama", torch.float64)
    target = Target(model, name="t", backend="native")
    eos = 7
    model.generation_config.eos_token_id = eos
    prompts = [[1, 2, 3], [4] * 9, [5, 6], [9, 8, 7, 6, 5, 4]]
    greedy = target.sample_batch(prompts, 12, temperature=0.0)
    for p, answer in zip(prompts, greedy):
        alone = generate_autoregressive(target, p, 12, eos_ids=[eos]).tokens
        assert answer == alone
    a = target.sample_batch(prompts, 12, temperature=1.0, top_p=0.9, seed=3)
    b = target.sample_batch([prompts[0], [11, 12]], 12, temperature=1.0, top_p=0.9, seed=3)
    assert a[0] == b[0] and all(len(x) <= 12 and (len(x) == 12 or x[-1] == eos) for x in a)
    assert a != target.sample_batch(prompts, 12, temperature=1.0, top_p=0.9, seed=4)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.7, 0, 0.8), (1.0, 50, 1.0), (1.0, 50, 0.9), (1.3, 0, 0.95)])
def test_candidate_probs_are_warp_probs_exactly(temperature, top_k, top_p):
    """Protects: the data sampler's fast path (top-p/top-k over the top candidates only) keeps warp_probs'
    distribution: the same shares on every token, or a refusal (None) that sends the row to the full path."""
    from dominospec.sampling import SamplingConfig, candidate_probs, warp_probs

    torch.manual_seed(0)
    logits = torch.randn(6, 1000) * 4
    s = SamplingConfig(temperature, top_k, top_p)
    fast = candidate_probs(logits, s, k=256)
    assert fast is not None
    probs, idx = fast
    dense = torch.zeros(6, 1000).scatter_(-1, idx, probs)
    torch.testing.assert_close(dense / dense.sum(-1, keepdim=True), warp_probs(logits, s), atol=1e-6, rtol=1e-5)


def test_candidate_probs_refuse_when_the_tail_could_survive():
    from dominospec.sampling import SamplingConfig, candidate_probs

    flat = torch.zeros(2, 1000)
    assert candidate_probs(flat, SamplingConfig(1.0, 0, 0.9), k=256) is None  # 256 tokens hold 26% < 90%
    assert candidate_probs(torch.randn(2, 1000), SamplingConfig(1.0, 300, 1.0), k=256) is None  # top-k past k
    assert candidate_probs(torch.randn(2, 1000), SamplingConfig(1.0, 0, 1.0), k=256) is None  # no tail cut
    ties = torch.zeros(1, 1000)
    ties[0, :3] = 5.0
    assert candidate_probs(ties, SamplingConfig(1.0, 10, 1.0), k=256) is None  # ties at the 10th run past k


def test_sample_rows_draws_from_the_warped_distribution():
    """Each row from its own generator, frequencies within 4 sigma of warp_probs (fast path, k = V here)."""
    from dominospec.sampling import SamplingConfig, sample_rows, warp_probs

    torch.manual_seed(1)
    row = torch.randn(40) * 2
    s = SamplingConfig(0.8, 0, 0.9)
    n = 3000
    picks = sample_rows(row.expand(n, -1), s, [torch.Generator().manual_seed(i) for i in range(n)])
    p = warp_probs(row[None], s)[0]
    freq = torch.bincount(torch.tensor(picks), minlength=40).double() / n
    assert float(freq[p == 0].sum()) == 0.0  # nothing outside the nucleus
    sigma = (p * (1 - p) / n).sqrt()
    assert bool(((freq - p).abs() <= 4 * sigma + 1e-9).all()), (freq, p)


@pytest.mark.parametrize("layer_ids", [[0, 2], [1, 3]])  # [1, 3] includes the last layer (post-norm in HF)
def test_native_sequence_features_equal_the_transformers_pass(layer_ids):
    """Protects: training features on the native path (one unpadded sequence at a time) are HF's hidden states."""
    from dominospec import Target

    model = tiny("qwen3", torch.float64)
    hf, nat = Target(model, name="t", backend="hf"), Target(model, name="t", backend="native")
    assert nat.native is not None and hf.native is None
    seqs = [[1, 5, 9, 3, 2, 8, 7], [4, 4, 6], list(range(1, 30))]
    fh, lh = hf.sequence_features(seqs, layer_ids)
    fn, ln = nat.sequence_features(seqs, layer_ids)
    for a, b, c, d, s in zip(fh, fn, lh, ln, seqs):
        assert a.shape == b.shape == (len(s), len(layer_ids) * hf.hidden_size)
        torch.testing.assert_close(b, a, atol=1e-9, rtol=1e-9)
        torch.testing.assert_close(d, c, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_the_fused_layers_compute_the_python_layers(kind, monkeypatch):
    """Protects: decode- and verify-sized forwards run every decoder layer in one call of the kernel extension
    (DecoderLayers: norms, fused projections with their biases, q/k norms, RoPE, cache writes, attention,
    residuals); it computes what the Python loop over the layers computes (to fp32 rounding, same greedy
    picks) for ragged rows, features included."""
    from dominospec.targets import kernels
    from dominospec.targets.native import FUSED_SWITCH

    if kernels.load_kernels() is None:
        pytest.skip("the small-M kernel does not build here (no compiler)")
    native = NativeModel.from_hf(tiny(kind))
    prompts = [[(5 * i + r) % 250 + 1 for i in range(9 + 11 * r)] for r in range(3)]
    new = [[3, 8, 1, 4], [12], [40, 41, 42]]
    out = fused_vs_python(native, monkeypatch, FUSED_SWITCH, prompts, new)
    (fused, f_feats), (loop, l_feats) = out["on"], out["off"]
    for r, toks in enumerate(new):
        n = len(toks)
        torch.testing.assert_close(fused[r, :n], loop[r, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(f_feats[r, :n], l_feats[r, :n], rtol=1e-5, atol=1e-5)
        assert torch.equal(fused[r, :n].argmax(-1), loop[r, :n].argmax(-1))


def test_a_second_kernel_build_waits_and_imports_the_first_ones_library(tmp_path, monkeypatch):
    """Two processes building the same kernel key at once (parallel test workers, two commands started
    together) must not compile into the same files: the second waits on the directory's lock, then finds the
    library the first one built and imports it instead of building again."""
    import threading

    from dominospec.io import exclusive_lock
    from dominospec.targets import kernels

    built, library = [], object()
    monkeypatch.setattr(kernels, "_build", lambda name, directory: built.append(name) or library)
    monkeypatch.setattr(kernels, "_import_built", lambda name, directory: library if built else None)
    result = []
    with exclusive_lock(tmp_path, "kernel build"):  # the first build, still running
        second = threading.Thread(target=lambda: result.append(kernels._build_once("k", tmp_path)))
        second.start()
        second.join(timeout=0.3)
        assert second.is_alive(), "the second build did not wait for the first"
        built.append("first")  # the first build finishes and leaves its library
    second.join(timeout=10)
    assert result == [library] and built == ["first"]
