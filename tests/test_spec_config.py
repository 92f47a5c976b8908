"""The decoding configuration (tune/spec.py): one parser over every surface's words, one table of defaults,
and the checks made before any model loads (environment switches, the drafter directory)."""

import json
import socket

import pytest
import torch
from conftest import run_cli, tiny_drafter, tiny_target

from dominospec import Target
from dominospec.cli.common import environment_switches
from dominospec.decode.proposers import DrafterProposer, HybridProposer, LookupProposer, PlainProposer
from dominospec.decode.schedule import CostPolicy, CostTable, StaticPolicy, VerifyPolicy
from dominospec.drafter.checkpoint import CONFIG_NAME, WEIGHTS_NAME
from dominospec.errors import DominoError
from dominospec.tune.spec import SURFACE_DEFAULTS, SpecConfig, bind, build, parse_spec

NOWHERE = "/nonexistent/target-that-must-not-load"
COSTS = CostTable({0: [0.05, 0.06, 0.065, 0.07, 0.075, 0.08]}, 0.02)


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", dtype=torch.float64)


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter")
    tiny_drafter(target, block_size=4, confidence=True).save_pretrained(d)
    return d


def expected(surface: str, word, lookup, verify) -> tuple[str, str | None] | str:
    """What a surface resolves the user's words to, read from its row of the table: (proposer, verify), or the
    start of the one refusal."""
    row = SURFACE_DEFAULTS[surface]
    word = row.proposer if word is None else word
    if word == "lookup" and lookup is False:
        return "leaves nothing to draft with"
    if word == "none":
        proposer = "lookup" if lookup else "none"
    elif word == "lookup":
        proposer = "lookup"
    else:
        proposer = "hybrid" if (lookup if lookup is not None else row.with_drafter == "hybrid") else "drafter"
    if proposer == "none":
        return "schedules drafts, and this run proposes none" if verify is not None else ("none", None)
    return proposer, verify or row.verify


@pytest.mark.parametrize("surface", list(SURFACE_DEFAULTS))
@pytest.mark.parametrize("word", [None, "none", "lookup", "DIR"])
@pytest.mark.parametrize("lookup", [None, True, False])
@pytest.mark.parametrize("verify", [None, "fixed", "static", "cost"])
def test_every_surface_resolves_every_proposer_and_verify_mode_by_its_row(surface, word, lookup, verify, drafter_dir):
    want = expected(surface, str(drafter_dir) if word == "DIR" else word, lookup, verify)
    words = dict(drafter=str(drafter_dir) if word == "DIR" else word, lookup=lookup, verify=verify)
    if isinstance(want, str):
        with pytest.raises(DominoError, match=want):
            parse_spec(surface, **words)
        return
    spec = parse_spec(surface, **words)
    assert (spec.proposer, spec.verify) == want
    assert (spec.drafter is not None) == (spec.proposer in ("drafter", "hybrid"))
    assert spec.describe() == ("plain" if want[0] == "none" else f"{want[0]}, verify {want[1]}")


def test_the_table_keeps_todays_defaults():
    """generate and serve: prompt lookup with verify cost, a drafter as the hybrid; the hook and the engine:
    plain until told, verify fixed, a drafter alone (each row says why it differs)."""
    rows = {s: (r.proposer, r.verify, r.with_drafter) for s, r in SURFACE_DEFAULTS.items()}
    assert rows["generate"] == rows["serve"] == ("lookup", "cost", "hybrid")
    assert rows["hook"] == rows["engine"] == ("none", "fixed", "drafter")
    assert all(r.why for r in SURFACE_DEFAULTS.values())


def test_one_parser_refuses_bad_settings_by_the_surfaces_names(drafter_dir):
    with pytest.raises(DominoError, match="--verify fast: choose from"):
        parse_spec("generate", verify="fast")
    with pytest.raises(DominoError, match="verify='fast': choose from fixed, static, cost"):
        parse_spec("hook", drafter="lookup", verify="fast", flags=False)
    with pytest.raises(DominoError, match="--confidence-threshold must be in"):
        parse_spec("serve", threshold=1.5)
    with pytest.raises(DominoError, match="--lookup-min-match 0: must be at least 1"):
        parse_spec("generate", lookup_min_match=0)
    with pytest.raises(DominoError, match="block_size=0: a positive integer"):
        parse_spec("hook", drafter="lookup", block_size=0, flags=False)
    with pytest.raises(DominoError, match="shipped: no drafter is shipped for 'elsewhere'"):
        parse_spec("generate", drafter="shipped", target_name="elsewhere")


@pytest.mark.parametrize(
    "proposer, verify, kinds",
    [
        ("none", None, (PlainProposer, VerifyPolicy)),
        ("lookup", "fixed", (LookupProposer, VerifyPolicy)),
        ("lookup", "cost", (LookupProposer, CostPolicy)),
        ("drafter", "static", (DrafterProposer, StaticPolicy)),
        ("hybrid", "cost", (HybridProposer, CostPolicy)),
    ],
)
def test_build_returns_the_proposer_and_policy_the_configuration_names(target, drafter_dir, proposer, verify, kinds):
    word = {"none": "none", "lookup": "lookup"}.get(proposer, str(drafter_dir))
    lookup = {"hybrid": True, "drafter": False}.get(proposer)
    spec = bind(parse_spec("engine", drafter=word, lookup=lookup, verify=verify), target)
    for rows in (None, 2):
        made, policy = build(spec, target, rows=rows, max_len=64, costs=COSTS)
        assert type(made) is kinds[0] and type(policy) is kinds[1]
    if proposer == "hybrid":
        assert made.lookup.min_match == spec.lookup_min_match


def test_a_hybrid_min_match_reaches_every_row(target, drafter_dir):
    spec = bind(parse_spec("engine", drafter=str(drafter_dir), lookup=True, verify="fixed", lookup_min_match=5), target)
    proposer, _ = build(spec, target, rows=2, max_len=64)
    assert proposer.lookup.min_match == 5


# ----- before any model loads -----


@pytest.fixture
def no_target_load(monkeypatch):
    """Target.load refuses to run: a check that comes after it would not be reached."""

    def refuse(*args, **kwargs):
        raise AssertionError("the target was loaded before the arguments were checked")

    monkeypatch.setattr(Target, "load", refuse)


@pytest.mark.parametrize("name", sorted(environment_switches()))
def test_every_environment_switch_is_checked_before_any_model_loads(name, monkeypatch, capsys, no_target_load):
    monkeypatch.setenv(name, "bogus")
    rc, err = run_cli(capsys, "generate", "Hello", "--target", NOWHERE, "--drafter", "none")
    assert rc == 2
    assert f"{name}='bogus': expected one of {', '.join(environment_switches()[name])}" in err


def test_a_valid_switch_word_passes(monkeypatch):
    from dominospec.cli.common import check_environment

    check_environment({"DOMINOSPEC_KERNELS": " OFF ", "DOMINOSPEC_DRAFTER_WEIGHTS": "int8"})
    with pytest.raises(DominoError, match="DOMINOSPEC_DRAFTER_WEIGHTS='bogus'"):
        check_environment({"DOMINOSPEC_DRAFTER_WEIGHTS": "bogus"})


def damaged(kind: str, good, tmp_path):
    d = tmp_path / kind
    d.mkdir()
    if kind == "empty":
        return d
    (d / CONFIG_NAME).write_bytes((good / CONFIG_NAME).read_bytes())
    weights = (good / WEIGHTS_NAME).read_bytes()
    if kind == "truncated":
        (d / WEIGHTS_NAME).write_bytes(weights[: len(weights) // 2])
    elif kind == "hidden-size":
        config = json.loads((good / CONFIG_NAME).read_text())
        config["hidden_size"] = config["hidden_size"] * 2
        (d / CONFIG_NAME).write_text(json.dumps(config))
        (d / WEIGHTS_NAME).write_bytes(weights)
    return d


@pytest.mark.parametrize("kind, message", [("empty", "missing config.json"), ("truncated", "not a readable"),
                                           ("hidden-size", "has shape")])  # fmt: skip
@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_a_damaged_drafter_directory_is_named_before_the_target_loads(
    command, kind, message, drafter_dir, tmp_path, capsys, no_target_load
):
    d = damaged(kind, drafter_dir, tmp_path)
    argv = {
        "generate": ["generate", "Hello"],
        "serve": ["serve", "--port", free_port()],
        "bench": ["bench", "--prompts", write_prompt(tmp_path), "--out", tmp_path / "out"],
    }[command]
    rc, err = run_cli(capsys, *argv, "--target", NOWHERE, "--drafter", d)
    assert rc == 2 and message in err, err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_prompt(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    return path


def test_a_plain_config_runs_like_plain_decoding(target):
    from dominospec.decode import generate_autoregressive
    from dominospec.tune.spec import run_spec

    res = run_spec(SpecConfig(seed=3), target, [1, 2, 3], 12, eos_ids=[], sampling=generate_default_sampling())
    assert res.tokens == generate_autoregressive(target, [1, 2, 3], 12, seed=3, eos_ids=[]).tokens and res.cycles == 0


def generate_default_sampling():
    from dominospec.sampling import SamplingConfig

    return SamplingConfig()


# ----- serve runs every proposer generate runs -----


def test_serve_with_the_hybrid_answers_like_generate_with_it(tmp_path):
    import httpx
    from conftest import serve_in_thread, tiny_chat_target

    from dominospec.engine import Engine
    from dominospec.sampling import SamplingConfig
    from dominospec.tune.spec import run_spec

    target = tiny_chat_target(dtype=torch.float64)
    tiny_drafter(target, block_size=4).save_pretrained(tmp_path / "d")
    messages = [{"role": "user", "content": "abcabcabcabc abcabc"}]
    served = parse_spec("serve", drafter=str(tmp_path / "d"), verify="fixed")
    generated = bind(parse_spec("generate", drafter=str(tmp_path / "d"), verify="fixed"), target)
    assert served.proposer == generated.proposer == "hybrid"  # --drafter DIR means the same on both
    res = run_spec(generated, target, target.encode_chat(messages), 40, SamplingConfig(temperature=0.0))
    with serve_in_thread(Engine(target, spec=served, max_batch=2), target) as base:
        body = {"messages": messages, "max_tokens": 40, "temperature": 0, "spec_metrics": True}
        answer = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["message"]["content"] == target.decode(res.tokens)
    counts = answer["usage"]["spec_metrics"]["source_counts"]
    assert counts["lookup"] == res.sources.count("lookup") > 0  # the hybrid's copies, in the server too
    assert counts["drafter"] == res.sources.count("drafter")
