"""The orchestrator: a topology file in, a supervised PD cluster out.

Top down: `cli` (the `dsv4-cluster` command) -> `cluster` (the up/status/down sequences and day-two
operations, run in the CLI's Ray driver) -> `supervise` (the controller and supervisor actors), `verify`
and `monitor` -> `readback` (what a running worker is read back as) -> `launch` (launch plans, SGLang's
flags, capacity, preflight) -> `topology` (the file, validated). Beside them: `errors` (the typed errors,
free of Ray) and `processes` (process and process-group liveness).
"""
