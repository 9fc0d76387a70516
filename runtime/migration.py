"""One planned migration as a member of the running job sees it (leaver or stayer).

Everything here runs at step boundaries or inside the session's step, on the
training thread, and never blocks on the joiner: groups are built by background
threads and transfers are asynchronous.

Agreement without extra round-trips: every step's gradient all-reduce carries a
three-integer vote ``[ready, abort, restart]``. All members see the same sums at the
same boundary, so they all switch (``ready == world``) or all abort (``abort > 0``)
at the same step, whatever order the commands reached them in; ``restart > 0``: a
member holds a ``Restart`` command, and every member checkpoints and exits
(``tmd.runtime.commands``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import Store

from tmd import wire
from tmd.errors import MigrationError
from tmd.runtime import swap_group
from tmd.runtime.env import slot_name
from tmd.runtime.group import Group, GroupBuilder, StoreAddress
from tmd.runtime.liveness import PeerWatch
from tmd.runtime.membership import Membership
from tmd.runtime.state import TrainState, bucket_layout
from tmd.runtime.transfer import Kind, TransferChannel

VOTE_READY = 0
VOTE_ABORT = 1
VOTE_RESTART = 2
VOTES = 3


def no_votes() -> torch.Tensor:
    return torch.zeros(VOTES, dtype=torch.int64)


def world_prefix(migration_id: str) -> str:
    return f"tmd/mig/{migration_id}/world"


def groups_key(migration_id: str) -> str:
    """Counted up by each joining process of a wrapped job once its mesh exists: the
    stayers start building the inner groups once every slot has (a machine of K slots
    counts to K)."""
    return f"tmd/mig/{migration_id}/groups"


def reading_key(migration_id: str) -> str:
    """Counted up by each joining process of a wrapped job once it reads the transfer
    channel (after its shadow iterations): the leaver sends it nothing before."""
    return f"tmd/mig/{migration_id}/reading"


def xfer_prefix(migration_id: str, local_rank: int) -> str:
    """The channel between the leaver's and the joiner's processes of ``local_rank``."""
    return f"tmd/mig/{migration_id}/xfer/{local_rank}"


@dataclass
class Migration:
    """A member's view of one migration, from ``prepare`` to switch or abort.

    With ``ahead`` (the live protocol) the next group and the transfer channel are
    built in the background as soon as ``prepare`` arrives; the bulk state follows,
    also in the background, once a switch is requested (or at once with
    ``eager_copy``), and from then on the joiner is kept in lock-step. Holding a
    prepared migration therefore costs the job nothing. Without ``ahead`` (the
    cold-standby baseline) nothing happens until the switch, which then builds and
    sends everything while the job waits.
    """

    prepare: wire.Prepare
    leaver_ranks: tuple[int, ...]
    """Every rank of the leaving machine, by local rank."""
    is_leaver: bool
    my_rank: int
    local_rank: int
    """This process's local rank: a leaver's pairs with the joiner's slot of the same."""
    world_size: int
    store: StoreAddress
    timeout: timedelta
    backend: str
    host: str
    ahead: bool = True
    eager_copy: bool = False
    wrapped: Store | None = None
    """A job wrapped by torch's parallelism (``tmd.runtime.parallel``): the job's store,
    where the joiner says when the inner groups can be built. A stayer then builds
    them beside the next group."""
    builder: GroupBuilder | None = None
    inner: dict[str, GroupBuilder] | None = None
    watch: PeerWatch | None = None
    started: float = field(default_factory=time.monotonic)
    channel: TransferChannel | None = None
    snapshot_step: int | None = None  # set once the bulk state is on its way
    snapshot_flushed: bool = False
    layout: dict[str, Any] | None = None
    """The leaver's DDP bucket layout (``state.bucket_layout``), sent with the switch."""
    switch: wire.Switch | None = None
    abort_reason: str | None = None
    prepared_acked: bool = False

    @property
    def id(self) -> str:
        return self.prepare.migration_id

    @classmethod
    def start(
        cls,
        prepare: wire.Prepare,
        *,
        rank: int,
        membership: Membership,
        store: StoreAddress,
        timeout: timedelta,
        backend: str,
        host: str,
        ahead: bool = True,
        eager_copy: bool = False,
        joiner_timeout: timedelta = timedelta(seconds=5),
        wrapped: Store | None = None,
    ) -> Migration:
        mig = cls(
            prepare=prepare,
            leaver_ranks=membership.ranks_of(prepare.leaver),
            is_leaver=membership.nodes[rank] == prepare.leaver,
            my_rank=rank,
            local_rank=membership.local_rank(rank),
            world_size=len(membership.nodes),
            store=store,
            timeout=timeout,
            backend=backend,
            host=host,
            ahead=ahead,
            eager_copy=eager_copy,
            wrapped=wrapped,
        )
        if ahead:
            mig._start_build()
            if mig.is_leaver:
                joiner = slot_name(prepare.joiner, mig.local_rank)
                mig.watch = PeerWatch(store, joiner, stale_after=joiner_timeout,
                                      interval=joiner_timeout / 10)  # fmt: skip
        return mig

    def _start_build(self) -> GroupBuilder:
        if self.is_leaver:
            # The leaver's only new link is to the joiner; it is rank 0 of the pair.
            # Always gloo: a CPU pair needs no second GPU communicator on the leaver.
            self.builder = GroupBuilder(
                self.store,
                xfer_prefix(self.id, self.local_rank),
                rank=0,
                size=2,
                timeout=self.timeout,
                backend="gloo",
                host=self.host,
            )
        else:
            self.builder = GroupBuilder(self.store, world_prefix(self.id), rank=self.my_rank,
                                        size=self.world_size, timeout=self.timeout,
                                        backend=self.backend, host=self.host)  # fmt: skip
        return self.builder

    def _start_inner(self) -> dict[str, GroupBuilder]:
        self.inner = swap_group.start_inner(self.store, world_prefix(self.id),
                                            timeout=self.timeout, backend=self.backend,
                                            host=self.host)  # fmt: skip
        return self.inner

    def _every_slot(self, key: str) -> bool:
        assert self.wrapped is not None
        slots = len(self.leaver_ranks)
        return bool(self.wrapped.check([key])) and int(self.wrapped.add(key, 0)) >= slots

    def joiner_ready(self) -> bool:
        """Every joining process reads the channel (a joiner of a wrapped job builds
        its model only once it knows its rank, then runs its shadow iterations; until
        it reads, a message sent to it would hold the sender)."""
        return self.wrapped is None or self._every_slot(reading_key(self.id))

    def _inner_pending(self) -> bool:
        """A stayer of a wrapped job whose inner groups are not all built yet (starting
        their build once the joiner is ready for it); records a failed build."""
        if self.wrapped is None or self.is_leaver:
            return False
        if self.inner is None:
            if not self._every_slot(groups_key(self.id)):
                return True
            self._start_inner()
        assert self.inner is not None
        for builder in self.inner.values():
            if builder.failed():
                self.abort_reason = f"group build failed: {builder.error}"
        return not all(b.done() for b in self.inner.values())

    # -- progress at boundaries --------------------------------------------------------

    def advance(self, state: TrainState, membership: Membership) -> None:
        """Move preparation forward without waiting; records failures as an abort."""
        builder = self.builder
        if self.abort_reason is not None or builder is None:
            return
        if time.monotonic() - self.started > self.prepare.deadline_s and not self.prepared():
            self.abort_reason = "prepare deadline passed"
            return
        if builder.failed():
            self.abort_reason = f"group build failed: {builder.error}"
            return
        if self.ahead and builder.done():
            self._inner_pending()
        if not self.is_leaver or not builder.done():
            return
        if self.watch is not None and self.watch.lost():
            self.abort_reason = f"the joiner {self.prepare.joiner} stopped beating"
            return
        try:
            if self.channel is None:
                self._open_channel(state, membership)
            elif (
                self.snapshot_step is None
                and (self.eager_copy or self.switch is not None)
                and self.joiner_ready()
            ):
                self._send_snapshot(state)
        except MigrationError as exc:
            self.abort_reason = str(exc)

    def finish_preparation(self, state: TrainState, membership: Membership) -> None:
        """At the switch: whatever was not prepared ahead is done now, blocking."""
        builder = self.builder or self._start_build()
        builders = [builder]
        if self.wrapped is not None and not self.is_leaver:
            builders += (self.inner or self._start_inner()).values()
        for b in builders:
            if not b.wait(self.timeout):
                raise MigrationError(f"group {b.prefix} not built in {self.timeout}")
        if self.is_leaver:
            if self.channel is None:
                self._open_channel(state, membership)
            elif self.layout is not None and not self.layout["final"]:
                # Read before the job's reducer rebuilt its buckets (a migration in
                # the job's first steps): read again, as it is now.
                self.layout = bucket_layout(state.model)
            if self.snapshot_step is None:
                self._send_snapshot(state)
            assert self.channel is not None
            self.channel.flush()
            self.snapshot_flushed = True

    def _open_channel(self, state: TrainState, membership: Membership) -> None:
        """Tell the joiner who it will be, so it can build the next group with the
        stayers; the bulk state follows later (``_send_snapshot``). A DDP model's
        bucket layout is read now, outside the switch (it allocates), and sent with
        the switch for the joiner to check its own against before it commits."""
        assert self.builder is not None
        self.layout = bucket_layout(state.model)
        self.channel = TransferChannel(self.builder.result(), is_leaver=True)
        after = self.after(membership)
        hello = {"rank": self.my_rank, "nodes": list(after.nodes),
                 "local_ranks": [after.local_rank(r) for r in range(len(after.nodes))],
                 "generation": after.generation, "migration_id": self.id}  # fmt: skip
        self.channel.send(Kind.HELLO, 0, hello)

    def _send_snapshot(self, state: TrainState) -> None:
        # Sent from the live tensors; flushed before the optimizer next writes them.
        assert self.channel is not None
        self.channel.flush()  # the hello
        self.channel.send(Kind.SNAPSHOT, state.step, state.manifest(), state.bulk_tensors())
        self.snapshot_step = state.step

    @property
    def stayers(self) -> int:
        """Members that stay: the world less the leaving machine's ranks."""
        return self.world_size - len(self.leaver_ranks)

    def after(self, membership: Membership) -> Membership:
        """The members once it switched: the joiner's slots in the leaver's ranks."""
        return membership.replaced({self.prepare.leaver: self.prepare.joiner})

    def prepared(self) -> bool:
        """Phase 1 is done: the next group (stayer) or the channel (leaver) is up."""
        if self.abort_reason is not None:
            return False
        if not self.ahead:
            return True
        if self.builder is None or not self.builder.done() or self.builder.failed():
            return False
        if self._inner_pending():
            return False
        return not self.is_leaver or self.channel is not None

    def ready(self) -> bool:
        """Prepared, and (leaver) the joiner holds the bulk state in lock-step."""
        return self.prepared() and (not self.ahead or not self.is_leaver or self.snapshot_flushed)

    def votes(self, step_after: int) -> torch.Tensor:
        """This member's ``[ready, abort, 0]`` for the step that ends at ``step_after``."""
        ready = (
            self.ready()
            and self.switch is not None
            and (self.switch.at_step is None or step_after >= self.switch.at_step)
        )
        votes = no_votes()
        votes[VOTE_READY] = int(ready)
        votes[VOTE_ABORT] = int(self.abort_reason is not None)
        return votes

    # -- the leaver's lock-step forwarding ---------------------------------------------

    def before_update(self, state: TrainState, buffers: list[torch.Tensor] | None) -> None:
        """Leaver, after the all-reduce and before the optimizer: make sure the
        snapshot has left (the optimizer is about to write those tensors), then
        forward this step's averaged gradients, hyper-parameters and the model's
        buffers. ``buffers``: the
        reducer's; None for a wrapped model, whose gradients (this rank's shards,
        clipped) go as they are."""
        if not self.is_leaver or self.snapshot_step is None or self.abort_reason is not None:
            return
        assert self.channel is not None
        try:
            self.channel.flush()
            self.snapshot_flushed = True
            # The model's buffers as this step's forward left them (BatchNorm's
            # statistics): no gradient brings them, the joiner takes them as they are.
            model_buffers = state.buffer_tensors()
            payload: dict[str, Any] = {"hyperparams": state.hyperparams(),
                                       "buffers": len(model_buffers)}  # fmt: skip
            if buffers is None:
                try:
                    payload["has_grad"], grads = state.local_grads()
                except ValueError as exc:
                    raise MigrationError(str(exc)) from exc
                self.channel.send(Kind.GRADS, state.step + 1, payload, grads + model_buffers)
                return
            self.channel.send(Kind.GRADS, state.step + 1, payload, [*buffers, *model_buffers])
        except MigrationError as exc:
            self.abort_reason = str(exc)

    def before_reduce(self) -> None:
        """Leaver: the forwarded buckets are about to be overwritten."""
        if self.is_leaver and self.channel is not None and self.abort_reason is None:
            try:
                self.channel.flush()
            except MigrationError as exc:
                self.abort_reason = str(exc)

    # -- endings -----------------------------------------------------------------------

    def send_switch(self, small_state: dict[str, object], step: int) -> None:
        assert self.channel is not None
        self.channel.flush()
        self.channel.send(Kind.SWITCH, step, {**small_state, "buckets": self.layout})
        self.channel.flush()

    def new_group(self) -> Group:
        if self.builder is None:
            raise MigrationError("no group was built")
        return self.builder.result()

    def new_inner(self) -> dict[str, Group] | None:
        """A wrapped job's next inner groups, by name (None: not a wrapped job)."""
        if self.wrapped is None:
            return None
        if self.inner is None:
            raise MigrationError("the inner groups were not built")
        return {name: b.result() for name, b in self.inner.items()}

    def close(self, *, tell_joiner: bool) -> None:
        """Drop everything this migration built; on abort, tell a connected joiner."""
        channel, self.channel = self.channel, None
        # A wrapped joiner not yet reading would hold the sender until it does; it
        # learns of the abort when the channel closes.
        if channel is not None and tell_joiner and self.joiner_ready():
            try:
                channel.flush()
                channel.send(Kind.ABORT, 0)
                channel.flush()
            except MigrationError:
                pass  # a joiner that is gone needs no telling
        for builder in [self.builder, *(self.inner or {}).values()]:
            if builder is not None:
                builder.abandon()
        if self.watch is not None:
            self.watch.close()
