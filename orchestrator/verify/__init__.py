"""Proof that a running cluster works: kernels active in every worker (SGLang attestations, embedded
call counters), the PD path equal to a single process, the shipped answers and a throughput probe
through the router (`sequence.py` runs them), and the controller's periodic deep probe of every pair."""
