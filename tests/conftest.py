"""Tiny random targets built offline from configs, in float64 so argmax ties cannot flip."""

from pathlib import Path

import pytest
import torch

from dominospec import Drafter, DrafterConfig, Target


def tiny_target(
    family: str = "llama",
    vocab: int = 64,
    layers: int = 4,
    seed: int = 0,
    dtype=torch.float64,
    tied: bool = False,
    backend: str = "hf",
) -> Target:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        eos_token_id=vocab - 1,
        bos_token_id=0,
        pad_token_id=0,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=tied))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, tie_word_embeddings=tied))
    else:
        raise ValueError(family)
    # sharpen the random model so its greedy continuations are not near-uniform
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.to(dtype)
    return Target(model, tokenizer=None, name=f"tiny-{family}", backend=backend)


def tiny_drafter(
    target: Target,
    head: str = "domino",
    block_size: int = 4,
    seed: int = 1,
    confidence: bool = False,
    mask_token_id=None,
    randomize_head: bool = True,
    draft_vocab: int = 0,
) -> Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(
        target,
        head=head,
        block_size=block_size,
        num_layers=2,
        intermediate_size=48,
        gru_hidden_size=16,
        rank=8,
        confidence_head=confidence,
        mask_token_id=mask_token_id,
        draft_vocab_size=draft_vocab,
    )
    d = Drafter(cfg)
    if draft_vocab:  # a scattered subset, so index and id differ
        d.draft_vocab.copy_(torch.randperm(target.vocab_size)[:draft_vocab].sort().values)
    if randomize_head:  # an untrained head is the identity; make it change proposals
        for name, p in d.named_parameters():
            if name.startswith("head.") and name.endswith("w2.weight"):
                torch.nn.init.normal_(p, std=2.0)
    return d.attach(target)


@pytest.fixture(scope="session")
def llama_target():
    return tiny_target("llama")


@pytest.fixture(scope="session")
def qwen3_target():
    return tiny_target("qwen3")


def save_char_model(d: Path, context: int = 64, seed: int = 0) -> Path:
    """A tiny Llama behind a one-token-per-character tokenizer and a chat template, `context` positions.

    Its EOS row of the LM head is zero and the others are sharpened, so greedy answers never end on
    their own: they run until a limit cuts them.
    """
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    chars = string.ascii_letters + string.digits + " .,?!:;'-()<>/|\n"
    vocab = {c: i for i, c in enumerate(chars)}
    start, end = len(vocab), len(vocab) + 1
    vocab.update({"<|im_start|>": start, "<|im_end|>": end})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(vocab),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            max_position_embeddings=context,
            eos_token_id=end,
            bos_token_id=start,
            pad_token_id=end,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        model.lm_head.weight[end] = 0.0
    model.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    return d
