"""Reliability, fourth round (issue 56): deadlines that hold, the server's own origin, damaged files named
with what to do, and every run bounded.

CLI tests use the tiny character-level Llama of conftest (64 positions); server tests the tiny chat target
with a real character tokenizer.
"""

import contextlib
import json
import shutil
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import init_char_drafter, run_cli, save_char_model, serving, tiny_chat_target, write_prompts

from dominospec import cli

CONTEXT = 64
NOWHERE = "/nonexistent/target-that-must-not-load"  # an argument error must be reported before this loads
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reliability4")


@pytest.fixture(scope="module")
def char_model(shared_dir) -> Path:
    return save_char_model(shared_dir / "char-model", CONTEXT)


@pytest.fixture(scope="module")
def drafter_dir(char_model, shared_dir) -> Path:
    return init_char_drafter(char_model, shared_dir / "drafter")


def snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ----- the server: one deadline for the whole body, the server's own origin, headers -----


@contextlib.contextmanager
def live_server(target, **config_kw):
    """A plain server over a batched engine in a thread on a free loopback port; yields its base URL."""
    from dominospec.engine import Engine
    from dominospec.serve import LOOPBACK_HOSTS, ServeConfig

    engine = Engine(target, None, policy="plain", max_batch=2, max_queue=8)
    config = ServeConfig(model_name=target.name, request_timeout=60, allowed_hosts=LOOPBACK_HOSTS, **config_kw)
    with serving(engine, target, config) as base:
        yield base


@pytest.fixture(scope="module")
def chat_target():
    return tiny_chat_target(dtype=torch.float32)


@pytest.fixture(scope="module")
def local_server(chat_target):
    with live_server(chat_target, body_timeout_s=1.0) as base:
        yield base


def test_a_body_sent_a_byte_at_a_time_is_cut_off_at_the_whole_body_deadline(local_server):
    """Protects: the body timeout is one deadline for the whole body, not one per chunk (issue 56, 4): a client
    sending a byte every 0.2 s (each under the 1 s limit) gets 408 at about 1 s, not after its 60 bytes."""
    port = int(local_server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Content-Length: 60\r\n\r\n"
        )
        s.sendall(head.encode())
        s.settimeout(0.2)
        start, reply = time.monotonic(), b""
        for _ in range(60):
            with contextlib.suppress(OSError):
                s.sendall(b" ")
            with contextlib.suppress(TimeoutError, socket.timeout):
                reply += s.recv(4096)
            if b"body_timeout" in reply:
                break
        took = time.monotonic() - start
    assert reply.startswith(b"HTTP/1.1 408") and b"body_timeout" in reply, reply
    assert took < 4, f"the 408 came after {took:.1f} s for a 1 s deadline"
    assert httpx.get(f"{local_server}/health").status_code == 200


def assert_refused(r) -> None:
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == "forbidden_origin"


def test_a_page_on_another_port_of_this_machine_is_refused(local_server):
    """Protects: the Origin check compares scheme, host and port (issue 56, 11): a page on any other local port
    (or https on this port) cannot use a key-less loopback server; the server's own page can, by any loopback
    name."""
    url = f"{local_server}/v1/chat/completions"
    port = int(local_server.rsplit(":", 1)[1])
    for origin in (
        f"http://127.0.0.1:{port + 1}",
        f"http://localhost:{port - 1}",
        "http://localhost",
        f"https://127.0.0.1:{port}",
        "null",
        f"http://127.0.0.1:{port}/page",
    ):
        assert_refused(httpx.post(url, json=CHAT, headers={"Origin": origin}))
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}", f"http://[::1]:{port}"):
        assert httpx.post(url, json=CHAT, headers={"Origin": origin}, timeout=60).status_code == 200, origin


def test_allow_origin_lets_the_named_pages_in(chat_target):
    """Protects: `--allow-origin` (ServeConfig.allowed_origins) allows exactly the origins it names; * any."""
    with live_server(chat_target, allowed_origins=("http://localhost:3000",)) as base:
        url = f"{base}/v1/chat/completions"
        r = httpx.post(url, json=CHAT, headers={"Origin": "http://LOCALHOST:3000"}, timeout=60)
        assert r.status_code == 200, r.text
        assert_refused(httpx.post(url, json=CHAT, headers={"Origin": "http://localhost:3001"}))
    with live_server(chat_target, allowed_origins=("*",)) as base:
        r = httpx.post(f"{base}/v1/chat/completions", json=CHAT, headers={"Origin": "https://a.example"}, timeout=60)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("origin", ["localhost:3000", "http://localhost:3000/app", "ftp://x", "http://"])
def test_serve_refuses_an_allow_origin_that_is_no_origin(origin, capsys):
    rc, err = run_cli(capsys, "serve", "--target", NOWHERE, "--allow-origin", origin)
    assert rc == 2 and "--allow-origin" in err and "scheme://host" in err, err


def test_a_body_with_a_byte_order_mark_is_read(local_server):
    """Protects: a UTF-8 body that starts with a byte-order mark is JSON like any other (issue 56, also)."""
    body = b"\xef\xbb\xbf" + json.dumps(CHAT).encode()
    r = httpx.post(
        f"{local_server}/v1/chat/completions",
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_every_response_forbids_type_sniffing(local_server):
    """Protects: JSON bodies (answers and errors, from the gate or the app) carry X-Content-Type-Options."""
    for r in (
        httpx.get(f"{local_server}/v1/models"),
        httpx.get(f"{local_server}/nothing-here"),
        httpx.post(f"{local_server}/v1/chat/completions", content=b"{", headers={"Content-Type": "application/json"}),
        httpx.post(f"{local_server}/v1/chat/completions", content=b"{}", headers={"Content-Type": "text/plain"}),
        httpx.post(f"{local_server}/v1/chat/completions", json=CHAT, timeout=60),
    ):
        assert r.headers.get("x-content-type-options") == "nosniff", (r.status_code, r.headers)
    r = httpx.get(f"{local_server}/")
    assert r.headers.get_list("x-content-type-options") == ["nosniff"]  # the page's own header, not twice


def test_serve_refuses_a_bad_host_before_any_warning(capsys):
    """Protects: `serve --host bogus.invalid` names the host and says nothing else first (issue 56, 12)."""
    rc, err = run_cli(capsys, "serve", "--target", NOWHERE, "--host", "bogus.invalid")
    assert rc == 2 and "--host 'bogus.invalid'" in err, err
    assert "api-key" not in err, err


# ----- train --resume over a damaged checkpoint -----


@pytest.fixture(scope="module")
def char_data(char_model, shared_dir) -> Path:
    """prepare-data output of the char model: 4 short prompts, answers cut at the context."""
    out = shared_dir / "char-data"
    assert cli.main(prepare_argv(char_model, shared_dir, out)) == 0
    return out


def prepare_argv(char_model, prompts_dir: Path, out: Path) -> list[str]:
    prompts = write_prompts(prompts_dir / "short.jsonl", ["hi", "why?", "a b", "ok"])
    argv = ["prepare-data", "--target", char_model, "--prompts", prompts, "--out", out, "--max-new-tokens", "8"]
    return [str(a) for a in [*argv, "--batch-size", "2", "--shard-size", "2"]]


def train_args(char_model, data, out, *extra) -> list:
    shape = ["--layers", "1", "--block-size", "2", "--gru-hidden-size", "8", "--rank", "4"]
    return ["train", "--target", char_model, "--data", data, "--out", out, *shape, "--max-steps", "2", *extra]


@pytest.fixture(scope="module")
def trained(char_model, char_data, shared_dir) -> Path:
    """A finished two-step training run: the exported drafter and train_state/ beside it."""
    out = shared_dir / "trained"
    assert cli.main([str(a) for a in train_args(char_model, char_data, out, "--save-every", "1")]) == 0
    assert (out / "train_state" / "trainer.pt").exists()
    return out


@pytest.mark.parametrize("damage", ["truncated", "empty", "drafter weights truncated"])
def test_resume_over_a_damaged_checkpoint_names_the_file_before_loading(damage, trained, char_data, tmp_path, capsys):
    """Protects: `train --resume` over a trainer.pt (or its drafter) cut short by a crash or a full disk exits 2
    naming the file and what to do, before the target loads, and leaves the exported drafter untouched
    (issue 56, 1)."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    damaged = out / "train_state" / ("drafter/model.safetensors" if "drafter" in damage else "trainer.pt")
    data = damaged.read_bytes()
    damaged.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    before = snapshot(out)
    rc, err = run_cli(capsys, *train_args(NOWHERE, char_data, out, "--resume"))
    assert rc == 2, err
    assert "Traceback" not in err and str(damaged) in err, err
    assert "remove it to train from the start" in err and str(out / "train_state") in err, err
    assert snapshot(out) == before


# ----- --threads above the CPUs this process may use -----


def threads_argv(name: str, tmp_path: Path, data: Path, drafter: Path) -> list:
    from dominospec.serve import free_port

    prompts = write_prompts(tmp_path / "p.jsonl", ["hi"])
    return {
        "generate": ["generate", "hi"],
        "serve": ["serve", "--port", free_port()],
        "bench": ["bench", "--prompts", prompts, "--out", tmp_path / "b"],
        "prepare-data": ["prepare-data", "--prompts", prompts, "--out", tmp_path / "d"],
        "train": ["train", "--data", data, "--out", tmp_path / "t"],
        "init": ["init", "--out", tmp_path / "i"],
        "calibrate": ["calibrate", "--drafter", drafter, "--prompts", prompts],
        "profile": ["profile", "--out", tmp_path / "profile.json"],
    }[name]


@pytest.mark.parametrize(
    "name", ["generate", "serve", "bench", "prepare-data", "train", "init", "calibrate", "profile"]
)
def test_threads_above_the_allowed_cpus_are_capped_with_a_note(
    name, char_data, drafter_dir, tmp_path, capsys, monkeypatch
):
    """Protects: `--threads 999` on a process allowed 1 CPU runs 1 thread and says so, on every subcommand that
    takes --threads (issue 56, 3); the note comes before the model loads (here: a target that does not exist)."""
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
    argv = threads_argv(name, tmp_path, char_data, drafter_dir)
    try:
        rc, err = run_cli(capsys, *argv, "--target", NOWHERE, "--threads", "999")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)
    assert "--threads 999: this process may use 1 CPU(s) (its affinity), so 1 thread(s) are used" in err, err
    assert rc == 2 and NOWHERE in err, err


def test_omp_num_threads_above_the_allowed_cpus_is_capped_too(monkeypatch):
    from dominospec.devices import threads_to_use

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    assert threads_to_use(None) == (
        2,
        "OMP_NUM_THREADS=64: this process may use 2 CPU(s) (its affinity), so 2 thread(s) are used",
    )
    assert threads_to_use(2) == (2, None)


# ----- bench: a per-prompt time limit for any method; its own flag in its errors -----


def test_a_method_that_stalls_is_stopped_at_the_per_prompt_limit_and_reported(tmp_path):
    """Protects: no benchmark row can stall the run (issue 56, 5): a method that sleeps past the per-prompt limit
    is stopped there, its prompt counted as timed out in the table, its later prompts skipped, and every
    other method's figures are whole."""
    from dataclasses import dataclass
    from typing import ClassVar

    from conftest import tiny_target

    from dominospec.bench import runner
    from dominospec.bench.methods import Autoregressive, Method

    @dataclass(kw_only=True)
    class Stalls(Method):
        kind: ClassVar[str] = "stalls"
        name: str = "stalls"
        calls: int = 0

        def run(self, target, prompt_ids, max_new_tokens, sampling, seed, dataset="", prompt_index=0):
            self.calls += 1
            time.sleep(3600)

    target = tiny_target()
    stalls = Stalls()
    datasets = {"x": [[1, 2, 3], [5, 9, 11]], "y": [[4, 4, 7]]}
    start = time.monotonic()
    res = runner.benchmark(
        target,
        datasets,
        [Autoregressive(), stalls],
        tmp_path,
        max_new_tokens=4,
        progress=False,
        plots=False,
        warmup=False,
        time_limit_s=0.5,
    )
    assert time.monotonic() - start < 30
    assert stalls.calls == 1  # stopped once, then skipped
    assert res["methods"]["ar"]["num_prompts"] == 3 and res["methods"]["ar"]["timed_out"] == 0
    assert res["methods"]["stalls"]["num_prompts"] == 0 and res["methods"]["stalls"]["timed_out"] == 1
    assert any("stalls: stopped on x#0, past the per-prompt time limit of 0.5 s" in n for n in res["config"]["notes"])
    report = (tmp_path / "report.md").read_text()
    assert "| stalls |" in report and "0 (+1 timed out)" in report
    runs = [json.loads(line) for line in (tmp_path / "runs.jsonl").read_text().splitlines()]
    assert [r["method"] for r in runs if r["timed_out"]] == ["stalls"]


def test_bench_server_names_its_own_flag(capsys):
    """Protects: `bench --server notaurl` names --server, not loadtest's --url (issue 56, 8)."""
    rc, err = run_cli(capsys, "bench", "--server", "notaurl", "--prompts", "p.jsonl", "--out", "o")
    assert rc == 2 and "--server 'notaurl'" in err and "--url" not in err, err


# ----- prepare-data over a damaged shard -----


@pytest.mark.parametrize("cut", ["mid-line", "a whole line"])
def test_prepare_data_rerun_over_a_truncated_shard_names_it_and_redoes_it(cut, char_model, char_data, tmp_path, capsys):
    """Protects: a rerun over a run whose shard was cut short names the shard and says how to have it written
    again (issue 56, 6), instead of "already complete"; doing so writes it identical to the first run."""
    out = tmp_path / "data"
    shutil.copytree(char_data, out)
    shard = out / "samples-00001.jsonl"
    whole = shard.read_bytes()
    lines = whole.splitlines(keepends=True)
    shard.write_bytes(whole[: len(whole) - 5] if cut == "mid-line" else b"".join(lines[:-1]))
    rc, err = run_cli(capsys, *prepare_argv(char_model, tmp_path, out))
    assert rc == 2 and "samples-00001.jsonl" in err and f"rm {shard}" in err, err
    assert "already complete" not in err
    shard.unlink()
    rc, err = run_cli(capsys, *prepare_argv(char_model, tmp_path, out))
    assert rc == 0, err
    assert shard.read_bytes() == whole


# ----- DOMINOSPEC_KERNELS=off: one note -----


@pytest.mark.parametrize("kernels", ["off", "on"])
def test_kernels_off_gives_one_consistent_note(kernels, char_model, tmp_path, capsys, monkeypatch):
    """Protects: with DOMINOSPEC_KERNELS=off, a target whose weights --dtype auto holds in int8 gets one note,
    saying int8 runs at fp32's speed without the kernel, and not also "int8 weights on the CPU kernel" (issue
    56, 9); with the kernel on, the auto note alone."""
    from transformers import AutoModelForCausalLM

    from dominospec import Target, log
    from dominospec.targets import kernels as kernels_module
    from dominospec.targets.quant import apply_weight_format_

    model_dir = tmp_path / "int8-exact"
    shutil.copytree(char_model, model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    apply_weight_format_(model, "int8")  # weights on the int8 grid: --dtype auto adopts int8
    model.save_pretrained(model_dir)
    monkeypatch.setenv("DOMINOSPEC_KERNELS", kernels)
    monkeypatch.setattr(log, "_said", set())
    kernels_module.reset_kernels()
    try:
        capsys.readouterr()
        target = Target.load(str(model_dir), device="cpu", dtype="auto", backend="native", progress=log.log)
        err = capsys.readouterr().err
        built = kernels_module.active_build() != "off"
    finally:
        kernels_module.reset_kernels()
    if kernels == "on" and not built:
        pytest.skip("the small-row kernel does not build here")
    assert target.weight_only == "int8"
    # the notes on how the int8 weights run (the panel cache's "saved the packed int8 weights" line is not one)
    notes = [line for line in err.splitlines() if "int8" in line and "kernel" in line]
    if kernels == "off":
        assert notes == [
            "[dominospec] DOMINOSPEC_KERNELS=off: int8 weights run as fp32 values on the library GEMMs (the same "
            "model, at fp32's speed, not the kernel's)"
        ], err
    else:
        assert len(notes) == 1 and "int8 weights on the CPU kernel" in notes[0], err


# ----- reproducible exports -----


def test_exports_of_the_same_drafter_are_byte_identical(drafter_dir, tmp_path, capsys):
    """Protects: exporting one drafter again gives the same bytes in every file, so a checksum means
    something (issue 56, 10: safetensors wrote its header's metadata in hash order, different each call)."""
    import struct

    exports, out = [], tmp_path / "e"  # the same --out: the report names it (in the serve command)
    for _ in range(4):
        rc, err = run_cli(capsys, "export", drafter_dir, "--to", "sglang", "--out", out)
        assert rc == 0, err
        exports.append(snapshot(out))
    assert all(e == exports[0] for e in exports[1:])
    blob = exports[0]["model.safetensors"]
    header = json.loads(blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]])
    assert list(header["__metadata__"]) == sorted(header["__metadata__"])


def test_an_export_with_a_mask_file_is_reproducible(tmp_path):
    """The learned-mask export (mask_embedding.pt beside the weights) is byte-identical too."""
    from conftest import tiny_drafter, tiny_target

    from dominospec.export import export_drafter

    target = tiny_target("llama", vocab=64)
    drafter = tiny_drafter(target, mask_token_id=None)
    exports = []
    for _ in range(2):
        report = export_drafter(drafter, "sglang", tmp_path / "e", target, mask_token_id=5, allow_approx=True)
        assert "mask_embedding.pt" in report["files"]
        exports.append(snapshot(tmp_path / "e"))
    assert exports[0] == exports[1]
