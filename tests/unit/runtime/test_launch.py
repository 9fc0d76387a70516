"""When ``tmd launch`` starts a job again: a pure decision over exit statuses."""

from __future__ import annotations

import pytest

from tmd.runtime.checkpoint import EX_RESTART
from tmd.runtime.launch import needs_restart

MEMBERS = ["worker0", "worker1", "worker2"]
KILLED = -9


@pytest.mark.parametrize(
    ("codes", "stopped", "restart"),
    [
        # Running normally, or one rank killed and a standby replacing it.
        ({"worker0": None, "worker1": None, "worker2": None}, False, False),
        ({"worker0": None, "worker1": KILLED, "worker2": None, "standby0": None}, False, False),
        # A survivor could not recover in place: at once, whatever else still runs.
        ({"worker0": EX_RESTART, "worker1": KILLED, "worker2": None}, False, True),
        # Every member ended and one of them badly: nobody is left to ask for it.
        ({"worker0": KILLED, "worker1": KILLED, "worker2": KILLED, "standby0": None}, False, True),
        ({"worker0": 1, "worker1": 0, "worker2": 0}, False, True),
        # A clean end, or one the job reported as stopped.
        ({"worker0": 0, "worker1": 0, "worker2": 0, "standby0": None}, False, False),
        ({"worker0": 0, "worker1": 0, "worker2": 3}, True, False),
        # A standby that failed is no member: the job goes on.
        ({"worker0": None, "worker1": None, "worker2": None, "standby0": 3}, False, False),
    ],
)
def test_needs_restart(codes: dict[str, int | None], stopped: bool, restart: bool) -> None:
    assert needs_restart(codes, MEMBERS, stopped=stopped) is restart


def test_members_come_from_the_status_after_a_failover() -> None:
    # standby0 holds rank 1 now; the killed worker1 no longer counts.
    members = ["worker0", "standby0", "worker2"]
    codes = {"worker0": None, "worker1": KILLED, "worker2": None, "standby0": None}
    assert not needs_restart(codes, members, stopped=False)
    codes = {"worker0": 0, "worker1": KILLED, "worker2": 0, "standby0": KILLED}
    assert needs_restart(codes, members, stopped=False)
