"""The load generator's steps: made together as vectors for the usual nodes (each rank
one step due) or a rank at a time, the same steps at the same ends, timed alike."""

from __future__ import annotations

import random

import pytest

from tmd import wire
from tmd.tools import synth

T0 = 1_800_000_000.0


def sender(ranks: int, slow: dict[int, float]) -> synth._Sender:
    spec = synth.SynthSpec(ranks=ranks, via="agent", slow=slow, seed=3)
    members = [wire.Member(r, synth.node_of(r, 8)) for r in range(ranks)]
    return synth._Sender(spec, None, random.Random(3), members, T0)  # type: ignore[arg-type]  # sends nothing


def test_the_usual_nodes_are_made_together_as_each_rank_alone_would_make_them() -> None:
    together, alone = sender(32, {5: 1.5}), sender(32, {5: 1.5})
    now = T0 + 1 + 31 / 32 + 0.001  # every rank's step 1 has ended, none's step 2
    columns = together._due_columns(0, 32, now)
    assert columns is not None
    rows = [row for r in range(32) for row in alone._rows_done(r, now)]
    assert columns[0] == list(range(32))
    assert columns[1] == [row[0] for row in rows] == [1] * 32
    assert columns[2] == pytest.approx([row[1] for row in rows], abs=1e-6)
    for field in range(2, 7):  # durations: the same law (random compute, the rest follows)
        assert columns[field + 1] == pytest.approx([row[field] for row in rows], abs=0.06)
    assert columns[4][5] > 1.4 * columns[4][4]  # rank 5 computes 1.5x as long
    assert together._due_columns(0, 32, now) is None  # step 2 not due: a rank at a time
    # A rank with two steps due (the publisher fell behind) is not the usual case either.
    assert together._due_columns(0, 32, now + 1.5) is None
    assert [len(together._rows_done(r, now + 1.5)) for r in (0, 31)] == [2, 1]
