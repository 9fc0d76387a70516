"""Telemetry through the machine's agent (issue 16), all real but NVML: a mosquitto, a
daemon, ``tmd agent`` as its own process (heartbeat only: no GPU here) relaying on a
Unix socket, and a training job of one machine of two ranks pointed at it. Its steps
reach the daemon's view in the agent's messages, one per machine each interval, its
GPU sample inside (``agent.relay_sample``); the
agent hangs (SIGSTOP) with their batches in its socket, then dies (SIGKILL), and the
ranks publish directly what it never confirmed and all that follows: every step of
both ranks arrives, and the view counts each once."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DaemonFactory
from tests.helpers import eventually
from tests.integration.runtime_conftest_helpers import release, run_job
from tmd.tools.mosquitto import Mosquitto

pytestmark = pytest.mark.slow

JOB = "relayjob"
NODE = "worker0"  # tmd launch's first machine
STEPS = 24


def spawn_agent(config: Path) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "tmd.cli", "agent", "--config", str(config)]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def test_steps_come_through_the_agent_and_straight_on_once_it_dies(
    broker: Mosquitto, start_daemon: DaemonFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    daemon = await start_daemon(broker)
    sock = tmp_path / "agent.sock"
    config = tmp_path / "agent.toml"
    config.write_text(
        f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n'
        f'[agent]\nnode = "{NODE}"\nheartbeat_only = true\ninterval_s = 0.5\n'
        f'relay_socket = "{sock}"\nrelay_sample = true\n'
    )
    agent = spawn_agent(config)
    received = daemon.metrics.received_by
    job = None
    try:
        node = await eventually(lambda: (n := daemon.view.nodes.get(NODE)) and n.state == "online")
        assert node
        monkeypatch.setenv("TMD_AGENT_SOCKET", str(sock))
        out = tmp_path / "job"
        job = run_job(out, nproc=2, nproc_per_node=2, steps=STEPS, job=JOB, held=True,
                      broker=f"{broker.host}:{broker.port}")  # fmt: skip

        def ranks_seen() -> bool:
            j = daemon.view.jobs.get(JOB)
            return j is not None and all(j.ranks.get(r) and j.ranks[r].total_steps for r in (0, 1))

        await eventually(lambda: ranks_seen() and received["node_iter"].value >= 2, timeout_s=120)
        assert received["iter"].value == 0  # every batch so far came through the agent
        # Its samples go inside what it relays (on its own topic on a tick with nothing
        # to relay): the machine stays online, its sample fresh.
        relayed, sample = received["node_iter"].value, daemon.view.nodes[NODE].sample
        assert sample is not None
        await eventually(lambda: received["node_iter"].value >= relayed + 2)
        fresh = daemon.view.nodes[NODE]
        assert fresh.state == "online" and fresh.sample is not None
        assert fresh.sample.ts > sample.ts
        # What it relays is numbered, and nothing went missing on the way (tmd.wire).
        assert fresh.seq["node_iter"][0] >= 2
        assert daemon.metrics.lost_by["node_iter"].value == daemon.metrics.lost_by["gpu"].value == 0
        # Hung first: the ranks' batches pile up in its socket, taken and never
        # published; then dead, its socket file left behind with nobody reading it.
        agent.send_signal(signal.SIGSTOP)
        await asyncio.sleep(1.5)
        agent.send_signal(signal.SIGKILL)
        assert await asyncio.to_thread(agent.wait, 10) == -9
        release(out)
        codes = await asyncio.to_thread(job.wait)
        assert set(codes.values()) == {0}, codes

        def complete() -> bool:
            ranks = daemon.view.jobs[JOB].ranks
            return all(ranks[r].total_steps == STEPS for r in (0, 1))

        await eventually(complete, timeout_s=30)
        assert received["iter"].value > 0  # the rest came straight from the ranks
        # Numbered by each rank's runtime as it published them; none went missing.
        assert all(daemon.view.jobs[JOB].ranks[r].seq is not None for r in (0, 1))
        assert daemon.metrics.lost_by["iter"].value == 0
        assert all(daemon.view.jobs[JOB].ranks[r].late == 0 for r in (0, 1))
        assert os.path.exists(sock)  # noqa: ASYNC240 (a killed agent leaves it)
    finally:
        if agent.poll() is None:
            agent.kill()
        agent.communicate()
        if job is not None:
            job.terminate()
