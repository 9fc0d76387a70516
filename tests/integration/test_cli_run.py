"""``tmd run`` as systemd runs it: a real process, READY=1 over NOTIFY_SOCKET only once
MQTT is subscribed and HTTP is bound, watchdog pings, ``tmd status`` and ``tmd events``
against it, a clean exit on SIGTERM, and a bad config that stops it at start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import Publisher
from tmd import wire
from tmd.tools.mosquitto import Mosquitto, free_port


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[socket.socket]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(0.2)
    yield sock
    sock.close()


def tmd(
    *args: str, env: dict[str, str] | None = None, **kw: object
) -> subprocess.CompletedProcess[str]:
    result: subprocess.CompletedProcess[str] = subprocess.run(
        [sys.executable, "-m", "tmd.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        **kw,
    )  # type: ignore[call-overload]
    return result


def read_datagrams(sock: socket.socket, until: str, timeout_s: float) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            got.append(sock.recv(4096).decode())
        except TimeoutError:
            continue
        if any(until in g for g in got):
            return got
    raise AssertionError(f"no {until!r} within {timeout_s} s; got {got}")


def pending_datagrams(sock: socket.socket) -> list[str]:
    """What has been sent to ``sock`` so far (datagrams on a Unix socket keep order)."""
    got = []
    sock.setblocking(False)
    try:
        while True:
            got.append(sock.recv(4096).decode())
    except BlockingIOError:
        return got
    finally:
        sock.settimeout(0.2)


def connection_failures(api: str) -> float:
    """The daemon's count of failed broker connections; 0 until its API serves."""
    try:
        with urllib.request.urlopen(f"{api}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("tmd_mqtt_connection_failures_total "):
            return float(line.split()[1])
    return 0.0


def test_run_notifies_ready_serves_and_stops_cleanly(
    own_broker: Mosquitto, notify_socket: socket.socket, tmp_path: Path
) -> None:
    api_port = free_port()
    config = tmp_path / "tmd.toml"
    config.write_text(
        f'[mqtt]\nhost = "127.0.0.1"\nport = {own_broker.port}\nreconnect_min_s = 0.2\n'
        f'[api]\nport = {api_port}\n[journal]\npath = "{tmp_path / "j.sqlite3"}"\n'
        "[detectors.node_lost]\nheartbeat_timeout_s = 2\n"
    )
    env = {
        **os.environ,
        "NOTIFY_SOCKET": notify_socket.getsockname(),
        "WATCHDOG_USEC": "2000000",
        "TMD_LOG__FORMAT": "json",
    }
    own_broker.stop()  # READY must wait for the broker
    proc = subprocess.Popen(
        [sys.executable, "-m", "tmd.cli", "run", "--config", str(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    api = f"http://127.0.0.1:{api_port}"
    try:
        early = read_datagrams(notify_socket, "STATUS=connecting", 30)
        # The daemon has tried the broker and failed twice (it retries): whatever it
        # sent by then is in the socket, and READY=1 must not be among it.
        deadline = time.monotonic() + 30
        while connection_failures(api) < 2:
            assert time.monotonic() < deadline, "the daemon never tried the broker"
            time.sleep(0.1)
        early += pending_datagrams(notify_socket)
        assert not any("READY=1" in d for d in early), early
        own_broker.start()
        read_datagrams(notify_socket, "READY=1", 30)
        read_datagrams(notify_socket, "WATCHDOG=1", 10)

        pub = Publisher(own_broker.host, own_broker.port)
        t = time.time()
        batch = wire.IterBatch(
            ts=t,
            job="cli",
            rank=0,
            node="cli-node",
            steps=[wire.StepTiming(7, t, 1.0, 0.6, 0.3, 0.05, 0.05)],
        )
        pub.send(wire.iter_topic("cli", 0), wire.encode(batch))
        pub.send(
            wire.node_topic("cli-node", "gpu"), wire.encode(wire.NodeGpu(ts=t, node="cli-node"))
        )
        pub.close()
        deadline = time.monotonic() + 20
        while True:
            status = tmd("status", "--api", api)
            if "cli-node" in status.stdout and "cli" in status.stdout:
                break
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
        assert status.returncode == 0
        assert "JOBS" in status.stdout and "RANKS of cli" in status.stdout
        # The node's heartbeats stop: after 2 s the detector journals NodeLost.
        deadline = time.monotonic() + 20
        while "NodeLost" not in (events := tmd("events", "--api", api)).stdout:
            assert time.monotonic() < deadline, events
            pending_datagrams(notify_socket)  # read on, as systemd does
            time.sleep(0.3)
        assert "cli-node" in events.stdout and "heartbeat" in events.stdout

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        assert any("STOPPING=1" in d for d in read_datagrams(notify_socket, "STOPPING=1", 5))
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_bad_config_stops_the_daemon_at_start_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "tmd.toml"
    config.write_text("[mqtt]\nport = 99999\n")
    result = tmd("run", "--config", str(config))
    assert result.returncode == 2
    assert "mqtt.port" in result.stderr
    env = {**os.environ, "TMD_INGEST__WINDOW_STEPS": "many"}
    result = tmd("run", env=env)
    assert result.returncode == 2 and "ingest.window_steps" in result.stderr


def test_status_reports_an_unreachable_daemon() -> None:
    result = tmd("status", "--api", f"http://127.0.0.1:{free_port()}")
    assert result.returncode == 1 and "cannot reach the daemon" in result.stderr
