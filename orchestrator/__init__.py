"""The orchestrator: a topology file in, a supervised PD cluster out.

Top down: `cli` -> `cluster` (up/status/down and day-two operations, in the CLI's Ray driver) -> `supervise`
(controller and supervisor actors), `verify`, `monitor` -> `readback` -> `launch` -> `topology`. Beside them:
`load` (the load behind `dsv4-cluster bench`, importing no other orchestrator package), `errors` (typed, free of
Ray) and `processes` (process-group liveness).
"""
