"""The survivors' agreement on which machines were lost (``failover._agree``), on a
real TCPStore, each survivor in its own thread: whole machines, part of a machine,
a slow survivor (whose ``Presence`` answers), a silent one, survivors at different
steps."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest

from tmd.runtime import failover
from tmd.runtime.group import StoreAddress, connect_store
from tmd.runtime.launch import host_store
from tmd.runtime.liveness import Presence
from tmd.runtime.membership import Membership
from tmd.runtime.session import Session
from tmd.runtime.session_config import SessionConfig
from tmd.runtime.timing import StepTimes

PREFIX = "tmd/fail/g0"


@dataclass
class _Survivor:
    """What ``_agree`` reads of a ``Session``."""

    rank: int
    membership: Membership
    store: Any
    step: int = 7
    median_step_s: float = 0.0
    config: SessionConfig = field(
        default_factory=lambda: SessionConfig(detect_timeout=timedelta(seconds=30))
    )

    def __post_init__(self) -> None:
        self.world_size = len(self.membership.nodes)
        self.state = SimpleNamespace(step=self.step)
        self.timing = StepTimes()
        if self.median_step_s:
            self.timing.durations.extend([self.median_step_s] * 3)


@pytest.fixture
def store() -> Iterator[StoreAddress]:
    server = host_store(0)
    yield StoreAddress("127.0.0.1", server.port)


def _agree(address: StoreAddress, membership: Membership, alive: dict[int, float],
           **kwargs: Any) -> dict[int, Any]:  # fmt: skip
    """Run ``_agree`` for every rank in ``alive`` (rank -> delay before it registers);
    what each returned, or the exception it raised."""
    results: dict[int, Any] = {}
    start = threading.Barrier(len(alive))

    def one(rank: int, delay: float) -> None:
        member = _Survivor(rank, membership, connect_store(address, timeout=timedelta(seconds=30)),
                           **kwargs)  # fmt: skip
        start.wait()
        time.sleep(delay)
        try:
            results[rank] = failover._agree(cast(Session, member), PREFIX)
        except failover.Replaced as exc:
            results[rank] = exc

    with ThreadPoolExecutor(len(alive)) as pool:
        for f in [pool.submit(one, r, d) for r, d in alive.items()]:
            f.result(timeout=60)
    return results


TWO_BY_TWO = Membership(0, ("a", "a", "b", "b"), (0, 1, 0, 1))


def test_a_machine_whose_every_rank_is_gone_is_lost(store: StoreAddress) -> None:
    results = _agree(store, TWO_BY_TWO, {0: 0.0, 1: 0.0})
    assert results[0] == results[1] == {"action": "replace", "alive": [0, 1], "lost": ["b"]}


def test_a_machine_that_lost_one_rank_is_lost_and_its_live_rank_leaves(
    store: StoreAddress,
) -> None:
    results = _agree(store, TWO_BY_TWO, {0: 0.0, 1: 0.0, 2: 0.0})
    assert results[0] == results[1] == {"action": "replace", "alive": [0, 1], "lost": ["b"]}
    assert isinstance(results[2], failover.Replaced)


def test_a_survivor_still_computing_is_waited_for_not_counted_lost(store: StoreAddress) -> None:
    # One rank per machine: rank 3 died; rank 2 is alive but registers 1 s after the
    # others (still computing its step). Its process's Presence answers at once, so
    # the survivors wait for it, far past the settle time.
    four = Membership(0, ("n0", "n1", "n2", "n3"))
    presence = Presence(store, lambda: (0, 2), failover.failure_reported)
    try:
        results = _agree(store, four, {0: 0.0, 1: 0.0, 2: 1.0})
    finally:
        presence.close()
    assert {r: v["lost"] for r, v in results.items()} == {0: ["n3"], 1: ["n3"], 2: ["n3"]}


def test_a_member_that_neither_registers_nor_answers_is_lost(store: StoreAddress) -> None:
    # The same, without rank 2's Presence: a process that does not answer is dead.
    four = Membership(0, ("n0", "n1", "n2", "n3"))
    results = _agree(store, four, {0: 0.0, 1: 0.0})
    assert results[0] == {"action": "replace", "alive": [0, 1], "lost": ["n2", "n3"]}


def test_survivors_at_different_steps_roll_back(store: StoreAddress) -> None:
    four = Membership(0, ("n0", "n1", "n2", "n3"))
    address = store
    client = connect_store(address, timeout=timedelta(seconds=30))
    client.set(f"{PREFIX}/alive/2", b"8")  # rank 2 was a step ahead
    client.append(f"{PREFIX}/alive-list", "2,")
    client.add(f"{PREFIX}/alive", 1)
    results = _agree(address, four, {0: 0.0, 1: 0.0})
    assert results[0]["action"] == "rollback" and "steps [7, 8]" in results[0]["reason"]


def test_each_lost_rank_gets_a_survivor_holding_what_it_held_or_the_job_rolls_back() -> None:
    """Donors by replica (``Session.replicas``): any survivor of a data-parallel job,
    the same shard in another replica group of an HSDP job, none of an FSDP2 job on
    one mesh dimension."""

    def donors(replicas: list[set[int]], lost: list[str], alive: list[int]) -> Any:
        session = SimpleNamespace(membership=TWO_BY_TWO, replicas=[frozenset(r) for r in replicas],
                                  bucket_layout=lambda: None)  # fmt: skip
        return failover._donors(cast(Session, session), {"lost": lost, "alive": alive})

    everyone = [{0, 1, 2, 3}] * 4
    assert donors(everyone, ["b"], [0, 1]) == {2: 0, 3: 1}  # in turn
    assert donors(everyone, ["b"], [0]) == {2: 0, 3: 0}
    hsdp = [{0, 2}, {1, 3}, {0, 2}, {1, 3}]  # (replicate, shard) = (machine, local rank)
    assert donors(hsdp, ["a"], [2, 3]) == {0: 2, 1: 3}
    fsdp = [{0}, {1}, {2}, {3}]
    assert "lost b, and no survivor holds the shards of its rank 2" in donors(fsdp, ["b"], [0, 1])


def _running_elsewhere(store: StoreAddress, rank: int, survivors: tuple[int, ...]) -> Any:
    member = SimpleNamespace(rank=rank, store=connect_store(store, timeout=timedelta(seconds=30)))
    recovery = SimpleNamespace(prefix=PREFIX, survivors=survivors)
    return failover.running_elsewhere(cast(Session, member), cast(failover.Recovery, recovery))


def _past_the_grace() -> None:
    time.sleep(failover.STUCK_GRACE.total_seconds() + 0.1)


def test_a_collective_left_waiting_for_a_survivor_that_ended_its_side_is_let_go(
    store: StoreAddress,
) -> None:
    """``running_elsewhere``, survivors 0 and 1: the pair's group {0, 1} lost nobody.
    Rank 1's collective 0 on it waits on rank 0's, which ended (failed where it met
    the lost member's failure, and went on): let go once rank 0 published, and
    nothing moved for the grace. Its collective 1 is waited for while rank 0 still
    runs it, and let go only a grace after that ended too."""
    zero, one = _running_elsewhere(store, 0, (0, 1)), _running_elsewhere(store, 1, (0, 1))
    mine = {("pair", 0): (0, 1), ("pair", 1): (0, 1)}
    assert not one(mine)  # rank 0 has not published: it may not have issued them yet
    assert not zero({("pair", 1): (0, 1)})  # rank 0 still runs collective 1
    assert not one(mine)
    _past_the_grace()
    assert not one(mine)  # collective 1 may still get rank 0's data
    assert zero({})  # rank 0's collective 1 ended: nothing left there
    assert not one(mine)  # something moved: a grace from now
    _past_the_grace()
    assert one(mine)
    assert one({})


def test_survivors_hung_in_a_ring_behind_the_one_whose_side_ended_all_let_go(
    store: StoreAddress,
) -> None:
    """A world of six in a ring, ranks 4 and 5 lost: rank 0's side of the world's
    collective 0 failed and ended; 1 waits for 0, 2 for 1, 3 for 2, each still
    running it. Its group lost members, so it never completes: every survivor lets
    it go once nothing has ended anywhere for the grace."""
    world = (0, 1, 2, 3, 4, 5)
    survivors = (0, 1, 2, 3)
    ranks = {r: _running_elsewhere(store, r, survivors) for r in survivors}
    assert ranks[0]({})
    hung = {("world", 0): world}
    assert not any(ranks[r](hung) for r in (1, 2, 3))  # each publishes
    assert not any(ranks[r](hung) for r in (1, 2, 3))  # each sees the others: a grace
    _past_the_grace()
    assert all(ranks[r](hung) for r in (1, 2, 3))
