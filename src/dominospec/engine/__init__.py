"""The batched engine: many requests decoded together in fixed cache slots (plain or speculative).

request.py  EngineRequest, RequestHandle, RequestResult, EngineFull
engine.py   Engine: admission, chunked prefill, one ragged verify per step, per-request sampling
memory.py   whether the slot caches fit in memory, checked before they are allocated
"""

from .engine import POLICIES, Engine
from .request import EngineFull, EngineRequest, RequestHandle, RequestResult

__all__ = ["Engine", "EngineRequest", "RequestHandle", "RequestResult", "EngineFull", "POLICIES"]
