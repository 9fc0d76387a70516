"""A member's step history, and the downtime of a switch measured against it.

Downtime (``shared/DESIGN.md``) is the time from the end of the last step before a
switch (its optimizer update, before the boundary where the switch runs) to the end
of the first step after it, minus one median step: the switch's own wall time lies
inside that window. The session
keeps the history (``StepTimes``); a switch leaves a ``PendingSwitch`` that becomes a
``wire.Downtime`` once that first step has ended. All times are ``time.monotonic()``,
all durations seconds.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from tmd import wire


@dataclass
class StepTimes:
    """Recent step ends and durations of this member, and the data-loading time of
    the step in progress."""

    data_s: float = 0.0
    step_ends: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    durations: deque[float] = field(default_factory=lambda: deque(maxlen=64))

    def median_step_s(self) -> float:
        return statistics.median(self.durations) if self.durations else 0.0

    def mark_step_end(self, when: float) -> None:
        self.step_ends.append(when)
        self.data_s = 0.0

    def inherit(self, median_step_s: float) -> None:
        """Start over from another member's median (this process took over its rank)."""
        self.durations.clear()
        self.durations.append(median_step_s)


@dataclass(frozen=True)
class PendingSwitch:
    """A switch this member took part in, waiting for the end of its first step."""

    migration_id: str
    last_step_end: float
    """End of the last step before the switch (a joiner: when the state began to arrive)."""
    resumed: float
    """When this member started training on the new group."""
    stop_s: float = 0.0
    transfer_s: float = 0.0
    switch_s: float = 0.0

    def downtime(self, first_step_end: float, median_step_s: float) -> wire.Downtime:
        """The switch's cost, unclamped: its parts add up to the total (``first_step_s``
        is whatever the first step took beyond a median one, which noise can make
        negative)."""
        total = first_step_end - self.last_step_end - median_step_s
        return wire.Downtime(
            total_s=total,
            stop_s=max(0.0, self.stop_s),
            transfer_s=max(0.0, self.transfer_s),
            switch_s=max(0.0, self.switch_s),
            first_step_s=total - max(0.0, self.stop_s) - max(0.0, self.transfer_s)
            - max(0.0, self.switch_s),
        )  # fmt: skip
