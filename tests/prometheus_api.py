"""Test helper: a real Prometheus server's HTTP API (instant queries, targets, rules, alerts)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from dsv4_cluster import metric_names

GRAFANA_RATE = "$__rate_interval"
RATE_FOR_TESTS = "1m"  # Grafana's $__rate_interval, as Grafana would pick it for a 1 s scrape
_NAME = re.compile(r"(sglang:[a-z0-9_]+|dsv4_[a-z0-9_]+)")


class PromQLError(AssertionError):
    """Prometheus refused or failed to evaluate an expression."""


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url
        self._http = httpx.Client(timeout=10.0)

    def _get(self, path: str, **params: str) -> Any:
        reply = self._http.get(f"{self.url}{path}", params=params).json()
        if reply.get("status") != "success":
            raise PromQLError(f"{path} {params}: {reply.get('errorType')}: {reply.get('error')}")
        return reply["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query; Grafana's $__rate_interval replaced. Raises PromQLError."""
        return list(self._get("/api/v1/query", query=expr.replace(GRAFANA_RATE, RATE_FOR_TESTS))["result"])

    def targets(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/targets")["activeTargets"])

    def rules(self) -> list[dict[str, Any]]:
        return [r for g in self._get("/api/v1/rules")["groups"] for r in g["rules"]]

    def alerts(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/alerts")["alerts"])

    def exported(self, name: str) -> bool:
        """True when any target exports a series of `name` (or, for a histogram, `name_bucket`) now."""
        return bool(self.query(f'count({{__name__=~"{name}|{name}_bucket"}})'))

    def close(self) -> None:
        self._http.close()


def metric_names_in(expr: str) -> set[str]:
    """The metric names an expression reads (histogram `_bucket` suffixes removed)."""
    return {n.removesuffix("_bucket") for n in _NAME.findall(expr)}


def known_metric_names() -> set[str]:
    names: set[str] = set()
    for key, value in vars(metric_names).items():
        if key.isupper() and isinstance(value, str):
            names.add(value)
        elif key.isupper() and isinstance(value, tuple):
            names.update(value)
    return names


# Prometheus (2.x) hands discovered targets on through two fixed 5 s throttles: the discovery manager's
# update tick and the scrape manager's reload tick.
PROMETHEUS_SD_THROTTLES_S = 5.0 + 5.0
LOADED_MACHINE = 3.0  # a loaded 2-core CI machine runs Prometheus' timers late; a ceiling, not a delay


def _seconds(duration: str) -> float:
    """A Prometheus duration as this project writes them ("1s", "500ms", "2m")."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)", duration)
    assert match, f"unexpected Prometheus duration {duration!r}"
    return float(match[1]) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match[2]]


@dataclass(frozen=True)
class Cadence:
    """How often the running Prometheus acts, read from the prometheus.yml it was started with."""

    scrape_s: float
    evaluation_s: float
    file_sd_refresh_s: float

    @classmethod
    def of(cls, config_path: Path) -> Cadence:
        config = yaml.safe_load(config_path.read_text())
        refresh = {c["refresh_interval"] for job in config["scrape_configs"] for c in job["file_sd_configs"]}
        assert len(refresh) == 1, refresh
        return cls(_seconds(config["global"]["scrape_interval"]), _seconds(config["global"]["evaluation_interval"]),
                   _seconds(refresh.pop()))

    def targets_follow_files_s(self) -> float:
        """The most a targets-file change takes to show in /api/v1/targets: the file re-read (inotify at once;
        the refresh interval if its event is missed), the two throttles, one scrape; on a loaded machine."""
        return LOADED_MACHINE * (self.file_sd_refresh_s + PROMETHEUS_SD_THROTTLES_S + self.scrape_s)
