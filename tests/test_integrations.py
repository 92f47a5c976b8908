"""transformers' own `model.generate(..., custom_generate=...)` running dominospec, and the real Qwen3 tokenizer."""

import gc
import json
import os

import pytest
import torch
from conftest import tiny_drafter, tiny_target
from transformers import StoppingCriteria, StoppingCriteriaList, TextStreamer

import dominospec.integrations.transformers as hfi
from dominospec.cli import build_parser, main
from dominospec.data.dataset import load_dataset_dir
from dominospec.data.prepare import ChatCodec, SampleBuilder
from dominospec.integrations import domino_generate, write_custom_generate

PROMPT = torch.tensor([[1, 5, 9, 14, 3, 7]])


@pytest.fixture(scope="module")
def tiny32():
    """A float32 Llama target with a drafter (float32: what transformers users run on CPU)."""
    target = tiny_target("llama", dtype=torch.float32)
    return target.model, tiny_drafter(target)


class Recorder:
    """Wraps a decoding loop of the integration module and keeps what it returned."""

    def __init__(self, monkeypatch, name):
        self.results, self.kwargs, inner = [], [], getattr(hfi, name)

        def spy(*args, **kwargs):
            self.kwargs.append((args, kwargs))
            self.results.append(inner(*args, **kwargs))
            return self.results[-1]

        monkeypatch.setattr(hfi, name, spy)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("drafter", ["tiny", "lookup", None])
def test_greedy_custom_generate_equals_plain_generate(family, drafter, monkeypatch):
    target = tiny_target(family, dtype=torch.float32)
    model = target.model
    plain = model.generate(PROMPT, max_new_tokens=40, do_sample=False)
    loop = Recorder(monkeypatch, "run_spec")
    given = tiny_drafter(target) if drafter == "tiny" else drafter
    ours = model.generate(PROMPT, max_new_tokens=40, do_sample=False, custom_generate=domino_generate, drafter=given)
    assert torch.equal(ours, plain)
    assert ours.shape == (1, PROMPT.shape[1] + 40)
    # control: dominospec's loop ran (not transformers' own), speculative when a proposer was given
    assert len(loop.results) == 1 and loop.results[0].new_tokens == 40
    assert loop.kwargs[0][0][0].proposer == {"tiny": "drafter", "lookup": "lookup", None: "none"}[drafter]
    assert (loop.results[0].cycles > 0) == (drafter is not None)


def test_streams_through_a_text_streamer(tiny32, capsys):
    model, drafter = tiny32

    class Digits:  # the streamer only needs decode()
        def decode(self, ids, **_):
            return "".join(f"{i} " for i in ids)

    streamer = TextStreamer(Digits(), skip_prompt=True)
    out = model.generate(PROMPT, max_new_tokens=12, custom_generate=domino_generate, drafter=drafter, streamer=streamer)
    printed = capsys.readouterr().out
    assert printed.strip() == Digits().decode(out[0, PROMPT.shape[1] :].tolist()).strip()
    assert printed.count(" ") == 12  # every new token once, none of the prompt's


def test_honours_max_new_tokens_and_eos(tiny32):
    model, drafter = tiny32
    plain = model.generate(PROMPT, max_new_tokens=20, do_sample=False)
    eos = int(plain[0, PROMPT.shape[1] + 6])  # a token greedy writes 7th: stop there
    want = model.generate(PROMPT, max_new_tokens=20, do_sample=False, eos_token_id=eos)
    ours = model.generate(PROMPT, max_new_tokens=20, custom_generate=domino_generate, drafter=drafter, eos_token_id=eos)
    assert torch.equal(ours, want) and int(ours[0, -1]) == eos and ours.shape[1] <= PROMPT.shape[1] + 7
    short = model.generate(PROMPT, max_new_tokens=3, custom_generate=domino_generate, drafter=drafter)
    assert torch.equal(short, plain[:, : PROMPT.shape[1] + 3])


def test_honours_a_user_stopping_criterion_token_by_token(tiny32):
    model, drafter = tiny32
    plain = model.generate(PROMPT, max_new_tokens=20, do_sample=False)
    stop_at = int(plain[0, PROMPT.shape[1] + 4])

    class StopOn(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == stop_at

    crit = StoppingCriteriaList([StopOn()])
    want = model.generate(PROMPT, max_new_tokens=20, do_sample=False, stopping_criteria=crit)
    ours = model.generate(
        PROMPT, max_new_tokens=20, stopping_criteria=crit, custom_generate=domino_generate, drafter=drafter
    )
    assert torch.equal(ours, want) and ours.shape[1] < plain.shape[1]


def test_return_dict_in_generate_gives_the_sequences(tiny32):
    model, drafter = tiny32
    out = model.generate(
        PROMPT, max_new_tokens=8, return_dict_in_generate=True, custom_generate=domino_generate, drafter=drafter
    )
    assert type(out).__name__ == "GenerateDecoderOnlyOutput"
    assert torch.equal(out.sequences, model.generate(PROMPT, max_new_tokens=8, do_sample=False))


def test_left_padding_is_dropped_at_batch_one(tiny32):
    model, drafter = tiny32
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), PROMPT], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(PROMPT)], dim=1)
    out = model.generate(
        padded, attention_mask=mask, max_new_tokens=10, custom_generate=domino_generate, drafter=drafter
    )
    plain = model.generate(PROMPT, max_new_tokens=10, do_sample=False)
    assert torch.equal(out[:, :9], padded) and torch.equal(out[:, 9:], plain[:, PROMPT.shape[1] :])


def test_sampling_settings_reach_the_loop_and_torch_seed_repeats_a_call(tiny32, monkeypatch):
    model, drafter = tiny32
    spy = Recorder(monkeypatch, "run_spec")
    settings = dict(max_new_tokens=16, do_sample=True, temperature=0.7, top_k=9, top_p=0.9)
    runs = []
    for _ in range(2):
        torch.manual_seed(3)
        runs.append(model.generate(PROMPT, **settings, custom_generate=domino_generate, drafter=drafter))
    assert torch.equal(runs[0], runs[1])
    sampling = spy.kwargs[0][0][4]
    assert (sampling.temperature, sampling.top_k, sampling.top_p) == (0.7, 9, 0.9)
    torch.manual_seed(4)
    other = model.generate(PROMPT, **settings, custom_generate=domino_generate, drafter=drafter)
    assert not torch.equal(other, runs[0])  # control: the seed does reach the loop


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_beams=2), "num_beams=2"),
        (dict(repetition_penalty=1.3), "RepetitionPenaltyLogitsProcessor"),
        (dict(min_new_tokens=4), "MinNewTokensLengthLogitsProcessor"),
        (dict(do_sample=True, num_return_sequences=2), "num_return_sequences=2"),
        (dict(prompt_lookup_num_tokens=3), "drafter='lookup'"),
        (dict(return_dict_in_generate=True, output_scores=True), "output_scores=True"),
        (dict(input_ids=PROMPT.repeat(2, 1)), "batch 1"),
        (dict(drafter=12), "drafter=12"),
    ],
)
def test_unsupported_settings_are_refused_by_name(tiny32, kwargs, message):
    model, _ = tiny32
    kwargs = {"input_ids": PROMPT, "max_new_tokens": 5, **kwargs}
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        model.generate(**kwargs, custom_generate=domino_generate)


def test_native_weights_are_packed_once_per_model_and_follow_weight_updates():
    model = tiny_target("llama", dtype=torch.float32).model
    for p in model.parameters():
        p.requires_grad_(True)
    model.train()
    first = hfi.target_for(model)
    assert first.backend == "native"
    assert hfi.target_for(model).native is first.native  # no repacking on the next call
    assert all(p.requires_grad for p in model.parameters()) and model.training  # the user's model as it was
    with torch.no_grad():
        model.lm_head.weight.mul_(0.5)  # an optimizer step would do the same: an in-place update
    assert hfi.target_for(model).native is not first.native
    model.eval()
    plain = model.generate(PROMPT, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(PROMPT, max_new_tokens=12, custom_generate=domino_generate), plain)
    before = len(hfi._NATIVE)
    del model, first
    gc.collect()
    assert len(hfi._NATIVE) == before - 1  # the packed copy dies with the model


def test_a_drafter_directory_is_loaded_once_and_again_when_rewritten(tiny32, tmp_path, monkeypatch):
    model, drafter = tiny32
    drafter.save_pretrained(tmp_path / "d")
    loads = []
    original = hfi.Drafter.from_pretrained
    monkeypatch.setattr(hfi.Drafter, "from_pretrained", lambda *a, **k: loads.append(a) or original(*a, **k))
    for _ in range(2):
        model.generate(PROMPT, max_new_tokens=4, custom_generate=domino_generate, drafter=str(tmp_path / "d"))
    assert len(loads) == 1
    os.utime(tmp_path / "d" / "model.safetensors", ns=(1, 1))  # as a new training run would leave it
    model.generate(PROMPT, max_new_tokens=4, custom_generate=domino_generate, drafter=tmp_path / "d")
    assert len(loads) == 2


def test_custom_generate_directory_runs_with_trust_remote_code(tiny32, tmp_path, capsys):
    model, drafter = tiny32
    drafter.save_pretrained(tmp_path / "drafter-cg")
    assert main(["custom-generate", str(tmp_path / "drafter-cg")]) == 0
    path = tmp_path / "drafter-cg" / "custom_generate" / "generate.py"
    assert capsys.readouterr().out.strip() == str(path)
    assert str(tmp_path / "drafter-cg") in path.read_text()
    plain = model.generate(PROMPT, max_new_tokens=16, do_sample=False)
    ours = model.generate(
        PROMPT, max_new_tokens=16, custom_generate=str(tmp_path / "drafter-cg"), trust_remote_code=True
    )
    assert torch.equal(ours, plain)
    with pytest.raises(ValueError, match="trust_remote_code"):
        model.generate(PROMPT, max_new_tokens=4, custom_generate=str(tmp_path / "drafter-cg"))


def test_custom_generate_refuses_a_directory_without_a_drafter(tmp_path):
    with pytest.raises(Exception, match="config.json"):
        write_custom_generate(tmp_path)
    with pytest.raises(Exception, match="--out"):
        write_custom_generate("lookup")
    assert write_custom_generate("lookup", tmp_path / "lk").read_text().count("'lookup'") == 1


def test_enable_thinking_flags_parse_and_default_off():
    parser = build_parser()
    assert parser.parse_args(["generate", "hi"]).enable_thinking is False
    assert parser.parse_args(["generate", "hi", "--enable-thinking"]).enable_thinking is True
    args = parser.parse_args(["prepare-data", "--prompts", "builtin:2", "--out", "x", "--enable-thinking"])
    assert args.enable_thinking is True


# ----- SmolLM2 (the bundled real model), fp32 -----


@pytest.fixture(scope="module")
def smollm2_plain():
    """The bundled model in fp32 and transformers' plain greedy answers to two chat prompts."""
    from dominospec import Target

    smollm = Target.load("smollm2-135m", device="cpu", dtype="float32", backend="hf")
    prompts = [
        torch.tensor([smollm.encode_chat(q)])
        for q in ("Write a Python function that reverses a string.", "What is 17 * 23? Explain briefly.")
    ]
    return smollm.model, smollm.tokenizer, [(ids, smollm.model.generate(ids, max_new_tokens=32)) for ids in prompts]


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["hf", "auto"])
def test_smollm2_custom_generate_equals_plain_generate(smollm2_plain, backend):
    from dominospec.drafter import shipped_drafter_dir

    model, tok, cases = smollm2_plain
    for ids, plain in cases:
        ours = model.generate(
            ids,
            max_new_tokens=32,
            custom_generate=domino_generate,
            drafter=str(shipped_drafter_dir("smollm2-135m")),
            backend=backend,
        )
        assert tok.decode(ours[0]) == tok.decode(plain[0])


# ----- the real Qwen3 tokenizer around a tiny random Qwen3 -----

THINK, END_THINK, IM_END = 151667, 151668, 151645


def test_real_qwen3_tokenizer_is_the_published_one(qwen3_real):
    tok = qwen3_real.tokenizer
    assert len(tok) == 151669 == qwen3_real.vocab_size
    assert tok.convert_tokens_to_ids(["<|im_end|>", "<think>", "</think>"]) == [IM_END, THINK, END_THINK]
    assert qwen3_real.eos_ids == [IM_END]


def test_thinking_switch_adds_or_drops_exactly_the_empty_think_block(qwen3_real):
    tok = qwen3_real.tokenizer
    on = qwen3_real.encode_chat("What is 2 + 2?", enable_thinking=True)
    off = qwen3_real.encode_chat("What is 2 + 2?")
    empty_block = tok("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"]
    assert off == on + empty_block and empty_block[0] == THINK and END_THINK in empty_block
    assert tok.decode(on).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("thinking", [False, True])
def test_qwen3_loss_mask_covers_exactly_the_assistant_turn(qwen3_real, thinking):
    tok = qwen3_real.tokenizer
    codec = ChatCodec.for_target(qwen3_real, enable_thinking=thinking)
    answer_text = ("<think>\nadd them\n</think>\n\n" if thinking else "") + "2 + 2 = 4."
    answer = tok(answer_text, add_special_tokens=False)["input_ids"] + [IM_END]
    history = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = codec.encode(history)
    builder = SampleBuilder("c")
    builder.add_turn(0, prompt, answer)
    history += [{"role": "assistant", "content": codec.decode(answer)}, {"role": "user", "content": "And 3 + 3?"}]
    second_prompt = codec.encode(history)
    second_answer = tok("6.", add_special_tokens=False)["input_ids"] + [IM_END]
    builder.add_turn(1, second_prompt, second_answer)
    samples = builder.samples()
    first = samples[0]
    # token by token: the rendered prompt (the empty think block of thinking-off included) is context,
    # the answer (its own think block in thinking mode, and <|im_end|>) is supervised
    for i, (tid, m) in enumerate(zip(first["input_ids"], first["loss_mask"])):
        assert m == (i >= len(prompt)), (i, tok.decode([tid]))
    supervised = [t for t, m in zip(first["input_ids"], first["loss_mask"]) if m]
    assert supervised[: len(answer)] == answer and tok.decode(answer).startswith(answer_text[:6])
    assert (THINK in prompt) == (not thinking) and (THINK in supervised) == thinking
    # Qwen3's template renders a past assistant turn without any think block (the empty one of thinking-off
    # mode included), so turn 2's prompt does not extend turn 1's sample: it starts a new one, in both modes
    assert len(samples) == 2 and samples[1]["id"] == "c/1"
    last = samples[1]
    assert last["input_ids"] == second_prompt + second_answer
    assert last["loss_mask"] == [0] * len(second_prompt) + [1] * len(second_answer)
    assert second_prompt.count(THINK) == (0 if thinking else 1)  # only the new turn's empty block, if any


@pytest.mark.slow
def test_qwen3_pipeline_through_the_cli_records_the_thinking_mode(qwen3_real, tmp_path, capsys):
    """prepare-data in both modes (recorded) -> train -> generate (says when the mode differs) -> custom_generate."""
    target_dir, prompts = tmp_path / "qwen3-tiny", tmp_path / "prompts.jsonl"
    qwen3_real.model.save_pretrained(target_dir)
    qwen3_real.tokenizer.save_pretrained(target_dir)
    prompts.write_text('{"turns": ["Name a colour."]}\n{"turns": ["Hi!", "Count to three."]}\n')
    common = ["--target", str(target_dir), "--dtype", "float32", "--backend", "hf"]
    for thinking in (False, True):
        out = tmp_path / f"thinking-{thinking}"
        flags = ["--prompts", str(prompts), "--out", str(out), "--max-new-tokens", "6", "--batch-size", "2"]
        flags += ["--extend", str(tmp_path / "dataset")]
        assert main(["prepare-data", *common, *flags] + (["--enable-thinking"] if thinking else [])) == 0
        meta, samples = load_dataset_dir(out)
        assert meta["enable_thinking"] is thinking
        # thinking off: the history loses turn 1's empty think block, so turn 2 starts a new sample; thinking on:
        # this random model writes no think block, so its history re-renders as a prefix and stays one sample
        ids = ["prompts:1", "prompts:2"] + ([] if thinking else ["prompts:2/1"])  # <file>:<line>
        assert [x["id"] for x in samples] == ids
        first = samples[0]
        start = first["loss_mask"].index(1)
        prompt = qwen3_real.encode_chat("Name a colour.", enable_thinking=thinking)
        assert first["input_ids"][:start] == prompt and not any(first["loss_mask"][:start])
    manifest = json.loads((tmp_path / "dataset" / "manifest.json").read_text())
    assert [p["settings"]["enable_thinking"] for p in manifest["parts"]] == [False, True]
    assert load_dataset_dir(tmp_path / "dataset")[0]["enable_thinking"] is None  # parts in both modes
    capsys.readouterr()
    other_mode = ["--prompts", str(prompts), "--out", str(tmp_path / "thinking-False"), "--max-new-tokens", "6"]
    assert main(["prepare-data", *common, *other_mode, "--batch-size", "2", "--enable-thinking"]) == 2
    assert "enable_thinking: False there, True now" in capsys.readouterr().err

    drafter_dir = tmp_path / "drafter"
    arch = ["--layers", "1", "--block-size", "4", "--intermediate-size", "48", "--gru-hidden-size", "16", "--rank", "8"]
    train = ["--data", str(tmp_path / "thinking-True"), "--out", str(drafter_dir), "--max-steps", "3"]
    assert main(["train", *common, *train, *arch, "--batch-size", "2", "--val-fraction", "0"]) == 0
    assert json.loads((drafter_dir / "config.json").read_text())["extra"] == {"enable_thinking": True}
    for thinking in (True, False):
        capsys.readouterr()
        flags = ["--drafter", str(drafter_dir), "--max-new-tokens", "4"] + (["--enable-thinking"] if thinking else [])
        assert main(["generate", "Name a colour.", *common, *flags]) == 0
        assert ("trained on data made with thinking on" in capsys.readouterr().err) == (not thinking)

    write_custom_generate(drafter_dir)
    model = qwen3_real.model
    inputs = torch.tensor([qwen3_real.encode_chat("Name a colour.", enable_thinking=True)])
    plain = model.generate(inputs, max_new_tokens=16, do_sample=False)
    ours = model.generate(inputs, max_new_tokens=16, custom_generate=str(drafter_dir), trust_remote_code=True)
    assert torch.equal(ours, plain)


@pytest.mark.parametrize("thinking", [False, True])
def test_qwen3_real_tokenizer_generates_through_our_path(qwen3_real, thinking, capsys):
    model, tok = qwen3_real.model, qwen3_real.tokenizer
    messages = [{"role": "user", "content": "Say hello."}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=thinking)
    inputs = tok(text, return_tensors="pt", add_special_tokens=False)
    assert inputs["input_ids"][0].tolist() == qwen3_real.encode_chat("Say hello.", enable_thinking=thinking)
    plain = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    drafter = tiny_drafter(qwen3_real, block_size=4)
    streamer = TextStreamer(tok, skip_prompt=True)
    ours = model.generate(
        **inputs, max_new_tokens=24, custom_generate=domino_generate, drafter=drafter, streamer=streamer
    )
    assert torch.equal(ours, plain)
    new = ours[0, inputs["input_ids"].shape[1] :]
    assert capsys.readouterr().out.strip() == tok.decode(new).strip()


def test_stop_strings_end_the_answer_as_in_transformers(qwen3_real, tmp_path):
    from transformers import StopStringCriteria

    model, tok = qwen3_real.model, qwen3_real.tokenizer
    inputs = tok("Hello world, this is", return_tensors="pt")
    plain = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    stop = tok.decode(plain[0, inputs["input_ids"].shape[1] :])[10:14]  # a piece of text greedy writes
    want = model.generate(**inputs, max_new_tokens=20, do_sample=False, stop_strings=[stop], tokenizer=tok)
    assert want.shape[1] < plain.shape[1]  # control: the stop string does end transformers' answer early
    criterion = StoppingCriteriaList([StopStringCriteria(tok, [stop])])
    ours = model.generate(
        **inputs, max_new_tokens=20, stopping_criteria=criterion, custom_generate=domino_generate, drafter="lookup"
    )
    assert torch.equal(ours, want)
    write_custom_generate("lookup", tmp_path / "qwen-lookup")
    by_path = model.generate(
        **inputs,
        max_new_tokens=20,
        stop_strings=[stop],
        tokenizer=tok,
        custom_generate=str(tmp_path / "qwen-lookup"),
        trust_remote_code=True,
    )
    assert torch.equal(by_path, want)
