"""Reliability, third round (issue 34): an export never deletes what it did not write, one client never
breaks another, and every bad input gets a named refusal.

CLI tests use the tiny character-level Llama of conftest (64 positions); engine and server tests the
tiny chat target with a real character tokenizer.
"""

import contextlib
import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import (
    init_char_drafter,
    run_cli,
    save_char_model,
    serving,
    tiny_chat_target,
    tiny_drafter,
    tiny_target,
    write_prompts,
)

from dominospec import SamplingConfig, cli
from dominospec.engine import EngineRequest

CONTEXT = 64
NOWHERE = "/nonexistent/target-that-must-not-load"  # an argument error must be reported before this loads


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reliability3")


@pytest.fixture(scope="module")
def char_model(shared_dir) -> Path:
    return save_char_model(shared_dir / "char-model", CONTEXT)


@pytest.fixture(scope="module")
def drafter_dir(char_model, shared_dir) -> Path:
    return init_char_drafter(char_model, shared_dir / "drafter")


# ----- Critical 1: an export never deletes what it did not write -----


def export_args(drafter, out, *extra) -> list:
    return ["export", drafter, "--to", "sglang", "--out", out, *extra]


def user_folder(path: Path) -> dict[str, bytes]:
    """A folder of the user's: notes, a sub-folder and a .git; returns what it holds, by relative path."""
    (path / ".git" / "objects").mkdir(parents=True)
    (path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (path / "notes.md").write_text("my notes\n")
    (path / "runs").mkdir()
    (path / "runs" / "log.txt").write_text("keep me\n")
    return snapshot(path)


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_export_into_a_folder_with_an_earlier_export_keeps_the_users_files(drafter_dir, tmp_path, capsys):
    """Protects: an export replaces only the files an earlier export's report lists (issue 34, 1)."""
    out = tmp_path / "out"
    assert run_cli(capsys, *export_args(drafter_dir, out))[0] == 0
    mine = user_folder(out)
    rc, err = run_cli(capsys, *export_args(drafter_dir, out))
    assert rc == 0, err
    after = snapshot(out)
    for name, data in mine.items():
        if not name.startswith(("config.json", "model.safetensors", "export_report.json")):
            assert after.get(name) == data, name
    assert {"config.json", "model.safetensors", "export_report.json"} <= set(after)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporary left beside it


def test_export_refuses_a_report_copied_beside_files_it_did_not_write(drafter_dir, tmp_path, capsys):
    """A copied export_report.json does not make a folder's own config.json/model.safetensors the export's."""
    out = tmp_path / "out"
    assert run_cli(capsys, *export_args(drafter_dir, out))[0] == 0
    mine = tmp_path / "mine"
    shutil.copytree(drafter_dir, mine)
    user_folder(mine)
    shutil.copy(out / "export_report.json", mine / "export_report.json")
    report = json.loads((mine / "export_report.json").read_text())
    report["files"] = ["export_report.json"]  # an export that wrote only its report
    (mine / "export_report.json").write_text(json.dumps(report))
    before = snapshot(mine)
    rc, err = run_cli(capsys, *export_args(drafter_dir, mine))
    assert rc == 2 and "did not write" in err and "config.json" in err, err
    assert snapshot(mine) == before


def test_export_refuses_the_drafter_itself_and_its_ancestors(drafter_dir, tmp_path, capsys):
    """Protects: --out equal to the source drafter (a report copied there) or a folder above it is refused."""
    src = tmp_path / "work" / "drafter"
    shutil.copytree(drafter_dir, src)
    user_folder(tmp_path / "work")
    assert run_cli(capsys, *export_args(src, tmp_path / "e"))[0] == 0
    shutil.copy(tmp_path / "e" / "export_report.json", src / "export_report.json")
    before = snapshot(tmp_path / "work")
    for out, words in ((src, "is the source drafter"), (tmp_path / "work", "holds the source drafter")):
        rc, err = run_cli(capsys, *export_args(src, out))
        assert rc == 2 and words in err, err
    assert snapshot(tmp_path / "work") == before


def test_export_refuses_the_current_directory(drafter_dir, tmp_path, capsys, monkeypatch):
    """Protects: `--out .` (even holding an earlier export's report) is refused and nothing is removed."""
    out = tmp_path / "here"
    assert run_cli(capsys, *export_args(drafter_dir, out))[0] == 0
    user_folder(out)
    before = snapshot(out)
    monkeypatch.chdir(out)
    for arg in (".", str(out), str(tmp_path)):
        rc, err = run_cli(capsys, *export_args(drafter_dir, arg))
        assert rc == 2 and "the current directory" in err, err
    assert snapshot(out) == before


def test_export_checks_a_read_only_out_before_loading_the_target(drafter_dir, tmp_path, capsys, monkeypatch):
    """Protects: an unwritable --out (here an empty read-only mount point) is named before the target loads."""
    from dominospec import Target

    def no_load(*a, **k):
        raise AssertionError("the target loaded before --out was checked")

    ro = tmp_path / "mnt"
    ro.mkdir()
    write_bytes = Path.write_bytes

    def read_only_mount(path, data):  # root ignores mode bits: fail writes under ro as a read-only mount does
        if path.parent == ro:
            raise OSError(30, "Read-only file system")
        return write_bytes(path, data)

    monkeypatch.setattr(Target, "load", no_load)
    monkeypatch.setattr(Path, "write_bytes", read_only_mount)
    rc, err = run_cli(capsys, *export_args(drafter_dir, ro))
    assert rc == 2 and f"--out {ro} is not writable (Read-only file system)" in err, err


# ----- Critical 2: one request never fails the others in its batch -----


@pytest.fixture(scope="module")
def native_target():
    return tiny_target("llama", backend="native")


@pytest.fixture(scope="module")
def drafter(native_target):
    return tiny_drafter(native_target, block_size=4)


def engine_for(kind, target, drafter):
    from dominospec.engine import Engine

    if kind == "plain":
        return Engine(target, max_batch=4)
    if kind == "lookup":
        return Engine(target, lookup=True, policy="fixed", max_batch=4)
    return Engine(target, drafter, policy="fixed", max_batch=4)


BYSTANDER = ([5, 9, 11, 2, 7, 8], 24, SamplingConfig(1.0, top_p=0.9), 7)  # prompt, budget, sampling, seed


def run_together(engine, requests) -> list:
    """Submit every (prompt, budget, sampling, seed) before the first step: they share each batch."""
    handles = [engine.submit(EngineRequest(p, n, s, seed=seed, eos_ids=[])) for p, n, s, seed in requests]
    engine.run_until_idle()
    return [h.wait(0) for h in handles]


@pytest.mark.parametrize("kind", ["plain", "fixed"])
@pytest.mark.parametrize(
    "poison", [dict(temperature=1e-300), dict(temperature=5e-324), dict(temperature=1.0, top_p=1e-300)]
)
def test_a_poisoned_request_neither_fails_nor_changes_its_batch_mate(kind, poison, native_target, drafter):
    """Protects: temperature 1e-300 / 5e-324 or top_p 1e-300 is greedy; the bystander is complete and equal
    to its solo answer (issue 34, 2)."""
    solo = run_together(engine_for(kind, native_target, drafter), [BYSTANDER])[0]
    poisoned = ([1, 2, 3], 24, SamplingConfig(**poison), 3)
    mate, bad = run_together(engine_for(kind, native_target, drafter), [BYSTANDER, poisoned])
    assert mate.finish_reason == "length" and mate.error is None
    assert mate.tokens == solo.tokens and len(solo.tokens) == 24
    greedy = run_together(engine_for(kind, native_target, drafter), [([1, 2, 3], 24, SamplingConfig(), 0)])[0]
    assert bad.finish_reason == "length" and bad.tokens == greedy.tokens  # as greedy as temperature 0


@pytest.mark.parametrize("kind", ["plain", "lookup"])
def test_a_row_whose_sampling_fails_ends_alone_with_an_error(kind, native_target, drafter):
    """Protects: a sampling failure in one row (here NaN probabilities) ends that row with an error;
    the others go on to their solo answers."""
    solo = run_together(engine_for(kind, native_target, drafter), [BYSTANDER])[0]
    broken = SamplingConfig(1.0)
    object.__setattr__(broken, "temperature", float("nan"))  # past every check: warp_probs gives NaN
    mate, bad = run_together(engine_for(kind, native_target, drafter), [BYSTANDER, ([1, 2, 3], 24, broken, 3)])
    assert bad.finish_reason == "error" and "sampling failed" in bad.error
    assert mate.finish_reason == "length" and mate.tokens == solo.tokens


def test_tiny_temperatures_are_greedy_in_the_sampling_config():
    """The one rule: a temperature or top_p so small that float32 cannot divide by it is greedy."""
    for s in (SamplingConfig(1e-300), SamplingConfig(5e-324), SamplingConfig(1.0, top_p=1e-300)):
        assert s.greedy
    assert not SamplingConfig(1e-3).greedy and not SamplingConfig(1.0, top_p=1e-3).greedy


# ----- High: named refusals before the model loads -----


def test_serve_refuses_a_port_out_of_range_before_loading(capsys):
    rc, err = run_cli(capsys, "serve", "--target", NOWHERE, "--port", "70000")
    assert rc == 2 and "--port must be in 1..65535, got 70000" in err, err


def test_serve_names_a_busy_port_and_a_bad_host_before_loading(capsys):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, err = run_cli(capsys, "serve", "--target", NOWHERE, "--port", port)
    assert rc == 2 and f"--port {port}: cannot listen there (in use)" in err, err
    rc, err = run_cli(capsys, "serve", "--target", NOWHERE, "--host", "no-such-host.invalid")
    assert rc == 2 and "--host 'no-such-host.invalid': not an address" in err, err
    rc, err = run_cli(capsys, "serve", "--target", NOWHERE, "--host", "192.0.2.1")  # TEST-NET: not ours
    assert rc == 2 and "--host 192.0.2.1 --port 8000: cannot listen there" in err, err


def test_serve_refuses_more_slots_than_memory_holds_saying_what_fits(char_model, capsys, monkeypatch):
    """Protects: --max-batch x --max-len is checked against free memory before the caches are allocated."""
    import dominospec.engine.memory as memory
    from dominospec.targets.native import KVCache

    def no_allocation(*a, **k):
        raise AssertionError("the slot caches were allocated before the check")

    monkeypatch.setattr(memory, "available_bytes", lambda device: 64 << 20)
    monkeypatch.setattr(KVCache, "_allocate", no_allocation)
    rc, err = run_cli(capsys, "serve", "--target", char_model, "--drafter", "none", "--max-batch", "100000")
    assert rc == 2 and "max_batch 100000 slots of 64 positions need" in err and "slots of 64 positions fit" in err, err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--max-len", "1"], "--max-len must be at least 3, got 1"),
        (["--max-len", "5", "--block-size", "4"], "--max-len 5 leaves no room for a request"),
        (["--api-key", " s3cret "], "--api-key has leading or trailing whitespace"),
        (["--api-key", "sécret"], "--api-key holds 'é'"),
        (["--served-model-name", " "], "--served-model-name is empty"),
    ],
)
def test_serve_configurations_that_can_serve_nothing_are_refused(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("DOMINOSPEC_API_KEY", raising=False)
    rc, err = run_cli(capsys, "serve", "--target", NOWHERE, *argv)
    assert rc == 2 and message in err, err


def test_an_empty_api_key_variable_is_named(capsys, monkeypatch):
    monkeypatch.setenv("DOMINOSPEC_API_KEY", "")
    rc, err = run_cli(capsys, "serve", "--target", NOWHERE)
    assert rc == 2 and "DOMINOSPEC_API_KEY is empty" in err, err


def test_the_served_model_name_is_the_directorys_base_name():
    from dominospec.cli.serve import served_name

    assert served_name(str(Path(__file__).parent)) == "tests"
    assert served_name("smollm2-135m") == "smollm2-135m"


# ----- the server: cross-site requests, slow bodies, large prompts, stop strings -----


@contextlib.contextmanager
def live_server(target, drafter=None, policy: str = "plain", **config_kw):
    """A server over a batched engine in a thread on a free loopback port; yields its base URL."""
    from dominospec.engine import Engine
    from dominospec.serve import ServeConfig

    engine = Engine(target, drafter, policy=policy, max_batch=4, max_queue=32)
    with serving(engine, target, ServeConfig(model_name=target.name, request_timeout=60, **config_kw)) as base:
        yield base


@pytest.fixture(scope="module")
def chat_target():
    return tiny_chat_target(dtype=torch.float32)


@pytest.fixture(scope="module")
def local_server(chat_target):
    from dominospec.serve import LOOPBACK_HOSTS

    with live_server(chat_target, allowed_hosts=LOOPBACK_HOSTS, body_timeout_s=1.0) as base:
        yield base


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def assert_openai_error(r, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_a_cross_site_simple_post_is_refused(local_server):
    """Protects: a text/plain body (a web page's "simple" request) gets 415, not an answer (issue 34, Medium)."""
    r = httpx.post(
        f"{local_server}/v1/chat/completions", content=json.dumps(CHAT), headers={"Content-Type": "text/plain"}
    )
    assert_openai_error(r, 415, "unsupported_media_type")
    assert httpx.post(f"{local_server}/v1/chat/completions", json=CHAT, timeout=60).status_code == 200


def test_a_foreign_origin_and_a_rebound_host_name_are_refused(local_server):
    """Protects: a page on another site, or one whose DNS name was rebound to 127.0.0.1, cannot use a local server."""
    url = f"{local_server}/v1/chat/completions"
    r = httpx.post(url, json=CHAT, headers={"Origin": "https://evil.example"})
    assert_openai_error(r, 403, "forbidden_origin")
    r = httpx.post(url, json=CHAT, headers={"Host": "evil.example:8000"})
    assert_openai_error(r, 403, "forbidden_origin")
    r = httpx.get(f"{local_server}/v1/models", headers={"Host": "evil.example"})
    assert_openai_error(r, 403, "forbidden_origin")
    port = local_server.rsplit(":", 1)[1]
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):  # the server's own page
        assert httpx.post(url, json=CHAT, headers={"Origin": origin}, timeout=60).status_code == 200
    assert httpx.post(url, json=CHAT, headers={"Host": f"localhost:{port}"}, timeout=60).status_code == 200


def test_a_server_bound_to_a_public_address_answers_any_host(chat_target):
    with live_server(chat_target, allowed_hosts=None) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers={"Host": "my-server.example"}, timeout=60)
        assert r.status_code == 200, r.text
        r = httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers={"Origin": "https://evil.example"})
        assert_openai_error(r, 403, "forbidden_origin")


def test_a_body_that_never_finishes_is_cut_off(local_server):
    """Protects: a client that sends part of its body holds its connection only for the body timeout."""
    import socket

    host, port = "127.0.0.1", int(local_server.rsplit(":", 1)[1])
    with socket.create_connection((host, port), timeout=10) as s:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 100\r\n\r\n{"
        )
        s.sendall(head.encode())
        reply = b""
        while b"body_timeout" not in reply and (chunk := s.recv(4096)):
            reply += chunk
        reply = reply.decode()
    assert reply.startswith("HTTP/1.1 408") and "body_timeout" in reply, reply


def test_a_prompt_too_long_by_characters_is_refused_without_tokenizing(chat_target, local_server, monkeypatch):
    """Protects: a 900 KB prompt is refused by its character count; the tokenizer and template never run."""
    calls = []
    monkeypatch.setattr(chat_target, "encode_chat", lambda *a, **k: calls.append(a) or [1])
    monkeypatch.setattr(chat_target, "encode_raw", lambda *a, **k: calls.append(a) or [1])
    big = "x" * 900_000
    r = httpx.post(f"{local_server}/v1/chat/completions", json={"messages": [{"role": "user", "content": big}]})
    assert "900000 characters" in assert_openai_error(r, 400, "context_length_exceeded")["message"]
    r = httpx.post(f"{local_server}/v1/completions", json={"prompt": big})
    assert_openai_error(r, 400, "context_length_exceeded")
    assert not calls


@pytest.mark.parametrize("route,body", [("chat/completions", CHAT), ("completions", {"prompt": "hi", "max_tokens": 4})])
def test_tokenizing_runs_off_the_event_loop(route, body, chat_target, local_server, monkeypatch):
    """Protects: while one prompt is being tokenized (templated), /health and other requests are answered."""
    entered, release = threading.Event(), threading.Event()
    name = "encode_chat" if route.startswith("chat") else "encode_raw"
    real = getattr(chat_target, name)

    def slow_encode(*a, **k):
        entered.set()
        release.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(chat_target, name, slow_encode)
    done = []
    slow = threading.Thread(
        target=lambda: done.append(httpx.post(f"{local_server}/v1/{route}", json=body, timeout=60).status_code)
    )
    slow.start()
    try:
        assert entered.wait(10)
        assert httpx.get(f"{local_server}/health", timeout=2).status_code == 200
    finally:
        release.set()
        slow.join(60)
    assert done == [200]


def test_long_stop_strings_are_refused(local_server):
    """Protects: a stop string is capped in length (what a stream holds back is bounded)."""
    r = httpx.post(f"{local_server}/v1/chat/completions", json={**CHAT, "stop": ["x" * 100_000] * 8})
    assert "at most 512" in assert_openai_error(r, 400)["message"]


def naive_release(text: str, stops: list[str]) -> tuple[str, int]:
    """(text cut at the first stop string, characters at its end that could begin one): the definition."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    if hits:
        return text[: min(hits)], 0
    held = max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)
    return text, held


def test_incremental_stop_matching_equals_the_definition():
    """StopMatcher (each character looked at once) cuts and holds back exactly what the definition does."""
    import random

    from dominospec.serve.text import TextStream

    rng = random.Random(34)
    for _ in range(300):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        pieces = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 12))]
        stream = TextStream(lambda ids, pieces=pieces: "".join(pieces[i] for i in ids), stops)
        sent = ""
        for i in range(len(pieces)):
            sent += stream.add(i)
            cut, held = naive_release("".join(pieces[: i + 1]), stops)
            if stream.stopped:
                assert sent == cut, (stops, pieces)
                break
            assert sent == cut[: len(cut) - held], (stops, pieces, i)
        else:
            sent += stream.finish()
            assert sent == naive_release("".join(pieces), stops)[0]


# ----- every surface: tiny temperatures are greedy, bad arguments are named -----


def test_generate_and_bench_at_temperature_1e_300_decode_greedily(char_model, drafter_dir, tmp_path, capsys):
    """Protects: generate and bench with --temperature 1e-300 answer (greedily) instead of a traceback."""
    common = ["--target", char_model, "--max-new-tokens", "6"]
    rc, err = run_cli(capsys, "generate", "hi", *common, "--drafter", drafter_dir, "--temperature", "1e-300")
    assert rc == 0 and "sampling is greedy" in err, err
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi", "why?"])
    argv = ["bench", *common, "--prompts", prompts, "--drafter", drafter_dir, "--methods", "ar,drafters"]
    rc, err = run_cli(capsys, *argv, "--out", tmp_path / "b", "--temperature", "5e-324", "--no-plots")
    assert rc == 0 and "Traceback" not in err, err


def test_the_transformers_hook_at_temperature_1e_300_equals_greedy():
    """Protects: generate(do_sample=True, temperature=1e-300) through the hook is greedy, not a crash."""
    from dominospec.integrations import domino_generate

    target = tiny_target("llama", vocab=64)
    model = target.model
    prompt = torch.tensor([[1, 2, 3, 4]])
    plain = model.generate(prompt, max_new_tokens=8, do_sample=False)
    ours = model.generate(
        prompt, max_new_tokens=8, do_sample=True, temperature=1e-300, top_k=0, custom_generate=domino_generate
    )
    assert ours.tolist() == plain.tolist()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(backend="jax"), "backend='jax': choose from"),
        (dict(verify="bogus"), "verify='bogus': choose from"),
        (dict(block_size=0), "block_size=0"),
    ],
)
def test_the_hook_names_its_own_keyword_arguments(kwargs, message):
    from dominospec.integrations import domino_generate
    from dominospec.integrations.transformers import UnsupportedSetting

    model = tiny_target("llama", vocab=64).model
    with pytest.raises(UnsupportedSetting, match=message.replace("(", r"\(")) as info:
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, custom_generate=domino_generate, **kwargs)
    assert "--" not in str(info.value)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--concurrency", "100000"], "at most 1024 clients"),
        (["--concurrency", ""], "--concurrency '': concurrency levels must be >= 1"),
        (["--verify", ""], "--verify '' names nothing; choose one or more of"),
    ],
)
def test_bench_arguments_are_named_before_loading(argv, message, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi"])
    rc, err = run_cli(capsys, "bench", "--target", NOWHERE, "--prompts", prompts, "--out", tmp_path / "b", *argv)
    assert rc == 2 and message in err, err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
        (["--temperature", "3"], "--temperature must be in [0, 2]"),
        (["--builtin", "0"], "--builtin must be at least 1, got 0"),
        (["--concurrency", "100000"], "--concurrency must be at most 1024"),
        (["--server-pid", "999999999"], "--server-pid 999999999: no such process"),
    ],
)
def test_loadtest_checks_its_own_arguments(argv, message, capsys):
    rc, err = run_cli(capsys, "loadtest", "--url", "http://127.0.0.1:9", *argv)
    assert rc == 2 and message in err, err


def test_loadtest_prints_the_first_error_of_each_kind(local_server, capsys):
    capsys.readouterr()
    argv = ["loadtest", "--url", local_server, "--builtin", "2", "--duration", "20", "--max-requests", "2"]
    rc = cli.main([*argv, "--max-tokens", "100000"])
    out = capsys.readouterr().out
    assert rc == 1 and "http_400" in out and "this server's context is" in out, out
    rc = cli.main([*argv, "--concurrency", "50", "--max-tokens", "2"])
    out = capsys.readouterr().out
    assert rc == 0 and "2 requests" in out, out


# ----- export --mask-token-id: the row SGLang overwrites -----


@pytest.mark.parametrize("which", ["eos", "end_of_turn", "pad"])
def test_export_refuses_a_special_id_as_the_mask_row(which, tmp_path):
    """Protects: SGLang writes a learned mask into row mask_token_id of the target's embeddings: never EOS,
    the chat template's end of turn, or pad (issue 34, Medium)."""
    from dominospec import DominoError
    from dominospec.export import export_drafter

    target = tiny_chat_target(dtype=torch.float32)
    tok = target.tokenizer
    mask = {"eos": target.eos_ids[0], "end_of_turn": tok.convert_tokens_to_ids("<|im_end|>"), "pad": tok.pad_token_id}
    drafter = tiny_drafter(target, mask_token_id=None)
    with pytest.raises(DominoError, match=f"--mask-token-id {mask[which]} is the target's special token"):
        export_drafter(drafter, "sglang", tmp_path / "out", target, mask_token_id=mask[which])
    start = tok.convert_tokens_to_ids("<|im_start|>")  # written by the chat template around every message
    with pytest.raises(DominoError, match="written by its chat template"):
        export_drafter(drafter, "sglang", tmp_path / "out", target, mask_token_id=start)
    assert not (tmp_path / "out").exists()
    report = export_drafter(drafter, "sglang", tmp_path / "out", target, mask_token_id=40)  # a plain character
    assert report["mask_token_id"] == 40


def test_a_learned_mask_on_a_tied_target_needs_allow_approx(tmp_path):
    """Protects: on tied embeddings the mask row is the LM head's row too; refused unless --allow-approx, and
    then the report says why."""
    from dominospec import DominoError
    from dominospec.export import export_drafter

    target = tiny_target("llama", vocab=64, tied=True)
    drafter = tiny_drafter(target, mask_token_id=None)
    with pytest.raises(DominoError, match="ties its embeddings to its LM head"):
        export_drafter(drafter, "sglang", tmp_path / "out", target, mask_token_id=5)
    report = export_drafter(drafter, "sglang", tmp_path / "out", target, mask_token_id=5, allow_approx=True)
    assert report["status"] == "approximate" and any("ties its embeddings" in a for a in report["approximations"])


# ----- Low: the smaller refusals and notes -----


def test_profile_clips_its_default_contexts_to_the_targets_context(char_model, tmp_path, capsys, monkeypatch):
    """Protects: `dominospec profile` with its default contexts runs on a short-context target, saying so."""
    import dominospec.cli.profile as profile_cli

    seen = {}

    def fake_profile(target, drafter, contexts, max_k, repeats, seed, batch_rows=()):
        seen["contexts"] = contexts
        raise SystemExit(0)  # the measurement itself is not under test

    monkeypatch.setattr(profile_cli, "profile_device", fake_profile)
    with pytest.raises(SystemExit):
        run_cli(capsys, "profile", "--target", char_model, "--no-draft", "--max-k", "8")
    err = capsys.readouterr().err
    assert seen["contexts"] == [56] and "default contexts 256,1024 clipped to 56" in err, err


def test_prepare_data_layer_ids_without_a_feature_cache_is_refused(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi"])
    argv = ["prepare-data", "--target", NOWHERE, "--prompts", prompts, "--out", tmp_path / "d", "--layer-ids", "1,2"]
    rc, err = run_cli(capsys, *argv)
    assert rc == 2 and "--layer-ids 1,2 chooses the layers kept in --feature-cache, and there is none" in err, err


def test_train_samples_without_off_policy_samples_blames_train_samples():
    """Protects: --train-samples N,M on a set without off-policy samples names --train-samples, not --train-labels."""
    from dominospec import DominoError
    from dominospec.train.run import training_subset

    samples = [{"labels": "on-policy", "i": i} for i in range(5)]
    with pytest.raises(DominoError, match=r"--train-samples 3,1000000 \(its off-policy count\): d holds no off-policy"):
        training_subset(samples, "all", (3, 1_000_000), "d", 0)


def test_block_size_auto_says_which_sizes_were_never_measured(monkeypatch, tmp_path):
    """Protects: when the profile covers only some block sizes, the note says the rest were not considered."""
    import dominospec.tune.profile as cost

    drafter = type("D", (), {"config": type("C", (), {"block_size": 6})()})()
    (tmp_path / "acceptance.json").write_text(json.dumps({"conditional": [0.0] * 6}))
    profile = {"verify": {"256": {"k": [1, 2, 3], "seconds": [0.01, 0.0101, 0.0102]}}}
    monkeypatch.setattr(cost, "sidecar_path", lambda d, name: tmp_path / name)
    monkeypatch.setattr(cost, "ensure_profile", lambda *a, **k: profile)
    b, note = cost.auto_block_size(None, drafter)
    assert b == 0 and "no measured block size beats it" in note and "block sizes 3..6 were not considered" in note


# ----- fuzz: random JSON for every field of both request schemas, against a live server -----

FUZZ_CASES = 150  # requests in all (bounded in count) ...
FUZZ_SECONDS = 20.0  # ... and in time: the test stops sending after this, whatever the count
SHARED_FIELDS = {  # field -> plausible values (the rest of the time: any JSON value)
    "model": ["tiny-chat"],
    "temperature": [0, 0.7, 1.0, 2, 1e-300, 5e-324, 1e-20, 1e-45],
    "top_p": [1.0, 0.5, 1e-300, 5e-324, 1e-30],
    "top_k": [0, 1, 5, 10**30],
    "max_tokens": [1, 3, 6],
    "seed": [0, 7, 2**63 - 1],
    "stop": ["a", ["x", "yz"], "\n", ["é"] * 8],
    "stream": [True, False],
    "stream_options": [{"include_usage": True}, {"include_usage": False}],
    "ignore_eos": [True, False],
    "n": [1],
    "logprobs": [None, False],
    "top_logprobs": [0],
    "presence_penalty": [0],
    "frequency_penalty": [0.0],
    "logit_bias": [{}],
}
CHAT_FIELDS = {
    **SHARED_FIELDS,
    "messages": [
        [{"role": "user", "content": "hi"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "why?"}]}],
    ],
    "max_completion_tokens": [2, 4],
    "chat_template_kwargs": [{"enable_thinking": True}, {"add_generation_prompt": False}, {"messages": 1}],
    "tools": [[]],
    "tool_choice": ["none"],
    "functions": [[]],
    "function_call": ["none"],
    "response_format": [{"type": "text"}],
    "audio": [None],
    "modalities": [["text"]],
    "prediction": [None],
}
COMPLETION_FIELDS = {
    **SHARED_FIELDS,
    "prompt": ["hello", ["hi"], [5, 9, 11], [[5, 9]], "é" * 50],
    "echo": [False],
    "suffix": [""],
    "best_of": [1],
}


def random_json(rng, depth: int = 0):
    """Any JSON value: the odd numbers (huge, tiny, negative zero), strings, nested lists and objects."""
    kinds = ["null", "bool", "int", "float", "str"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "null":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "int":
        return rng.choice([0, 1, -1, 2, 17, 511, 10**6, -(2**63), 2**64, 10**40])
    if kind == "float":
        return rng.choice([0.0, -0.0, 0.5, 1.5, 2.0000001, -1e-300, 1e-300, 5e-324, 1e308, 3.14])
    if kind == "str":
        return rng.choice(["", "a", "é", "\u0000", "\ud7ff" * 3, "x" * 600, "<|im_end|>", "NaN", "1"])
    if kind == "list":
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {
        rng.choice(["role", "content", "type", "text", "k"]): random_json(rng, depth + 1)
        for _ in range(rng.randint(0, 3))
    }


def random_request(rng, fields: dict) -> dict:
    """Half the cases hold plausible values only (they reach the engine: poisoned sampling, odd stops, ...);
    the other half put any JSON value into about a third of their fields (they test the schema)."""
    wild = rng.random() < 0.5
    body = {}
    for name, plausible in fields.items():
        if rng.random() < 0.5 and name not in ("messages", "prompt"):
            continue
        body[name] = random_json(rng) if wild and rng.random() < 0.3 else rng.choice(plausible)
    return body


def check_response(r: httpx.Response, body) -> None:
    """A 2xx (a whole stream without a server error inside), or a 4xx with OpenAI's error body."""
    assert r.status_code < 500, (r.status_code, r.text[:300], body)
    if r.status_code >= 400:
        assert_openai_error(r, r.status_code)
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", (r.text[-300:], body)
        for e in events[:-1]:
            assert json.loads(e).get("error", {}).get("type") != "server_error", (e, body)
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length"), (r.text[:300], body)


def bystander_streams(base: str, stop: threading.Event, outcomes: list) -> None:
    """Streams a sampled answer over and over while the fuzz runs; records how each ended."""
    body = {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 12,
        "stream": True,
        "temperature": 0.8,
        "seed": 3,
        "ignore_eos": True,
    }
    while not stop.is_set():
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=60) as r:
            text = r.read().decode()
        finish = [
            json.loads(e)["choices"][0]["finish_reason"]
            for e in (line[6:] for line in text.splitlines() if line.startswith("data: {"))
            if json.loads(e).get("choices")
        ]
        outcomes.append((r.status_code, text.rstrip().endswith("data: [DONE]"), finish[-1] if finish else None))


def test_fuzzed_requests_never_get_a_500_and_never_break_a_bystander(chat_target):
    """Protects: random JSON in every field of chat and completion requests gets a 2xx or an OpenAI-shaped
    4xx, never a 500; a stream running beside them always completes (issue 34, Tests)."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(2026)
    cases = []
    for i in range(FUZZ_CASES):
        chat = i % 2 == 0
        body = random_request(rng, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        if rng.random() < 0.05:  # not an object at all
            body = random_json(rng)
        cases.append(("chat/completions" if chat else "completions", body))
    drafter = tiny_drafter(chat_target, block_size=3)
    with live_server(chat_target, drafter=drafter, policy="fixed") as base:
        stop, outcomes = threading.Event(), []
        watcher = threading.Thread(target=bystander_streams, args=(base, stop, outcomes))
        watcher.start()
        deadline = time.monotonic() + FUZZ_SECONDS
        sent = []

        def send(case):
            route, body = case
            if time.monotonic() > deadline:
                return
            r = httpx.post(
                f"{base}/v1/{route}", content=json.dumps(body), timeout=60, headers={"Content-Type": "application/json"}
            )
            check_response(r, body)
            sent.append(r.status_code)

        try:
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(send, cases))
        finally:
            stop.set()
            watcher.join(120)
    ok = sum(s < 300 for s in sent)
    print(
        f"fuzz: {len(sent)} requests, {ok} answered, {len(sent) - ok} refused with a 4xx; "
        f"bystander streams {len(outcomes)}"
    )
    assert len(sent) >= 50 and ok >= 10  # enough of both kinds to mean something
    assert outcomes and all(o == (200, True, "length") for o in outcomes), outcomes


def test_a_request_head_that_never_finishes_is_cut_off(local_server, monkeypatch):
    """Protects: a client that sends part of its headers and stalls is disconnected after the head timeout."""
    import socket

    import dominospec.serve.server as server_mod

    monkeypatch.setattr(server_mod, "HEAD_TIMEOUT_S", 0.5)  # read when a connection is made
    port = int(local_server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        assert s.recv(4096) == b""  # closed by the server, well before the socket's own 10 s
    assert httpx.get(f"{local_server}/health").status_code == 200


def test_an_engine_whose_slots_cannot_hold_a_cycle_is_refused(native_target, drafter):
    """Protects: max_len below the drafter's block size (the CLI cannot see it before loading) is named."""
    from dominospec import DominoError
    from dominospec.engine import Engine

    with pytest.raises(DominoError, match="engine max_len 5 leaves no room for a request"):
        Engine(native_target, drafter, policy="fixed", max_len=5)
