"""The control commands as a member acts on them: prepare, switch, abort and restart.

A member holds at most one planned migration (``Commands.current``). Commands are
read at the step boundary: a ``prepare`` starts a migration or is refused, a
``switch`` or ``abort`` marks the current one, and the votes the step's all-reduce
carried decide, on every member at the same step, whether it switches
(``tmd.runtime.switch``) or aborts. Commands can come twice (a lost ack, a restarted
controller) or late: each migration id is acted on once, and a repeat is answered
with what already happened, with the downtime this member measured if it switched.

A ``restart`` (checkpoint, then exit for a restart without a machine) is refused
by a job without a checkpoint directory; otherwise the first member to read it
stores it in the job's store and votes for it, and at the boundary where the vote
is counted every member reads the same command there and ends its run
(``Session._restart``).

A long job sees migration ids without end, so a member remembers the newest
``MAX_REMEMBERED`` of them (the ids it acted on and the answers it gave, in the order
it first met them). A command for an id that fell out is taken for a new one. That is
safe because such a command never comes from the controller: it sends a command only
while its migration is in flight, and the one controller of a job (heads split work by
job) runs at most ``guardrails.max_concurrent_per_job`` of them at a time and starts at
most ``guardrails.max_per_hour`` an hour, restarts one at a time: a thousand newer ids
of the same job cannot come while one is still in flight. An old command that sat in a
queue or is replayed is refused by its age before it gets here
(``MqttControl``'s ``max_age``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, TypeVar

import torch

from tmd import wire
from tmd.runtime import switch
from tmd.runtime.control import standbys
from tmd.runtime.migration import VOTE_ABORT, VOTE_READY, Migration

RESTART_KEY = "tmd/restart"
MAX_REMEMBERED = 1024
"""Migration ids a member remembers, the newest (see the module's docstring)."""

if TYPE_CHECKING:
    from tmd.runtime.session import Session

AckKind = Literal["prepared", "switched", "failed", "aborted", "restarting"]


class Commands:
    """One member's planned migration, and its answers to every migration id it saw."""

    def __init__(self, session: Session) -> None:
        self._session = session
        self.current: Migration | None = None
        self.left = False  # the leaver of a migration that switched: out of the job
        # By migration id, oldest first, each at most MAX_REMEMBERED long.
        self.seen: dict[str, None] = {}  # the ids of the commands acted on
        self.outcomes: dict[str, AckKind] = {}
        self.downtimes: dict[str, wire.Downtime] = {}  # as acked
        self.restart_asked = False  # this member holds a Restart: it votes for it

    # -- at the step boundary ----------------------------------------------------------

    def boundary(self, votes: torch.Tensor) -> None:
        """Act on the votes of the step that just ended, then on the commands that
        came in, then move the current migration's preparation forward."""
        s = self._session
        mig = self.current
        if mig is not None:
            if int(votes[VOTE_ABORT]) > 0:
                self._abort(mig)
            elif int(votes[VOTE_READY]) == s.world_size:
                self._switch(mig)
        for message in s.control.poll():
            self._handle(message)
        mig = self.current
        if mig is not None:
            mig.advance(s.state, s.membership)
            if not mig.prepared_acked and mig.prepared():
                mig.prepared_acked = True
                s.ack(mig.id, "prepared")

    def drop(self) -> None:
        """A member died: a planned migration cannot survive this."""
        if self.current is not None:
            self.current.close(tell_joiner=True)
            self.current = None

    def _switch(self, mig: Migration) -> None:
        s = self._session
        if mig.is_leaver:
            if not switch.leave(s, mig):
                self._abort(mig)
                return
            self.left = True
            self.current = None
            self.settle(mig.id, "switched", detail="left")
            return
        joined = switch.commit(s, mig)
        if joined is None:
            self._abort(mig)
            return
        self.current = None
        _remember(self.outcomes, mig.id, "switched")  # acked with the downtime after a step
        s.reconfigure(joined)
        s.publish_status()

    def _abort(self, mig: Migration) -> None:
        mig.close(tell_joiner=mig.is_leaver)
        self.current = None
        self.settle(mig.id, "aborted", detail=mig.abort_reason or "aborted by a member")
        self._session.publish_status()

    def _handle(self, message: wire.Control) -> None:
        mig = self.current
        if isinstance(message, wire.Restart):
            self._restart(message)
        elif isinstance(message, wire.Prepare):
            self._prepare(message)
        elif mig is not None and message.migration_id == mig.id:
            if isinstance(message, wire.Switch):
                mig.switch = message
            else:
                mig.abort_reason = message.reason or "aborted by controller"
        elif message.migration_id in self.outcomes:
            self._answer_repeat(message.migration_id)

    def _restart(self, message: wire.Restart) -> None:
        s = self._session
        if message.run is not None and message.run != s.env.restart_count:
            return  # meant for another run of the job: a resend that outlived it
        if not self.first_seen(message.migration_id):
            if message.migration_id in self.outcomes:
                self._answer_repeat(message.migration_id)
            return
        if s.config.checkpoint_dir is None:
            detail = "no checkpoint_dir: this job cannot checkpoint before a restart"
            self.settle(message.migration_id, "failed", detail=detail)
            return
        if message.node not in s.membership.nodes:
            detail = f"{message.node} is not a member of generation {s.membership.generation}"
            self.settle(message.migration_id, "failed", detail=detail)
            return
        # The first member to read it stores it; every member restarts on that one.
        s.store.compare_set(RESTART_KEY, "", wire.encode(message).decode())
        self.restart_asked = True

    def end_for_restart(self) -> wire.Restart:
        """The restart every member agreed on; a planned migration ends with it."""
        mig = self.current
        if mig is not None:
            mig.close(tell_joiner=mig.is_leaver)
            self.current = None
            self.settle(mig.id, "aborted", detail="the job restarts")
        order: wire.Restart = wire.decode(bytes(self._session.store.get(RESTART_KEY)),
                                          wire.Restart)  # fmt: skip
        return order

    def _prepare(self, message: wire.Prepare) -> None:
        s, mig = self._session, self.current
        if not self.first_seen(message.migration_id):
            # A repeat (a lost ack, a restarted controller): say where it stands.
            if mig is not None and mig.id == message.migration_id:
                if mig.prepared_acked:
                    s.ack(mig.id, "prepared", detail="already prepared")
            elif message.migration_id in self.outcomes:
                self._answer_repeat(message.migration_id)
            return
        if mig is not None:
            self.settle(message.migration_id, "failed", detail=f"busy with {mig.id}")
            return
        refused = self._refusal(message)
        if refused:
            self.settle(message.migration_id, "failed", detail=refused)
            return
        cfg, env = s.config, s.env
        self.current = Migration.start(
            message, rank=s.rank, membership=s.membership, store=env.store,
            timeout=cfg.group_timeout, backend=env.backend, host=env.host,
            ahead=cfg.prepare_ahead, eager_copy=cfg.eager_copy,
            joiner_timeout=cfg.joiner_timeout, wrapped=s.store if s.wrapped else None,
        )  # fmt: skip
        if self.current.is_leaver:
            self._check_joiner_size(self.current)
        s.publish_status("migrating")

    def _refusal(self, message: wire.Prepare) -> str:
        """Why this member refuses ``message`` ('' if it does not): the leaver must be a
        machine of the job and the joiner not. Every member holds the same membership,
        so they all refuse alike."""
        nodes = self._session.membership.nodes
        if message.joiner in nodes or message.leaver not in nodes:
            return "leaver or joiner not valid"
        return ""

    def _check_joiner_size(self, mig: Migration) -> None:
        """The leaving machine's processes only: a standby machine of another size than
        the leaver cannot take its place; the abort vote stops the migration for all."""
        ranks = len(mig.leaver_ranks)
        joiner = mig.prepare.joiner
        found = [i for i in standbys(self._session.store) if i.node == joiner]
        if found and found[0].slots != ranks:
            mig.abort_reason = (
                f"standby machine {joiner} has {found[0].slots} slots, "
                f"the leaver {mig.prepare.leaver} runs {ranks} ranks"
            )

    # -- answers -----------------------------------------------------------------------

    def first_seen(self, migration_id: str) -> bool:
        """True the first time a command for ``migration_id`` reaches this member."""
        if migration_id in self.seen:
            return False
        _remember(self.seen, migration_id, None)
        return True

    def settle(
        self, migration_id: str, kind: AckKind, *, detail: str = "",
        downtime: wire.Downtime | None = None,
    ) -> None:  # fmt: skip
        """Record how a migration ended for this member, and ack it."""
        _remember(self.outcomes, migration_id, kind)
        if downtime is not None:
            _remember(self.downtimes, migration_id, downtime)
        self._session.ack(migration_id, kind, detail=detail, downtime=downtime)

    def measured(self, migration_id: str, downtime: wire.Downtime) -> None:
        """The first step after a switch has ended: ack the switch with its downtime."""
        _remember(self.downtimes, migration_id, downtime)
        self._session.ack(migration_id, "switched", downtime=downtime)

    def _answer_repeat(self, migration_id: str) -> None:
        """A repeated or late command: answer with what already happened, with the
        downtime this member measured if it switched (a controller that lost the
        first answer still learns it)."""
        outcome = self.outcomes[migration_id]
        self._session.ack(migration_id, outcome, detail=f"already {outcome}",
                          downtime=self.downtimes.get(migration_id))  # fmt: skip


V = TypeVar("V")


def _remember(seen: dict[str, V], migration_id: str, value: V) -> None:
    """Set ``seen[migration_id]``, newest last; past ``MAX_REMEMBERED`` the oldest go."""
    seen.pop(migration_id, None)
    seen[migration_id] = value
    while len(seen) > MAX_REMEMBERED:
        del seen[next(iter(seen))]
