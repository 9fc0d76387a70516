"""``swap_group.Guard``: while armed, a collective that fails, or hangs until a failure
elsewhere is reported, completes with this rank's own answer and the failure is kept,
instead of raising inside a wrapper's code; every later one is answered without the
network until ``reset``. One process, its world's inner group a stand-in whose works
the test completes (or fails) by hand."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tmd.runtime import swap_group


class Inner:
    """An inner group of one rank whose collectives complete when the test says."""

    def __init__(self) -> None:
        self.futures: list[torch.futures.Future[Any]] = []
        self.calls = 0

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    def shutdown(self) -> None:
        pass

    def allreduce(self, tensors: list[torch.Tensor], *_: Any) -> Any:
        self.calls += 1
        future: torch.futures.Future[Any] = torch.futures.Future()
        self.futures.append(future)
        return FutureWork(future)


class FutureWork(dist.Work):
    """A work whose future is the test's, errors included (as a gloo work's is)."""

    def __init__(self, future: torch.futures.Future[Any]) -> None:
        super().__init__()
        self.future = future

    def wait(self, timeout: Any = None) -> bool:
        self.future.wait()
        return True

    def get_future(self) -> Any:
        return self.future


class NoFuture(dist.Work):
    """A work with no future (gloo's reduce_scatter_single), done once ``release``d;
    like gloo's, it never reports itself complete."""

    def __init__(self, error: BaseException | None = None) -> None:
        super().__init__()
        self.release = threading.Event()
        self.error = error

    def wait(self, timeout: Any = None) -> bool:
        self.release.wait()
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return False

    def get_future(self) -> Any:
        raise RuntimeError("Work::getFuture not implemented.")


@pytest.fixture
def guarded() -> Iterator[tuple[swap_group.Guard, Inner, list[BaseException]]]:
    world = swap_group.install(rank=0, size=1)
    inner = Inner()
    world.swap(inner)
    reported: list[BaseException] = []
    seen = threading.Event()

    def report(error: BaseException, generation: int) -> None:
        assert generation == 0
        reported.append(error)
        seen.set()

    guard = swap_group.Guard(report, 0)
    guard.seen = seen  # type: ignore[attr-defined]
    swap_group.guard_with(guard)
    guard.armed = True
    try:
        yield guard, inner, reported
    finally:
        swap_group.release()


def test_a_collective_that_completes_passes_through(guarded: Any) -> None:
    guard, inner, reported = guarded
    work = dist.all_reduce(torch.ones(2), async_op=True)
    inner.futures[0].set_result([torch.full((2,), 7.0)])
    work.wait()
    assert work.get_future().value()[0].tolist() == [7.0, 7.0]
    assert guard.error is None and reported == []


def test_a_failed_collective_is_answered_locally_kept_and_reported_once(guarded: Any) -> None:
    guard, inner, reported = guarded
    out = torch.ones(2)
    work = dist.all_reduce(out, async_op=True)
    inner.futures[0].set_exception(RuntimeError("Connection closed by peer"))
    work.wait()  # no exception in the caller's code
    assert "Connection closed" in str(guard.error) and out.tolist() == [1.0, 1.0]
    assert guard.seen.wait(5) and len(reported) == 1
    later = torch.full((2,), 3.0)
    dist.all_reduce(later)  # answered at once; still issued, for survivors waiting on it
    assert inner.calls == 2 and later.tolist() == [3.0, 3.0] and len(reported) == 1
    assert not guard.drain(timedelta(seconds=0.05))  # the later one has not ended


def test_a_hanging_collective_ends_when_a_failure_elsewhere_is_reported(guarded: Any) -> None:
    guard, inner, reported = guarded
    work = dist.all_reduce(torch.ones(2), async_op=True)
    elsewhere = threading.Timer(0.1, lambda: guard.fail(RuntimeError("elsewhere"), 0,
                                                        report=False))  # fmt: skip
    elsewhere.start()
    work.wait()
    assert str(guard.error) == "elsewhere" and reported == []  # its reporter already told
    guard.reset(1)
    inner.futures[0].set_exception(RuntimeError("late"))  # the abandoned one, failing late
    guard.fail(RuntimeError("a report about generation 0, late"), 0)
    assert guard.error is None
    assert guard.drain(timedelta(seconds=5))  # it ended, failing
    fresh = dist.all_reduce(torch.ones(2), async_op=True)
    inner.futures[1].set_result([torch.ones(2)])
    fresh.wait()
    assert inner.calls == 2 and guard.error is None


def test_reset_answers_what_the_failed_step_never_waited_for_and_drain_waits_for_it(
    guarded: Any,
) -> None:
    guard, inner, _ = guarded
    never_waited = dist.all_reduce(torch.ones(2), async_op=True)
    guard.reset(1)  # a failure seen only in the votes: this one was never waited on
    never_waited.wait()  # answered locally, not left hanging
    threading.Timer(0.1, lambda: inner.futures[0].set_exception(RuntimeError("closed"))).start()
    assert guard.drain(timedelta(seconds=5))  # waited until its inner work ended
    assert guard.error is None  # an old generation's failure


def test_an_answer_that_cannot_be_made_still_completes_the_collective(guarded: Any) -> None:
    """A failure must release every waiter, even where the local answer fails."""
    guard, inner, _ = guarded
    out = torch.ones(4, 4).t()  # not contiguous: the answer's view of it raises
    inner.all_gather_single = lambda *_: FutureWork(torch.futures.Future())  # type: ignore[attr-defined]
    group: Any = dist.group.WORLD
    work = group.all_gather_single(out, torch.ones(16))
    guard.fail(RuntimeError("Connection closed by peer"), 0)
    work.wait()
    assert guard.error is not None


def test_a_work_without_a_future_is_waited_for_on_a_thread(guarded: Any) -> None:
    guard, inner, _ = guarded
    made = [NoFuture(), NoFuture(RuntimeError("Read error"))]
    given = iter(made)
    inner.reduce_scatter_single = lambda *_: next(given)  # type: ignore[attr-defined]
    group: Any = dist.group.WORLD
    out = [torch.zeros(1), torch.zeros(1)]
    first = group.reduce_scatter_single(out[0], torch.ones(1))
    second = group.reduce_scatter_single(out[1], torch.full((1,), 3.0))
    made[0].release.set()
    first.wait()
    assert guard.error is None
    made[1].release.set()
    second.wait()  # it failed: answered with this rank's chunk, no exception
    assert str(guard.error) == "Read error" and out[1].tolist() == [3.0]
    assert guard.drain(timedelta(seconds=5))  # ended, though gloo's never says so


def test_disarmed_a_failure_raises_as_it_would_without_tmd(guarded: Any) -> None:
    guard, inner, reported = guarded
    guard.armed = False
    work = dist.all_reduce(torch.ones(2), async_op=True)
    inner.futures[0].set_exception(RuntimeError("Connection closed by peer"))
    with pytest.raises(RuntimeError, match="Connection closed"):
        work.wait()
    assert guard.error is None and reported == []


def test_drain_lets_go_of_what_is_settled_and_collectives_are_numbered_per_generation(
    guarded: Any,
) -> None:
    guard, inner, _ = guarded
    dist.all_reduce(torch.ones(2), async_op=True)
    dist.all_reduce(torch.ones(2), async_op=True)
    guard.fail(RuntimeError("Connection closed by peer"), 0, report=False)
    seen: list[dict[Any, Any]] = []

    def settled(running: dict[Any, Any]) -> bool:
        seen.append(running)
        return len(seen) >= 3  # the third time it asks, the rest can receive nothing

    assert not guard.drain(timedelta(seconds=0.05), lambda _: False)
    guard.reset(1)
    third = dist.all_reduce(torch.ones(2), async_op=True)  # generation 1: numbered afresh
    guard.fail(RuntimeError("again"), 1, report=False)
    inner.futures[0].set_exception(RuntimeError("closed"))  # ended; forgotten anyway
    assert guard.drain(timedelta(seconds=5), settled)
    world: Any = dist.group.WORLD
    assert seen[0] == {(world.group_name, 0): (0,)}  # its first collective of generation 1
    third.wait()
