"""Test helper: a real Prometheus server's HTTP API (instant queries, targets, rules, alerts)."""

from __future__ import annotations

import re
import time
from typing import Any, Callable

import httpx

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


def wait_for(what: str, check: Callable[[], Any], timeout_s: float, interval_s: float = 0.25) -> Any:
    """Poll `check` until it returns something truthy; fail naming `what` after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)
