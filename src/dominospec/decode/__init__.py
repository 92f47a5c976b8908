"""Decoding: proposals, verification, the batch-1 loops, and what verification costs.

result.py   GenerationResult and tau
propose.py  Proposal and draft_block (drafter backbone + head rollout)
single.py   generate_autoregressive / generate_speculative at batch 1
cost.py     the verify-cost profile of a target on this device
"""

from .propose import Proposal, draft_block
from .result import GenerationResult, tokens_per_cycle
from .single import generate_autoregressive, generate_speculative

__all__ = ["Proposal", "draft_block", "GenerationResult", "tokens_per_cycle", "generate_autoregressive",
           "generate_speculative"]
