"""The daemon's judgement of its own view: stale while disconnected or lagging, then
settling, then trusted, with silences counted from when it became current."""

from __future__ import annotations

import math

from tmd.daemon.freshness import Freshness

T0 = 1_800_000_000.0


def fresh(t: float = T0) -> Freshness:
    f = Freshness(interval_s=1.0, max_lag_s=2.0, settle_s=5.0)
    f.connection(True, t)
    f.answered(t, t + 0.01)
    return f


def test_a_view_is_trusted_only_once_current_and_settled() -> None:
    f = Freshness(interval_s=1.0, max_lag_s=2.0, settle_s=5.0)
    assert f.state(T0) == "stale" and f.since(T0) is None  # never connected
    f.connection(True, T0)
    assert f.stale(T0)  # subscribed, but no probe read back yet
    f.answered(T0, T0 + 0.01)
    assert f.state(T0 + 1) == "settling" and f.since(T0 + 1) is None
    for t in range(1, 6):  # probes keep coming back
        f.answered(T0 + t, T0 + t + 0.01)
    assert f.state(T0 + 5.5) == "current" and f.since(T0 + 5.5) == T0 + 0.01


def test_no_probe_back_makes_it_stale_when_asked() -> None:
    """A paused broker (or a blocked loop) returns no probe: the gap shows at the
    next question, whatever ran first after it."""
    f = fresh()
    for t in range(1, 7):
        f.answered(T0 + t, T0 + t + 0.01)
    assert f.since(T0 + 7) is not None
    assert f.since(T0 + 6 + 1 + 2.5) is None  # newest known point 3.5 s old > 1 + 2
    assert math.isclose(f.lag_s(T0 + 9.5), 2.5)
    f.answered(T0 + 7, T0 + 9.6)  # a late probe: 2.6 s behind
    assert f.stale(T0 + 9.6)
    f.answered(T0 + 9.6, T0 + 9.7)  # caught up: current again, and settles anew
    assert f.state(T0 + 9.8) == "settling"
    for t in range(11, 15):
        f.answered(T0 + t, T0 + t + 0.01)
    assert f.since(T0 + 9.7 + 5.1) == T0 + 9.7  # silences count from here


def test_a_lost_connection_settles_again_even_when_short() -> None:
    f = fresh()
    for t in range(1, 7):
        f.answered(T0 + t, T0 + t + 0.01)
    f.connection(False, T0 + 6.5)
    assert f.state(T0 + 6.6) == "stale"
    f.connection(True, T0 + 6.8)
    f.answered(T0 + 6.8, T0 + 6.9)
    assert f.state(T0 + 7) == "settling"


def test_a_view_fed_directly_is_always_trusted() -> None:
    f = Freshness.always()
    assert f.state(T0) == "current" and f.since(T0) == -math.inf
    assert f.lost(T0) and f.since(T0 + 1) == -math.inf  # nothing on the way to lose


def test_messages_lost_on_the_way_settle_the_view_anew() -> None:
    """A probe back in time says the view is recent, not whole: a loss ingest found
    (gaps in the agents' sequence numbers) settles it again, and silences count from
    the loss."""
    f = fresh()
    for t in range(1, 7):
        f.answered(T0 + t, T0 + t + 0.01)
    assert f.since(T0 + 6.5) == T0 + 0.01
    f.answered(T0 + 7, T0 + 7.01)
    assert f.lost(T0 + 7.02)  # it was trusted
    assert f.state(T0 + 7.5) == "settling" and f.since(T0 + 7.5) is None
    f.answered(T0 + 8, T0 + 8.01)
    assert not f.lost(T0 + 8)  # settling: not trusted, but settles from here
    for t in range(9, 14):
        f.answered(T0 + t, T0 + t + 0.01)
    assert f.since(T0 + 13.5) == T0 + 8
    f.connection(False, T0 + 14)
    assert not f.lost(T0 + 14.5)  # stale: the probe, not the loss, says when it is current
    assert f.fresh_since is None
