"""q4-dot (targets/cpu_kernels/format_q4_dot.h): a GGUF file's own 4-bit blocks in 4-bit panels, multiplied with
int8-dot's per-row int8 activations. The panels hold the file's weights exactly, the kernel computes its own
arithmetic to the last bit on every instruction path, a row's bits never depend on its batch, and speculative
decoding reproduces plain decoding of the format. The models here carry random blocks in memory; test_gguf.py
takes them from real files."""

import pytest
import torch
from conftest import QUANT_PROMPTS as PROMPTS
from conftest import SMOL_ATTENTION, assert_matches_target_distribution, llama_fp32, tiny_drafter

from dominospec import SamplingConfig, Target, generate_autoregressive, generate_speculative
from dominospec.decode import PromptLookup
from dominospec.engine import Engine, EngineRequest
from dominospec.targets.kernels import INT8_DOT_PATH, PackedLinear, load_kernels, pack_q4
from dominospec.targets.quant import Blocks, named_linear_layers

# (N, K): N ragged against the panel width, K whole blocks of 32
SHAPES = [(1, 32), (5, 64), (33, 96), (100, 160), (70, 384)]


@pytest.fixture(scope="module")
def kernels():
    module = load_kernels()
    if module is None or not module.int8_dot_paths():
        pytest.skip("no kernel with an integer dot product (AVX512-VNNI or AVX2) here")
    return module


def paths(module) -> list[str]:
    return list(module.int8_dot_paths())


@pytest.fixture(params=["avx512-vnni", "avx2"])
def path(request, kernels, monkeypatch):
    """Each instruction path this build has (AVX2 forced on an AVX-512 machine too)."""
    if request.param not in paths(kernels):
        pytest.skip(f"this CPU's build has no {request.param} path")
    monkeypatch.setenv(INT8_DOT_PATH, request.param)
    return request.param


def random_blocks(n: int, k: int, gen: torch.Generator, kind: str = "Q4_1") -> Blocks:
    """Blocks as a file holds them: q in 0..15, float16 scales (Q4_0: offset -8 * scale) or Q8_0's int8."""
    scale = (0.002 + 0.02 * torch.rand(n, k // 32, generator=gen)).half()
    if kind == "Q8_0":
        scale = (scale.float() / 8).half()
        q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
        return Blocks(8, q, scale, torch.zeros_like(scale))
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    centre = 7.5 if kind == "Q4_1" else 8.0  # Q4_1: a minimum near -7.5 steps, as for weights around 0
    offset = (-centre * scale.float() * (1 + 0.3 * (kind == "Q4_1") * torch.rand(n, k // 32, generator=gen))).half()
    return Blocks(4, q, scale, offset)


def q4_reference(x: torch.Tensor, blocks: Blocks, bias: torch.Tensor | None = None) -> torch.Tensor:
    """q4-dot's arithmetic in float64, each fp32 step rounded where the kernel rounds it: each row quantised in
    blocks of 32 (d = max|x| / 127, qx = round-half-even(x / d)), the integer dot exact, then per block
    total += float(dot) * (s * d), total += o * (d * sum(qx)) (4-bit blocks only), then the bias."""

    def f32(t):
        return t.float().double()

    n, k = blocks.q.shape
    total = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for g in range(k // 32):
        xb = x[:, 32 * g : 32 * (g + 1)]  # [M, 32]
        d = xb.abs().amax(1, keepdim=True) / 127.0  # fp32, as the kernel's
        qx = torch.where(d > 0, torch.round(xb / d), torch.zeros_like(xb)).clamp(-127, 127).double()
        dot = qx @ blocks.q[:, 32 * g : 32 * (g + 1)].double().T  # [M, N], exact
        d = d.double()
        total = f32(total + f32(dot * f32(blocks.scale[:, g].double() * d)))
        if blocks.bits == 4:  # Q8_0 has no offset step
            total = f32(total + f32(blocks.offset[:, g].double() * f32(d * qx.sum(1, keepdim=True))))
    return (total if bias is None else f32(total + bias.double())).float()


def unpack_q4(panels: torch.Tensor, so: torch.Tensor, n: int) -> torch.Tensor:
    """The weights q4-dot's panels hold, in fp32: s * q + o from the nibbles (Q8_0: bytes - 128) and float16 values
    (pack_q4's inverse)."""
    p, g, steps, nr, _ = panels.shape
    if steps == 8:  # Q8_0
        q = panels.to(torch.int16) - 128  # [P, G, 8, NR, 4]
        q = q.permute(0, 3, 1, 2, 4).reshape(p * nr, g * 32)[:n]
    else:
        q = torch.stack([panels & 0x0F, panels >> 4], dim=3)  # [P, G, 4, 2, NR, 4]
        q = q.permute(0, 4, 1, 2, 3, 5).reshape(p * nr, g * 32)[:n]  # [N, K]
    s, *o = (so[:, :, i].permute(0, 2, 1).reshape(p * nr, g)[:n].float() for i in range(so.shape[2]))
    return q.float() * s.repeat_interleave(32, 1) + (o[0].repeat_interleave(32, 1) if o else 0.0)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_panels_hold_the_files_weights_bit_for_bit(kind, kernels):
    """Protects: the 4-bit panels (two weights a byte, float16 scale and offset per block) are the file's blocks
    as they are: unpacked, they give the file's dequantised fp32 weights to the last bit (no requantisation)."""
    gen = torch.Generator().manual_seed(1)
    for n, k in SHAPES:
        blocks = random_blocks(n, k, gen, kind)
        lin = PackedLinear(kernels, blocks.dequantize(), None, "q4-dot", blocks)
        assert lin.format == ("q8_quads" if kind == "Q8_0" else "q4_octets")
        assert lin.panels.dtype == torch.uint8 and lin.scale.dtype == torch.float16
        assert torch.equal(unpack_q4(lin.panels, lin.scale, n), blocks.dequantize()), (kind, n, k)
        columns = lin.panels.shape[0] * kernels.panel_width()
        # 4 bits a weight and 2 float16 a block; Q8_0: 8 bits and 1 float16
        assert lin.nbytes == (
            columns * k + columns * k // 32 * 2 if kind == "Q8_0" else columns * k // 2 + columns * k // 32 * 4
        )
    panels, _ = pack_q4(random_blocks(40, 64, gen), kernels.panel_width())
    assert panels.shape[1:] == (2, 4, kernels.panel_width(), 4)


@pytest.mark.parametrize("bias", [False, True])
def test_kernel_equals_a_float64_reference_of_its_own_arithmetic_to_the_last_bit(bias, path, kernels):
    """Protects: on each instruction path, every row of every shape is q4-dot's fixed arithmetic to the last bit,
    whatever the number of rows in the call (1 for decode, 2-17 for verify, more for prefill)."""
    gen = torch.Generator().manual_seed(2)
    for n, k in SHAPES:
        blocks = random_blocks(n, k, gen, ("Q4_1", "Q4_0", "Q8_0")[n % 3])
        b = torch.randn(n, generator=gen) if bias else None
        lin = PackedLinear(kernels, blocks.dequantize(), b, "q4-dot", blocks)
        x = torch.randn(70, k, generator=gen)
        x[3, :32] = 0.0  # a block of zeros (d = 0)
        for m in (1, 2, 5, 9, 17, 70):
            assert torch.equal(lin(x[:m]), q4_reference(x[:m], blocks, b)), (path, n, k, m)
    assert not torch.equal(lin(x), q4_reference(x * 1.01, blocks, b))


def q4_model(seed: int = 0, **shape) -> tuple[torch.nn.Module, dict[str, Blocks]]:
    """A tiny tied Llama whose linear weights are random 4-bit blocks (Q4_1 and Q4_0 mixed) and whose LM head (the
    embedding) is Q8_0, as the bundled SmolLM2's file: the model's weights are the blocks' dequantised values."""
    model = llama_fp32(seed, **shape)
    gen = torch.Generator().manual_seed(seed)
    blocks = {}
    with torch.no_grad():
        for i, (name, linear) in enumerate(named_linear_layers(model)):
            n, k = linear.weight.shape
            kind = "Q8_0" if name == "lm_head.weight" else ("Q4_1", "Q4_0")[i % 2]
            blocks[name] = random_blocks(n, k, gen, kind)
            linear.weight.copy_(blocks[name].dequantize())
    return model, blocks


def q4_target(seed: int = 0, **shape) -> Target:
    model, blocks = q4_model(seed, **shape)
    return Target(model, name="tiny-q4", backend="native", weights="q4-dot", blocks=blocks)


def test_q4_dot_target_packs_its_blocks_and_keeps_its_weights(kernels):
    """Protects: --dtype q4-dot streams 4-bit panels for the 4-bit blocks (fused q/k/v and gate/up included) and the
    file's own int8 with its float16 scales for a Q8_0 LM head; the model's weights stay the file's values (an exact
    format), and the precision says q4-weights-dot (activations are rounded: a model of its own)."""
    model, blocks = q4_model(0)
    before = {name: linear.weight.clone() for name, linear in named_linear_layers(model)}
    t = Target(model, name="tiny-q4", backend="native", weights="q4-dot", blocks=blocks)
    assert t.exact_weights and t.precision == "q4-weights-dot" and t.rounds_activations
    assert all(torch.equal(linear.weight, before[name]) for name, linear in named_linear_layers(t.model))
    layer = t.native.blocks[0]
    assert {lin.kernel.format for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)} == {"q4_octets"}
    head = t.native.lm_head.kernel
    assert head.format == "q8_quads"
    scales = head.scale[:, :, 0].permute(0, 2, 1).reshape(-1, head.scale.shape[1])[:96]  # [N, G]
    assert torch.equal(scales, blocks["lm_head.weight"].scale)
    plain = Target(q4_model(0)[0], name="tiny-q4", backend="native", weights="int8-dot")
    ids = torch.tensor([PROMPTS[2]])
    a = t.forward(ids, t.new_cache(), with_features=False).logits
    ref = plain.forward(ids, plain.new_cache(), with_features=False).logits
    assert (a - ref).abs().max().item() < 0.05 * ref.abs().max().item()


def test_a_verified_token_has_its_decode_steps_bits(path, kernels):
    """Protects: in q4-dot a token verified among others gets the very logits of its own decode step."""
    native = q4_target(0, **SMOL_ATTENTION).native
    prompt, new = [(7 * i) % 90 + 1 for i in range(150)], [5, 9, 2, 7, 7, 11, 30, 31]
    together = native.new_cache(1, 256)
    native(torch.tensor([prompt]), together, logits="none")
    block, _ = native(torch.tensor([new]), together, logits="all")  # [1, 8, V]
    alone = native.new_cache(1, 256)
    native(torch.tensor([prompt]), alone, logits="none")
    for j, tok in enumerate(new):
        step, _ = native(torch.tensor([[tok]]), alone, logits="all")
        assert torch.equal(step[0, 0], block[0, j]), f"token {j} of the block"


def test_a_row_of_a_ragged_batch_has_its_own_bits(path, kernels):
    """Protects: rows at different lengths with different numbers of new tokens, batched in q4-dot, each get the
    bits they get alone."""
    native = q4_target(1, **SMOL_ATTENTION).native
    prompts = [[(5 * i + r) % 90 + 1 for i in range(40 + 37 * r)] for r in range(3)]
    new = [[3, 8, 1, 4, 4, 9], [12, 13], [40, 41, 42, 43]]
    batch = native.new_cache(3, 256)
    for r, prompt in enumerate(prompts):
        native(torch.tensor([prompt]), batch.row(r), logits="none")
        batch.set_length(r, len(prompt))
    padded = torch.tensor([toks + [0] * (6 - len(toks)) for toks in new])  # [3, 6]
    together, _ = native(padded, batch, num_new=[len(t) for t in new], logits="all")  # [3, 6, V]
    for r, prompt in enumerate(prompts):
        alone = native.new_cache(1, 256)
        native(torch.tensor([prompt]), alone, logits="none")
        own, _ = native(torch.tensor([new[r]]), alone, logits="all")
        assert torch.equal(own[0], together[r, : len(new[r])]), f"row {r}"


def test_greedy_speculative_equals_greedy_plain_in_q4_dot(kernels):
    """Protects: greedy speculative decoding (drafter at every block size, prompt lookup, both) through the
    batch-1 loop and the batched engine is token for token plain greedy decoding of q4-dot."""
    t = q4_target(0)
    drafter = tiny_drafter(t, head="domino", block_size=4).to(torch.float32)
    for prompt in PROMPTS:
        ref = generate_autoregressive(t, prompt, 32, eos_ids=[]).tokens
        for b in (1, 2, 4):
            spec = generate_speculative(t, drafter, prompt, 32, block_size=b, eos_ids=[])
            assert spec.tokens == ref and spec.cycles > 0, (prompt, b)
        assert generate_speculative(t, drafter, prompt, 32, eos_ids=[], lookup=PromptLookup()).tokens == ref
    for engine in (Engine(t, max_batch=3), Engine(t, drafter, lookup=True, policy="fixed", max_batch=3)):
        handles = [engine.submit(EngineRequest(p, 24, SamplingConfig(), seed=i)) for i, p in enumerate(PROMPTS)]
        engine.run_until_idle()
        for prompt, h in zip(PROMPTS, handles):
            assert h.wait(0).tokens == generate_autoregressive(t, prompt, 24, eos_ids=t.eos_ids).tokens


@pytest.mark.slow
def test_sampling_at_t1_keeps_q4_dots_distribution(kernels):
    """Protects: speculative sampling at T=1 in q4-dot commits 3-token continuations with exactly the probabilities
    of q4-dot's own model (chi-square against enumeration)."""
    model, blocks = q4_model(3, vocab_size=8, num_hidden_layers=2, eos_token_id=7)
    target = Target(model, name="tiny-q4-soft", backend="native", weights="q4-dot", blocks=blocks)
    assert target.native.blocks[0].qkv.kernel.format == "q4_octets"
    drafter = tiny_drafter(target, head="domino", block_size=3, seed=4).to(torch.float32)
    prompt = [1, 2, 3, 4]

    def run(seed):
        return generate_speculative(target, drafter, prompt, 3, SamplingConfig(1.0), seed=seed, eos_ids=[])

    seen = assert_matches_target_distribution(run, target, prompt, SamplingConfig(1.0))
    assert seen["accepted_any"] > 100
