"""The topology's `router:` section is the router's own `OperatorSettings`: every setting, its limits checked with
file and line, what the orchestrator derives refused by name."""

from __future__ import annotations

import pytest

from dsv4_cluster.orchestrator.topology.load import parse_topology
from dsv4_cluster.orchestrator.topology.schema import RouterConfig
from dsv4_cluster.router.settings import OperatorSettings
from dsv4_cluster.router.settings_fields import derived_fields

from tests.topology_fixtures import BASE, check, edit, line_of

ROUTER = "  port: 30001\n"


def _router(extra: str) -> str:
    return edit(BASE, ROUTER, ROUTER + extra)


def test_every_router_setting_is_a_key_of_the_section_with_the_routers_default() -> None:
    router = parse_topology(_router("  health_check_interval_s: 0.5\n  model_aliases: [tiny]\n")).router
    assert (router.health_check_interval_s, router.model_aliases) == (0.5, ["tiny"])
    assert isinstance(router, OperatorSettings)
    assert parse_topology(BASE).router.stream_hold_s == OperatorSettings().stream_hold_s


@pytest.mark.parametrize("extra, key, message, fix", [
    ("  health_check_interval_s: 0\n", "health_check_interval_s", "0 is out of range", "use a value > 0"),
    ("  max_queued_per_worker: -1\n", "max_queued_per_worker", "-1 is out of range", "use a value >= 0"),
    ("  policy:\n    prefix:\n      block_chars: 4\n", "policy.prefix.block_chars", "4 is out of range",
     "use a value >= 8"),
    ("  stream_hold_s: '3'\n", "stream_hold_s", "expected a number, got '3'", "without quotes"),
    ("  breaker_failures: 2.5\n", "breaker_failures", "expected a whole number", "write an integer"),
])
def test_a_bad_router_value_names_file_line_and_key(extra: str, key: str, message: str, fix: str) -> None:
    text = _router(extra)
    check(text, f"router.{key}", line_of(text, key.split(".")[-1] + ":"), message, fix)


@pytest.mark.parametrize("key", sorted(RouterConfig.DERIVED))
def test_a_derived_router_setting_is_refused_naming_the_key_and_where_it_comes_from(key: str) -> None:
    text = _router(f"  {key}: x\n")
    check(text, f"router.{key}", line_of(text, f"{key}: x"), f"{key!r} is derived by the orchestrator",
          "remove it; " + RouterConfig.DERIVED[key])


def test_every_derived_setting_has_its_refusal() -> None:
    """A field added to RouterSettings beyond the operator's is either a topology key or refused with a reason."""
    assert set(RouterConfig.DERIVED) == set(derived_fields()) - set(RouterConfig.model_fields)


def test_api_keys_are_never_inline_and_unknown_keys_are_still_named() -> None:
    text = _router("  api_keys: [sk-one]\n")
    check(text, "router.api_keys", line_of(text, "api_keys:"), "API keys are never written in the topology",
          "topology.yaml")
    text = _router("  health_checks_interval_s: 1\n")
    check(text, "router.health_checks_interval_s", line_of(text, "health_checks"),
          "unknown key 'health_checks_interval_s'", "did you mean 'health_check_interval_s'?")
