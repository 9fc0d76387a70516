"""Telemetry through the machine's agent: a rank hands its batches to the agent on
its machine, which publishes one message for all of the machine's ranks each flush
(``tmd.agent.relay``, ``tmd.wire.NodeIter``): eight times fewer messages for the
broker and the daemon on a machine of eight GPUs.

The way there is a Unix datagram socket (``TMD_AGENT_SOCKET``, by default
``/run/tmd/agent.sock`` where it exists): a send never blocks, and the training step
only appends to ``Telemetry``'s queue. Each datagram is an 8-byte sequence number
and the encoded ``IterBatch``; once the broker has the agent's message holding a
batch, the agent answers with its number, to this process's own (abstract) address;
an answer from anyone else is ignored. Where the agent does not take a batch (no
socket, nobody bound to it, its queue full), or took one and did not confirm it
within ``CONFIRM_WITHIN`` (it died, hung, or lost the broker), every batch it has
not confirmed is published directly, oldest first, and so is each new one for
``RETRY_AFTER`` before the agent is tried again. At exit what is unconfirmed is
published directly at once. The daemon counts a step that arrives twice as a
duplicate: nothing is lost and nothing counted twice.
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

from tmd.errors import ConfigError
from tmd.runtime.telemetry import Sink

AGENT_SOCKET: Final = "/run/tmd/agent.sock"
"""Where ``tmd agent`` listens by default (``agent.relay_socket``)."""
CONFIRM_WITHIN: Final = timedelta(seconds=5)
"""How long a batch the agent took may wait for its confirmation before it is
published directly (the agent flushes every ``agent.interval_s``, 1 s by default)."""
RETRY_AFTER: Final = timedelta(seconds=10)
"""How long the relay publishes directly after the agent failed it."""
SEQ_BYTES: Final = 8
MAX_ANSWERS_READ: Final = 64
"""The agent's answers read per call, at most (each confirms any number of batches)."""


class AgentRelay:
    """A ``Telemetry`` sink: each batch to the agent at ``path``, or to ``direct``
    (the MQTT publish; None: dropped, and counted) where the agent does not take it.
    ``poll`` (from the telemetry thread, each flush interval) reads the agent's
    confirmations and publishes directly what it left unconfirmed too long;
    ``close`` publishes directly what is still unconfirmed."""

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
                    self._give_up_on_agent(now)
                else:
                    self._unconfirmed[self._seq] = (now, topic, payload)
                    return
            self._publish(topic, payload)

    def poll(self) -> None:
        with self._lock:
            self._settle(time.monotonic())

    def close(self) -> None:
        with self._lock:
            self._settle(time.monotonic())
            for _, topic, payload in self._unconfirmed.values():
                self._publish(topic, payload)
            self._unconfirmed.clear()
            self._sock.close()

    @property
    def unconfirmed(self) -> int:
        return len(self._unconfirmed)

    def _settle(self, now: float) -> None:
        """Take the agent's confirmations (a bounded number of answers, so a flood
        cannot hold the caller); if one batch waited too long, give up on the agent.
        Holds the lock; the direct publishes happen in it (they do not block)."""
        for _ in range(MAX_ANSWERS_READ):
            try:
                answer, sender = self._sock.recvfrom(65536)
            except OSError:  # nothing more (BlockingIOError), or the socket is gone
                break
            if not isinstance(sender, str) or os.path.realpath(sender) != os.path.realpath(
                self.path
            ):
                continue  # not the agent: a confirmation must not be forged
            for i in range(0, len(answer) - SEQ_BYTES + 1, SEQ_BYTES):
                seq = int.from_bytes(answer[i : i + SEQ_BYTES], "big")
                if self._unconfirmed.pop(seq, None) is not None:
                    self.relayed += 1
        if self._unconfirmed:
            oldest = next(iter(self._unconfirmed.values()))[0]
            if oldest < now - CONFIRM_WITHIN.total_seconds():
                self._give_up_on_agent(now)

    def _give_up_on_agent(self, now: float) -> None:
        """Publish directly everything the agent has not confirmed, oldest first (a
        later step must not reach the daemon long before an earlier one, which it
        would count as late), and publish directly for ``RETRY_AFTER``."""
        self._agent_down_until = now + RETRY_AFTER.total_seconds()
        for _, topic, payload in self._unconfirmed.values():
            self._publish(topic, payload)
        self._unconfirmed.clear()

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
    if "TMD_AGENT_SOCKET" not in environ:
        return AGENT_SOCKET if os.path.exists(AGENT_SOCKET) else None
    path = environ["TMD_AGENT_SOCKET"]
    if path and not (path.startswith("/") and len(path.encode()) < 108):
        raise ConfigError("TMD_AGENT_SOCKET", f"must be empty or an absolute path of under "
                          f"108 bytes (a Unix socket's limit), got {path[:200]!r}")  # fmt: skip
    return path or None
