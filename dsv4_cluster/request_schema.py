"""The request schema's shared facts: every sampling value's range, and the one rename of `max_tokens`.

The router's admission (`router/admission.py`, open models: SGLang's extensions pass through) and the
embedded workers' bodies (`workers/http/protocol.py`, closed models) declare their fields with these types, so a
value the router admits is one a worker takes and the other way round. The ranges are SGLang 0.5.23's
(`SamplingParams.verify` in `sglang/srt/sampling/sampling_params.py`, `CompletionRequest`'s
`validate_max_tokens_positive` in `sglang/srt/entrypoints/openai/protocol.py`) and, on the OpenAI routes,
OpenAI's (temperature at most 2, `max_tokens` at least 1, `n` and `top_logprobs` bounded).

Logprob alternatives (`top_logprobs` on chat, the integer `logprobs` of legacy completions, `top_logprobs_num` on
`/generate`) are bounded by OpenAI's chat limit, `MAX_TOP_LOGPROBS` (20), on every route (OpenAI's legacy
completions stop at 5; 6..20 are taken here as SGLang takes them).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError

# SGLang's SamplingParams.verify, on every route.
Temperature = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]           # finite, >= 0 (0: greedy)
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]           # (0, 1]
MinP = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]           # [0, 1]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]       # presence/frequency: [-2, 2]
MaxNewTokens = Annotated[int, Field(ge=0)]                                     # 0: prefill only, no output
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]                        # sampling_seed / seed


def _whole(value: Any) -> Any:
    """A float with no fractional part as its int: SGLang's OpenAI models (lax pydantic) take `max_tokens: 5.0`."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# OpenAI's ranges on /v1/chat/completions and /v1/completions.
OpenAITemperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
MaxTokens = Annotated[int, Field(ge=1), BeforeValidator(_whole)]               # max_tokens, max_completion_tokens
N = Annotated[int, Field(ge=1, le=128)]   # not whole floats: the router counts a batch's items by an int n
MAX_TOP_LOGPROBS = 20                                                          # OpenAI's limit on chat
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]                # alternatives per output token

_CHECKS = {"temperature": TypeAdapter(Temperature), "top_p": TypeAdapter(TopP),
           "max_new_tokens": TypeAdapter(MaxNewTokens), "sampling_seed": TypeAdapter(Seed),
           "top_logprobs": TypeAdapter(TopLogprobs)}


def check(field: str, value: Any) -> None:
    """ValueError naming `field` when `value` is out of its range (for values built outside a request body)."""
    try:
        _CHECKS[field].validate_python(value, strict=True)
    except ValidationError as e:
        raise ValueError(f"{field}: {e.errors(include_url=False)[0]['msg']}, got {value!r}") from None


def max_new_tokens(max_completion_tokens: int | None, max_tokens: int | None) -> int | None:
    """An OpenAI body's output budget under SGLang's name: OpenAI's current `max_completion_tokens` wins over
    the deprecated `max_tokens`, as SGLang's `ChatCompletionRequest.to_sampling_params` does. None: not given."""
    return max_completion_tokens if max_completion_tokens is not None else max_tokens


def chat_logprobs(logprobs: bool | None, top_logprobs: int | None) -> None:
    """OpenAI's rule on chat: `top_logprobs` (alternatives per token) needs `logprobs: true` (ValueError otherwise)."""
    if top_logprobs and not logprobs:
        raise ValueError(f"top_logprobs {top_logprobs} needs logprobs: true (OpenAI's rule); send logprobs: true "
                         "or drop top_logprobs")


_OBJECT_TYPES = frozenset({"model_type", "dataclass_type", "is_instance_of"})


def error_text(error: Any) -> str:
    """One pydantic error's message as a client reads it: pydantic's "Value error, " prefix dropped, and a JSON
    object expected said so (pydantic's "a valid dictionary or instance of GenerateSampling" names our model
    class, which a client never sees)."""
    if error["type"] in _OBJECT_TYPES:
        return "Input should be a JSON object"
    return error["msg"].removeprefix("Value error, ")


def json_body(raw: bytes) -> Any:
    """A request body's JSON, read as the router's admission and the embedded workers both read it; ValueError
    saying what the client must change: not JSON (or not UTF-8), arrays or objects nested past the parser's stack,
    an integer literal past Python's digit limit (`sys.set_int_max_str_digits`), each the client's fault, not a 500."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"the request body is not valid JSON ({exc}); send a JSON object") from exc
    except RecursionError:
        raise ValueError("the request body nests arrays or objects too deeply to be read; "
                         "send a JSON object of reasonable depth") from None
    except ValueError:   # int(): "Exceeds the limit (4300 digits) ..."
        raise ValueError("the request body has an integer literal with too many digits to be read; "
                         "send numbers of reasonable size") from None
