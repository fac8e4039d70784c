"""Admission: what a generation request must pass before any worker is touched.

1. Size: a body over `max_body_bytes` gets 413 (from its Content-Length, before reading it, or while reading).
2. Access: with `api_keys` configured, `Authorization: Bearer <key>` must carry one of them (401).
3. Shape: the OpenAI schema (SGLang's for `/generate`) with the value ranges of `dsv4_cluster.request_schema`
   (the workers' too): wrong types, NaN or out-of-range sampling values, missing prompts -> 400 naming the
   field. Fields the schema does not know pass through to the workers (SGLang takes many extensions).
4. Model: a `model` that is neither the served name nor one of its aliases -> 404 `model_not_found`, as
   OpenAI answers. A missing `model` means the served one.
Keys are compared in constant time and never logged.
"""

from __future__ import annotations

import hmac
from typing import Any, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from dsv4_cluster import request_schema as rs

from .errors import BodyTooLarge, InvalidRequest, ModelNotFound, Unauthorized
from .pairing import check_body

Stop = Union[StrictStr, list[StrictStr], None]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class Message(_Open):
    role: StrictStr
    content: Union[StrictStr, list[dict[str, Any]], None] = None


class StreamOptions(_Open):
    include_usage: StrictBool | None = None


class _Sampling(_Open):
    model: StrictStr | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    temperature: rs.OpenAITemperature | None = None
    top_p: rs.TopP | None = None
    presence_penalty: rs.Penalty | None = None
    frequency_penalty: rs.Penalty | None = None
    max_tokens: rs.MaxTokens | None = None
    n: rs.N | None = None
    seed: rs.Seed | None = None
    stop: Stop = None
    user: StrictStr | None = None


class ChatBody(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: rs.MaxTokens | None = None
    logprobs: StrictBool | None = None
    top_logprobs: rs.TopLogprobs | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        rs.chat_logprobs(self.logprobs, self.top_logprobs)
        return self


class CompletionBody(_Sampling):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    logprobs: rs.TopLogprobs | None = None     # legacy completions: alternatives per token


class GenerateSampling(_Open):
    temperature: rs.Temperature | None = None
    top_p: rs.TopP | None = None
    top_k: StrictInt | None = None
    min_p: rs.MinP | None = None
    presence_penalty: rs.Penalty | None = None
    frequency_penalty: rs.Penalty | None = None
    max_new_tokens: rs.MaxNewTokens | None = None
    n: rs.N | None = None
    sampling_seed: rs.Seed | None = None
    stop: Stop = None


class GenerateBody(_Open):
    model: StrictStr | None = None
    text: Union[StrictStr, list[StrictStr], None] = None
    input_ids: Union[list[StrictInt], list[list[StrictInt]], None] = None
    input_embeds: Any = None
    sampling_params: Union[GenerateSampling, list[GenerateSampling], None] = None
    stream: StrictBool | None = None
    return_logprob: Union[StrictBool, list[StrictBool], None] = None
    top_logprobs_num: Union[rs.TopLogprobs, list[rs.TopLogprobs], None] = None
    return_text_in_logprobs: StrictBool | None = None


SCHEMAS: dict[str, type[BaseModel]] = {"/v1/chat/completions": ChatBody, "/v1/completions": CompletionBody,
                                       "/generate": GenerateBody}
PROMPT_FIELDS = {"/v1/chat/completions": ("messages",), "/v1/completions": ("prompt",),
                 "/generate": ("text", "input_ids", "input_embeds")}


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


async def read_body(receive: Any, scope: dict[str, Any], limit: int) -> bytes:
    """The whole request body; BodyTooLarge past `limit` bytes."""
    declared = _header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"the request body has {int(declared)} bytes; this router takes at most {limit} "
                           "(max_body_bytes)")
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(f"the request body is over {limit} bytes (max_body_bytes)")
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def check_key(scope: dict[str, Any], keys: list[str]) -> None:
    if not keys:
        return
    auth = (_header(scope, b"authorization") or b"").decode("latin-1")
    scheme, _, token = auth.partition(" ")
    token = token.strip().encode()
    if scheme.lower() != "bearer" or not any(hmac.compare_digest(token, k.encode()) for k in keys):
        raise Unauthorized("missing or invalid API key: send 'Authorization: Bearer <key>' with a key of this "
                           "router (api_keys)", code="invalid_api_key")


TYPE_LABELS = {"str", "int", "float", "bool", "none", "dict", "list"}


def _is_field(part: object) -> bool:
    """Union branches show up in an error's location as type labels ('str', 'list[int]', 'GenerateSampling')."""
    text = str(part)
    return isinstance(part, int) or not ("[" in text or "-" in text or text[:1].isupper() or text in TYPE_LABELS)


def _field_errors(err: ValidationError) -> str:
    """'field.path: problem' for each error; for a union, the branch that got furthest (the others are noise), and
    of one value or a list of them, the form the client sent (a list branch's "should be a valid list" is noise)."""
    errors = [(tuple(str(p) for p in e["loc"] if _is_field(p)), e)
              for e in err.errors(include_url=False, include_input=False)]
    found = [(loc, rs.error_text(e)) for loc, e in errors
             if not (e["type"] == "list_type" and sum(other == loc for other, _ in errors) > 1)]
    kept = [(loc, msg) for loc, msg in found
            if not any(len(other) > len(loc) and other[:len(loc)] == loc for other, _ in found)]
    return "; ".join(dict.fromkeys(f"{'.'.join(loc)}: {msg}" if loc else msg for loc, msg in kept))


def admit(state: Any, path: str, scope: dict[str, Any], raw: bytes) -> tuple[dict[str, Any], bool]:
    """The admitted body and whether it streams; raises a RouterError (400/401/404) saying what is wrong."""
    settings = state.settings
    check_key(scope, settings.api_keys)
    try:
        body = rs.json_body(raw)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc
    body = check_body(body)
    if not any(body.get(f) is not None for f in PROMPT_FIELDS[path]):
        raise InvalidRequest(f"{path} needs {' or '.join(repr(f) for f in PROMPT_FIELDS[path])} in the request body")
    try:
        SCHEMAS[path].model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(f"invalid request: {_field_errors(exc)}") from None
    model = body.get("model")
    if model is not None and model != settings.model_name and model not in settings.model_aliases:
        raise ModelNotFound(f"The model {model!r} does not exist; this router serves {settings.model_name!r}"
                            + (f" (aliases {settings.model_aliases})" if settings.model_aliases else ""))
    return body, bool(body.get("stream", False))
