"""The OpenAI request surface shared by the router and the emulator: validation and error bodies.

Every malformed request becomes an :class:`ApiError` (a 4xx with ``{"error": {"message", "type",
"code", "param"}}``), never an exception that escapes as a 500. Validation is strict: a field of the
wrong JSON type is rejected rather than coerced (``"max_tokens": "5"`` or ``true`` is an error).
Fields this module does not know are kept and forwarded untouched.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from twin.router.prompt import chat_text, text_token_ids

DEFAULT_MAX_TOKENS = 16  # OpenAI's completions default; used for chat too (documented)
MAX_TOKEN_ID = 2**31 - 1

TokenId = Annotated[StrictInt, Field(ge=0, le=MAX_TOKEN_ID)]
Number = StrictInt | StrictFloat


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body; ``reason`` labels the router's rejection metric."""

    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error", reason: str = "invalid",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type_ = type_
        self.reason = reason
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type_, self.status, param=self.param)


def error_body(message: str, type_: str, code: int | str, *, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "code": code, "param": param}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Request(_Strict):
    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1  # n > 1 is not supported (one stream per request)
    temperature: Annotated[Number, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[Number, Field(gt=0.0, le=1.0)] | None = None
    ignore_eos: StrictBool | None = None
    return_token_ids: StrictBool | None = None
    user: StrictStr | None = None


class CompletionRequest(_Request):
    prompt: Annotated[StrictStr, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart]


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None


Kind = Literal["completions", "chat"]


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated request: its JSON body, its prompt as token ids, and the effective limits."""

    kind: Kind
    raw: bytes  # the body as received (forwarded unchanged)
    body: dict[str, Any]
    prompt_ids: tuple[int, ...]
    prompt_is_text: bool
    max_tokens: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    user: str | None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)


def _first_error(exc: ValidationError) -> tuple[str, str]:
    err = exc.errors(include_url=False)[0]
    path = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and p.startswith(("str", "list["))))
    return path or "body", f"{path or 'body'}: {err['msg']}"


def parse_request(raw: bytes, kind: Kind, *, max_model_len: int, vocab_size: int | None = None) -> ParsedRequest:
    """Validate a request body; raises :class:`ApiError` (400) for anything malformed.

    ``prompt_tokens + max_tokens`` must fit ``max_model_len`` (as vLLM checks). With ``vocab_size``, token
    ids must be below it (the emulator knows its vocabulary; the router does not).
    """
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # bad UTF-8, bad JSON, too deep, int too long
        raise ApiError(400, f"the body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, not {type(data).__name__}")
    model_cls = CompletionRequest if kind == "completions" else ChatCompletionRequest
    try:
        req = model_cls.model_validate(data)
    except ValidationError as exc:
        param, message = _first_error(exc)
        raise ApiError(400, message, param=param) from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None
    if isinstance(req, CompletionRequest):
        if isinstance(req.prompt, str):
            ids, is_text = text_token_ids(req.prompt, vocab_size=vocab_size), True
        else:
            ids, is_text = tuple(req.prompt), False
        max_tokens = req.max_tokens
    else:
        ids, is_text = text_token_ids(chat_text(req.messages), vocab_size=vocab_size), True
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if vocab_size is not None and not is_text and max(ids) >= vocab_size:
        raise ApiError(400, f"prompt: token id {max(ids)} is outside the vocabulary (size {vocab_size})", param="prompt")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if len(ids) + max_tokens > max_model_len:
        raise ApiError(400, f"this model's maximum context length is {max_model_len} tokens; the request has "
                            f"{len(ids)} prompt tokens and max_tokens {max_tokens}", param="max_tokens")
    if req.min_tokens is not None and req.min_tokens > max_tokens:
        raise ApiError(400, "min_tokens must be <= max_tokens", param="min_tokens")
    opts = req.stream_options
    return ParsedRequest(kind=kind, raw=raw, body=data, prompt_ids=ids, prompt_is_text=is_text, max_tokens=max_tokens,
                         stream=req.stream, include_usage=bool(opts and opts.include_usage),
                         return_token_ids=bool(req.return_token_ids), user=req.user)
