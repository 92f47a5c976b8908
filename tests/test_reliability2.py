"""Reliability, second round (issue 24): a data set never loses samples silently, no damaged file
gets a traceback, and nothing is written where it should not be.

CLI tests use the tiny character-level Llama of conftest (64 positions); library tests build the
files they damage directly.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli, save_char_model, write_prompts

import dominospec
from dominospec import DominoError, cli
from dominospec.data.dataset import load_dataset_dir
from dominospec.data.store import read_manifest

CONTEXT = 64
NOWHERE = "/nonexistent/target-that-must-not-load"  # an argument error must be reported before this loads
SRC = Path(dominospec.__file__).resolve().parents[1]  # the dominospec these tests import, for subprocesses


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reliability2")


@pytest.fixture(scope="module")
def char_model(shared_dir) -> Path:
    return save_char_model(shared_dir / "char-model", CONTEXT)


def prepare_args(model, prompts, out, *extra) -> list:
    return [
        "prepare-data",
        "--target",
        model,
        "--prompts",
        prompts,
        "--out",
        out,
        "--max-new-tokens",
        "8",
        "--batch-size",
        "2",
        *extra,
    ]


@pytest.fixture(scope="module")
def dataset(char_model, shared_dir) -> Path:
    """A data set of one part, made through the CLI."""
    prompts = write_prompts(shared_dir / "ds-prompts.jsonl", ["hi", "why?", "a b", "ok"])
    ds = shared_dir / "ds"
    assert cli.main([str(a) for a in prepare_args(char_model, prompts, shared_dir / "run0", "--extend", ds)]) == 0
    return ds


def copy_dataset(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


# ----- 1. silent data loss: concurrent adds, unlisted and unchecked files -----


def _extend_in_subprocess(model, prompts, out, ds, seed) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(SRC), "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    argv = [str(a) for a in prepare_args(model, prompts, out, "--extend", ds, "--seed", seed)]
    return subprocess.Popen(
        [sys.executable, "-m", "dominospec.cli", *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )


@pytest.mark.slow
def test_two_concurrent_extends_both_land_whole(char_model, tmp_path):
    """Protects: two prepare-data --extend runs into one data set at once lose no sample (issue 24, 1).

    The test holds the data set's lock until both runs have finished generating, so their adds
    contend for it at the same moment.
    """
    import time

    from dominospec.io import exclusive_lock

    prompts = write_prompts(tmp_path / "p.jsonl", [f"q{i}" for i in range(12)])
    ds = tmp_path / "ds"
    ds.mkdir()
    with exclusive_lock(ds, "test"):
        runs = [_extend_in_subprocess(char_model, prompts, tmp_path / f"run{k}", ds, k) for k in (1, 2)]
        deadline = time.monotonic() + 300
        while not all(_complete(tmp_path / f"run{k}") for k in (1, 2)) and time.monotonic() < deadline:
            if any(p.poll() is not None for p in runs):
                break
            time.sleep(0.1)
        time.sleep(0.5)  # both are now at the lock
    outputs = [p.communicate(timeout=300) for p in runs]
    codes = [p.returncode for p in runs]
    for (_, err), rc in zip(outputs, codes):
        assert b"Traceback" not in err, err.decode()
        assert rc == 0, err.decode()
    assert any(b"waiting for another prepare-data --extend run" in err for _, err in outputs)
    made = [json.loads((tmp_path / f"run{k}" / "meta.json").read_text())["counts"]["samples"] for k in (1, 2)]
    manifest = read_manifest(ds)
    assert manifest["counts"]["samples"] == sum(made) == len(load_dataset_dir(ds)[1])
    assert sorted(p["name"] for p in manifest["parts"]) == ["part-000", "part-001"]
    assert not [p for p in ds.iterdir() if p.name.startswith(".part")]  # no temporary left


def _complete(run: Path) -> bool:
    try:
        return bool(json.loads((run / "meta.json").read_text()).get("complete"))
    except (OSError, ValueError):
        return False


def test_an_add_waits_for_the_data_sets_lock(char_model, dataset, tmp_path):
    """Protects: the add holds DATASET/.lock; a second add waits its turn instead of racing (control: it lands)."""
    import threading

    from dominospec.data.extend import add_part
    from dominospec.io import exclusive_lock

    ds = copy_dataset(dataset, tmp_path / "ds")
    prompts = write_prompts(tmp_path / "p.jsonl", ["yes", "no"])
    assert cli.main([str(a) for a in prepare_args(char_model, prompts, tmp_path / "run")]) == 0
    said, done = [], []
    with exclusive_lock(ds, "test"):
        worker = threading.Thread(target=lambda: done.append(add_part(ds, tmp_path / "run", report=said.append)))
        worker.start()
        worker.join(1.0)
        assert worker.is_alive() and not done  # blocked on the lock
        assert said == [f"waiting for another prepare-data --extend run to finish writing {ds}"]
    worker.join(30)
    assert done and done[0]["name"] == "part-001"


def test_reading_a_data_set_waits_for_an_add_in_progress(dataset, tmp_path):
    """Protects: train never sees a part renamed into place but not yet in the manifest."""
    import threading

    from dominospec.io import exclusive_lock

    ds = copy_dataset(dataset, tmp_path / "ds")
    loaded = []
    with exclusive_lock(ds, "test"):
        reader = threading.Thread(target=lambda: loaded.append(load_dataset_dir(ds)))
        reader.start()
        reader.join(1.0)
        assert reader.is_alive() and not loaded
    reader.join(30)
    assert loaded and loaded[0][1]


def test_parts_are_built_under_a_unique_temporary_name(char_model, dataset, tmp_path, monkeypatch):
    """Protects: a part is written as .part-NNN.tmpPID and renamed whole; a killed add's leftovers are cleared."""
    from dominospec.data import extend

    ds = copy_dataset(dataset, tmp_path / "ds")
    (ds / ".part-001.tmp").mkdir()  # the shared name an old version used, left by a killed add
    (ds / ".part-001.tmp" / "samples-00000.npz").write_bytes(b"half")
    prompts = write_prompts(tmp_path / "p.jsonl", ["yes", "no"])
    assert cli.main([str(a) for a in prepare_args(char_model, prompts, tmp_path / "run")]) == 0
    seen = []
    real = extend._write_part

    def spy(tmp, *args):
        seen.append(tmp.name)
        return real(tmp, *args)

    monkeypatch.setattr(extend, "_write_part", spy)
    extend.add_part(ds, tmp_path / "run")
    assert seen == [f".part-001.tmp{os.getpid()}"]
    assert sorted(p.name for p in ds.iterdir()) == [".lock", "manifest.json", "part-000", "part-001"]


def test_train_data_refuses_files_the_manifest_does_not_list(char_model, dataset, tmp_path):
    """Protects: an unlisted shard inside a part, or an unrecorded part, is refused by name, not read."""
    ds = copy_dataset(dataset, tmp_path / "a")
    extra = ds / "part-000" / "samples-00099.npz"
    extra.write_bytes(b"not even a zip")
    with pytest.raises(DominoError, match=f"{extra} is not listed in"):
        load_dataset_dir(ds)
    ds = copy_dataset(dataset, tmp_path / "b")
    copy_dataset(ds / "part-000", ds / "part-001")  # an add killed before its manifest entry
    with pytest.raises(DominoError, match=f"{ds / 'part-001'} is not listed in"):
        load_dataset_dir(ds)
    assert load_dataset_dir(dataset)[1]  # control: the data set as made loads


def test_a_manifest_that_lists_no_files_is_refused(dataset, tmp_path):
    ds = copy_dataset(dataset, tmp_path / "ds")
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["parts"][0]["files"] = {}
    (ds / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DominoError, match="'files' lists no file, so nothing could be checked"):
        load_dataset_dir(ds)


def test_a_killed_add_is_repaired_by_the_next_add(char_model, dataset, tmp_path, capsys):
    """Protects: a part renamed into place but never recorded does not block the data set forever."""
    ds = copy_dataset(dataset, tmp_path / "ds")
    copy_dataset(ds / "part-000", ds / "part-001")
    prompts = write_prompts(tmp_path / "p.jsonl", ["yes", "no"])
    rc, err = run_cli(capsys, *prepare_args(char_model, prompts, tmp_path / "run", "--extend", ds))
    assert rc == 0, err
    assert f"removing {ds / 'part-001'}: an add killed after writing it" in err
    run_samples = json.loads((tmp_path / "run" / "meta.json").read_text())["counts"]["samples"]
    assert len(load_dataset_dir(ds)[1]) == read_manifest(dataset)["counts"]["samples"] + run_samples


# ----- 2. --extend after a full generation that skipped a prompt too long for the context -----


def test_extend_works_when_a_prompt_was_skipped_as_too_long(char_model, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi", "x" * 50, "ok"])
    argv = prepare_args(char_model, prompts, tmp_path / "run", "--extend", tmp_path / "ds")
    rc, err = run_cli(capsys, *argv)
    assert rc == 0, err
    assert "prompt p:2" in err and "skipped" in err
    rc, err = run_cli(capsys, *argv)  # the rerun finds its part
    assert rc == 0 and "part-000 holds this run" in err, err
    stored = [json.loads(line)["id"] for line in _gunzip(tmp_path / "ds" / "part-000" / "prompts.jsonl.gz")]
    assert stored == ["p:1", "p:3"]  # the prompts the run was made from


def _gunzip(path: Path) -> list[str]:
    import gzip

    return gzip.decompress(path.read_bytes()).decode().splitlines()


# ----- 3. bench --save-acceptance -----


@pytest.fixture(scope="module")
def drafter_dir(char_model, shared_dir) -> Path:
    d = shared_dir / "drafter"
    argv = ["init", "--target", char_model, "--out", d, "--layers", "1", "--block-size", "2"]
    assert cli.main([str(a) for a in [*argv, "--gru-hidden-size", "8", "--rank", "4", "--confidence-head"]]) == 0
    return d


def bench_args(model, prompts, drafter, out, *extra) -> list:
    return [
        "bench",
        "--target",
        model,
        "--prompts",
        prompts,
        "--drafter",
        drafter,
        "--methods",
        "ar,drafters",
        "--verify",
        "fixed",
        "--no-warmup",
        "--no-plots",
        "--max-new-tokens",
        "12",
        "--save-acceptance",
        "--out",
        out,
        *extra,
    ]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "0.7"], "needs greedy runs (--temperature 0), not --temperature 0.7"),
        (["--verify", "static"], "needs the `fixed` verify policy in --verify (got static)"),
        (["--methods", "ar"], "needs the `drafters` group in --methods"),
    ],
)
def test_save_acceptance_that_would_write_nothing_is_refused_before_loading(extra, message, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi"])
    rc, err = run_cli(capsys, *bench_args(NOWHERE, prompts, tmp_path / "d", tmp_path / "out"), *extra)
    assert rc == 2 and f"--save-acceptance would write nothing: it {message}" in err, err
    assert not (tmp_path / "out").exists()  # and no empty --out left behind


def test_save_acceptance_refuses_the_shipped_drafter_unless_asked(
    char_model, drafter_dir, tmp_path, capsys, monkeypatch
):
    """Protects: the installed package is never written by default (here a drafter posing as shipped)."""
    from dominospec.drafter import checkpoint

    shipped = copy_dataset(drafter_dir, tmp_path / "package" / "shipped")
    monkeypatch.setattr(checkpoint, "SHIPPED_ROOT", (tmp_path / "package").resolve())
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi"])
    rc, err = run_cli(capsys, *bench_args(char_model, prompts, shipped, tmp_path / "out"))
    assert rc == 2 and "--save-acceptance would write into the installed package" in err, err
    assert not (tmp_path / "out" / "results.json").exists()  # refused before the benchmark ran
    rc, err = run_cli(capsys, *bench_args(char_model, prompts, shipped, tmp_path / "out"), "--into-package")
    assert rc == 0 and (shipped / "acceptance.json").exists(), err  # control: allowed when asked


def test_save_acceptance_checks_the_drafter_folder_is_writable_first(char_model, drafter_dir, tmp_path, capsys):
    d = copy_dataset(drafter_dir, tmp_path / "d")
    (d / f".write-test.{os.getpid()}").mkdir()  # the probe cannot be written: an unwritable folder, even for root
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi"])
    rc, err = run_cli(capsys, *bench_args(char_model, prompts, d, tmp_path / "out"))
    assert rc == 2 and f"--save-acceptance: drafter directory {d} is not writable" in err, err
    assert not (tmp_path / "out" / "results.json").exists()


def test_save_acceptance_never_writes_a_run_that_measured_nothing(char_model, drafter_dir, tmp_path, capsys):
    d = copy_dataset(drafter_dir, tmp_path / "d")
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi"])
    rc, err = run_cli(capsys, *bench_args(char_model, prompts, d, tmp_path / "out"), "--max-new-tokens", "1")
    assert rc == 2 and "the run measured no draft cycle" in err and "no acceptance.json was written" in err, err
    assert not (d / "acceptance.json").exists()
    rc, err = run_cli(capsys, *bench_args(char_model, prompts, d, tmp_path / "out2"))  # control
    assert rc == 0 and json.loads((d / "acceptance.json").read_text())["cycles"] > 0, err


def test_bench_drafter_lookup_says_what_to_use(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi"])
    rc, err = run_cli(
        capsys, "bench", "--target", NOWHERE, "--prompts", prompts, "--drafter", "lookup", "--out", tmp_path
    )
    assert rc == 2 and "bench takes no --drafter lookup" in err and "--methods ar,lookup" in err, err


# ----- 5. silently wrong choices -----


def test_a_new_drafter_removes_the_sidecars_of_the_old_one(char_model, drafter_dir, tmp_path, capsys):
    d = copy_dataset(drafter_dir, tmp_path / "d")
    (d / "acceptance.json").write_text('{"conditional": [0.9, 0.9]}')
    (d / "calibration.json").write_text('{"temperatures": [1, 1]}')
    rc, err = run_cli(capsys, "init", "--target", char_model, "--out", d, "--layers", "1", "--block-size", "2")
    assert rc == 0 and f"removed {d / 'acceptance.json'}" in err
    assert sorted(p.name for p in d.iterdir() if not p.name.startswith(".")) == ["config.json", "model.safetensors"]


def test_extend_adds_a_different_run_that_has_the_same_settings(dataset, shared_dir, tmp_path):
    """Protects: 'already held' means the same samples, not merely the same settings."""
    from dominospec.data.extend import add_part

    ds = copy_dataset(dataset, tmp_path / "ds")
    run = copy_dataset(shared_dir / "run0", tmp_path / "run")
    assert add_part(ds, run, exist_ok=True)["name"] == "part-000"  # control: the same run is found
    shard = run / "samples-00000.jsonl"
    lines = shard.read_text().splitlines()
    sample = json.loads(lines[0])
    sample["input_ids"][-1] = (sample["input_ids"][-1] + 1) % 40  # another model's answer, same settings
    shard.write_text("\n".join([json.dumps(sample), *lines[1:]]) + "\n")
    said = []
    assert add_part(ds, run, exist_ok=True, report=said.append)["name"] == "part-001"
    assert "has the settings of part-000" in said[0]


def test_a_target_is_known_by_content_not_by_spelling(char_model, shared_dir, tmp_path, monkeypatch, capsys):
    from dominospec import Target

    prompts = write_prompts(tmp_path / "p.jsonl", ["hi", "ok"])
    out = tmp_path / "run"
    assert run_cli(capsys, *prepare_args(char_model, prompts, out))[0] == 0
    monkeypatch.chdir(char_model.parent)
    for spelling in (char_model.name + "/", char_model.name, f"./{char_model.name}"):
        rc, err = run_cli(capsys, *prepare_args(spelling, prompts, out))
        assert rc == 0 and "already complete" in err, (spelling, err)
    other = save_char_model(tmp_path / "other", CONTEXT, seed=1)  # same config and tokenizer, other weights
    a, b = Target.load(str(char_model), device="cpu"), Target.load(str(other), device="cpu")
    assert a.fingerprint == Target.load(char_model.name + "/", device="cpu").fingerprint
    assert a.fingerprint != b.fingerprint
    with pytest.raises(DominoError, match="written by target"):
        load_dataset_dir(out, b)
    assert load_dataset_dir(out, a)[1]  # control


def test_the_feature_cache_is_keyed_by_the_target_and_remakes_a_damaged_file(tmp_path):
    from conftest import tiny_drafter, tiny_target

    from dominospec.train.trainer import TrainConfig, Trainer

    samples = [{"id": "c:0", "input_ids": [3, 5, 7, 9, 11, 13], "loss_mask": [0, 0, 1, 1, 1, 1]}]
    a, b = tiny_target("llama", seed=0), tiny_target("llama", seed=1)
    d = tiny_drafter(a, head="none", block_size=2)
    cache = tmp_path / "cache"
    cache.mkdir()

    def trainer(target, out):
        return Trainer(target, d, samples, tmp_path / out, TrainConfig(), feature_cache=cache, progress=False)

    first, second = trainer(a, "a"), trainer(b, "b")
    assert first._cache_path(0) != second._cache_path(0)
    fresh = first.features([0])[0][0]
    path = first._cache_path(0)
    path.write_bytes(path.read_bytes()[:50])  # a write cut short
    again = trainer(a, "c").features([0])[0][0]
    assert again.shape == fresh.shape and path.stat().st_size > 50  # remade, not trusted


# ----- 6. calibrate keeps a better-founded calibration -----


def test_calibrate_keeps_a_calibration_resting_on_more_cycles(char_model, drafter_dir, tmp_path, capsys):
    d = copy_dataset(drafter_dir, tmp_path / "d")
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi", "ok"])
    argv = ["calibrate", "--target", char_model, "--drafter", d, "--prompts", prompts, "--no-plots"]
    argv += ["--max-new-tokens", "12"]
    rc, err = run_cli(capsys, *argv)
    assert rc == 0 and "ECE over all positions (weighted by cycles): raw" in err, err
    written = json.loads((d / "calibration.json").read_text())
    old = {**written, "cycles": 10**6}
    (d / "calibration.json").write_text(json.dumps(old))
    rc, err = run_cli(capsys, *argv)
    assert rc == 0 and f"kept {d / 'calibration.json'}: it rests on 1000000 cycles" in err, err
    assert json.loads((d / "calibration.json").read_text())["cycles"] == 10**6
    rc, err = run_cli(capsys, *argv, "--force")
    assert rc == 0 and json.loads((d / "calibration.json").read_text())["cycles"] == written["cycles"]


# ----- 7. damaged files: a message, never a traceback -----


def _damage_manifest(ds: Path, change) -> None:
    path = ds / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "damage, message",
    [
        ("directory", "manifest.json is a directory, expected a JSON file"),
        ("empty", "manifest.json is empty"),
        ("truncated", "manifest.json is not valid JSON"),
        ("list", "manifest.json: expected a JSON object"),
        ("no parts", "manifest.json: missing 'parts'"),
        ("parts null", "manifest.json: 'parts' is null"),
        ("parts string", "manifest.json: 'parts' must be a list, found a string"),
        ("no files", "part-000: missing 'files'"),
        ("no settings", "part-000: missing 'settings'"),
        ("part a number", "part 0: expected an object"),
        ("bad checksum", "file entry 'meta.json'"),
    ],
)
def test_a_damaged_manifest_is_named_not_a_traceback(damage, message, dataset, tmp_path, capsys):
    ds = copy_dataset(dataset, tmp_path / "ds")
    path = ds / "manifest.json"
    if damage == "directory":
        path.unlink()
        path.mkdir()
    elif damage == "empty":
        path.write_text("")
    elif damage == "truncated":
        path.write_text(path.read_text()[:40])
    elif damage == "list":
        path.write_text("[]")
    else:
        change = {
            "no parts": lambda m: m.pop("parts"),
            "parts null": lambda m: m.update(parts=None),
            "parts string": lambda m: m.update(parts="part-000"),
            "no files": lambda m: m["parts"][0].pop("files"),
            "no settings": lambda m: m["parts"][0].pop("settings"),
            "part a number": lambda m: m.update(parts=[7]),
            "bad checksum": lambda m: m["parts"][0]["files"].update({"meta.json": 5}),
        }[damage]
        _damage_manifest(ds, change)
    with pytest.raises(DominoError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_dataset_dir(ds)
    rc, err = run_cli(capsys, "train", "--target", NOWHERE, "--data", ds, "--out", tmp_path / "out")
    assert rc == 2 and message in err and "Traceback" not in err  # checked before the model loads


def test_a_shard_that_is_a_directory_is_named(dataset, tmp_path):
    ds = copy_dataset(dataset, tmp_path / "ds")
    shard = next((ds / "part-000").glob("samples-*.npz"))
    shard.unlink()
    shard.mkdir()
    with pytest.raises(DominoError, match=f"{shard} is listed in .* as a file but is a directory"):
        load_dataset_dir(ds)


def test_a_corrupt_compact_shard_is_named(tmp_path):
    from dominospec.data.store import read_npz_shard

    bad = tmp_path / "samples-00000.npz"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(DominoError, match="not a readable compact shard"):
        read_npz_shard(bad)


def test_a_prompt_argument_that_is_not_utf8_is_refused(capsys):
    prompt = b"caf\xe9".decode("utf-8", "surrogateescape")  # what Python makes of a Latin-1 argv byte
    rc, err = run_cli(capsys, "generate", prompt, "--target", NOWHERE)
    assert rc == 2 and "PROMPT is not UTF-8 text" in err


def test_output_piped_into_head_ends_quietly(tmp_path):
    code = (
        "import sys\n"
        "from dominospec.cli import generate, main\n"
        "def spam(args):\n"
        "    for i in range(10**6):\n"
        "        print('line', i)\n"
        "generate.cmd_generate = spam\n"
        "sys.exit(main(['generate', 'hi']))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    r = subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -c "$CODE" | head -1'],
        env={**env, "CODE": code},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.stdout == "line 0\n"
    assert "Traceback" not in r.stderr and "BrokenPipe" not in r.stderr, r.stderr


def test_a_full_disk_is_found_before_generation(char_model, tmp_path, capsys, monkeypatch):
    import shutil
    from collections import namedtuple

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(10**9, 10**9 - 4096, 4096))
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi", "ok"])
    rc, err = run_cli(capsys, *prepare_args(NOWHERE, prompts, tmp_path / "out"))
    assert rc == 2 and f"--out {tmp_path / 'out'}: only 0.0 MiB free on its disk" in err, err


# ----- 8. smaller -----


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"conditional": [0.9, NaN]}', "entry 1 is nan; each must be a number in [0, 1]"),
        ('{"conditional": [1.5]}', "entry 0 is 1.5"),
        ('{"conditional": [-0.1]}', "entry 0 is -0.1"),
        ('{"conditional": []}', "'conditional' is empty: the run that wrote it measured no draft cycle"),
        ('{"conditional": "0.9"}', "expected a non-empty list of probabilities, found a string"),
        ("", "is empty"),
    ],
)
def test_acceptance_json_is_range_checked(content, message, tmp_path):
    from dominospec.tune.profile import read_acceptance

    path = tmp_path / "acceptance.json"
    path.write_text(content)
    with pytest.raises(DominoError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_acceptance(path)
    path.write_text('{"conditional": [0.9, 0.5, 0]}')
    assert read_acceptance(path) == [0.9, 0.5, 0.0]  # control


def test_a_prompt_line_that_is_not_utf8_is_named_by_file_and_line(tmp_path):
    from dominospec.data.prompts import read_prompt_file

    path = tmp_path / "p.jsonl"
    path.write_bytes(b'{"prompt": "hi"}\n{"prompt": "caf\xe9"}\n{"prompt": "ok"}\n')
    said = []
    convs = read_prompt_file(path, report=said.append)
    assert [c.turns[0] for c in convs] == ["hi", "ok"]  # no U+FFFD smuggled in
    assert said[0] == f"{path}:2: not UTF-8 text (byte 0xe9 at column 16); line skipped"
    with pytest.raises(DominoError, match=f"{path}:2: not UTF-8 text"):
        read_prompt_file(path, on_error="fatal")


def test_init_from_layer_names_the_value_given():
    from conftest import tiny_target

    from dominospec import Drafter
    from dominospec.train.samples import init_from_target_layer

    target = tiny_target("llama", layers=4)

    def drafter():
        return Drafter.for_target(target, head="none", num_layers=2, block_size=2)

    message = r"--init-from-layer 3 is out of range: the drafter's 2 layer\(s\) would copy target layers 3..4,"
    with pytest.raises(DominoError, match=message):
        init_from_target_layer(drafter(), target, 3)
    assert init_from_target_layer(drafter(), target, 2)  # control: layers 2..3 fit


def test_dev_null_is_not_called_missing(tmp_path, capsys):
    rc, err = run_cli(capsys, "bench", "--target", NOWHERE, "--prompts", "/dev/null", "--out", tmp_path)
    assert rc == 2 and "--prompts /dev/null is not a regular file" in err, err


def test_profile_refuses_contexts_that_do_not_fit(char_model, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DOMINOSPEC_CACHE", str(tmp_path / "cache"))
    rc, err = run_cli(capsys, "profile", "--target", char_model, "--no-draft", "--contexts", "32,60", "--max-k", "8")
    assert rc == 2 and "--contexts 60: the target's context of 64 positions leaves no room" in err, err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["prepare-data", "--prompts", "self:x"], "--prompts 'self:x': expected self:N with an integer N"),
        (["prepare-data", "--prompts", "self:0"], "--prompts 'self:0': N must be at least 1"),
        (["train", "--data", "{tmp}", "--val-data", "{tmp}/none"], "--val-data {tmp}/none: no such directory"),
    ],
)
def test_prompt_specs_and_val_data_are_checked_before_the_model_loads(argv, message, tmp_path, capsys):
    write_prompts(tmp_path / "x.jsonl", ["hi"])
    (tmp_path / "meta.json").write_text(json.dumps({"format": "dominospec-data/1", "vocab_size": 10}))
    argv = [a.format(tmp=tmp_path) for a in argv]
    rc, err = run_cli(capsys, *argv, "--target", NOWHERE, "--out", tmp_path / "out")
    assert rc == 2 and message.format(tmp=tmp_path) in err, err
    assert not (tmp_path / "out").exists()


def test_a_refused_run_leaves_no_empty_out_behind(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi"])
    out = tmp_path / "new" / "out"
    rc, err = run_cli(capsys, *prepare_args(NOWHERE, prompts, out))  # refused only when the target fails to load
    assert rc == 2 and "no such directory" in err
    assert not (tmp_path / "new").exists()


def test_profile_checks_its_cache_is_writable_before_loading(tmp_path, capsys, monkeypatch):
    blocked = tmp_path / "cache"
    blocked.write_text("a file where the cache directory should be")
    monkeypatch.setenv("DOMINOSPEC_CACHE", str(blocked))
    rc, err = run_cli(capsys, "profile", "--target", NOWHERE, "--no-draft")
    assert rc == 2 and f"the profile cache (DOMINOSPEC_CACHE) {blocked / 'profiles'} is not writable" in err, err


def test_self_written_questions_are_kept_for_a_resumed_run(tmp_path, monkeypatch):
    """Protects: resuming a self:N run reuses the target's questions instead of writing them again."""
    from types import SimpleNamespace

    from dominospec.data import sources
    from dominospec.data.prompts import Conversation

    calls = []

    def write(target, n, seed, report=None):
        calls.append(n)
        return [Conversation((f"question {i} of {seed}",), f"self-chat:{i}") for i in range(n)]

    monkeypatch.setattr(sources, "self_written_prompts", write)
    target = SimpleNamespace(name="t")
    first, _ = sources.load_prompts(["self:3"], seed=5, target=target, keep_in=tmp_path)
    said = []
    again, _ = sources.load_prompts(["self:3"], seed=5, target=target, keep_in=tmp_path, report=said.append)
    assert calls == [3] and again == first and "kept in" in said[0]
    sources.load_prompts(["self:3"], seed=5, target=SimpleNamespace(name="other"), keep_in=tmp_path)
    assert calls == [3, 3]  # another target writes its own


def test_a_damaged_jsonl_shard_is_named(char_model, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "p.jsonl", ["hi", "ok"])
    assert run_cli(capsys, *prepare_args(char_model, prompts, tmp_path / "run"))[0] == 0
    shard = tmp_path / "run" / "samples-00000.jsonl"
    shard.write_bytes(shard.read_bytes()[:20] + b"\xff\xfe" + shard.read_bytes()[20:])
    with pytest.raises(DominoError, match=f"{shard}:1: not UTF-8 text"):
        load_dataset_dir(tmp_path / "run")
    shard.unlink()
    shard.mkdir()
    with pytest.raises(DominoError, match=f"{shard} is not a file"):
        load_dataset_dir(tmp_path / "run")
