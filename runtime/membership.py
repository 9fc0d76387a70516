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
    """Who holds which rank in one generation of the job's group: the machine of each
    rank and its local rank there. A machine is replaced as a whole: every one of its
    ranks goes to the slot of the same local rank on the machine that replaces it."""

    generation: int
    nodes: tuple[str, ...]  # index: rank
    local_ranks: tuple[int, ...] = ()
    """Index: rank. Empty: one rank per machine, every local rank 0."""

    def __post_init__(self) -> None:
        if self.local_ranks and len(self.local_ranks) != len(self.nodes):
            raise ValueError(
                f"generation {self.generation}: {len(self.local_ranks)} local ranks "
                f"for {len(self.nodes)} ranks"
            )
        slots = list(zip(self.nodes, self.local_ranks or [0] * len(self.nodes), strict=True))
        if len(set(slots)) != len(slots):
            twice = sorted({f"{n}/{lr}" for n, lr in slots if slots.count((n, lr)) > 1})
            raise MigrationError(
                f"generation {self.generation}: (node, local rank) held twice: {twice}; "
                "ranks on one machine need distinct LOCAL_RANK"
            )

    def local_rank(self, rank: int) -> int:
        return self.local_ranks[rank] if self.local_ranks else 0

    def ranks_of(self, node: str) -> tuple[int, ...]:
        """The ranks ``node`` holds, by local rank."""
        ranks = sorted((r for r, n in enumerate(self.nodes) if n == node), key=self.local_rank)
        if not ranks:
            raise MigrationError(f"{node} is not a member of generation {self.generation}")
        return tuple(ranks)

    def machines(self) -> dict[str, tuple[int, ...]]:
        """Every machine and its ranks, by local rank (one pass over the ranks)."""
        found: dict[str, list[int]] = {}
        for rank in sorted(range(len(self.nodes)), key=self.local_rank):
            found.setdefault(self.nodes[rank], []).append(rank)
        return {node: tuple(found[node]) for node in dict.fromkeys(self.nodes)}

    def members(self) -> list[wire.Member]:
        return [
            wire.Member(rank, node, self.local_rank(rank)) for rank, node in enumerate(self.nodes)
        ]

    def replaced(self, swaps: dict[str, str]) -> Membership:
        """The next generation: for each ``leaver: joiner`` of ``swaps`` every rank of the
        leaving machine held by the joining one, local ranks kept; everyone else where
        they were."""
        nodes = tuple(swaps.get(node, node) for node in self.nodes)
        return Membership(self.generation + 1, nodes, self.local_ranks)


@dataclass(frozen=True)
class Reconfiguration:
    """This process's place in a new group, as one record: what ``Session.reconfigure``
    takes, whoever made the group (start, switch, join, failover)."""

    group: Group
    membership: Membership
    rank: int
    switch: PendingSwitch | None = None
    """A planned switch: its downtime is acked once the first step on ``group`` ends."""
    inner: dict[str, Group] | None = None
    """A job wrapped by torch's parallelism (``tmd.runtime.parallel``): the next inner
    group of each of its groups but the world, by group name."""
    median_step_s: float | None = None
    """A process new to the job (joiner, standby taking over) starts its step history
    from the median step of the rank it replaces, to measure its first step against."""
