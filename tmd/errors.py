"""The one error tree of tmd. Third-party errors are translated into it at the edges."""

from __future__ import annotations


class TmdError(Exception):
    """Base of every error tmd raises on purpose."""


class ConfigError(TmdError):
    """A configuration value is missing, of the wrong type or out of range.

    ``key`` is the dotted path of the offending key (``mqtt.port``), so the message a
    user sees at start names it.
    """

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"{key}: {why}")
        self.key = key
        self.why = why


class ProtocolError(TmdError):
    """A message on the wire could not be accepted.

    ``reason`` is a short, bounded label (``json``, ``schema``, ``version``, ...) used
    as the ``reason`` label of ``tmd_messages_rejected_total``.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class MigrationError(TmdError):
    """A migration step failed or timed out."""


class RestartRequired(TmdError):
    """In-place recovery could not serve: the job must restart from its latest checkpoint.

    Raised out of a training step on every survivor of a failure that no standby
    could repair. ``checkpoint_step`` is the step of the latest complete checkpoint
    (``None``: there is none, the restarted job begins at step 0). A process that
    lets it escape should exit with ``tmd.runtime.EX_RESTART`` (75, EX_TEMPFAIL),
    which ``tmd.runtime.run`` does, so a launcher knows to start the job again.
    """

    def __init__(self, reason: str, *, checkpoint_step: int | None = None) -> None:
        if checkpoint_step is None:
            then = "no checkpoint, the job restarts from step 0"
        else:
            then = f"rollback to checkpoint step {checkpoint_step}"
        super().__init__(f"{reason}; {then}")
        self.reason = reason
        self.checkpoint_step = checkpoint_step


class PluginError(TmdError):
    """A detector or policy could not be loaded or configured."""


class PublishError(TmdError):
    """A message could not be handed to the broker: not connected, refused or timed out.
    Callers retry; the command they were sending is resent by its own schedule."""


class JournalError(TmdError):
    """The journal (SQLite) could not be read or written; ``sqlite3`` errors are
    translated into this at the journal's edge."""


class AlreadyFinished(TmdError):
    """A migration's state was set after it had ended (done, aborted or failed): each
    migration ends, and is reported, once. A logic error of the caller, not a failure
    of the disk, so it is no ``JournalError``."""
