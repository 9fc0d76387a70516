"""A rank in the view: what it last reported, its column of its job's recent steps
(``StepColumns``), and the count of what became of the steps a message brought."""

from __future__ import annotations

from dataclasses import dataclass

from tmd.daemon.columns import TIMING_FIELDS, StepColumns


@dataclass(slots=True)
class StepsApplied:
    """Steps the view took, by outcome; one per message, added to by each batch."""

    accepted: int = 0
    duplicate: int = 0
    late: int = 0


class RankState:
    """One rank: what it last reported, and its column of the job's ``StepColumns``
    (its recent steps, row ``step % window``; its last step and report). Valid while
    its job's view holds it: a rank that left gave its column back, for another."""

    __slots__ = (
        "col",
        "cols",
        "duplicates",
        "generation",
        "late",
        "node",
        "rank",
        "run",
        "seq",
        "seq_doubted_until",
        "total_steps",
        "window",
    )

    def __init__(self, rank: int, node: str, cols: StepColumns) -> None:
        self.rank = rank
        self.node = node
        self.cols = cols
        self.col = cols.take(rank)
        self.window = cols.window
        self.generation = 0
        self.run = 0
        self.total_steps = 0
        self.duplicates = 0
        # What it published itself: its last number, stamp, run and generation, and
        # until when its numbers are not believed (``ClusterView.rank_gap``).
        self.seq: tuple[int, float, int | None, int] | None = None
        self.seq_doubted_until = 0.0
        self.late = 0

    @property
    def last_step(self) -> int:
        """The highest step its column holds (-1: none), kept in the columns
        (``StepColumns.last_step``): a detector reads every rank's at once."""
        return self.cols.w_last_step[self.col]

    @last_step.setter
    def last_step(self, step: int) -> None:
        self.cols.w_last_step[self.col] = step

    @property
    def last_seen(self) -> float:
        """When (daemon time) it last reported (0: never), in the columns too."""
        return self.cols.w_last_seen[self.col]

    @last_seen.setter
    def last_seen(self, now: float) -> None:
        self.cols.w_last_seen[self.col] = now

    @property
    def steps(self) -> list[int]:
        """The steps its column holds, by row (-1: none)."""
        return [int(t) - 1 for t in self.cols.tags[:, self.col]]

    def add(
        self, into: StepsApplied, step: int, end_ts: float, step_s: float, compute_s: float,
        allreduce_s: float, optimizer_s: float, data_s: float,
    ) -> None:  # fmt: skip
        """One step into its row of the column, counted in ``into`` as accepted, a
        duplicate (its row holds it already) or late (older than the window)."""
        cols, col, window = self.cols, self.col, self.window
        last = cols.w_last_step[col]
        if step <= last - window:
            self.late += 1
            into.late += 1
            return
        slot = step % window
        tags = cols.w_tags
        if tags[slot, col] == step + 1:
            self.duplicates += 1
            into.duplicate += 1
            return
        tags[slot, col] = step + 1
        cols.w_end_ts[slot, col] = end_ts
        t = cols.w_timings  # [field * window + slot, col]
        t[slot, col] = step_s
        t[window + slot, col] = compute_s
        t[2 * window + slot, col] = allreduce_s
        t[3 * window + slot, col] = optimizer_s
        t[4 * window + slot, col] = data_s
        if step > last:
            cols.w_last_step[col] = step
        self.total_steps += 1
        into.accepted += 1

    def busy_at(self, step: int) -> float | None:
        """Time the rank spent on ``step`` other than waiting for its peers (the step
        minus the all-reduce wait), or None if the step is not held."""
        cols, col = self.cols, self.col
        slot = step % self.window
        if cols.tags[slot, col] != step + 1:
            return None
        return float(cols.timings[0, slot, col] - cols.timings[2, slot, col])

    def new_run(self, run: int) -> None:
        """The job's launcher started it again: generations from 0, steps from its
        checkpoint."""
        self.reset()
        self.run, self.generation = run, 0

    def reset(self) -> None:
        """Forget the held steps (kept: the counters, which only ever grow)."""
        self.cols.tags[:, self.col] = 0
        self.last_step = -1

    def recent(self, field_name: str = "compute_s", *, last: int | None = None) -> list[float]:
        """Values of ``field_name`` for the held steps among the last ``last`` (default:
        the whole window), oldest first. O(last): the ring is walked in step order."""
        offset = TIMING_FIELDS.index(field_name)
        n = self.window if last is None else min(last, self.window)
        cols, col, window = self.cols, self.col, self.window
        out = []
        for step in range(max(0, self.last_step - n + 1), self.last_step + 1):
            slot = step % window
            if cols.tags[slot, col] == step + 1:
                out.append(float(cols.timings[offset, slot, col]))
        return out
