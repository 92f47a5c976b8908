"""The Python API runs what the command line runs: one configuration record, the same threads and tokens."""

from __future__ import annotations

import pytest
import torch
from conftest import run_cli_json

import dominospec
from dominospec.cli import build_parser
from dominospec.cli.common import spec_from_args
from dominospec.devices import threads_to_use
from dominospec.drafter import Drafter, shipped_drafter_dir
from dominospec.errors import DominoError
from dominospec.tune.spec import parse_spec


@pytest.mark.parametrize("words", [[], ["--drafter", "shipped"], ["--drafter", "none"], ["--verify", "fixed"]])
def test_api_default_record_equals_the_cli_default(words):
    args = build_parser().parse_args(["generate", "Hello", *words])
    cli = spec_from_args(args, "generate", None)
    keywords = {"--drafter": "drafter", "--verify": "verify"}
    named = {keywords[k]: v for k, v in zip(words[::2], words[1::2])}
    api = parse_spec("generate", target_name="smollm2-135m", flags=False, **named)
    assert api.describe() == cli.describe()
    assert api == cli if api.drafter is None else api.proposer == cli.proposer


def test_drafter_from_pretrained_takes_the_cli_names():
    shipped = shipped_drafter_dir("smollm2-135m")
    if not (shipped / "config.json").exists():
        pytest.skip("no shipped drafter in this checkout")
    for name in ("shipped", "smollm2-135m"):
        d = Drafter.from_pretrained(name)
        assert d.directory == shipped
        assert d.config.block_size == Drafter.from_pretrained(shipped).config.block_size


def test_shipped_drafter_for_another_target_is_refused_by_name():
    class Other:
        name = "tiny-llama"

    with pytest.raises(DominoError, match="no drafter is shipped for 'tiny-llama'"):
        Drafter.from_pretrained("shipped", target=Other())


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("drafter", [None, "shipped"])
def test_api_generate_gives_the_cli_tokens(capsys, cli_smollm, drafter):
    words = [] if drafter is None else ["--drafter", drafter]
    prompt = "Write a Python function that returns the square of x."
    rc, out, _ = run_cli_json(capsys, "generate", prompt, "--max-new-tokens", 24, "--json", *words)
    assert rc == 0
    assert (out["temperature"], out["seed"]) == (0.0, 0)  # what was drawn with, in the record
    res = dominospec.generate(cli_smollm, prompt, 24, drafter=drafter)
    assert (cli_smollm.decode(res.tokens), res.new_tokens) == (out["text"], out["new_tokens"])
    assert (res.cycles, res.lookup_cycles) == (out["cycles"], out["lookup_cycles"])  # the same proposer ran
    assert torch.get_num_threads() == threads_to_use(None)[0]


def _result(accepted: list[int], lookup_cycles=0):
    """A run of len(accepted) cycles at block 2, each accepting that many drafts."""
    from dominospec.decode.result import GenerationResult

    n = len(accepted)
    return GenerationResult([1, 2], 1, cycles=n, block_size=2, accepted=accepted, lookup_cycles=lookup_cycles)


def test_an_undrafted_run_is_explained_in_words():
    from dominospec.cli.generate import undrafted_note

    lookup = parse_spec("generate", flags=False)
    assert "prompt lookup found nothing to copy; the drafter was not used" in undrafted_note(lookup, _result([0, 0]))
    assert "accepted none" in undrafted_note(lookup, _result([0, 0], lookup_cycles=2))
    assert undrafted_note(lookup, _result([1, 0], lookup_cycles=2)) is None
    assert undrafted_note(parse_spec("generate", drafter="none", flags=False), _result([])) is None


def test_head_of_the_root_answers_200():
    import httpx
    from conftest import serve_in_thread, tiny_chat_target

    from dominospec.engine import Engine

    target = tiny_chat_target()
    with serve_in_thread(Engine(target, max_batch=1), target) as base:
        head = httpx.head(f"{base}/")  # a reachability check (curl -I) gets what GET would, without the body
        assert head.status_code == 200 and head.content == b""
