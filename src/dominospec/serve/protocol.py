"""The OpenAI request bodies we accept, the options we refuse, and the error body every failure gets.

Bodies are parsed strictly from the raw JSON (a string is not a number, NaN is not a number); fields
the API defines but this server does not implement are listed in UNSUPPORTED and refused with a 400
that names them, and fields nobody defines are ignored, as OpenAI's own server does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine import EngineRequest
from ..sampling import SamplingConfig

MAX_STOP_STRINGS = 8
MAX_STOP_CHARS = 512  # the longest stop string: what a stream holds back while a stop may be forming
MAX_SEED = 2**63 - 1
MAX_TEMPERATURE = 2.0  # OpenAI's range


class APIError(Exception):
    """A failure with its HTTP status and OpenAI error fields; the app renders it as error_body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """What both endpoints share: sampling, length, stop strings, streaming."""

    model: str | None = None  # None: the served model
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)  # an extension (vLLM has it too)
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # an extension: generate max_tokens even past EOS (load tests)
    spec_metrics: bool = False  # an extension: usage.spec_metrics and per-token sources (serve/marks.py)
    speculative: bool = True  # an extension: false decodes this request plainly (no drafts), in any batch
    # defined by OpenAI, implemented here only at their neutral value (checked by refuse_unsupported)
    n: int | None = 1
    logprobs: Any = None
    top_logprobs: Any = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", param="stop")
        if any(not s for s in stops):
            raise APIError(400, "stop strings must not be empty", param="stop")
        longest = max(map(len, stops), default=0)
        if longest > MAX_STOP_CHARS:
            raise APIError(
                400, f"a stop string has {longest} characters; at most {MAX_STOP_CHARS} are allowed", param="stop"
            )
        return stops

    def engine_request(self, prompt_ids: list[int], max_new_tokens: int) -> EngineRequest:
        """This body as the engine's request (a new field reaches the engine here and in EngineRequest only):
        OpenAI's defaults where a field is absent (temperature 1, top_p 1), every token with its source."""
        temperature = 1.0 if self.temperature is None else self.temperature
        return EngineRequest(
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            sampling=SamplingConfig(temperature, self.top_k or 0, 1.0 if self.top_p is None else self.top_p),
            seed=self.seed,
            eos_ids=[] if self.ignore_eos else None,
            marks=True,
            speculative=self.speculative,
        )


class TextPart(_Strict):
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: Any = None

    def text(self, index: int) -> str:
        where = f"messages[{index}]"
        if self.role in ("tool", "function") or self.tool_calls:
            raise APIError(400, f"{where}: tool and function messages are not supported by this server", param=where)
        if isinstance(self.content, str) or self.content is None:
            return self.content or ""
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise APIError(
                    400,
                    f"{where}.content[{j}]: content parts of type {part.type!r} are not supported (text only)",
                    param=f"{where}.content",
                )
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict]:
        """Messages as the chat template takes them (developer is the newer name of system)."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text(i)}
            for i, m in enumerate(self.messages)
        ]


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = 1

    def token_budget(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default for completions


# field -> its neutral values; anything else is an option this server does not implement
UNSUPPORTED = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "audio": (None, None),
    "modalities": (None, ["text"]),
    "prediction": (None, None),
}


def refuse_unsupported(req: BaseModel) -> None:
    for name, neutral in UNSUPPORTED.items():
        value = getattr(req, name, None)
        if value is not None and value not in neutral:
            raise APIError(
                400,
                f"{name}={value!r} is not supported by this server (only {neutral[1]!r})",
                param=name,
                code="unsupported_parameter",
            )


UTF8_BOM = b"\xef\xbb\xbf"  # some editors and Windows tools start UTF-8 text with it; JSON parsers may skip it


def parse_body(model: type[BaseModel], raw: bytes):
    """The request body as `model`, or an APIError(400) naming the first problem and where it is."""
    try:
        req = model.model_validate_json(raw.removeprefix(UTF8_BOM))
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        if err["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {err['msg']}", code="invalid_json") from None
        # union members add their type name to the location; keep field names and indices only
        loc = [str(p) for p in err["loc"] if isinstance(p, int) or p in _FIELD_NAMES]
        param = ".".join(loc) or None
        got = f" (got {err['input']!r})" if err["type"] != "missing" and _short(err.get("input")) else ""
        raise APIError(400, f"{param or 'body'}: {err['msg']}{got}", param=param) from None
    refuse_unsupported(req)
    return req


def _short(value) -> bool:
    return isinstance(value, (int, float, str, bool)) and len(repr(value)) <= 80


_FIELD_NAMES = {
    name
    for m in (ChatCompletionRequest, CompletionRequest, ChatMessage, TextPart, StreamOptions)
    for name in m.model_fields
}
