"""systemd readiness and watchdog notifications (sd_notify) over $NOTIFY_SOCKET.

Owns the whole protocol in a few lines so the daemon needs no libsystemd binding:
one datagram of newline-separated ``KEY=VALUE`` fields, sent to the AF_UNIX socket
systemd names in ``NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace).
Outside systemd (tests, ``tmd demo``, a terminal) every call is a cheap no-op that
returns False, so callers never branch on how they were started.
"""

from __future__ import annotations

import datetime
import os
import socket

__all__ = ["notify", "ready", "stopping", "watchdog_interval", "watchdog_ping"]


def _address() -> str | bytes | None:
    raw = os.environ.get("NOTIFY_SOCKET", "")
    if raw.startswith("@") and len(raw) > 1:
        # Abstract namespace: the leading '@' stands for the NUL byte.
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    return None


def notify(*fields: str, wait_s: float = 1.0) -> bool:
    """Send ``fields`` (e.g. ``"READY=1"``, ``"STATUS=serving"``) as one notification.

    Returns True when the datagram was sent, False when there is no (usable)
    ``NOTIFY_SOCKET`` or sending failed. Never raises, and waits at most ``wait_s``
    for room in the socket (the daemon calls it from its event loop, and a datagram
    socket whose reader fell behind blocks its senders): losing a notification must
    not take the daemon down, and systemd's own timeouts report the consequence.
    """
    address = _address()
    if address is None or not fields:
        return False
    payload = "\n".join(fields).encode()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.settimeout(wait_s)  # 0: never wait
            sock.sendto(payload, address)
    except OSError:
        return False
    return True


def ready(status: str = "") -> bool:
    """Tell systemd start-up is complete (``READY=1``), with an optional status line."""
    if status:
        return notify("READY=1", f"STATUS={status}")
    return notify("READY=1")


def stopping() -> bool:
    """Tell systemd a clean shutdown has begun (``STOPPING=1``)."""
    return notify("STOPPING=1")


def watchdog_ping() -> bool:
    """Keep the service watchdog (``WatchdogSec=``) from firing (``WATCHDOG=1``). Never
    waits: a ping that finds no room is dropped, the next one follows soon."""
    return notify("WATCHDOG=1", wait_s=0.0)


def watchdog_interval() -> datetime.timedelta | None:
    """The watchdog timeout systemd set for this process, or None when there is none.

    Read from ``WATCHDOG_USEC``; when ``WATCHDOG_PID`` is set it must name this
    process (a child that inherited the environment must not ping). Ping at about
    half this interval.
    """
    usec = _positive_int(os.environ.get("WATCHDOG_USEC"))
    if usec is None:
        return None
    pid_raw = os.environ.get("WATCHDOG_PID")
    if pid_raw is not None and _positive_int(pid_raw) != os.getpid():
        return None
    try:
        return datetime.timedelta(microseconds=usec)
    except OverflowError:
        return None


def _positive_int(raw: str | None) -> int | None:
    # Plain ASCII digits only: int() would also take " 5", "+5" and "5_0".
    if raw is None or not (raw.isascii() and raw.isdigit()):
        return None
    value = int(raw)
    return value if value > 0 else None
