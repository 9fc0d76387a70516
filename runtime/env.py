"""The environment contract between a launcher and the training processes.

``tmd launch`` and torchrun set these variables. Under ``srun`` without them,
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are read from
``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID`` and ``SLURM_NTASKS_PER_NODE``.

=====================  =========================================================
``TMD_ROLE``           ``worker`` (default) or ``standby``
``TMD_JOB``            job name, one MQTT topic segment (default ``job``)
``TMD_NODE``           this process's machine: every rank on one machine shares
                       it, and it is the name the machine's agent publishes under
                       (default: the host name, ``tmd.wire.default_node_name``)
``RANK``               data-parallel rank of a worker (ignored for a standby)
``LOCAL_RANK``         this process's index on its machine, its GPU (default 0);
                       (node, local rank) is unique in the job. A standby machine's
                       slot of local rank i takes the leaver's rank of local rank i
``LOCAL_WORLD_SIZE``   processes on this machine (default ``LOCAL_RANK + 1``); a
                       standby machine of K slots replaces a machine of K ranks
``WORLD_SIZE``         number of workers; never changes across migrations
``MASTER_ADDR``        host of the job's TCPStore server
``MASTER_PORT``        its port
``TMD_STORE``          ``host:port`` of the store, overrides MASTER_ADDR/PORT; point it
                       at a store that outlives every worker (the launcher hosts one)
``TMD_HOST``           address peers reach this process on (gloo device); default
                       ``127.0.0.1`` when the store is on loopback, else the hostname
``TMD_BROKER``         ``host:port`` of the MQTT broker; unset (and no
                       ``TMD_MQTT_CONFIG``): control through the store only
                       (``JobController``) and telemetry is not sent
``TMD_MQTT_CONFIG``    a TOML file whose ``[mqtt]`` table is read as the daemon and
                       the agent read theirs (``tmd.config.MqttConfig``: username,
                       ``password_file``, ``tls``, ``ca_file``, ``cert_file``,
                       ``key_file``, ``client_id``, ...); ``TMD_MQTT__<KEY>``
                       overrides one key (``TMD_MQTT__PASSWORD_FILE=...``), and
                       ``TMD_BROKER`` the host and port
``TMD_AGENT_SOCKET``   the Unix socket of this machine's agent, which publishes
                       the telemetry of every rank on the machine in one message
                       (``tmd.runtime.relay``); default ``/run/tmd/agent.sock``
                       where it exists; empty: publish directly
``TMD_BACKEND``        ``gloo`` (default) or ``nccl``
``TMD_RESTART_COUNT``  how many times the launcher restarted the job before this
                       start (``tmd launch --max-restarts``); read from
                       ``TORCHELASTIC_RESTART_COUNT`` when unset; default 0
=====================  =========================================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

import msgspec

from tmd import wire
from tmd.config import MqttConfig, mqtt_options
from tmd.errors import ConfigError
from tmd.runtime.group import StoreAddress
from tmd.runtime.relay import agent_socket

Role = Literal["worker", "standby"]


@dataclass(frozen=True)
class RuntimeEnv:
    role: Role
    job: str
    node: str
    rank: int  # a standby's is a placeholder until it joins
    world_size: int
    store: StoreAddress
    host: str
    backend: str
    mqtt: MqttConfig | None = None
    """How to reach the broker; None: no broker (control through the store)."""
    restart_count: int = 0
    local_rank: int = 0
    local_world_size: int = 1
    agent_socket: str | None = None
    """The machine's agent's relay socket (``tmd.runtime.relay``); None: publish directly."""

    @property
    def broker(self) -> str | None:
        """``host:port`` of the broker, or None."""
        return None if self.mqtt is None else f"{self.mqtt.host}:{self.mqtt.port}"

    @property
    def slot(self) -> str:
        """This process's name in the job: its machine and local rank."""
        return slot_name(self.node, self.local_rank)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RuntimeEnv:
        env = os.environ if environ is None else environ
        role = env.get("TMD_ROLE", "worker")
        if role not in ("worker", "standby"):
            raise ConfigError("TMD_ROLE", f"must be worker or standby, got {role!r}")
        env = _with_slurm(env)
        try:
            world_size = int(env["WORLD_SIZE"])
            rank = int(env.get("RANK", "0"))
        except (KeyError, ValueError) as exc:
            raise ConfigError("WORLD_SIZE", f"missing or not an integer: {exc}") from None
        if role == "worker" and not 0 <= rank < world_size:
            raise ConfigError("RANK", f"{rank} is outside 0..{world_size - 1}")
        if "TMD_STORE" in env:
            store = StoreAddress.parse(env["TMD_STORE"])
        else:
            try:
                store = StoreAddress(env["MASTER_ADDR"], int(env["MASTER_PORT"]))
            except (KeyError, ValueError):
                raise ConfigError(
                    "MASTER_ADDR", "set MASTER_ADDR/MASTER_PORT or TMD_STORE"
                ) from None
        node = env.get("TMD_NODE") or wire.default_node_name()
        try:
            msgspec.convert(node, wire.Name)
        except msgspec.ValidationError:
            raise ConfigError(
                "TMD_NODE", f"{node!r} is not a machine name (letters, digits, _.:@-)"
            ) from None
        local_rank = _count(env, "LOCAL_RANK", 0)
        local_world_size = _count(env, "LOCAL_WORLD_SIZE", local_rank + 1)
        if not 0 <= local_rank < local_world_size <= wire.MAX_GPUS_PER_NODE:
            raise ConfigError(
                "LOCAL_RANK",
                f"{local_rank} is outside 0..{local_world_size - 1} (LOCAL_WORLD_SIZE "
                f"{local_world_size}, at most {wire.MAX_GPUS_PER_NODE})",
            )
        restarts = env.get("TMD_RESTART_COUNT", env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if not restarts.isdigit():
            raise ConfigError("TMD_RESTART_COUNT", f"must be a count, got {restarts!r}")
        loopback = store.host in ("127.0.0.1", "localhost", "::1")
        host = env.get("TMD_HOST", "127.0.0.1" if loopback else "")
        return cls(
            role=role,  # type: ignore[arg-type]  # checked above
            job=env.get("TMD_JOB", "job"),
            node=node,
            rank=rank if role == "worker" else 0,
            world_size=world_size,
            store=store,
            host=host,
            backend=env.get("TMD_BACKEND", "gloo"),
            mqtt=_mqtt(env),
            restart_count=int(restarts),
            local_rank=local_rank,
            local_world_size=local_world_size,
            agent_socket=agent_socket(env),
        )


SLURM: Final = {
    "RANK": "SLURM_PROCID",
    "WORLD_SIZE": "SLURM_NTASKS",
    "LOCAL_RANK": "SLURM_LOCALID",
    "LOCAL_WORLD_SIZE": "SLURM_NTASKS_PER_NODE",
}
"""What ``srun`` sets for each variable torchrun sets; the torchrun name wins."""


def _with_slurm(env: Mapping[str, str]) -> Mapping[str, str]:
    missing = {
        ours: env[theirs]
        for ours, theirs in SLURM.items()
        if ours not in env and env.get(theirs, "").isdigit()
    }
    return {**env, **missing} if missing else env


def _mqtt(env: Mapping[str, str]) -> MqttConfig | None:
    """The broker and the credentials to reach it with, or None for no broker."""
    broker = env.get("TMD_BROKER", "")
    path = env.get("TMD_MQTT_CONFIG", "")
    if not broker and not path:
        return None
    overrides = dict(env)
    if broker:
        host, _, port = broker.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError("TMD_BROKER", f"must be host:port, got {broker!r}")
        overrides["TMD_MQTT__HOST"], overrides["TMD_MQTT__PORT"] = host.strip("[]"), port
    return mqtt_options(path or None, env=overrides)


def slot_name(node: str, local_rank: int) -> str:
    """A process's name in the job: ``node/local_rank``."""
    return f"{node}/{local_rank}"


def _count(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key, "")
    if not value:
        return default
    if not value.isdigit():
        raise ConfigError(key, f"must be a count, got {value!r}")
    return int(value)
