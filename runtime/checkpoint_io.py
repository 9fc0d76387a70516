"""What a checkpoint holds, and the baselines live migration is measured against.

Data-parallel replicas hold the same bulk state, so one rank writes it with
``torch.distributed.checkpoint`` (planned without a process group: tmd's groups are
its own) and every rank writes its own small state (RNG streams and data position
differ per rank). Loading restores both, so a restarted job continues exactly
where it stopped. Checkpoint-restart is benchmarked against live migration with
this same code; the cold-standby baseline is ``SessionConfig(prepare_ahead=False,
shadow_steps=0)``. Periodic, atomically committed checkpoints and the global
rollback built on these functions are ``tmd.runtime.checkpoint``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from tmd.runtime.session import Session


def _bulk(session: Session) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(session.state.model, session.state.optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


def write_checkpoint(session: Session, directory: Path) -> None:
    """This rank's part of a checkpoint: the bulk state on rank 0, the small state on
    every rank. Written and synced to disk on return; nothing waits for the others."""
    from torch.distributed.checkpoint.state_dict_saver import save

    directory.mkdir(parents=True, exist_ok=True)
    if session.rank == 0:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group": intended, see above
            save(_bulk(session), checkpoint_id=directory / "bulk", no_dist=True)
    with open(directory / f"small-rank{session.rank}.pt", "wb") as f:
        torch.save(session.state.small_state(), f)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(session: Session, directory: Path) -> None:
    """Every worker calls this at the same step boundary; returns once all wrote."""
    write_checkpoint(session, directory)
    done = torch.ones(1)
    assert session.group is not None
    session.group.allreduce([done]).wait()  # nobody exits before every rank has written


def load_checkpoint(session: Session, directory: Path) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    bulk = _bulk(session)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load(bulk, checkpoint_id=directory / "bulk", no_dist=True)
    set_state_dict(
        session.state.model,
        session.state.optimizer,
        model_state_dict=bulk["model"],
        optim_state_dict=bulk["optimizer"],
    )
    small = torch.load(directory / f"small-rank{session.rank}.pt", weights_only=False)
    session.state.load_small_state(small)
