"""``tmd launch``: run a training script locally as N workers and K standbys.

Like torchrun for one machine, plus standbys: the launcher hosts the job's TCPStore
(so the store outlives any worker, the leaver included), starts every process with
the environment described in ``tmd.runtime.env``, and waits. A process that exits
0 after leaving the job is a success; the launcher does not tear the job down when
one rank dies, because the runtime replaces it with a standby.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta

import msgspec
from torch._C._distributed_c10d import TCPStore

from tmd import wire
from tmd.runtime.control import STATUS_KEY


@dataclass(frozen=True)
class ProcessSpec:
    role: str
    node: str
    rank: int


def process_env(
    spec: ProcessSpec,
    *,
    world_size: int,
    store_port: int,
    job: str,
    broker: str | None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(
        TMD_ROLE=spec.role,
        TMD_JOB=job,
        TMD_NODE=spec.node,
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
        TMD_STORE=f"127.0.0.1:{store_port}",
    )
    if broker:
        env["TMD_BROKER"] = broker
    else:
        env.pop("TMD_BROKER", None)
    return env


def plan(nproc: int, standby: int) -> list[ProcessSpec]:
    workers = [ProcessSpec("worker", f"worker{r}", r) for r in range(nproc)]
    return workers + [ProcessSpec("standby", f"standby{i}", 0) for i in range(standby)]


def host_store(port: int = 0) -> TCPStore:
    """The job's store server, in this process; port 0 picks a free one."""
    return TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )


class LocalJob:
    """The processes of one local job; also the harness the integration tests use."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        nproc: int,
        standby: int,
        job: str = "job",
        broker: str | None = None,
        store_port: int = 0,
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        self.store = host_store(store_port)
        self.specs = plan(nproc, standby)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for spec in self.specs:
            env = process_env(
                spec, world_size=nproc, store_port=self.store.port, job=job, broker=broker
            )
            env.update(extra_env or {})
            self.procs[spec.node] = subprocess.Popen(list(command), env=env)

    def wait(
        self, timeout: timedelta | None = None, *, grace: timedelta = timedelta(seconds=15)
    ) -> dict[str, int]:
        """Wait for every process. Standbys end by themselves once the job stops;
        whatever still runs ``grace`` after the job reported stopped is killed."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        stopped_at: float | None = None
        while any(proc.poll() is None for proc in self.procs.values()):
            now = time.monotonic()
            if stopped_at is None and self.job_stopped():
                stopped_at = now
            late = stopped_at is not None and now - stopped_at > grace.total_seconds()
            if late or (deadline is not None and now > deadline):
                self.terminate()
                break
            time.sleep(0.05)
        return {node: proc.wait() for node, proc in self.procs.items()}

    def status(self) -> wire.JobStatus | None:
        if not self.store.check([STATUS_KEY]):
            return None
        status: wire.JobStatus = msgspec.json.decode(
            self.store.get(STATUS_KEY), type=wire.JobStatus
        )
        return status

    def job_stopped(self) -> bool:
        status = self.status()
        return status is not None and status.state == "stopped"

    def kill(self, node: str, sig: int = signal.SIGKILL) -> None:
        self.procs[node].send_signal(sig)

    def terminate(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tmd launch", description=__doc__)
    parser.add_argument("--nproc", type=int, required=True, help="workers (the world size)")
    parser.add_argument("--standby", type=int, default=0, help="standby processes")
    parser.add_argument("--job", default="job", help="job name (MQTT topic segment)")
    parser.add_argument("--broker", default=None, help="MQTT broker host:port")
    parser.add_argument("--port", type=int, default=0, help="store port (0: any free one)")
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.nproc < 1 or ns.standby < 0:
        parser.error("--nproc must be >= 1 and --standby >= 0")
    job = LocalJob(
        [sys.executable, ns.script, *ns.args],
        nproc=ns.nproc, standby=ns.standby, job=ns.job, broker=ns.broker, store_port=ns.port,
    )  # fmt: skip
    try:
        codes = job.wait()
    except KeyboardInterrupt:
        job.terminate()
        return 130
    failed = {node: code for node, code in codes.items() if code != 0}
    for node, code in failed.items():
        print(f"tmd launch: {node} exited with {code}", file=sys.stderr)
    # A rank that died and was replaced by a standby did not fail the job: the job
    # succeeded if it stopped normally and every final member exited cleanly.
    status = job.status()
    if status is not None and status.state == "stopped":
        return 1 if any(codes.get(m.node, 0) != 0 for m in status.members) else 0
    return 1 if failed else 0
