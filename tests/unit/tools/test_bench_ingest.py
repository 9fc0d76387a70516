"""``tmd bench ingest``'s verdict and latency, table-tested without a broker: the target
holds only at the load claimed, and latency runs from a step's end, as a user waits."""

from __future__ import annotations

import asyncio
import os
import time
from types import SimpleNamespace
from typing import Any

import pytest

from tmd import wire
from tmd.tools.bench import ingest as bench_ingest
from tmd.tools.bench.ingest import (
    behind_limit_s,
    holds,
    percentile,
    process_cpu_s,
    relayed_ends,
    search_max,
    shortfalls,
    step_latencies,
)

T0 = 1_800_000_000.0


def result(**changes: Any) -> dict[str, Any]:
    """A run's result that holds the target; ``changes`` spoil it."""
    return {
        "loss": 0.0,
        "p99_latency_s": 0.05,
        "publisher_max_behind_s": 0.01,
        "publisher_behind_limit_s": behind_limit_s(flush_s=1.0, step_s=1.0),
        "rss_mb": 400.0,
        **changes,
    }


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({}, None),
        ({"loss": 1e-6}, "lost"),
        ({"p99_latency_s": 1.0}, "p99 latency"),
        ({"p99_latency_s": 0.999}, None),
        ({"p99_latency_s": None}, "no rank-step"),
        # A publisher behind its schedule packs more steps into fewer messages: the
        # daemon kept up with a lighter load than the one claimed.
        ({"publisher_max_behind_s": 0.51}, "fell 0.51 s behind"),
        ({"publisher_max_behind_s": 0.5}, None),
        ({"publisher_max_behind_s": 3.0, "p99_latency_s": 0.01}, "fell 3.0 s behind"),
        ({"rss_mb": 2048.0}, "RSS 2048.0 MB"),
        ({"rss_mb": 2047.9}, None),
    ],
)
def test_the_target_holds_only_without_loss_under_a_second_and_2_gib_at_the_load_claimed(
    changes: dict[str, Any], why: str | None
) -> None:
    r = result(**changes)
    found = shortfalls(r)
    assert holds(r) is (why is None)
    if why is None:
        assert found == []
    else:
        assert len(found) == 1 and why in found[0], found


def test_every_shortfall_is_named() -> None:
    r = result(loss=0.5, p99_latency_s=2.0, publisher_max_behind_s=1.0, rss_mb=4096.0)
    assert len(shortfalls(r)) == 4 and not holds(r)


@pytest.mark.parametrize(
    ("flush_s", "step_s", "limit"),
    [(1.0, 1.0, 0.5), (0.2, 1.0, 0.1), (5.0, 1.0, 0.5), (1.0, 0.4, 0.2)],
)
def test_the_publisher_may_fall_behind_by_half_the_shorter_of_flush_and_step(
    flush_s: float, step_s: float, limit: float
) -> None:
    assert behind_limit_s(flush_s=flush_s, step_s=step_s) == pytest.approx(limit)


def test_latency_runs_from_each_steps_end_not_from_publishing() -> None:
    # Three steps batched and sent together at T0 + 3, applied 50 ms later: the first
    # step's user waited 2.05 s, however fresh the message was.
    got = step_latencies([T0 + 1, T0 + 2, T0 + 3], applied_at=T0 + 3.05)
    assert got == pytest.approx([2.05, 1.05, 0.05])


def test_a_late_publisher_shows_in_the_latency() -> None:
    # Sent 0.8 s after the step ended, applied at once: 0.8 s, not ~0.
    assert step_latencies([T0], applied_at=T0 + 0.8) == pytest.approx([0.8])


def test_a_relayed_message_counts_the_steps_of_the_batches_taken_only() -> None:
    batches = [
        wire.IterBatch(ts=T0 + 3, job="j", rank=r, node="m",
                       steps=[wire.StepTiming(s, T0 + r + s / 10, 1.0, 0.6, 0.3, 0.05, 0.05)
                              for s in range(1, r + 2)])
        for r in range(3)
    ]  # fmt: skip
    (relayed,) = wire.RelayedBatches.of(batches)
    assert list(relayed_ends(relayed, [0, 1, 2])) == relayed.end_ts
    # Rank 1's batch (two steps) refused: ranks 0 and 2, one step and three.
    assert list(relayed_ends(relayed, [0, 2])) == [T0 + 0.1, T0 + 2.1, T0 + 2.2, T0 + 2.3]


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([], 0.5, None),
        ([0.3], 0.99, 0.3),
        ([0.4, 0.1, 0.3, 0.2], 0.5, 0.3),
        ([float(i) for i in range(100)], 0.99, 99.0),
        ([float(i) for i in range(1000)], 0.99, 990.0),
    ],
)
def test_percentile(values: list[float], q: float, expected: float | None) -> None:
    assert percentile(values, q) == expected


def test_a_process_cpu_time_is_read_from_proc() -> None:
    busy = time.process_time()
    while time.process_time() - busy < 0.2:
        pass
    mine, times = process_cpu_s(os.getpid()), os.times()
    assert mine == pytest.approx(times.user + times.system, abs=0.05)  # its user + system
    assert process_cpu_s(None) is None


@pytest.mark.parametrize(
    ("limit", "start", "expected"),
    [
        (40_000, 16_384, (36_864, 40_960)),  # start holds: doubled, then bisected
        (10_500, 16_384, (10_240, 11_264)),  # start fails: halved until held, bisected
        (0, 16_384, (0, 1)),  # nothing holds
    ],
)
def test_the_search_brackets_the_largest_n_held_to_within_an_eighth(
    limit: int, start: int, expected: tuple[int, int]
) -> None:
    lo, hi = search_max(start, start <= limit, lambda n: n <= limit)
    assert (lo, hi) == expected
    assert hi is not None and (lo == 0 or hi - lo <= lo // 8)


@pytest.mark.parametrize(
    ("grows_to", "published", "polls"),
    [
        (50, 50, 6),  # all in: once it is still
        (50, 100, 15),  # half lost at the broker: still for 2 s (10 polls), not 20 s
        (10**9, 100, 100),  # never still: 20 s at most
    ],
)
async def test_the_drain_ends_soon_after_the_view_stops_growing(
    grows_to: int, published: int, polls: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The publisher has stopped, so every machine is silent from its last message:
    a drain that waited past node_lost's 15 s would count the findings of that silence
    as the run's decisions."""
    seen: list[int] = []

    def total_steps() -> int:
        seen.append(min(grows_to, 10 * (len(seen) + 1)))
        return seen[-1]

    async def no_wait(_: float) -> None:
        pass

    monkeypatch.setattr(asyncio, "sleep", no_wait)
    daemon: Any = SimpleNamespace(view=SimpleNamespace(total_steps=total_steps))
    await bench_ingest._drain(daemon, published)
    assert len(seen) == polls
