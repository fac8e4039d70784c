"""The embedded PD engine, by job: `http/` (the SGLang-compatible HTTP surface), `engine/` (model, scheduling
loop, sampling), `kv/` (the paged KV pool, prefix cache and NIXL transfer); `prefill/` and `decode/` are the two
`core.Role`s, each its engine and server; `main.py` runs one role (`python -m dsv4_cluster.workers.<role>`)."""
