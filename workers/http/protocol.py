"""Request bodies the embedded workers accept, in SGLang's and OpenAI's shapes.

Every field of SGLang 0.5.23's `GenerateReqInput`, `ChatCompletionRequest` and `CompletionRequest` is accepted:
those declared here are honoured, the others checked against `fields.py`, as are the OpenAI API's fields that
clients send and SGLang ignores; any other field is a 400 naming it (a misspelt field is not silently dropped).
Value ranges and the `max_tokens` rename are `dsv4_cluster.request_schema`'s, shared with the router.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from dsv4_cluster import request_schema as rs

from . import fields
from ..engine.sampling import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _SGLangBody(_Body):
    """A body whose SGLang fields outside the declared ones are checked against `RULES` (a table of `fields.py`)."""

    RULES: ClassVar[dict[str, fields.Rule]] = {}
    SGLANG: ClassVar[str] = ""          # the SGLang class whose fields this body takes

    @model_validator(mode="before")
    @classmethod
    def _neutral_fields(cls, data: Any) -> Any:
        return fields.check(data, cls.RULES) if isinstance(data, dict) else data


class Bootstrap(_SGLangBody):
    """Fields the router adds (docs/protocol.md, "One request")."""

    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = Field(default=None, ge=0, le=2**63 - 1)
    rid: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False

    @model_validator(mode="after")
    def _usage_once(self):
        if self.continuous_usage_stats:
            raise ValueError("continuous_usage_stats: true is not supported: the embedded engine sends usage once, "
                             "in the stream's last chunk (include_usage); omit it or send false")
        return self


def _lower(role: Any) -> Any:
    """SGLang takes a message's role in any case ("User")."""
    return role.lower() if isinstance(role, str) else role


def _no_empty_stop(stop: str | list[str] | None) -> str | list[str] | None:
    if any(not s for s in _stops(stop)):
        raise ValueError("an empty stop string would end every generation at once; drop it")
    return stop


Stop = Annotated[str | list[str] | None, AfterValidator(_no_empty_stop)]


def _stops(stop: str | list[str] | None) -> tuple[str, ...]:
    return (stop,) if isinstance(stop, str) else tuple(stop or ())


def _no_batch(data: Any, field: str, batch: tuple[type, ...]) -> Any:
    """SGLang takes a list of prompts (a batch, with a bootstrap room and a rid per item); the embedded engine does
    not: one sentence naming the field, not the per-item type errors of every field the router made a list."""
    value = data.get(field) if isinstance(data, dict) else None
    if isinstance(value, list) and any(isinstance(item, batch) for item in value):
        raise ValueError(f"{field}: a batch (a list of prompts) is not supported by the embedded engine; "
                         "send one request per prompt")
    return data


class _OpenAISampling(Bootstrap):
    max_tokens: rs.MaxTokens | None = None
    temperature: rs.OpenAITemperature | None = None
    top_p: rs.TopP | None = None
    seed: rs.Seed | None = None
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    def logprobs_asked(self) -> tuple[bool, int]:
        """(report logprobs, alternatives per token): each route spells them its own way."""
        raise NotImplementedError

    def max_asked(self) -> int | None:
        """The output budget the client gave (None: the server's default)."""
        return rs.max_new_tokens(getattr(self, "max_completion_tokens", None), self.max_tokens)

    def sampling(self, default_max: int) -> SamplingParams:
        asked = self.max_asked()
        logprobs, top = self.logprobs_asked()
        return SamplingParams(max_new_tokens=default_max if asked is None else asked,
                              temperature=1.0 if self.temperature is None else self.temperature,
                              top_p=1.0 if self.top_p is None else self.top_p, seed=self.seed,
                              stop=_stops(self.stop), stop_token_ids=tuple(self.stop_token_ids or ()),
                              ignore_eos=self.ignore_eos, no_stop_trim=self.no_stop_trim, logprobs=logprobs,
                              top_logprobs=top)


def _text_parts(content: str | list[dict] | None) -> str | list[dict] | None:
    """SGLang's text part is `{"type": "text", "text": str}`: one without its text, or with a number or null for
    it, is refused as SGLang refuses it, never rendered into the prompt as "", "5" or "None". Other parts pass
    (the chat template refuses what the embedded engine cannot render, naming the message)."""
    for i, part in enumerate(content if isinstance(content, list) else ()):
        if part.get("type") == "text" and not isinstance(part.get("text"), str):
            raise ValueError(f"part {i}: a text part needs 'text', a string")
    return content


class ChatMessage(_SGLangBody):
    RULES: ClassVar = fields.MESSAGE
    SGLANG: ClassVar = "ChatCompletionMessageGenericParam"
    role: Annotated[Literal["system", "developer", "user", "assistant", "tool"], BeforeValidator(_lower)]
    content: Annotated[str | list[dict] | None, AfterValidator(_text_parts)] = None
    name: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _no_tools(self):
        if self.role == "tool" or self.tool_calls or self.tool_call_id:
            raise ValueError(f"tool messages: {fields.CHAT['tools'].why}")
        if self.role == "user" and self.content is None:   # SGLang's user message requires it; the others may omit it
            raise ValueError("a user message needs 'content': a string or a list of parts")
        return self


class ChatCompletionRequest(_OpenAISampling):
    RULES: ClassVar = fields.CHAT
    SGLANG: ClassVar = "ChatCompletionRequest"
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: rs.MaxTokens | None = None
    continue_final_message: bool = False  # continue a final assistant message
    input_ids: list[int] | None = Field(default=None, min_length=1)   # the prompt's ids (no chat template)
    # not SGLang's (its chat streams ids only at the end): each chunk's output ids and the prompt's, as completions
    # stream them with return_token_ids; what the router continues a broken stream from (SGLang ignores the field)
    stream_token_ids: bool = False
    logprobs: bool | None = False
    top_logprobs: rs.TopLogprobs | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        rs.chat_logprobs(self.logprobs, self.top_logprobs)
        return self

    def logprobs_asked(self) -> tuple[bool, int]:
        return bool(self.logprobs), self.top_logprobs or 0


class CompletionRequest(_OpenAISampling):
    RULES: ClassVar = fields.COMPLETION
    SGLANG: ClassVar = "CompletionRequest"
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: rs.MaxTokens = 16     # SGLang's and OpenAI's default for completions
    temperature: rs.OpenAITemperature = 1.0
    top_p: rs.TopP = 1.0
    logprobs: rs.TopLogprobs | None = None   # legacy completions: an int, the alternatives per token (0: none)
    return_token_ids: bool = False   # each choice's output ids (per chunk when streaming) and the prompt's

    @model_validator(mode="before")
    @classmethod
    def _one_prompt(cls, data: Any) -> Any:
        return _no_batch(data, "prompt", (str, list))

    def logprobs_asked(self) -> tuple[bool, int]:
        return self.logprobs is not None, self.logprobs or 0


class GenerateSampling(_SGLangBody):
    RULES: ClassVar = fields.SAMPLING
    SGLANG: ClassVar = "SamplingParams"
    max_new_tokens: rs.MaxNewTokens | None = None
    temperature: rs.Temperature = 1.0
    top_p: rs.TopP = 1.0
    sampling_seed: rs.Seed | None = None
    stop: Stop = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False

    def params(self, default_max: int, logprobs: bool = False, top_logprobs: int = 0) -> SamplingParams:
        asked = default_max if self.max_new_tokens is None else self.max_new_tokens
        return SamplingParams(asked, self.temperature, self.top_p, self.sampling_seed,
                              _stops(self.stop), tuple(self.stop_token_ids or ()), self.ignore_eos,
                              self.no_stop_trim, logprobs, top_logprobs)


def _null_is_defaults(value: Any) -> Any:
    """SGLang's `sampling_params` is Optional: null means the defaults, as {} does."""
    return {} if value is None else value


class GenerateRequest(Bootstrap):
    RULES: ClassVar = fields.GENERATE
    SGLANG: ClassVar = "GenerateReqInput"
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: Annotated[GenerateSampling | None, BeforeValidator(_null_is_defaults)] = Field(
        default_factory=GenerateSampling)
    stream: bool = False
    return_logprob: bool | None = False
    top_logprobs_num: rs.TopLogprobs | None = None
    return_text_in_logprobs: bool | None = False
    return_prompt_token_ids: bool = False   # the prompt's ids in every event (with output_ids, as SGLang sends them)

    def max_asked(self) -> int | None:
        return self.sampling_params.max_new_tokens

    def sampling(self, default_max: int) -> SamplingParams:
        return self.sampling_params.params(default_max, bool(self.return_logprob), self.top_logprobs_num or 0)

    @model_validator(mode="before")
    @classmethod
    def _no_batches(cls, data: Any) -> Any:
        return _no_batch(_no_batch(data, "text", (str,)), "input_ids", (list,))

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids (batched lists are not supported)")
        return self


class AbortRequest(_Body):
    rid: str
