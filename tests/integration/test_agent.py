"""The node agent against a real mosquitto, with only NVML faked: status with a Last
Will, samples, XIDs mid-run, offline on a clean stop and on SIGKILL, reconnecting,
a hung GPU, heartbeat-only mode, the no-driver error, ``--once --json``, and the
daemon seeing the node."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiomqtt
import pytest

from tests.conftest import DaemonFactory
from tests.fakes import nvml as fake_mod
from tests.fakes.nvml import FakeNvml
from tests.helpers import eventually
from tmd import config as config_mod
from tmd import wire
from tmd.agent import agent as agent_mod
from tmd.agent.agent import Agent
from tmd.agent.nvml import Nvml, NvmlUnavailable
from tmd.errors import ConfigError
from tmd.tools.mosquitto import Mosquitto

ROOT = Path(__file__).resolve().parents[2]
KINDS = {"status": wire.NodeStatus, "gpu": wire.NodeGpu, "xid": wire.XidEvent}


def agent_config(b: Mosquitto, node: str, **agent: Any) -> config_mod.Config:
    return config_mod.from_dict(
        {
            "mqtt": {
                "host": b.host,
                "port": b.port,
                "reconnect_min_s": 0.1,
                "reconnect_max_s": 0.3,
            },
            "agent": {"node": node, "interval_s": 0.1, "xid_wait_ms": 50, **agent},
        }
    )


class Watch:
    """Everything published under one node's topics, decoded with tmd.wire."""

    def __init__(self) -> None:
        self.got: list[tuple[str, bool, Any]] = []

    def of(self, kind: str) -> list[Any]:
        return [m for k, _, m in self.got if k == kind]

    def last_status(self) -> wire.NodeStatus | None:
        statuses = self.of("status")
        return statuses[-1] if statuses else None


@contextlib.asynccontextmanager
async def watching(b: Mosquitto, node: str) -> AsyncIterator[Watch]:
    watch = Watch()
    async with aiomqtt.Client(b.host, b.port) as client:
        await client.subscribe(f"tmd/v1/node/{node}/#", qos=1)

        async def read() -> None:
            async for m in client.messages:
                kind = m.topic.value.rsplit("/", 1)[1]
                assert isinstance(m.payload, bytes)
                watch.got.append((kind, m.retain, wire.decode(m.payload, KINDS[kind])))

        task = asyncio.create_task(read())
        try:
            yield watch
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


async def retained_status(b: Mosquitto, node: str) -> wire.NodeStatus:
    async with watching(b, node) as watch:
        return await eventually(watch.last_status, timeout_s=5)


@contextlib.asynccontextmanager
async def running(config: config_mod.Config, fake: FakeNvml | None) -> AsyncIterator[Agent]:
    nvml = Nvml.open(fake) if fake is not None else None
    agent = Agent(config, nvml=nvml)
    task = asyncio.create_task(agent.run())
    try:
        await asyncio.wait_for(agent.ready.wait(), 10)
        yield agent
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if nvml is not None:
            nvml.close()


async def test_status_and_samples_arrive_and_decode(broker: Mosquitto) -> None:
    node = "ag-samples"
    async with watching(broker, node) as watch, running(agent_config(broker, node), FakeNvml(2)):
        await eventually(lambda: len(watch.of("gpu")) >= 3)
        status = watch.of("status")[0]
        assert (status.state, status.role, len(status.gpus)) == ("online", "worker", 2)
        assert status.gpus[1].uuid == "GPU-fake-0001" and "570.86.15" in status.agent
        sample = watch.of("gpu")[0]
        assert sample.node == node and [g.index for g in sample.gpus] == [0, 1]
        assert [s.seq for s in watch.of("gpu")[:3]] == [1, 2, 3]  # numbered (tmd.wire)
        assert sample.gpus[0].temp_c == 41.0 and sample.gpus[0].remap_failure is False
        # Nothing changes: after the first few in full, brief ones that repeat them.
        brief = await eventually(lambda: next((s for s in watch.of("gpu") if s.brief), None))
        assert brief.repeats(sample) and brief.reasons == [0, 0]
    # Stopped cleanly (the SIGTERM path): the retained status says offline.
    assert (await retained_status(broker, node)).state == "offline"


async def test_faults_mid_run_show_in_samples_and_xid_79_arrives(broker: Mosquitto) -> None:
    node = "ag-faults"
    fake = FakeNvml(4)
    fake.after(0.2, lambda: fake.double_bit_ecc(0))
    fake.after(0.2, lambda: fake.row_remap_failure(1))
    fake.after(0.2, lambda: fake.thermal_throttle(2))
    fake.after(0.2, lambda: fake.nvlink_replay_burst(2, count=4000, link=5))
    fake.after(0.4, lambda: fake.fall_off_bus(3))
    async with watching(broker, node) as watch, running(agent_config(broker, node), fake):
        (xid,) = await eventually(lambda: watch.of("xid"))
        assert (xid.node, xid.gpu, xid.xid) == (node, 3, 79)

        def faulty() -> list[wire.GpuSample] | None:
            full = [s for s in watch.of("gpu") if not s.brief]  # sent when a counter moves
            return full[-1].gpus if full[-1].gpus[3].temp_c is None else None

        gpus = await eventually(faulty)
        assert gpus[0].ecc_dbe_volatile == 1 and gpus[0].ecc_dbe_aggregate == 1
        assert gpus[1].remap_failure is True
        assert gpus[2].clock_event_reasons == fake_mod.THERMAL and gpus[2].nvlink_replay == 4000
        assert gpus[3].power_w is None  # lost: every getter says so, the sample still goes
        # Sustained throttling stays in every later sample.
        n = len(watch.of("gpu"))
        await eventually(lambda: len(watch.of("gpu")) >= n + 3)
        assert all(
            s.reasons[2] if s.brief else s.gpus[2].clock_event_reasons for s in watch.of("gpu")[n:]
        )


async def test_a_hung_gpu_stops_samples_without_stacking_threads(broker: Mosquitto) -> None:
    node = "ag-hung"
    fake = FakeNvml(1)
    config = agent_config(broker, node, sample_timeout_s=0.2)
    async with watching(broker, node) as watch, running(config, fake) as agent:
        await eventually(lambda: watch.of("gpu"))
        fake.gpus[0].hang_s = 1.0
        calls = fake.calls["nvmlDeviceGetPowerUsage"]  # the first getter of a sample
        await eventually(lambda: agent.sample_timeouts >= 1)
        # Sampled every 0.1 s: three more ticks while the call is hung (~1 s) ...
        await eventually(lambda: agent.skipped_samples >= 3)
        stalled = len(watch.of("gpu"))
        # ... and still one thread stuck in NVML, not one per tick.
        assert fake.calls["nvmlDeviceGetPowerUsage"] - calls <= 1
        assert agent.sample_timeouts == 1
        fake.gpus[0].hang_s = 0.0
        await eventually(lambda: len(watch.of("gpu")) >= stalled + 2, timeout_s=5)


async def test_systemd_hears_ready_then_watchdog_pings(
    broker: Mosquitto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "notify")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(path)
        sock.setblocking(False)  # read on the loop itself: no executor thread to wait for
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        loop = asyncio.get_running_loop()
        async with running(agent_config(broker, "ag-notify"), FakeNvml(1)):
            async with asyncio.timeout(20):
                got = [await loop.sock_recv(sock, 1024) for _ in range(4)]
    assert b"READY=1" in b"".join(got)
    assert b"WATCHDOG=1" in got


async def test_reconnects_and_resends_status_and_held_xids(own_broker: Mosquitto) -> None:
    node = "ag-reconnect"
    fake = FakeNvml(1)
    async with running(agent_config(own_broker, node), fake) as agent:
        async with watching(own_broker, node) as before:
            rev = (await eventually(lambda: before.of("gpu")))[0].rev
        own_broker.stop()
        await eventually(lambda: not agent.connected)
        fake.xid(0, 48)  # while the broker is away
        await eventually(lambda: agent.xids_waiting == 1)  # seen, held for the broker
        own_broker.start()
        async with watching(own_broker, node) as watch:
            (xid,) = await eventually(lambda: watch.of("xid"))
            assert xid.xid == 48
            samples = await eventually(lambda: watch.of("gpu"))
            # Briefs after a reconnect lean on no full sample sent before it.
            assert all(s.rev > rev for s in samples)
        assert (await retained_status(own_broker, node)).state == "online"


async def test_heartbeat_only_publishes_without_nvml(broker: Mosquitto) -> None:
    node = "ag-heartbeat"
    config = agent_config(broker, node, heartbeat_only=True, role="standby")
    assert agent_mod.open_nvml(config, FakeNvml(init_error=9)) is None  # NVML never touched
    async with watching(broker, node) as watch, running(config, None):
        await eventually(lambda: len(watch.of("gpu")) >= 2)
        status = watch.of("status")[0]
        assert (status.state, status.role, status.gpus) == ("online", "standby", [])
        assert "heartbeat only" in status.agent
        assert watch.of("gpu")[-1].gpus == []


def test_no_driver_is_a_clear_error_naming_heartbeat_only(broker: Mosquitto) -> None:
    config = agent_config(broker, "ag-nodriver")
    with pytest.raises(NvmlUnavailable, match=r"agent\.heartbeat_only = true") as err:
        agent_mod.open_nvml(config, FakeNvml(init_error=fake_mod.NVML_ERROR_DRIVER_NOT_LOADED))
    assert "driver is not loaded" in str(err.value)
    # The command line says the same and fails.
    done = spawn("--scenario", "no-driver").communicate(timeout=20)
    assert "agent.heartbeat_only" in done[1]


def test_once_json_prints_one_sample_of_every_gpu(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "agent.toml"
    cfg.write_text('[agent]\nnode = "ag-once"\n')
    assert agent_mod.run(str(cfg), once=True, as_json=True, lib=fake_mod.scenario("faults")) == 0
    printed = wire.decode(capsys.readouterr().out.encode(), wire.NodeGpu)
    assert printed.node == "ag-once" and len(printed.gpus) == 4
    assert printed.gpus[0].nvlink_replay == 5000 and printed.gpus[1].ecc_dbe_volatile == 1
    assert printed.gpus[2].remap_failure and printed.gpus[3].clock_event_reasons


def spawn(*args: str, config: Path | None = None) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "tests.fakes.nvml", *args]
    if config is not None:
        argv += ["--config", str(config)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def write_config(path: Path, b: Mosquitto, node: str) -> Path:
    path.write_text(
        f'[mqtt]\nhost = "{b.host}"\nport = {b.port}\n'
        f'[agent]\nnode = "{node}"\ninterval_s = 0.1\nxid_wait_ms = 50\n'
    )
    return path


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGKILL, -9), (signal.SIGTERM, 0)])
async def test_a_stopped_agent_process_leaves_offline(
    broker: Mosquitto, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    """SIGKILL: the broker delivers the Last Will. SIGTERM: the agent says it itself."""
    node = f"ag-proc-{sig.name.lower()}"
    proc = spawn("--scenario", "faults", config=write_config(tmp_path / "a.toml", broker, node))
    try:
        async with watching(broker, node) as watch:
            # XID 79 is scripted 1.5 s into the faults scenario.
            await eventually(lambda: watch.of("xid"), timeout_s=15)
            assert watch.last_status() is not None and watch.last_status().state == "online"
            proc.send_signal(sig)
            offline = await eventually(
                lambda: (s := watch.last_status()) and s.state == "offline" and s
            )
            assert offline.node == node and len(offline.gpus) == 4
        assert await asyncio.to_thread(proc.wait, 10) == code
        assert (await retained_status(broker, node)).state == "offline"
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


async def test_the_daemon_sees_the_node_online_with_its_gpus(
    broker: Mosquitto, start_daemon: DaemonFactory
) -> None:
    daemon = await start_daemon(broker)
    node = "ag-daemon"
    async with running(agent_config(broker, node), FakeNvml(2)):

        def seen() -> Any:
            view = daemon.view.nodes.get(node)
            return view if view and view.state == "online" and view.sample else None

        view = await eventually(seen)
        assert [g.uuid for g in view.gpus] == ["GPU-fake-0000", "GPU-fake-0001"]
        assert len(view.sample.gpus) == 2
    await eventually(lambda: daemon.view.nodes[node].state == "offline")


async def test_the_daemon_finds_gpu_faults_in_an_agent_s_brief_samples(
    broker: Mosquitto, start_daemon: DaemonFactory
) -> None:
    """A real agent's samples through mosquitto to a real daemon, brief between full
    ones: a GPU that starts throttling changes only its clock event reasons, so the
    samples stay brief and it is found from them; a double-bit ECC count is a counter,
    so a full sample carries it and it is found too."""
    daemon = await start_daemon(broker, detectors={"gpu_health": {"throttle_window_s": 2.0}})
    node = "ag-brief"
    fake = FakeNvml(2)
    samples = daemon.metrics.samples_by
    async with running(agent_config(broker, node, full_sample_every_s=60), fake):
        await eventually(lambda: samples["brief"].value >= 5)
        full = samples["full"].value  # the first few, a connection's
        fake.thermal_throttle(1)
        found = await eventually(lambda: daemon.journal.events(kind="GpuDegraded"))
        assert [(r.node, r.body["gpu"], r.body["cause"]) for r in found] == [
            (node, 1, "throttling")
        ]
        assert samples["full"].value == full  # found from brief samples alone
        fake.double_bit_ecc(0)
        (fault,) = await eventually(lambda: daemon.journal.events(kind="GpuFault"))
        assert (fault.node, fault.body["gpu"], fault.body["cause"]) == (node, 0, "volatile DBE")
        assert samples["full"].value > full and samples["unresolved"].value == 0


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"node": "a/b"}, "agent.node"),
        ({"role": "leader"}, "agent.role"),
        ({"interval_s": 0}, "agent.interval_s"),
        ({"sample_timeout_s": -1.0}, "agent.sample_timeout_s"),
        ({"xid_wait_ms": 5}, "agent.xid_wait_ms"),
        ({"heartbeat_only": "yes"}, "agent.heartbeat_only"),
    ],
)
def test_bad_agent_config_names_the_key(table: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_mod.from_dict({"agent": table})
    assert err.value.key == key
    env = {"TMD_AGENT__HEARTBEAT_ONLY": "true", "TMD_AGENT__INTERVAL_S": "0.5"}
    loaded = config_mod.load(None, env=env).agent
    assert loaded.heartbeat_only and loaded.interval_s == 0.5
