"""The leaver-to-joiner channel: a two-member group and the messages on it.

Every message is a fixed header ``[kind, step, nbytes]`` followed by a payload of
``nbytes`` bytes and, for some kinds, raw tensors:

- ``HELLO``: who the joiner will be (rank, members, generation), before it joins
  the next group.
- ``SNAPSHOT``: the bulk state (parameters, buffers, optimizer tensors) as of
  ``step``, sent from the live tensors; the payload is the optimizer manifest.
- ``GRADS``: the averaged gradients (a wrapped model's: this rank's shards, clipped),
  then the model's buffers as the step's forward left them; the payload is
  ``{"hyperparams", "buffers": count, "has_grad" (wrapped)}``. The joiner applies the
  same update and takes the buffers, so its bulk stays bit-identical to the
  leaver's.
- ``SWITCH``: the small state at the switch boundary.
- ``ABORT``: the migration is off; the joiner goes back to standing by.

Payloads are ``tmd.runtime.state.encode``-d (``torch.save``, read back with
``torch.load(weights_only=True)``), not pickled: bytes from anyone but the leaver
can at worst build wrong tensors and plain values on the joiner, never run code
there.

Sends are asynchronous and never copy (the leaver sends from its live tensors and
waits for them only before it next writes those tensors); one message at a time is
in flight in each direction, which bounds the leaver's extra memory to nothing.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tmd.errors import MigrationError
from tmd.runtime.group import Group
from tmd.runtime.state import pack, unpack

LEAVER = 0
JOINER = 1
_TAG = 0


class Kind(enum.IntEnum):
    HELLO = 1
    SNAPSHOT = 2
    GRADS = 3
    SWITCH = 4
    ABORT = 5


@dataclass(frozen=True)
class Header:
    kind: Kind
    step: int
    nbytes: int


class TransferChannel:
    """One side of the leaver-joiner pair. The leaver calls ``send``; the joiner calls
    ``recv`` and, for messages with tensors, ``recv_tensors``."""

    def __init__(self, group: Group, *, is_leaver: bool) -> None:
        self._group = group
        self._peer = JOINER if is_leaver else LEAVER
        self._pending: list[dist.Work] = []
        self.bytes_sent = 0

    # -- leaver ------------------------------------------------------------------------

    def send(
        self, kind: Kind, step: int, payload: Any = None, tensors: Sequence[torch.Tensor] = ()
    ) -> None:
        """Start sending one message; the previous one must have been ``flush``-ed."""
        if self._pending:
            raise MigrationError("previous transfer message still in flight")
        try:
            body = pack(payload)
        except ValueError as exc:  # the user's state holds what cannot travel safely
            raise MigrationError(f"cannot send {kind.name}: {exc}") from exc
        header = torch.tensor([int(kind), step, body.numel()], dtype=torch.int64)
        try:
            works = [self._group.send([header], self._peer, _TAG)]
            works.append(self._group.send([body], self._peer, _TAG))
            for t in tensors:
                works.append(self._group.send([_contiguous(t)], self._peer, _TAG))
                self.bytes_sent += t.numel() * t.element_size()
        except RuntimeError as exc:  # gloo fails at once when the peer is known gone
            raise MigrationError(f"transfer to joiner failed: {exc}") from exc
        # The header and body are temporaries: keep them alive until sent.
        self._pending = works
        self._keepalive = (header, body)

    def flush(self) -> None:
        """Wait until the last message has left; raises if the joiner is gone."""
        works, self._pending = self._pending, []
        try:
            for work in works:
                work.wait()
        except RuntimeError as exc:
            raise MigrationError(f"transfer to joiner failed: {exc}") from exc

    # -- joiner ------------------------------------------------------------------------

    def recv(self) -> tuple[Header, Any]:
        """The next message's header and payload (its tensors, if any, follow:
        ``recv_tensors``). Always reads the payload, so the sender's flush returns."""
        raw = torch.empty(3, dtype=torch.int64)
        self._recv(raw)
        kind, step, nbytes = (int(x) for x in raw.tolist())
        body = torch.empty(nbytes, dtype=torch.uint8)
        self._recv(body)
        header = Header(Kind(kind), step, nbytes)
        try:
            return header, unpack(body)
        except ValueError as exc:
            raise MigrationError(f"{header.kind.name} from the leaver: {exc}") from exc

    def recv_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Receive into ``tensors`` in place (all posted at once, then waited)."""
        works = [self._group.recv([t], self._peer, _TAG) for t in tensors]
        try:
            for work in works:
                work.wait()
        except RuntimeError as exc:
            raise MigrationError(f"transfer from leaver failed: {exc}") from exc

    def _recv(self, tensor: torch.Tensor) -> None:
        try:
            self._group.recv([tensor], self._peer, _TAG).wait()
        except RuntimeError as exc:
            raise MigrationError(f"transfer from leaver failed: {exc}") from exc


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise MigrationError("state tensors must be contiguous to be sent in place")
    return t
