"""Who holds which rank, and the one record every change of group is made of.

A process becomes a member of a group in exactly one way: it hands the session a
``Reconfiguration`` (``Session.reconfigure``). The job's first group at start (after
which the checkpoint is restored), a planned switch (stayers and joiner) and a
failover (survivors and the standby that takes over) each build one, and nothing
else writes the session's group, membership, rank or role.
"""

from __future__ import annotations

from dataclasses import dataclass

from tmd import wire
from tmd.errors import MigrationError
from tmd.runtime.group import Group
from tmd.runtime.timing import PendingSwitch


@dataclass(frozen=True)
class Membership:
    """Who holds which rank in one generation of the job's group."""

    generation: int
    nodes: tuple[str, ...]  # index: rank

    def rank_of(self, node: str) -> int:
        try:
            return self.nodes.index(node)
        except ValueError:
            raise MigrationError(
                f"{node} is not a member of generation {self.generation}"
            ) from None

    def members(self) -> list[wire.Member]:
        return [wire.Member(rank, node) for rank, node in enumerate(self.nodes)]

    def replaced(self, rank: int, node: str) -> Membership:
        """The next generation: ``node`` in ``rank``'s place, everyone else where they were."""
        nodes = list(self.nodes)
        nodes[rank] = node
        return Membership(self.generation + 1, tuple(nodes))


@dataclass(frozen=True)
class Reconfiguration:
    """This process's place in a new group, as one record: what ``Session.reconfigure``
    takes, whoever made the group (start, switch, join, failover)."""

    group: Group
    membership: Membership
    rank: int
    switch: PendingSwitch | None = None
    """A planned switch: its downtime is acked once the first step on ``group`` ends."""
    median_step_s: float | None = None
    """A process new to the job (joiner, standby taking over) starts its step history
    from the median step of the rank it replaces, to measure its first step against."""
