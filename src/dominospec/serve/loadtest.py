"""A closed-loop load test of a running server: N streaming clients for S seconds, and a fault round.

Each client sends one streaming chat request at a time with the official `openai` client (no
automatic retries: every failure is counted), records when its first and last tokens arrive and
how many tokens the server says it generated, and starts the next request at once. A 429 (queue
full) is retried after its Retry-After, as a well-behaved client does, and counted apart. The
server's RSS is sampled over the run, from /proc/PID when the server's pid is given (same machine)
or from the process_resident_memory_bytes gauge of its /metrics.

The fault round (halfway through) runs beside the clients: streams whose clients disconnect after
the first chunk, malformed and oversized bodies, and a burst of requests beyond the server's queue.
Its requests are reported apart; the clients' own errors must stay at zero.

Loopback only, bounded in time (duration + one request timeout) and in count (max_requests).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from ..errors import DominoError

LOOPBACK_NAMES = ("localhost",)
RETRY_429_MAX = 50  # retries of one request after 429s before it counts as an error


@dataclass
class LoadTestConfig:
    url: str  # the server's root, e.g. http://127.0.0.1:8000
    prompts: list[str]
    concurrency: int = 4
    duration_s: float = 60.0
    max_requests: int | None = None  # stop starting requests after this many (all clients together)
    max_tokens: int = 128
    temperature: float = 0.0
    api_key: str | None = None
    server_pid: int | None = None
    fault_round: bool = False
    request_timeout_s: float = 300.0
    rss_every_s: float = 1.0


@dataclass
class RequestRecord:
    ok: bool
    error: str | None = None  # the kind: http_429, http_500, timeout, connection, ...
    detail: str | None = None  # what the server said (its error message), for the report
    ttft_s: float | None = None
    tpot_s: float | None = None
    tokens: int = 0
    retries: int = 0
    started_s: float | None = None  # seconds since the test began (the last attempt)
    latency_s: float | None = None  # start to the end of the stream


@dataclass
class LoadTestReport:
    concurrency: int
    duration_s: float
    requests: int
    errors: dict[str, int]
    tokens: int
    tokens_per_s: float
    requests_per_s: float
    ttft_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    retried_429: int
    rss_mb: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MB)
    faults: dict = field(default_factory=dict)
    first_errors: dict[str, str] = field(default_factory=dict)  # error kind -> the first one's message
    # per finished request, in start order: [started s, TTFT ms, latency ms, tokens] (for plots over time)
    timeline: list[list] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}

    def table(self) -> str:
        def pct(d):
            return " / ".join("-" if d[k] is None else f"{d[k]:.1f}" for k in ("p50", "p90", "p99"))

        rss = [mb for _, mb in self.rss_mb]
        lines = [
            f"concurrency {self.concurrency}, {self.duration_s:.1f} s: {self.requests} requests, {self.tokens} tokens",
            f"  throughput      {self.tokens_per_s:.1f} tokens/s, {self.requests_per_s:.2f} requests/s",
            f"  TTFT ms         p50 / p90 / p99 = {pct(self.ttft_ms)}",
            f"  TPOT ms         p50 / p90 / p99 = {pct(self.tpot_ms)}",
            f"  errors          {sum(self.errors.values())} {dict(self.errors) if self.errors else ''}".rstrip(),
            f"  retried 429     {self.retried_429}",
        ]
        for kind, message in self.first_errors.items():
            lines.append(f"  first {kind:<10} {message}")
        if rss:
            lines.append(
                f"  server RSS MB   start {rss[0]:.1f}, max {max(rss):.1f}, end {rss[-1]:.1f} ({len(rss)} samples)"
            )
        for kind, outcome in self.faults.items():
            lines.append(f"  fault {kind:<18} {outcome}")
        return "\n".join(lines)


def check_loopback(url: str, flag: str = "--url") -> str:
    """The URL without a trailing slash; a DominoError (naming `flag`, the option that gave it) unless it is
    http(s) on this machine."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise DominoError(f"{flag} {url!r}: expected http://127.0.0.1:PORT")
    host = parsed.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host in LOOPBACK_NAMES
    if not loopback:
        raise DominoError(f"{flag} {url!r}: the load test only drives servers on this machine (127.0.0.1, ::1)")
    return url.rstrip("/")


def percentiles(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    """p50/p90/p99 by the nearest-rank method (None without values)."""
    s = sorted(values)
    out = {}
    for name, q in (("p50", 0.50), ("p90", 0.90), ("p99", 0.99)):
        out[name] = s[max(0, math.ceil(q * len(s)) - 1)] * scale if s else None
    return out


def read_rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def metrics_value(text: str, name: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return None


class LoadTest:
    def __init__(self, cfg: LoadTestConfig):
        if cfg.concurrency < 1 or cfg.duration_s <= 0 or not cfg.prompts:
            raise DominoError("a load test needs --concurrency >= 1, --duration > 0 and at least one prompt")
        self.cfg = cfg
        self.base = check_loopback(cfg.url)
        self.headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.records: list[RequestRecord] = []
        self.started_requests = 0
        self.rss: list[tuple[float, float]] = []
        self.faults: dict = {}

    async def run(self) -> LoadTestReport:
        cfg = self.cfg
        limits = httpx.Limits(max_connections=cfg.concurrency + 64)
        async with httpx.AsyncClient(timeout=cfg.request_timeout_s, limits=limits, headers=self.headers) as http:
            self.http = http
            model = await self._model()
            self.client = openai.AsyncOpenAI(
                base_url=f"{self.base}/v1",
                api_key=cfg.api_key or "none",
                max_retries=0,
                timeout=cfg.request_timeout_s,
                http_client=http,
            )
            self.t0 = time.monotonic()
            self.deadline = self.t0 + cfg.duration_s
            sampler = asyncio.create_task(self._sample_rss())
            tasks = [asyncio.create_task(self._client(i, model)) for i in range(cfg.concurrency)]
            if cfg.fault_round:
                tasks.append(asyncio.create_task(self._fault_round(model)))
            await asyncio.gather(*tasks)
            elapsed = time.monotonic() - self.t0
            sampler.cancel()
            await self._sample_once()
        ok = [r for r in self.records if r.ok]
        tokens = sum(r.tokens for r in ok)
        return LoadTestReport(
            concurrency=cfg.concurrency,
            duration_s=elapsed,
            requests=len(self.records),
            errors=dict(Counter(r.error for r in self.records if not r.ok)),
            tokens=tokens,
            tokens_per_s=tokens / elapsed,
            requests_per_s=len(ok) / elapsed,
            ttft_ms=percentiles([r.ttft_s for r in ok if r.ttft_s is not None], 1000),
            tpot_ms=percentiles([r.tpot_s for r in ok if r.tpot_s is not None], 1000),
            retried_429=sum(r.retries for r in self.records),
            rss_mb=self.rss,
            faults=self.faults,
            first_errors=first_errors(self.records),
            timeline=[
                [round(r.started_s, 3), _ms(r.ttft_s), _ms(r.latency_s), r.tokens]
                for r in sorted(ok, key=lambda r: r.started_s)
            ],
        )

    async def _model(self) -> str:
        try:
            r = await self.http.get(f"{self.base}/v1/models")
        except httpx.HTTPError as exc:
            raise DominoError(f"--url {self.base}: no server answers there ({type(exc).__name__})") from None
        if r.status_code != 200:
            raise DominoError(f"--url {self.base}: GET /v1/models answered {r.status_code}: {r.text[:200]}")
        return r.json()["data"][0]["id"]

    def _take_request(self) -> bool:
        if time.monotonic() >= self.deadline:
            return False
        if self.cfg.max_requests is not None and self.started_requests >= self.cfg.max_requests:
            return False
        self.started_requests += 1
        return True

    async def _client(self, index: int, model: str) -> None:
        turn = index
        while self._take_request():
            prompt = self.cfg.prompts[turn % len(self.cfg.prompts)]
            turn += self.cfg.concurrency
            self.records.append(await self._one(model, prompt))

    async def _one(self, model: str, prompt: str) -> RequestRecord:
        """One streaming chat request, retried after 429s; its timings from the client's side."""
        retries = 0
        while True:
            start = time.monotonic()
            first = last = None
            tokens = 0
            try:
                stream = await self.client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=self.cfg.max_tokens,
                    temperature=self.cfg.temperature,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                async for chunk in stream:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                    if chunk.choices and chunk.choices[0].delta.content:
                        last = time.monotonic()
                        first = first or last
            except openai.RateLimitError as exc:
                retries += 1
                if retries > RETRY_429_MAX or time.monotonic() > self.deadline + self.cfg.request_timeout_s:
                    return RequestRecord(False, "http_429", retries=retries)
                await asyncio.sleep(_retry_after(exc.response))
                continue
            except openai.APIStatusError as exc:
                return RequestRecord(False, f"http_{exc.status_code}", _said(exc), retries=retries)
            except openai.APITimeoutError as exc:
                return RequestRecord(False, "timeout", str(exc), retries=retries)
            except openai.APIConnectionError as exc:
                return RequestRecord(False, "connection", str(exc), retries=retries)
            except openai.APIError as exc:  # an error event inside the stream
                kind = f"stream_{getattr(exc, 'code', None) or 'error'}"
                return RequestRecord(False, kind, _said(exc), retries=retries)
            tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
            ttft = None if first is None else first - start
            return RequestRecord(
                True,
                ttft_s=ttft,
                tpot_s=tpot,
                tokens=tokens,
                retries=retries,
                started_s=start - self.t0,
                latency_s=time.monotonic() - start,
            )

    async def _sample_rss(self) -> None:
        while True:
            await self._sample_once()
            await asyncio.sleep(self.cfg.rss_every_s)

    async def _sample_once(self) -> None:
        t = round(time.monotonic() - self.t0, 2)
        if self.cfg.server_pid is not None:
            mb = read_rss_mb(self.cfg.server_pid)
        else:
            try:
                r = await self.http.get(f"{self.base}/metrics")
                value = metrics_value(r.text, "process_resident_memory_bytes") if r.status_code == 200 else None
            except httpx.HTTPError:
                value = None
            mb = None if value is None else value / 2**20
        if mb is not None:
            self.rss.append((t, round(mb, 1)))

    # ----- faults -----
    async def _fault_round(self, model: str) -> None:
        await asyncio.sleep(self.cfg.duration_s / 2)
        self.faults["disconnect"] = await self._disconnects(model, count=max(2, self.cfg.concurrency // 2))
        self.faults["malformed"] = await self._malformed(model)
        self.faults["burst"] = await self._burst(model)

    async def _disconnects(self, model: str, count: int) -> dict:
        """Streams closed by their clients after the first chunk: the server must free their slots."""
        outcome = Counter()

        async def one():
            body = {"model": model, "messages": [{"role": "user", "content": self.cfg.prompts[0]}], "stream": True}
            body["max_tokens"] = self.cfg.max_tokens
            try:
                async with self.http.stream("POST", f"{self.base}/v1/chat/completions", json=body) as r:
                    outcome[f"status_{r.status_code}"] += 1
                    async for _ in r.aiter_bytes():
                        break  # leave after the first bytes; closing the response drops the connection
            except httpx.HTTPError as exc:
                outcome[type(exc).__name__] += 1

        await asyncio.gather(*(one() for _ in range(count)))
        return dict(outcome)

    async def _malformed(self, model: str) -> dict:
        """Bad bodies, each expecting its 4xx status with an OpenAI error body."""
        msgs = [{"role": "user", "content": "hi"}]
        cases = {
            "invalid_json": (b"{not json", 400),
            "wrong_type": (_json({"model": model, "messages": msgs, "temperature": "hot"}), 400),
            "nan": (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', 400),
            "negative": (_json({"model": model, "messages": msgs, "max_tokens": -5}), 400),
            "n_2": (_json({"model": model, "messages": msgs, "n": 2}), 400),
            "unknown_model": (_json({"model": "no-such-model", "messages": msgs}), 404),
            "oversized": (b'{"messages": "' + b"x" * (2 << 20) + b'"}', 413),  # over the default 1 MiB
        }
        outcome = {}
        for name, (body, expected) in cases.items():
            try:
                r = await self.http.post(
                    f"{self.base}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
                )
                shaped = r.headers.get("content-type", "").startswith("application/json") and "error" in r.json()
                outcome[name] = "ok" if r.status_code == expected and shaped else f"got {r.status_code}"
            except httpx.HTTPError as exc:
                outcome[name] = f"failed: {type(exc).__name__}"
        return outcome

    async def _burst(self, model: str) -> dict:
        """Requests beyond the queue at once: each gets 200 or 429/503 with Retry-After, none hangs or fails."""
        r = await self.http.get(f"{self.base}/metrics")
        size = int(
            (metrics_value(r.text, "dominospec_max_queue") or 64) + (metrics_value(r.text, "dominospec_max_batch") or 8)
        )
        body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}
        outcome = Counter()

        async def one():
            try:
                resp = await self.http.post(f"{self.base}/v1/chat/completions", json=body)
                has_retry = resp.status_code not in (429, 503) or "retry-after" in resp.headers
                outcome[f"status_{resp.status_code}" + ("" if has_retry else "_without_retry_after")] += 1
            except httpx.HTTPError as exc:
                outcome[type(exc).__name__] += 1

        await asyncio.gather(*(one() for _ in range(size + 16)))
        return dict(outcome)


def _said(exc: openai.APIError) -> str:
    """The server's own error message (OpenAI's body), else the client's."""
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return str(exc)


def first_errors(records: list[RequestRecord]) -> dict[str, str]:
    """The first failure of each kind, with what was said about it: why requests failed, not just how many."""
    out: dict[str, str] = {}
    for r in records:
        if not r.ok and r.error not in out:
            out[r.error] = r.detail or ""
    return out


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(1000 * seconds, 1)


def write_loadtest(report: LoadTestReport, out, plots: bool = True) -> list:
    """DIR/loadtest.json (the report with its timeline) and, with matplotlib, loadtest.png: the server's
    RSS and each request's TTFT and latency over the run. The paths written."""
    from pathlib import Path

    from ..io import write_json_atomic

    out = Path(out)
    written = [out / "loadtest.json"]
    write_json_atomic(written[0], report.to_dict(), indent=2)
    if plots and plot_loadtest(report, out / "loadtest.png"):
        written.append(out / "loadtest.png")
    return written


def plot_loadtest(report: LoadTestReport, path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (rss, lat) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    if report.rss_mb:
        rss.plot([t for t, _ in report.rss_mb], [mb for _, mb in report.rss_mb], color="C0")
    rss.set_ylabel("server RSS (MB)")
    rss.set_title(f"{report.concurrency} clients, {report.requests} requests, {report.tokens_per_s:.1f} tok/s")
    rows = [r for r in report.timeline if r[2] is not None]
    lat.scatter([r[0] for r in rows], [r[2] / 1000 for r in rows], s=6, color="C1", label="request latency")
    rows = [r for r in report.timeline if r[1] is not None]
    lat.scatter([r[0] for r in rows], [r[1] / 1000 for r in rows], s=6, color="C2", label="TTFT")
    lat.set_ylabel("seconds")
    lat.set_xlabel("request start (s since the test began)")
    lat.legend()
    for ax in (rss, lat):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


def _retry_after(response) -> float:
    try:
        return max(0.05, min(10.0, float(response.headers.get("retry-after", "0.5"))))
    except (TypeError, ValueError):
        return 0.5


def run_loadtest(cfg: LoadTestConfig) -> LoadTestReport:
    return asyncio.run(LoadTest(cfg).run())
