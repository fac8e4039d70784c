"""KV memory: the paged pool (float rows or SGLang's fp8 V4 pages), its allocator, the prefix cache, NIXL transfer."""
