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
from conftest import save_char_model

from dominospec import DominoError, cli
from dominospec.data.dataset import load_dataset_dir
from dominospec.data.store import read_manifest

CONTEXT = 64
NOWHERE = "/nonexistent/target-that-must-not-load"  # an argument error must be reported before this loads
SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("reliability2")


@pytest.fixture(scope="module")
def char_model(shared_dir) -> Path:
    return save_char_model(shared_dir / "char-model", CONTEXT)


def write_prompts(path: Path, texts) -> Path:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def run_cli(capsys, *argv) -> tuple[int, str]:
    """(exit code, stderr) of one dominospec command, run in this process."""
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


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
