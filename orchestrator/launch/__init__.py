"""What gets started and how: launch plans (argv, env, log file, readiness probes) of every process,
SGLang's flags and KV pool sizing, predicted KV capacity, and the machine checks run before `up` starts
anything (preflight, ports and who holds them)."""
