"""Phase 2 on the members: the switch at the agreed boundary, with a commit vote.

Every member reached this boundary with the same vote sums, so all of them are
here. The switch is two collectives and one small message:

1. each leaver process sends the small state (step, RNG, data position, scheduler, ...) to
   the joiner, which already holds bit-identical bulk state (lock-step);
2. stayers and joiner run one all-reduce on the prepared group: everyone is there;
3. every old member runs one all-reduce on the old group: did step 2 succeed
   everywhere? Only then do the leaving machine's processes leave and the stayers
   swap groups.

If step 2 fails anywhere (the joiner died), step 3 says so to all, the new group
is dropped and training continues on the old group with nothing lost: the leaver
has not left yet.

These functions run the protocol and say how it ended; the session acts on that
(``Session.reconfigure`` with the stayer's ``Reconfiguration``, or an abort).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

import torch

from tmd.errors import MigrationError
from tmd.runtime.membership import Reconfiguration
from tmd.runtime.migration import Migration
from tmd.runtime.timing import PendingSwitch

if TYPE_CHECKING:
    from tmd.runtime.session import Session


def _sum(group: object, value: int) -> int:
    tensor = torch.tensor([value], dtype=torch.int64)
    group.allreduce([tensor]).wait()  # type: ignore[attr-defined]
    return int(tensor.item())


def _step_aside() -> None:
    # The leaver is done with the job. Whatever it still does (the user's epilogue,
    # interpreter teardown) must not take CPU from ranks that share its host.
    with contextlib.suppress(OSError):
        os.nice(19)


def small_state(session: Session) -> dict[str, object]:
    # The joiner has no step history of its own; it measures its first step
    # against the leaver's median.
    return {**session.state.small_state(), "median_step_s": session.timing.median_step_s()}


def leave(session: Session, mig: Migration) -> bool:
    """The leaver's half: send the small state, then hear whether every other member
    committed on the new group. True: this process is out of the job (the migration
    is closed); False: the switch is aborted and this process stays."""
    assert session.group is not None
    try:
        mig.finish_preparation(session.state, session.membership)
        mig.send_switch(small_state(session), session.state.step)
    except MigrationError as exc:
        mig.abort_reason = str(exc)
    if _sum(session.group, 0) != mig.stayers:
        return False
    _step_aside()
    mig.close(tell_joiner=False)
    return True


def commit(session: Session, mig: Migration) -> Reconfiguration | None:
    """A stayer's half: commit on the new group, then confirm on the old one. Returns
    this member's place in the new group, or None: the switch is aborted
    (``mig.abort_reason`` says why) and everyone stays on the old group."""
    last_step_end = session.timing.step_ends[-1]
    started = time.monotonic()
    old, world = session.group, session.world_size
    assert old is not None
    ok = 1
    new = inner = None
    try:
        mig.finish_preparation(session.state, session.membership)
        new, inner = mig.new_group(), mig.new_inner()
        ok = int(_sum(new, 1) == world)
    except (MigrationError, RuntimeError) as exc:
        ok = 0
        mig.abort_reason = f"commit on the new group failed: {exc}"
    if _sum(old, ok) != mig.stayers or new is None:
        mig.abort_reason = mig.abort_reason or "another member failed to commit"
        return None
    resumed = time.monotonic()
    timing = PendingSwitch(
        mig.id, last_step_end=last_step_end, resumed=resumed,
        stop_s=started - last_step_end, switch_s=resumed - started,
    )  # fmt: skip
    return Reconfiguration(new, mig.after(session.membership), rank=session.rank, switch=timing,
                           inner=inner)  # fmt: skip
