"""Request bodies the embedded workers accept, in SGLang's and OpenAI's shapes.

Unknown fields are rejected with a 400 that names them, rather than silently ignored; fields the
tiny engine cannot honour (n > 1, logprobs, tools) are rejected the same way.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .sampling import SamplingParams


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Bootstrap(_Body):
    """Fields the router adds (PROTOCOL.md, router -> workers)."""

    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = Field(default=None, ge=0, le=2**63 - 1)
    rid: str | None = None

    @property
    def has_bootstrap(self) -> bool:
        return self.bootstrap_host is not None and self.bootstrap_room is not None


class StreamOptions(_Body):
    include_usage: bool = False


class _OpenAISampling(Bootstrap):
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    user: str | None = None
    ignore_eos: bool = False
    logprobs: bool | int | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.n != 1:
            raise ValueError("n: only n=1 is supported; send several requests instead")
        if self.logprobs:
            raise ValueError("logprobs: not supported by the embedded engine; drop the field")
        return self

    def sampling(self, default_max: int) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(max_new_tokens=self.max_tokens or default_max, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos)


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict] | None = None
    name: str | None = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    continue_final_message: bool = False  # continue a final assistant message (the router's stream migration)

    def sampling(self, default_max: int) -> SamplingParams:
        params = super().sampling(default_max)
        if self.max_completion_tokens and not self.max_tokens:
            params = SamplingParams(**{**params.__dict__, "max_new_tokens": self.max_completion_tokens})
        return params


class CompletionRequest(_OpenAISampling):
    prompt: str


class GenerateSampling(_Body):
    max_new_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, alias="sampling_seed")
    stop: str | list[str] | None = None
    ignore_eos: bool = False

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    def params(self) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(self.max_new_tokens, self.temperature, self.top_p, self.seed, stop, self.ignore_eos)


class GenerateRequest(Bootstrap):
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSampling = Field(default_factory=GenerateSampling)
    stream: bool = False
    return_logprob: bool = False

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids (batched lists are not supported)")
        if self.return_logprob:
            raise ValueError("return_logprob: not supported by the embedded engine")
        return self


class AbortRequest(_Body):
    rid: str
