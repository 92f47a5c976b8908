"""bf16 and int8 target weights (targets/quant.py, the small-row kernel's formats), and the dot-product formats
int8-dot / bfloat16-dot (activations rounded too): each format is its own model, computed to fp32 rounding (int8-dot:
to the last bit of a float64 reference of its own arithmetic), and speculative decoding is exact against plain
decoding of that model."""

import hashlib
import json

import pytest
import torch
import torch.nn.functional as F
import transformers
from conftest import (
    QUANT_PROMPTS as PROMPTS,
)
from conftest import (
    SMOL_ATTENTION,
    assert_matches_target_distribution,
    fused_vs_python,
    llama_fp32,
    serving,
    tiny_chat_target,
    tiny_drafter,
    tiny_target,
    write_prompts,
)

from dominospec import DominoError, SamplingConfig, Target, cli, generate_autoregressive, generate_speculative
from dominospec.data.dataset import load_dataset_dir, target_record
from dominospec.decode import PromptLookup
from dominospec.engine import Engine, EngineRequest
from dominospec.targets.features import FeatureCache
from dominospec.targets.kernels import BF16_DOT_SWITCH, INT8_DOT_PATH, PackedLinear, kernel_format, load_kernels
from dominospec.targets.quant import (
    INT8_GROUP,
    apply_weight_format_,
    dequantize_int8,
    format_values,
    quantize_int8,
    weight_only_format,
)
from dominospec.tune.profile import device_fingerprint

FORMATS = ["bfloat16", "int8"]
DOT = ["int8-dot", "bfloat16-dot"]  # the dot-product formats, where the CPU has their instructions
# (N, K): N ragged against the panel width, K odd, int8's groups of 32 ragged
SHAPES = [(1, 1), (5, 3), (33, 17), (100, 37), (70, 64), (40, 150)]


@pytest.fixture(scope="module")
def kernels():
    module = load_kernels()
    if module is None:
        pytest.skip("the small-row kernel does not build here (no compiler)")
    return module


def int8_dot_paths(module) -> list[str]:
    """int8-dot on each instruction path this build has: its best, and AVX2 forced where that is another."""
    paths = list(module.int8_dot_paths())
    return ["int8-dot"] * bool(paths) + ["int8-dot-avx2"] * ("avx2" in paths[1:])


def kernel_formats(module) -> list[str]:
    """Every panel layout this CPU runs: the portable formats, bf16 on the native dot product where it exists,
    int8-dot on each of its instruction paths."""
    bf16_dot = ["bfloat16-dot"] if module.has_bf16_dot() else []
    return ["float32", "bfloat16", "int8"] + bf16_dot + int8_dot_paths(module)


def needs(module, fmt: str) -> None:
    if fmt.startswith("bfloat16-dot") and not module.has_bf16_dot():
        pytest.skip("this CPU has no AVX512-BF16")
    if fmt.startswith("int8-dot") and fmt not in int8_dot_paths(module):
        pytest.skip(f"this CPU's build has no {fmt} path")


def force_path(fmt: str, monkeypatch) -> str:
    """The format's name for the target; int8-dot-avx2: int8-dot on AVX2's instructions (DOMINOSPEC_INT8_DOT_PATH)."""
    monkeypatch.setenv(BF16_DOT_SWITCH, "off")
    monkeypatch.setenv(INT8_DOT_PATH, "avx2" if fmt == "int8-dot-avx2" else "auto")
    return "int8-dot" if fmt == "int8-dot-avx2" else fmt


LAYOUTS = {"bfloat16-dot": "bfloat16_pairs", "int8-dot": "int8_quads", "int8-dot-avx2": "int8_quads"}


def packed(module, w, b, fmt, monkeypatch) -> PackedLinear:
    lin = PackedLinear(module, w, b, force_path(fmt, monkeypatch))
    assert lin.format == LAYOUTS.get(fmt, fmt)
    return lin


def int8_dot_reference(x, w, b, group: int = INT8_GROUP):
    """int8-dot's own arithmetic in float64, each fp32 step rounded where the kernel rounds it: every row quantised
    in blocks of `group` (d = max|x| / 127, qx = round-half-even(x / d)), the integer dot exact, then per group
    total += float(dot) * (s * d), total += o * (d * sum(qx)), then the bias (cpu_kernels/format_int8_dot.h)."""
    q, scale, offset = quantize_int8(w, group)  # [N, K], [N, G], [N, G]

    def f32(t):
        return t.float().double()

    total = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float64)
    for g in range(scale.shape[1]):
        xb = x[:, g * group : (g + 1) * group]  # [M, <= group] fp32
        d = xb.abs().amax(1, keepdim=True) / 127.0  # fp32 division, as the kernel's
        qx = torch.where(d > 0, torch.round(xb / d), torch.zeros_like(xb)).clamp(-127, 127).double()
        dot = qx @ q[:, g * group : (g + 1) * group].double().T  # [M, N], exact
        d = d.double()
        total = f32(total + f32(dot * f32(scale[:, g].double() * d)))
        total = f32(total + f32(offset[:, g].double() * f32(d * qx.sum(1, keepdim=True))))
    return (total if b is None else f32(total + b.double())).float()


def reference(x, w, b, fmt):
    """F.linear on the weights the format stores, widened / dequantised to fp32 (the bf16 dot product also
    rounds the activations to bf16); int8-dot: its own arithmetic (int8_dot_reference)."""
    if fmt.startswith("int8-dot"):
        return int8_dot_reference(x, w, b)
    if fmt == "bfloat16-dot":
        x, fmt = x.to(torch.bfloat16).float(), "bfloat16"
    return F.linear(x, w if fmt == "float32" else format_values(w, fmt), b)


@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_a_matmul_on_the_widened_weights_for_every_shape_class(bias, kernels, monkeypatch):
    """Protects: in every weight format, the kernel computes x @ W_fmt^T + b to fp32 rounding for 1..16
    rows, ragged N and odd K, and a wrong weight is caught by the same comparison."""
    g = torch.Generator().manual_seed(0)
    for fmt in kernel_formats(kernels):
        for n, k in SHAPES:
            w = torch.randn(n, k, generator=g) / k**0.5
            b = torch.randn(n, generator=g) if bias else None
            lin = packed(kernels, w, b, fmt, monkeypatch)
            x = torch.randn(16, k, generator=g)
            for m in range(1, 17):
                y = lin(x[:m])
                assert y.shape == (m, n)
                assert (y - reference(x[:m], w, b, fmt)).abs().max().item() <= 1e-5 * max(1.0, k**0.5), (fmt, n, k, m)
        control = w.clone()
        control[0, 0] += 1.0
        assert (packed(kernels, control, b, fmt, monkeypatch)(x) - reference(x, w, b, fmt)).abs().max() > 1e-2


@pytest.mark.parametrize("bias", [False, True])
def test_a_rows_output_does_not_depend_on_how_many_rows_share_the_call(bias, kernels, monkeypatch):
    """Protects: the property that makes speculative output identical to plain output, in every format:
    row r gives the same bits alone, in every prefix of 1..16 rows and among other rows (bitwise)."""
    g = torch.Generator().manual_seed(1)
    for fmt in kernel_formats(kernels):
        for n, k in SHAPES + [(960, 576)]:
            lin = packed(kernels, torch.randn(n, k, generator=g), torch.randn(n) if bias else None, fmt, monkeypatch)
            x = torch.randn(16, k, generator=g)
            batch = lin(x)
            for m in range(1, 17):
                assert torch.equal(lin(x[:m]), batch[:m]), (fmt, n, k, m)
            for r in (0, 5, 15):
                assert torch.equal(lin(x[r : r + 1]), batch[r : r + 1])
                shuffled = torch.cat([torch.randn(3, k, generator=g), x[r : r + 1], torch.randn(7, k, generator=g)])
                assert torch.equal(lin(shuffled)[3], batch[r])


def test_a_rows_output_does_not_depend_on_the_thread_count(kernels, monkeypatch):
    """Protects: how many adjacent panels a row group walks at once depends on the rows and the threads
    (AVX2 walks up to four for one row, fewer where threads would go short of work), never the order
    of an output element's sum: 1, 2 and 3 threads give the same bits in every format, including a
    ragged last block of panels."""
    g = torch.Generator().manual_seed(2)
    threads = torch.get_num_threads()
    try:
        for fmt in kernel_formats(kernels):
            for n, k in [(100, 37), (7 * kernels.panel_width() + 3, 64), (960, 576)]:
                lin = packed(kernels, torch.randn(n, k, generator=g), torch.randn(n, generator=g), fmt, monkeypatch)
                x = torch.randn(9, k, generator=g)
                outputs = {}
                for t in (1, 2, 3):
                    torch.set_num_threads(t)
                    outputs[t] = [lin(x[:m]) for m in (1, 2, 3, 9)]
                for t in (2, 3):
                    for a, b in zip(outputs[1], outputs[t]):
                        assert torch.equal(a, b), (fmt, n, k, t)
                assert torch.equal(outputs[1][0], outputs[1][3][:1])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("path", ["int8-dot", "int8-dot-avx2"])
def test_int8_dot_equals_a_float64_reference_of_its_own_arithmetic_to_the_last_bit(path, kernels, monkeypatch):
    """Protects: int8-dot (int8 weights x activations quantised per row in blocks of 32, integer sums, one fixed
    scaling order) is exactly the arithmetic it states, on VNNI and on AVX2's instructions alike: ragged N, K not
    a multiple of 4 or 32 (ragged last group and quad), zero blocks, symmetric and affine weight groups, 1..16
    rows (groups of up to 12: totals in registers, then in memory); a wrong weight or a path that rounds
    differently would not be equal."""
    needs(kernels, path)
    g = torch.Generator().manual_seed(3)
    for n, k in SHAPES + [(96, 576)]:
        w = torch.randn(n, k, generator=g) / k**0.5
        w[:, : min(k, 32)] = w[:, : min(k, 32)].abs()  # a first group on the affine grid
        b = torch.randn(n, generator=g)
        lin = packed(kernels, w, b, path, monkeypatch)
        x = torch.randn(16, k, generator=g) * 3
        x[1, : min(k, 40)] = 0.0  # a zero block: d = 0
        for m in (1, 2, 5, 9, 12, 16):
            assert torch.equal(lin(x[:m]), int8_dot_reference(x[:m], w, b)), (path, n, k, m)
    assert not torch.equal(lin(x), int8_dot_reference(x * 1.01, w, b))


def test_int8_dot_is_refused_clearly_on_a_cpu_without_dot_product_instructions(kernels):
    """Protects: a CPU with neither AVX512-VNNI nor AVX2 (a build whose int8-dot paths are empty) refuses int8-dot
    by name instead of running something else; the drafter's packer falls back to int8."""
    from dominospec.drafter.fast import Packer

    class NoDot:
        def int8_dot_paths(self):
            return []

    with pytest.raises(DominoError, match=r"int8-dot .*AVX512-VNNI or AVX2.*neither"):
        kernel_format(NoDot(), "int8-dot")
    assert Packer(NoDot(), "int8-dot").format == "int8"


def test_int8_groups_take_the_better_grid_and_hold_8_and_4_bit_blocks_exactly():
    """Protects: int8 per output channel and group of 32 inputs: every weight within half a step of its group's
    grid, a ragged last group and an all-zero group work, 8-bit symmetric blocks (Q8_0-like) and 4-bit affine
    blocks (Q4_1-like: what the bundled model's fp32 weights are) come back exactly, groups beat one scale per
    row, and quantising the dequantised weights gives the same codes (the model rounded in place and the
    kernel's packed copy are one model)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 150, generator=g) * torch.logspace(-4, 1, 40)[:, None]  # groups 32 x 4 + a ragged 22
    w[:, 64:96] *= 20.0  # one loud group: the quiet ones keep their own resolution
    w[7, :32] = 0.0
    d = torch.rand(40, 1, generator=g) * 0.01 + 1e-3
    w[:, 32:64] = d * torch.randint(-127, 128, (40, 32), generator=g).float()  # 8-bit symmetric blocks
    w[:, 32] = 127 * d[:, 0]
    w[:, 96:128] = 0.3 * d - d * torch.randint(0, 16, (40, 32), generator=g).float() / 7  # 4-bit affine
    w[:, 96], w[:, 97] = 0.3 * d[:, 0], 0.3 * d[:, 0] - 15 * d[:, 0] / 7
    q, scale, offset = quantize_int8(w, 32)
    assert q.dtype == torch.int8 and scale.shape == offset.shape == (40, 5)
    back = dequantize_int8(q, scale, offset, 32)
    for j in range(5):
        cols = slice(32 * j, min(150, 32 * j + 32))
        assert bool(((back - w)[:, cols].abs() <= scale[:, j : j + 1] / 2 * (1 + 1e-5) + 1e-12).all())
    assert int(q[7, :32].abs().max()) == 0 and float(scale[7, 0]) == 1.0 and float(offset[7, 0]) == 0.0
    assert torch.allclose(back[:, 32:64], w[:, 32:64], rtol=0, atol=1e-9) and bool((offset[:, 1] == 0).all())
    assert (back - w)[:, 96:128].abs().max() < 1e-6 * w[:, 96:128].abs().max()
    one_scale_per_row = dequantize_int8(*quantize_int8(w, 150), 150)  # the loud group sets every step
    assert (back - w)[:, :32].abs().max() < (one_scale_per_row - w)[:, :32].abs().max() / 5
    q2, scale2, offset2 = quantize_int8(back, 32)
    again = dequantize_int8(q2, scale2, offset2, 32)  # the same codes; values to fp32 rounding of their row
    assert torch.equal(q2, q) and bool(((again - back).abs() <= 1e-6 * back.abs().amax(1, keepdim=True)).all())
    assert torch.equal(format_values(format_values(w, "bfloat16"), "bfloat16"), format_values(w, "bfloat16"))


# ----- the weight format behind the Target -----


def quant_target(fmt: str | None, seed: int = 0) -> Target:
    return Target(llama_fp32(seed), name="tiny-smol", backend="native", weights=fmt)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_format_is_its_own_model_close_to_fp32(fmt, kernels):
    """Protects: --dtype bfloat16 / int8 change the weights (the kernel streams half / a quarter of the bytes),
    the whole model (the HF module and the native forward) computes with the format's values, and its logits
    stay close to fp32's. The source weights' fingerprint is kept; the precision label says the format."""
    ref, t = quant_target(None), quant_target(fmt)
    assert t.weight_format == fmt and t.precision == f"{fmt}-weights" and ref.precision == "float32"
    assert t.dtype == torch.float32 and t.fingerprint == ref.fingerprint
    assert t.native.lm_head.kernel.format == fmt
    # half / a quarter of the bytes, plus int8's fp32 scale and offset (8 bytes per 32 weights)
    assert t.native.weight_bytes * (2 if fmt == "bfloat16" else 3.1) <= ref.native.weight_bytes * 1.01
    head = t.model.get_output_embeddings().weight
    assert head is t.model.get_input_embeddings().weight  # tied: the embedding follows the LM head
    assert torch.equal(head, format_values(ref.model.get_output_embeddings().weight, fmt))
    ids = torch.tensor([PROMPTS[2]])
    native = t.forward(ids, t.new_cache(), with_features=False).logits
    hf = t.model(input_ids=ids).logits
    fp32 = ref.forward(ids, ref.new_cache(), with_features=False).logits
    assert (native - hf).abs().max().item() < 1e-4  # one model on both paths
    assert 1e-5 < (native - fp32).abs().max().item() < (0.1 if fmt == "bfloat16" else 0.3)  # another model, close


@pytest.mark.parametrize("fmt", FORMATS)
def test_without_the_kernel_the_format_is_the_same_model_on_library_paths(fmt, kernels, monkeypatch):
    """Protects: where the kernel cannot be built (DOMINOSPEC_KERNELS=off stands in for no compiler), a
    bf16 / int8 target still computes the format's model (fp32 library GEMMs on its values), so a data
    set or profile keyed by the format means the same model on either path."""
    from dominospec.targets import kernels as kernels_module

    ids = torch.tensor([PROMPTS[3]])
    with_kernel = quant_target(fmt)
    monkeypatch.setenv(kernels_module.ENV_SWITCH, "off")
    kernels_module.reset_kernels()
    try:
        library = quant_target(fmt)
        assert library.native.lm_head.kernel is None and library.precision == with_kernel.precision
        a = with_kernel.forward(ids, with_kernel.new_cache(), with_features=False).logits
        b = library.forward(ids, library.new_cache(), with_features=False).logits
        assert (a - b).abs().max().item() < 1e-4
    finally:
        kernels_module.reset_kernels()


@pytest.mark.parametrize("fmt", FORMATS + DOT)
def test_greedy_speculative_equals_greedy_plain_of_the_same_format(fmt, kernels):
    """Protects: with bf16 / int8 weights, greedy speculative decoding (drafter at every block size, prompt
    lookup, the hybrid) is token for token the plain greedy output of that format."""
    needs(kernels, fmt)
    t = quant_target(fmt)
    drafter = tiny_drafter(t, head="domino", block_size=4).to(torch.float32)
    for prompt in PROMPTS:
        ref = generate_autoregressive(t, prompt, 32, eos_ids=[]).tokens
        for b in (1, 2, 4):
            spec = generate_speculative(t, drafter, prompt, 32, block_size=b, eos_ids=[])
            assert spec.tokens == ref and spec.cycles > 0, (fmt, prompt, b)
        assert generate_speculative(t, None, prompt, 32, eos_ids=[], lookup=PromptLookup()).tokens == ref
        assert generate_speculative(t, drafter, prompt, 32, eos_ids=[], lookup=PromptLookup()).tokens == ref


@pytest.mark.parametrize("fmt", FORMATS + DOT)
def test_engine_gives_every_greedy_request_its_plain_output_in_the_format(fmt, kernels):
    """Protects: the batched engine (rows of different lengths sharing every kernel call) keeps each greedy
    request's output equal to plain decoding of the same format, plain and speculative."""
    needs(kernels, fmt)
    t = quant_target(fmt)
    drafter = tiny_drafter(t, head="domino", block_size=4).to(torch.float32)
    for engine in (Engine(t, max_batch=3), Engine(t, drafter, lookup=True, policy="fixed", max_batch=3)):
        handles = [engine.submit(EngineRequest(p, 24, SamplingConfig(), seed=i)) for i, p in enumerate(PROMPTS)]
        engine.run_until_idle()
        for prompt, h in zip(PROMPTS, handles):
            assert h.wait(0).tokens == generate_autoregressive(t, prompt, 24, eos_ids=t.eos_ids).tokens


@pytest.mark.parametrize("fmt", FORMATS)
def test_server_answers_greedy_chat_with_the_formats_plain_output(fmt, kernels):
    """Protects: the OpenAI-compatible server over a speculative engine (drafter + prompt lookup), with
    bf16 / int8 weights, answers a T=0 chat with the text plain decoding of that format writes."""
    import openai

    from dominospec.serve import ServeConfig

    chat = tiny_chat_target(backend="hf")
    t = Target(chat.model, chat.tokenizer, name="tiny-chat", backend="native", weights=fmt)
    drafter = tiny_drafter(t, head="domino", block_size=4).to(torch.float32)
    engine = Engine(t, drafter, lookup=True, policy="fixed", max_batch=2)
    with serving(engine, t, ServeConfig(model_name=t.name)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        for text in ("Tell me about the sea.", "abcabcabc"):
            messages = [{"role": "user", "content": text}]
            plain = generate_autoregressive(t, t.encode_chat(messages), 24, eos_ids=t.eos_ids).tokens
            r = client.chat.completions.create(model=t.name, messages=messages, max_tokens=24, temperature=0)
            assert r.choices[0].message.content == t.decode(plain)
        assert engine.stats()["requests_finished"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS + ["int8-dot"])
def test_sampling_at_t1_keeps_the_formats_distribution(fmt, kernels):
    """Protects: speculative sampling at T=1 commits 3-token continuations with exactly the probabilities of
    the format's own model (chi-square against enumeration through the rounded HF module)."""
    needs(kernels, fmt)
    model = tiny_target("qwen3", vocab=8, layers=2, seed=3, dtype=torch.float32).model
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.7)
    target = Target(model, name="tiny-soft", backend="native", weights=fmt)
    assert target.native.lm_head.kernel.format == LAYOUTS.get(fmt, fmt)
    drafter = tiny_drafter(target, head="domino", block_size=3, seed=4).to(torch.float32)
    prompt = [1, 2, 3, 4]

    def run(seed):
        return generate_speculative(target, drafter, prompt, 3, SamplingConfig(1.0), seed=seed, eos_ids=[])

    seen = assert_matches_target_distribution(run, target, prompt, SamplingConfig(1.0))
    assert seen["accepted_any"] > 100


def test_bf16_dot_product_switch_is_its_own_precision_and_stays_exact(kernels, monkeypatch):
    """Protects: DOMINOSPEC_BF16_DOT=on runs bf16 weights on AVX512-BF16's dot product where the CPU has it
    (activations rounded to bf16: another precision, recorded as such) and keeps speculative == plain."""
    if not kernels.has_bf16_dot():
        pytest.skip("this CPU has no AVX512-BF16")
    monkeypatch.setenv(BF16_DOT_SWITCH, "on")
    t = quant_target("bfloat16")
    assert t.native.bf16_dot and t.precision == "bfloat16-weights-dot"
    drafter = tiny_drafter(t, head="domino", block_size=4).to(torch.float32)
    for prompt in PROMPTS[:2]:
        ref = generate_autoregressive(t, prompt, 24, eos_ids=[]).tokens
        assert generate_speculative(t, drafter, prompt, 24, block_size=4, eos_ids=[]).tokens == ref


def weights_of(fmt: str, monkeypatch) -> str | None:
    """The target's --dtype for a test format (float32: None); int8-dot-avx2 forces AVX2's instructions."""
    return {"float32": None}.get(fmt, force_path(fmt, monkeypatch))


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8", "bfloat16-dot", "int8-dot", "int8-dot-avx2"])
def test_a_verified_token_has_its_decode_steps_bits(fmt, kernels, monkeypatch):
    """Protects: in every weight format a token verified among others gets the very logits its own decode step
    gives: decode- and verify-sized forwards run attention one query at a time in the kernel (SDPA's masked
    multi-query and one-query paths sum in different orders, ~1e-6 apart, which bf16-rounded activations
    turned into flipped greedy answers on the bundled model: 3-6 of 16). Greedy speculative = plain holds by
    construction, not only by measurement."""
    needs(kernels, fmt)
    # SmolLM2's attention shape (head_dim 64, 3 q heads per kv head) and a long context: where the SDPA paths
    # part (on the tiny shapes above they happen to agree)
    weights = weights_of(fmt, monkeypatch)
    native = Target(llama_fp32(0, **SMOL_ATTENTION), name="tiny-smol", backend="native", weights=weights).native
    prompt, new = [(7 * i) % 90 + 1 for i in range(150)], [5, 9, 2, 7, 7, 11, 30, 31]
    together = native.new_cache(1, 256)
    native(torch.tensor([prompt]), together, logits="none")
    block, _ = native(torch.tensor([new]), together, logits="all")  # [1, 8, V]
    alone = native.new_cache(1, 256)
    native(torch.tensor([prompt]), alone, logits="none")
    for j, tok in enumerate(new):
        step, _ = native(torch.tensor([[tok]]), alone, logits="all")
        assert torch.equal(step[0, 0], block[0, j]), f"token {j} of the block"


@pytest.mark.parametrize("fmt", ["float32", "int8", "int8-dot", "int8-dot-avx2"])
def test_a_row_of_a_ragged_batch_has_its_own_bits(fmt, kernels, monkeypatch):
    """Protects: the engine's ragged batches (rows at different lengths, each with its own number of new tokens)
    give every row the bits it gets alone: a request's tokens do not depend on the requests it is batched with."""
    needs(kernels, fmt)
    weights = weights_of(fmt, monkeypatch)
    native = Target(llama_fp32(1, **SMOL_ATTENTION), name="tiny-smol", backend="native", weights=weights).native
    prompts = [[(5 * i + r) % 90 + 1 for i in range(40 + 37 * r)] for r in range(3)]  # 40, 77, 114 tokens
    new = [[3, 8, 1, 4, 4, 9], [12, 13], [40, 41, 42, 43]]
    batch = native.new_cache(3, 256)
    for r, prompt in enumerate(prompts):  # prefill each row alone, as the engine does
        native(torch.tensor([prompt]), batch.row(r), logits="none")
        batch.set_length(r, len(prompt))
    padded = torch.tensor([toks + [0] * (6 - len(toks)) for toks in new])  # [3, 6]
    together, _ = native(padded, batch, num_new=[len(t) for t in new], logits="all")  # [3, 6, V]
    for r, prompt in enumerate(prompts):
        alone = native.new_cache(1, 256)
        native(torch.tensor([prompt]), alone, logits="none")
        own, _ = native(torch.tensor([new[r]]), alone, logits="all")  # [1, n, V]
        assert torch.equal(own[0], together[r, : len(new[r])]), f"row {r}"


@pytest.mark.parametrize("fmt", ["float32", "int8", "int8-dot"])
def test_a_prompt_prefilled_in_chunks_has_the_bits_of_one_prefill(fmt, kernels, monkeypatch):
    """Protects: a prompt prefilled whole, or in chunks of any sizes (the engine's chunked prefill, whose chunks
    depend on the load), leaves the same logits and cache: prefill attends one query at a time in the kernel as
    decode does. Before, chunks of more than 16 tokens went through SDPA, whose sums depend on the chunk's shape:
    int8-dot's activation rounding turned that into an engine request at concurrency 8 written differently."""
    needs(kernels, fmt)
    weights = weights_of(fmt, monkeypatch)
    native = Target(llama_fp32(0, **SMOL_ATTENTION), name="tiny-smol", backend="native", weights=weights).native
    prompt = [(7 * i) % 90 + 1 for i in range(120)]

    def prefill(sizes):
        cache, start, out = native.new_cache(1, 256), 0, None
        for size in sizes:
            out, _ = native(torch.tensor([prompt[start : start + size]]), cache, logits="last")
            start += size
        return out, cache

    whole, cache = prefill([120])
    for sizes in ([100, 20], [60, 60], [16, 104], [119, 1], [40, 40, 40]):
        out, chunked = prefill(sizes)
        assert torch.equal(out, whole), sizes
        assert torch.equal(chunked.k[:, :, :, :120], cache.k[:, :, :, :120]), sizes


def test_the_attention_kernel_is_attention(kernels):
    """Protects: the per-query kernel computes causal grouped-query attention over each row's cache prefix
    (SDPA as the reference, to fp32 tolerance), rows at different starts."""
    torch.manual_seed(0)
    B, S, Hq, Hkv, D, L = 3, 5, 6, 2, 64, 40
    q = torch.randn(B, S, Hq, D)
    k, v = torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    starts = torch.tensor([0, 7, 30])
    out = kernels.attend(q, k, v, starts, 0.125)  # [B, S, Hq, D]
    for b in range(B):
        for j in range(S):
            T = int(starts[b]) + j + 1
            keys, vals = (c[b, :, :T].repeat_interleave(Hq // Hkv, 0) for c in (k, v))  # [Hq, T, D]
            ref = F.scaled_dot_product_attention(q[b, j][:, None], keys, vals, scale=0.125)  # [Hq, 1, D]
            torch.testing.assert_close(out[b, j], ref[:, 0], rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="reads past the cache"):
        kernels.attend(q, k, v, torch.tensor([0, 7, 36]), 0.125)


# ----- the format is part of the target's identity -----


def test_the_format_keys_profiles_feature_caches_and_data_records(tmp_path, kernels):
    """Protects: a device profile, a feature cache file and a data set's target record made with one weight
    format are never read for another; fp32's keys stay what they were before formats existed."""
    has = {"int8-dot": bool(kernels.int8_dot_paths()), "bfloat16-dot": kernels.has_bf16_dot()}
    dot = [fmt for fmt in DOT if has[fmt]]
    targets = {fmt: quant_target(fmt) for fmt in (None, *FORMATS, *dot)}
    labels = {"float32", "bfloat16-weights", "int8-weights"} | {f"{f.split('-')[0]}-weights-dot" for f in dot}
    profiles = {device_fingerprint(t)["dtype"] for t in targets.values()}
    assert profiles == labels
    paths = {FeatureCache(tmp_path, t).path([0, 1], [1, 2, 3]) for t in targets.values()}
    assert len(paths) == len(labels)
    fp32 = targets[None]
    legacy = [fp32.fingerprint, str(fp32.dtype)]  # the key before weight formats: fp32 caches stay valid
    key = hashlib.sha256(json.dumps([legacy, [0, 1], [1, 2, 3]]).encode()).hexdigest()[:32]
    assert FeatureCache(tmp_path, fp32).path([0, 1], [1, 2, 3]).name == f"{key}.safetensors"
    assert {target_record(t)["target_precision"] for t in targets.values()} == labels


def model_holding(fmt: str | None, seed: int = 0):
    """A tiny fp32 Llama whose linear weights already are `fmt`'s values (a dequantised checkpoint), or random."""
    model = llama_fp32(seed)
    if fmt is not None:
        with torch.no_grad():
            apply_weight_format_(model, fmt)
    return model


@pytest.mark.parametrize("held", [None, "int8", "bfloat16"])
def test_dtype_auto_runs_the_fewest_bytes_format_that_holds_the_weights(held, tmp_path, kernels):
    """Protects: --dtype auto on the CPU picks int8 for weights on int8's grid (the bundled model, a dequantised
    4-bit GGUF), bfloat16 for bf16 values, fp32 otherwise; a format that holds the weights is the same model, so
    its data, feature caches and drafters are the fp32 target's (precision "float32"), while its device profile
    is its own (run_precision); explicit --dtype int8 on such weights is the same model too."""
    assert weight_only_format("auto", "cpu", "auto") == "auto" and weight_only_format("auto", "cpu", "hf") is None
    auto = Target(model_holding(held), name="tiny-smol", backend="native", weights="auto")
    fp32 = Target(model_holding(held), name="tiny-smol", backend="native")
    assert auto.weight_only == held and auto.exact_weights == (held is not None)
    assert auto.precision == "float32" and target_record(auto) == target_record(fp32)
    assert FeatureCache(tmp_path, auto).path([0, 1], [1, 2, 3]) == FeatureCache(tmp_path, fp32).path([0, 1], [1, 2, 3])
    assert device_fingerprint(auto)["dtype"] == (f"{held}-weights" if held else "float32")
    ids = torch.tensor([PROMPTS[2]])
    logits = [t.forward(ids, t.new_cache(), with_features=False).logits for t in (auto, fp32)]
    assert (logits[0] - logits[1]).abs().max().item() < 1e-4  # the same model (sums in another order)
    if held == "int8":
        explicit = Target(model_holding(held), name="tiny-smol", backend="native", weights="int8")
        assert explicit.exact_weights and explicit.precision == "float32" and explicit.run_precision == "int8-weights"


def test_data_made_with_another_weight_format_is_refused_by_name(char_model, tmp_path, capsys, kernels):
    """Protects: a drafter's data records the precision of the target that wrote it (prepare-data --dtype
    int8), and training on it with a target of another format is refused with a message naming both,
    unless --allow-other-target; the same format is accepted."""
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi", "ok"])
    out = tmp_path / "int8-data"
    argv = ["prepare-data", "--target", str(char_model), "--prompts", str(prompts), "--out", str(out)]
    argv += ["--max-new-tokens", "8", "--temperature", "0", "--dtype", "int8", "--device", "cpu"]
    assert cli.main(argv) == 0
    int8 = Target.load(str(char_model), device="cpu", dtype="int8")
    fp32 = Target.load(str(char_model), device="cpu")
    assert int8.precision == "int8-weights" and int8.backend == "native"
    assert load_dataset_dir(out, int8)[1]
    with pytest.raises(DominoError, match=r"computing in int8-weights, but this run's target computes in float32"):
        load_dataset_dir(out, fp32)
    assert load_dataset_dir(out, fp32, allow_other_target=True)[1]


def test_int8_is_refused_where_there_is_no_kernel_path_to_run_it(char_model):
    """Protects: int8 exists only on the native backend's kernel: --backend hf and families outside the
    native set are refused with a sentence that names the reason, before or without loading weights."""
    with pytest.raises(DominoError, match=r"--dtype int8 .*--backend hf"):
        Target.load(str(char_model), device="cpu", dtype="int8", backend="hf")
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=63)
    )
    with pytest.raises(DominoError, match=r"--dtype int8 needs the native backend.*gpt2"):
        Target(gpt2, name="tiny-gpt2", backend="auto", weights="int8")
    hf_bf16 = Target.load(str(char_model), device="cpu", dtype="bfloat16", backend="hf")
    assert hf_bf16.dtype == torch.bfloat16 and hf_bf16.precision == "bfloat16"  # transformers' own bf16
    native_bf16 = Target(llama_fp32().to(torch.bfloat16), backend="native")  # a bf16 model, as on a GPU
    assert native_bf16.native is not None and native_bf16.precision == "bfloat16"


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "bfloat16-dot", "int8-dot"])
def test_the_fused_layers_compute_the_python_layers_in_every_format(fmt, kernels, monkeypatch):
    """Protects: the one-call decoder layers (DecoderLayers) read each format's panels and int8 scales as the
    Python loop does: same logits to fp32 rounding and the same greedy picks, ragged rows."""
    from dominospec.targets.native import FUSED_SWITCH

    needs(kernels, fmt)
    weights = weights_of(fmt, monkeypatch)
    native = Target(llama_fp32(2, **SMOL_ATTENTION), name="tiny-smol", backend="native", weights=weights).native
    prompts = [[(3 * i + r) % 90 + 1 for i in range(20 + 13 * r)] for r in range(2)]
    new = [[4, 5, 6], [70, 71, 72, 73, 74]]
    out = fused_vs_python(native, monkeypatch, FUSED_SWITCH, prompts, new)
    (fused, _), (loop, _) = out["on"], out["off"]
    for r, toks in enumerate(new):
        torch.testing.assert_close(fused[r, : len(toks)], loop[r, : len(toks)], rtol=1e-4, atol=1e-4)
        assert torch.equal(fused[r, : len(toks)].argmax(-1), loop[r, : len(toks)].argmax(-1))
