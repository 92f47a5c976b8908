"""A target directory loaded without transformers (targets/checkpoint.py, targets/tokenizer.py): the same model,
the same tokenizer, the same tokens, and no transformers model or tokenizer built on a warm load."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import TINY_SHAPE
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from dominospec.decode import generate_autoregressive
from dominospec.targets import checkpoint, kernels, load, panel_cache
from dominospec.targets.checkpoint import Checkpoint
from dominospec.targets.hf import Target
from dominospec.targets.tokenizer import SavedTokenizer, load_tokenizer, vocab_fingerprint

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),  # q/k norms
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
}
SHAPE = dict(
    vocab_size=64,
    **TINY_SHAPE,
    max_position_embeddings=128,
    eos_token_id=63,
    bos_token_id=0,
    pad_token_id=0,
)
TEXTS = [
    "Hello, world!",
    "  two  spaces\tand a tab\n",
    "<|im_start|>user\nhi<|im_end|>",
    "caf\u00e9 \U0001f600 \u4e2d",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]
TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}<|im_start|>system\nDefault.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {c: i + 1 for i, c in enumerate(chars[:58])}  # ids 1..58; the rest is unknown
    vocab["<unk>"] = 0
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<unk>",
        chat_template=TEMPLATE,
    )


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A cache of this test's own (the built kernels shared)."""
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(kernels.kernel_dir().parent, target_is_directory=True)
    monkeypatch.setenv("DOMINOSPEC_CACHE", str(cache))
    return cache


def save_tiny(path, family="llama", tied=True, seed=0):
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**SHAPE, **extra, tie_word_embeddings=tied))
    with torch.no_grad():
        for name, p in model.named_parameters():  # spread, so greedy continuations vary
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def forbid_transformers_loads(monkeypatch):
    """Building any transformers model, or loading a transformers tokenizer, fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("a warm load built a transformers model or tokenizer")

    monkeypatch.setattr(transformers.PreTrainedModel, "__init__", refuse)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)


def through_transformers(path, monkeypatch, **kw) -> Target:
    """The same directory loaded as before checkpoint.py: transformers' model and tokenizer."""
    with monkeypatch.context() as m:
        m.setattr(load, "checkpoint_support", lambda directory: "off for the reference")
        m.setattr(panel_cache, "model_files", lambda model: None)  # packed here, not read from the cache
        target = Target.load(str(path), device="cpu", **kw)
    assert not isinstance(target.module, Checkpoint)
    return target


def tokens(target, prompt, n=24):
    return generate_autoregressive(target, prompt, n).tokens


@pytest.mark.parametrize("dtype", ["auto", "float32", "int8"])
def test_a_warm_load_builds_no_transformers_model_and_gives_the_same_tokens(tmp_path, cache, monkeypatch, dtype):
    path = save_tiny(tmp_path / "tiny")
    reference = through_transformers(path, monkeypatch, dtype=dtype)
    prompt = reference.encode_chat("What is 2+2?")
    want = tokens(reference, prompt)
    first = Target.load(str(path), device="cpu", dtype=dtype)  # packs, and saves the panels and tokenizer state
    assert isinstance(first.module, Checkpoint) and not first.packed_from_cache
    assert tokens(first, prompt) == want
    assert first.fingerprint == reference.fingerprint  # computed from the file, then saved for the warm load
    forbid_transformers_loads(monkeypatch)
    warm = Target.load(str(path), device="cpu", dtype=dtype)
    assert isinstance(warm.module, Checkpoint) and isinstance(warm.tokenizer, SavedTokenizer)
    assert warm.backend == "native" and (warm.packed_from_cache or kernels.load_kernels() is None)
    assert warm.encode_chat("What is 2+2?") == prompt
    assert tokens(warm, prompt) == want
    same = ("fingerprint", "tokenizer_fingerprint", "eos_ids", "pad_id", "max_positions", "arch", "precision")
    for name in same:
        assert getattr(warm, name) == getattr(reference, name), name
    assert (warm.weight_only, warm.exact_weights, warm.vocab_size) == (
        reference.weight_only,
        reference.exact_weights,
        reference.vocab_size,
    )
    assert torch.equal(warm.embed_weight, reference.embed_weight)  # a format's values, as the drafter borrows them


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("tied", [True, False])
def test_a_checkpoint_is_the_model_transformers_loads(tmp_path, cache, family, tied):
    path = save_tiny(tmp_path / family, family, tied)
    assert checkpoint.checkpoint_support(path) is None
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    ours = Checkpoint.load(path)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in hf.named_parameters()]
    for (name, a), b in zip(ours.named_parameters(), hf.parameters()):
        assert torch.equal(a, b), name
    assert torch.equal(ours.model.rotary_emb.inv_freq, hf.model.rotary_emb.inv_freq)
    assert ours.model.layers[0].self_attn.scaling == hf.model.layers[0].self_attn.scaling
    a = Target(ours, name="t", backend="native", weights="float32")
    b = Target(hf, name="t", backend="native", weights="float32")
    assert (a.fingerprint, a.arch, a.eos_ids, a.max_positions) == (b.fingerprint, b.arch, b.eos_ids, b.max_positions)
    prompt = [1, 5, 9, 3, 7, 2]
    assert tokens(a, prompt) == tokens(b, prompt)
    # transformers' own forward on the checkpoint's tensors (Target.model): the hf path and baselines
    ids = torch.tensor([prompt])
    assert torch.equal(a.model(input_ids=ids).logits, hf(input_ids=ids).logits)


def test_what_a_checkpoint_cannot_read_loads_through_transformers(tmp_path):
    path = save_tiny(tmp_path / "m", "mistral")
    config = (path / "config.json").read_text().replace('"sliding_window": null', '"sliding_window": 32')
    (path / "config.json").write_text(config)
    assert "sliding" in checkpoint.checkpoint_support(path)
    target = Target.load(str(path), device="cpu", backend="auto")
    assert not isinstance(target.module, Checkpoint)


def test_the_hf_backend_of_a_checkpoint_is_transformers_model(tmp_path, cache):
    path = save_tiny(tmp_path / "tiny")
    target = Target.load(str(path), device="cpu", backend="hf")
    assert target.backend == "hf" and not isinstance(target.module, Checkpoint)


def test_a_saved_tokenizer_encodes_decodes_and_templates_as_transformers(tmp_path, cache, monkeypatch):
    path = save_tiny(tmp_path / "tiny")
    first = load_tokenizer(path)
    assert not isinstance(first, SavedTokenizer)  # the first load is transformers', its state saved
    forbid_transformers_loads(monkeypatch)
    saved = load_tokenizer(path)
    assert isinstance(saved, SavedTokenizer)
    for text in TEXTS:
        for special in (True, False):
            assert (
                saved(text, add_special_tokens=special)["input_ids"]
                == first(text, add_special_tokens=special)["input_ids"]
            )
        ids = first(text)["input_ids"]
        for skip in (True, False):
            assert saved.decode(ids, skip_special_tokens=skip) == first.decode(ids, skip_special_tokens=skip)
    for chat in CHATS:
        for prompt in (True, False):
            for extra in ({}, {"enable_thinking": False}, {"enable_thinking": True}):
                kw = dict(tokenize=False, add_generation_prompt=prompt, **extra)
                assert saved.apply_chat_template(chat, **kw) == first.apply_chat_template(chat, **kw)
    assert saved.get_vocab() == first.get_vocab() and len(saved) == len(first)
    assert vocab_fingerprint(saved) == vocab_fingerprint(first)
    for name in ("eos_token_id", "pad_token_id", "bos_token_id", "chat_template"):
        assert getattr(saved, name) == getattr(first, name), name


def test_a_saved_tokenizer_answers_other_calls_through_transformers(tmp_path, cache):
    path = save_tiny(tmp_path / "tiny")
    first = load_tokenizer(path)
    saved = load_tokenizer(path)
    assert saved.convert_ids_to_tokens(5) == first.convert_ids_to_tokens(5)  # not its own: transformers answers
    chat = [{"role": "user", "content": "x", "name": "someone"}]  # a field it does not render itself
    assert saved.apply_chat_template(chat, tokenize=False) == first.apply_chat_template(chat, tokenize=False)


def test_a_changed_tokenizer_file_is_not_read_from_the_saved_state(tmp_path, cache):
    path = save_tiny(tmp_path / "tiny")
    load_tokenizer(path)
    tok = _tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.save_pretrained(path)
    again = load_tokenizer(path)
    assert not isinstance(again, SavedTokenizer)
    assert again.apply_chat_template(CHATS[0], tokenize=False) == "What is 2+2?"


@pytest.mark.slow
def test_the_bundled_tokenizer_saved_state_is_transformers_tokenizer():
    from dominospec.targets.load import bundled_model_dir

    path = bundled_model_dir("smollm2-135m")
    first = load_tokenizer(path)
    saved = load_tokenizer(path)
    assert isinstance(saved, SavedTokenizer)
    for text in TEXTS + ["def f(x):\n    return x[::-1]  # reversed", "17 * 23 = 391"]:
        assert saved(text)["input_ids"] == first(text)["input_ids"]
        ids = first(text)["input_ids"]
        assert saved.decode(ids, skip_special_tokens=True) == first.decode(ids, skip_special_tokens=True)
    for chat in CHATS:
        kw = dict(tokenize=False, add_generation_prompt=True, enable_thinking=False)
        assert saved.apply_chat_template(chat, **kw) == first.apply_chat_template(chat, **kw)
    assert vocab_fingerprint(saved) == vocab_fingerprint(first)
