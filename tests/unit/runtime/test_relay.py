"""The telemetry relay between a rank (``tmd.runtime.relay.AgentRelay``) and its
machine's agent (``tmd.agent.relay.Relay``), over a real Unix datagram socket: a batch
taken, published and confirmed; no agent, a dead one and one that never confirms,
each sending the batch directly; what the agent refuses."""

from __future__ import annotations

import asyncio
import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest

from tmd import wire
from tmd.agent import relay as agent_relay
from tmd.agent.relay import Relay
from tmd.runtime import relay as rank_relay
from tmd.runtime.relay import AgentRelay


def batch(step: int, node: str = "m0", rank: int = 3) -> tuple[str, bytes]:
    timing = wire.StepTiming(step, 1.0, 0.5, 0.3, 0.1, 0.1, 0.0)
    message = wire.IterBatch(ts=1.0, job="j", rank=rank, node=node, steps=[timing])
    return wire.iter_topic("j", rank), wire.encode(message)


async def settle() -> None:
    for _ in range(20):  # the agent's reader runs on the loop
        await asyncio.sleep(0.01)


async def test_a_batch_the_agent_took_and_published_is_confirmed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rank_relay, "CONFIRM_WITHIN", timedelta(seconds=1))
    path = str(tmp_path / "agent.sock")
    agent = Relay(path, "m0")
    agent.open()
    direct: list[str] = []
    rank = AgentRelay(path, lambda topic, _: direct.append(topic))
    try:
        for step in range(3):
            rank(*batch(step))
        await settle()
        forger = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        forger.sendto((1).to_bytes(8, "big"), rank._sock.getsockname())  # not the agent
        forger.close()
        rank.poll()
        assert rank.unconfirmed == 3 and rank.relayed == 0
        size = len(batch(0)[1])
        assert len(agent.take(max_bytes=2 * size - 1)) == 1  # split by size, at least one
        taken = agent.take()
        assert [b.steps[0].step for _, _, b in taken] == [1, 2] and agent.received == 3
        assert rank.unconfirmed == 3
        agent.confirm(taken)  # as the agent does once it published them
        await settle()
        rank.poll()
        assert rank.unconfirmed == 1 and rank.relayed == 2 and direct == []  # one unsent
        rank.close()  # waits for its confirmation, then publishes it directly
        assert direct == [wire.iter_topic("j", 3)]
    finally:
        agent.close()
    assert not os.path.exists(path)  # noqa: ASYNC240 (a stat, at the end)


async def test_without_an_agent_or_after_it_died_batches_go_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rank_relay, "RETRY_AFTER", timedelta(0))  # try the agent each time
    path = str(tmp_path / "agent.sock")
    direct: list[str] = []
    rank = AgentRelay(path, lambda topic, _: direct.append(topic))
    rank(*batch(0))  # no socket at all
    assert direct == [wire.iter_topic("j", 3)] and rank.unconfirmed == 0
    # A dead agent's socket file: nobody reads it, the send is refused.
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    dead.bind(path)
    dead.close()
    rank(*batch(1))
    assert len(direct) == 2 and rank.direct == 2 and rank.unconfirmed == 0
    rank.close()


async def test_a_batch_the_agent_took_and_never_confirmed_is_sent_direct(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The agent took it, then died (or lost the broker) before it published it."""
    monkeypatch.setattr(rank_relay, "CONFIRM_WITHIN", timedelta(milliseconds=100))
    path = str(tmp_path / "agent.sock")
    agent = Relay(path, "m0")
    agent.open()
    direct: list[bytes] = []
    rank = AgentRelay(path, lambda _, payload: direct.append(payload))
    try:
        first, second = batch(7), batch(8)
        rank(*first)
        rank(*second)
        await settle()
        assert agent.pending == 2 and direct == []
        await asyncio.sleep(0.15)
        rank.poll()  # the first is overdue: both go direct, in order
        assert direct == [first[1], second[1]] and rank.unconfirmed == 0
        rank(*batch(9))  # the agent is given a rest: direct until RETRY_AFTER
        assert len(direct) == 3
    finally:
        rank.close()
        agent.close()


async def test_the_agent_refuses_what_is_not_a_batch_of_its_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "agent.sock")
    agent = Relay(path, "m0")
    agent.open()
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sender.bind(f"\0tmd-test-relay-{os.getpid()}")
    try:
        _, other = batch(0, node="m1")
        _, good = batch(1)
        for data in (b"x", (1).to_bytes(8, "big") + b"{}", (2).to_bytes(8, "big") + other):
            sender.sendto(data, path)
        unbound = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        unbound.sendto((3).to_bytes(8, "big") + good, path)  # could not hear a confirmation
        unbound.close()
        sender.sendto((4).to_bytes(8, "big") + good, path)
        await settle()
        assert agent.rejected == 4 and [seq for _, seq, _ in agent.take()] == [4]
        sender.sendto((5).to_bytes(8, "big") + good, path)
        await settle()
        monkeypatch.setattr(agent_relay, "STALE_S", 0.0)  # its rank has sent it itself
        assert agent.take() == [] and agent.dropped == 1
    finally:
        sender.close()
        agent.close()
