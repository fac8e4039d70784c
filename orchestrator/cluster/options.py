"""Options of `up` and `down`; the CLI takes its defaults from here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UpOptions:
    address: str | None = None  # join this Ray cluster; default: the topology's, else a new head
    timeout_s: float = 600.0  # per process, from spawn to READY
    head_timeout_s: float = 60.0  # for a Ray head `up` starts
    foreground: bool = False  # stay attached; SIGTERM/SIGINT takes the cluster down


@dataclass(frozen=True)
class DownOptions:
    timeout_s: float = 30.0  # per process: SIGTERM, then SIGKILL after this many seconds
