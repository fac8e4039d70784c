"""The reliability bench's table (markdown), from its results dict (`reliability.py`)."""

from __future__ import annotations


def _s(value) -> str:
    return "-" if value is None else (f"{value:.2f}" if isinstance(value, float) else str(value))


def faults_table(faults: list[dict]) -> list[str]:
    rows = ["| fault | in flight | completed | errored explicitly | held, then completed | reset | hung | lost "
            "| latest end after fault (s) | recovery (s) | after recovery ok | KV back to baseline | orphans | ok |",
            "|" + " --- |" * 14]
    for f in faults:
        kv = "yes" if f["kv_after"] == f["kv_baseline"] else f"no: {f['kv_baseline']} -> {f['kv_after']}"
        rows.append(f"| {f['fault']} | {f['in_flight']} | {f['completed']} | {f['errored']} | {f.get('held', 0)} | "
                    f"{f['reset']} | "
                    f"{f['hung']} | {f['lost']} | {_s(f['latest_end_after_fault_s'])} | {_s(f['recovery_s'])} | "
                    f"{f['after_ok']}/{f['after_total']} | {kv} | {len(f['orphans'])} | "
                    f"{'yes' if f['ok'] else 'NO'} |")
    return rows


def soak_table(soak: dict) -> list[str]:
    mem = ", ".join(f"{k} {v['growth_pct']:+.1f}%" for k, v in soak["rss"].items())
    return ["| requests | concurrency | completed | errored explicitly | left on purpose | hung | lost | p50 (s) "
            "| p99 (s) | wall (s) | RSS growth warm-up -> end | KV at end | ok |", "|" + " --- |" * 13,
            f"| {soak['requests']} | {soak['concurrency']} | {soak['completed']} | {soak['errored']} | {soak['left']} "
            f"| {soak['hung']} | {soak['lost']} | {_s(soak['p50_s'])} | {_s(soak['p99_s'])} | {_s(soak['wall_s'])} "
            f"| {mem} | {soak['kv_end']} | {'yes' if soak['ok'] else 'NO'} |"]


def input_table(inp: dict) -> list[str]:
    rows = ["| check | cases | 5xx | schema-breaking | other failures | ok |", "|" + " --- |" * 6]
    for c in inp["checks"]:
        rows.append(f"| {c['name']} | {c['cases']} | {c['server_errors']} | {c.get('schema_breaking', '-')} "
                    f"| {len(c['failures'])} | {'yes' if c['ok'] else 'NO'} |")
    return rows


def security_table(sec: dict) -> list[str]:
    rows = ["| check | result | ok |", "| --- | --- | --- |"]
    for c in sec["checks"]:
        rows.append(f"| {c['name']} | {c['detail']} | {'yes' if c['ok'] else 'NO'} |")
    return rows


def render(out: dict) -> str:
    m = out["machine"]
    lines = ["# Reliability: faults, bad input, security, soak on the embedded cluster", "",
             f"`{out.get('command', '')}`: {m['cpus']} CPUs, load average {m['loadavg_before'][0]:.1f} before -> "
             f"{m['loadavg_after'][0]:.1f} after (the machine is shared with other work), {out['wall_s']} s. "
             f"Passed: {'yes' if out.get('passed') else 'NO'}.", ""]
    if "faults" in out:
        lines += ["## Faults (explicit error or answer within 10 s of the fault, or held for the worker's return "
                  "and completed; hung and lost must be 0)", "",
                  *faults_table(out["faults"]), ""]
        for f in out["faults"]:
            lines += [f"- {f['fault']}: {s}" for s in f["samples"]]
        lines.append("")
    if "soak" in out:
        lines += ["## Soak", "", *soak_table(out["soak"]), ""]
    if "input" in out:
        lines += ["## Bad input", "", *input_table(out["input"]), ""]
    if "security" in out:
        lines += ["## Security", "", *security_table(out["security"]), ""]
    lines.append(f"Processes left after `down`: {out['after_down']['leftover_processes'] or 'none'}.")
    return "\n".join(lines) + "\n"
