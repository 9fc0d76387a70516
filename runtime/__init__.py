"""tmd.runtime: live migration inside a torch.distributed data-parallel job.

The training script opens a ``session`` around its own loop; the session owns the
swappable process group, the gradient all-reduce and the step boundary, and the
same script runs as worker or as standby. See ``tmd.runtime.session`` for the loop,
``tmd.runtime.env`` for the environment contract (``TMD_ROLE``, ``TMD_JOB``,
``TMD_NODE``, ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` or
``TMD_STORE``, ``TMD_HOST``, ``TMD_BROKER``, ``TMD_BACKEND``), and
``tmd.runtime.control.JobController`` for driving migrations from Python. Wrap
the script's entry point in ``run`` so a job that must roll back to its checkpoint
exits with ``EX_RESTART`` (``tmd.runtime.checkpoint``).

This package imports nothing of the daemon: only ``tmd.wire`` and ``tmd.errors``.
"""

from tmd.runtime.checkpoint import EX_RESTART, run
from tmd.runtime.control import JobController, StoreControl
from tmd.runtime.data import ResumableSampler
from tmd.runtime.env import RuntimeEnv
from tmd.runtime.session import Session, session
from tmd.runtime.session_config import SessionConfig

__all__ = [
    "EX_RESTART",
    "JobController",
    "ResumableSampler",
    "RuntimeEnv",
    "Session",
    "SessionConfig",
    "StoreControl",
    "run",
    "session",
]
