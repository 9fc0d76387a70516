"""The leaver-joiner channel over a real two-member gloo group, in one process."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from tmd.errors import MigrationError
from tmd.runtime.group import GroupBuilder, StoreAddress
from tmd.runtime.launch import host_store
from tmd.runtime.transfer import Kind, TransferChannel

TIMEOUT = timedelta(seconds=20)


def _pair() -> tuple[TransferChannel, TransferChannel]:
    store = host_store(0)
    address = StoreAddress("127.0.0.1", store.port)
    builders = [
        GroupBuilder(address, "pair", rank=r, size=2, timeout=TIMEOUT, host="127.0.0.1")
        for r in (0, 1)
    ]
    assert all(b.wait(TIMEOUT) for b in builders)
    leaver = TransferChannel(builders[0].result(), is_leaver=True)
    joiner = TransferChannel(builders[1].result(), is_leaver=False)
    leaver._store = store  # type: ignore[attr-defined]  # keep the server alive
    return leaver, joiner


def test_messages_arrive_in_order_with_their_payloads_and_tensors() -> None:
    leaver, joiner = _pair()
    state = [torch.randn(3, 4), torch.arange(5, dtype=torch.int64), torch.tensor(7.0)]
    grads = [torch.randn(12)]
    got: dict[str, object] = {}

    def receive() -> None:
        header, meta = joiner.recv()
        into = [torch.empty_like(t) for t in state]
        joiner.recv_tensors(into)
        got["snapshot"] = (header, meta, into)
        header, hyper = joiner.recv()
        buf = [torch.empty(12)]
        joiner.recv_tensors(buf)
        got["grads"] = (header, hyper, buf)
        got["end"] = joiner.recv()[0]

    thread = threading.Thread(target=receive)
    thread.start()
    leaver.send(Kind.SNAPSHOT, 5, {"rank": 1}, state)
    with pytest.raises(MigrationError):
        leaver.send(Kind.GRADS, 6)  # one message in flight at a time
    leaver.flush()
    leaver.send(Kind.GRADS, 6, [{"lr": 0.1}], grads)
    leaver.flush()
    leaver.send(Kind.ABORT, 0)
    leaver.flush()
    thread.join(20)

    header, meta, into = got["snapshot"]  # type: ignore[misc]
    assert (header.kind, header.step, meta) == (Kind.SNAPSHOT, 5, {"rank": 1})
    assert all(torch.equal(a, b) for a, b in zip(into, state, strict=True))
    header, hyper, buf = got["grads"]  # type: ignore[misc]
    assert (header.kind, header.step, hyper) == (Kind.GRADS, 6, [{"lr": 0.1}])
    assert torch.equal(buf[0], grads[0])
    assert got["end"].kind is Kind.ABORT  # type: ignore[attr-defined]
    assert leaver.bytes_sent == sum(t.numel() * t.element_size() for t in state + grads)


def test_a_build_that_nobody_joins_fails_after_its_timeout() -> None:
    store = host_store(0)
    builder = GroupBuilder(StoreAddress("127.0.0.1", store.port), "lonely", rank=0, size=2,
                           timeout=timedelta(seconds=1), host="127.0.0.1")  # fmt: skip
    assert builder.wait(timedelta(seconds=30))
    assert builder.failed()
    with pytest.raises(MigrationError):
        builder.result()
