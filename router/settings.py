"""Router settings: the JSON file the orchestrator writes and `python -m dsv4_cluster.router` reads.

`OperatorSettings` is what an operator sets (the topology's `router:` section is that model); `RouterSettings` adds
what the orchestrator derives. Validated with pydantic (`extra="forbid"`, strict) so that a typo in a field name or
a bad URL fails at startup with the field's path in the message, not at the first request. The CLI takes its
defaults from here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .policies import PolicySettings


class SettingsError(ValueError):
    """The settings file is missing, not JSON, or does not validate; the message names the field."""


def _check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r} is not an http(s) URL with a host; write it like 'http://127.0.0.1:30100'")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r} must be the server's base URL, without a path, query or fragment")
    return url.rstrip("/")


class DecodeEndpoint(BaseModel):
    """One decode server: its HTTP URL."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    name: str = Field(min_length=1)
    url: str

    _url = field_validator("url")(_check_url)


class PrefillEndpoint(DecodeEndpoint):
    """One prefill server: its HTTP URL and where decode servers reach its bootstrap server."""

    bootstrap_host: str = Field(min_length=1, description="P's host as reachable from the decode servers")
    bootstrap_port: int | None = Field(default=8998, ge=1, le=65535)


class OperatorSettings(BaseModel):
    """What an operator sets about the router, each setting declared once: its default, limit and description.

    The topology's `router:` section is this model plus where the router runs and where its API keys come from
    (`orchestrator/topology/schema.py`'s `RouterConfig`); docs/router.md's table is generated from it
    (`settings_fields.py`). Strict: "30" is not a number, a typo is not a setting.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    host: str = Field(default="0.0.0.0", min_length=1, description="address the router binds")
    port: int = Field(default=30001, ge=1, le=65535, description="port the router listens on (no worker may use it)")
    policy: PolicySettings = Field(default_factory=PolicySettings, description="how each role's worker is chosen")
    model_aliases: list[str] = Field(default_factory=list, description="other names clients may use for the model; "
                                     "any other name gets 404 `model_not_found`")
    max_body_bytes: int = Field(default=32 * 2**20, ge=1024, description="larger request bodies get 413")
    request_timeout_s: float = Field(default=600.0, gt=0, description="how long the router waits on a worker "
                                     "for its answer's head, its body, or a stream's next chunk")
    connect_timeout_s: float = Field(default=5.0, gt=0, description="deadline for opening a connection to a worker "
                                     "(and for an abort call)")
    request_head_timeout_s: float = Field(default=10.0, gt=0, description="a request head not complete this long "
                                          "after its first byte gets 408 and its connection closed (slowloris)")
    request_body_timeout_s: float = Field(default=30.0, gt=0, description="a request body not complete this long "
                                          "after its head gets 408 and its connection closed")
    upstream_keepalive_s: float = Field(default=4.5, gt=0, description="idle upstream connections are dropped after "
                                        "this; keep it below the workers' keep-alive (SGLang's: 5 s; the embedded "
                                        "workers': 65 s). Shorter costs "
                                        "a connect per request to workers that are seldom picked (many workers)")
    health_check_interval_s: float = Field(default=2.0, gt=0, description="how often each worker's `/health` is polled")
    health_check_timeout_s: float = Field(default=2.0, gt=0, description="deadline of one `/health` poll")
    health_failures_to_unhealthy: int = Field(default=2, ge=1,
                                              description="consecutive failed checks before a worker leaves the pool")
    max_queued_per_worker: int = Field(default=64, ge=0, description="a stage whose every eligible worker has this "
                                       "many requests queued for KV pages is saturated: new requests get 503 + "
                                       "Retry-After at once (backpressure.py); 0: off")
    stream_hold_s: float = Field(default=15.0, ge=0, description="a request whose prefill or decode died under it, "
                                 "with no other worker of that role that answers, is held this long for one (the "
                                 "supervisor restarts the dead one), tried at most once a second; 0: not held")
    max_retries: int = Field(default=2, ge=0, description="fresh pairs tried after a connection-level failure that "
                             "happened before the first byte reached the client")
    migration_limit: int = Field(default=1, ge=0, description="times a stream whose decode died is continued on "
                                 "a fresh pair before it ends with an error event")
    breaker_failures: int = Field(default=5, ge=1, description="connection failures in a row that open a worker's "
                                  "circuit breaker")
    breaker_cooldown_s: float = Field(default=5.0, gt=0, description="how long an open breaker keeps its worker out "
                                      "before one request tries it again")


class RouterSettings(OperatorSettings):
    """The settings file: what an operator sets, plus what the orchestrator derives from the rest of the topology
    (model name, workers, admin token) and the API keys. The pools may be empty (then /health is 503 and requests
    get 503)."""

    model_name: str = Field(min_length=1, description="the served model's name (the topology's model.name)")
    context_length: int | None = Field(default=None, ge=1, description="the model's context length, prompt + output "
                                       "(the topology's model.context_length): `/v1/models`' max_model_len")
    prefill: list[PrefillEndpoint] = Field(default_factory=list, description="the prefill workers")
    decode: list[DecodeEndpoint] = Field(default_factory=list, description="the decode workers")
    admin_token: str | None = Field(
        default=None, min_length=16, repr=False,
        description="bearer token of `/admin/*`; without one the admin routes answer 403 (docs/router_admin.md)")
    api_keys: list[str] = Field(default_factory=list, repr=False,
                                description="if set, `/v1/*` and `/generate` need "
                                "`Authorization: Bearer KEY` with one of them as KEY")
    api_keys_file: str | None = Field(default=None, description="a file of API keys, one per line ('#' comments), "
                                      "added to api_keys when the settings are loaded")
    api_keys_env: str | None = Field(default=None, description="an environment variable holding API keys, "
                                     "comma-separated, added to api_keys when the settings are loaded")

    @model_validator(mode="after")
    def _names_unique(self) -> RouterSettings:
        names = [w.name for w in [*self.prefill, *self.decode]]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"worker names must be unique across prefill and decode; repeated: {dupes}")
        return self


def _describe(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"  {where}: {e['msg']}")
    return "\n".join(lines)


def with_api_keys(settings: RouterSettings) -> RouterSettings:
    """`settings` with the keys of `api_keys_file` / `api_keys_env` added to `api_keys` (read now, in this
    process); SettingsError naming the file or variable when it cannot be read or holds no key."""
    keys, sources = list(settings.api_keys), []
    if settings.api_keys_file is not None:
        try:
            lines = Path(settings.api_keys_file).read_text().splitlines()
        except OSError as exc:
            raise SettingsError(f"cannot read the API keys file {settings.api_keys_file} (api_keys_file): "
                                f"{exc.strerror}") from exc
        sources.append((f"the API keys file {settings.api_keys_file}",
                        [s for line in lines if (s := line.split("#", 1)[0].strip())]))
    if settings.api_keys_env is not None:
        if settings.api_keys_env not in os.environ:
            raise SettingsError(f"the environment variable {settings.api_keys_env} (api_keys_env) is not set in the "
                                "router's environment; set it where the cluster is started")
        sources.append((f"the environment variable {settings.api_keys_env}",
                        [s for k in os.environ[settings.api_keys_env].split(",") if (s := k.strip())]))
    for where, found in sources:
        if not found:
            raise SettingsError(f"{where} holds no API key; put at least one there or drop the setting")
        keys += found
    return settings.model_copy(update={"api_keys": keys}) if sources else settings


def load_settings(path: str | Path) -> RouterSettings:
    """Read and validate a settings JSON file, API keys from their file or variable added; raise SettingsError
    naming the file and the bad fields."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise SettingsError(f"cannot read router settings {path}: {exc.strerror}") from exc
    except json.JSONDecodeError as exc:
        raise SettingsError(f"router settings {path} is not valid JSON: {exc}") from exc
    try:
        settings = RouterSettings.model_validate(raw)
    except ValidationError as exc:
        raise SettingsError(f"router settings {path} are invalid:\n{_describe(exc)}") from exc
    return with_api_keys(settings)
