"""Tiny random targets built offline from configs, in float64 so argmax ties cannot flip."""

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


@pytest.fixture(params=["kernels-on", "kernels-off"])
def linear_path(request, monkeypatch):
    """Runs a test once with the small-M kernel (where it builds) and once on the library GEMMs."""
    from dominospec.target import kernels

    monkeypatch.setenv(kernels.ENV_SWITCH, "on" if request.param == "kernels-on" else "off")
    kernels.reset_kernels()
    if request.param == "kernels-on" and kernels.load_kernels() is None:
        pytest.skip("the small-M kernel does not build here (no compiler)")
    yield request.param
    kernels.reset_kernels()
