"""A job's recent steps as columns: one column per reporting rank, one row per step.

Row ``step % window`` of column ``c`` holds that step of the rank in column ``c``
(``tags`` says which step a row holds: the step + 1, 0 none): its end time and its
durations in ``TIMING_FIELDS`` order. What reads a whole job at one step (the straggler detector:
every rank's busy time at a step, their median) takes a row as one vector instead of
one Python object per rank. A rank that leaves gives its column back for the next
to take; the arrays grow by doubling, so a rank joining costs O(1) amortized.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

TIMING_FIELDS: Final = ("step_s", "compute_s", "allreduce_s", "optimizer_s", "data_s")
"""Order of the per-step durations in ``StepColumns.timings``."""
NF: Final = len(TIMING_FIELDS)


class StepColumns:
    """``window`` rows of steps for up to ``capacity`` ranks (it grows on demand)."""

    __slots__ = ("end_ts", "free", "last_seen", "last_step", "n", "rank", "tags", "timings",
                 "w_end_ts", "w_last_seen", "w_last_step", "w_tags", "w_timings",
                 "window")  # fmt: skip

    def __init__(self, window: int, capacity: int = 8) -> None:
        self.window = window
        self.n = 0  # columns ever handed out; those in ``free`` are not in use
        self.free: list[int] = []
        # The step each row holds, + 1 (0: none), so that new columns are zeros: memory
        # the system hands out untouched until written, one row a step. A fill of -1
        # wrote a job's 131,072 columns at once (134 MB, up to half a second when huge
        # pages had to be compacted for it) in its first second, the busiest.
        self.tags: npt.NDArray[np.int64] = np.zeros((window, capacity), np.int64)
        self.end_ts: npt.NDArray[np.float64] = np.zeros((window, capacity), np.float64)
        # float32: a duration to 7 digits is plenty, and half the memory at 131k ranks.
        self.timings: npt.NDArray[np.float32] = np.zeros((NF, window, capacity), np.float32)
        self.rank: npt.NDArray[np.int64] = np.full(capacity, -1, np.int64)
        # Each column's rank: its highest step held (-1: none), and when (daemon time)
        # it last reported; what a detector reads of every rank at each tick.
        self.last_step: npt.NDArray[np.int64] = np.full(capacity, -1, np.int64)
        self.last_seen: npt.NDArray[np.float64] = np.zeros(capacity, np.float64)
        self._writers()

    def _writers(self) -> None:
        """Memoryviews of the arrays, for the one-element writes of ingest: indexing one
        costs about half what a numpy scalar assignment does. ``w_timings`` is
        ``timings`` as ``[NF * window, capacity]``: field ``f`` of row ``r`` is row
        ``f * window + r``."""
        window, capacity = self.window, self.capacity
        self.w_tags = self.tags.data.cast("B").cast("q", [window, capacity])
        self.w_end_ts = self.end_ts.data.cast("B").cast("d", [window, capacity])
        flat = self.timings.reshape(NF * window, capacity)  # a view: the same memory
        self.w_timings = flat.data.cast("B").cast("f", [NF * window, capacity])
        self.w_last_step = self.last_step.data.cast("B").cast("q")
        self.w_last_seen = self.last_seen.data.cast("B").cast("d")

    @property
    def capacity(self) -> int:
        return int(self.rank.shape[0])

    def take(self, rank: int) -> int:
        """A column for ``rank``, empty."""
        if self.free:
            col = self.free.pop()
        else:
            if self.n == self.capacity:
                self._grow(2 * self.capacity)
            col = self.n
            self.n += 1
        self.rank[col] = rank  # its rows hold no step: new, or emptied by ``give_back``
        return col

    def give_back(self, col: int) -> None:
        self.rank[col] = -1
        self.tags[:, col] = 0
        self.last_step[col] = -1
        self.last_seen[col] = 0.0
        self.free.append(col)

    def in_use(self) -> npt.NDArray[np.intp]:
        """The columns a rank holds."""
        return np.flatnonzero(self.rank[: self.n] >= 0)

    def reserve(self, ranks: int) -> None:
        """Room for ``ranks`` columns in all, made now: a job whose status lists its
        members takes one allocation for them rather than a copy at each doubling
        (at 131,072 ranks the doublings copied 0.6 GB, seconds of the first step)."""
        if ranks > self.capacity:
            self._grow(ranks)

    def _grow(self, capacity: int) -> None:
        """Room for ``capacity`` columns; the new ones hold no step."""
        old = self.capacity
        tags = np.zeros((self.window, capacity), np.int64)
        tags[:, :old] = self.tags
        end_ts = np.zeros((self.window, capacity), np.float64)
        end_ts[:, :old] = self.end_ts
        timings = np.zeros((NF, self.window, capacity), np.float32)
        timings[:, :, :old] = self.timings
        rank = np.full(capacity, -1, np.int64)
        rank[:old] = self.rank
        last_step = np.full(capacity, -1, np.int64)
        last_step[:old] = self.last_step
        last_seen = np.zeros(capacity, np.float64)
        last_seen[:old] = self.last_seen
        self.tags, self.end_ts, self.timings, self.rank = tags, end_ts, timings, rank
        self.last_step, self.last_seen = last_step, last_seen
        self._writers()

    def held(self, step: int) -> npt.NDArray[np.bool_]:
        """Which of the first ``n`` columns hold ``step``."""
        held: npt.NDArray[np.bool_] = self.tags[step % self.window, : self.n] == step + 1
        return held
