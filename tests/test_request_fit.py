"""One request rule (targets/context.py fit_request), phrased by each surface: a 400 on the server, a capped
note at batch 1 (generate, the hook), an error from the engine."""

import pytest
from conftest import tiny_target

from dominospec.decode import generate_autoregressive
from dominospec.engine import Engine, EngineRequest
from dominospec.errors import DominoError
from dominospec.targets.context import MIN_ANSWER_TOKENS, Fit, fit_request


@pytest.mark.parametrize(
    "prompt, asked, context, cap, want",
    [
        (10, 20, 64, False, Fit(20)),
        (10, None, 64, False, Fit(54)),  # without max_tokens: what the context leaves
        (10, 60, 64, False, Fit(None, "max_tokens", "over")),
        (10, 60, 64, True, Fit(54, capped=True)),  # batch 1 caps instead
        (64, 5, 64, True, Fit(None, "prompt", "full")),  # nothing left even to cap to
        (64 - MIN_ANSWER_TOKENS + 1, None, 64, False, Fit(None, "prompt", "full")),
        (64 - MIN_ANSWER_TOKENS, None, 64, False, Fit(MIN_ANSWER_TOKENS)),
        (0, 5, 64, False, Fit(None, "prompt", "empty")),
        (3, 0, 64, False, Fit(None, "max_tokens", "below")),
        (10**6, 5, None, False, Fit(5)),  # unknown context: nothing refused
        (10, None, None, False, Fit(1024)),
    ],
)
def test_fit_request_in_tokens(prompt, asked, context, cap, want):
    assert fit_request(prompt, asked, context, cap=cap) == want


@pytest.mark.parametrize(
    "chars, asked, want",
    [
        ((64 - MIN_ANSWER_TOKENS) * 12, None, Fit(None)),  # could fit: the token count decides later
        ((64 - MIN_ANSWER_TOKENS) * 12 + 1, None, Fit(None, "prompt", "full")),  # cannot, whatever the tokens
        ((64 - 40) * 12 + 1, 40, Fit(None, "prompt", "full")),  # max_tokens takes its share first
        (5, 64, Fit(None, "max_tokens", "over")),  # max_tokens alone fills the context
        (10**9, 5, Fit(None, "prompt", "full")),
    ],
)
def test_fit_request_in_characters(chars, asked, want):
    assert fit_request(chars, asked, 64, token_chars=12) == want
    assert fit_request(chars, asked, None, token_chars=12) == Fit(None)  # unknown context


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", backend="native")


def test_batch1_caps_with_a_note(target):
    limit = target.max_positions
    res = generate_autoregressive(target, list(range(1, 9)) * ((limit - 4) // 8), 40, eos_ids=[])
    prompt_len = res.prompt_len
    assert res.new_tokens == limit - prompt_len
    assert res.notes == [
        f"max_new_tokens 40 capped at {limit - prompt_len}: the prompt ({prompt_len} tokens) and the answer must "
        f"fit the target's context of {limit} positions"
    ]
    with pytest.raises(DominoError, match="fills the target's context"):
        generate_autoregressive(target, [1] * limit, 4)
    with pytest.raises(DominoError, match="outside the target's vocabulary"):  # the engine's check, shared
        generate_autoregressive(target, [1, target.vocab_size], 4)


def test_engine_refuses_with_an_error(target):
    engine = Engine(target, max_len=40)
    with pytest.raises(DominoError, match=r"prompt \(10 tokens\) \+ max_new_tokens \(30\) \+ 1 exceed"):
        engine.submit(EngineRequest(list(range(1, 11)), 30))
    engine.submit(EngineRequest(list(range(1, 11)), 29))  # exactly the engine's context (max_len - 1)


def test_server_refuses_with_a_400_naming_the_parameter():
    from dominospec.serve.app import check_chars, fit_budget
    from dominospec.serve.protocol import APIError

    assert fit_budget(10, None, 64) == 54
    for args, param in [((60, None, 64, "messages"), "messages"), ((10, 60, 64), "max_tokens")]:
        with pytest.raises(APIError) as exc:
            fit_budget(*args)
        assert exc.value.status == 400 and exc.value.param == param
    with pytest.raises(APIError) as exc:
        check_chars(10**6, None, 64, 12, "prompt")
    assert exc.value.param == "prompt" and "at most 576 characters" in str(exc.value.body())
