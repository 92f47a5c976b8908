"""Prompts the target writes itself (--prompts self:N): the open user turn, the filters, the ids."""

import pytest
from conftest import SMOL_LIKE, char_level_target

from dominospec import DominoError
from dominospec.data import selfwritten
from dominospec.data.selfwritten import self_written_prompts
from dominospec.data.sources import load_prompts


@pytest.fixture(scope="module")
def target():
    return char_level_target(SMOL_LIKE)


def test_the_template_is_opened_at_a_user_turn(target):
    ids = target.open_user_turn("Explain ")
    assert target.tokenizer.decode(ids) == "<|im_start|>user\nExplain "


def test_unfinished_short_repetitive_and_repeated_questions_are_dropped(target, monkeypatch):
    eos = target.eos_ids[0]
    enc = target.tokenizer

    def ids(text, end=True):
        return enc(text, add_special_tokens=False)["input_ids"] + ([eos] if end else [])

    scripted = iter(
        [
            [
                ids("how rivers form deltas over many years?"),  # kept
                ids("how rivers form deltas over many years?", end=False),  # unfinished
                ids("hi"),  # too short
                ids("a a a a a a a a a a a a"),  # repetitive
                ids("how  Rivers form deltas over many YEARS?"),
            ],  # a repeat, case and spacing aside
            [ids("which tools measure the depth of a lake?")] + [ids("x")] * 4,
        ]
    )
    monkeypatch.setattr(target, "sample_batch", lambda prompts, *a, **k: next(scripted)[: len(prompts)])
    monkeypatch.setattr(selfwritten, "OPENINGS", {kind: ["Q:"] for kind in selfwritten.MIX})  # one opening each
    notes = []
    convs = self_written_prompts(target, 2, seed=3, batch_size=5, report=notes.append)
    assert len(convs) == 2 and all(len(c.turns) == 1 for c in convs)
    assert convs[0].turns[0].endswith("how rivers form deltas over many years?")
    assert convs[1].turns[0].endswith("which tools measure the depth of a lake?")
    assert [c.id.split(":")[1] for c in convs] == ["0", "1"] and all(c.id.startswith("self-") for c in convs)
    assert "2 usable prompts in 10 attempts (4 dropped" in notes[-1]


def test_self_source_needs_the_target_and_a_count(target, monkeypatch):
    with pytest.raises(DominoError, match="need the target"):
        load_prompts(["self:4"])
    with pytest.raises(DominoError, match="self:N"):
        load_prompts(["self:many"], target=target)
    monkeypatch.setattr(target, "sample_batch", lambda prompts, *a, **k: [[] for _ in prompts])
    with pytest.raises(DominoError, match="no usable prompt"):
        load_prompts(["self:2"], target=target, report=lambda m: None)
