"""Load through a running router: the streamed-chat load generator (`loadgen.py`: one concurrency level,
tok/s, TTFT/TPOT, errors by reason) and the concurrency sweep behind `dsv4-cluster bench URL` (`sweep.py`).
The benchmarks under `bench/` import the generator from here."""
