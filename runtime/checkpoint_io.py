"""What a checkpoint holds, and the baselines live migration is measured against.

Data-parallel replicas hold the same bulk state, so one rank writes it with
``torch.distributed.checkpoint`` (planned without a process group: tmd's groups are
its own); a model sharded by torch's parallelism (``tmd.runtime.parallel``) is
written by every rank, collectively on the job's default world. Every rank writes
its own small state (RNG streams and data position differ per rank). Loading
restores both, so a restarted job continues exactly where it stopped.
Checkpoint-restart is benchmarked against live migration with this same code; the
cold-standby baseline is ``SessionConfig(prepare_ahead=False, shadow_steps=0)``.
Periodic, atomically committed checkpoints and the global rollback built on these
functions are ``tmd.runtime.checkpoint``.

Loading runs no code a checkpoint's files could name: the small state is written
with ``tmd.runtime.state.encode`` and read with ``decode`` (``torch.load`` with
``weights_only=True``), the bulk is read through ``tmd.runtime.safe_dcp``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tmd.runtime.state import StateDict, TrainState, decode, encode

if TYPE_CHECKING:
    from tmd.runtime.session import Session


def _bulk(state: TrainState) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(state.model, state.optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def write_checkpoint(session: Session, directory: Path) -> None:
    """This rank's part of a checkpoint: the bulk state on rank 0 (every rank's shards,
    written collectively, where the session is ``wrapped``), the small state on every
    rank. Written and synced to disk on return; only a collective write waits for the
    others."""
    from torch.distributed.checkpoint.state_dict_saver import save

    small = encode(session.state.small_state())  # refuses unsafe state before any write
    directory.mkdir(parents=True, exist_ok=True)
    if session.wrapped:
        # Sharded state (tmd.runtime.parallel): every rank writes its shards, through
        # the job's default world, which is tmd's current group.
        save(_bulk(session.state), checkpoint_id=directory / "bulk")
    elif session.rank == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group": intended, see above
            save(_bulk(session.state), checkpoint_id=directory / "bulk", no_dist=True)
    with open(directory / f"small-rank{session.rank}.pt", "wb") as f:
        f.write(small)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(session: Session, directory: Path) -> None:
    """Every worker calls this at the same step boundary; returns once all wrote."""
    write_checkpoint(session, directory)
    done = torch.ones(1)
    assert session.group is not None
    session.group.allreduce([done]).wait()  # nobody exits before every rank has written


def load_checkpoint(session: Session, directory: Path) -> None:
    load_bulk(session.state, directory / "bulk", collective=session.wrapped)
    session.state.load_small_state(read_small_state(directory / f"small-rank{session.rank}.pt"))


def read_small_state(path: Path) -> StateDict:
    """One rank's small state as ``write_checkpoint`` wrote it; ``ValueError`` if the
    file holds anything but plain values and tensors (nothing in it runs)."""
    try:
        small = decode(path.read_bytes(), source=str(path))
    except ValueError as exc:
        if "numpy" not in str(exc):
            raise
        raise ValueError(
            f"{exc}. An earlier tmd pickled numpy's RNG state into every small-rank file, "
            "which cannot be loaded safely: move the checkpoints it wrote out of the "
            "checkpoint directory to start the job afresh"
        ) from exc
    if not isinstance(small, dict):
        raise ValueError(f"{path}: holds a {type(small).__name__}, not a small state")
    return small


def load_bulk(state: TrainState, directory: Path, *, collective: bool = False) -> None:
    """Restore parameters, buffers and optimizer state from ``directory``, written by
    ``torch.distributed.checkpoint``; nothing in its files runs (``safe_dcp``).
    ``collective``: sharded state, every rank of the default world loads its shards."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    from tmd.runtime.safe_dcp import SafePlanner, SafeReader

    bulk = _bulk(state)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load(bulk, storage_reader=SafeReader(directory), planner=SafePlanner(),
                 no_dist=not collective)  # fmt: skip
    except CheckpointException as exc:  # a BaseException, which names no cause itself
        causes = "; ".join(str(error) for error, _ in exc.failures.values())
        raise ValueError(f"{directory}: cannot be restored: {causes}") from exc
    set_state_dict(
        state.model,
        state.optimizer,
        model_state_dict=bulk["model"],
        optim_state_dict=bulk["optimizer"],
    )
