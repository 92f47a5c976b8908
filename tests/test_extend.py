"""Data that accumulates: compact parts, extending keeps earlier parts byte-identical, other targets refused,
and the shipped data set holds no held-out benchmark prompt."""

import hashlib
import json
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import CONVERSATIONS, CharCodec, tiny_target
from conftest import PREPARE as CFG

from dominospec import DominoError
from dominospec.data.dataset import load_dataset_dir
from dominospec.data.extend import add_part, check_extendable
from dominospec.data.prepare import prepare_data
from dominospec.data.prompts import Conversation, read_prompt_file
from dominospec.data.store import dataset_prompts, read_manifest, read_npz_shard

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "data" / "smollm2-135m"


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", vocab=64)


def digests(d: Path) -> dict:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file() and p.name not in ("manifest.json", ".lock")
    }


def run(target, tmp_path, name, convs=CONVERSATIONS, cfg=CFG, codec=None):
    prepare_data(target, convs, tmp_path / name, cfg, codec=codec or CharCodec().codec(), progress=False)
    return tmp_path / name


def test_parts_round_trip_and_extending_keeps_earlier_parts_byte_identical(target, tmp_path):
    ds = tmp_path / "ds"
    first = run(target, tmp_path, "a")
    entry = add_part(ds, first, CONVERSATIONS)
    assert entry["name"] == "part-000"
    plain = load_dataset_dir(first, target)[1]
    meta, packed = load_dataset_dir(ds, target)
    assert [s["id"] for s in packed] == [f"part-000:{s['id']}" for s in plain]
    assert [(s["input_ids"], s["loss_mask"]) for s in packed] == [(s["input_ids"], s["loss_mask"]) for s in plain]
    before = digests(ds)

    second = run(target, tmp_path, "b", cfg=replace(CFG, seed=9))
    assert add_part(ds, second, CONVERSATIONS)["name"] == "part-001"
    after = digests(ds)
    assert {k: v for k, v in after.items() if k.startswith("part-000")} == before  # untouched, byte for byte
    manifest = read_manifest(ds)
    assert [p["name"] for p in manifest["parts"]] == ["part-000", "part-001"]
    both = len(plain) + len(load_dataset_dir(second, target)[1])
    assert manifest["counts"]["samples"] == len(load_dataset_dir(ds, target)[1]) == both
    assert {p["id"] for p in dataset_prompts(ds)} == {c.id for c in CONVERSATIONS}
    with pytest.raises(DominoError, match="already in"):
        add_part(ds, second, CONVERSATIONS)
    assert add_part(ds, second, CONVERSATIONS, exist_ok=True)["name"] == "part-001"
    with pytest.raises(DominoError, match="not the ones it was made from"):
        add_part(tmp_path / "ds2", second, CONVERSATIONS[:2])


def test_extending_with_another_tokenizer_or_target_is_refused(target, tmp_path):
    ds = tmp_path / "ds"
    add_part(ds, run(target, tmp_path, "a"), CONVERSATIONS)
    other = replace(CharCodec().codec(), tokenizer_sha256="another-tokenizer")
    with pytest.raises(DominoError, match="tokenizer_sha256"):
        add_part(ds, run(target, tmp_path, "b", cfg=replace(CFG, seed=5), codec=other))
    assert len(read_manifest(ds)["parts"]) == 1 and not (ds / "part-001").exists()
    with pytest.raises(DominoError, match="another target or tokenizer"):
        check_extendable(ds, tiny_target("qwen3", vocab=64))


def test_a_changed_part_is_refused_on_load(target, tmp_path):
    ds = tmp_path / "ds"
    add_part(ds, run(target, tmp_path, "a"), CONVERSATIONS)
    shard = next((ds / "part-000").glob("samples-*.npz"))
    shard.write_bytes(shard.read_bytes()[:-7] + b"garbage")
    with pytest.raises(DominoError, match="checksum"):
        load_dataset_dir(ds, target)


def test_an_incomplete_run_is_not_added(target, tmp_path):
    d = run(target, tmp_path, "a")
    meta = json.loads((d / "meta.json").read_text())
    (d / "meta.json").write_text(json.dumps({**meta, "complete": False}))
    with pytest.raises(DominoError, match="not a complete"):
        add_part(tmp_path / "ds", d)


def _normal(text: str) -> str:
    return " ".join(text.lower().split())


@pytest.mark.skipif(not SHIPPED.exists(), reason="no shipped data set in this checkout")
def test_shipped_data_holds_no_held_out_prompt():
    """Protects: the prompts/eval-* benchmark prompts (and anything near them) never reach training data."""
    manifest = read_manifest(SHIPPED)
    for part in manifest["parts"]:
        for source in part["prompt_sources"]:
            assert "eval-" not in source["spec"] and source["kind"] != "hf", (part["name"], source)
    train = [_normal(t) for c in dataset_prompts(SHIPPED) for t in c["turns"]]
    assert len(train) == manifest["counts"]["conversations"] or len(train) >= manifest["counts"]["conversations"]
    held = [
        _normal(c.turns[0])
        for f in sorted((REPO / "prompts").glob("eval-*.jsonl"))
        for c in read_prompt_file(f, on_error="fatal")
    ]
    assert held
    train_set = set(train)
    for h in held:
        assert h not in train_set
        probe = h[:60]  # a held-out prompt's opening inside a training prompt counts as a leak too
        assert not any(probe in t for t in train), h
    for path in sorted(SHIPPED.glob("part-*/samples-*.npz"))[:1]:
        assert read_npz_shard(path)  # readable


def test_compact_shard_round_trips_in_under_a_byte_and_a_half_per_token(tmp_path):
    import random

    from dominospec.data.store import write_npz_shard

    rng = random.Random(0)
    samples = []
    for i in range(100):  # realistic-ish text: a Zipf-like mix of ids from a 49k vocabulary
        n, p = rng.randrange(200, 600), rng.randrange(20, 80)
        ids = [min(49151, int(rng.paretovariate(0.7))) for _ in range(n)]
        samples.append({"id": f"x:{i}", "input_ids": ids, "loss_mask": [0] * p + [1] * (n - p)})
    write_npz_shard(tmp_path / "s.npz", samples, 49152)
    assert read_npz_shard(tmp_path / "s.npz") == samples
    tokens = sum(len(s["input_ids"]) for s in samples)
    assert (tmp_path / "s.npz").stat().st_size < 1.5 * tokens


def test_validation_split_keeps_conversations_of_a_data_set_apart(target, tmp_path):
    """Protects: part-prefixed ids still split by conversation (and not all into validation)."""
    from dominospec.train.validate import conversation_of, split_validation

    ds = tmp_path / "ds"
    add_part(
        ds, run(target, tmp_path, "a", convs=[Conversation((f"count to {i}", "again"), f"c:{i}") for i in range(40)])
    )
    samples = load_dataset_dir(ds, target)[1]
    train, val = split_validation(samples, 0.2)
    assert train and val
    assert not {conversation_of(s) for s in train} & {conversation_of(s) for s in val}


def test_one_part_of_the_shipped_data_set_loads_alone_with_its_ids():
    """`train --data data/smollm2-135m/part-000` reads exactly what the shipped drafter trained on, with the
    same sample ids (so the same validation split) as when the data set held only that part."""
    from dominospec.data.dataset import load_dataset_dir

    shipped = Path(__file__).resolve().parents[1] / "data" / "smollm2-135m"
    meta, part = load_dataset_dir(shipped / "part-000")
    _, whole = load_dataset_dir(shipped)
    assert meta["parts"] == ["part-000"] and len(part) == meta["counts"]["conversations"] == 1024
    assert len(whole) > len(part)  # control: the data set has grown past that part
    assert [s["id"] for s in part] == [s["id"] for s in whole if s["id"].startswith("part-000:")]
