"""Speculation that never costs: a cycle that drafts nothing stays a plain step, and the cost policy turns drafting
off where the measured rate or the batch's verify price says it does not pay."""

import pytest
import torch
from conftest import PROMPTS, tiny_drafter, tiny_target

from dominospec import SamplingConfig, generate_autoregressive
from dominospec.decode import CostTable, PromptLookup, Proposal
from dominospec.decode.proposers import make_proposer
from dominospec.decode.schedule import BatchCostTable, CostPolicy
from dominospec.decode.step import OneCache, SeqState, make_generator
from dominospec.engine import Engine, EngineRequest

GREEDY, T1 = SamplingConfig(), SamplingConfig(1.0)


def seq(prompt, sampling=GREEDY, seed=0) -> SeqState:
    return SeqState(list(prompt), 64, sampling, make_generator(seed, "cpu"), set())


# ----- the lazy context path -----


@pytest.mark.parametrize("sampling", [GREEDY, T1], ids=["greedy", "sampled"])
@torch.inference_mode()  # as the decoding loops run
def test_a_drafter_that_skipped_many_cycles_drafts_what_an_eager_one_drafts(sampling):
    """Protects: the drafter's context takes the skipped cycles' features at its next draft, all at once; its
    drafts (and, sampled, the distributions they were drawn from) are those of a drafter whose context was
    brought up to date every cycle."""
    target = tiny_target("llama", dtype=torch.float32, backend="native")
    drafter = tiny_drafter(target, block_size=4)
    layers = drafter.config.target_layer_ids
    side = OneCache(target, 64)
    lazy, eager = make_proposer(drafter, False, 4), make_proposer(drafter, False, 4)
    rows = [seq(PROMPTS[1], sampling), seq(PROMPTS[1], sampling)]
    out = side.forward(torch.tensor([PROMPTS[1]]), logits="last", layer_ids=layers, with_features=True)
    for p, r in zip((lazy, eager), rows):
        p.claim(r)
        p.extend(r, out.features)
    tok = int(out.logits[0, -1].argmax())
    for _ in range(12):  # twelve cycles without a draft: the eager drafter updates its context every one
        for p, r in zip((lazy, eager), rows):
            r.res.tokens.append(tok)
            assert p.propose([r], [4], draft=False) == [None]
        out = side.forward(torch.tensor([[tok]]), layer_ids=layers, with_features=True)
        for p, r in zip((lazy, eager), rows):
            p.observe(r, None, 0, 0, out.features)
        eager._flush(rows[1])
        assert rows[1].draft_cache.length == len(PROMPTS[1]) + 1 + len(rows[1].tokens) - 1
        tok = int(out.logits[0, -1].argmax())
    assert rows[0].draft_cache.length == 0  # the lazy one has not touched its cache, not even for the prompt
    for r in rows:
        r.res.tokens.append(tok)
        r.gen.manual_seed(7)
    (a,), (b,) = lazy.propose([rows[0]], [4]), eager.propose([rows[1]], [4])
    assert rows[0].draft_cache.length == rows[1].draft_cache.length
    assert torch.equal(a.drafts, b.drafts)
    if not sampling.greedy:
        assert torch.equal(a.draft_probs, b.draft_probs)


def test_a_plain_request_in_a_drafter_engine_captures_no_features():
    """Protects: steps (and prompt chunks) whose rows all decode plainly ask the target for no features (a plain
    request beside a drafter), and the output stays plain decoding's."""
    target = tiny_target("llama", dtype=torch.float32, backend="native")
    drafter = tiny_drafter(target, block_size=4)
    asked = []
    forward = target.forward_rows

    def spy(*args, **kw):
        asked.append(args[6] if len(args) > 6 else kw.get("with_features"))
        return forward(*args, **kw)

    target.forward_rows = spy
    engine = Engine(target, drafter, policy="fixed", max_batch=1)
    h = engine.submit(EngineRequest(list(PROMPTS[1]), 12, eos_ids=[], speculative=False))
    engine.run_until_idle()
    del target.forward_rows
    assert len(asked) >= 11 and not any(asked)
    assert h.wait(0).tokens == generate_autoregressive(target, PROMPTS[1], 12, eos_ids=[]).tokens


# ----- the cost model: a no-draft cycle that is dearer than a plain step -----


class Row:
    """What the cost policy reads of a row; a row is itself (the policy keeps per-row state in weak maps)."""

    def __init__(self, **fields):
        self.__dict__.update(fields)


def request(context=10):
    return Row(committed_len=context + 1, sampling=GREEDY, speculative=True)


def test_a_measured_no_draft_overhead_turns_drafting_off():
    """Protects: a request whose own cycles, measured, commit tokens slower than a plain step (here: cycles that
    draft nothing, each 5% dearer than the profile's plain step) falls back to plain decoding after the warm-up;
    one whose cycles are as cheap as a plain step, or dearer but committing more, keeps speculating, and so does
    one on a machine slower than when it was profiled (its forwards measure slower too)."""
    policy = CostPolicy(costs=CostTable({0: [0.010, 0.012, 0.014]}, draft_s=0.002), block_size=2, fallback_after=8)
    dear, even, paying = request(), request(), request()
    slow_machine = request()  # every forward 20% above the profile's price: its plain step is too (12 ms)
    for i in range(8):
        assert dear.speculative  # not before the warm-up
        policy.observe_step([dear], 0.0105, [1], 0.0100, 1)
        policy.observe_step([even], 0.0100, [1], 0.0100, 1)
        policy.observe_step([paying], 0.0150, [2], 0.0140, 3)
        policy.observe_step([slow_machine], 0.0165, [1 + i % 2], 0.0144, 2)  # 11 ms a token: above 10, under 12
    assert [policy.resting(r) for r in (dear, even, paying, slow_machine)] == [True, False, False, False]
    assert policy.rests == 1 and not policy.wants_draft([dear])  # no drafter pass while it rests
    assert policy.verify_lengths([Proposal(torch.tensor([1, 2]), source="lookup")], [dear]) == [0]
    for _ in range(policy.rest_steps):
        policy.observe_step([dear], 0.0100, [1], 0.0100, 1)
    assert not policy.resting(dear)  # then it measures again


def test_the_skip_decision_is_computed_again_only_when_what_it_reads_moves(monkeypatch):
    """Protects: a cycle that drafts nothing does not run the allocation over the whole curve again (it reads a
    remembered decision) until an outcome, the row count or the priced context changes."""
    policy = CostPolicy(costs=CostTable({0: [1.0, 1.2, 1.4], 500: [2.0, 2.4, 2.8]}, draft_s=0.5), block_size=2)
    calls = []
    pays = policy.drafting_pays
    monkeypatch.setattr(policy, "drafting_pays", lambda rows: calls.append(len(rows)) or pays(rows))
    r = request()
    for _ in range(10):
        policy.wants_draft([r])
    assert len(calls) == 1
    policy.observe(Proposal(torch.tensor([1, 2]), source="drafter"), 2, 0, row=r)
    policy.wants_draft([r])
    policy.wants_draft([r, request()])
    policy.wants_draft([request(400)])  # another profiled context prices it
    assert calls == [1, 1, 2, 1]


# ----- prompt lookup: its cost does not grow with the context -----


class CountingDict(dict):
    """An index that counts its reads and writes."""

    ops = 0

    def __setitem__(self, key, value):
        CountingDict.ops += 1
        super().__setitem__(key, value)

    def get(self, key, default=None):
        CountingDict.ops += 1
        return super().get(key, default)


def lookup_ops(context: int) -> int:
    """Index operations of 50 committed tokens and 50 proposals after `context` tokens of history (a repeating
    pattern: every proposal finds its longest match)."""
    lookup = PromptLookup()
    lookup.index = CountingDict()
    lookup.extend([i % 37 for i in range(context)])
    CountingDict.ops = 0
    for i in range(context, context + 50):
        lookup.extend([i % 37])
        assert lookup.propose(8, 1000, GREEDY)[1] == 4
    return CountingDict.ops


def test_prompt_lookup_costs_the_same_operations_at_any_context_length():
    """Protects: prompt lookup's index takes each committed token in O(1) and a proposal reads O(match)
    entries: the work of a cycle does not grow with the context (a count of index operations, not a time)."""
    assert lookup_ops(100) == lookup_ops(10_000) == 50 * (4 + 1)  # 4 n-grams written, the longest read


# ----- the engine: one more verified draft priced for the whole batch -----


def test_a_batch_at_high_row_count_stops_drafting_when_the_verify_is_priced_above_its_gain():
    """Protects: one more verified draft is priced at the batch's row count: where a token more per row makes
    the step dearer than the tokens it is expected to bring (eight rows here), the batch decodes plainly (a
    probe now and then); one row, where a token more is cheap, drafts. The output stays plain decoding's."""
    table = BatchCostTable({1: [1.0, 1.05, 1.1, 1.15, 1.2], 8: [1.0, 2.0, 3.0, 4.0, 5.0]}, {1: 0.01, 8: 0.08})
    policy = CostPolicy(costs=table, block_size=4)
    assert policy.drafting_pays([request()]) and not policy.drafting_pays([request() for _ in range(8)])
    target = tiny_target("llama", dtype=torch.float32, backend="native")
    drafter = tiny_drafter(target, block_size=4)
    engine = Engine(target, drafter, policy="cost", max_batch=8, costs=table)
    handles = [engine.submit(EngineRequest(list(PROMPTS[i % 2]) + [i + 1], 20, eos_ids=[])) for i in range(8)]
    engine.run_until_idle()
    stats = engine.stats()
    assert stats["draft_skipped"] >= stats["steps"] * 3 // 4  # eight rows decode together nearly every step
    for i, h in enumerate(handles):
        ref = generate_autoregressive(target, list(PROMPTS[i % 2]) + [i + 1], 20, eos_ids=[])
        assert h.wait(0).tokens == ref.tokens
