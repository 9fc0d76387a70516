"""Logging: structlog, JSON when stderr is not a terminal (journald), console on one.

Job, node and migration id are bound through contextvars (``bind``), so every line
logged inside a handler carries them without passing a logger around.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal

import structlog

bind = structlog.contextvars.bind_contextvars
unbind = structlog.contextvars.unbind_contextvars
bound = structlog.contextvars.bound_contextvars


def setup(*, level: str = "info", format: Literal["auto", "json", "console"] = "auto") -> None:
    as_json = format == "json" or (format == "auto" and not sys.stderr.isatty())
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=_StderrLogger,
        cache_logger_on_first_use=True,
    )


class _StderrLogger:
    """Writes to whatever ``sys.stderr`` is at the time of the call (pytest swaps it)."""

    def __init__(self, *args: Any) -> None:
        pass

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


def get(name: str) -> Any:
    """A logger whose lines carry ``logger=name`` (the plug-in or module name)."""
    return structlog.get_logger(name).bind(logger=name)
