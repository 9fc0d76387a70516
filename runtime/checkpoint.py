"""Periodic checkpoints and the global rollback: the fallback where no replica can serve.

Every ``SessionConfig.checkpoint_every`` steps, at the step boundary, every worker
writes its part (``checkpoint_io.write_checkpoint``: the bulk state on rank 0, or
every rank's shards where the model is sharded by torch's parallelism; its own small
state on every rank) into ``{checkpoint_dir}/.tmp-step-{n:09d}`` and counts
itself in the store. Rank 0 waits until every rank has, writes the commit marker
and renames the directory to ``step-{n:09d}``. A checkpoint is complete exactly
when a ``step-*`` directory holds the marker, so a crash at any moment leaves the
earlier checkpoints and maybe a complete new one, never a partial one that loads.
Rank 0 then prunes to the newest ``KEEP``.

On ``Session.__enter__`` every worker of a job with a ``checkpoint_dir`` restores
the latest complete checkpoint: rank 0 lists the directory and publishes the step
in the store; the others load that step and never list the directory themselves,
so no two ranks can pick different steps. That is the global rollback. When
in-place failover cannot serve (``tmd.runtime.failover``) the survivors raise
``RestartRequired``, their processes exit with ``EX_RESTART`` (``run``), the
launcher starts the whole job again on a fresh store, and every rank resumes from
the same step with the state it had then, RNG streams and data position included.

Requirements: every rank sees the same ``checkpoint_dir`` (a shared file system
across machines), and the job's store is fresh for every start of the job
(``tmd launch`` hosts a new one per restart), so no key of an earlier start is read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, ParamSpec, TypeVar

from tmd.errors import ConfigError, RestartRequired
from tmd.runtime.checkpoint_io import load_checkpoint, write_checkpoint
from tmd.runtime.control import put

if TYPE_CHECKING:
    from tmd.runtime.session import Session

EX_RESTART: Final = 75
"""Exit status of a process that needs the job restarted from its checkpoint
(``EX_TEMPFAIL`` of sysexits.h)."""
KEEP: Final = 2
MARKER: Final = "commit.json"
_RESTORE_KEY: Final = "tmd/ckpt/restore"
_STEP_DIR = re.compile(r"^step-(\d{9,})$")
_TMP_PREFIX: Final = ".tmp-step-"
_TRASH_PREFIX: Final = ".trash-"

log = logging.getLogger("tmd.runtime.checkpoint")

# -- the directory ---------------------------------------------------------------------


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def read_marker(path: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def complete_steps(root: Path) -> list[int]:
    """Steps of the complete checkpoints under ``root``, oldest first."""
    if not root.is_dir():
        return []
    steps = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match is None:
            continue
        marker = read_marker(path)
        if marker is not None and marker.get("step") == int(match[1]):
            steps.append(int(match[1]))
    return sorted(steps)


def latest_step(root: Path) -> int | None:
    """The step of the newest complete checkpoint under ``root``, if any."""
    steps = complete_steps(root)
    return steps[-1] if steps else None


def commit(tmp: Path, root: Path, *, step: int, world_size: int) -> Path:
    """Mark ``tmp`` complete and give it its final name; rank 0, once every rank wrote."""
    _write_synced(tmp / MARKER, json.dumps({"step": step, "world_size": world_size}).encode())
    final = step_dir(root, step)
    if final.exists():  # an earlier start of this job got this far; same state
        _discard(final)
    tmp.rename(final)
    _sync_dir(root)
    return final


def prune(root: Path, *, keep: int = KEEP) -> None:
    """Drop all but the newest ``keep`` complete checkpoints, and everything unfinished."""
    kept = {step_dir(root, step).name for step in complete_steps(root)[-keep:]} if keep else set()
    for path in root.iterdir():
        if path.name in kept:
            continue
        if _STEP_DIR.match(path.name) or path.name.startswith(_TMP_PREFIX):
            _discard(path)
        elif path.name.startswith(_TRASH_PREFIX):
            shutil.rmtree(path, ignore_errors=True)


def _discard(path: Path) -> None:
    # Renamed first: a checkpoint deleted halfway must not still look complete.
    trash = path.with_name(f"{_TRASH_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    path.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _sync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- the session's side ----------------------------------------------------------------


def _root(session: Session) -> Path:
    directory = session.config.checkpoint_dir
    assert directory is not None
    return Path(directory)


def save(session: Session) -> int | None:
    """Every worker, at the same boundary. Returns the step committed (on rank 0), or
    None: another rank, or (on rank 0) a checkpoint dropped because a rank failed or
    was late."""
    root, step, store = _root(session), session.state.step, session.store
    tmp = root / f"{_TMP_PREFIX}{step:09d}"
    done, failed = f"tmd/ckpt/{step}/done", f"tmd/ckpt/{step}/failed"
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        write_checkpoint(session, tmp)
    # A full or lost disk costs this checkpoint, not the job. A sharded (collective)
    # write fails on every rank when one rank's does: a BaseException, named here.
    except (OSError, CheckpointException) as exc:
        log.warning("rank %d could not write its part of step %d: %s", session.rank, step, exc)
        put(store, failed, str(session.rank).encode())
    store.add(done, 1)
    if session.rank != 0:
        return None
    deadline = time.monotonic() + session.config.group_timeout.total_seconds()
    while int(store.add(done, 0)) < session.world_size:
        # A rank that died before writing never counts itself: the failover that
        # follows at the next collective takes over, and this checkpoint is dropped.
        if session.member_failed() or time.monotonic() > deadline:
            break
        time.sleep(0.002)
    else:
        if not store.check([failed]):
            commit(tmp, root, step=step, world_size=session.world_size)
            prune(root)
            return step
    log.warning("checkpoint at step %d dropped: not every rank wrote its part", step)
    return None


def agreed_latest(session: Session) -> int | None:
    """Every worker, after a ``save``: the latest complete checkpoint as rank 0 sees
    it, the same answer on every rank (None: there is none)."""
    key = f"tmd/ckpt/latest-after/{session.state.step}"
    if session.rank == 0:
        step = latest_step(_root(session))
        put(session.store, key, json.dumps(step).encode())
        return step
    try:
        session.store.wait([key], session.config.group_timeout)
    except RuntimeError:  # rank 0 died while writing: the restart goes on, from what is there
        log.warning("rank 0 did not say which checkpoint the restart resumes from")
        return latest_step(_root(session))
    found: int | None = json.loads(bytes(session.store.get(key)))
    return found


def restore(session: Session) -> int | None:
    """Load the latest complete checkpoint on every worker; rank 0 picks it. Returns
    its step, or None where there is none (the job starts at step 0)."""
    root = _root(session)
    if session.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        prune(root)  # leftovers of an earlier start that stopped mid-checkpoint
        step = latest_step(root)
        put(session.store, _RESTORE_KEY, b"none" if step is None else str(step).encode())
    else:
        decided = bytes(session.store.get(_RESTORE_KEY)).decode()  # waits for rank 0
        step = None if decided == "none" else int(decided)
    if step is None:
        return None
    path = step_dir(root, step)
    marker = read_marker(path) or {}
    if marker.get("world_size") != session.world_size:
        raise ConfigError(
            "checkpoint_dir",
            f"{path} holds {marker.get('world_size')} ranks, this job has {session.world_size}",
        )
    load_checkpoint(session, path)
    return step


# -- the process's side ----------------------------------------------------------------

P = ParamSpec("P")
R = TypeVar("R")


def run(main: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
    """Call ``main``; a ``RestartRequired`` escaping it exits the process with
    ``EX_RESTART``, which ``tmd launch --max-restarts`` reads as "start the job again
    from its checkpoint" (any other exception keeps its usual exit status 1).

        if __name__ == "__main__":
            tmd.runtime.run(train)
    """
    try:
        return main(*args, **kwargs)
    except RestartRequired as exc:
        print(f"tmd: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EX_RESTART) from exc
