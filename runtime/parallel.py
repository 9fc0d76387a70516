"""Jobs wrapped by torch's own parallelism: FSDP2 (``fully_shard``), HSDP and tensor
parallelism on a ``DeviceMesh``, and ``DistributedDataParallel`` (built with
``init_sync=False``), migrated live by swapping the groups beneath them.

    import tmd.runtime as rt
    from tmd.runtime import parallel

    parallel.init()                               # where init_process_group() was
    mesh = init_device_mesh("cpu", (world,))      # or (replicas, shards), (dp, tp)
    model = Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters())
    with rt.session(model, optimizer) as s:
        for step in s.steps(total):
            loss_fn(model(x), y).backward()       # FSDP reduces the gradients
            s.step()                              # the optimizer, then the boundary

``init`` makes the job's default world a group tmd can swap
(``tmd.runtime.swap_group``), so every group the mesh is made of is one too. On a
worker it returns at once, with the worker's rank. A standby has no rank until a
migration names it, and the wrapper shards the model by rank: ``init`` registers it
ready, waits for a ``Prepare`` naming its machine, learns from the leaver the rank it
will take, builds the job's next group with the stayers, and returns that rank. The
script then builds its mesh and model as any worker does, and its session takes the
leaver's shards (parameters and optimizer state, pre-copied, then kept in lock-step
with the leaver's clipped gradient shards) and joins at the switch. Its sandboxed
shadow iterations (``SessionConfig.shadow_steps`` of the user's loop) run in its
session before it tells the stayers it is ready, every collective answered from its
own tensors (``swap_group.Loopback``): the joiner's first forward and backward, and
their allocations, happen before the switch, not in the first step after it. Once
prepared for a rank it serves that migration only: if the
migration fails or is aborted, it registers as ``failed`` and its loop ends (the
machine needs a fresh standby process: ``tmd launch`` starts one only when it
restarts the job). If the job stops first, ``init`` returns None, the default world
is installed at rank 0 so the script can go on, and the loop runs no step.

In the session, a wrapped model (``Session.wrapped``) has no gradient reducer (the
wrapper reduced the gradients during backward); the step's migration votes go
through one small all-reduce on tmd's own group, and the update (clipping, optimizer,
scheduler) runs as for data parallelism. A DDP joiner commits only where its
reducer buckets the gradients as the job's does (``state.bucket_layout``).

A machine lost mid-step is replaced in place where its state has replicas (DDP,
HSDP; ``tmd.runtime.failover``): the survivors' collectives of that step are
answered locally once one failed (``swap_group.Guard``), ``step`` replaces the lost
ranks and returns False, and the loop runs the step again. A standby waiting in
``init`` is named by the failover plan instead of a ``Prepare``: it returns the lost
rank of its slot, and its session takes that rank's state from its donor (after
sandboxed iterations that rebuild a DDP model's buckets). Without replicas (FSDP2
on one mesh dimension, tensor parallelism) the job rolls back to its checkpoint,
which is sharded, written collectively with ``torch.distributed.checkpoint``. Not
covered yet: NCCL (see ``swap_group``). Tested with torch 2.13.0 on gloo and the CPU.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch._C._distributed_c10d import Store

from tmd import wire
from tmd.errors import MigrationError
from tmd.runtime import swap_group
from tmd.runtime.commands import AckKind
from tmd.runtime.control import ControlChannel, Sink, open_control
from tmd.runtime.env import RuntimeEnv
from tmd.runtime.failover import failover_rank, take_over, take_plan
from tmd.runtime.group import GroupBuilder, connect_store
from tmd.runtime.liveness import Heartbeat
from tmd.runtime.membership import Reconfiguration
from tmd.runtime.migration import groups_key, reading_key, world_prefix
from tmd.runtime.session_config import SessionConfig
from tmd.runtime.standby import Prepared, Standing, announce, complete_join, prepare_join
from tmd.runtime.swap_group import start_inner

if TYPE_CHECKING:
    from tmd.runtime.session import Session

__all__ = ["Place", "init", "installed"]

installed = swap_group.installed


@dataclass
class Place:
    """What a standby of a wrapped job learnt before its model existed: the rank it
    takes in the migration it is prepared for (or that the job stopped first), and
    the channel and heartbeat the join goes on with in its session."""

    control: ControlChannel
    sink: Sink | None
    warmup_s: float
    seen: list[str]
    """Migration ids this standby acted on (the session remembers them too)."""
    prepare: wire.Prepare | None = None
    prepared: Prepared | None = None
    heartbeat: Heartbeat | None = None
    inner: dict[str, GroupBuilder] | None = None
    failover: dict[str, Any] | None = None
    """Instead of a migration: the failover plan that gave this standby a lost rank."""
    failover_rank: int | None = None

    @property
    def rank(self) -> int | None:
        if self.failover is not None:
            return self.failover_rank
        return None if self.prepared is None else self.prepared.rank

    def close(self) -> None:
        """Stop the heartbeat; abandon whatever is still being built."""
        if self.heartbeat is not None:
            self.heartbeat.close()
        builders = list((self.inner or {}).values())
        if self.prepared is not None:
            builders.append(self.prepared.world)
        for builder in builders:
            if not builder.done():
                builder.abandon()


_place: Place | None = None


def take_place() -> Place | None:
    """The place ``init`` found for this standby, once (for its session)."""
    global _place
    place, _place = _place, None
    return place


def init(*, config: SessionConfig | None = None, env: RuntimeEnv | None = None) -> int | None:
    """Make the default world swappable, at this worker's rank or, on a standby, at the
    rank it will take (waiting until a migration names it; see the module's
    docstring). Call it once, before ``init_device_mesh`` and the wrappers; pass the
    session's ``config`` where it is not the default."""
    global _place
    env = env or RuntimeEnv.from_environ()
    if env.role == "worker":
        swap_group.install(rank=env.rank, size=env.world_size)
        return env.rank
    place = _Waiting(env, config or SessionConfig()).wait()
    swap_group.install(rank=place.rank or 0, size=env.world_size)
    _place = place
    return place.rank


WRAPPER_MODULES = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch._dynamo")
"""What the wrappers import on first use: about 1.6 s on an idle core of this host
(``fully_shard`` loads ``torch._dynamo`` for its first DTensor), which a standby
named by a failover would otherwise spend after the loss, on the job's critical
path. A standby imports them before it registers ready."""


def prewarm() -> None:
    for name in WRAPPER_MODULES:
        with contextlib.suppress(ImportError):  # one this job cannot use: its loss
            importlib.import_module(name)


class _Waiting:
    """A standby of a wrapped job before its model exists: what standing by and the
    first phase of a join need (``tmd.runtime.standby.Standing``)."""

    def __init__(self, env: RuntimeEnv, config: SessionConfig) -> None:
        self.env, self.config = env, config
        self.created = time.monotonic()
        prewarm()
        self.store: Store = connect_store(env.store, timeout=config.store_timeout)
        self.warmup_s: float | None = None
        self._control, self.sink = open_control(env, config)
        self.seen: list[str] = []

    @property
    def control(self) -> ControlChannel:
        return self._control

    def ack(
        self, migration_id: str, kind: AckKind, *, detail: str = "",
        downtime: wire.Downtime | None = None,
    ) -> None:  # fmt: skip
        env = self.env
        self._control.ack(
            wire.Ack(ts=time.time(), job=env.job, migration_id=migration_id, kind=kind,
                     node=env.node, rank=None, local_rank=env.local_rank, generation=0,
                     at_step=0, downtime=downtime, detail=detail[:1000])
        )  # fmt: skip

    def wait(self) -> Place:
        """Until a migration names this machine and its phase 1 is done, or the job
        stopped (a place without a rank)."""
        self.warmup_s = time.monotonic() - self.created
        announce(self, "ready")
        poll = min(self.config.control_poll.total_seconds(), 0.01)
        place = Place(self._control, self.sink, self.warmup_s, self.seen)
        while not self._control.stopped():
            plan = take_plan(self.store, self.env.slot)
            if plan is not None:  # a machine was lost: take its rank of this slot
                place.failover = plan
                place.failover_rank = failover_rank(plan, self.env)
                announce(self, "joining")
                return place
            for message in self._control.poll():
                if not isinstance(message, wire.Prepare) or message.joiner != self.env.node:
                    continue
                if message.migration_id in self.seen:
                    continue
                self.seen.append(message.migration_id)
                if self._prepare(place, message):
                    return place
                announce(self, "ready")
            time.sleep(poll)
        return place

    def _prepare(self, place: Place, message: wire.Prepare) -> bool:
        mid = message.migration_id
        announce(self, "joining")
        beat = self.config.joiner_timeout / 10
        heartbeat = Heartbeat(self.env.store, self.env.slot, interval=beat)  # the leaver watches
        try:
            prepared = prepare_join(self, mid)
        except (MigrationError, RuntimeError, ValueError) as exc:
            heartbeat.close()
            self.ack(mid, "failed", detail=str(exc))
            return False
        if prepared is None:
            heartbeat.close()
            self.ack(mid, "aborted")
            return False
        place.prepare, place.prepared, place.heartbeat = message, prepared, heartbeat
        return True


def finish_join(session: Session, place: Place) -> Reconfiguration | None:
    """The rest of a wrapped standby's join, in its session, its model now built at
    the rank ``init`` returned: build the inner groups with the stayers (they start
    once they see the store key), then follow the leaver and commit
    (``standby.complete_join``); or, named by a failover plan, take the lost rank's
    state from its donor. None: the migration or takeover failed, or was aborted."""
    if place.failover is not None:
        return _take_over(session, place, place.failover)
    assert place.prepare is not None and place.prepared is not None
    assert place.inner is not None
    mid = place.prepare.migration_id
    session.store.add(reading_key(mid), 1)  # from here on it reads the channel
    joined = None
    try:
        joined = complete_join(session, mid, place.prepared, place.inner)
    except (MigrationError, RuntimeError, ValueError) as exc:
        session.ack(mid, "failed", detail=str(exc))
    if joined is None:
        abandon(session, place)
    else:
        place.close()
    return joined


def _take_over(session: Session, place: Place, plan: dict[str, Any]) -> Reconfiguration | None:
    """A wrapped standby named by a failover plan, its model built at the lost rank and
    its shadow iterations done: the donor's state, then the next generation's groups
    (``failover.take_over``). None: it could not."""
    try:
        joined = take_over(session, plan)
    except (MigrationError, RuntimeError, ValueError) as exc:
        session.ack(str(plan.get("id", "")), "failed", detail=str(exc))
        abandon(session, place)
        return None
    place.close()
    return joined


def start_failover(session: Session) -> None:
    """A wrapped standby's session opened for a failover: a DDP model's shadow
    iterations (its buckets rebuilt as the job's were) run on ``Loopback`` groups."""
    ddp = isinstance(session.state.model, torch.nn.parallel.DistributedDataParallel)
    swap_group.sandbox(own_broadcasts=ddp)


def start_groups(session: Session, place: Place) -> None:
    """A wrapped standby's session opened, its mesh built: start building the inner
    groups with the stayers (they start theirs once every slot counted itself), and
    run the shadow iterations on ``Loopback`` groups meanwhile."""
    assert place.prepare is not None
    mid, env, cfg = place.prepare.migration_id, session.env, session.config
    place.inner = start_inner(env.store, world_prefix(mid), timeout=cfg.group_timeout,
                              backend=env.backend, host=env.host)  # fmt: skip
    session.store.add(groups_key(mid), 1)
    ddp = isinstance(session.state.model, torch.nn.parallel.DistributedDataParallel)
    swap_group.sandbox(own_broadcasts=ddp)


def abandon(session: Standing, place: Place, detail: str = "") -> None:
    """The join is off (failed, aborted, or the script raised): stop the heartbeat
    and the builds; sharded for a rank it did not take, this process cannot serve
    another, so it registers as failed."""
    if place.prepare is not None and detail:
        session.ack(place.prepare.migration_id, "failed", detail=detail)
    if place.failover is not None and detail:
        session.ack(str(place.failover.get("id", "")), "failed", detail=detail)
    place.close()
    announce(session, "failed")
