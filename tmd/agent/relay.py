"""The agent's side of the telemetry relay (``tmd.runtime.relay`` is the ranks'): a
Unix datagram socket the machine's ranks hand their step batches to, read on the
agent's event loop without a task per datagram. Each flush the agent publishes what
came in as one ``NodeIter`` with its GPU sample, then confirms each batch to its
sender by number; a batch it could not publish is not confirmed, and its rank
publishes it directly.

A datagram is an 8-byte sequence number and an encoded ``IterBatch`` naming this
machine; anything else is counted, logged at most once a minute, and dropped. At most
``MAX_PENDING_BYTES`` of batches wait for a flush; past that the oldest are dropped,
and so are batches older than ``STALE_S`` (the broker was away): their ranks
publish them directly once they go unconfirmed.

Trust: the socket is open to every user of the machine (the ranks run as the jobs'
users), so any local process can relay step timings for a rank it names on this
machine, as any holder of a job's broker credentials can. The daemon takes a relayed
batch only where it names this machine and the job's status does not place its rank
elsewhere; its bounds on jobs and ranks hold as for direct publishing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import time
from collections import deque
from pathlib import Path
from typing import Final

import msgspec

from tmd import log, wire

SEQ_BYTES: Final = 8
_MAX_DATAGRAM: Final = 1 << 20
_LOG_EVERY_S: Final = 60.0
MAX_MESSAGE_BYTES: Final = 128 * 1024
"""The relayed batches' bytes in one ``NodeIter`` (as encoded in it): half the
daemon's default ``ingest.max_payload_bytes``; a daemon set below it refuses them."""
MAX_PENDING_BYTES: Final = 8 << 20
"""Encoded batches waiting for a flush, at most."""
STALE_S: Final = 5.0
"""A batch waiting longer is not published: its rank has published it itself
(``tmd.runtime.relay.CONFIRM_WITHIN``)."""

Sender = str | bytes
"""A rank's socket address (abstract: bytes or a str starting with NUL)."""
Taken = tuple[Sender, int, wire.IterBatch]
"""A relayed batch: its sender, its number there, the batch."""


class Relay:
    def __init__(self, path: str, node: str, *, max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self.path = path
        self.node = node
        self.max_pending_bytes = max_pending_bytes
        self.received = 0
        self.rejected = 0
        self.dropped = 0
        self._pending: deque[Taken] = deque()
        self._sizes: deque[tuple[int, float]] = deque()  # encoded bytes, when received
        self._pending_bytes = 0
        self._inode = 0
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._decoder = msgspec.json.Decoder(wire.IterBatch)
        self._logged_at = -1e18
        self._log = log.get("agent.relay").bind(node=node, path=path)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def open(self) -> None:
        """Bind the socket (replacing a stale one a dead agent left) and read it on
        the running loop."""
        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISSOCK(path.lstat().st_mode):
                path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        sock.bind(self.path)
        os.chmod(self.path, 0o666)  # the ranks run as the jobs' users
        self._inode = os.stat(self.path).st_ino
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(sock.fileno(), self._readable)
        self._log.info("relaying the ranks' telemetry")

    def close(self) -> None:
        if self._sock is None:
            return
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._sock.fileno())
        self._sock.close()
        self._sock = None
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.path).st_ino == self._inode:  # not a newer agent's
                os.unlink(self.path)

    def take(
        self, limit: int = wire.MAX_RELAYED_BATCHES, max_bytes: int = MAX_MESSAGE_BYTES
    ) -> list[Taken]:
        """Waiting batches, oldest first, to publish in one message: at most ``limit``
        of them, and no more than ``max_bytes`` of their encodings (at least one)."""
        out: list[Taken] = []
        size = 0
        stale = time.monotonic() - STALE_S
        while self._pending and len(out) < limit:
            nbytes, received = self._sizes[0]
            if out and size + nbytes > max_bytes:
                break
            self._sizes.popleft()
            self._pending_bytes -= nbytes
            taken = self._pending.popleft()
            if received < stale:
                self.dropped += 1
                continue
            size += nbytes
            out.append(taken)
        return out

    def confirm(self, taken: list[Taken]) -> None:
        """Tell each sender which of its batches are published."""
        sock = self._sock
        if sock is None:
            return
        by_sender: dict[Sender, list[int]] = {}
        for sender, seq, _ in taken:
            by_sender.setdefault(sender, []).append(seq)
        for sender, seqs in by_sender.items():
            answer = b"".join(s.to_bytes(SEQ_BYTES, "big") for s in seqs)
            with contextlib.suppress(OSError):  # gone, or its queue full: it publishes them
                sock.sendto(answer, sender)

    def _readable(self) -> None:
        sock = self._sock
        if sock is None:
            return
        for _ in range(1024):  # then let the loop breathe; the reader fires again
            try:
                data, sender = sock.recvfrom(_MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._reject(f"recv failed: {exc}")
                return
            self._datagram(data, sender)

    def _datagram(self, data: bytes, sender: Sender) -> None:
        if not sender:
            self._reject("an unbound sender: it could not hear the confirmation")
            return
        if len(data) <= SEQ_BYTES:
            self._reject("too short")
            return
        seq = int.from_bytes(data[:SEQ_BYTES], "big")
        try:
            batch = self._decoder.decode(data[SEQ_BYTES:])
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            self._reject(f"not a step batch: {str(exc)[:200]}")
            return
        if batch.node != self.node:
            self._reject(f"a batch of {batch.node[:128]!r} on {self.node!r}'s agent")
            return
        self.received += 1
        nbytes = len(wire.encode(batch))  # as it will be in the message
        while self._pending and self._pending_bytes + nbytes > self.max_pending_bytes:
            self._pending.popleft()
            self._pending_bytes -= self._sizes.popleft()[0]
            self.dropped += 1
        self._pending.append((sender, seq, batch))
        self._sizes.append((nbytes, time.monotonic()))
        self._pending_bytes += nbytes

    def _reject(self, why: str) -> None:
        self.rejected += 1
        now = time.monotonic()
        if now - self._logged_at >= _LOG_EVERY_S:
            self._logged_at = now
            self._log.warning("relayed datagram rejected", reason=why, rejected_total=self.rejected)
