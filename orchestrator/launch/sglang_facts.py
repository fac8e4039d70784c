"""What SGLang 0.5.23 does with DeepSeek-V4 whatever it is told (read in its wheel): the values the topology's
rules and the launch plan both follow. A leaf module: the topology imports it without the launch spec."""

# SGLang 0.5.23 registers these parser names for DeepSeek-V4 (reasoning_parser_names.py and
# function_call/parser_names.py in its wheel).
SGLANG_REASONING_PARSER = "deepseek-v4"
SGLANG_TOOL_CALL_PARSER = "deepseekv4"
DSV4_PAGE_SIZE = 256  # model_overrides/deepseek_v4.py: forced on CUDA whatever --page-size says
# The V4 KV pool stores 584-byte fp8 rows only (mem_cache/deepseek_v4_memory_pool.py asserts uint8 storage, which
# bfloat16 is not): `auto` resolves to it, bf16 fails at start. Our kernels read those rows.
SGLANG_V4_KV_DTYPE = "fp8_e4m3"
SGLANG_KV_DTYPE = {"auto": SGLANG_V4_KV_DTYPE, "fp8_e4m3": SGLANG_V4_KV_DTYPE}
