"""The OpenAI-compatible HTTP app over a running Engine.

A request is read and checked in full (body size, API key, JSON, types, options, model name,
prompt length) before it is submitted, so a bad request never takes a slot. The engine thread
hands tokens to the event loop (`Generation`); the handler turns them into text (`TextStream`),
cuts it at a stop string and cancels the request there. A request ends its engine row when it
finishes, hits a stop string, runs past the time limit, or its client goes away; the engine frees
the slot at its next step.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models[/{id}], GET /health,
GET /metrics, and the playground: GET / and its files under /playground/ (static, no data: they need
no API key, while every call the page makes does). Every error has OpenAI's body:
{"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import importlib.resources
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineFull, EngineRequest, RequestResult
from ..errors import DominoError
from ..log import log
from ..targets.context import MIN_ANSWER_TOKENS, fit_request
from .marks import marked_pieces, spec_metrics
from .metrics import ServerMetrics
from .protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body, parse_body
from .text import TextStream

GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
ROUTES = (*GENERATION_ROUTES, "/v1/models", "/health", "/metrics", "/")
PLAYGROUND = importlib.resources.files(__package__) / "playground"
# the playground's files, by name: what the page loads, all from this server
PLAYGROUND_FILES = {"index.html": "text/html", "playground.js": "text/javascript", "playground.css": "text/css"}
# the page may load and call nothing but this server
PLAYGROUND_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}
DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


@dataclass
class ServeConfig:
    model_name: str  # the id clients send as "model" (the target's name)
    api_key: str | None = None  # every route but /health then needs "Authorization: Bearer KEY"
    request_timeout: float = 600.0  # seconds from arrival to the last token, queueing included
    max_body_bytes: int = 1 << 20
    retry_after_s: int = 1  # the Retry-After of a 429 (queue full) or 503 (draining)
    # Host names answered (None: any). A loopback-bound server answers only loopback names, so a web
    # page that rebinds its own DNS name to 127.0.0.1 cannot read its answers.
    allowed_hosts: tuple[str, ...] | None = None
    body_timeout_s: float = 30.0  # a whole body not in within this many seconds is cut off (408)
    # Origins (scheme://host:port) whose web pages may call the server besides its own; "*" allows any
    allowed_origins: tuple[str, ...] = ()


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class Gate:
    """What SIGTERM changes and what it waits for: new requests are refused while in-flight ones finish."""

    def __init__(self):
        self.draining = False
        self.active = 0  # generation requests submitted to the engine and not finished there


def create_app(engine, target, config: ServeConfig, gate: Gate | None = None) -> FastAPI:
    """The app over `engine`: starting the app starts the engine's thread, stopping it drains the engine."""
    gate = gate or Gate()
    metrics = ServerMetrics(engine, gate)
    context = request_context(engine, target)
    token_chars = getattr(target, "max_token_chars", None) if getattr(target, "tokenizer", None) else None
    created = int(time.time())
    tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="dominospec-tokenize")

    async def tokenize(encode, *args, **kwargs) -> list[int]:
        """Tokenizing (and templating) a long prompt takes seconds: off the event loop, one at a time."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(tokenizer_thread, functools.partial(encode, *args, **kwargs))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        engine.start()
        yield
        await asyncio.to_thread(engine.shutdown, True, config.request_timeout)
        tokenizer_thread.shutdown(wait=False)

    app = FastAPI(title="dominospec", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.gate, app.state.metrics, app.state.engine = gate, metrics, engine
    app.add_middleware(Gatekeeper, config=config, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(_request, exc: Exception):
        log(f"serve: internal error: {type(exc).__name__}: {exc}")
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        if gate.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return {"status": "ok"}

    def model_card() -> dict:
        return {"id": config.model_name, "object": "model", "created": created, "owned_by": "dominospec"}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        check_model(model_id, config.model_name)
        return model_card()

    @app.api_route("/", methods=["GET", "HEAD"])  # HEAD: a reachability check gets 200, as GET would
    async def playground():
        return playground_file("index.html")

    @app.get("/playground/{name}")
    async def playground_asset(name: str):
        if name not in PLAYGROUND_FILES:
            raise APIError(404, f"the playground has no file {name!r}", type="not_found_error")
        return playground_file(name)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        arrived = time.monotonic()
        req = parse_body(ChatCompletionRequest, await request.body())
        check_model(req.model, config.model_name)
        conversation = req.conversation()
        chars = sum(len(m["content"]) for m in conversation)
        check_chars(chars, req.token_budget(), context, token_chars, "messages")
        kwargs = dict(req.chat_template_kwargs or {})
        thinking = kwargs.pop("enable_thinking", False)
        try:
            prompt_ids = await tokenize(
                target.encode_chat, conversation, enable_thinking=bool(thinking), template_kwargs=kwargs
            )
        except DominoError as exc:
            raise APIError(400, str(exc)) from None
        except Exception as exc:  # the template is the model's own Jinja code; its refusals are the caller's
            raise APIError(400, f"the chat template refused these messages: {exc}", param="messages") from None
        return await respond(request, req, prompt_ids, "chat", arrived)

    @app.post("/v1/completions")
    async def completions(request: Request):
        arrived = time.monotonic()
        req = parse_body(CompletionRequest, await request.body())
        check_model(req.model, config.model_name)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"prompt holds {len(prompt)} prompts; this server takes one", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            check_chars(len(prompt), req.token_budget(), context, token_chars, "prompt")
            try:
                prompt_ids = await tokenize(target.encode_raw, prompt)
            except DominoError as exc:
                raise APIError(400, str(exc)) from None
        else:
            bad = [t for t in prompt if not 0 <= t < target.vocab_size]
            if bad:
                raise APIError(400, f"prompt has token ids outside [0, {target.vocab_size}): {bad[:5]}", param="prompt")
            prompt_ids = list(prompt)
        return await respond(request, req, prompt_ids, "text", arrived)

    async def respond(request: Request, req, prompt_ids: list[int], kind: str, arrived: float):
        """Check the lengths, submit, and answer in one body or as a stream."""
        if gate.draining:
            raise APIError(
                503,
                "the server is shutting down and takes no new requests",
                type="service_unavailable",
                code="draining",
                headers={"Retry-After": str(config.retry_after_s)},
            )
        max_new = fit_budget(len(prompt_ids), req.token_budget(), context, "messages" if kind == "chat" else "prompt")
        stops = req.stop_strings()
        gen = Generation.submit(
            engine, req.engine_request(prompt_ids, max_new), gate, config, asyncio.get_running_loop()
        )
        metrics.prompt_tokens.inc(len(prompt_ids))
        text = TextStream(target.decode, stops)
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]
        shape = ResponseShape(kind, rid, int(time.time()), config.model_name)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = stream_events(gen, text, shape, len(prompt_ids), include_usage, metrics, arrived, req.spec_metrics)
            return EventStream(body, gen)
        parts = []
        async for delta in gen.text(text, metrics, arrived, gone=request.is_disconnected):
            parts.append(delta)
        if gen.outcome == "disconnected":
            return Response(status_code=499)  # nobody is listening; the status is for the logs and metrics
        answer = "".join(parts)
        counts = usage(len(prompt_ids), text.tokens)
        if not req.spec_metrics:
            return JSONResponse(shape.whole(answer, gen.outcome, counts))
        marks = marked_pieces(text.pieces(0, len(answer)), gen.sources)
        counts["spec_metrics"] = gen.spec_metrics(text.tokens)
        return JSONResponse(shape.whole(answer, gen.outcome, counts, marks))

    return app


def playground_file(name: str) -> Response:
    body = (PLAYGROUND / name).read_bytes()
    return Response(body, media_type=f"{PLAYGROUND_FILES[name]}; charset=utf-8", headers=PLAYGROUND_HEADERS)


def request_context(engine, target) -> int | None:
    """Positions one request may fill with prompt and answer: the engine's `context` (its slot, less the
    room a speculative step needs past the last token; the engine refuses requests that would not fit)."""
    context = getattr(engine, "context", None)
    return target.max_positions if context is None else int(context)


def check_chars(chars: int, asked: int | None, context: int | None, token_chars: int | None, param: str) -> None:
    """Refuse, before tokenizing it, a prompt whose character count alone cannot fit the context: no
    token covers more than `token_chars` characters (targets/context.py fit_request)."""
    if context is None or not token_chars:
        return
    fit = fit_request(chars, asked, context, token_chars=token_chars)
    if fit.refused == "max_tokens":
        raise APIError(
            400,
            f"this server's context is {context} tokens per request, but max_tokens asks for {asked} (and the "
            "prompt needs at least one): lower max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if fit.why == "full":
        room = context - (asked if asked is not None else MIN_ANSWER_TOKENS)
        raise APIError(
            400,
            f"the prompt has {chars} characters; this server's context of {context} tokens per request leaves "
            f"{room} tokens for it, at most {room * token_chars} characters (no token covers more than "
            f"{token_chars})",
            param=param,
            code="context_length_exceeded",
        )


def check_model(name: str | None, served: str) -> None:
    if name is not None and name != served:
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves {served!r}",
            param="model",
            code="model_not_found",
        )


def fit_budget(prompt_len: int, asked: int | None, context: int | None, prompt_param: str = "prompt") -> int:
    """Tokens to generate (targets/context.py fit_request): what was asked, or what the context leaves; a 400
    naming the counts when it does not fit."""
    fit = fit_request(prompt_len, asked, context)
    if fit.why == "empty":
        raise APIError(400, "the prompt is empty (0 tokens)", param=prompt_param)
    if fit.why == "full":
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens; this server's context of {context} tokens per request "
            f"takes prompts of at most {context - MIN_ANSWER_TOKENS} tokens "
            f"(room for a {MIN_ANSWER_TOKENS}-token answer)",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if fit.refused is not None:
        raise APIError(
            400,
            f"this server's context is {context} tokens per request, but {prompt_len + asked} were requested "
            f"({prompt_len} in the prompt, {asked} for the completion): shorten the prompt or lower max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return fit.budget


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Generation:
    """One request in the engine, seen from the event loop: its tokens and its end arrive on a queue.

    The time limit is a timer on the loop that cancels the engine request, so it holds even when
    nobody reads the stream. `outcome` says how it ended: stop, length, disconnected, timeout, error.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, gate: Gate):
        self.loop, self.gate = loop, gate
        self.events: asyncio.Queue = asyncio.Queue()
        self.handle = None
        self.result: RequestResult | None = None
        self.timed_out = False
        self.outcome: str | None = None
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.sources: list[str] = []  # per token received: where it came from
        self.verified: list[int] = []  # per cycle received: drafts the target checked

    @classmethod
    def submit(cls, engine, ereq: EngineRequest, gate: Gate, config: ServeConfig, loop) -> Generation:
        gen = cls(loop, gate)
        ereq.on_tokens = lambda tokens, sources, verified: gen._post((tokens, sources, verified))
        ereq.on_finish = gen._post
        try:
            gen.handle = engine.submit(ereq)
        except EngineFull:
            raise APIError(
                429,
                "the server's request queue is full; retry later",
                type="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(config.retry_after_s)},
            ) from None
        except DominoError as exc:  # the engine's own checks (lengths) or a shutdown under way
            if gate.draining:
                raise APIError(
                    503,
                    str(exc),
                    type="service_unavailable",
                    code="draining",
                    headers={"Retry-After": str(config.retry_after_s)},
                ) from None
            raise APIError(400, str(exc)) from None
        gate.active += 1
        gen._timer = loop.call_later(config.request_timeout, gen._expire)
        return gen

    def _post(self, item) -> None:  # engine thread
        try:
            self.loop.call_soon_threadsafe(self._receive, item)
        except RuntimeError:  # the loop is closed: the server is gone, nobody waits for this
            pass

    def _receive(self, item) -> None:  # event loop
        if isinstance(item, RequestResult):
            self.result = item
            self._timer.cancel()
            self.gate.active -= 1
        self.events.put_nowait(item)

    def _expire(self) -> None:
        self.timed_out = True
        self.cancel()

    def cancel(self) -> None:
        if self.handle is not None and self.result is None:
            self.handle.cancel()

    async def text(
        self,
        stream: TextStream,
        metrics: ServerMetrics,
        arrived: float,
        gone: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[str]:
        """The answer's text as it settles; raises APIError for a timeout or an engine failure.

        Leaving early (a stop string, a disconnect, the consumer closing it) cancels the engine request.
        """
        getter = None  # one pending get across polls: a cancelled get could drop tokens (Python 3.11)
        next_check = time.monotonic() + DISCONNECT_POLL_S
        try:
            while True:
                if gone is None:
                    item = await self.events.get()
                else:
                    if time.monotonic() >= next_check:  # whether tokens flow or not
                        if await gone():
                            self.outcome = "disconnected"
                            return
                        next_check = time.monotonic() + DISCONNECT_POLL_S
                    getter = getter or asyncio.ensure_future(self.events.get())
                    done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                    if not done:
                        continue
                    item, getter = getter.result(), None
                if isinstance(item, RequestResult):
                    self._check_end(item)
                    tail = stream.finish()
                    if tail:
                        yield tail
                    self.outcome = item.finish_reason
                    return
                tokens, sources, verified = item
                self.sources.extend(sources)
                self.verified.append(verified)
                now = time.monotonic()
                if self.first_token_at is None and tokens:
                    self.first_token_at = now
                    metrics.ttft.observe(now - arrived)
                self.last_token_at = now
                delta = "".join(stream.add(t) for t in tokens)
                if delta:
                    yield delta
                if stream.stopped:
                    self.outcome = "stop"
                    return
        finally:
            if getter is not None:
                getter.cancel()
            self.cancel()
            self.outcome = self.outcome or "disconnected"  # closed by the consumer: the client left
            metrics.finished.labels(self.outcome).inc()
            metrics.completion_tokens.inc(stream.tokens)
            if self.first_token_at is not None and stream.tokens > 1:
                metrics.tpot.observe((self.last_token_at - self.first_token_at) / (stream.tokens - 1))
            metrics.latency.observe(time.monotonic() - arrived)

    def spec_metrics(self, answer_tokens: int) -> dict:
        """usage.spec_metrics of the answer's first answer_tokens tokens."""
        return spec_metrics(self.sources[:answer_tokens], self.verified)

    def _check_end(self, result: RequestResult) -> None:
        if self.timed_out:
            self.outcome = "timeout"
            raise APIError(504, "the request ran past the server's time limit", type="timeout", code="request_timeout")
        if result.finish_reason == "error":
            self.outcome = "error"
            raise APIError(500, f"generation failed: {result.error}", type="server_error")
        if result.finish_reason == "cancelled":  # not by us: the engine stopped without draining
            self.outcome = "error"
            raise APIError(503, "the request was cancelled by the server", type="service_unavailable")


@dataclass
class ResponseShape:
    """The OpenAI JSON of one response, whole or as stream chunks (chat or text completion)."""

    kind: str  # "chat" | "text"
    id: str
    created: int
    model: str

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def whole(self, text: str, finish_reason: str, usage: dict, marks: list | None = None) -> dict:
        """marks: the spec_tokens extension ([text, source] pieces), only when the request asked for it."""
        if self.kind == "chat":
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            return self._envelope("chat.completion", [_marked(choice, marks)], usage=usage)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [_marked(choice, marks)], usage=usage)

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        marks: list | None = None,
        progress: dict | None = None,
    ) -> dict:
        """marks, progress: the spec_metrics extension's spec_tokens and spec_progress, when asked for."""
        if self.kind == "chat":
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        choice = _marked(choice, marks)
        if progress is not None:
            choice["spec_progress"] = progress
        return self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", [choice])

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, [], usage=usage)


def _marked(choice: dict, marks: list | None) -> dict:
    return choice if marks is None else {**choice, "spec_tokens": marks}


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)}\n\n"


async def stream_events(
    gen: Generation,
    text: TextStream,
    shape: ResponseShape,
    prompt_tokens: int,
    include_usage: bool,
    metrics: ServerMetrics,
    arrived: float,
    with_marks: bool = False,
) -> AsyncIterator[str]:
    """Server-sent events: a role chunk (chat), text chunks, the finish chunk, usage if asked, [DONE].
    with_marks (the spec_metrics extension): each text chunk carries its spec_tokens, and the usage
    chunk, always sent then, usage.spec_metrics.

    Starlette cancels this generator when the client disconnects; leaving `gen.text` then cancels
    the engine request. An error after the first byte is sent as an error event, as OpenAI does.
    """
    pieces = gen.text(text, metrics, arrived)
    try:
        if shape.kind == "chat":
            yield sse(shape.chunk(None, role=True))
        sent = 0  # characters of the answer already sent
        async for delta in pieces:
            marks = progress = None
            if with_marks:
                marks = marked_pieces(text.pieces(sent, sent + len(delta)), gen.sources)
                progress = {"cycles": len(gen.verified), "drafted": sum(gen.verified)}
            sent += len(delta)
            yield sse(shape.chunk(delta, marks=marks, progress=progress))
        yield sse(shape.chunk(None, finish_reason=gen.outcome))
        if include_usage or with_marks:
            counts = usage(prompt_tokens, text.tokens)
            if with_marks:
                counts["spec_metrics"] = gen.spec_metrics(text.tokens)
            yield sse(shape.usage_chunk(counts))
    except APIError as exc:
        yield sse(exc.body())
    finally:
        await pieces.aclose()
    yield sse("[DONE]")


class EventStream(StreamingResponse):
    """The event-stream response; however it ends (a client gone mid-stream included), its body is
    closed before the response is done, so the engine request is cancelled now, not when the
    abandoned generator is garbage-collected."""

    def __init__(self, body: AsyncIterator[str], gen: Generation):
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.generation = gen

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.cancel()
            await self.body_iterator.aclose()


def _public(path: str) -> bool:
    """Routes open without the API key: the health check and the playground's static files."""
    return path in ("/health", "/") or path.startswith("/playground/")


class Gatekeeper:
    """ASGI middleware in front of every route: counts responses by status, checks the API key,
    and refuses oversized bodies (413) before the app reads them."""

    def __init__(self, app, config: ServeConfig, metrics: ServerMetrics):
        self.app, self.config, self.metrics = app, config, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def counted_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = message.get("headers", [])
                if not any(name.lower() == b"x-content-type-options" for name, _ in headers):
                    # no browser may guess another type (HTML, script) for a JSON or text body
                    message = {**message, "headers": [*headers, (b"x-content-type-options", b"nosniff")]}
            await send(message)

        try:
            await self._checked(scope, receive, counted_send)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.requests.labels(route, str(status)).inc()

    async def _checked(self, scope, receive, send):
        headers = dict(scope["headers"])
        refusal = self._foreign(scope, headers)
        if refusal is not None:
            return await self._refuse(scope, receive, send, 403, refusal, "forbidden_origin")
        if self.config.api_key is not None and not _public(scope["path"]) and not self._authorized(scope):
            return await self._refuse(scope, receive, send, 401, "invalid or missing API key", "invalid_api_key")
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        kind = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        if kind != "application/json":
            return await self._refuse(
                scope,
                receive,
                send,
                415,
                f"the body must be JSON sent as Content-Type: application/json (got {kind or 'none'!r})",
                "unsupported_media_type",
            )
        limit = self.config.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(scope, receive, send, 413, f"the body exceeds {limit} bytes", "body_too_large")
        chunks, size = [], 0
        # one deadline for the whole body: a client dripping a byte at a time is cut off at it too
        deadline = time.monotonic() + self.config.body_timeout_s
        while True:  # read it whole here, so a body without Content-Length is bounded too
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                msg = f"the body did not arrive within {self.config.body_timeout_s:g} s"
                return await self._refuse(scope, receive, send, 408, msg, "body_timeout")
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._refuse(
                    scope, receive, send, 413, f"the body exceeds {limit} bytes", "body_too_large"
                )
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        await self.app(scope, replay, send)

    def _foreign(self, scope, headers: dict) -> str | None:
        """Why a request from a web page on another origin (or a rebound DNS name) is refused; None if it is not.

        Browsers send Origin on cross-site requests; API clients send none. An Origin is accepted when it is
        the server's own: the scheme, host and port the request was sent to (on a loopback server, any
        loopback name on that port), or one that `allowed_origins` (serve --allow-origin) lists."""
        netloc = headers.get(b"host", b"").decode("latin-1")
        host = _hostname(netloc)
        allowed = self.config.allowed_hosts
        if allowed is not None and host not in allowed:
            return f"Host {host!r} is not this server's; a server bound to loopback answers {', '.join(allowed)}"
        origin = headers.get(b"origin")
        if origin is None:
            return None
        text = origin.decode("latin-1")
        page = origin_of(text)
        own = origin_of(f"{scope.get('scheme', 'http')}://{netloc}")
        if page is not None and own is not None and page[0] == own[0] and page[2] == own[2]:
            if page[1] == own[1] or (allowed is not None and page[1] in allowed):
                return None
        if "*" in self.config.allowed_origins or (
            page is not None and page in {origin_of(o) for o in self.config.allowed_origins}
        ):
            return None
        return (
            f"requests from web pages on {text} are refused (Origin is not this server's own, "
            f"{scope.get('scheme', 'http')}://{netloc}; `serve --allow-origin ORIGIN` allows another)"
        )

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
        scheme, _, key = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(key.strip().encode(), self.config.api_key.encode())

    async def _refuse(self, scope, receive, send, status: int, message: str, code: str):
        kind = {401: "authentication_error", 403: "permission_error"}.get(status, "invalid_request_error")
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        await JSONResponse(error_body(message, kind, code=code), status_code=status, headers=headers)(
            scope, receive, send
        )


def _hostname(netloc: str) -> str:
    """`host[:port]` or `[v6]:port` -> the host name, lower case, without brackets or port."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[1 : netloc.find("]")] if "]" in netloc else netloc
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_of(url: str) -> tuple[str, str, int] | None:
    """`scheme://host[:port]` -> (scheme, host, port) with the scheme's default port made explicit; None
    when `url` is not such an origin (a path, no host, an unknown scheme, a bad port, or "null")."""
    try:
        parts = urlparse(url.strip().lower())
        port = parts.port or DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    if not parts.hostname or port is None or parts.path not in ("", "/") or parts.query or parts.params:
        return None
    return parts.scheme, parts.hostname, port
