"""The OpenAI-compatible server, driven as users drive it: the official `openai` client and raw HTTP
against a real uvicorn server on a free 127.0.0.1 port, over the batched engine and a tiny target
with a real (character-level) tokenizer. SIGTERM is tested on a `dominospec serve` subprocess."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from conftest import paced_engine, serving, tiny_chat_target
from prometheus_client.parser import text_string_to_metric_families

import dominospec
from dominospec.bench.loadtest import LoadTestConfig, check_loopback, percentiles, run_loadtest
from dominospec.decode import generate_autoregressive
from dominospec.engine import Engine
from dominospec.sampling import SamplingConfig
from dominospec.serve import ServeConfig, free_port
from dominospec.serve.text import TextStream

SRC = Path(dominospec.__file__).resolve().parents[1]  # the subprocess imports the package under test
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
PAUSE = 0.01  # seconds before each engine step, where a test must act while a request runs


@contextlib.contextmanager
def running_server(target, pause: float = 0.0, request_timeout: float = 30.0, api_key=None, **engine_kw):
    """A server in a thread on a free loopback port; yields (base URL, engine); stopped on exit.
    pause > 0: the engine sleeps that long before every step (see paced_engine)."""
    engine = paced_engine(target, pause, **engine_kw) if pause else Engine(target, **engine_kw)
    config = ServeConfig(model_name=target.name, api_key=api_key, request_timeout=request_timeout)
    with serving(engine, target, config) as base:
        yield base, engine


def client(base: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)


def wait_for(condition, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def metric(base: str, name: str, labels: dict | None = None, headers=None) -> float | None:
    text = httpx.get(f"{base}/metrics", headers=headers).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in (labels or {}).items()):
                return s.value
    return None


@pytest.fixture(scope="module")
def target():
    return tiny_chat_target(dtype=torch.float64)


@pytest.fixture(scope="module")
def server(target):
    """One shared server; its engine counts submissions, so tests can see what reached it."""
    with running_server(target, max_batch=4, max_queue=16) as (base, engine):
        submitted = []
        submit = engine.submit

        def counting_submit(req):
            submitted.append(req)
            return submit(req)

        engine.submit = counting_submit
        yield base, engine, submitted


def offline(target, prompt_ids, max_tokens, **kw) -> list[int]:
    return generate_autoregressive(target, prompt_ids, max_tokens, SamplingConfig(), 0, **kw).tokens


# ----- text: incremental detokenization and stop strings (no server) -----


def byte_decode(ids) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def feed(stream: TextStream, ids) -> list[str]:
    return [stream.add(t) for t in ids] + [stream.finish()]


def test_text_stream_never_releases_half_a_character():
    data = "añ€😀b".encode()
    pieces = feed(TextStream(byte_decode), data)
    assert "".join(pieces) == "añ€😀b"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[1:3] == ["", "ñ"]  # the first byte of ñ alone is held back


def test_text_stream_cuts_at_a_stop_string_split_across_tokens():
    s = TextStream(byte_decode, stops=["STOP"])
    pieces = feed(s, b"abcSTOPdef")
    assert "".join(pieces) == "abc" and s.stopped
    assert s.tokens == 7  # consumed up to the token that completed the stop string
    assert pieces[3:6] == ["", "", ""]  # "S", "ST", "STO" could begin the stop string: held


def test_text_stream_releases_a_held_prefix_that_turns_out_not_to_stop():
    s = TextStream(byte_decode, stops=["STOP"])
    pieces = feed(s, b"aSTx")
    assert pieces == ["a", "", "", "STx", ""] and not s.stopped


def test_text_stream_earliest_of_several_stop_strings_wins():
    s = TextStream(byte_decode, stops=["cd", "b"])
    assert "".join(feed(s, b"abcd")) == "a"


# ----- the endpoints -----


def test_chat_completion_at_temperature_zero_equals_offline_generation(server, target):
    base, _, _ = server
    prompt_ids = target.encode_chat(MESSAGES)
    tokens = offline(target, prompt_ids, 24)
    r = client(base).chat.completions.create(model=target.name, messages=MESSAGES, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == target.decode(tokens)
    assert r.choices[0].finish_reason == ("stop" if tokens[-1] in target.eos_ids else "length")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), len(tokens))
    assert r.usage.total_tokens == len(prompt_ids) + len(tokens)


def test_streamed_chat_has_openai_chunks_and_the_same_text(server, target):
    base, _, _ = server
    whole = client(base).chat.completions.create(model=target.name, messages=MESSAGES, max_tokens=24, temperature=0)
    chunks = list(
        client(base).chat.completions.create(
            model=target.name,
            messages=MESSAGES,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()


def test_raw_event_stream_ends_with_done(server, target):
    base, _, _ = server
    body = {"model": target.name, "prompt": "abc", "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "text_completion"


def test_text_completion_equals_offline_generation_streamed_or_not(server, target):
    base, _, _ = server
    prompt = "Once upon a time"
    tokens = offline(target, target.encode_raw(prompt), 20)
    c = client(base)
    r = c.completions.create(model=target.name, prompt=prompt, max_tokens=20, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == target.decode(tokens)
    assert r.usage.completion_tokens == len(tokens)
    streamed = c.completions.create(model=target.name, prompt=prompt, max_tokens=20, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == r.choices[0].text
    by_ids = c.completions.create(model=target.name, prompt=target.encode_raw(prompt), max_tokens=20, temperature=0)
    assert by_ids.choices[0].text == r.choices[0].text


def test_stop_string_cuts_the_text_and_the_count(server, target):
    base, _, _ = server
    prompt_ids = target.encode_chat(MESSAGES)
    tokens = offline(target, prompt_ids, 40, eos_ids=[])
    full = target.decode(tokens)
    # a stop string that first appears after a few characters (so the cut is not vacuous)
    at = next(i for i in range(3, len(full) - 2) if full.find(full[i : i + 2]) == i)
    stop = full[at : at + 2]
    used = next(n for n in range(1, len(tokens) + 1) if stop in target.decode(tokens[:n]))
    c = client(base)
    kw = dict(model=target.name, messages=MESSAGES, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    plain = c.chat.completions.create(**kw)
    assert plain.choices[0].message.content == full  # control: without stop, the stop string is in the text
    r = c.chat.completions.create(stop=[stop, "\x00never"], **kw)
    assert r.choices[0].message.content == full[:at] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == used
    chunks = list(c.chat.completions.create(stop=stop, stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == full[:at]


def test_same_seed_same_sample(server, target):
    base, _, _ = server
    c = client(base)
    kw = dict(model=target.name, messages=MESSAGES, max_tokens=16, temperature=1.0, top_p=0.95)
    texts = [c.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (7, 7, 8, 9)]
    assert texts[0] == texts[1]
    assert len(set(texts)) > 1  # control: the seed matters


def test_chat_template_kwargs_reach_the_template():
    target = tiny_chat_target(dtype=torch.float64)
    target.tokenizer.chat_template = "{{ greeting | default('none') }}: {{ messages[0]['content'] }}"
    with running_server(target, max_batch=1) as (base, _):
        c = client(base)
        kw = dict(model=target.name, messages=MESSAGES, max_tokens=1, temperature=0)
        assert c.chat.completions.create(**kw).usage.prompt_tokens == len("none: " + MESSAGES[0]["content"])
        r = c.chat.completions.create(extra_body={"chat_template_kwargs": {"greeting": "hello!"}}, **kw)
        assert r.usage.prompt_tokens == len("hello!: " + MESSAGES[0]["content"])


def test_models_health_and_metrics(server, target):
    base, _, _ = server
    assert [m.id for m in client(base).models.list()] == [target.name]
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    client(base).chat.completions.create(model=target.name, messages=MESSAGES, max_tokens=4)
    httpx.post(f"{base}/v1/chat/completions", content=b"{", headers={"Content-Type": "application/json"})
    text = httpx.get(f"{base}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    statuses = {s.labels["status"] for s in families["dominospec_http_requests"].samples if s.name.endswith("_total")}
    assert {"200", "400"} <= statuses
    for name in (
        "dominospec_queue_depth",
        "dominospec_active_rows",
        "dominospec_tau",
        "dominospec_acceptance_by_position",
        "dominospec_time_to_first_token_seconds",
        "dominospec_time_per_output_token_seconds",
        "process_resident_memory_bytes",
    ):
        assert name in families, name
    assert metric(base, "dominospec_prompt_tokens_total") > 0
    assert metric(base, "dominospec_completion_tokens_total") > 0
    assert metric(base, "dominospec_time_to_first_token_seconds_count") > 0


# ----- bad input -----

GOOD = {"messages": MESSAGES, "max_tokens": 4}
BAD_BODIES = {
    "malformed JSON": (b'{"messages": [', 400, "invalid_json"),
    "not an object": (b"[1, 2]", 400, None),
    "wrong type": ({**GOOD, "temperature": "hot"}, 400, "temperature"),
    "string for a number": ({**GOOD, "max_tokens": "4"}, 400, "max_tokens"),
    "NaN": (b'{"messages": [{"role": "user", "content": "hi"}], "top_p": NaN}', 400, "top_p"),
    "infinity": (b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}', 400, "temperature"),
    "negative max_tokens": ({**GOOD, "max_tokens": -1}, 400, "max_tokens"),
    "negative temperature": ({**GOOD, "temperature": -0.5}, 400, "temperature"),
    "negative seed": ({**GOOD, "seed": -3}, 400, "seed"),
    "top_p zero": ({**GOOD, "top_p": 0}, 400, "top_p"),
    "no messages": ({"messages": []}, 400, "messages"),
    "unknown role": ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    "image part": (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content",
    ),
    "n > 1": ({**GOOD, "n": 2}, 400, "unsupported_parameter"),
    "logprobs": ({**GOOD, "logprobs": True}, 400, "unsupported_parameter"),
    "tools": ({**GOOD, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "unsupported_parameter"),
    "json mode": ({**GOOD, "response_format": {"type": "json_object"}}, 400, "unsupported_parameter"),
    "empty stop": ({**GOOD, "stop": [""]}, 400, "stop"),
    "unknown model": ({**GOOD, "model": "gpt-17"}, 404, "model_not_found"),
    "too long for the context": ({**GOOD, "max_tokens": 100000}, 400, "context_length_exceeded"),
    "oversized body": ({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}, 413, "body_too_large"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_bad_chat_request_gets_its_status_and_an_openai_error_body(server, case):
    base, _, submitted = server
    body, status, where = BAD_BODIES[case]
    before = len(submitted)
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{base}/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert where in (err["param"], err["code"]), err
    assert len(submitted) == before  # refused before it reached the engine


def test_prompt_too_long_names_the_token_counts(server, target):
    base, engine, _ = server
    long_prompt = "ab" * engine.max_len
    r = httpx.post(f"{base}/v1/completions", json={"prompt": long_prompt, "max_tokens": 4})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert str(len(target.encode_raw(long_prompt))) in msg and "context" in msg
    with pytest.raises(openai.BadRequestError, match="context"):
        client(base).completions.create(model=target.name, prompt="abc", max_tokens=engine.max_len)


def test_bad_completion_requests(server, target):
    base, _, _ = server
    for body, param in (
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1, 2, 10**6]}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": "a", "echo": True}, "echo"),
        ({"prompt": "a", "best_of": 3}, "best_of"),
        ({"prompt": 5}, "prompt"),
    ):
        r = httpx.post(f"{base}/v1/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_unknown_route_and_method_get_openai_errors(server):
    base, _, _ = server
    r = httpx.get(f"{base}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{base}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


# ----- load and faults -----


@pytest.mark.slow
def test_full_queue_gives_429_with_retry_after(target):
    with running_server(target, PAUSE, max_batch=1, max_queue=1) as (base, engine):
        long = dict(model=target.name, messages=MESSAGES, max_tokens=300, extra_body={"ignore_eos": True})
        running = client(base).chat.completions.create(stream=True, **long)
        next(iter(running))
        wait_for(lambda: engine.stats()["active_rows"] == 1, what="the first request to hold the only slot")
        waiting = threading.Thread(target=lambda: client(base).chat.completions.create(**long), daemon=True)
        waiting.start()
        wait_for(lambda: engine.stats()["queue_depth"] == 1, what="a queued request")
        r = httpx.post(f"{base}/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        running.close()
        waiting.join(timeout=60)


def record_results(engine) -> list:
    """Wrap engine.submit so that every request's RequestResult is also appended to the returned list."""
    results, submit = [], engine.submit

    def recording_submit(req):
        finish = req.on_finish

        def on_finish(result):
            results.append(result)
            finish(result)

        req.on_finish = on_finish
        return submit(req)

    engine.submit = recording_submit
    return results


@pytest.mark.slow
def test_client_disconnect_frees_the_slot(target):
    with running_server(target, PAUSE, max_batch=1, max_queue=4) as (base, engine):
        results = record_results(engine)
        long = {"messages": MESSAGES, "max_tokens": 450, "ignore_eos": True}
        # a stream whose client leaves after the first chunk
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={**long, "stream": True}, timeout=60) as r:
            next(r.iter_lines())
        # a plain request whose client gives up while it is decoding
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/chat/completions", json=long, timeout=0.5)
        # the next request is admitted and finishes; the two abandoned ones were cancelled, not run out
        short = {"messages": MESSAGES, "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/chat/completions", json=short, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        assert [x.finish_reason for x in results] == ["cancelled", "cancelled", "length"]
        assert all(len(x.tokens) < 450 for x in results)
        assert metric(base, "dominospec_generations_total", {"finish_reason": "disconnected"}) == 2
        assert engine.stats()["active_rows"] == 0


@pytest.mark.slow
def test_request_time_limit_cancels_and_reports(target):
    with running_server(target, PAUSE, request_timeout=0.5, max_batch=1) as (base, engine):
        long = {"messages": MESSAGES, "max_tokens": 400, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/chat/completions", json=long, timeout=60)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        with pytest.raises(openai.APIError, match="time limit"):
            for _ in client(base).chat.completions.create(model=target.name, stream=True, **_openai_kw(long)):
                pass
        wait_for(lambda: engine.stats()["active_rows"] == 0, what="the slot to be freed")


def _openai_kw(body: dict) -> dict:
    return {"messages": body["messages"], "max_tokens": body["max_tokens"], "extra_body": {"ignore_eos": True}}


def test_api_key_is_required_everywhere_but_health(target):
    with running_server(target, max_batch=1, api_key="s3cret") as (base, _):
        assert httpx.get(f"{base}/health").status_code == 200
        for path in ("/v1/models", "/metrics"):
            assert httpx.get(f"{base}{path}").status_code == 401
            assert httpx.get(f"{base}{path}", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert httpx.get(f"{base}{path}", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        r = httpx.post(f"{base}/v1/chat/completions", json=GOOD)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(base, key="wrong").chat.completions.create(model=target.name, messages=MESSAGES, max_tokens=2)
        r = client(base, key="s3cret").chat.completions.create(model=target.name, messages=MESSAGES, max_tokens=2)
        assert r.usage.completion_tokens >= 1


DRAIN_SERVER = """
import sys
sys.path.insert(0, {tests!r})
from conftest import paced_engine, serving, tiny_chat_target
from dominospec.serve import ServeConfig, make_server
target = tiny_chat_target()
engine = paced_engine(target, {pause}, max_batch=1)
make_server(engine, target, ServeConfig(model_name=target.name), port={port}).run()
print("returned from run")
"""


@contextlib.contextmanager
def server_process(cmd: list[str], port: int, log_path: Path):
    """A server subprocess; yields (process, base URL) once /health answers; killed if still alive at exit."""
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_for(lambda: _healthy(base) or proc.poll() is not None, timeout=120, what="the server")
            assert proc.poll() is None, log_path.read_text()
            yield proc, base
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
def test_sigterm_drains_running_requests_refuses_new_ones_and_exits_zero(tmp_path):
    port, pause, n = free_port(), 0.02, 200  # the running request needs >= n * pause = 4 s
    script = DRAIN_SERVER.format(tests=str(Path(__file__).parent), pause=pause, port=port)
    with server_process([sys.executable, "-c", script], port, tmp_path / "log") as (proc, base):
        body = {"messages": MESSAGES, "max_tokens": n, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            lines = (json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {"))
            next(x for x in lines if x["choices"] and x["choices"][0]["delta"].get("content"))
            proc.send_signal(signal.SIGTERM)
            wait_for(lambda: httpx.get(f"{base}/health").status_code == 503, what="draining")
            refused = httpx.post(f"{base}/v1/chat/completions", json=GOOD)
            assert refused.status_code == 503 and "retry-after" in refused.headers
            assert refused.json()["error"]["code"] == "draining"
            rest = list(lines)
        assert rest[-2]["choices"][0]["finish_reason"] == "length"  # the running request ran to its end
        assert rest[-1]["usage"]["completion_tokens"] == n
        assert proc.wait(timeout=60) == 0
    assert "returned from run" in (tmp_path / "log").read_text()


@pytest.mark.slow
def test_cli_serve_answers_and_exits_zero_on_sigterm(tmp_path):
    model_dir = tmp_path / "tiny-chat"
    saved = tiny_chat_target()
    saved.model.save_pretrained(model_dir)
    saved.tokenizer.save_pretrained(model_dir)
    port = free_port()
    cmd = [sys.executable, "-m", "dominospec.cli", "serve", "--target", str(model_dir), "--drafter", "none"]
    cmd += ["--port", str(port), "--max-batch", "2", "--threads", "1"]
    with server_process(cmd, port, tmp_path / "log") as (proc, base):
        c = client(base)
        [model] = [m.id for m in c.models.list()]
        r = c.completions.create(model=model, prompt="Hello", max_tokens=5, temperature=0)
        assert r.usage.completion_tokens >= 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    assert "serve: stopped" in (tmp_path / "log").read_text()


def _healthy(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# ----- the load test -----


def test_loadtest_refuses_other_machines_and_computes_percentiles():
    from dominospec.errors import DominoError

    assert check_loopback("http://127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert check_loopback("http://localhost:1") and check_loopback("http://[::1]:1")
    for url in ("http://example.com:8000", "http://10.0.0.2:8000", "ftp://127.0.0.1"):
        with pytest.raises(DominoError):
            check_loopback(url)
    assert percentiles(list(range(1, 101))) == {"p50": 50, "p90": 90, "p99": 99}
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None}


@pytest.mark.slow
def test_loadtest_with_fault_round_loses_no_client_request(target):
    with running_server(target, max_batch=2, max_queue=4) as (base, _):
        cfg = LoadTestConfig(
            url=base,
            prompts=["Hello there.", "What is the sea?"],
            concurrency=2,
            duration_s=3.0,
            max_tokens=16,
            fault_round=True,
            server_pid=os.getpid(),
            rss_every_s=0.5,
        )
        report = run_loadtest(cfg)
    assert report.requests > 0 and report.errors == {}, report.table()
    assert report.tokens > 0 and report.ttft_ms["p50"] is not None and report.rss_mb
    assert set(report.faults) == {"disconnect", "malformed", "burst"}
    assert all(v == "ok" for v in report.faults["malformed"].values()), report.faults
    burst = report.faults["burst"]
    assert burst.get("status_429", 0) > 0 and set(burst) <= {"status_200", "status_429"}, burst


def test_cli_serve_and_loadtest_check_flags_before_loading(capsys):
    from dominospec.cli import main

    assert main(["serve", "--max-batch", "0"]) == 2
    assert "--max-batch must be at least 1" in capsys.readouterr().err
    assert main(["loadtest", "--url", "http://example.com:8000"]) == 2
    assert "this machine" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.integration
def test_bundled_target_with_its_shipped_drafter_serves_plain_greedy_text():
    """The real chat template and tokenizer (byte-level BPE), speculative decoding in the engine, fp32."""
    from dominospec import Drafter, Target
    from dominospec.drafter import shipped_drafter_dir

    smollm = Target.load("smollm2-135m", device="cpu", dtype="float32")
    drafter = Drafter.from_pretrained(shipped_drafter_dir("smollm2-135m"), target=smollm)
    question = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    expected = smollm.decode(offline(smollm, smollm.encode_chat(question), 40))
    with running_server(smollm, drafter=drafter, policy="fixed", max_batch=2) as (base, engine):
        c = client(base)
        kw = dict(model=smollm.name, messages=question, max_tokens=40, temperature=0)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(stream=True, **kw))
        assert streamed == expected
        assert c.chat.completions.create(**kw).choices[0].message.content == expected
        assert engine.stats()["tau"] > 1  # drafts were accepted: the speculative path ran
