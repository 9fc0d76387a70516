"""Bucketed gradient all-reduce on whichever group is current.

Gradients are packed into a few flat buckets (one per dtype and device, split at
``bucket_bytes``) so a step issues a handful of large collectives instead of one per
parameter. The reduced buckets are kept after the step: they are exactly what the
optimizer consumed, which is what a leaver forwards to a joiner in lock-step.

A parameter without a gradient on this rank contributes zeros, and every rank then
sets its gradient from the bucket; all replicas, the joiner included, apply the same
update whatever autograd skipped locally.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from tmd.runtime.group import Group


@dataclass
class Bucket:
    buffer: torch.Tensor
    params: list[torch.Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)


class GradientReducer:
    """Averages the gradients of ``params`` across a group, in place."""

    def __init__(self, params: Sequence[torch.Tensor], *, bucket_bytes: int = 25 << 20) -> None:
        self.buckets: list[Bucket] = []
        open_by_kind: dict[tuple[torch.dtype, torch.device], tuple[Bucket, int]] = {}
        layout: list[tuple[Bucket, torch.Tensor, int]] = []
        for p in params:
            if not p.requires_grad:
                continue
            kind = (p.dtype, p.device)
            current = open_by_kind.get(kind)
            nbytes = p.numel() * p.element_size()
            if current is None or (current[1] > 0 and current[1] + nbytes > bucket_bytes):
                bucket = Bucket(torch.empty(0, dtype=p.dtype, device=p.device))
                self.buckets.append(bucket)
                current = (bucket, 0)
            bucket, used = current
            layout.append((bucket, p, used // p.element_size()))
            open_by_kind[kind] = (bucket, used + nbytes)
        for bucket, p, offset in layout:
            bucket.params.append(p)
            bucket.offsets.append(offset)
        for bucket in self.buckets:
            numel = sum(p.numel() for p in bucket.params)
            bucket.buffer = torch.empty(
                numel, dtype=bucket.buffer.dtype, device=bucket.buffer.device
            )

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The flat buckets; after ``reduce`` or ``load`` they hold the averaged grads."""
        return [b.buffer for b in self.buckets]

    def pack(self) -> None:
        """Copy this rank's gradients into the buckets."""
        for bucket in self.buckets:
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                view = bucket.buffer[offset : offset + p.numel()]
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(p.grad.reshape(-1))

    def unpack(self) -> None:
        """Set every gradient from the (reduced) buckets."""
        for bucket in self.buckets:
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                view = bucket.buffer[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = view.clone()
                else:
                    p.grad.copy_(view)

    def start(self, group: Group, *, extra: Sequence[torch.Tensor] = ()) -> list[dist.Work]:
        """Pack and start the all-reduce of every bucket, plus ``extra`` tensors (summed,
        not averaged) riding along in the same step."""
        self.pack()
        works = [group.allreduce([t]) for t in extra]
        works += [group.allreduce([b.buffer]) for b in self.buckets]
        return works

    def finish(
        self,
        works: Sequence[dist.Work],
        world_size: int,
        *,
        interrupted: Callable[[], bool] | None = None,
        poll: timedelta = timedelta(milliseconds=50),
    ) -> None:
        """Wait for ``start``'s collectives and turn the sums into averages.

        A collective can hang rather than fail when a member dies: in a ring, only
        the dead rank's neighbours see the broken connection. So a wait longer than
        ``poll`` asks ``interrupted`` (did another member report a failure?) and
        gives up if so. On any failure the buckets are replaced by fresh ones: the
        abandoned collectives may still write into the old ones.
        """
        try:
            for work in works:
                wait_interruptible(work, interrupted, poll)
        except RuntimeError:
            self._renew()
            raise
        for bucket in self.buckets:
            bucket.buffer.div_(world_size)
        self.unpack()

    def _renew(self) -> None:
        for bucket in self.buckets:
            bucket.buffer = torch.empty_like(bucket.buffer)

    def load(self, buffers: Sequence[torch.Tensor] | None = None) -> None:
        """Take the averaged gradients from elsewhere: ``buffers`` received from a
        leaver, or (``None``) this rank's own gradients, which is what the reduction
        would return if every replica had computed the same ones."""
        if buffers is None:
            self.pack()
        else:
            for bucket, buffer in zip(self.buckets, buffers, strict=True):
                if buffer.data_ptr() != bucket.buffer.data_ptr():
                    bucket.buffer.copy_(buffer)
        self.unpack()


class PeerLost(RuntimeError):
    """Another member reported a failure while this rank waited on a collective."""


def wait_interruptible(
    work: dist.Work,
    interrupted: Callable[[], bool] | None,
    poll: timedelta = timedelta(milliseconds=50),
) -> None:
    """Wait for ``work``; past each ``poll``, ask ``interrupted`` (did another member
    report a failure?) and raise ``PeerLost`` if so."""
    if interrupted is None:
        work.wait()
        return
    while True:
        try:
            work.wait(poll)
            return
        except RuntimeError:
            if work.is_completed():
                # Done by now, maybe just after the timeout fired: a plain wait
                # returns, or raises the collective's own error.
                work.wait()
                return
        if interrupted():
            raise PeerLost("a member of the group failed during this collective")
