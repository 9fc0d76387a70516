"""The training session: the user's loop, the current group, and the step boundary.

    with tmd.runtime.session(model, optimizer, scheduler=sched,
                             stateful={"sampler": sampler}) as s:
        for step in s.steps(total_steps):
            with s.loading():
                x, y = data(sampler.next_batch())
            loss_fn(model(x), y).backward()
            s.step()

The same script runs as a worker or as a standby (``TMD_ROLE``). A worker's
``step`` averages gradients over the current group, applies the optimizer and
then runs the boundary: it acts on the agreed migration votes and polls the
control channel. A standby's first ``shadow_steps`` iterations are sandboxed
shadow iterations; then ``steps`` blocks until the standby joins the job (it
resumes holding the leaver's state, rank and data position, and the loop carries
on as that rank) or the job stops. A leaver's ``steps`` ends after the switch.

If a collective fails because a member died, ``step`` replaces it with a ready
standby in place (``tmd.runtime.failover``) and completes the same step. Where no
standby can serve, ``step`` raises ``tmd.errors.RestartRequired`` on every survivor;
the job then restarts from its latest checkpoint (``checkpoint_dir``,
``tmd.runtime.checkpoint``), which every worker loads when the session opens.
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch

from tmd import wire
from tmd.errors import ConfigError
from tmd.runtime import checkpoint
from tmd.runtime.control import ControlChannel, StoreControl
from tmd.runtime.env import RuntimeEnv
from tmd.runtime.failover import Recovery, failure_reported, recover
from tmd.runtime.group import Group, connect_store, make_group
from tmd.runtime.migration import VOTE_ABORT, VOTE_READY, Membership, Migration
from tmd.runtime.reducer import GradientReducer
from tmd.runtime.state import Stateful, TrainState
from tmd.runtime.telemetry import Telemetry

AckKind = Literal["prepared", "switched", "failed", "aborted"]


@dataclass(frozen=True)
class SessionConfig:
    bucket_bytes: int = 25 << 20
    shadow_steps: int = 2
    """Sandboxed iterations a standby runs before it reports ready."""
    max_grad_norm: float | None = None
    """Clip the averaged gradients; applied identically by a lock-step joiner."""
    store_timeout: timedelta = timedelta(seconds=60)
    group_timeout: timedelta = timedelta(seconds=60)
    """Bounds building a group and every collective on it."""
    control_poll: timedelta = timedelta(milliseconds=50)
    """How often the control channel's thread reads the store log (commands are
    acted on at the next step boundary anyway)."""
    telemetry_flush: timedelta = timedelta(seconds=1)
    telemetry_queue: int = 4096
    eager_copy: bool = False
    """Copy the bulk state to the joiner as soon as the groups are built, not when
    the switch is requested: the switch can then come sooner, but every step until
    it pays for forwarding gradients."""
    prepare_ahead: bool = True
    """Build the next group and copy the state during prepare (live migration).
    ``False`` is the cold-standby baseline: everything happens at the switch."""
    joiner_timeout: timedelta = timedelta(seconds=5)
    """A joiner whose heartbeat is older than this is given up (the migration aborts)."""
    detect_timeout: timedelta = timedelta(seconds=10)
    """After a collective fails, how long survivors wait for each other to agree on
    which rank died."""
    status_every: int = 100
    """Steps between two status publications by rank 0 (plus one at every change)."""
    standby_wait: timedelta = timedelta(seconds=5)
    """After a rank died, how long the donor waits for a standby to become ready (one
    still warming up) before giving up on in-place failover."""
    checkpoint_dir: str | os.PathLike[str] | None = None
    """Where periodic checkpoints go, one directory every rank sees. A worker whose
    directory holds a complete checkpoint resumes from the latest one at start."""
    checkpoint_every: int = 0
    """Steps between two checkpoints (0: never). Each one stalls the job while rank
    0 writes the bulk state, which must take less than ``group_timeout`` (the other
    ranks wait for it in the next all-reduce); see ``tmd.runtime.checkpoint``."""

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ConfigError("checkpoint_every", "must be >= 0")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ConfigError("checkpoint_every", "needs a checkpoint_dir")
        if self.standby_wait < timedelta(0):
            raise ConfigError("standby_wait", "must not be negative")


@dataclass
class _Timing:
    data_s: float = 0.0
    step_ends: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=64))

    def median_step_s(self) -> float:
        return statistics.median(self.durations) if self.durations else 0.0


class Session:
    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        scheduler: Stateful | None = None,
        stateful: dict[str, Stateful] | None = None,
        config: SessionConfig | None = None,
        env: RuntimeEnv | None = None,
        control: ControlChannel | None = None,
    ) -> None:
        self.config = config or SessionConfig()
        self.env = env or RuntimeEnv.from_environ()
        self.state = TrainState(model, optimizer, scheduler, dict(stateful or {}))
        self.reducer = GradientReducer(self.state.params(), bucket_bytes=self.config.bucket_bytes)
        self.role = self.env.role
        self.rank = self.env.rank
        self.world_size = self.env.world_size
        self.created = time.monotonic()
        self.group: Group | None = None
        self.membership = Membership(0, [])
        self.migration: Migration | None = None
        self.left = False
        self.stopped = False
        self.shadow_steps_done = 0
        self.timing = _Timing()
        self.seen: set[str] = set()
        self.outcomes: dict[str, AckKind] = {}
        self.downtimes: dict[str, wire.Downtime] = {}  # by migration id, as acked
        self.warmup_s: float | None = None
        self.last_downtime: wire.Downtime | None = None
        self.last_timing: wire.StepTiming | None = None
        self.restored_step: int | None = None
        self.checkpoints_dropped = 0
        self.last_checkpoint_s: float | None = None
        self._pending_switch: dict[str, Any] | None = None
        self._failovers: list[Recovery] = []  # in the current step
        self.boundary_stateful: dict[str, Any] = {}
        self._retired: list[Group] = []
        self._control = control
        self.store = connect_store(self.env.store, timeout=self.config.store_timeout)
        self.telemetry = Telemetry(None, job=self.env.job, node=self.env.node, rank=self.rank)

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def control(self) -> ControlChannel:
        assert self._control is not None
        return self._control

    def __enter__(self) -> Session:
        sink = None
        if self._control is None and self.env.broker:
            from tmd.runtime.mqtt_control import MqttControl

            mqtt = MqttControl(self.env.broker, job=self.env.job, node=self.env.node,
                               store=self.env.store)  # fmt: skip
            self._control, sink = mqtt, mqtt.publish
        elif self._control is None:
            self._control = StoreControl(
                self.env.store, job=self.env.job, poll_interval=self.config.control_poll
            )
        self.telemetry = Telemetry(
            sink, job=self.env.job, node=self.env.node, rank=self.rank,
            flush_interval=self.config.telemetry_flush, max_queue=self.config.telemetry_queue,
        )  # fmt: skip
        try:
            if self.role == "worker":
                self._join_initial_group()
            else:
                from tmd.runtime.standby import announce

                announce(self, "warming")
        except BaseException:
            self.telemetry.close()  # no __exit__ follows a failed __enter__
            self.control.close()
            raise
        return self

    def _join_initial_group(self) -> None:
        self.store.set(f"tmd/gen0/node/{self.rank}", self.env.node)
        self.group = make_group(
            self.store, "tmd/gen0/world", rank=self.rank, size=self.world_size,
            timeout=self.config.group_timeout, backend=self.env.backend, host=self.env.host,
        )  # fmt: skip
        nodes = [
            bytes(self.store.get(f"tmd/gen0/node/{r}")).decode() for r in range(self.world_size)
        ]
        self.membership = Membership(0, nodes)
        if self.config.checkpoint_dir is not None:
            self.restored_step = checkpoint.restore(self)
        self._capture_boundary()
        self.publish_status()

    def __exit__(self, *exc: object) -> None:
        if self.role == "worker" and not self.left and self.rank == 0:
            self.publish_status("stopped" if exc[0] is None else "running")
        self.telemetry.close()
        self.control.close()

    # -- the user's loop ---------------------------------------------------------------

    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices until ``total`` steps are done, this rank left, or (on a
        standby that never joined) the job stopped."""
        self._mark_step_end(time.monotonic())
        while not (self.left or self.stopped):
            if self.is_shadow and self.shadow_steps_done >= self.config.shadow_steps:
                from tmd.runtime.standby import stand_by

                stand_by(self)  # returns as a worker, or with the job stopped
                self._mark_step_end(time.monotonic())
                continue
            if self.role == "worker" and self.state.step >= total:
                return
            yield self.state.step

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Wrap data loading so telemetry can tell it from compute."""
        start = time.monotonic()
        try:
            yield
        finally:
            self.timing.data_s += time.monotonic() - start

    @property
    def is_shadow(self) -> bool:
        return self.role == "standby"

    def step(self) -> None:
        """Average gradients, update, and run the step boundary."""
        compute_end = time.monotonic()
        if self.is_shadow:
            self._shadow_step()
            return
        assert self.group is not None
        mig = self.migration
        if mig is not None:
            mig.before_reduce()
            votes = mig.votes(self.state.step + 1)
        else:
            votes = torch.zeros(2, dtype=torch.int64)
        attempt = compute_end
        while True:
            try:
                self.reducer.finish(
                    self.reducer.start(self.group, extra=[votes]),
                    self.world_size,
                    interrupted=self._member_failed,
                )
                break
            except RuntimeError as exc:
                # A member died. Recover in place, then reduce this same step again
                # on the new group from the local gradients, which are still intact
                # (and again, should a member of the new group die too). Where that
                # cannot be done, recover raises RestartRequired.
                self._failovers.append(recover(self, exc, collective_started=attempt))
                attempt = time.monotonic()
                votes = torch.zeros(2, dtype=torch.int64)
                mig = None
        reduced = time.monotonic()
        if mig is not None:
            mig.before_update(self.state, self.reducer.buffers)
        self.apply_update()
        end = time.monotonic()
        self._record(compute_end, reduced, end)
        self._boundary(votes)

    def _member_failed(self) -> bool:
        return failure_reported(self.store, self.membership.generation)

    def apply_update(self, *, step_scheduler: bool = True) -> None:
        """The optimizer's use of the averaged gradients; a lock-step joiner runs
        exactly this on the gradients the leaver forwards."""
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.state.params(), self.config.max_grad_norm)
        self.state.optimizer.step()
        if step_scheduler and self.state.scheduler is not None:
            self.state.scheduler.step()  # type: ignore[attr-defined]
        self.state.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1

    def _shadow_step(self) -> None:
        # A sandboxed iteration: the all-reduce is answered with this rank's own
        # gradients, i.e. what every replica agreeing would produce. Real tensors,
        # real kernels, no network.
        self.reducer.load(None)
        self.apply_update()
        self.shadow_steps_done += 1
        self._mark_step_end(time.monotonic())

    # -- timing ------------------------------------------------------------------------

    def _mark_step_end(self, when: float) -> None:
        self.timing.step_ends.append(when)
        self.timing.data_s = 0.0

    def _record(self, compute_end: float, reduced: float, end: float) -> None:
        start = self.timing.step_ends[-1] if self.timing.step_ends else self.created
        step_s = end - start
        if self._pending_switch is None and not self._failovers:
            self.timing.durations.append(step_s)
        data_s = self.timing.data_s
        self.last_timing = wire.StepTiming(
                step=self.state.step, end_ts=time.time(), step_s=step_s,
                compute_s=max(0.0, compute_end - start - data_s),
                allreduce_s=reduced - compute_end, optimizer_s=end - reduced, data_s=data_s,
        )  # fmt: skip
        self.telemetry.record(self.last_timing)
        self._mark_step_end(end)
        if self._pending_switch is not None:
            self._finish_switch(end)
        if self._failovers:
            self._finish_failovers(start, end)

    # -- the boundary ------------------------------------------------------------------

    def _boundary(self, votes: torch.Tensor) -> None:
        every = self.config.checkpoint_every
        if every and self.state.step % every == 0:
            # Before a switch: the members that wrote the state are the ones in it.
            started = time.monotonic()
            checkpoint.save(self)
            self.last_checkpoint_s = time.monotonic() - started
            # Step timings describe training; the write shows as the others' wait.
            self._mark_step_end(time.monotonic())
        mig = self.migration
        if mig is not None:
            if int(votes[VOTE_ABORT]) > 0:
                self._abort(mig)
            elif int(votes[VOTE_READY]) == self.world_size:
                from tmd.runtime.switch import switch

                switch(self, mig)
        for message in self.control.poll():
            self._handle(message)
        mig = self.migration
        if mig is not None:
            mig.advance(self.state, self.membership)
            if not mig.prepared_acked and mig.prepared():
                mig.prepared_acked = True
                self.ack(mig.id, "prepared")
        if self.rank == 0 and (
            self.state.step % self.config.status_every == 0 or self.control.standbys_changed()
        ):
            self.publish_status()
        self._capture_boundary()

    def _capture_boundary(self) -> None:
        # Where every stateful object stood when the next step began: what a
        # replacement needs if a rank dies inside that step.
        self.boundary_stateful = {
            name: copy.deepcopy(obj.state_dict()) for name, obj in self.state.stateful.items()
        }

    def _handle(self, message: wire.Prepare | wire.Switch | wire.Abort) -> None:
        mig = self.migration
        if isinstance(message, wire.Prepare):
            if message.migration_id in self.seen:
                # A repeat (a lost ack, a restarted controller): say where it stands.
                if mig is not None and mig.id == message.migration_id:
                    if mig.prepared_acked:
                        self.ack(mig.id, "prepared", detail="already prepared")
                elif message.migration_id in self.outcomes:
                    self._answer_repeat(message.migration_id)
                return
            self.seen.add(message.migration_id)
            if mig is not None:
                self._refuse(message.migration_id, f"busy with {mig.id}")
                return
            if (
                message.joiner in self.membership.nodes
                or message.leaver not in self.membership.nodes
            ):
                self._refuse(message.migration_id, "leaver or joiner not valid")
                return
            self.migration = Migration.start(
                message, me=self.env.node, membership=self.membership, store=self.env.store,
                timeout=self.config.group_timeout, backend=self.env.backend, host=self.env.host,
                ahead=self.config.prepare_ahead, eager_copy=self.config.eager_copy,
                joiner_timeout=self.config.joiner_timeout,
            )  # fmt: skip
            self.publish_status("migrating")
        elif mig is not None and message.migration_id == mig.id:
            if isinstance(message, wire.Switch):
                mig.switch = message
            else:
                mig.abort_reason = message.reason or "aborted by controller"
        elif message.migration_id in self.outcomes:
            self._answer_repeat(message.migration_id)

    def _answer_repeat(self, migration_id: str) -> None:
        """A repeated or late command: answer with what already happened, with the
        downtime this member measured if it switched (a controller that lost the
        first answer still learns it)."""
        outcome = self.outcomes[migration_id]
        self.ack(migration_id, outcome, detail=f"already {outcome}",
                 downtime=self.downtimes.get(migration_id))  # fmt: skip

    def _refuse(self, migration_id: str, why: str) -> None:
        self.outcomes[migration_id] = "failed"
        self.ack(migration_id, "failed", detail=why)

    def _abort(self, mig: Migration) -> None:
        mig.close(tell_joiner=mig.is_leaver)
        self.migration = None
        self.outcomes[mig.id] = "aborted"
        self.ack(mig.id, "aborted", detail=mig.abort_reason or "aborted by a member")
        self.publish_status()

    def _finish_switch(self, first_step_end: float) -> None:
        pending, self._pending_switch = self._pending_switch, None
        assert pending is not None
        median = self.timing.median_step_s()
        first_step_s = first_step_end - pending["resumed"]
        total = first_step_end - pending["last_step_end"] - median
        self.last_downtime = wire.Downtime(
            total_s=max(0.0, total),
            stop_s=max(0.0, pending.get("stop_s", 0.0)),
            transfer_s=max(0.0, pending.get("transfer_s", 0.0)),
            switch_s=max(0.0, pending.get("switch_s", 0.0)),
            first_step_s=max(0.0, first_step_s - median),
        )
        self.downtimes[pending["migration_id"]] = self.last_downtime
        self.ack(pending["migration_id"], "switched", downtime=self.last_downtime)

    def _finish_failovers(self, step_start: float, step_end: float) -> None:
        # The failed step against a median one: what the failure cost the job, from
        # the start of the step whose collective failed to the end of its re-run.
        failovers, self._failovers = self._failovers, []
        median = self.timing.median_step_s()
        for rec in failovers:
            self.last_downtime = wire.Downtime(
                total_s=max(0.0, step_end - step_start - median),
                stop_s=rec.detect_s,
                transfer_s=rec.transfer_s,
                switch_s=rec.build_s,
                first_step_s=max(0.0, step_end - rec.resumed),
            )
            if rec.is_donor:
                self.outcomes[rec.id] = "switched"
                self.downtimes[rec.id] = self.last_downtime
                self.ack(rec.id, "switched", downtime=self.last_downtime,
                         detail=f"rank {rec.dead} replaced by {rec.joiner}")  # fmt: skip

    # -- outbound ----------------------------------------------------------------------

    def ack(self, migration_id: str, kind: AckKind, **fields: Any) -> None:
        if "detail" in fields:  # the wire bounds free text; an error message can be long
            fields["detail"] = str(fields["detail"])[:1000]
        self.control.ack(
            wire.Ack(
                ts=time.time(), job=self.env.job, migration_id=migration_id, kind=kind,
                node=self.env.node, rank=self.rank if self.role == "worker" else None,
                generation=self.membership.generation, at_step=self.state.step, **fields,
            )
        )  # fmt: skip

    def publish_status(self, state: str = "running") -> None:
        if self.migration is not None and state == "running":
            state = "migrating"
        self.control.publish_status(
            wire.JobStatus(
                ts=time.time(), job=self.env.job, generation=self.membership.generation,
                world_size=self.world_size, members=self.membership.members(),
                state=state, step=self.state.step,  # type: ignore[arg-type]
            )
        )  # fmt: skip


def session(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    **kwargs: Any,
) -> Session:
    """``with tmd.runtime.session(model, optimizer, ...) as s:`` (see ``Session``)."""
    return Session(model, optimizer, **kwargs)
