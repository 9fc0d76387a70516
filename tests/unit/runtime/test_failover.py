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


def test_a_collective_left_waiting_for_a_survivor_that_ended_its_side_is_let_go(
    store: StoreAddress,
) -> None:
    """``running_elsewhere``: survivors 0 and 1 of a world of four. Rank 1's collective
    0 on the world waits on rank 0's, which ended (a ring whose next member died):
    let go once rank 0 published, after the grace. Its collective 1 is let go only
    once rank 0's collective 1, still running there, has ended too. A collective of
    a group rank 0 is not in waits for nobody alive."""
    world, pair = (0, 1, 2, 3), (1, 3)
    recovery = SimpleNamespace(prefix=PREFIX, survivors=(0, 1))

    def survivor(rank: int) -> Any:
        member = SimpleNamespace(
            rank=rank, store=connect_store(store, timeout=timedelta(seconds=30))
        )
        return failover.running_elsewhere(cast(Session, member), cast(failover.Recovery, recovery))

    zero, one = survivor(0), survivor(1)
    mine = {(world, 0), (world, 1), (pair, 0)}
    assert not one(mine)  # rank 0 has not published: it may not have issued them yet
    assert not zero({(world, 1)})  # rank 0 still runs collective 1 (published)
    assert not one(mine)  # collective 0 and the pair's: now waiting out the grace
    time.sleep(failover.STUCK_GRACE_S + 0.1)
    assert not one(mine)  # collective 1 may still get rank 0's data
    assert zero(set())  # rank 0's collective 1 ended: nothing left there
    assert not one(mine)  # collective 1 starts its grace
    time.sleep(failover.STUCK_GRACE_S + 0.1)
    assert one(mine)
    assert one(set())
