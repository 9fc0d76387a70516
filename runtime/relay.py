"""Telemetry through the machine's agent: a rank hands its batches to the agent on
its machine, which publishes one message for all of the machine's ranks each flush
(``tmd.agent.relay``, ``tmd.wire.NodeIter``): eight times fewer messages for the
broker and the daemon on a machine of eight GPUs.

The way there is a Unix datagram socket (``TMD_AGENT_SOCKET``, by default
``/run/tmd/agent.sock`` where it exists): a send never blocks the sender thread, and
never the training step, which only appends to ``Telemetry``'s queue. Each datagram
is an 8-byte sequence number and the encoded ``IterBatch``; once the agent has
published a batch it answers with its number, to this process's own (abstract)
address. A batch the agent does not take (no socket, nobody bound to it, its queue
full) is published directly, as without an agent; so is one it took and did not
confirm within ``CONFIRM_WITHIN`` (it died, or lost the broker): the daemon counts a
step that arrives twice as a duplicate, so nothing is lost and nothing counted
twice. After a failure the relay publishes directly for ``RETRY_AFTER`` before it
tries the agent again.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Final

from tmd.runtime.telemetry import Sink

AGENT_SOCKET: Final = "/run/tmd/agent.sock"
"""Where ``tmd agent`` listens by default (``agent.relay_socket``)."""
CONFIRM_WITHIN: Final = timedelta(seconds=5)
"""How long a batch the agent took may wait for its confirmation before it is
published directly (the agent flushes every ``agent.interval_s``, 1 s by default)."""
RETRY_AFTER: Final = timedelta(seconds=10)
"""How long the relay publishes directly after the agent failed it."""
SEQ_BYTES: Final = 8


class AgentRelay:
    """A ``Telemetry`` sink: each batch to the agent at ``path``, or to ``direct``
    (the MQTT publish; None: dropped, and counted) where the agent does not take it.
    ``poll`` (from the telemetry thread, each flush interval) reads the agent's
    confirmations and publishes directly what it left unconfirmed; ``close`` waits
    for the last confirmations, up to ``CONFIRM_WITHIN``."""

    def __init__(self, path: str, direct: Sink | None) -> None:
        self.path = path
        self._direct = direct
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        # Linux's abstract namespace: no file to clean up, gone with the process.
        self._sock.bind(f"\0tmd-relay-{os.getpid()}-{secrets.token_hex(4)}")
        self._lock = threading.Lock()
        self._seq = 0
        self._unconfirmed: dict[int, tuple[float, str, bytes]] = {}
        self._agent_down_until = 0.0
        self.relayed = 0
        """Batches the agent confirmed."""
        self.direct = 0
        """Batches published directly: no agent, or one that did not take or confirm them."""
        self.dropped = 0
        """Batches neither the agent nor the direct sink took."""

    def __call__(self, topic: str, payload: bytes) -> None:
        with self._lock:
            now = time.monotonic()
            self._settle(now)
            if now >= self._agent_down_until:
                self._seq += 1
                try:
                    self._sock.sendto(self._seq.to_bytes(SEQ_BYTES, "big") + payload, self.path)
                except OSError:  # no socket, nobody bound to it, its queue full
                    self._agent_down_until = now + RETRY_AFTER.total_seconds()
                else:
                    self._unconfirmed[self._seq] = (now, topic, payload)
                    return
        self._publish(topic, payload)

    def poll(self) -> None:
        with self._lock:
            self._settle(time.monotonic())

    def close(self) -> None:
        deadline = time.monotonic() + CONFIRM_WITHIN.total_seconds()
        while True:
            with self._lock:
                self._settle(time.monotonic())
                if not self._unconfirmed or time.monotonic() > deadline:
                    overdue = list(self._unconfirmed.values())
                    self._unconfirmed.clear()
                    break
            time.sleep(0.05)
        for _, topic, payload in overdue:
            self._publish(topic, payload)
        self._sock.close()

    @property
    def unconfirmed(self) -> int:
        return len(self._unconfirmed)

    def _settle(self, now: float) -> None:
        """Take the agent's confirmations; publish directly what waited too long.
        Holds the lock; the direct publishes happen in it (they do not block)."""
        while True:
            try:
                answer = self._sock.recv(65536)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            for i in range(0, len(answer) - SEQ_BYTES + 1, SEQ_BYTES):
                seq = int.from_bytes(answer[i : i + SEQ_BYTES], "big")
                if self._unconfirmed.pop(seq, None) is not None:
                    self.relayed += 1
        limit = now - CONFIRM_WITHIN.total_seconds()
        overdue = [seq for seq, (sent, _, _) in self._unconfirmed.items() if sent < limit]
        if overdue:
            self._agent_down_until = now + RETRY_AFTER.total_seconds()
        for seq in overdue:
            _, topic, payload = self._unconfirmed.pop(seq)
            self._publish(topic, payload)

    def _publish(self, topic: str, payload: bytes) -> None:
        if self._direct is None:
            self.dropped += 1
            return
        try:
            self._direct(topic, payload)
        except Exception:  # a broken sink costs the batch, never the step
            self.dropped += 1
        else:
            self.direct += 1


def agent_socket(environ: Mapping[str, str]) -> str | None:
    """The agent's socket this process relays through: ``TMD_AGENT_SOCKET`` (empty:
    none), else ``AGENT_SOCKET`` where it exists."""
    if "TMD_AGENT_SOCKET" in environ:
        return environ["TMD_AGENT_SOCKET"] or None
    return AGENT_SOCKET if os.path.exists(AGENT_SOCKET) else None
