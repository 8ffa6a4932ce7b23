"""The broker's one frozen settings object.

Precedence, highest first: explicit arguments (the CLI's options) >
environment (``SANDLOT_*``) > the config file (``--config``, TOML) > the
shipped ``default_config.toml``. Nothing else in the broker reads the
environment.

Environment variables: ``SANDLOT_HOST``, ``SANDLOT_PORT``,
``SANDLOT_DATA_DIR``, ``SANDLOT_STORE`` (a SQLAlchemy URL),
``SANDLOT_PUBLIC_URL`` (how clients reach this server, when it is not
``http://HOST:PORT``), ``SANDLOT_PROVIDER_MODE`` (``isolated``|``unisolated``),
``SANDLOT_LOG_FORMAT`` (``text``|``json``), ``SANDLOT_CONFIG`` (a config file),
``SANDLOT_FAILPOINTS`` (crash points for recovery tests), ``SANDLOT_DATAPLANE_PORT``,
``SANDLOT_DATAPLANE_URL`` (this host's dataplane, for a replica behind a load balancer),
``SANDLOT_SANDBOX_HOSTS`` (``embedded``|``registered``), ``SANDLOT_HOST_CAPACITY``.

Config file keys (see ``default_config.toml`` for every one with its default):
``[policy]`` TTLs and capability policy per actor type, ``[quotas]``,
``[promotion]``, ``[hosts]``, ``[provider]`` (one provider) or ``[providers.NAME]``
tables with ``default_provider`` (several: a ``kind`` key names each one's provider,
default NAME), ``[templates.NAME]``, ``[pools.NAME]``,
``admins = ["user", …]`` (users allowed to read the audit log and manage
templates, pools and everyone's sandboxes).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from sandlot.protocol.common import ActorType, Capability
from sandlot.protocol.sessions import Pool, Template
from sandlot.protocol.templates import MAX_SECONDS


class ConfigError(ValueError):
    """The configuration is invalid; the message says which key and why."""


#: The most sandboxes a sandbox host may say it runs (``[hosts] capacity``, ``--capacity``).
MAX_HOST_CAPACITY = 1_000_000

#: ``[policy]`` and ``[quotas]`` keys: whole numbers or not, and their range. A delay
#: is at most :data:`MAX_SECONDS` (the store keeps some in 32-bit columns).
NUMBERS: dict[str, tuple[str, bool, float, float]] = {
    "token_ttl_seconds": ("policy", True, 1, MAX_SECONDS),
    "lease_ttl_seconds": ("policy", True, 1, MAX_SECONDS),
    "idle_timeout_seconds": ("policy", True, 1, MAX_SECONDS),
    "hard_ttl_seconds": ("policy", True, 1, MAX_SECONDS),
    "provision_timeout_seconds": ("policy", True, 1, MAX_SECONDS),
    "reaper_interval_seconds": ("policy", False, 0.01, 3600),
    "max_live_sandboxes_per_user": ("quotas", True, 1, 10**9),
    "negotiation_rate_per_second": ("quotas", False, 1e-6, 1e9),
    "negotiation_burst": ("quotas", True, 1, 10**9),
    "max_volumes_per_user": ("quotas", True, 1, 10**9),
}


def _entries(raw: Mapping[str, Any], table: str, model: type[Template] | type[Pool]) -> Any:
    """``[table.NAME]`` entries as models; a wrong one is said as ``table.NAME.key: why``."""
    entries = raw.get(table, {})
    if not isinstance(entries, dict):
        raise ConfigError(f"{table} must be a table of tables")
    out = {}
    for name, spec in entries.items():
        if not isinstance(spec, dict):
            raise ConfigError(f"{table}.{name} must be a table")
        try:
            out[name] = model.model_validate({**spec, "name": name})
        except ValidationError as exc:
            parts = []
            for err in exc.errors()[:5]:
                where = "".join(f".{p}" for p in err["loc"])
                parts.append(f"{table}.{name}{where}: {err['msg']}")
            raise ConfigError("; ".join(parts)) from exc
    return out


def _checked_number(key: str, value: Any) -> int | float:
    table, integer, low, high = NUMBERS[key]
    kind = "a whole number" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        raise ConfigError(f"{table}.{key} must be {kind}, not {value!r}")
    if not low <= value <= high:
        raise ConfigError(f"{table}.{key} must be from {low!r} to {high!r}, not {value!r}")
    return value


@dataclass(frozen=True)
class CapabilityPolicy:
    default: frozenset[Capability]
    allowed: frozenset[Capability]


#: ``[hosts] mode``: where a broker's new sandboxes run (docs/SCALE.md).
SANDBOX_HOST_MODES = ("embedded", "registered", "mixed")


@dataclass(frozen=True)
class BrokerSettings:
    host: str = "127.0.0.1"
    port: int = 8765
    data_dir: Path = Path(".sandlot")
    store_url: str | None = None
    public_url: str | None = None
    workers: int = 1
    #: With several workers, where the sandbox host serves the dataplane (None: port + 1).
    dataplane_port: int | None = None
    #: Where this host's dataplane answers, when not at ``public_url``: a replica behind a
    #: load balancer shares the balancer's ``public_url`` (the tokens' issuer) and gives
    #: its own address here, since only this host runs its sandboxes.
    dataplane_url: str | None = None
    log_format: str = "text"
    token_ttl_seconds: int = 900
    lease_ttl_seconds: int = 300
    idle_timeout_seconds: int = 900
    hard_ttl_seconds: int = 28800
    provision_timeout_seconds: int = 60
    reaper_interval_seconds: float = 5.0
    idempotency_ttl_seconds: int = 86400
    capabilities: Mapping[ActorType, CapabilityPolicy] = field(default_factory=dict)
    max_live_sandboxes_per_user: int = 20
    negotiation_rate_per_second: float = 100.0
    negotiation_burst: int = 200
    max_volumes_per_user: int = 100
    promote_thread_to_assistant: bool = False
    provider_name: str = "local"
    provider_mode: str = "isolated"
    provider_config: Mapping[str, Any] = field(default_factory=dict)
    #: Every configured provider: configured name → its table (``name`` = its kind, as in
    #: the ``sandlot.providers`` entry points). One ``[provider]`` table: just that one.
    providers: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    #: The provider of sandboxes whose template pins none and whose request prefers none.
    default_provider: str = "local"
    templates: Mapping[str, Template] = field(default_factory=dict)
    pools: Mapping[str, Pool] = field(default_factory=dict)
    admins: frozenset[str] = frozenset()
    default_template: str = "default"
    #: ``embedded``: new sandboxes run in this process's provider; ``registered``: on the
    #: sandbox hosts registered in the store (:mod:`sandlot.broker.fleet`); ``mixed``: both,
    #: each new one on the registered host with the most free slots, this one included.
    sandbox_hosts: str = "embedded"
    #: Where other replicas reach this process's provider API (a server store only; None:
    #: its listening address). ``SANDLOT_HOST_PROVIDER_URL``, ``[hosts] provider_url``.
    host_provider_url: str | None = None
    host_heartbeat_seconds: float = 2.0
    host_lost_after_seconds: float = 20.0
    host_capacity: int = 100
    #: Crash points armed for recovery tests (``SANDLOT_FAILPOINTS``; see ``failpoints.py``).
    failpoints: frozenset[str] = frozenset()

    @property
    def base_url(self) -> str:
        if self.public_url:
            return self.public_url.rstrip("/")
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    @property
    def issuer(self) -> str:
        return self.base_url

    @property
    def resolved_store_url(self) -> str:
        return self.store_url or f"sqlite:///{(self.data_dir / 'sandlot.db').absolute()}"

    def policy_for(self, actor: ActorType) -> CapabilityPolicy:
        return self.capabilities[actor]


def _shipped_config() -> dict[str, Any]:
    text = resources.files("sandlot.broker").joinpath("default_config.toml").read_text()
    return tomllib.loads(text)


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _caps(values: Any, where: str) -> frozenset[Capability]:
    try:
        return frozenset(Capability(v) for v in values)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _providers(
    raw: Mapping[str, Any], values: Mapping[str, Any]
) -> tuple[dict[str, dict[str, Any]], str]:
    """``[providers.NAME]`` tables (``kind`` names the provider, default NAME) and
    ``default_provider``; without them the one ``[provider]`` table."""
    tables = raw.get("providers", {})
    if not tables:
        name = str(values["provider_name"])
        return {name: {"kind": name, **values["provider_config"]}}, name
    if not isinstance(tables, Mapping):
        raise ConfigError("providers must be a table of provider tables")
    out: dict[str, dict[str, Any]] = {}
    for name, table in tables.items():
        if not isinstance(table, Mapping):
            raise ConfigError(f"providers.{name} must be a table")
        entry = dict(table)
        entry["kind"] = str(entry.pop("kind", name))
        out[str(name)] = entry
    default = str(raw.get("default_provider", next(iter(out))))
    if default not in out:
        raise ConfigError(f"default_provider {default!r} is not one of the configured providers")
    return out, default


def load_settings(
    *,
    config_file: Path | None = None,
    environ: Mapping[str, str] | None = None,
    hosted_url_var: str | None = None,
    hosted_url: str | None = None,
    **overrides: Any,
) -> BrokerSettings:
    """Build the settings: ``overrides`` (non-None values) > env > file > shipped defaults.

    Hosted by another server (a LangGraph server), the public URL is by default that
    server's: the variable ``hosted_url_var`` names, else ``hosted_url``.
    """
    env = os.environ if environ is None else environ
    raw = _shipped_config()
    file_path = config_file or (Path(env["SANDLOT_CONFIG"]) if env.get("SANDLOT_CONFIG") else None)
    if file_path is not None:
        try:
            raw = _merge(raw, tomllib.loads(Path(file_path).read_text()))
        except OSError as exc:
            raise ConfigError(f"cannot read config file {file_path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {file_path} is not valid TOML: {exc}") from exc

    values: dict[str, Any] = {}
    policy = raw.get("policy", {})
    for key in (
        "token_ttl_seconds",
        "lease_ttl_seconds",
        "idle_timeout_seconds",
        "hard_ttl_seconds",
        "provision_timeout_seconds",
        "reaper_interval_seconds",
    ):
        if key in policy:
            values[key] = _checked_number(key, policy[key])
    caps: dict[ActorType, CapabilityPolicy] = {}
    for actor in ActorType:
        entry = policy.get("capabilities", {}).get(actor.value, {})
        allowed = _caps(entry.get("allowed", []), f"policy.capabilities.{actor}.allowed")
        default = _caps(entry.get("default", []), f"policy.capabilities.{actor}.default")
        if not default <= allowed:
            raise ConfigError(f"policy.capabilities.{actor}: default must be within allowed")
        caps[actor] = CapabilityPolicy(default=default, allowed=allowed)
    values["capabilities"] = caps
    quotas = raw.get("quotas", {})
    for key in (
        "max_live_sandboxes_per_user",
        "negotiation_rate_per_second",
        "negotiation_burst",
        "max_volumes_per_user",
    ):
        if key in quotas:
            values[key] = _checked_number(key, quotas[key])
    values["promote_thread_to_assistant"] = bool(
        raw.get("promotion", {}).get("thread_to_assistant", False)
    )
    provider = dict(raw.get("provider", {}))
    values["provider_name"] = provider.pop("name", "local")
    values["provider_mode"] = provider.pop("mode", "isolated")
    values["provider_config"] = provider
    hosts = raw.get("hosts", {})
    for key, name in (
        ("mode", "sandbox_hosts"),
        ("heartbeat_seconds", "host_heartbeat_seconds"),
        ("lost_after_seconds", "host_lost_after_seconds"),
        ("capacity", "host_capacity"),
        ("provider_url", "host_provider_url"),
    ):
        if key in hosts:
            values[name] = hosts[key]
    values["providers"], values["default_provider"] = _providers(raw, values)
    values["admins"] = frozenset(raw.get("admins", []))
    values["default_template"] = raw.get("default_template", "default")
    values["templates"] = _entries(raw, "templates", Template)
    values["pools"] = _entries(raw, "pools", Pool)
    for key in (
        "host",
        "port",
        "data_dir",
        "store_url",
        "public_url",
        "log_format",
        "workers",
        "dataplane_port",
        "dataplane_url",
    ):
        if key in raw.get("server", {}):
            values[key] = raw["server"][key]

    env_map = {
        "SANDLOT_HOST": "host",
        "SANDLOT_PORT": "port",
        "SANDLOT_DATA_DIR": "data_dir",
        "SANDLOT_STORE": "store_url",
        "SANDLOT_PUBLIC_URL": "public_url",
        "SANDLOT_PROVIDER_MODE": "provider_mode",
        "SANDLOT_LOG_FORMAT": "log_format",
        "SANDLOT_DATAPLANE_PORT": "dataplane_port",
        "SANDLOT_DATAPLANE_URL": "dataplane_url",
        "SANDLOT_SANDBOX_HOSTS": "sandbox_hosts",
        "SANDLOT_HOST_CAPACITY": "host_capacity",
        "SANDLOT_HOST_PROVIDER_URL": "host_provider_url",
    }
    for var, key in env_map.items():
        if env.get(var):
            values[key] = env[var]
    if "public_url" not in values and (hosted_url_var or hosted_url):
        values["public_url"] = (env.get(hosted_url_var) if hosted_url_var else None) or hosted_url
    if env.get("SANDLOT_FAILPOINTS"):
        values["failpoints"] = frozenset(p.strip() for p in env["SANDLOT_FAILPOINTS"].split(","))
    values.update({k: v for k, v in overrides.items() if v is not None})

    try:
        values["port"] = int(values.get("port", 8765))
        values["workers"] = int(values.get("workers", 1))
        if values.get("dataplane_port") is not None:
            values["dataplane_port"] = int(values["dataplane_port"])
    except ValueError as exc:
        raise ConfigError(f"port and workers must be integers: {exc}") from exc
    try:
        values["host_capacity"] = int(values.get("host_capacity", 100))
        values["host_heartbeat_seconds"] = float(values.get("host_heartbeat_seconds", 2.0))
        values["host_lost_after_seconds"] = float(values.get("host_lost_after_seconds", 20.0))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"hosts.capacity and the hosts' delays must be numbers: {exc}") from exc
    if values.get("sandbox_hosts", "embedded") not in SANDBOX_HOST_MODES:
        raise ConfigError("hosts.mode must be 'embedded', 'registered' or 'mixed'")
    if not 1 <= values["host_capacity"] <= MAX_HOST_CAPACITY:
        raise ConfigError(f"hosts.capacity must be from 1 to {MAX_HOST_CAPACITY}")
    if not 0 < values["host_heartbeat_seconds"] < values["host_lost_after_seconds"]:
        raise ConfigError("hosts.heartbeat_seconds must be positive and under lost_after_seconds")
    values["data_dir"] = Path(values.get("data_dir", ".sandlot")).expanduser()
    if values["provider_mode"] not in ("isolated", "unisolated"):
        raise ConfigError("provider.mode must be 'isolated' or 'unisolated'")
    if values.setdefault("log_format", "text") not in ("text", "json"):
        raise ConfigError("log format must be 'text' or 'json'")
    if values["workers"] < 1:
        raise ConfigError("workers must be at least 1")
    settings = BrokerSettings(**values)
    for tpl in settings.templates.values():
        if tpl.provider is not None and tpl.provider not in settings.providers:
            raise ConfigError(f"template {tpl.name!r} pins unknown provider {tpl.provider!r}")
    if settings.default_template not in settings.templates:
        raise ConfigError(f"the default template {settings.default_template!r} is not declared")
    for pool in settings.pools.values():
        if pool.template not in settings.templates:
            raise ConfigError(f"pool {pool.name!r} names unknown template {pool.template!r}")
    return settings
