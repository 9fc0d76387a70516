"""The joiner's heartbeat as the leaver watches it (``Heartbeat``, ``PeerWatch``), on a
real TCPStore: a joiner whose wall clock is 30 s off either way is alive while it
beats and lost once it stops, and what an earlier beating period left in the store
is no sign of life."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from tmd.runtime.group import StoreAddress
from tmd.runtime.launch import host_store
from tmd.runtime.liveness import Heartbeat, PeerWatch

NODE = "standby0/0"
BEAT = timedelta(seconds=0.05)
STALE = timedelta(seconds=1.5)
SLACK_S = 1.5  # a loaded 2-core machine may delay the watcher's thread this much
EARLY_S = STALE.total_seconds() - 0.5  # lost no sooner than this: not before stale_after

# A joiner on a machine whose wall clock is off by argv[3] seconds: time.time is
# skewed before the runtime is imported, so all its process reads is the skewed clock.
BEATER = """
import sys, time
real, skew = time.time, float(sys.argv[3])
time.time = lambda: real() + skew
from datetime import timedelta
from tmd.runtime.group import StoreAddress
from tmd.runtime.liveness import Heartbeat
Heartbeat(StoreAddress(sys.argv[1], int(sys.argv[2])), sys.argv[4],
          interval=timedelta(seconds=float(sys.argv[5])))
print("beating", flush=True)
sys.stdin.read()  # beats until killed
"""


@pytest.fixture
def store() -> Iterator[StoreAddress]:
    server = host_store(0)
    yield StoreAddress("127.0.0.1", server.port)


@pytest.fixture
def watch(store: StoreAddress) -> Iterator[Callable[[], PeerWatch]]:
    """Starts a ``PeerWatch`` of ``NODE``; each is closed before the store goes away."""
    started: list[PeerWatch] = []

    def start() -> PeerWatch:
        started.append(PeerWatch(store, NODE, interval=BEAT, stale_after=STALE))
        return started[-1]

    yield start
    for w in started:
        w.close()


def _until(done: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _stays_alive(watch: PeerWatch, for_s: float) -> bool:
    return not _until(watch.lost, for_s)


def _skewed_beater(store: StoreAddress, skew_s: float) -> subprocess.Popen[str]:
    args = [store.host, str(store.port), str(skew_s), NODE, str(BEAT.total_seconds())]
    proc = subprocess.Popen(
        [sys.executable, "-c", BEATER, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "beating"
    return proc


@pytest.mark.parametrize("skew_s", [30.0, -30.0], ids=["ahead", "behind"])
def test_a_joiner_whose_clock_is_off_is_alive_while_it_beats_and_lost_once_it_stops(
    store: StoreAddress, watch: Callable[[], PeerWatch], skew_s: float
) -> None:
    joiner = _skewed_beater(store, skew_s)
    try:
        leaver = watch()
        assert _stays_alive(leaver, 2 * STALE.total_seconds())
        joiner.kill()  # the joiner's machine dies
        joiner.wait()
        stopped = time.monotonic()
        assert not leaver.lost()  # it beat a moment ago
        assert _until(leaver.lost, STALE.total_seconds() + SLACK_S)
        assert time.monotonic() - stopped >= EARLY_S
        # Its last beat, still in the store, is no sign of life to a later watch.
        assert _until(watch().lost, STALE.total_seconds() + SLACK_S)
    finally:
        joiner.kill()
        joiner.wait()


def test_an_earlier_beating_period_is_no_sign_of_life_and_a_new_one_is(
    store: StoreAddress, watch: Callable[[], PeerWatch]
) -> None:
    # A standby that beat while it joined one migration, then stood by again.
    with Heartbeat(store, NODE, interval=BEAT):
        time.sleep(0.3)
    time.sleep(0.2)  # a beat under way at the close has landed
    started = time.monotonic()
    leaver = watch()
    assert _until(leaver.lost, STALE.total_seconds() + SLACK_S)
    assert time.monotonic() - started >= EARLY_S
    # The same standby joins a later migration: it is alive again for a new watch.
    leaver = watch()
    with Heartbeat(store, NODE, interval=BEAT):
        assert _stays_alive(leaver, 2 * STALE.total_seconds())


def test_a_joiner_that_never_beats_is_lost_after_stale_after(
    watch: Callable[[], PeerWatch],
) -> None:
    started = time.monotonic()
    leaver = watch()
    assert _until(leaver.lost, STALE.total_seconds() + SLACK_S)
    assert time.monotonic() - started >= EARLY_S
