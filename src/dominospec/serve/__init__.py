"""Serving: an OpenAI-compatible HTTP server over the batched engine and its playground page.

protocol.py  the request bodies accepted, the options refused, the error body
text.py      incremental detokenization, cut at stop strings
marks.py     the spec_metrics extension: per-request speculation counts and per-token sources
metrics.py   Prometheus metrics (requests, tokens, queue, tau, acceptance, TTFT/TPOT)
app.py       the FastAPI app: validation, submission, responses and server-sent events
server.py    uvicorn with a drain on SIGTERM
playground/  the page at / (index.html, playground.js, playground.css): static, no build step
"""

from .app import LOOPBACK_HOSTS, Gate, ServeConfig, create_app
from .server import DrainingServer, free_port, make_server

__all__ = ["LOOPBACK_HOSTS", "ServeConfig", "Gate", "create_app", "make_server", "DrainingServer", "free_port"]
