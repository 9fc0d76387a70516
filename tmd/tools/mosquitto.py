"""A private mosquitto on a free loopback port, for tests, benchmarks and the demo.

Production uses the site's broker; this starts the real ``mosquitto`` binary (the
Debian package) with a throw-away config, waits until it accepts connections, and
stops it on exit. ``restart`` keeps the port, so tests can cut the daemon's
connection and watch it come back. ``tmd.tools.brokers.local_broker`` falls back to
the embedded broker where mosquitto is not installed.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from tmd.errors import TmdError

SEARCH_PATHS = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/opt/homebrew/sbin/mosquitto")


def find_mosquitto() -> str | None:
    found = shutil.which("mosquitto")
    if found:
        return found
    return next((p for p in SEARCH_PATHS if Path(p).is_file()), None)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Mosquitto:
    def __init__(
        self,
        *,
        port: int = 0,
        host: str = "127.0.0.1",
        listener_config: str = "",
        allow_anonymous: bool = True,
        config: str = "",
        max_queued_messages: int = 100_000,
    ) -> None:
        """``listener_config``: lines for the listener (``cafile``, ``certfile``, ...);
        ``config``: a whole broker configuration instead (its own ``listener`` on
        ``port``), to which only logging and the process's user are added.
        ``max_queued_messages``: what it keeps for a client that lags before it drops
        (QoS 0 too: mosquitto drops them past this many unsent packets)."""
        binary = find_mosquitto()
        if binary is None:
            raise TmdError("mosquitto not found: install it (apt-get install -y mosquitto)")
        self.binary = binary
        self.host = host
        self.port = port or free_port(host)
        self._dir = tempfile.TemporaryDirectory(prefix="tmd-mosquitto-")
        self.config_path = Path(self._dir.name) / "mosquitto.conf"
        self.log_path = Path(self._dir.name) / "mosquitto.log"
        own = (
            (config + "\n")
            if config
            else (
                f"listener {self.port} {host}\n"
                + listener_config
                + f"\nallow_anonymous {'true' if allow_anonymous else 'false'}\n"
            )
        )
        self.config_path.write_text(
            own
            # Started as root, mosquitto switches to user "mosquitto", which cannot read
            # the test's key files; stay who we are (ignored when not root).
            + f"user {pwd.getpwuid(os.geteuid()).pw_name}\n"
            "persistence false\n"
            f"max_queued_messages {max_queued_messages}\n"
            "max_inflight_messages 0\n"
            f"log_dest file {self.log_path}\n"
        )
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> Mosquitto:
        self._proc = subprocess.Popen(
            [self.binary, "-c", str(self.config_path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log = self.log_path.read_text() if self.log_path.exists() else ""
                raise TmdError(f"mosquitto exited with {self._proc.returncode}: {log[-500:]}")
            try:
                socket.create_connection((self.host, self.port), timeout=0.2).close()
                return self
            except OSError:
                time.sleep(0.02)
        self.stop()
        raise TmdError(f"mosquitto did not listen on {self.host}:{self.port} in {timeout_s} s")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def __enter__(self) -> Mosquitto:
        return self.start()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._dir.cleanup()
