"""``tmd sim --live``'s plan of failures: deterministic for a seed, one kind after
another, each with a cause of the mix that maps to that kind (the run itself is in
``tests/integration/test_sim_live.py``)."""

from __future__ import annotations

import pytest

from tmd.sim import mixes
from tmd.sim.live import SIGNALS, LiveSettings, plan


def test_the_plan_takes_every_kind_in_turn_with_causes_of_that_kind() -> None:
    s = LiveSettings(seconds=40, failures=8, seed=3)
    episodes = plan(s)
    assert [(e.t_s, e.signal, e.cause) for e in episodes] == [
        (e.t_s, e.signal, e.cause) for e in plan(s)
    ]
    kinds = [e.signal for e in episodes]
    assert sorted(kinds[:4]) == sorted(SIGNALS) and kinds[4:] == kinds[:4]
    times = [e.t_s for e in episodes]
    assert times == sorted(times) and times[0] > 0 and times[-1] < s.seconds
    mix = {c.name: c.signal for c in mixes.load(s.mix).causes}
    slow = {c.name for c in mixes.load_failslow().causes}
    for e in episodes:
        if e.signal == "planned":
            assert e.cause == mixes.PLANNED_CAUSE
        elif e.signal == "straggler":
            assert e.cause in slow
        else:
            assert mix[e.cause] == e.signal


def test_only_the_kinds_asked_for_and_never_an_unknown_one() -> None:
    assert {e.signal for e in plan(LiveSettings(signals=("xid",), failures=3))} == {"xid"}
    with pytest.raises(ValueError, match="hang"):
        plan(LiveSettings(signals=("hang",)))
