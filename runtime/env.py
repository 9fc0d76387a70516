"""The environment contract between a launcher and the training processes.

``tmd launch`` sets these variables; on a cluster, set them from torchrun or srun.

=====================  =========================================================
``TMD_ROLE``           ``worker`` (default) or ``standby``
``TMD_JOB``            job name, one MQTT topic segment (default ``job``)
``TMD_NODE``           this process's node name; must be unique in the job
                       (default ``{hostname}-r{RANK}``, standbys must set it)
``RANK``               data-parallel rank of a worker (ignored for a standby)
``WORLD_SIZE``         number of workers; never changes across migrations
``MASTER_ADDR``        host of the job's TCPStore server
``MASTER_PORT``        its port
``TMD_STORE``          ``host:port`` of the store, overrides MASTER_ADDR/PORT; point it
                       at a store that outlives every worker (the launcher hosts one)
``TMD_HOST``           address peers reach this process on (gloo device); default
                       ``127.0.0.1`` when the store is on loopback, else the hostname
``TMD_BROKER``         ``host:port`` of the MQTT broker; unset: control through the
                       store only (``JobController``) and telemetry is not sent
``TMD_BACKEND``        ``gloo`` (default) or ``nccl``
``TMD_RESTART_COUNT``  how many times the launcher restarted the job before this
                       start (``tmd launch --max-restarts``); read from
                       ``TORCHELASTIC_RESTART_COUNT`` when unset; default 0
=====================  =========================================================
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from tmd.errors import ConfigError
from tmd.runtime.group import StoreAddress

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
    broker: str | None = None
    restart_count: int = 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> RuntimeEnv:
        env = os.environ if environ is None else environ
        role = env.get("TMD_ROLE", "worker")
        if role not in ("worker", "standby"):
            raise ConfigError("TMD_ROLE", f"must be worker or standby, got {role!r}")
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
        node = env.get("TMD_NODE")
        if node is None:
            if role == "standby":
                raise ConfigError("TMD_NODE", "a standby must be given its node name")
            node = f"{socket.gethostname()}-r{rank}"
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
            broker=env.get("TMD_BROKER") or None,
            restart_count=int(restarts),
        )
