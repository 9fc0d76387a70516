"""The standby: shadow warm-up, waiting, and joining the job as the leaver's rank.

The session runs the standby's first ``shadow_steps`` iterations of the user's own
loop as sandboxed shadow iterations (``Session._shadow_step``): real data, forward,
backward and optimizer, the all-reduce answered locally. Then ``stand_by`` reports
ready with the warm-up time and waits for a ``Prepare`` naming this machine. A
standby machine runs one such process per slot (``LOCAL_RANK``); each joins as the
leaving machine's rank of its own local rank, over its own channel to that rank.

Joining (the joiner's half of the protocol):

1. connect the transfer channel to the leaver, learn the rank it will take, build
   the next group with the stayers, answer ``prepared``;
2. once a switch is requested, receive the bulk snapshot straight into the
   shadow-warmed tensors (the shadow state is disposable); then lock-step: apply
   every ``GRADS`` message with the session's own update, so the bulk state stays
   bit-identical to the leaver's;
3. on ``SWITCH``: load the small state, commit on the new group, and hand the
   session this process's place in it (a ``Reconfiguration``); the session makes it
   a worker and the user's loop carries on as that rank. On ``ABORT`` (or any
   failure) go back to standing by.

A standby of a job wrapped by torch's parallelism runs phase 1 before its model
exists and the rest in its session, and cannot go back to standing by
(``tmd.runtime.parallel``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch._C._distributed_c10d import Store

from tmd import wire
from tmd.errors import MigrationError
from tmd.runtime.commands import AckKind
from tmd.runtime.control import STATUS_KEY, ControlChannel, register_standby
from tmd.runtime.env import RuntimeEnv
from tmd.runtime.failover import failure_reported, take_over, take_plan
from tmd.runtime.group import GroupBuilder
from tmd.runtime.liveness import Heartbeat
from tmd.runtime.membership import Membership, Reconfiguration
from tmd.runtime.migration import world_prefix, xfer_prefix
from tmd.runtime.session_config import SessionConfig
from tmd.runtime.state import bucket_layout
from tmd.runtime.timing import PendingSwitch
from tmd.runtime.transfer import Kind, TransferChannel

if TYPE_CHECKING:
    from tmd.runtime.session import Session


class Standing(Protocol):
    """What standing by and the first phase of a join need of a session; a standby of
    a job wrapped by torch's parallelism has them before its session
    (``tmd.runtime.parallel``)."""

    env: RuntimeEnv
    config: SessionConfig
    store: Store
    warmup_s: float | None

    @property
    def control(self) -> ControlChannel: ...

    def ack(
        self, migration_id: str, kind: AckKind, *, detail: str = "",
        downtime: wire.Downtime | None = None,
    ) -> None: ...  # fmt: skip


def announce(session: Standing, state: Literal["warming", "ready", "joining", "failed"]) -> None:
    warmup_s = session.warmup_s if state == "ready" else None
    env = session.env
    info = wire.StandbyInfo(node=env.node, state=state, warmup_s=warmup_s,
                            slots=env.local_world_size)  # fmt: skip
    register_standby(session.store, info, local_rank=env.local_rank)


def stand_by(session: Session) -> Reconfiguration | None:
    """Block until this standby has joined the job (its place in the group), or the
    job stopped (None)."""
    announce(session, "ready")
    # The standby has nothing else to do: poll often, a failover waits on it.
    poll = min(session.config.control_poll.total_seconds(), 0.01)
    while True:
        if session.control.stopped():
            return None
        plan = take_plan(session.store, session.env.slot)
        if plan is not None:
            return take_over(session, plan)
        for message in session.control.poll():
            if not isinstance(message, wire.Prepare) or message.joiner != session.env.node:
                continue
            if not session.commands.first_seen(message.migration_id):
                continue
            try:
                joined = join(session, message)
                if joined is not None:
                    return joined
            except (MigrationError, RuntimeError) as exc:
                session.ack(message.migration_id, "failed", detail=str(exc))
            announce(session, "ready")
        time.sleep(poll)


def _wait_built(
    session: Standing, builder: GroupBuilder, migration_id: str, failed: Callable[[], bool]
) -> bool:
    """Wait for a group build, watching for an abort of this migration, and for a
    failure in the job (``failed``): a member died, so this migration is off and the
    survivors need this machine ready for their failover, within ``standby_wait``."""
    poll = session.config.control_poll
    while not builder.wait(poll):
        for message in session.control.poll():
            if isinstance(message, wire.Abort) and message.migration_id == migration_id:
                builder.abandon()
                return False
        if session.control.stopped() or failed():
            builder.abandon()
            return False
    return True


def _job_failure(session: Standing) -> Callable[[], bool]:
    """Whether a member of the job's generation (as its status in the store says now)
    reported a failed collective since."""
    store = session.store
    if not store.check([STATUS_KEY]):
        return lambda: False
    status = wire.decode(bytes(store.get(STATUS_KEY)), wire.JobStatus)
    return lambda: failure_reported(store, status.generation)


def join(session: Session, prepare: wire.Prepare) -> Reconfiguration | None:
    """Run one migration as its joiner: this process's place in the new group, or
    None where the migration was aborted."""
    beat = session.config.joiner_timeout / 10
    with Heartbeat(session.env.store, session.env.slot, interval=beat):  # the leaver watches
        return _join(session, prepare)


def _join(session: Session, prepare: wire.Prepare) -> Reconfiguration | None:
    mid = prepare.migration_id
    announce(session, "joining")
    prepared = prepare_join(session, mid)
    if prepared is None:
        session.ack(mid, "aborted")
        return None
    return complete_join(session, mid, prepared)


def complete_join(
    session: Session, mid: str, prepared: Prepared,
    inner: dict[str, GroupBuilder] | None = None,
) -> Reconfiguration | None:  # fmt: skip
    """Phases 2 and 3 of a join: ack prepared, follow the leaver until the switch, and
    commit on the new group. ``inner``: the builders of the inner groups of a job
    wrapped by torch's parallelism (``tmd.runtime.parallel``)."""
    layout = bucket_layout(session.state.model)  # its shadow iterations are done
    session.ack(mid, "prepared")
    # The bulk state comes once a switch is requested; until then this waits idle.
    arrived = _follow(session, prepared.channel)
    world = prepared.world
    builders = [world, *(inner or {}).values()]
    if arrived is None:
        for builder in builders:
            builder.abandon()
        session.ack(mid, "aborted")
        return None
    for builder in builders:
        if not builder.wait(session.config.group_timeout):
            raise MigrationError(f"group {builder.prefix} not built at the switch")
    group = world.result()
    groups = None if inner is None else {name: b.result() for name, b in inner.items()}
    agree = layout == arrived.buckets
    total = torch.tensor([int(agree)], dtype=torch.int64)  # 0: every member aborts
    group.allreduce([total]).wait()
    if not agree:
        raise MigrationError(
            f"the joiner's DDP buckets {layout} are not the job's {arrived.buckets}"
        )
    if int(total.item()) != len(prepared.membership.nodes):
        raise MigrationError("commit on the new group did not see every member")
    # From here on this process is the leaver's rank. If the old members fail to
    # commit, they drop the new group and this rank's next collective fails.
    resumed = time.monotonic()
    timing = PendingSwitch(
        mid, last_step_end=arrived.started, resumed=resumed, transfer_s=arrived.transfer_s,
        switch_s=max(0.0, resumed - arrived.started - arrived.transfer_s),
    )  # fmt: skip
    return Reconfiguration(group, prepared.membership, rank=prepared.rank, switch=timing,
                           inner=groups, median_step_s=arrived.median_step_s)  # fmt: skip


@dataclass(frozen=True)
class Prepared:
    """Phase 1 done: the leaver said who to be, and the next group is built."""

    channel: TransferChannel
    membership: Membership
    rank: int
    world: GroupBuilder


def prepare_join(session: Standing, mid: str) -> Prepared | None:
    """Phase 1: the channel to the leaver, which says the rank and members to join
    as, and the next group built with the stayers. None: aborted."""
    cfg, env = session.config, session.env
    failed = _job_failure(session)
    pair = GroupBuilder(env.store, xfer_prefix(mid, env.local_rank), rank=1, size=2,
                        timeout=cfg.group_timeout, backend="gloo", host=env.host)  # fmt: skip
    if not _wait_built(session, pair, mid, failed):
        return None
    channel = TransferChannel(pair.result(), is_leaver=False)
    header, hello = channel.recv()
    if header.kind is Kind.ABORT:
        return None
    if header.kind is not Kind.HELLO:
        raise MigrationError(f"expected hello, got {header.kind.name}")
    membership = Membership(int(hello["generation"]), tuple(hello["nodes"]),
                            tuple(hello.get("local_ranks", ())))  # fmt: skip
    rank = int(hello["rank"])
    world = GroupBuilder(env.store, world_prefix(mid), rank=rank, size=len(membership.nodes),
                         timeout=cfg.group_timeout, backend=env.backend, host=env.host)  # fmt: skip
    if not _wait_built(session, world, mid, failed):
        return None
    world.result()  # raises if the build failed
    return Prepared(channel, membership, rank, world)


@dataclass(frozen=True)
class _Arrived:
    """The leaver's state is all here and loaded."""

    started: float
    """Where the switch's downtime starts for the joiner."""
    transfer_s: float
    median_step_s: float
    buckets: dict[str, Any] | None = None
    """The leaver's DDP bucket layout (``state.bucket_layout``), None for any other model."""


def _follow(session: Session, channel: TransferChannel) -> _Arrived | None:
    """Phase 2: receive the bulk snapshot, follow the leaver in lock-step, and load
    the small state the switch brings. None: aborted."""
    header, manifest = channel.recv()
    if header.kind is Kind.ABORT:
        return None
    if header.kind is not Kind.SNAPSHOT:
        raise MigrationError(f"expected a snapshot, got {header.kind.name}")
    state = session.state
    snapshot_started = time.monotonic()
    channel.recv_tensors(state.receive_tensors(manifest))
    snapshot_s = time.monotonic() - snapshot_started
    state.step = header.step
    lockstep_steps = 0
    while True:
        header, payload = channel.recv()
        received = time.monotonic()
        if header.kind is Kind.GRADS:
            model_buffers = state.buffer_tensors()
            if not isinstance(payload, dict) or "buffers" not in payload:
                raise MigrationError("the leaver's lock-step message lacks the model's "
                                     "buffers: it runs another version of tmd")  # fmt: skip
            if payload["buffers"] != len(model_buffers):
                raise MigrationError(f"the leaver's model has {payload['buffers']} buffers, "
                                     f"this joiner's {len(model_buffers)}")  # fmt: skip
            state.load_hyperparams(payload["hyperparams"])
            if session.reducer is None:  # a wrapped model: this rank's shards, clipped
                channel.recv_tensors(state.receive_grads(payload["has_grad"]) + model_buffers)
                session.apply_update(step_scheduler=False, clip=False)
            else:
                channel.recv_tensors([*session.reducer.buffers, *model_buffers])
                session.reducer.load(session.reducer.buffers)
                # The schedule arrives at the switch.
                session.apply_update(step_scheduler=False)
            state.step = header.step
            lockstep_steps += 1
        elif header.kind is Kind.SWITCH:
            break
        elif header.kind is Kind.ABORT:
            return None
        else:
            raise MigrationError(f"unexpected {header.kind.name} in lock-step")
    # Without lock-step (cold standby) the whole snapshot was part of the switch.
    cold = lockstep_steps == 0
    started = snapshot_started if cold else time.monotonic()
    small: dict[str, Any] = payload
    state.load_small_state(small)
    session.capture_boundary()  # what to hand on should the first step fail
    transfer_s = time.monotonic() - received + (snapshot_s if cold else 0.0)
    return _Arrived(started, transfer_s, float(small.get("median_step_s", 0.0)),
                    small.get("buckets"))  # fmt: skip
