"""The settings of a training session (``SessionConfig``), one place for every
timeout and knob of the runtime; each timeout is a ``timedelta``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from tmd.errors import ConfigError


@dataclass(frozen=True)
class SessionConfig:
    """Every setting of a ``Session``; checked when built, so a bad one fails at start."""

    bucket_bytes: int = 25 << 20
    shadow_steps: int = 2
    """Sandboxed iterations a standby runs before it reports ready."""
    max_grad_norm: float | None = None
    """Clip the averaged gradients; applied identically by a lock-step joiner."""
    store_timeout: timedelta = timedelta(seconds=60)
    group_timeout: timedelta = timedelta(seconds=60)
    """Bounds building a group and every collective on it."""
    control_poll: timedelta = timedelta(milliseconds=50)
    """How often the control channel's thread reads the store log (commands are
    acted on at the next step boundary anyway)."""
    telemetry_flush: timedelta = timedelta(seconds=1)
    telemetry_queue: int = 4096
    eager_copy: bool = False
    """Copy the bulk state to the joiner as soon as the groups are built, not when
    the switch is requested: the switch can then come sooner, but every step until
    it pays for forwarding gradients."""
    prepare_ahead: bool = True
    """Build the next group and copy the state during prepare (live migration).
    ``False`` is the cold-standby baseline: everything happens at the switch."""
    command_max_age: timedelta = timedelta(seconds=120)
    """A command over MQTT stamped longer ago than this, by this process's clock, is
    ignored (so is a retained one): a replay never moves the job. It must exceed the
    clock skew between the head node and the training machines."""
    joiner_timeout: timedelta = timedelta(seconds=5)
    """A joiner whose heartbeat is older than this is given up (the migration aborts)."""
    detect_timeout: timedelta = timedelta(seconds=10)
    """After a collective fails, how long survivors wait for each other to agree on
    which rank died."""
    detect_settle: timedelta = timedelta(milliseconds=250)
    """Survivors stop waiting for each other once the missing ranks make up whole
    machines, none of their processes answered as present, and nobody registered for
    this long (a machine's ranks die together). A live member still computing its
    step answers as present from a thread at once, and is waited for."""
    status_every: int = 100
    """Steps between two status publications by rank 0 (plus one at every change)."""
    standby_wait: timedelta = timedelta(seconds=5)
    """After a rank died, how long the donor waits for a standby to become ready (one
    still warming up) before giving up on in-place failover."""
    checkpoint_dir: str | os.PathLike[str] | None = None
    """Where periodic checkpoints go, one directory every rank sees. A worker whose
    directory holds a complete checkpoint resumes from the latest one at start."""
    checkpoint_every: int = 0
    """Steps between two checkpoints (0: never). Each one stalls the job while rank
    0 writes the bulk state, which must take less than ``group_timeout`` (the other
    ranks wait for it in the next all-reduce); see ``tmd.runtime.checkpoint``."""

    def __post_init__(self) -> None:
        if self.checkpoint_every < 0:
            raise ConfigError("checkpoint_every", "must be >= 0")
        if self.checkpoint_every and self.checkpoint_dir is None:
            raise ConfigError("checkpoint_every", "needs a checkpoint_dir")
        if self.standby_wait < timedelta(0):
            raise ConfigError("standby_wait", "must not be negative")
