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

A model wrapped by torch's own parallelism (``fully_shard``, HSDP, tensor
parallelism on a mesh, DDP) is trained the same way, once
``tmd.runtime.parallel.init()`` made the groups beneath it swappable; its standby's
shadow iterations run once it knows the rank it takes, their collectives answered
locally. Its gradients are reduced inside the user's backward, so a member lost
mid-step cannot be made good inside ``step``: the wrapper's collectives go through a
guard (``swap_group.Guard``) that records the failure instead of raising it, ``step``
replaces the lost machine from replicas (DDP, HSDP) and returns False, and the loop
runs the same step again on the new groups, every stateful object and RNG stream
as they were at its start. Where no survivor holds a lost rank's shards (FSDP2 on
one mesh dimension, tensor parallelism), the job rolls back to its checkpoint.

Every change of group goes through one call, ``Session.reconfigure``, with a
``Reconfiguration`` (``tmd.runtime.membership``): the first group at start, a switch
(``tmd.runtime.switch``), a join (``tmd.runtime.standby``) and a failover
(``tmd.runtime.failover``). Those modules run their protocol and return the record;
none of them writes the session's state.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Literal, NoReturn

import torch

from tmd import wire
from tmd.errors import ConfigError, MigrationError, RestartRequired, TmdError
from tmd.runtime import checkpoint, liveness, parallel, standby, swap_group
from tmd.runtime.commands import AckKind, Commands
from tmd.runtime.control import ControlChannel, open_control
from tmd.runtime.env import RuntimeEnv
from tmd.runtime.failover import (
    Recovery,
    Replaced,
    failure_reported,
    give_up,
    recover,
    report_failure,
    running_elsewhere,
    settle_drain,
    wrapped_failure,
)
from tmd.runtime.group import Group, connect_store, make_group
from tmd.runtime.membership import Membership, Reconfiguration
from tmd.runtime.migration import VOTE_RESTART, no_votes
from tmd.runtime.reducer import GradientReducer, PeerLost, wait_interruptible
from tmd.runtime.session_config import SessionConfig
from tmd.runtime.state import (
    Stateful,
    TrainState,
    bucket_layout,
    can_rebuild_ddp_buckets,
    ddp_warmup_steps,
    is_dtensor,
    rebuild_ddp_buckets,
    replicas,
    rng_state,
    set_rng_state,
)
from tmd.runtime.telemetry import Telemetry
from tmd.runtime.timing import PendingSwitch, StepTimes


def _trim_heap() -> None:
    """Give the memory a switch freed back to the system (glibc's ``malloc_trim``).
    The migration's transfer and group threads allocate in glibc arenas of their own,
    which keep what they freed: without this, a stayer's resident memory grows by a
    few percent with every migration it takes part in. Elsewhere, nothing."""
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim(0)


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
        self.wrapped = _wrapped(model, self.state)
        """The model is wrapped by torch's parallelism on groups tmd swaps
        (``tmd.runtime.parallel``): the wrapper reduces the gradients, not the session."""
        self.reducer: GradientReducer | None = None
        if not self.wrapped:
            self.reducer = GradientReducer(self.state.params(),
                                           bucket_bytes=self.config.bucket_bytes)  # fmt: skip
        self.world_size = self.env.world_size
        self.created = time.monotonic()
        # Where this process stands in the job: written by ``reconfigure`` alone.
        self._role = self.env.role
        self._rank = self.env.rank
        self._group: Group | None = None
        self._membership = Membership(0, ())
        self._retired: list[Group] = []  # a switch's old groups, until it is done
        self._failed: list[Group] = []
        """Groups left by a failover, kept for the job's life: the failed step's
        abandoned collectives may still be queued on them, and freeing a gloo group
        waits for its queue (until the group's timeout)."""
        self.commands = Commands(self)
        self.stopped = False
        self.shadow_steps_done = 0
        # A DDP joiner must have rebuilt its buckets, as the job has, before it joins.
        self._shadow_target = max(self.config.shadow_steps, ddp_warmup_steps(model))
        self._rebuild_after_shadow = False
        """A failover's DDP joiner rebuilds its buckets after its one shadow iteration
        rather than in a second one (they are on the job's critical path)."""
        self.timing = StepTimes()
        self.warmup_s: float | None = None
        self.last_downtime: wire.Downtime | None = None
        self.last_timing: wire.StepTiming | None = None
        self.restored_step: int | None = None
        self.checkpoints_dropped = 0
        self.last_checkpoint_s: float | None = None
        self._pending_switch: PendingSwitch | None = None
        self._failovers: list[Recovery] = []  # in the current step
        self.boundary_stateful: dict[str, Any] = {}
        self.boundary_rng: dict[str, Any] | None = None
        """The RNG streams at the start of the step (a wrapped job's, which a failover
        makes every survivor run again)."""
        self._guard: swap_group.Guard | None = None  # a wrapped worker's
        self._replicas: list[frozenset[int]] | None = None
        self._layout: dict[str, Any] | None = None
        self._boundary_buffers: dict[str, torch.Tensor] = {}
        self.excluded: list[str] = []
        """Machines a ``Restart`` asked this job to go on without (in its status)."""
        self._control = control
        self._place = parallel.take_place() if self.wrapped and self._role == "standby" else None
        if self.wrapped:  # at exit, before the interpreter's teardown (swap_group.release)
            swap_group.on_release(_letting_go(weakref.ref(self)))
        self._presence: liveness.Presence | None = None  # a worker's, once it is one
        self.store = connect_store(self.env.store, timeout=self.config.store_timeout)
        self.telemetry = Telemetry(None, job=self.env.job, node=self.env.node, rank=self.rank)

    # -- where this process stands -----------------------------------------------------

    @property
    def role(self) -> Literal["worker", "standby"]:
        return self._role

    @property
    def rank(self) -> int:
        """This process's rank; it changes when a standby becomes a worker."""
        return self._rank

    @property
    def group(self) -> Group | None:
        return self._group

    @property
    def membership(self) -> Membership:
        return self._membership

    @property
    def left(self) -> bool:
        """This rank was migrated away: its process is out of the job."""
        return self.commands.left

    def reconfigure(self, change: Reconfiguration) -> None:
        """Make this process the member ``change`` describes. The one way the group,
        membership, rank and role change: at start, at a switch (stayers and joiner)
        and at a failover (survivors and the standby taking over)."""
        if change.inner is not None:  # first: where it raises, nothing has changed
            old = swap_group.bind_inner(change.group, change.inner, self.store)
            (self._retired if change.switch is not None else self._failed).extend(old)
        if self._guard is not None and self._guard.generation != change.membership.generation:
            # A switch (a failover moved the guard already), before Presence follows:
            # failures are counted, and collectives numbered, per generation.
            self._guard.advance(change.membership.generation)
        if self._group is not None:
            # A switch's old group is kept until the first step on the new group has
            # ended (``_ack_downtimes``): its confirmation may still be in flight in
            # another member until then.
            (self._retired if change.switch is not None else self._failed).append(self._group)
            liveness.wake(self.store, self._membership.generation)  # Presence moves on
        self._group = change.group
        self._membership = change.membership
        self._rank = change.rank
        self._role = "worker"
        if change.median_step_s is not None:
            self.timing.inherit(change.median_step_s)
        self.telemetry.set_rank(self._rank, self._membership.generation)
        if self.wrapped and self._guard is None:
            report_store = connect_store(self.env.store, timeout=self.config.store_timeout)
            self._guard = swap_group.Guard(
                lambda _, generation: report_failure(report_store, generation),
                self._membership.generation,
            )
            swap_group.guard_with(self._guard)
        if self._presence is None:
            self._presence = liveness.Presence(
                self.env.store, lambda: (self._membership.generation, self._rank),
                failure_reported, self._failure_elsewhere,
            )  # fmt: skip
        if change.switch is not None:
            self._pending_switch = change.switch
            self.timing.mark_step_end(change.switch.resumed)

    def _failure_elsewhere(self, generation: int) -> None:
        """A member of ``generation`` reported a failed collective (``Presence``'s
        thread): a wrapped worker's collectives stop waiting for the lost."""
        if self._guard is not None:  # it ignores a generation it has left
            self._guard.fail(PeerLost(f"a member of generation {generation} reported a "
                                      "failed collective"), generation, report=False)  # fmt: skip

    @property
    def replicas(self) -> list[frozenset[int]]:
        """For each rank, the ranks that hold what it holds (``state.replicas``)."""
        if self._replicas is None:
            self._replicas = replicas(self.state.model, self.state.params(), self.world_size,
                                      wrapped=self.wrapped)  # fmt: skip
        return self._replicas

    def bucket_layout(self) -> dict[str, Any] | None:
        """A DDP model's bucket layout (``state.bucket_layout``), read again only until
        it is final (each read allocates a zero copy of the gradients)."""
        if self._layout is None or not self._layout["final"]:
            self._layout = bucket_layout(self.state.model)
        return self._layout

    # -- lifecycle ---------------------------------------------------------------------

    @property
    def control(self) -> ControlChannel:
        assert self._control is not None
        return self._control

    def __enter__(self) -> Session:
        sink = None
        if self._place is not None:  # a standby of a wrapped job: its channel is open
            self._control, sink = self._place.control, self._place.sink
        elif self._control is None:
            self._control, sink = open_control(self.env, self.config)
        self.telemetry = Telemetry(
            sink, job=self.env.job, node=self.env.node, rank=self.rank,
            run=self.env.restart_count, flush_interval=self.config.telemetry_flush,
            max_queue=self.config.telemetry_queue,
        )  # fmt: skip
        try:
            if self.role == "worker":
                self._join_initial_group()
            elif self._place is not None:  # ready and prepared for a rank (parallel.init)
                self.warmup_s = self._place.warmup_s
                for mid in self._place.seen:
                    self.commands.first_seen(mid)
                # The job stopped first, or no migration or failover named it.
                self.stopped = self._place.prepared is None and self._place.failover is None
                if self._place.failover is not None:
                    # A DDP joiner rebuilds its buckets as the job has (after one
                    # iteration where it can); nothing else needs a shadow iteration
                    # before it takes the lost rank's state.
                    self._rebuild_after_shadow = can_rebuild_ddp_buckets(self.state.model)
                    self._shadow_target = (
                        1 if self._rebuild_after_shadow else ddp_warmup_steps(self.state.model)
                    )
                    parallel.start_failover(self)
                elif not self.stopped:
                    parallel.start_groups(self, self._place)
            elif self.wrapped:
                raise ConfigError("TMD_ROLE", "a standby of a job wrapped by torch's "
                                  "parallelism must call tmd.runtime.parallel.init() "
                                  "before it builds its mesh")  # fmt: skip
            else:
                standby.announce(self, "warming")
        except BaseException:
            self.telemetry.close()  # no __exit__ follows a failed __enter__
            self.control.close()
            raise
        return self

    def _join_initial_group(self) -> None:
        self.store.set(f"tmd/gen0/node/{self.rank}", f"{self.env.local_rank} {self.env.node}")
        cfg, env = self.config, self.env
        group = make_group(
            self.store, "tmd/gen0/world", rank=self.rank, size=self.world_size,
            timeout=cfg.group_timeout, backend=env.backend, host=env.host,
        )  # fmt: skip
        inner = None
        if self.wrapped:
            inner = swap_group.build_inner(self.store, "tmd/gen0", timeout=cfg.group_timeout,
                                           backend=env.backend, host=env.host)  # fmt: skip
        slots = [
            bytes(self.store.get(f"tmd/gen0/node/{r}")).decode().split(" ", 1)
            for r in range(self.world_size)
        ]
        nodes = tuple(node for _, node in slots)
        local_ranks = tuple(int(local) for local, _ in slots)
        try:
            membership = Membership(0, nodes, local_ranks)
        except MigrationError as exc:  # two processes claim one slot
            raise ConfigError(
                "LOCAL_RANK", f"{exc} (or TMD_NODE: two hosts with one name)"
            ) from None
        self.reconfigure(Reconfiguration(group, membership, rank=self.rank, inner=inner))
        if self.config.checkpoint_dir is not None:
            self.restored_step = checkpoint.restore(self)
        self.capture_boundary()
        self.publish_status()

    def __exit__(self, *exc: object) -> None:
        try:
            error = exc[1]
            if self._guard is not None:
                self._guard.armed = False
            if self._place is not None:  # a wrapped standby that did not join
                place, self._place = self._place, None
                if error is None:  # the job stopped first
                    place.close()
                else:
                    parallel.abandon(self, place, f"the standby's loop raised: {error!r}")
            if (
                self.wrapped and self.role == "worker" and not self.left
                and isinstance(error, RuntimeError) and not isinstance(error, TmdError)
            ):  # fmt: skip
                # A wrapped model's collective failed outside the guarded part of a
                # step (a checkpoint's, the script's own between steps): a lost member
                # is recognised here, and the job rolls back.
                self.commands.drop()
                wrapped_failure(self, error)
            if self.role == "worker" and not self.left and self.rank == 0:
                state = "stopped" if exc[0] is None else "running"
                self.publish_status("restarting" if self.excluded else state)
        finally:
            self._close()

    def _let_go(self) -> None:
        """At the process's exit: drop every group this session holds."""
        if (mig := self.commands.current) is not None:  # its groups and channel
            self.commands.current = None
            mig.close(tell_joiner=False)  # a joiner learns it from the closed channel
        if self._place is not None:  # a wrapped standby's builds
            self._place.close()
            self._place = None
        self._retired.clear()
        self._failed.clear()
        self._group = None

    def _close(self) -> None:
        if self._guard is not None and swap_group._guard is self._guard:
            swap_group.guard_with(None)
        self.telemetry.close()
        self.control.close()
        if self._presence is not None:
            self._presence.close()
            with contextlib.suppress(RuntimeError):  # let its thread go before the store
                liveness.wake(self.store, self._membership.generation)
            self._presence.join(timedelta(seconds=5))

    # -- the user's loop ---------------------------------------------------------------

    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices until ``total`` steps are done, this rank left, or (on a
        standby that never joined) the job stopped."""
        self.timing.mark_step_end(time.monotonic())
        while not (self.left or self.stopped):
            warm = self.shadow_steps_done >= self._shadow_target
            if self._place is not None and warm:  # a wrapped standby, prepared for a rank
                place, self._place = self._place, None
                joined = parallel.finish_join(self, place)
                if joined is None:
                    self.stopped = True  # it cannot serve another rank
                else:
                    self.reconfigure(joined)
                self.timing.mark_step_end(time.monotonic())
                continue
            if self.is_shadow and self._place is None and warm:
                self.warmup_s = time.monotonic() - self.created
                joined = standby.stand_by(self)  # this process's place, or the job stopped
                if joined is None:
                    self.stopped = True
                else:
                    self.reconfigure(joined)
                self.timing.mark_step_end(time.monotonic())
                continue
            if self.role == "worker" and self.state.step >= total:
                return
            guard = self._guard
            if guard is not None:
                guard.armed = True  # until step() has clipped
            try:
                yield self.state.step
            finally:
                if guard is not None:
                    guard.armed = False
            if guard is not None and guard.error is not None and not self.left:
                # The loop went on without step() (a skipped batch): the failure its
                # collectives met is handled here, and the step runs again.
                self._fail_over(guard.error, guard.failed_at)

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

    def step(self) -> bool:
        """Average gradients, update, and run the step boundary. False where the step
        was not applied: this process left the job (its machine was replaced), or (a
        wrapped job) a failover undid the step, which the loop then runs again at the
        same index, every stateful object and RNG stream as they were at its start."""
        compute_end = time.monotonic()
        if self.is_shadow:
            self._shadow_step()
            return True
        if self.reducer is None:
            return self._wrapped_step(compute_end)
        mig = self.commands.current
        if mig is not None:
            mig.before_reduce()
            votes = mig.votes(self.state.step + 1)
        else:
            votes = no_votes()
        votes[VOTE_RESTART] = int(self.commands.restart_asked)
        attempt = compute_end
        while True:
            assert self.group is not None
            try:
                self.reducer.finish(
                    self.reducer.start(self.group, extra=[votes]),
                    self.world_size,
                    interrupted=self.member_failed,
                )
                break
            except RuntimeError as exc:
                # A member died. Recover in place, then reduce this same step again
                # on the new group from the local gradients, which are still intact
                # (and again, should a member of the new group die too). Where that
                # cannot be done, recover raises RestartRequired.
                self.commands.drop()
                try:
                    recovery = recover(self, exc, collective_started=attempt)
                except Replaced:
                    # This process's machine was counted lost and replaced: it is out
                    # of the job, like a leaver after a switch.
                    self.commands.left = True
                    return False
                self.reconfigure(recovery.change)
                self.publish_status()
                self._failovers.append(recovery)
                attempt = time.monotonic()
                votes = no_votes()
                votes[VOTE_RESTART] = int(self.commands.restart_asked)
                mig = None
        reduced = time.monotonic()
        if mig is not None:
            mig.before_update(self.state, self.reducer.buffers)
        self.apply_update()
        end = time.monotonic()
        self._record(compute_end, reduced, end)
        self._boundary(votes)
        return True

    def _wrapped_step(self, compute_end: float) -> bool:
        """A wrapped model's step: its gradients were reduced during backward, through
        the guard; clipping (the whole job's norm: collectives too), the votes through
        one all-reduce on tmd's group, then the update. A failure seen by the guard
        or in the votes replaces the lost machines and undoes the step."""
        guard = self._guard
        assert guard is not None and self.group is not None
        mig = self.commands.current
        votes = no_votes() if mig is None else mig.votes(self.state.step + 1)
        votes[VOTE_RESTART] = int(self.commands.restart_asked)
        failure, failed_at = guard.error, guard.failed_at
        if failure is None:
            self.clip()
            failure, failed_at = guard.error, guard.failed_at
        guard.armed = False
        if failure is None:
            # Every member's vote in, or none applies the step: a member lost after it
            # voted was lost after its step, and the next step finds it gone.
            try:
                wait_interruptible(self.group.allreduce([votes]), self.member_failed)
            except RuntimeError as exc:
                failure, failed_at = exc, compute_end
        if failure is not None:
            return self._fail_over(failure, failed_at)
        reduced = time.monotonic()
        if mig is not None:
            mig.before_update(self.state, None)  # the clipped gradients, as applied
        self.apply_update(clip=False)
        end = time.monotonic()
        self._record(compute_end, reduced, end)
        self._boundary(votes)
        return True

    def _fail_over(self, failure: BaseException, failed_at: float) -> bool:
        """A wrapped worker's step failed: replace the lost machines in place
        (``failover.recover``; it raises ``RestartRequired`` where it cannot) and undo
        the step, to run it again on the next generation's groups."""
        guard = self._guard
        assert guard is not None
        self.commands.drop()
        self._restore_buffers()  # before a donor sends them: the step's start
        try:
            recovery = recover(self, failure, collective_started=failed_at)
        except Replaced:  # this process's machine was counted lost: out of the job
            self.commands.left = True
            return False
        # The guard first: a failure of the new generation reported as soon as
        # Presence follows it (in reconfigure) must count.
        guard.reset(recovery.change.membership.generation)
        self.reconfigure(recovery.change)
        # The failed step's collectives may still run on the old groups, on tensors
        # the wrapper uses again (DDP's buckets): the step runs again only once, on
        # every survivor, each has ended or waits for data no member will send (it
        # would end only at the group timeout: ``running_elsewhere``).
        drained = guard.drain(self.config.group_timeout, running_elsewhere(self, recovery))
        if not settle_drain(self, recovery, drained):
            give_up(self, recovery.id, "the failed step's collectives did not end within "
                    f"the group timeout ({self.config.group_timeout}) on every survivor",
                    failure)  # fmt: skip
        self.publish_status()
        self._failovers.append(recovery)
        self.state.optimizer.zero_grad(set_to_none=True)
        for name, obj in self.state.stateful.items():
            obj.load_state_dict(copy.deepcopy(self.boundary_stateful[name]))
        if self.boundary_rng is not None:
            set_rng_state(self.boundary_rng)
        return False

    def _restore_buffers(self) -> None:
        """Put the model's buffers back as the step found them (by name; a buffer made
        during the step, or reshaped, stays as it is)."""
        with torch.no_grad():
            for name, buffer in self.state.model.named_buffers():
                kept = self._boundary_buffers.get(name)
                if kept is not None and kept.shape == buffer.shape and kept.dtype == buffer.dtype:
                    buffer.copy_(kept)

    def member_failed(self) -> bool:
        """Has a member of the current generation reported a failed collective?"""
        return failure_reported(self.store, self.membership.generation)

    def clip(self) -> None:
        if self.config.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.state.params(), self.config.max_grad_norm)

    def apply_update(self, *, step_scheduler: bool = True, clip: bool = True) -> None:
        """The optimizer's use of the averaged gradients; a lock-step joiner runs
        exactly this on the gradients the leaver forwards (already clipped where the
        model is wrapped: clipping a sharded gradient takes the whole job's norm)."""
        if clip:
            self.clip()
        self.state.optimizer.step()
        if step_scheduler and self.state.scheduler is not None:
            self.state.scheduler.step()  # type: ignore[attr-defined]
        self.state.optimizer.zero_grad(set_to_none=True)
        self.state.step += 1

    def _shadow_step(self) -> None:
        # A sandboxed iteration: the all-reduce is answered with this rank's own
        # gradients, i.e. what every replica agreeing would produce (a wrapped model's
        # collectives ran on swap_group.Loopback). Real tensors, real kernels, no
        # network.
        if self.reducer is not None:
            self.reducer.load(None)
        self.apply_update()
        self.shadow_steps_done += 1
        if self._rebuild_after_shadow and self.shadow_steps_done >= self._shadow_target:
            self._rebuild_after_shadow = False
            if not rebuild_ddp_buckets(self.state.model):
                self._shadow_target = ddp_warmup_steps(self.state.model)  # as a forward does
        self.timing.mark_step_end(time.monotonic())

    # -- timing ------------------------------------------------------------------------

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
        self.timing.mark_step_end(end)
        if self._pending_switch is not None or self._failovers:
            self._ack_downtimes(start, end)

    def _ack_downtimes(self, step_start: float, step_end: float) -> None:
        # The first step after a switch or failover has ended: its downtime is known.
        median = self.timing.median_step_s()
        pending, self._pending_switch = self._pending_switch, None
        if pending is not None:
            # Every member ran a collective on the new group, so none is still in
            # the switch's confirmation on the old ones: let them go (buffers, threads).
            self._retired.clear()
            _trim_heap()
            self.last_downtime = pending.downtime(step_end, median)
            self.commands.measured(pending.migration_id, self.last_downtime)
        failovers, self._failovers = self._failovers, []
        for rec in failovers:
            self.last_downtime = rec.downtime(step_start, step_end, median)
            if rec.reports:
                self.commands.settle(rec.id, "switched", downtime=self.last_downtime,
                                     detail=rec.describe())  # fmt: skip

    # -- the boundary ------------------------------------------------------------------

    def _boundary(self, votes: torch.Tensor) -> None:
        every = self.config.checkpoint_every
        saved = bool(every and self.state.step % every == 0)
        if saved:
            # Before a switch: the members that wrote the state are the ones in it.
            self._checkpoint()
        if int(votes[VOTE_RESTART]) > 0:
            self._restart(saved)
        self.commands.boundary(votes)
        if self.rank == 0 and (
            self.state.step % self.config.status_every == 0 or self.control.standbys_changed()
        ):
            self.publish_status()
        self.capture_boundary()

    def _checkpoint(self) -> None:
        started = time.monotonic()
        if checkpoint.save(self) is None and self.rank == 0:
            self.checkpoints_dropped += 1
        self.last_checkpoint_s = time.monotonic() - started
        # Step timings describe training; the write shows as the others' wait.
        self.timing.mark_step_end(time.monotonic())

    def _restart(self, saved: bool) -> NoReturn:
        """Every member, at the boundary where a member's ``Restart`` was counted: a
        checkpoint at this step (unless one was just written), the machine to leave out
        recorded in the job's status, and out of the loop with ``RestartRequired``, for
        the launcher to start the job again without that machine."""
        order = self.commands.end_for_restart()
        if not saved:
            self._checkpoint()
        step = checkpoint.agreed_latest(self)
        self.excluded = [order.node]
        if self.rank == 0:
            self.publish_status("restarting")
            detail = f"checkpoint at step {step}; the job restarts without {order.node}"
            self.commands.settle(order.migration_id, "restarting", detail=detail)
        why = f"asked to restart without {order.node}" + (
            f": {order.reason}" if order.reason else ""
        )
        raise RestartRequired(why, checkpoint_step=step)

    def capture_boundary(self) -> None:
        """Record where every stateful object stood when the next step began: what a
        replacement needs if a rank dies inside that step."""
        self.boundary_stateful = {
            name: copy.deepcopy(obj.state_dict()) for name, obj in self.state.stateful.items()
        }
        if self.wrapped:  # what a failover's redo of the next step starts from
            self.boundary_rng = rng_state()
            kept, self._boundary_buffers = self._boundary_buffers, {}
            with torch.no_grad():
                for name, buffer in self.state.model.named_buffers():
                    copy_ = kept.get(name)
                    if copy_ is None or copy_.shape != buffer.shape or copy_.dtype != buffer.dtype:
                        copy_ = buffer.detach().clone()
                    else:
                        copy_.copy_(buffer)
                    self._boundary_buffers[name] = copy_

    # -- outbound ----------------------------------------------------------------------

    def ack(
        self,
        migration_id: str,
        kind: AckKind,
        *,
        detail: str = "",
        downtime: wire.Downtime | None = None,
    ) -> None:
        self.control.ack(
            wire.Ack(
                ts=time.time(), job=self.env.job, migration_id=migration_id, kind=kind,
                node=self.env.node, rank=self.rank if self.role == "worker" else None,
                local_rank=self.env.local_rank,
                generation=self.membership.generation, at_step=self.state.step,
                downtime=downtime,
                detail=detail[:1000],  # the wire bounds free text; an error can be long
            )
        )  # fmt: skip

    def publish_status(self, state: str = "running") -> None:
        if self.commands.current is not None and state == "running":
            state = "migrating"
        self.control.publish_status(
            wire.JobStatus(
                ts=time.time(), job=self.env.job, generation=self.membership.generation,
                world_size=self.world_size, members=self.membership.members(),
                state=state, step=self.state.step, excluded=self.excluded,  # type: ignore[arg-type]
                run=self.env.restart_count,
            )
        )  # fmt: skip


def _letting_go(session: weakref.ref[Session]) -> Callable[[], None]:
    def let_go() -> None:
        if (s := session()) is not None:
            s._let_go()

    return let_go


def _wrapped(model: torch.nn.Module, state: TrainState, installed: bool | None = None) -> bool:
    """Is ``model`` wrapped by torch's parallelism on tmd's swappable groups
    (``installed``: ``tmd.runtime.parallel.init()`` ran)? Raises where it is wrapped
    in a way tmd cannot move, or where nobody would average its gradients."""
    if installed is None:
        installed = swap_group.installed()
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        if not isinstance(model.process_group, swap_group.SwappableGroup):
            raise ConfigError("model", "DistributedDataParallel on a process group tmd "
                              "cannot swap: call tmd.runtime.parallel.init() instead of "
                              "init_process_group() and build it with init_sync=False, or "
                              "pass the module itself and let the session average the "
                              "gradients")  # fmt: skip
        return True
    sharded = any(is_dtensor(p) for p in state.params())
    if sharded and not installed:
        raise ConfigError("model", "its parameters are DTensors (fully_shard or tensor "
                          "parallelism) on groups tmd cannot swap: call "
                          "tmd.runtime.parallel.init() before init_device_mesh")  # fmt: skip
    if installed and not sharded:
        # The session leaves the gradients to the wrapper: a model no wrapper holds
        # would train every replica on its own gradients, silently apart.
        raise ConfigError("model", "tmd.runtime.parallel.init() ran but no parameter is a "
                          "DTensor and the model is not DistributedDataParallel: wrap it "
                          "(fully_shard, parallelize_module, DDP), or leave "
                          "parallel.init() out and let the session average the "
                          "gradients")  # fmt: skip
    return installed


def session(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    **kwargs: Any,
) -> Session:
    """``with tmd.runtime.session(model, optimizer, ...) as s:`` (see ``Session``)."""
    return Session(model, optimizer, **kwargs)
