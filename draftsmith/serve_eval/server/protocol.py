"""OpenAI-shaped request/response models and the OpenAI error body.

Requests are validated strictly from the raw JSON (`model_validate_json`): a string where
a number belongs is a type error, not a silent cast, and unknown fields are rejected the
way OpenAI's API rejects them. Every failure becomes an `ApiError` whose body names the
offending field in `param`.

Extra (non-OpenAI) request fields, vLLM-style: `top_k`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
`domain` (label for per-domain metrics and per-domain speculation settings) and
`priority` (scheduler tier; larger = served first is the engine's convention).
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draftsmith.kernels.sampling import INT64_MAX, INT64_MIN, check_sampling_values
from draftsmith.serve_eval.engine.sampling_params import SamplingParams

MAX_N = 16
DEFAULT_COMPLETION_MAX_TOKENS = 16   # OpenAI's documented default for /v1/completions
MAX_LOGPROBS = 20


class ApiError(Exception):
    """An error the client caused (or a refusal); rendered as OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every refusal (OpenAI's error shape)."""
    error: ErrorInfo


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"
    engine_restarts: int = 0          # failed engine steps the supervisor recovered from
    last_engine_error: str | None = None


# ---------------------------------------------------------------- requests

class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extras
    top_k: int = Field(0, ge=-1, le=INT64_MAX)   # -1 or 0 = off (vLLM accepts both)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)   # no EOS / stop token / stop string before this many tokens
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] | None = None
    domain: str | None = Field(None, min_length=1, max_length=64)
    priority: int = 0

    def check_supported(self) -> None:
        """Refuse, by name, the OpenAI knobs this engine does not implement (never ignore them)."""
        if self.presence_penalty != 0.0:
            raise ApiError(400, "presence_penalty is not supported (must be 0)", "presence_penalty")
        if self.frequency_penalty != 0.0:
            raise ApiError(400, "frequency_penalty is not supported (must be 0)", "frequency_penalty")
        if self.logit_bias:
            raise ApiError(400, "logit_bias is not supported", "logit_bias")
        if isinstance(self.stop, list) and any(s == "" for s in self.stop) or self.stop == "":
            raise ApiError(400, "stop must not contain an empty string", "stop")
        try:   # the kernels' own ranges, in the dtypes they use (1e39 is inf in float32)
            check_sampling_values(self.temperature, max(self.top_k, 0), self.top_p, self.seed)
        except ValueError as exc:
            raise ApiError(400, str(exc), str(exc).split()[0]) from None
        if self.seed is not None and self.seed + self.n - 1 > INT64_MAX:
            raise ApiError(400, f"seed + n - 1 must be <= {INT64_MAX} (choice i samples with seed + i)",
                           "seed")

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def sampling_params(self, max_tokens: int, index: int, logprobs: int | None) -> SamplingParams:
        """Engine params for choice `index` of n (seeded choices get seed + index, so they differ)."""
        seed = None if self.seed is None else self.seed + index
        try:
            return SamplingParams(
                temperature=float(self.temperature), top_k=max(self.top_k, 0), top_p=float(self.top_p),
                seed=seed, max_tokens=max_tokens, stop=self.stop_list(),
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens, n=1, logprobs=logprobs)
        except ValueError as exc:   # SamplingParams names the field first in its message
            raise ApiError(400, str(exc), str(exc).split()[0]) from None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1)   # null also means 16, as OpenAI's
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool = False   # vLLM's extension: logprobs tokens spelled "token_id:<id>"
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise ApiError(400, "best_of is not supported (omit it or set it equal to n)", "best_of")
        if self.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if self.echo and self.logprobs is not None:
            raise ApiError(400, "echo together with logprobs is not supported", "echo")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.tools:
            raise ApiError(400, "tools are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice is not supported", "tool_choice")
        if self.response_format not in (None, {"type": "text"}):
            raise ApiError(400, "response_format other than text is not supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs=true", "top_logprobs")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


_FIELD_NAMES: set[str] = set()
for _model in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextContentPart, StreamOptions):
    _FIELD_NAMES.update(_model.model_fields)


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (union tags dropped)."""
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in _FIELD_NAMES:
            parts.append(("." if parts else "") + item)
        else:
            break
    return "".join(parts) or None


def parse_request(model: type[_Strict], raw: bytes) -> Any:
    """Validate a raw JSON body into `model`, or raise ApiError(400) naming the field."""
    if not raw.strip():
        raise ApiError(400, "request body is empty; expected a JSON object")
    try:
        request = model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            raise ApiError(400, f"request body is not valid JSON: {first['msg']}") from None
        if first["type"] == "model_type" and not first["loc"]:
            raise ApiError(400, "request body must be a JSON object") from None
        param = _param_from_loc(tuple(first["loc"]))
        if first["type"] == "extra_forbidden":   # the unknown name itself is the field
            param = ".".join(str(x) for x in first["loc"])
        if first["type"] == "missing":
            message = f"'{param}' is a required property"
        elif first["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        else:
            # A union reports one error per member; keep the distinct messages for this field.
            msgs = [e["msg"] for e in exc.errors() if _param_from_loc(tuple(e["loc"])) == param]
            message = f"{param}: " + "; or ".join(dict.fromkeys(msgs))
        raise ApiError(400, message, param) from None
    request.check_supported()
    return request


def param_from_value_error(message: str, candidates: tuple[str, ...]) -> str | None:
    """The engine raises ValueError naming the field; recover the field for `param`."""
    for name in candidates:
        if message.startswith(name) or f" {name} " in f" {message} ":
            return name
    return None


# ---------------------------------------------------------------- responses

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    """OpenAI streams completions with object 'text_completion' too."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "draftsmith"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
