"""Prompt lookup: what it copies, and that copying (alone or in a hybrid) keeps the output exact."""

import pytest
import torch
from conftest import (
    PROMPTS,
    SAMPLING,
    assert_matches_target_distribution,
    confident_drafter,
    soft_target,
    tiny_drafter,
)

from dominospec import DominoError, SamplingConfig, generate_autoregressive, generate_speculative
from dominospec.decode import CostTable, PromptLookup
from dominospec.decode.schedule import CostPolicy


def test_lookup_copies_after_the_longest_most_recent_suffix_match():
    lk = PromptLookup(max_ngram=3)
    lk.start([7, 1, 2, 9, 9, 5, 1, 2, 3, 4, 1, 2])
    # suffix (1, 2): the latest earlier occurrence is at 6..7, followed by 3, 4, 1, 2
    assert lk.match() == (8, 2)
    drafts = lk.propose(3, vocab_size=10, sampling=SamplingConfig())[0].drafts
    assert drafts.tolist() == [3, 4, 1]
    lk.extend([3])  # suffix (1, 2, 3) occurred once before, followed by 4
    assert lk.match() == (9, 3)
    lk.extend([8])  # 8 never occurred: no match
    assert lk.match() == (-1, 0) and lk.propose(4, 10, SamplingConfig()) == (None, 0)
    # a continuation stops at the end of the history
    lk.start([4, 5, 4])
    assert lk.propose(8, 10, SamplingConfig())[0].drafts.tolist() == [5, 4]


def test_lookup_drafts_are_one_hot_when_sampling_and_confidence_follows_their_record():
    lk = PromptLookup()
    lk.start([1, 2, 3, 1, 2])
    prop, n = lk.propose(3, vocab_size=6, sampling=SamplingConfig(0.8))
    assert n == 2 and prop.source == "lookup" and prop.drafts.tolist() == [3, 1, 2]
    assert prop.draft_probs.shape == (3, 6) and torch.equal(prop.draft_probs.argmax(-1), prop.drafts)
    assert torch.equal(prop.draft_probs.sum(-1), torch.ones(3))
    assert torch.allclose(torch.sigmoid(prop.confidence_logits), torch.full((3,), 0.5, dtype=torch.float64))
    for _ in range(8):
        lk.record(verified=3, accepted=1)  # slot 1 always right, slot 2 always wrong, slot 3 never judged
    p = torch.sigmoid(lk.confidence_logits(3))
    assert p[0] == pytest.approx(0.9) and p[1] == pytest.approx(0.1) and p[2] == pytest.approx(0.5)
    with pytest.raises(DominoError, match="lookup-min-match"):
        PromptLookup(min_match=0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lookup_alone_and_hybrid_keep_greedy_output(family, llama_target, qwen3_target):
    target = llama_target if family == "llama" else qwen3_target
    drafter = tiny_drafter(target, head="domino", block_size=4)
    copied = accepted_copies = 0
    for prompt in PROMPTS + [[5, 9, 11, 2, 5, 9, 11, 2, 5, 9]]:
        ref = generate_autoregressive(target, prompt, 30, eos_ids=[])
        for drafter_or_none, b in ((None, 6), (None, 2), (drafter, 4)):
            spec = generate_speculative(
                target, drafter_or_none, prompt, 30, block_size=b, eos_ids=[], lookup=PromptLookup(min_match=2)
            )
            assert spec.tokens == ref.tokens, (family, drafter_or_none is not None, b, prompt)
            copied += spec.lookup_cycles
            accepted_copies += sum(spec.accepted)
        # EOS met inside a copied run stops exactly where plain decoding does
        eos = ref.tokens[12]
        want = generate_autoregressive(target, prompt, 30, eos_ids=[eos])
        assert (
            generate_speculative(target, None, prompt, 30, eos_ids=[eos], lookup=PromptLookup()).tokens == want.tokens
        )
    assert copied > 10 and accepted_copies > 10  # the random targets loop, so copies are really taken


def test_hybrid_takes_the_copy_only_from_a_long_enough_match(llama_target):
    target, prompt = llama_target, PROMPTS[1]
    drafter = tiny_drafter(target, head="domino", block_size=4)
    strict = generate_speculative(target, drafter, prompt, 30, eos_ids=[], lookup=PromptLookup(min_match=4))
    loose = generate_speculative(target, drafter, prompt, 30, eos_ids=[], lookup=PromptLookup(min_match=1))
    assert strict.tokens == loose.tokens
    assert 0 < strict.lookup_cycles < loose.lookup_cycles
    with pytest.raises(DominoError, match="drafter, prompt lookup"):
        generate_speculative(target, None, prompt, 8)


@pytest.mark.slow
@pytest.mark.parametrize("hybrid", [False, True], ids=["lookup", "hybrid-cost"])
def test_lookup_and_hybrid_sampling_preserve_target_distribution(hybrid):
    """A copied draft is a one-hot draft distribution: rejection sampling keeps the target's distribution."""
    target = soft_target()
    drafter = confident_drafter(target, block_size=3, seed=4, scale=3.0) if hybrid else None
    policy = CostPolicy(costs=CostTable({0: [1.0, 1.2, 1.4, 1.6]})) if hybrid else None
    prompt = [1, 2, 3, 1, 2, 3, 1, 2]

    def run(seed):
        return generate_speculative(
            target,
            drafter,
            prompt,
            3,
            SAMPLING,
            seed=seed,
            block_size=3,
            eos_ids=[],
            lookup=PromptLookup(min_match=2),
            verify=policy,
        )

    seen = assert_matches_target_distribution(run, target, prompt)
    assert seen["lookup_cycles"] > (50 if hybrid else 300) and seen["accepted_any"] > 50
