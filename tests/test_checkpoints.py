"""Drafter checkpoints: round trip, and clear errors for drafters that do not fit or are damaged."""

import json

import pytest
import torch
from conftest import tiny_drafter, tiny_target

from dominospec import DominoError, Drafter, DrafterConfig, generate_speculative
from dominospec.targets import default_layer_ids


@pytest.mark.parametrize(
    "head,confidence,mask_id",
    [("domino", True, None), ("markov", False, 5), ("rnn", False, None), ("none", True, None), ("path", True, None)],
)
def test_save_load_round_trip(tmp_path, qwen3_target, head, confidence, mask_id):
    drafter = tiny_drafter(qwen3_target, head=head, confidence=confidence, mask_token_id=mask_id)
    drafter.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    loaded = Drafter.from_pretrained(tmp_path, target=qwen3_target)
    assert loaded.config == drafter.config
    a, b = drafter.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    x = generate_speculative(qwen3_target, drafter, [1, 2, 3], 12, eos_ids=[])
    y = generate_speculative(qwen3_target, loaded, [1, 2, 3], 12, eos_ids=[])
    assert x.tokens == y.tokens and x.accepted == y.accepted


def test_checkpoint_holds_no_target_tables(tmp_path, qwen3_target):
    from safetensors.torch import load_file

    tiny_drafter(qwen3_target).save_pretrained(tmp_path)
    names = load_file(str(tmp_path / "model.safetensors")).keys()
    vocab_by_hidden = [
        n
        for n, t in load_file(str(tmp_path / "model.safetensors")).items()
        if tuple(t.shape) == (qwen3_target.vocab_size, qwen3_target.hidden_size)
    ]
    assert not vocab_by_hidden and not any("embed_tokens" in n or "lm_head" in n or n.startswith("_") for n in names)


def test_mismatched_target_is_refused_with_both_values(tmp_path, qwen3_target):
    tiny_drafter(qwen3_target).save_pretrained(tmp_path)
    other = tiny_target("llama", vocab=80)
    with pytest.raises(DominoError, match=r"vocab_size: drafter 64 vs target 80"):
        Drafter.from_pretrained(tmp_path, target=other)
    deeper = tiny_target("llama", layers=6)
    with pytest.raises(DominoError, match=r"target_num_layers: drafter 4 vs target 6"):
        Drafter.from_pretrained(tmp_path, target=deeper)


def test_bad_layer_ids_are_refused(tmp_path, qwen3_target):
    tiny_drafter(qwen3_target).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["target_layer_ids"] = [0, 1, 3]  # layer 3 of 4 is the post-norm one
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DominoError, match=r"\[3\] out of range .* 4 decoder layers"):
        Drafter.from_pretrained(tmp_path, target=qwen3_target)


def test_damaged_checkpoints_give_clear_errors(tmp_path, qwen3_target):
    d = tmp_path / "d"
    with pytest.raises(DominoError, match="no such directory"):
        Drafter.from_pretrained(d)
    tiny_drafter(qwen3_target).save_pretrained(d)
    good_cfg = (d / "config.json").read_text()

    (d / "config.json").write_text(good_cfg.replace('"head": "domino"', '"head": "domino",,'))
    with pytest.raises(DominoError, match=r"config.json is not valid JSON \(a drafter config\): .* at line \d+"):
        Drafter.from_pretrained(d)
    (d / "config.json").write_text(good_cfg.replace('"head": "domino"', '"head": "lstm"'))
    with pytest.raises(DominoError, match=r"head 'lstm' is not one of"):
        Drafter.from_pretrained(d)
    (d / "config.json").write_text(good_cfg.replace('"rank": 8', '"rank": 8, "colour": 1'))
    with pytest.raises(DominoError, match=r"unknown drafter config keys \['colour'\]"):
        Drafter.from_pretrained(d)
    (d / "config.json").write_text(good_cfg.replace('"rank": 8', '"rank": 9'))
    with pytest.raises(DominoError, match=r"tensor head\.\S+ has shape"):
        Drafter.from_pretrained(d)
    (d / "config.json").write_text(good_cfg.replace('"head": "domino"', '"head": "none"'))
    with pytest.raises(DominoError, match=r"unexpected tensors \['head\."):
        Drafter.from_pretrained(d)
    (d / "config.json").write_text(good_cfg)

    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(DominoError, match=r"model.safetensors: not a readable safetensors file"):
        Drafter.from_pretrained(d)
    (d / "model.safetensors").unlink()
    with pytest.raises(DominoError, match="missing model.safetensors"):
        Drafter.from_pretrained(d)
    (d / "config.json").unlink()
    with pytest.raises(DominoError, match="missing config.json"):
        Drafter.from_pretrained(d)


def test_block_size_above_the_drafters_is_refused(qwen3_target):
    drafter = tiny_drafter(qwen3_target, block_size=4)
    with pytest.raises(DominoError, match="block size 5 must be between 1 and the drafter's 4"):
        generate_speculative(qwen3_target, drafter, [1, 2], 8, block_size=5)


def test_default_layer_ids_follow_the_published_rule():
    assert default_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_layer_ids(30) == [1, 8, 14, 20, 27]
    for n in range(2, 40):
        ids = default_layer_ids(n)
        assert ids and len(set(ids)) == len(ids) and max(ids) <= n - 2 and min(ids) >= 0


def test_invalid_config_values_are_named():
    with pytest.raises(DominoError, match="num_attention_heads 6 is not a multiple of num_key_value_heads 4"):
        DrafterConfig(
            hidden_size=32,
            vocab_size=10,
            target_num_layers=4,
            target_layer_ids=[1],
            num_attention_heads=6,
            num_key_value_heads=4,
        )


def test_a_drafter_with_nan_weights_is_refused_naming_the_tensor(tmp_path, qwen3_target):
    drafter = tiny_drafter(qwen3_target)
    with torch.no_grad():
        drafter.fc.weight[0, :3] = float("nan")
    drafter.save_pretrained(tmp_path)
    with pytest.raises(
        DominoError,
        match=r"model.safetensors: tensor fc.weight holds 3 NaN/inf value\(s\); the "
        r"drafter is damaged \(a diverged training run\?\)",
    ):
        Drafter.from_pretrained(tmp_path, target=qwen3_target)


def test_a_file_given_as_drafter_is_called_a_file(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    with pytest.raises(
        DominoError,
        match=rf"drafter {path} is a file; a drafter is a directory holding config.json "
        "and model.safetensors",
    ):
        Drafter.from_pretrained(path)
