"""The batched engine: many requests decoded together in fixed cache slots (plain or speculative).

request.py  EngineRequest, RequestHandle, RequestResult, EngineFull
engine.py   Engine: admission, chunked prefill, the shared step (decode/step.py) over all decoding rows, threads
memory.py   whether max_batch slot caches fit in free memory, checked before they are allocated
"""

from .engine import Engine
from .request import EngineFull, EngineRequest, RequestHandle, RequestResult

__all__ = ["Engine", "EngineRequest", "RequestHandle", "RequestResult", "EngineFull"]
