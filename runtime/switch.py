"""Phase 2 on the members: the switch at the agreed boundary, with a commit vote.

Every member reached this boundary with the same vote sums, so all of them are
here. The switch is two collectives and one small message:

1. the leaver sends the small state (step, RNG, data position, scheduler, ...) to
   the joiner, which already holds bit-identical bulk state (lock-step);
2. stayers and joiner run one all-reduce on the prepared group: everyone is there;
3. every old member runs one all-reduce on the old group: did step 2 succeed
   everywhere? Only then does the leaver leave and the stayers swap groups.

If step 2 fails anywhere (the joiner died), step 3 says so to all, the new group
is dropped and training continues on the old group with nothing lost: the leaver
has not left yet.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import TYPE_CHECKING

import torch

from tmd.errors import MigrationError
from tmd.runtime.migration import Migration

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


def switch(session: Session, mig: Migration) -> None:
    last_step_end = session.timing.step_ends[-1]
    started = time.monotonic()
    stop_s = started - last_step_end
    old = session.group
    assert old is not None
    world = session.world_size
    transfer_s = 0.0
    if mig.is_leaver:
        try:
            mig.finish_preparation(session.state, session.membership)
            mig.send_switch(small_state(session), session.state.step)
        except MigrationError as exc:
            mig.abort_reason = str(exc)
        transfer_s = time.monotonic() - started
        committed = _sum(old, 0) == world - 1
        if committed:
            session.left = True
            _step_aside()
            mig.close(tell_joiner=False)
            session.migration = None
            session.outcomes[mig.id] = "switched"
            session.ack(mig.id, "switched", detail="left")
        else:
            session._abort(mig)
        return
    ok = 1
    new = None
    try:
        mig.finish_preparation(session.state, session.membership)
        new = mig.new_group()
        ok = int(_sum(new, 1) == world)
    except (MigrationError, RuntimeError) as exc:
        ok = 0
        mig.abort_reason = f"commit on the new group failed: {exc}"
    if _sum(old, ok) != world - 1 or new is None:
        mig.abort_reason = mig.abort_reason or "another member failed to commit"
        session._abort(mig)
        return
    session._retired.append(old)
    session.group = new
    session.membership.nodes[mig.leaver_rank] = mig.prepare.joiner
    session.membership.generation += 1
    session.telemetry.set_rank(session.rank, session.membership.generation)
    session.migration = None
    session.outcomes[mig.id] = "switched"
    resumed = time.monotonic()
    session._pending_switch = {
        "migration_id": mig.id,
        "last_step_end": last_step_end,
        "resumed": resumed,
        "stop_s": stop_s,
        "transfer_s": transfer_s,
        "switch_s": resumed - started,
    }
    session._mark_step_end(resumed)
    session.publish_status()
