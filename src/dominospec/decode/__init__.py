"""Decoding: proposals, verification, the batch-1 loops, and what verification costs.

result.py   GenerationResult and tau
propose.py  Proposal and draft_block (drafter backbone + head rollout)
step.py     one speculative step over explicit per-sequence state (propose, accept, commit, roll back)
proposers.py  the proposer protocol (propose, then observe) for the drafter, prompt lookup and the hybrid
single.py   generate_autoregressive / generate_speculative at batch 1
cost.py     the verify-cost profile of a target on this device
schedule.py the verify-length policies (fixed, static, cost) and the STS temperatures they read
lookup.py   the prompt-lookup proposer (alone, or as a hybrid with a drafter)
calibrate.py  confidence records from live rollouts and the Sequential Temperature Scaling fit
"""

from .lookup import PromptLookup
from .propose import Proposal, draft_block
from .result import GenerationResult, tokens_per_cycle
from .schedule import VERIFY_MODES, CostTable, VerifyPolicy, make_policy
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
    "make_policy",
]
