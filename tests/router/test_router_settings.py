"""The router's settings model: docs/router.md's tables and `plan`'s printout come from it; its file is read strictly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsv4_cluster.router.settings import OperatorSettings, RouterSettings, SettingsError, load_settings
from dsv4_cluster.router.settings_fields import leaves, summary, with_tables

REPO = Path(__file__).resolve().parents[2]


def test_the_docs_tables_are_the_settings_models() -> None:
    """A setting added to (or changed in) the models without regenerating docs/router.md fails here."""
    text = (REPO / "docs" / "router.md").read_text()
    assert with_tables(text) == text, \
        "docs/router.md's settings tables are stale: python -m dsv4_cluster.router.settings_fields --write docs/router.md"


def test_the_plan_printout_names_every_operator_setting_with_its_value() -> None:
    settings = RouterSettings(model_name="m", stream_hold_s=7.5, policy={"prefix": {"threshold": 0.25}})
    text = " ".join(summary(settings))
    assert [key for key, _ in leaves(OperatorSettings) if f" {key}=" not in text] == []
    assert "stream_hold_s=7.5," in text and "policy.prefix.threshold=0.25," in text
    assert "API keys: none" in text


@pytest.mark.parametrize("settings, field", [
    ({"port": "30001"}, "port"),
    ({"policy": {"prefix": {"threshold": "0.5"}}}, "policy.prefix.threshold"),
    ({"prefill_policy": "prefix"}, "prefill_policy"),
])
def test_a_settings_file_is_read_strictly_naming_the_field(tmp_path: Path, settings: dict, field: str) -> None:
    path = tmp_path / "router.json"
    path.write_text(json.dumps({"model_name": "m", **settings}))
    with pytest.raises(SettingsError, match=rf"router settings {path} are invalid:\n  {field}: "):
        load_settings(path)
