"""Serving: an OpenAI-compatible HTTP server over the batched engine, and a load test for it.

protocol.py  the request bodies accepted, the options refused, the error body
text.py      incremental detokenization, cut at stop strings
metrics.py   Prometheus metrics (requests, tokens, queue, tau, acceptance, TTFT/TPOT)
app.py       the FastAPI app: validation, submission, responses and server-sent events
server.py    uvicorn with a drain on SIGTERM
loadtest.py  closed-loop streaming clients against a running server, with a fault round
"""

from .app import LOOPBACK_HOSTS, Gate, ServeConfig, create_app
from .server import DrainingServer, free_port, make_server

__all__ = ["LOOPBACK_HOSTS", "ServeConfig", "Gate", "create_app", "make_server", "DrainingServer", "free_port"]
