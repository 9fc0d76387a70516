"""tmd.sdnotify against real AF_UNIX datagram sockets standing in for systemd."""

from __future__ import annotations

import datetime
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tmd import sdnotify


@pytest.fixture
def listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A bound notify socket on the filesystem, advertised in NOTIFY_SOCKET."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(2.0)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def _received(sock: socket.socket) -> bytes:
    return sock.recv(4096)


def _nothing_pending(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        sock.recv(4096)
    except BlockingIOError:
        return True
    return False


def test_notify_sends_fields_as_one_newline_joined_datagram(listener: socket.socket) -> None:
    assert sdnotify.notify("READY=1", "STATUS=serving") is True
    assert _received(listener) == b"READY=1\nSTATUS=serving"
    assert _nothing_pending(listener)


def test_ready_without_status(listener: socket.socket) -> None:
    assert sdnotify.ready() is True
    assert _received(listener) == b"READY=1"


def test_ready_with_status(listener: socket.socket) -> None:
    assert sdnotify.ready("subscribed, HTTP on :8080") is True
    assert _received(listener) == b"READY=1\nSTATUS=subscribed, HTTP on :8080"


def test_stopping_and_watchdog_ping(listener: socket.socket) -> None:
    assert sdnotify.watchdog_ping() is True
    assert sdnotify.stopping() is True
    assert _received(listener) == b"WATCHDOG=1"
    assert _received(listener) == b"STOPPING=1"


def test_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"tmd-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(2.0)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.ready("warm") is True
        assert _received(sock) == b"READY=1\nSTATUS=warm"


@pytest.mark.parametrize("value", [None, "", "relative/path.sock", "@"])
def test_no_usable_socket_is_a_quiet_false(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    else:
        monkeypatch.setenv("NOTIFY_SOCKET", value)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.ready() is False
    assert sdnotify.stopping() is False
    assert sdnotify.watchdog_ping() is False


def test_socket_errors_return_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Nobody listens here: sendto fails with ENOENT, which must not escape.
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert sdnotify.ready() is False
    # A path longer than sun_path allows is another OSError flavour.
    monkeypatch.setenv("NOTIFY_SOCKET", "/" + "x" * 200)
    assert sdnotify.watchdog_ping() is False


def test_notify_without_fields_sends_nothing(listener: socket.socket) -> None:
    assert sdnotify.notify() is False
    assert _nothing_pending(listener)


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", None, datetime.timedelta(seconds=30)),
        ("15000000", "self", datetime.timedelta(seconds=15)),
        ("1", None, datetime.timedelta(microseconds=1)),
        (None, None, None),
        (None, "self", None),
        ("", None, None),
        ("0", None, None),
        ("-5", None, None),
        ("+5", None, None),
        (" 5", None, None),
        ("5_000", None, None),
        ("thirty", None, None),
        ("30000000", "other", None),
        ("30000000", "not-a-pid", None),
        ("30000000", "", None),
        ("9" * 40, None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch,
    usec: str | None,
    pid: str | None,
    expected: datetime.timedelta | None,
) -> None:
    for key, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            real = {"self": str(os.getpid()), "other": str(os.getpid() + 1)}.get(value, value)
            monkeypatch.setenv(key, real)
    assert sdnotify.watchdog_interval() == expected


def test_a_reader_that_fell_behind_never_blocks_the_sender(listener: socket.socket) -> None:
    """The daemon pings from its event loop: once the socket's queue is full (nobody
    reads it), a ping is dropped, not waited for. Run in a thread so a blocked send
    fails the test instead of hanging it."""
    import threading

    sent: list[bool] = []
    sender = threading.Thread(
        target=lambda: sent.extend(sdnotify.watchdog_ping() for _ in range(2000)), daemon=True
    )
    sender.start()
    sender.join(30)
    assert not sender.is_alive(), "a notification blocked on a full socket"
    assert sent[0] and not all(sent)  # the first went out, the overflow was dropped
