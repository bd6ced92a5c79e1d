"""OpenAI request bodies for the frontend: every parameter is either served or refused with a clear 400.

`parse_body(raw, content_type, model_class)` turns an HTTP body into a validated request or raises
`ApiError` in OpenAI's shape: not JSON, not UTF-8, not an object, a wrong type, a number out of
range (OpenAI's ranges; integers also within the INT32 / UINT64 tensors they become), NaN or
infinity, an unknown field, or a known OpenAI parameter this server does not implement.
docs/parameters.md lists the same choices as a table.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from clients.client import ClientError

ERROR_STATUS = {"invalid_request": 400, "not_found": 404, "unavailable": 503, "timeout": 504, "server_error": 500}
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
MAX_STOP_STRINGS = 4  # OpenAI's limit


class ApiError(Exception):
    """An error returned in OpenAI's shape."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        """{"error": {message, type, param, code}}."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @classmethod
    def from_client_error(cls, error: ClientError) -> "ApiError":
        """The OpenAI error for a failed Triton request."""
        status = ERROR_STATUS.get(error.kind, 500)
        type_ = "invalid_request_error" if status < 500 else "server_error"
        return cls(status, str(error), type_, code="model_not_found" if error.kind == "not_found" else error.kind)


def _float(lo: float, hi: float, **kw):
    return Field(default=None, ge=lo, le=hi, allow_inf_nan=False, **kw)


def _int(lo: int, hi: int = INT32_MAX):
    return Field(default=None, ge=lo, le=hi, strict=True)


# OpenAI parameters this server does not implement: field -> (values that mean "not used", why / what to do).
REFUSED: dict[str, tuple[tuple, str]] = {
    "logit_bias": ((None, {}), "logit_bias is not supported; remove it"),
    "best_of": ((None, 1), "best_of other than 1 is not supported; remove it"),
    "suffix": ((None, ""), "suffix (insertion) is not supported; remove it"),
    "tools": ((None, []), "tools are not supported by this server; remove them"),
    "tool_choice": ((None, "none"), "tool_choice is not supported (no tools); remove it"),
    "functions": ((None, []), "functions are not supported by this server; remove them"),
    "function_call": ((None, "none"), "function_call is not supported (no functions); remove it"),
    "response_format": ((None, {"type": "text"}), "only response_format {\"type\": \"text\"} is supported; "
                        "json_object and json_schema need guided decoding, which this server does not have"),
    "audio": ((None,), "audio output is not supported; remove it"),
    "modalities": ((None, ["text"]), "only the text modality is supported"),
    "prediction": ((None,), "predicted outputs are not supported; remove prediction"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported (not a reasoning model); remove it"),
    "verbosity": ((None,), "verbosity is not supported; remove it"),
    "web_search_options": ((None,), "web search is not supported; remove web_search_options"),
    "store": ((None, False), "store is not supported (nothing is stored); remove it or set it to false"),
    "ignore_eos": ((None, False), "ignore_eos is not supported; raise max_tokens or use min_tokens instead"),
    "n": ((None, 1), "n other than 1 is not supported; send n separate requests (with different seeds)"),
}


class GenerationFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI's, plus the speculation extras)."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = _int(1)
    temperature: float | None = _float(0.0, 2.0)
    top_p: float | None = _float(0.0, 1.0)
    n: int | None = _int(1, 128)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = _int(0, UINT64_MAX)
    presence_penalty: float | None = _float(-2.0, 2.0)
    frequency_penalty: float | None = _float(-2.0, 2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the caller's own records; no effect on generation
    store: bool | None = None
    metadata: dict[str, str] | None = None  # kept with stored completions; nothing is stored here
    service_tier: Literal["auto", "default"] | None = None  # one tier here
    # Extras (the openai package sends them with extra_body=...).
    num_draft_tokens: int | None = _int(0)
    use_draft_logits: bool | None = None
    top_k: int | None = _int(0)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2**20, allow_inf_nan=False)
    min_tokens: int | None = _int(0)
    ignore_eos: bool | None = None

    def check(self) -> None:
        """Refuse parameters that are set to something this server does not implement."""
        for name, (unused, why) in REFUSED.items():
            if name in type(self).model_fields and getattr(self, name) not in unused:
                raise ApiError(400, why, param=name, code="unsupported_parameter")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise ApiError(400, f"stop has {len(self.stop)} strings; send at most {MAX_STOP_STRINGS}", param="stop")
        unknown = set(self.stream_options or {}) - {"include_usage"}
        if unknown:
            raise ApiError(400, f"stream_options.{sorted(unknown)[0]} is not supported; only include_usage is",
                           param="stream_options")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")

    @property
    def wants_logprobs(self) -> bool:
        """Whether the response carries token log-probabilities."""
        return False

    @property
    def num_top_logprobs(self) -> int:
        """How many most likely alternatives to list per token."""
        return 0

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(GenerationFields):
    """POST /v1/completions. A prompt is text, a list of texts, or token ids (one list or a list of lists)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    logprobs: int | None = _int(0, 5)
    best_of: int | None = _int(1, 20)
    suffix: str | None = None

    @property
    def wants_logprobs(self) -> bool:
        """`logprobs` is set (0 means the chosen tokens only)."""
        return self.logprobs is not None

    @property
    def num_top_logprobs(self) -> int:
        """Completions' `logprobs` is the number of alternatives."""
        return self.logprobs or 0

    def check(self) -> None:
        """GenerationFields.check, plus: echoed prompt log-probs only without stream."""
        super().check()
        if self.echo and self.wants_logprobs and self.stream:
            raise ApiError(400, "echo with logprobs is not supported with stream=true; send stream=false", param="echo")

    def prompts(self) -> list[str | list[int]]:
        """The prompts, each text or token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class ChatMessage(BaseModel):
    """One chat message (text content only)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None


class ChatRequest(GenerationFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = _int(1)
    logprobs: bool | None = None
    top_logprobs: int | None = _int(0, 20)
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # only meaningful with tools, which are refused
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    prompt_cache_key: str | None = None  # a cache-routing hint; prefix caching here is automatic
    safety_identifier: str | None = None  # an end-user id, like user

    @property
    def wants_logprobs(self) -> bool:
        """Chat's `logprobs` is a flag."""
        return bool(self.logprobs)

    @property
    def num_top_logprobs(self) -> int:
        """Chat's `top_logprobs`."""
        return self.top_logprobs or 0

    def check(self) -> None:
        """GenerationFields.check, plus: top_logprobs needs logprobs, max_tokens and max_completion_tokens agree."""
        super().check()
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if None not in (self.max_tokens, self.max_completion_tokens) and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens differ; send one of them",
                           param="max_completion_tokens")


def _param(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def parse_body(raw: bytes, content_type: str | None, model_class: type[GenerationFields]) -> GenerationFields:
    """A validated request from an HTTP body, or ApiError (400) saying what is wrong and how to fix it."""
    media = (content_type or "application/json").split(";")[0].strip().lower()
    if media != "application/json":
        raise ApiError(400, f"Content-Type {media!r} is not supported; send a JSON object with "
                       "Content-Type: application/json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start}); send UTF-8 encoded JSON") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}; "
                       "send a JSON object") from None
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body is a JSON {type(body).__name__}; send a JSON object")
    try:
        request = model_class.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        param = _param(err["loc"])
        if err["type"] == "extra_forbidden":
            raise ApiError(400, f"unknown parameter '{param}'; remove it (docs/parameters.md lists the supported ones)",
                           param=param, code="unknown_parameter") from None
        got = repr(err.get("input"))
        raise ApiError(400, f"{param}: {err['msg']} (got {got if len(got) <= 80 else got[:77] + '...'})",
                       param=param) from None
    request.check()
    return request


def _refuse_constant(name: str):
    raise ValueError(f"the request body contains {name}, which is not a JSON number; send a finite number")
