"""SGLang 0.5.23's request fields that the embedded engine does not act on, and when each is accepted.

`ANY`: the value cannot change the output (ids, routing hints, logging): accepted. `Neutral(values, why)`:
accepted when it is one of SGLang's no-op values, else a 400 naming the field and saying why. Nothing that would
change the request's meaning is silently ignored; tests/workers/test_request_schema.py compares these tables with the
installed SGLang.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Neutral:
    values: tuple
    why: str

    def accepts(self, value: Any) -> bool:
        return any(_same(value, v) for v in self.values)


def _same(a: Any, b: Any) -> bool:
    """Equal, with None, booleans and numbers kept apart (False is not 0; 0 is 0.0)."""
    if a is None or b is None or isinstance(a, bool) or isinstance(b, bool):
        return a is b
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float)) and a == b)


ANY = "any"
Rule = Neutral | str

_TEXT_ONLY = "the embedded engine is text-only"
_LOGPROBS = ("the embedded engine returns the logprobs of output tokens and their top alternatives only (no prompt "
             "logprobs, chosen-token-id logprobs, sampling masks or flat/raw forms)")
_INTERNALS = "the embedded engine does not expose hidden states, routed experts or indexer picks"
_LORA = "the embedded engine has no LoRA adapters"
_GRAMMAR = "the embedded engine has no constrained decoding (regex, EBNF, JSON schema, structural tags)"
_PENALTY = "the embedded engine applies no penalties or logit bias"
_SAMPLER = "the embedded engine samples with temperature, top_p and a seed only"
_SESSION = "the embedded engine keeps no sessions"
_CUSTOM = "the embedded engine runs no custom logit processors, watermarks or custom params"
_REASONING = "the embedded engine has no reasoning parser (model_info.reasoning_parser is null)"
_TOOLS = "the embedded engine has no tool-call parser (model_info.tool_call_parser is null)"
_ONE = "the embedded engine returns one choice; send several requests instead"
_EXTRA = "the embedded engine adds no extra response sections"


def _off(why: str, *extra: Any) -> Neutral:
    """Accepted only when absent-equivalent: None, False, an empty list/dict/string, or `extra`."""
    return Neutral((None, False, [], {}, "", *extra), why)


def _zero(why: str, *extra: Any) -> Neutral:
    return Neutral((None, 0, *extra), why)


def _mm(names: str) -> dict[str, Rule]:
    return {n: _off(_TEXT_ONLY) for n in names.split()}


# Fields two or more of the request kinds share, with one rule.
_SHARED: dict[str, Rule] = {
    # routing, identity, logging: they cannot change the text
    "session_id": ANY, "routed_dp_rank": ANY, "data_parallel_rank": ANY, "disagg_prefill_dp_rank": ANY,
    "extra_key": ANY, "cache_salt": ANY, "priority": ANY, "custom_labels": ANY, "model": ANY, "user": ANY,
    # what the engine cannot do
    "return_hidden_states": _off(_INTERNALS), "return_routed_experts": _off(_INTERNALS),
    "routed_experts_start_len": _zero(_INTERNALS), "return_cached_tokens_details": _off(_EXTRA),
    "return_spec_tokens_details": _off(_EXTRA), "return_token_ids": _off(_EXTRA),
    "return_prompt_token_ids": _off(_EXTRA), "return_sampling_mask": _off(_LOGPROBS),
    "sampling_logprobs_mode": _off(_LOGPROBS, "selected"),   # "selected", SGLang's default, is what is returned
    "return_flat_raw_output_top_logprobs": _off(_LOGPROBS),
    "lora_path": _off(_LORA), "session_params": _off(_SESSION), "custom_logit_processor": _off(_CUSTOM),
    "custom_params": _off(_CUSTOM), "watermark": _off(_CUSTOM), "images_config": _off(_TEXT_ONLY),
    "mm_processor_kwargs": _off(_TEXT_ONLY), "video_config": _off(_TEXT_ONLY),
    "use_audio_in_video": _off(_TEXT_ONLY), "max_dynamic_patch": _off(_TEXT_ONLY),
    "min_dynamic_patch": _off(_TEXT_ONLY),
    "frequency_penalty": _zero(_PENALTY), "presence_penalty": _zero(_PENALTY),
    "repetition_penalty": Neutral((None, 1), _PENALTY), "logit_bias": _off(_PENALTY),
    "top_k": Neutral((None, -1), _SAMPLER), "min_p": _zero(_SAMPLER), "min_tokens": _zero(_SAMPLER),
    "regex": _off(_GRAMMAR), "ebnf": _off(_GRAMMAR), "json_schema": _off(_GRAMMAR),
    "stop_regex": _off("the embedded engine matches stop strings and stop token ids, not regexes"),
    "response_format": _off(_GRAMMAR + "; response_format {'type': 'text'} is accepted", {"type": "text"}),
    "n": Neutral((None, 1), _ONE),
    "skip_special_tokens": Neutral((True, None), "the embedded engine always leaves special tokens out of "
                                                 "the text"),
}

CHAT: dict[str, Rule] = {
    **{k: v for k, v in _SHARED.items() if k not in ("custom_labels", "json_schema")},
    "tools": _off(_TOOLS), "parallel_tool_calls": ANY,
    "tool_choice": Neutral(("none", "auto", None), _TOOLS + "; tool_choice 'required' or a named tool "
                                                    "cannot be honoured"),
    "return_meta_info": _off(_EXTRA), "return_input_ids_in_sglext": _off(_EXTRA),
    "return_output_ids_in_sglext": _off(_EXTRA), "return_flat_raw_top_logprobs_b64": ANY,
    "reasoning_effort": _off(_REASONING, "none"), "thinking": _off(_REASONING),
    "task": _off("the embedded engine has no DeepSeek-V4 quick-instruction tasks"),
    # without a reasoning parser there is no reasoning to separate or stream: no effect either way
    "separate_reasoning": ANY, "stream_reasoning": ANY,
    "chat_template_kwargs": _off("the embedded chat template takes no arguments"),
}

COMPLETION: dict[str, Rule] = {
    **{k: v for k, v in _SHARED.items() if k not in (
        "max_dynamic_patch", "min_dynamic_patch", "return_flat_raw_output_top_logprobs", "return_prompt_token_ids",
        "return_token_ids", "return_sampling_mask", "sampling_logprobs_mode", "use_audio_in_video", "video_config")},
    "best_of": Neutral((None, 1), _ONE), "echo": _off("the embedded engine does not echo the prompt"),
    "suffix": _off("the embedded engine does not insert a suffix"),
}

GENERATE: dict[str, Rule] = {
    **{k: _SHARED[k] for k in ("session_id", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank",
                               "extra_key", "cache_salt", "priority", "custom_labels", "return_hidden_states",
                               "return_routed_experts", "routed_experts_start_len",
                               "return_sampling_mask", "sampling_logprobs_mode", "lora_path", "session_params",
                               "custom_logit_processor", "watermark", "images_config", "mm_processor_kwargs",
                               "video_config", "use_audio_in_video", "max_dynamic_patch", "min_dynamic_patch",
                               "return_flat_raw_output_top_logprobs")},
    **_mm("input_embeds image_data video_data audio_data mm_hashes mm_content_hashes modalities "
          "image_max_dynamic_patch video_max_dynamic_patch need_wait_for_mm_inputs num_items_assigned "
          "encoder_urls positional_embed_overrides multi_item_delimiter_indices token_indices_to_pool"),
    "logprob_start_len": Neutral((None, -1), _LOGPROBS), "token_ids_logprob": _off(_LOGPROBS),
    "return_flat_raw_top_logprobs": _off(_LOGPROBS), "return_flat_raw_top_logprobs_b64": _off(_LOGPROBS),
    "return_indexer_topk": _off(_INTERNALS), "lora_id": _off(_LORA),
    "bootstrap_pair_key": ANY, "decode_tp_size": ANY, "routing_key": ANY, "conversation_id": ANY,
    "http_worker_ipc": ANY, "log_metrics": ANY, "no_logs": ANY, "external_trace_header": ANY,
    "received_time": ANY, "kv_hints": ANY,
    "background": _off("the embedded engine answers in the foreground only"),
    "require_reasoning": _off(_REASONING), "max_thinking_tokens": _off(_REASONING),
    "return_bytes": _off(_EXTRA), "return_entropy": _off(_EXTRA),
    # not SGLang's: its Rust router adds it to /generate, and SGLang's server ignores unknown fields there
    "model": ANY,
}

# The OpenAI API's chat fields that SGLang's ChatCompletionRequest lacks (its pydantic model ignores them), which
# OpenAI clients send: accepted where they cannot change the output, else at their no-op values.
OPENAI_CHAT: dict[str, Rule] = {
    "store": ANY, "metadata": ANY, "service_tier": ANY, "prompt_cache_key": ANY, "safety_identifier": ANY,
    "prediction": ANY,   # predicted output: a speed hint, the output is the same
    "verbosity": Neutral((None, "medium"), "the embedded engine has no verbosity control"),
    "modalities": Neutral((None, ["text"]), _TEXT_ONLY), "audio": _off(_TEXT_ONLY),
    "functions": _off(_TOOLS), "function_call": Neutral((None, "none", "auto"), _TOOLS),
    "web_search_options": _off("the embedded engine has no web search"),
}
CHAT.update(OPENAI_CHAT)

# A chat message's fields beyond role, content, name, reasoning_content, tool_calls and tool_call_id: SGLang's
# (ChatCompletionMessageGenericParam), then the OpenAI API's that its responses carry and clients send back in the
# next turn's history (SGLang ignores them).
MESSAGE: dict[str, Rule] = {
    "phase": _off("the embedded chat template has no message phases"), "tools": _off(_TOOLS),
    "prefix": _off("DeepSeek's prefix completion: send continue_final_message: true instead"),
}
OPENAI_MESSAGE: dict[str, Rule] = {"refusal": ANY, "annotations": ANY, "audio": _off(_TEXT_ONLY),
                                   "function_call": _off(_TOOLS)}
MESSAGE.update(OPENAI_MESSAGE)

SAMPLING: dict[str, Rule] = {
    **{k: _SHARED[k] for k in ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
                               "top_k", "min_p", "regex", "ebnf", "json_schema", "stop_regex", "custom_params",
                               "watermark", "skip_special_tokens", "n")},
    "min_new_tokens": _zero(_SAMPLER), "n": Neutral((None, 1), _ONE),
    "beam_width": Neutral((None, 1), "the embedded engine has no beam search"),
    "structural_tag": _off(_GRAMMAR), "spaces_between_special_tokens": ANY, "stream_interval": ANY,
}


def check(body: dict, rules: dict[str, Rule], where: str = "") -> dict:
    """`body` without the fields `rules` accepts; raises ValueError naming the first refused one."""
    kept = {}
    for key, value in body.items():
        rule = rules.get(key)
        if rule is None:
            kept[key] = value
        elif rule is not ANY and not rule.accepts(value):
            raise ValueError(f"{where}{key}: {json.dumps(value)} is not supported: {rule.why}; omit it or send "
                             f"{_spell(rule.values)}")
    return kept


def _spell(values: tuple) -> str:
    """The accepted values as JSON (null, false, 1, {"type": "text"}), empty containers left out."""
    shown = [json.dumps(v) for v in values if not (isinstance(v, (list, dict, str)) and not v)]
    return " or ".join(dict.fromkeys(shown))
