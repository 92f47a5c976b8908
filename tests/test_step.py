"""The step's plan and the engine's prefill budget, decided before any forward: testable without a model."""

import torch

from dominospec import SamplingConfig
from dominospec.decode.lookup import PromptLookup
from dominospec.decode.proposers import LookupProposer, PlainProposer
from dominospec.decode.schedule import VerifyPolicy
from dominospec.decode.step import SeqState, commit_first, plan_step
from dominospec.engine.engine import prefill_chunks


def row(prompt, slot=0, budget=20):
    seq = SeqState(list(prompt), budget, SamplingConfig(), torch.Generator(), set(), lookup=PromptLookup(), slot=slot)
    seq.prefilled = len(prompt)
    return seq


def started(proposer, prompt, first, slot=0):
    """A row whose prompt is in and whose first token is committed (its logits: a one-hot at `first`)."""
    seq = row(prompt, slot)
    proposer.claim(seq)
    commit_first(seq, torch.nn.functional.one_hot(torch.tensor(first), 50).float(), proposer)
    return seq


def test_plan_cuts_each_rows_room_at_the_context_and_verifies_what_fits():
    """Protects: a row's verify block never passes the context limit (room = limit - committed tokens), a
    row with no earlier match proposes nothing (a plain step), and fixed verifies every proposed draft."""
    lookup = LookupProposer(vocab_size=50, block_size=4)
    repeating = started(lookup, [1, 2, 3, 1, 2, 3, 1, 2], 3, slot=0)  # "3 1 2 3" occurred: "1 2 3" follows
    fresh = started(lookup, [7, 8, 9], 10, slot=1)  # "10" never occurred before
    plan = plan_step([repeating, fresh], lookup, VerifyPolicy(), limit=None)
    assert plan.rooms == [4, 4] and plan.draft
    assert plan.proposals[0].drafts.tolist() == [1, 2, 3] and plan.proposals[1] is None
    assert plan.verify == [3, 0] and plan.num_new == [4, 1]
    near_end = plan_step([repeating, fresh], lookup, VerifyPolicy(), limit=repeating.committed_len + 2)
    assert near_end.rooms == [2, 4] and near_end.verify == [2, 0]  # 9 committed + 2 drafts fit in 11
    full = plan_step([repeating], lookup, VerifyPolicy(), limit=repeating.committed_len)
    assert full.rooms == [0] and full.proposals == [None] and full.num_new == [1]  # only the anchor fits


def test_a_plain_proposer_plans_one_token_per_row():
    rows = [row([1, 2, 3], slot=0), row([4, 5], slot=1)]
    for r in rows:
        r.res.tokens.append(6)
    plan = plan_step(rows, PlainProposer(), VerifyPolicy(), limit=None)
    assert plan.proposals == [None, None] and plan.verify == [0, 0] and plan.num_new == [1, 1]


def test_prefill_budget_serves_the_oldest_rows_first():
    assert prefill_chunks([5, 3, 10], 6) == [5, 1]  # the second row gets what is left, the third waits
    assert prefill_chunks([700], 512) == [512] and prefill_chunks([], 4) == []
