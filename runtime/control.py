"""Control channels: how prepare / switch / abort reach the ranks, and acks leave.

A session talks to a ``ControlChannel``: ``poll`` returns the commands that arrived
since the last boundary without waiting for anything, ``ack`` and
``publish_status`` queue a message and return. Network I/O happens only in the
channel's background thread, so a slow or absent broker never stalls a step.

Two channels speak the same v1 wire messages (``tmd.wire``):

- ``StoreControl`` keeps an append-only log of commands and acks in the job's
  TCPStore. ``JobController`` writes that log: the direct Python API that drives
  migrations in tests and scripts without a broker.
- ``MqttControl`` (``tmd.runtime.mqtt_control``) subscribes to ``tmd/v1/job/{job}/ctl``.

Both also keep the standby registry in the store, which is where the job's status
finds its standbys and where failover finds a ready one.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol

import msgspec
from torch._C._distributed_c10d import Store

from tmd import wire
from tmd.errors import MigrationError, ProtocolError
from tmd.runtime.group import StoreAddress, connect_store
from tmd.runtime.relay import AgentRelay

if TYPE_CHECKING:
    from tmd.runtime.env import RuntimeEnv
    from tmd.runtime.session_config import SessionConfig

CTL_LOG = "tmd/ctl"
ACK_LOG = "tmd/ack"
STATUS_KEY = "tmd/status"
STANDBY_LIST = "tmd/standbys"


def standby_key(slot: str) -> str:
    return f"tmd/standby/{slot}"


class ControlChannel(Protocol):
    def poll(self) -> list[wire.Control]: ...
    def ack(self, ack: wire.Ack) -> None: ...
    def publish_status(self, status: wire.JobStatus) -> None: ...
    def stopped(self) -> bool: ...
    def close(self) -> None: ...
    def standbys_changed(self) -> bool:
        """Has a standby changed state since the last call? Called by rank 0 at each
        boundary, which then republishes the job status; must not block."""
        ...


# -- the store log ---------------------------------------------------------------------


def put(store: Store, key: str, value: bytes) -> None:
    store.set(key, value)  # type: ignore[arg-type]  # the binding takes bytes too


def append(store: Store, log: str, payload: bytes) -> int:
    """Reserve the next index of ``log``, then write it; readers block briefly on a
    reserved index until it is written, so several writers never collide."""
    index = int(store.add(f"{log}/n", 1))
    put(store, f"{log}/{index}", payload)
    return index


def read_from(store: Store, log: str, start: int) -> list[bytes]:
    """Entries ``start, start + 1, ...`` of ``log`` that exist now (1-based)."""
    count = int(store.add(f"{log}/n", 0))
    return [bytes(store.get(f"{log}/{i}")) for i in range(start, count + 1)]


def register_standby(store: Store, info: wire.StandbyInfo, *, local_rank: int = 0) -> None:
    """Record the state of one slot of a standby machine (``info.slots`` slots)."""
    slot = f"{info.node}/{local_rank}"
    put(store, standby_key(slot), wire.encode(info))
    if int(store.add(f"{standby_key(slot)}/n", 1)) == 1:  # listed once, however raced
        store.append(STANDBY_LIST, f"{slot},")  # type: ignore[attr-defined]


def standbys(store: Store) -> list[wire.StandbyInfo]:
    """The standby machines, each as one entry: ``ready`` once every one of its slots
    is, ``failed`` if any failed, ``joining`` while any joins, else ``warming``; its
    warm-up is its slowest slot's."""
    if not store.check([STANDBY_LIST]):
        return []
    slots = [n for n in bytes(store.get(STANDBY_LIST)).decode().split(",") if n]
    by_node: dict[str, list[wire.StandbyInfo]] = {}
    for slot in slots:
        info = msgspec.json.decode(store.get(standby_key(slot)), type=wire.StandbyInfo)
        by_node.setdefault(info.node, []).append(info)
    return [_machine(infos) for infos in by_node.values()]


def _machine(infos: list[wire.StandbyInfo]) -> wire.StandbyInfo:
    states = {i.state for i in infos}
    size = max(i.slots for i in infos)
    state: Literal["warming", "ready", "joining", "failed"]
    if "failed" in states:
        state = "failed"
    elif "joining" in states:
        state = "joining"
    elif states == {"ready"} and len(infos) >= size:
        state = "ready"
    else:
        state = "warming"
    warmups = [i.warmup_s for i in infos]
    warmup = (
        max(w for w in warmups if w is not None)
        if state == "ready" and None not in warmups
        else None
    )
    return wire.StandbyInfo(node=infos[0].node, state=state, warmup_s=warmup, slots=size)


def with_standbys(registry: list[wire.StandbyInfo], status: wire.JobStatus) -> wire.JobStatus:
    # A standby that joined stays registered; as a member it is no standby.
    members = {m.node for m in status.members}
    spare = [s for s in registry if s.node not in members]
    return msgspec.structs.replace(status, standbys=spare)


def put_status(
    store: Store, status: wire.JobStatus, registry: list[wire.StandbyInfo] | None = None
) -> bytes | None:
    """Store ``status``, with the standby registry, unless a newer one is there: every
    member publishes at times (a prepare, an abort, a failover), each from its own
    thread, so a late write must not undo a later status — a job that stopped must
    not read as running. Newer is a higher (generation, step), then an ending
    (``stopped``, ``restarting``) over any other state at the same step, then a later
    time (members' clocks may differ, so time decides last). Returns the payload
    stored, or None when a newer status was kept. ``registry``: the standby registry,
    if the caller has just read it."""
    if registry is None:
        registry = standbys(store)
    payload = wire.encode(with_standbys(registry, status))
    mine = _order(status)
    while True:
        old = bytes(store.get(STATUS_KEY)) if store.check([STATUS_KEY]) else b""
        if old:
            held = msgspec.json.decode(old, type=wire.JobStatus)
            if _order(held) > mine:
                return None
        if bytes(store.compare_set(STATUS_KEY, old.decode(), payload.decode())) == payload:
            return payload


def _order(status: wire.JobStatus) -> tuple[int, int, bool, float]:
    return (status.generation, status.step, status.state in ("stopped", "restarting"),
            status.ts)  # fmt: skip


class _Poller:
    """A daemon thread that runs ``tick`` every ``interval`` and drains an outbox.
    Errors are counted and kept, never raised into training."""

    def __init__(self, name: str, interval: timedelta, tick: Callable[[], None]) -> None:
        self.outbox: queue.Queue[Callable[[], None]] = queue.Queue(maxsize=1024)
        self.errors = 0
        self.last_error: BaseException | None = None
        self._tick = tick
        self._interval = interval.total_seconds()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None]) -> None:
        try:
            self.outbox.put_nowait(job)
        except queue.Full:
            self.errors += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            for job in [*self._drain(), self._tick]:
                try:
                    job()
                except Exception as exc:  # a store hiccup must not end the channel
                    self.errors += 1
                    self.last_error = exc
            self._stop.wait(self._interval)
        for job in self._drain():
            try:
                job()
            except Exception:
                self.errors += 1

    def _drain(self) -> Iterable[Callable[[], None]]:
        jobs = []
        while True:
            try:
                jobs.append(self.outbox.get_nowait())
            except queue.Empty:
                return jobs

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        self._stop.set()
        self._thread.join(timeout.total_seconds())


class StoreControl:
    """A ``ControlChannel`` over the job's TCPStore (tests, and jobs without a broker)."""

    def __init__(
        self,
        address: StoreAddress,
        *,
        job: str,
        poll_interval: timedelta = timedelta(milliseconds=20),
        timeout: timedelta = timedelta(seconds=30),
    ) -> None:
        self.job = job
        self.rejected = 0
        self._store = connect_store(address, timeout=timeout)
        self._next = 1
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._stopped = False
        self._poller = _Poller(f"tmd-ctl-{job}", poll_interval, self._tick)

    def _tick(self) -> None:
        for data in read_from(self._store, CTL_LOG, self._next):
            self._next += 1
            try:
                message = wire.decode(data, wire.Control)
            except ProtocolError:
                self.rejected += 1
                continue
            if message.job == self.job:
                self._inbox.put(message)
        if self._store.check([STATUS_KEY]):
            status = msgspec.json.decode(self._store.get(STATUS_KEY), type=wire.JobStatus)
            self._stopped = status.state == "stopped"

    def poll(self) -> list[wire.Control]:
        out = []
        while not self._inbox.empty():
            out.append(self._inbox.get_nowait())
        return out

    def ack(self, ack: wire.Ack) -> None:
        def write() -> None:
            append(self._store, ACK_LOG, wire.encode(ack))

        self._poller.submit(write)

    def publish_status(self, status: wire.JobStatus) -> None:
        def write() -> None:
            put_status(self._store, status)

        self._poller.submit(write)

    def stopped(self) -> bool:
        return self._stopped

    def standbys_changed(self) -> bool:
        return False  # readers of the store's status read the standby registry themselves

    def close(self) -> None:
        self._poller.close()


class JobController:
    """The direct Python API: drives the migration protocol through the store log.

    Commands are the same wire messages the daemon sends over MQTT; ``wait_acks``
    collects the runtime's answers.
    """

    def __init__(self, store: Store, *, job: str) -> None:
        self.job = job
        self._store = store
        self._acks: list[wire.Ack] = []
        self._next_ack = 1

    def send(self, message: wire.Control) -> None:
        append(self._store, CTL_LOG, wire.encode(message))

    def prepare(self, migration_id: str, *, leaver: str, joiner: str) -> None:
        self.send(
            wire.Prepare(
                ts=time.time(),
                job=self.job,
                migration_id=migration_id,
                leaver=leaver,
                joiner=joiner,
            )
        )

    def switch(self, migration_id: str, *, at_step: int | None = None) -> None:
        self.send(
            wire.Switch(ts=time.time(), job=self.job, migration_id=migration_id, at_step=at_step)
        )

    def restart(self, migration_id: str, *, node: str, reason: str = "") -> None:
        self.send(wire.Restart(ts=time.time(), job=self.job, migration_id=migration_id,
                               node=node, reason=reason))  # fmt: skip

    def abort(self, migration_id: str, *, reason: str = "") -> None:
        self.send(
            wire.Abort(ts=time.time(), job=self.job, migration_id=migration_id, reason=reason)
        )

    def acks(self) -> list[wire.Ack]:
        for data in read_from(self._store, ACK_LOG, self._next_ack):
            self._next_ack += 1
            self._acks.append(wire.decode(data, wire.Ack))
        return list(self._acks)

    def wait_acks(
        self,
        migration_id: str,
        kind: str,
        *,
        count: int,
        timeout: timedelta = timedelta(seconds=60),
    ) -> list[wire.Ack]:
        """Block until ``count`` processes acked ``kind`` for ``migration_id`` (a
        machine of K ranks answers K times, once per local rank); raises
        MigrationError on a ``failed`` ack or on timeout."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            mine = [a for a in self.acks() if a.migration_id == migration_id]
            if kind != "failed" and any(a.kind == "failed" for a in mine):
                said = "; ".join(f"{a.node}/{a.local_rank} {a.kind}: {a.detail}" for a in mine)
                raise MigrationError(f"{migration_id}: {said}")
            found = [a for a in mine if a.kind == kind]
            if len({(a.node, a.local_rank) for a in found}) >= count:  # a repeat counts once
                return found
            if time.monotonic() > deadline:
                raise MigrationError(f"{migration_id}: {len(found)}/{count} {kind} acks")
            time.sleep(0.02)

    def wait_standbys(self, *nodes: str, timeout: timedelta = timedelta(seconds=60)) -> None:
        """Block until every standby machine in ``nodes`` is ``ready`` (each of its
        slots warmed up and waiting for a ``Prepare``), as the daemon waits before it
        names a joiner; raises MigrationError on timeout."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            ready = {s.node for s in standbys(self._store) if s.state == "ready"}
            if ready >= set(nodes):
                return
            if time.monotonic() > deadline:
                raise MigrationError(f"standbys not ready: {sorted(set(nodes) - ready)}")
            time.sleep(0.02)

    def status(self) -> wire.JobStatus | None:
        if not self._store.check([STATUS_KEY]):
            return None
        result: wire.JobStatus = msgspec.json.decode(
            self._store.get(STATUS_KEY), type=wire.JobStatus
        )
        return result


Sink = Callable[[str, bytes], None]
"""Where a session's telemetry goes: ``MqttControl.publish``."""


def open_control(env: RuntimeEnv, config: SessionConfig) -> tuple[ControlChannel, Sink | None]:
    """The control channel ``env`` names (MQTT where it names a broker, else the job's
    store) and the telemetry sink: through the machine's agent where it has one
    (``tmd.runtime.relay``), directly over MQTT where it has not or the agent fails,
    else none."""
    control: ControlChannel
    direct: Sink | None = None
    if env.mqtt is not None:
        # paho is loaded only by a job that talks to a broker.
        from tmd.runtime.mqtt_control import MqttControl

        mqtt = MqttControl(env.mqtt, job=env.job, node=env.slot, store=env.store,
                           max_age=config.command_max_age)  # fmt: skip
        control, direct = mqtt, mqtt.publish
    else:
        control = StoreControl(env.store, job=env.job, poll_interval=config.control_poll)
    if env.agent_socket is not None:  # the machine's agent publishes for its ranks
        try:
            return control, AgentRelay(env.agent_socket, direct)
        except OSError:  # no socket of its own to hear the agent on: go direct
            pass
    return control, direct
