"""The switch's commit vote (``switch.leave``, ``switch.commit``) on real gloo groups in
one process: three members (rank 1 leaves) and a joiner, each in its own thread.

The stayers run the real ``Migration`` and its group builder; the joiner does what
``runtime.standby`` does at the switch (one all-reduce of 1 on the new group). Only
the leaver's migration is a fake: its transfer channel is not what is under test.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal, TypeVar, cast

import pytest
import torch

from tmd import wire
from tmd.errors import MigrationError
from tmd.runtime import switch
from tmd.runtime.group import Group, StoreAddress, connect_store, make_group
from tmd.runtime.launch import host_store
from tmd.runtime.membership import Membership, Reconfiguration
from tmd.runtime.migration import Migration, world_prefix
from tmd.runtime.session import Session
from tmd.runtime.timing import StepTimes

NODES = ("w0", "w1", "w2")
LEAVER, JOINER = "w1", "s0"  # the leaver is in the middle: its rank is not the last
STAYERS = (0, 2)
OLD = Membership(4, NODES)
PREPARE = wire.Prepare(ts=0.0, job="unit", migration_id="m7", leaver=LEAVER, joiner=JOINER)
STEP = 7
OLD_TIMEOUT = timedelta(seconds=30)
FAIL_TIMEOUT = timedelta(seconds=1)  # how long the new group waits for a joiner that died

T = TypeVar("T")
Joiner = Literal["commits", "absent", "hangs", "votes no"]


@dataclass
class _State:
    step: int = STEP

    def small_state(self) -> dict[str, object]:
        return {"step": self.step, "rng": "rng-state"}


@dataclass
class _Member:
    """What ``switch`` reads of a ``Session``."""

    rank: int
    group: Group
    world_size: int = len(NODES)
    membership: Membership = OLD
    state: _State = field(default_factory=_State)
    timing: StepTimes = field(default_factory=StepTimes)

    def __post_init__(self) -> None:
        self.timing.durations.extend([0.2, 0.4, 0.3])
        self.timing.mark_step_end(time.monotonic() - 0.5)  # the last step before the switch


@dataclass
class _LeaverMigration:
    """The leaver's ``Migration`` without its transfer channel: what ``leave`` calls,
    recorded; ``fail`` makes sending the small state fail."""

    fail: str | None = None
    prepare: wire.Prepare = PREPARE
    stayers: int = 2
    abort_reason: str | None = None
    prepared_with: tuple[object, Membership] | None = None
    switch_sent: list[tuple[dict[str, object], int]] = field(default_factory=list)
    closed: list[bool] = field(default_factory=list)

    @property
    def id(self) -> str:
        return self.prepare.migration_id

    def finish_preparation(self, state: object, membership: Membership) -> None:
        self.prepared_with = (state, membership)  # the snapshot and the hello come from them

    def send_switch(self, small_state: dict[str, object], step: int) -> None:
        if self.fail is not None:
            raise MigrationError(self.fail)
        self.switch_sent.append((small_state, step))

    def close(self, *, tell_joiner: bool) -> None:
        self.closed.append(tell_joiner)


@dataclass
class _Run:
    changes: dict[int, Reconfiguration | None]  # stayers, by rank
    migrations: dict[int, Migration]
    left: bool
    leaver: _LeaverMigration
    old: list[Group]  # by old rank
    joiner_group: Group | None
    joiner_sum: int | None


def _concurrently(*calls: Callable[[], T]) -> list[T]:
    """Run each call in its own thread (collectives need every member at once)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(c) for c in calls]
        return [f.result(timeout=60) for f in futures]


def _sums(groups: list[Group]) -> list[int]:
    """One all-reduce of 1 by every member of one group: the group works."""

    def one(group: Group) -> Callable[[], int]:
        def run() -> int:
            tensor = torch.ones(1, dtype=torch.int64)
            group.allreduce([tensor]).wait()
            return int(tensor.item())

        return run

    return _concurrently(*(one(g) for g in groups))


@pytest.fixture
def aside(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Who stepped aside (the leaver, once out); it would renice the test's thread."""
    calls: list[str] = []
    monkeypatch.setattr(switch, "_step_aside", lambda: calls.append("aside"))
    return calls


@pytest.fixture
def store() -> Iterator[StoreAddress]:
    server = host_store(0)
    yield StoreAddress("127.0.0.1", server.port)  # the server lives as long as the test


def _group(address: StoreAddress, prefix: str, rank: int, timeout: timedelta) -> Group:
    store = connect_store(address, timeout=timeout)
    return make_group(store, prefix, rank=rank, size=3, timeout=timeout, host="127.0.0.1")


def _switch(
    address: StoreAddress,
    joiner: Joiner,
    *,
    leaver_fails: str | None = None,
    timeout: timedelta = OLD_TIMEOUT,
) -> _Run:
    """Members on an old group of three, prepared (the stayers' next group under way),
    then all at the switch boundary at once; ``joiner`` says what the joiner does."""
    old = _concurrently(*(lambda r=r: _group(address, "old", r, OLD_TIMEOUT) for r in range(3)))
    migrations = {
        r: Migration.start(PREPARE, rank=r, membership=OLD, store=address,
                           timeout=timeout, backend="gloo", host="127.0.0.1")
        for r in STAYERS
    }  # fmt: skip
    leaver = _LeaverMigration(fail=leaver_fails)
    joined: dict[str, object] = {}

    def stayer(rank: int) -> Callable[[], Reconfiguration | None]:
        member = cast(Session, _Member(rank, old[rank]))
        return lambda: switch.commit(member, migrations[rank])

    def leave() -> bool:
        return switch.leave(cast(Session, _Member(1, old[1])), cast(Migration, leaver))

    def join() -> None:
        if joiner == "absent":  # died before it built the next group
            return
        group = _group(address, world_prefix(PREPARE.migration_id), 1, timeout)
        joined["group"] = group  # kept: a hung joiner's sockets stay open
        if joiner == "hangs":  # built it, then died or never got the switch
            return
        total = torch.tensor([1 if joiner == "commits" else 0], dtype=torch.int64)
        group.allreduce([total]).wait()
        joined["sum"] = int(total.item())

    first, second, left, _ = _concurrently(stayer(0), stayer(2), leave, join)
    return _Run(
        changes={0: cast(Reconfiguration | None, first), 2: cast(Reconfiguration | None, second)},
        migrations=migrations,
        left=bool(left),
        leaver=leaver,
        old=old,
        joiner_group=joined.get("group"),
        joiner_sum=cast(int | None, joined.get("sum")),
    )


def test_the_stayers_commit_and_the_leaver_leaves(store: StoreAddress, aside: list[str]) -> None:
    run = _switch(store, "commits")
    after = Membership(5, ("w0", "s0", "w2"))
    for rank, change in run.changes.items():
        assert change is not None, run.migrations[rank].abort_reason
        assert (change.rank, change.membership) == (rank, after)
        assert change.group is run.migrations[rank].new_group()
        assert change.switch is not None and change.switch.migration_id == "m7"
        timing = change.switch
        assert 0.5 <= timing.stop_s < 30 and 0 <= timing.switch_s < 30
        assert timing.resumed - timing.last_step_end == pytest.approx(
            timing.stop_s + timing.switch_s
        )
        assert run.migrations[rank].abort_reason is None
    assert run.left and run.leaver.closed == [False] and aside == ["aside"]
    assert run.leaver.switch_sent == [
        ({"step": STEP, "rng": "rng-state", "median_step_s": 0.3}, STEP)
    ]
    assert run.leaver.prepared_with == (_State(), OLD)
    assert run.joiner_sum == 3
    # The next step runs on the new group: the stayers and the joiner, in rank 1.
    changes = [c for c in run.changes.values() if c is not None]
    assert _sums([c.group for c in changes] + [run.joiner_group]) == [3, 3, 3]


@pytest.mark.parametrize(
    ("joiner", "leaver_fails"),
    [
        ("absent", None),  # died before it built the next group
        ("hangs", None),  # built it, then died: the commit on the new group times out
        ("votes no", None),  # the new group answered without everyone's commit
        ("hangs", "channel to the joiner broke"),  # the joiner never got the switch
    ],
)
def test_when_the_commit_fails_anywhere_every_member_stays_on_the_old_group(
    store: StoreAddress, aside: list[str], joiner: Joiner, leaver_fails: str | None
) -> None:
    run = _switch(store, joiner, leaver_fails=leaver_fails, timeout=FAIL_TIMEOUT)
    assert run.changes == {0: None, 2: None}
    for mig in run.migrations.values():
        assert mig.abort_reason  # what the member's "aborted" ack says
    assert not run.left and run.leaver.closed == [] and aside == []
    assert run.leaver.abort_reason == leaver_fails
    # Nobody left and nobody moved: the next step runs on the old group, all three.
    assert _sums(run.old) == [3, 3, 3]


def test_a_stayer_that_could_not_commit_stops_the_others(
    store: StoreAddress, aside: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The joiner and stayer 0 commit; stayer 2 fails on its own (its copy of the new
    group errs after the sum): its vote on the old group stops everyone."""

    def new_group(self: Migration) -> Group:
        group = self.builder.result()  # type: ignore[union-attr]
        if self.my_rank != 2:
            return group

        class Broken:
            def allreduce(self, tensors: list[torch.Tensor]) -> object:
                work = group.allreduce(tensors)
                work.wait()
                raise RuntimeError("connection reset after the sum")

        return Broken()

    monkeypatch.setattr(Migration, "new_group", new_group)
    run = _switch(store, "commits")
    assert run.changes == {0: None, 2: None}
    assert run.migrations[0].abort_reason == "another member failed to commit"
    assert "connection reset" in (run.migrations[2].abort_reason or "")
    assert not run.left and aside == []
    assert _sums(run.old) == [3, 3, 3]
