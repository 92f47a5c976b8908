"""Decoding: the online step, for one row (the batch-1 loop) or many (the engine).

result.py     GenerationResult, tau (tokens per cycle) and the tau to expect from an acceptance curve
rollout.py    Proposal and the drafter's rollout (draft_block, draft_rows)
lookup.py     the prompt-lookup index (alone, or as a hybrid with a drafter)
proposers.py  the proposer protocol (propose, then observe): plain, drafter, lookup, hybrid
schedule.py   the verify modes, the verify-length policies (fixed, static, cost) and what a step costs
step.py       one step for any number of rows (plan, one target forward, accept, roll back, commit)
single.py     generate_autoregressive / generate_speculative at batch 1: prefill, then the step until done
"""

from .lookup import PromptLookup
from .result import GenerationResult, tokens_per_cycle
from .rollout import Proposal, draft_block
from .schedule import VERIFY_MODES, CostTable, VerifyPolicy
from .single import generate_autoregressive, generate_speculative

__all__ = [
    "Proposal",
    "draft_block",
    "GenerationResult",
    "tokens_per_cycle",
    "generate_autoregressive",
    "generate_speculative",
    "PromptLookup",
    "VERIFY_MODES",
    "CostTable",
    "VerifyPolicy",
]
