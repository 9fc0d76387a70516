"""``tmd launch``: run a training script locally as machines of workers, and standby machines.

Like torchrun for one host, plus standbys. ``--nproc N --nproc-per-node K`` starts
N / K simulated machines ``worker0``, ``worker1``, ... of K ranks each (ranks
``m * K .. m * K + K - 1`` on machine ``m``, local ranks ``0 .. K - 1``), and
``--standby S`` starts S standby machines ``standby0``, ... of K slots each. Every
process gets ``TMD_NODE`` (its machine), ``RANK``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE`` and ``GROUP_RANK`` as torchrun sets them. A machine's
processes are named ``node/local_rank`` (just ``node`` when K is 1). The launcher
hosts the job's TCPStore
(so the store outlives any worker, the leaver included), starts every process with
the environment described in ``tmd.runtime.env``, and waits. A process that exits
0 after leaving the job is a success; the launcher does not tear the job down when
one rank dies, because the runtime replaces it with a standby.

Where the runtime cannot (``RestartRequired``: no standby machine ready), the
survivors exit with ``EX_RESTART``; so do all ranks after a ``Restart`` command
(the daemon asks for one when no standby can replace a faulty machine whose
processes still run), having written a checkpoint and recorded the machine to
leave out in the job's status (``excluded``). With ``--max-restarts N`` the
launcher then stops every process of the job and starts the plan again on a fresh
store, under the original names and ranks, except that an excluded machine's
ranks go to a standby machine when there is one (which is then no standby); the
workers roll back to the latest checkpoint in their ``checkpoint_dir`` and carry
on. It does the same when the job has not stopped and every member has exited,
one of them with an error (a job whose every rank was killed). Each start sees
``TMD_RESTART_COUNT``.

On a real cluster, torchrun or Slurm starts the same processes (see
``runtime/README.md``): set ``TMD_NODE`` to the host name (the default), and start
a standby machine's K processes with ``TMD_ROLE=standby``, ``LOCAL_RANK`` and
``LOCAL_WORLD_SIZE``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import msgspec
from torch._C._distributed_c10d import TCPStore

from tmd import wire
from tmd.runtime.checkpoint import EX_RESTART
from tmd.runtime.control import ACK_LOG, STATUS_KEY, read_from


@dataclass(frozen=True)
class ProcessSpec:
    role: str
    node: str
    rank: int
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def name(self) -> str:
        """The process's name: its machine, with ``/local rank`` where it runs several."""
        return process_name(self.node, self.local_rank, self.local_world_size)


def process_name(node: str, local_rank: int | None, local_world_size: int) -> str:
    return node if local_world_size == 1 else f"{node}/{local_rank or 0}"


def process_env(
    spec: ProcessSpec,
    *,
    world_size: int,
    store_port: int,
    job: str,
    broker: str | None,
    restart_count: int = 0,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.update(
        TMD_ROLE=spec.role,
        TMD_JOB=job,
        TMD_NODE=spec.node,
        RANK=str(spec.rank),
        LOCAL_RANK=str(spec.local_rank),
        LOCAL_WORLD_SIZE=str(spec.local_world_size),
        GROUP_RANK=str(spec.rank // spec.local_world_size),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
        TMD_STORE=f"127.0.0.1:{store_port}",
        TMD_RESTART_COUNT=str(restart_count),
    )
    if broker:
        env["TMD_BROKER"] = broker
    else:
        env.pop("TMD_BROKER", None)
    return env


def plan(nproc: int, standby: int, *, nproc_per_node: int = 1) -> list[ProcessSpec]:
    """``nproc / nproc_per_node`` worker machines and ``standby`` standby machines."""
    k = nproc_per_node
    if k < 1 or nproc % k:
        raise ValueError(f"--nproc {nproc} is not a multiple of --nproc-per-node {k}")
    workers = [ProcessSpec("worker", f"worker{r // k}", r, r % k, k) for r in range(nproc)]
    spares = [
        ProcessSpec("standby", f"standby{i}", 0, local, k)
        for i in range(standby)
        for local in range(k)
    ]
    return workers + spares


def without(specs: list[ProcessSpec], excluded: Collection[str]) -> list[ProcessSpec]:
    """The plan with each excluded worker machine's ranks on a standby machine, while
    standby machines last; an excluded machine with no standby left stays."""
    specs = list(specs)
    for node in excluded:
        leaving = [s for s in specs if s.node == node and s.role == "worker"]
        spare = next((s.node for s in specs if s.role == "standby"), None)
        if not leaving or spare is None:
            continue
        specs = [s for s in specs if s.node not in (node, spare)] + [
            ProcessSpec("worker", spare, s.rank, s.local_rank, s.local_world_size) for s in leaving
        ]
    return sorted(specs, key=lambda s: (s.role != "worker", s.rank, s.node, s.local_rank))


def next_plan(
    specs: list[ProcessSpec], status: wire.JobStatus, *, nproc_per_node: int
) -> tuple[list[ProcessSpec], list[str]]:
    """The next start's plan, and the excluded machines started again for want of a
    standby machine: the machines as the job last reported them (one that was migrated
    away or lost is not started again, the standby machine that took its place runs
    its ranks), the standby machines that never joined, and each machine the job asked
    to go on without (``excluded``) replaced by a standby machine while one is left."""
    k = nproc_per_node
    members = {m.node for m in status.members}
    workers = [ProcessSpec("worker", m.node, m.rank, m.local_rank or 0, k) for m in status.members]
    spares = [s for s in specs if s.role == "standby" and s.node not in members]
    planned = without(workers + spares, status.excluded)
    stays = sorted(members & set(status.excluded) & {s.node for s in planned})
    return planned, stays


def host_store(port: int = 0) -> TCPStore:
    """The job's store server, in this process; port 0 picks a free one."""
    return TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
    )


def needs_restart(
    codes: Mapping[str, int | None], members: Collection[str], *, stopped: bool
) -> bool:
    """Must the job start again? ``codes``: exit status by node, None while running;
    ``members``: the nodes holding a rank now."""
    if stopped:
        return False
    if any(code == EX_RESTART for code in codes.values()):
        return True
    ended = [codes.get(node) for node in members]
    return all(code is not None for code in ended) and any(code != 0 for code in ended)


@dataclass
class Attempt:
    """One start of the job, kept once it ended: how each process exited, and the
    acks and status it left in its store."""

    codes: dict[str, int]
    acks: list[wire.Ack] = field(default_factory=list)
    status: wire.JobStatus | None = None


class LocalJob:
    """The processes of one local job; also the harness the integration tests use."""

    def __init__(
        self,
        command: Sequence[str],
        *,
        nproc: int,
        standby: int,
        nproc_per_node: int = 1,
        job: str = "job",
        broker: str | None = None,
        store_port: int = 0,
        extra_env: Mapping[str, str] | None = None,
        max_restarts: int = 0,
        restart_grace: timedelta = timedelta(seconds=10),
    ) -> None:
        self.command = list(command)
        self.nproc = nproc
        self.nproc_per_node = nproc_per_node
        self.job = job
        self.broker = broker
        self.extra_env = dict(extra_env or {})
        self.max_restarts = max_restarts
        self.restart_grace = restart_grace
        self.specs = plan(nproc, standby, nproc_per_node=nproc_per_node)
        self.restarts = 0
        self.attempts: list[Attempt] = []
        """Earlier starts of the job, oldest first."""
        self._port = store_port
        self.store = host_store(store_port)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._served: set[str] = set()
        """Processes that held a rank in the current start: members, and leavers,
        which still run their epilogue after leaving (at nice 19, slow on a busy
        host)."""
        self._start()

    def _start(self) -> None:
        self.procs = {}
        self._served = {spec.name for spec in self.specs if spec.role == "worker"}
        for spec in self.specs:
            env = process_env(
                spec, world_size=self.nproc, store_port=self.store.port, job=self.job,
                broker=self.broker, restart_count=self.restarts,
            )  # fmt: skip
            env.update(self.extra_env)
            self.procs[spec.name] = subprocess.Popen(self.command, env=env)

    def wait(
        self, timeout: timedelta | None = None, *, grace: timedelta = timedelta(seconds=15)
    ) -> dict[str, int]:
        """Wait for every process, restarting the job up to ``max_restarts`` times;
        returns how the processes of the last start exited. Standbys end by
        themselves once the job stops: an idle standby that still runs ``grace`` after
        the job reported stopped is killed, a process that held a rank (a leaver
        finishing its epilogue) after four times that."""
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        while (restart := self._watch(deadline, grace)) and self.restarts < self.max_restarts:
            self._end_attempt(self.restart_grace)
            self.restarts += 1
            self._replan(self.attempts[-1].status)
            # A fresh store: no key of the failed start (groups, failover plans, the
            # checkpoint to restore) can mislead the next one.
            if self._port == 0:
                self.store = host_store()
            else:
                del self.store
                self.store = host_store(self._port)
            self._start()
        self._end_attempt(self.restart_grace if restart else timedelta(0))
        return self.attempts[-1].codes

    def _replan(self, status: wire.JobStatus | None) -> None:
        if status is None:
            return
        self.specs, stays = next_plan(self.specs, status, nproc_per_node=self.nproc_per_node)
        if stays:
            print(f"tmd launch: no standby machine left to start {', '.join(stays)} "
                  "without; starting it again", file=sys.stderr)  # fmt: skip

    def _watch(self, deadline: float | None, grace: timedelta) -> bool:
        """Until every process ended (False) or the job needs a restart (True)."""
        stopped_at: float | None = None
        while True:
            codes = {node: proc.poll() for node, proc in self.procs.items()}
            now = time.monotonic()
            status = self.status()  # read after polling, once: a clean end is seen
            stopped = status is not None and status.state == "stopped"
            members = self._members(status)
            # Every member gone counts as an end too, whatever the status says (its
            # last write may be lost with the process): idle standbys get ``grace``.
            members_gone = all(codes.get(m, 0) is not None for m in members)
            if stopped_at is None and (stopped or members_gone):
                stopped_at = now
            self._served.update(members)
            if needs_restart(codes, members, stopped=stopped):
                return True
            if all(code is not None for code in codes.values()):
                return False
            after_stop = None if stopped_at is None else now - stopped_at
            if after_stop is not None and after_stop > grace.total_seconds():
                self._kill_idle_standbys()
            late = after_stop is not None and after_stop > 4 * grace.total_seconds()
            if late or (deadline is not None and now > deadline):
                return False
            time.sleep(0.05)

    def _end_attempt(self, grace: timedelta) -> None:
        """Stop what still runs of this start and record it. Members and leavers get
        ``grace`` to exit by themselves first, so their last acks reach the store."""
        self._served.update(self.members())
        until = time.monotonic() + grace.total_seconds()
        self._kill_idle_standbys()
        for node in self._served:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.procs[node].wait(max(0.0, until - time.monotonic()))
        self.terminate()
        codes = {node: proc.wait() for node, proc in self.procs.items()}
        acks = [wire.decode(data, wire.Ack) for data in read_from(self.store, ACK_LOG, 1)]
        self.attempts.append(Attempt(codes, acks, self.status()))

    def _kill_idle_standbys(self) -> None:
        for node, proc in self.procs.items():
            if node not in self._served and proc.poll() is None:
                proc.kill()  # it never held a rank: nothing to lose

    def members(self) -> list[str]:
        """The processes holding a rank, as the job last reported them."""
        return self._members(self.status())

    def _members(self, status: wire.JobStatus | None) -> list[str]:
        if status is None:
            return [spec.name for spec in self.specs if spec.role == "worker"]
        k = self.nproc_per_node
        return [process_name(m.node, m.local_rank, k) for m in status.members]

    def processes(self, node: str) -> list[str]:
        """The names of machine ``node``'s processes (a process name stands for itself)."""
        return [n for n in self.procs if n == node or n.startswith(f"{node}/")]

    def status(self) -> wire.JobStatus | None:
        if not self.store.check([STATUS_KEY]):
            return None
        status: wire.JobStatus = msgspec.json.decode(
            self.store.get(STATUS_KEY), type=wire.JobStatus
        )
        return status

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Signal a process, or every process of a machine at once."""
        names = self.processes(name)
        if not names:
            raise KeyError(name)
        for each in names:
            self.procs[each].send_signal(sig)

    def terminate(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def serve_store(argv: list[str]) -> int:
    """``tmd store``: serve a job's TCPStore until stopped, for launchers that do not
    host one (torchrun, srun): point every process's ``TMD_STORE`` at it. It must
    outlive every worker (a leaver may otherwise take the store with it) and be fresh
    for every start of the job: start it with the job, stop it when the job ends."""
    parser = argparse.ArgumentParser(prog="tmd store", description=serve_store.__doc__)
    parser.add_argument("--port", type=int, default=29400, help="port (0: any free one)")
    ns = parser.parse_args(argv)
    server = TCPStore("0.0.0.0", ns.port, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=60))  # fmt: skip
    print(f"tmd store: serving on port {server.port}", file=sys.stderr, flush=True)
    stop = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    signal.sigwait(stop)
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tmd launch", description=__doc__)
    parser.add_argument("--nproc", type=int, required=True, help="workers (the world size)")
    parser.add_argument(
        "--nproc-per-node", type=int, default=1,
        help="ranks per simulated machine (its GPUs); --nproc must be a multiple",
    )  # fmt: skip
    parser.add_argument(
        "--standby", type=int, default=0, help="standby machines, of --nproc-per-node slots each"
    )
    parser.add_argument("--job", default="job", help="job name (MQTT topic segment)")
    parser.add_argument("--broker", default=None, help="MQTT broker host:port")
    parser.add_argument("--port", type=int, default=0, help="store port (0: any free one)")
    parser.add_argument(
        "--max-restarts", type=int, default=0,
        help="start the job again, from its latest checkpoint, up to N times when it "
        f"cannot go on (a process exited {EX_RESTART}, or every member ended)",
    )  # fmt: skip
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    ns = parser.parse_args(argv)
    if ns.nproc < 1 or ns.standby < 0 or ns.max_restarts < 0:
        parser.error("--nproc must be >= 1, --standby and --max-restarts >= 0")
    if ns.nproc_per_node < 1 or ns.nproc % ns.nproc_per_node:
        parser.error("--nproc must be a multiple of --nproc-per-node (>= 1)")
    job = LocalJob(
        [sys.executable, ns.script, *ns.args],
        nproc=ns.nproc, standby=ns.standby, nproc_per_node=ns.nproc_per_node, job=ns.job,
        broker=ns.broker, store_port=ns.port, max_restarts=ns.max_restarts,
    )  # fmt: skip
    try:
        codes = job.wait()
    except KeyboardInterrupt:
        job.terminate()
        return 130
    for n, attempt in enumerate(job.attempts[:-1]):
        ended = ", ".join(f"{node} {code}" for node, code in attempt.codes.items() if code)
        print(f"tmd launch: restart {n + 1} after {ended}", file=sys.stderr)
    failed = {node: code for node, code in codes.items() if code != 0}
    for node, code in failed.items():
        print(f"tmd launch: {node} exited with {code}", file=sys.stderr)
    # A rank that died and was replaced by a standby did not fail the job: the job
    # succeeded if it stopped normally and every final member exited cleanly.
    status = job.status()
    if status is not None and status.state == "stopped":
        final = job.members()
        return 1 if any(codes.get(name, 0) != 0 for name in final) else 0
    return 1 if failed else 0
