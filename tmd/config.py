"""Configuration: one TOML file, a default for every key, ``TMD_*`` overrides.

This is the only module that reads configuration files. Every section is a small
frozen dataclass; ``load`` checks every key's type and range and raises
``ConfigError`` naming the dotted key, so a bad config stops the daemon at start.

Environment overrides use a double underscore between levels, the value parsed as
the key's type: ``TMD_MQTT__PORT=8883``, ``TMD_API__TOKEN_FILE=/run/secrets/tmd``,
``TMD_DETECTORS__STRAGGLER__MIN_SLOWDOWN=0.1``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import ssl
import tomllib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from tmd.errors import ConfigError

ENV_PREFIX = "TMD_"
T = typing.TypeVar("T")

SECRETS = (("mqtt", "password"), ("api", "token"))
"""Keys whose values are secrets: never echoed, masked by ``as_dict``."""

CREDENTIALS: tuple[tuple[str, str, str, str], ...] = (
    ("mqtt", "password_file", "password", "mqtt-password"),
    ("api", "token_file", "token", "api-token"),
    ("mqtt", "cert_file", "", "mqtt-cert"),
    ("mqtt", "key_file", "", "mqtt-key"),
)
"""(section, file key, value key, credential name): under systemd, a key left unset
defaults to the credential of that name in ``$CREDENTIALS_DIRECTORY``
(``LoadCredential=mqtt-password:/etc/tmd/credentials/mqtt-password``), readable by
the service's own (dynamic) user only."""


@dataclass(frozen=True, kw_only=True)
class MqttConfig:
    host: str = "127.0.0.1"
    port: int = 1883
    # 3.1.1 by default: paho parses MQTT 5 properties on every message, which more
    # than doubles the daemon's CPU per message. Shared subscriptions ($share) work
    # with 3.1.1 clients on Mosquitto and EMQX.
    protocol: Literal["3.1.1", "5"] = "3.1.1"
    client_id: str = ""  # empty: "tmd-<hostname>-<pid>"
    username: str = ""
    password: str = ""
    password_file: str = ""
    tls: bool = False
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    tls_insecure: bool = False
    keepalive_s: float = 30.0
    # MQTT 5 shared subscription group: several head nodes split the jobs between them.
    shared_group: str = ""
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    connect_timeout_s: float = 10.0

    def validate(self) -> None:
        _check(1 <= self.port <= 65535, "mqtt.port", "must be in 1..65535")
        _check(self.keepalive_s >= 5, "mqtt.keepalive_s", "must be >= 5")
        _check(self.reconnect_min_s > 0, "mqtt.reconnect_min_s", "must be > 0")
        _check(
            self.reconnect_max_s >= self.reconnect_min_s,
            "mqtt.reconnect_max_s",
            "must be >= mqtt.reconnect_min_s",
        )
        _check(self.connect_timeout_s > 0, "mqtt.connect_timeout_s", "must be > 0")
        if self.shared_group:
            _check(
                all(c not in self.shared_group for c in "/+#"),
                "mqtt.shared_group",
                "must not contain / + #",
            )
        if self.password and self.password_file:
            raise ConfigError("mqtt.password_file", "set either mqtt.password or this, not both")
        for key in ("password_file", "ca_file", "cert_file", "key_file"):
            _check_file(f"mqtt.{key}", getattr(self, key))
        for key in ("ca_file", "tls_insecure"):
            if getattr(self, key) and not self.tls:
                raise ConfigError(f"mqtt.{key}", "needs mqtt.tls = true (else it is ignored)")
        if self.cert_file or self.key_file:
            _check(self.tls, "mqtt.cert_file", "client certificates need mqtt.tls = true")
            _check(bool(self.cert_file and self.key_file), "mqtt.key_file", "set both cert and key")

    def read_password(self) -> str:
        """The password: ``password``, or the contents of ``password_file``."""
        if not self.password_file:
            return self.password
        try:
            with open(self.password_file) as f:
                return f.read().strip()
        except OSError as exc:
            raise ConfigError("mqtt.password_file", f"cannot read: {exc.strerror}") from None

    def tls_context(self) -> ssl.SSLContext | None:
        """The client's TLS context (None without ``tls``); every file is read here,
        so a bad one is a ConfigError at start rather than a failed connection later."""
        if not self.tls:
            return None
        try:
            context = ssl.create_default_context(cafile=self.ca_file or None)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError("mqtt.ca_file", f"cannot load CA certificates: {exc}") from None
        if self.cert_file:
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, OSError) as exc:
                raise ConfigError(
                    "mqtt.cert_file", f"cannot load certificate and key: {exc}"
                ) from None
        if self.tls_insecure:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


@dataclass(frozen=True, kw_only=True)
class IngestConfig:
    max_payload_bytes: int = 256 * 1024
    # A job's retained status lists every member: ~20 bytes a rank, 333 KB at 16k ranks.
    max_status_bytes: int = 32 << 20
    window_steps: int = 128  # per-rank ring of recent steps the detectors read
    # About 5 KB a rank at the default window: the caps bound the view's memory.
    max_ranks_per_job: int = 1 << 17  # bound for ranks of jobs whose status is not yet known
    # Over all jobs: each holds its reporting ranks or its status's members, whichever
    # are more, plus the standby and excluded machines its status lists.
    max_ranks: int = 1 << 17
    max_jobs: int = 1024
    max_nodes: int = 65536
    forget_after_s: float = 3600.0  # drop nodes and jobs silent this long
    reject_log_interval_s: float = 60.0  # one log line per (topic kind, reason) per interval
    # The daemon's own lag (tmd.daemon.freshness): a probe through the broker this often;
    # the view is stale past this lag, and trusted again this long after it is current.
    probe_interval_s: float = 1.0
    stale_lag_s: float = 5.0
    stale_settle_s: float = 5.0
    # Processes that apply the ranks' steps, each owning whole jobs (tmd.daemon.shards);
    # 0: the daemon's own process does.
    shards: int = 0

    def validate(self) -> None:
        _check(
            1024 <= self.max_payload_bytes <= 64 << 20,
            "ingest.max_payload_bytes",
            "must be in 1 KiB..64 MiB",
        )
        _check(
            self.max_status_bytes >= self.max_payload_bytes,
            "ingest.max_status_bytes",
            "must be >= ingest.max_payload_bytes",
        )
        _check(8 <= self.window_steps <= 65536, "ingest.window_steps", "must be in 8..65536")
        _check(self.max_ranks_per_job >= 1, "ingest.max_ranks_per_job", "must be >= 1")
        _check(self.max_ranks >= 1, "ingest.max_ranks", "must be >= 1")
        _check(self.max_jobs >= 1, "ingest.max_jobs", "must be >= 1")
        _check(self.max_nodes >= 1, "ingest.max_nodes", "must be >= 1")
        _check(self.forget_after_s > 0, "ingest.forget_after_s", "must be > 0")
        _check(self.reject_log_interval_s >= 0, "ingest.reject_log_interval_s", "must be >= 0")
        _check(0 < self.probe_interval_s <= 60, "ingest.probe_interval_s", "must be in (0, 60]")
        _check(self.stale_lag_s > 0, "ingest.stale_lag_s", "must be > 0")
        _check(self.stale_settle_s >= 0, "ingest.stale_settle_s", "must be >= 0")
        _check(0 <= self.shards <= 64, "ingest.shards", "must be in 0..64")


@dataclass(frozen=True, kw_only=True)
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 9464
    token: str = ""
    token_file: str = ""

    def validate(self) -> None:
        _check(0 <= self.port <= 65535, "api.port", "must be in 0..65535 (0: any free port)")
        if self.token and self.token_file:
            raise ConfigError("api.token_file", "set either api.token or this, not both")
        _check_file("api.token_file", self.token_file)


@dataclass(frozen=True, kw_only=True)
class JournalConfig:
    # Empty: $STATE_DIRECTORY/journal.sqlite3 under systemd, else ./tmd-state/.
    path: str = ""
    retention_days: float = 30.0

    def resolved_path(self) -> Path:
        if self.path:
            return Path(self.path)
        state = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
        return Path(state or "tmd-state") / "journal.sqlite3"

    def validate(self) -> None:
        _check(self.retention_days > 0, "journal.retention_days", "must be > 0")


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"

    def validate(self) -> None:
        pass


_NODE_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,128}")


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """``tmd agent``, the NVML publisher on every worker and standby node."""

    node: str = ""  # empty: this host's name
    role: Literal["worker", "standby"] = "worker"
    interval_s: float = 1.0  # one NVML sample of every GPU, published; also the heartbeat
    # One round of NVML calls over every GPU; a GPU falling off the bus can hang NVML,
    # and a round that overruns is abandoned (and the systemd watchdog not fed).
    sample_timeout_s: float = 5.0
    init_timeout_s: float = 60.0  # nvmlInit: slow without nvidia-persistenced
    # One nvmlEventSetWait_v2 call: bounds how long stopping waits for the XID thread.
    xid_wait_ms: int = 1000
    # No GPU or driver on this node: publish status and heartbeats only, without NVML.
    heartbeat_only: bool = False
    # The Unix socket this machine's ranks hand their step timings to: the agent
    # publishes them with its sample, one message per machine each interval
    # (``tmd.agent.relay``; the ranks look for ``/run/tmd/agent.sock``, which
    # systemd/tmd-agent.service sets). Empty: no relay; the ranks publish directly.
    relay_socket: str = ""
    # Send the tick's GPU sample inside the relayed message rather than on its own
    # ``gpu`` topic: one message per machine per tick. Only once every daemon and the
    # broker's ACL know ``tmd/v1/node/{node}/iter``: the sample is the heartbeat.
    relay_sample: bool = False
    # A sample in full at least this often, and whenever a GPU's counters or flags
    # change; in between a brief one: each GPU's clock event reasons only, the rest
    # as in the last full one (``wire.BriefSamples``). 0: every sample in full. Only
    # once every daemon knows briefs: an older one judges the GPUs on the full ones.
    full_sample_every_s: float = 10.0

    def validate(self) -> None:
        _check(
            0 <= self.full_sample_every_s <= 60,
            "agent.full_sample_every_s",
            "must be in 0..60 (0: every sample in full): a daemon that lost a full sample"
            " judges the GPUs again only from the next",
        )
        if self.node:
            _check(
                bool(_NODE_NAME.fullmatch(self.node)),
                "agent.node",
                "must be 1-128 of A-Z a-z 0-9 _ . : @ - (one MQTT topic segment)",
            )
        _check(0.05 <= self.interval_s <= 3600, "agent.interval_s", "must be in 0.05..3600")
        _check(self.sample_timeout_s > 0, "agent.sample_timeout_s", "must be > 0")
        _check(self.init_timeout_s > 0, "agent.init_timeout_s", "must be > 0")
        _check(10 <= self.xid_wait_ms <= 60_000, "agent.xid_wait_ms", "must be in 10..60000")
        _check(
            not self.relay_socket
            or (self.relay_socket.startswith("/") and len(self.relay_socket) < 100),
            "agent.relay_socket",
            "must be empty or an absolute path of under 100 characters (a Unix socket's limit)",
        )


@dataclass(frozen=True, kw_only=True)
class ActuatorConfig:
    """How the daemon drives migrations against the runtime (``tmd.daemon.actuator``)."""

    enabled: bool = True  # false: decisions are journaled, nothing is sent to jobs
    # From Prepare to every member's and the joiner's ``prepared``: the next group is
    # built in the background while the job trains, so this bounds a slow store/rendezvous.
    prepare_timeout_s: float = 180.0
    # From Switch to the stayers' and joiner's ``switched``.
    switch_timeout_s: float = 120.0
    abort_timeout_s: float = 60.0
    # While waiting, the current command is sent again this often (same migration id:
    # the runtime answers a repeated command with where it stands).
    resend_s: float = 10.0
    # After the first subscription, how long retained job statuses may take to arrive
    # before in-flight migrations from the journal are reconciled against them.
    settle_s: float = 2.0
    # Only replace a machine with a standby carrying the same GPU model (when both
    # agents reported one).
    same_gpu_type: bool = True

    def validate(self) -> None:
        for key in ("prepare_timeout_s", "switch_timeout_s", "abort_timeout_s", "resend_s"):
            _check(getattr(self, key) > 0, f"actuator.{key}", "must be > 0")
        _check(self.settle_s >= 0, "actuator.settle_s", "must be >= 0")


@dataclass(frozen=True, kw_only=True)
class GuardrailsConfig:
    """Limits the actuator puts on every decision (``tmd.daemon.actuator.guardrails``)."""

    dry_run: bool = False
    max_concurrent_per_job: int = 1
    min_standby_pool: int = 1
    node_cooldown_s: float = 1800.0
    max_per_hour: int = 12

    def validate(self) -> None:
        _check(
            self.max_concurrent_per_job >= 1, "guardrails.max_concurrent_per_job", "must be >= 1"
        )
        _check(self.min_standby_pool >= 0, "guardrails.min_standby_pool", "must be >= 0")
        _check(self.node_cooldown_s >= 0, "guardrails.node_cooldown_s", "must be >= 0")
        _check(self.max_per_hour >= 1, "guardrails.max_per_hour", "must be >= 1")


@dataclass(frozen=True, kw_only=True)
class Config:
    mqtt: MqttConfig = field(default_factory=MqttConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    journal: JournalConfig = field(default_factory=JournalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    actuator: ActuatorConfig = field(default_factory=ActuatorConfig)
    guardrails: GuardrailsConfig = field(default_factory=GuardrailsConfig)
    # Plug-in sections are checked by each plug-in's own Config when it is built.
    detectors: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    policies: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)


_SECTIONS: dict[str, type[Any]] = {
    "mqtt": MqttConfig,
    "ingest": IngestConfig,
    "api": ApiConfig,
    "journal": JournalConfig,
    "log": LogConfig,
    "agent": AgentConfig,
    "actuator": ActuatorConfig,
    "guardrails": GuardrailsConfig,
}
_PLUGIN_SECTIONS = ("detectors", "policies")


def load(path: str | Path | None = None, *, env: Mapping[str, str] | None = None) -> Config:
    """Read ``path`` (or nothing: all defaults), apply ``TMD_*`` overrides, validate."""
    return from_dict(_read(path, env))


def from_dict(raw: Mapping[str, Any]) -> Config:
    sections: dict[str, Any] = {}
    for name, value in raw.items():
        if name in _SECTIONS:
            sections[name] = build_section(_SECTIONS[name], value, name)
        elif name in _PLUGIN_SECTIONS:
            sections[name] = _plugin_tables(value, name)
        else:
            raise ConfigError(name, f"unknown section (known: {', '.join(_known_sections())})")
    config = Config(**sections)
    for name in _SECTIONS:
        getattr(config, name).validate()
    if config.mqtt.shared_group and config.actuator.enabled:
        # A shared subscription splits messages, not jobs: one migration's acks and
        # statuses would land on different heads, and none could drive it.
        raise ConfigError(
            "mqtt.shared_group",
            "splits one job's acks and statuses across head nodes, so no head could "
            "drive a migration: set actuator.enabled = false on heads that share a group",
        )
    return config


def build_section(cls: type[T], value: Any, where: str) -> T:
    """Build dataclass ``cls`` from a TOML table, checking every key's type. The
    error for a secret key names the key and never its value."""
    if not isinstance(value, Mapping):
        raise ConfigError(where, f"must be a table, got {type(value).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, item in value.items():
        if key not in fields:
            raise ConfigError(f"{where}.{key}", f"unknown key (known: {', '.join(sorted(fields))})")
        if (where, key) in SECRETS and not isinstance(item, str):
            raise ConfigError(f"{where}.{key}", f"must be a string, got a {type(item).__name__}")
        kwargs[key] = _coerce(item, hints[key], f"{where}.{key}")
    return cls(**kwargs)


def mqtt_options(
    path: str | Path | None = None, *, env: Mapping[str, str] | None = None
) -> MqttConfig:
    """The ``[mqtt]`` section alone, validated: how a client that is not the daemon
    (a training process, a tool) connects, from the same file format and the same
    ``TMD_MQTT__*`` overrides; the file's other sections are not read."""
    mqtt = build_section(MqttConfig, _read(path, env).get("mqtt", {}), "mqtt")
    mqtt.validate()
    return mqtt


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(key, f"must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    if origin in (types.UnionType, typing.Union):
        errors = []
        for arm in typing.get_args(hint):
            try:
                return _coerce(value, arm, key)
            except ConfigError as exc:
                errors.append(exc.why)
        raise ConfigError(key, " or ".join(errors))
    if hint is type(None):
        if value is not None:
            raise ConfigError(key, f"must be empty, got {value!r}")
        return None
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"must be an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(key, f"must be a number, got {value!r}")
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(key, f"must be finite, got {value!r}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"must be a string, got {value!r}")
        return value
    if origin in (list, tuple) or hint in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(key, f"must be a list, got {value!r}")
        (arm, *_) = typing.get_args(hint) or (Any,)
        items = [_coerce(v, arm, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if (origin or hint) is tuple else items
    if origin in (dict, Mapping) or hint is Any:
        return value
    raise ConfigError(key, f"unsupported type {hint!r}")  # a bug in a Config class


def _plugin_tables(value: Any, where: str) -> dict[str, dict[str, Any]]:
    if not isinstance(value, Mapping):
        raise ConfigError(where, f"must be a table of plug-in tables, got {type(value).__name__}")
    tables = {}
    for name, table in value.items():
        if not isinstance(table, Mapping):
            raise ConfigError(f"{where}.{name}", f"must be a table, got {type(table).__name__}")
        tables[name] = dict(table)
    return tables


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    for name, text in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        if any(not part for part in path):
            raise ConfigError(name, "empty level in environment override")
        table = raw
        for part in path[:-1]:
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise ConfigError(name, f"{part} is not a table")
        table[path[-1]] = _parse_env_value(text, _hint_for(path))


def _hint_for(path: list[str]) -> Any:
    if len(path) == 2 and path[0] in _SECTIONS:
        return typing.get_type_hints(_SECTIONS[path[0]]).get(path[1], str)
    return Any  # plug-in keys: parsed as TOML scalars, checked by the plug-in


def _parse_env_value(text: str, hint: Any) -> Any:
    if hint is str or typing.get_origin(hint) is Literal:
        return text
    try:
        return tomllib.loads(f"x = {text}")["x"]
    except tomllib.TOMLDecodeError:
        return text  # the type check names the key


def _known_sections() -> list[str]:
    return [*_SECTIONS, *_PLUGIN_SECTIONS]


def _check(ok: bool, key: str, why: str) -> None:
    if not ok:
        raise ConfigError(key, why)


def _check_file(key: str, path: str) -> None:
    if path and not (os.path.isfile(path) and os.access(path, os.R_OK)):
        raise ConfigError(key, f"cannot read file {path!r}")


def api_address(path: str | Path | None, *, env: Mapping[str, str] | None = None) -> ApiConfig:
    """Only the ``[api]`` section, unvalidated: what ``tmd status`` needs to find the
    daemon, without reading (or being allowed to read) the daemon's secret files."""
    return build_section(ApiConfig, _read(path, env).get("api", {}), "api")


def _read(path: str | Path | None, env: Mapping[str, str] | None) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(str(path), f"cannot read: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(str(path), f"not valid TOML: {exc}") from None
    env = os.environ if env is None else env
    _apply_env(raw, env)
    _apply_credentials(raw, env)
    return raw


def _apply_credentials(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    """Point every unset secret file key at its systemd credential, if one was passed
    (``CREDENTIALS`` lists them); a key set in the file or environment wins."""
    directory = env.get("CREDENTIALS_DIRECTORY")
    if not directory:
        return
    for section, key, value_key, name in CREDENTIALS:
        path = os.path.join(directory, name)
        table = raw.get(section, {})
        if not isinstance(table, dict) or not os.path.isfile(path):
            continue
        if table.get(key) or (value_key and table.get(value_key)):
            continue
        if key == "key_file" and table.get("cert_file") != os.path.join(directory, "mqtt-cert"):
            continue  # a key without its certificate would be a config error
        raw.setdefault(section, table)[key] = path


def as_dict(config: Config) -> dict[str, Any]:
    """The effective configuration, secrets masked (for ``tmd check-config``)."""
    out = dataclasses.asdict(config)
    for section, key in SECRETS:
        if out[section][key]:
            out[section][key] = "***"
    return out
