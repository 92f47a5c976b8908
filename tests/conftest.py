"""Tiny random targets built offline from configs, in float64 so argmax ties cannot flip."""

import time

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


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer():
    """A real fast tokenizer built offline: one token per printable ASCII character, ChatML specials.

    100 ids: <s> (0, BOS and pad), <unk> (1), <|im_start|> (2), newline (3), the 95 printable
    characters (4-98), <|im_end|> (99, EOS: tiny_target's eos_token_id is vocab - 1).
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<s>": 0, "<unk>": 1, "<|im_start|>": 2, "\n": 3}
    vocab.update({chr(c): 4 + i for i, c in enumerate(range(32, 127))})
    vocab["<|im_end|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: characters
    tok.decoder = decoders.Fuse()  # join the pieces without spaces
    tok.add_special_tokens(["<s>", "<unk>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        pad_token="<s>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_chat_target(dtype=torch.float32, backend: str = "native", **kw) -> Target:
    """tiny_target with tiny_tokenizer attached: text in, text out (servers, chat templates)."""
    tok = tiny_tokenizer()
    target = tiny_target(vocab=len(tok), dtype=dtype, backend=backend, **kw)
    target.tokenizer = tok
    target.name = "tiny-chat"
    return target


def paced_engine(target: Target, pause: float, **engine_kw):
    """The batched engine with a pause before every step: a long request then holds its slot long
    enough for a test to act while it runs (a tiny target otherwise finishes in milliseconds)."""
    from dominospec.engine import Engine

    class PacedEngine(Engine):
        def step(self) -> bool:
            time.sleep(pause)
            return super().step()

    return PacedEngine(target, **engine_kw)


@pytest.fixture(scope="session")
def llama_target():
    return tiny_target("llama")


@pytest.fixture(scope="session")
def qwen3_target():
    return tiny_target("qwen3")


# ----- distribution checks shared by the sampling tests -----


def exact_target_distribution(target, prompt, steps, sampling) -> dict:
    """P(x_1..x_steps) by enumeration over the whole (tiny) vocabulary, from the HF forward."""
    import itertools

    from dominospec.sampling import warp_probs

    v = target.vocab_size
    seqs = torch.tensor(list(itertools.product(range(v), repeat=steps)))  # [V^steps, steps]
    ids = torch.cat([torch.tensor(prompt).expand(seqs.shape[0], -1), seqs], dim=1)
    with torch.no_grad():
        logits = target.model(input_ids=ids).logits[:, len(prompt) - 1 : -1]  # [N, steps, V]
    probs = warp_probs(logits, sampling)
    p = probs.gather(-1, seqs.unsqueeze(-1)).squeeze(-1).prod(-1)
    return {tuple(s): float(q) for s, q in zip(seqs.tolist(), p)}


def assert_matches_distribution(samples: list, exact: dict, min_bins: int = 15) -> None:
    """Chi-square goodness of fit of sampled continuations against their exact probabilities.

    Bins with at least 5 expected samples, the rest pooled; an impossible continuation fails at once.
    """
    from scipy.stats import chisquare

    n = len(samples)
    counts = {}
    for s in samples:
        counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    keys = sorted(exact, key=exact.get, reverse=True)
    big = [k for k in keys if exact[k] * n >= 5]
    obs = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    exp = [exact[k] * n for k in big] + [n - sum(exact[k] * n for k in big)]
    assert len(big) >= min_bins
    assert sum(c for k, c in counts.items() if exact.get(k, 0) == 0) == 0
    stat = chisquare(obs, exp)
    assert stat.pvalue > 1e-3, stat
