"""The store-backed control log and the direct Python API, against a real TCPStore."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from tmd import wire
from tmd.errors import ConfigError, MigrationError
from tmd.runtime.control import (
    CTL_LOG,
    STATUS_KEY,
    JobController,
    StoreControl,
    append,
    put_status,
    register_standby,
    standbys,
)
from tmd.runtime.env import RuntimeEnv
from tmd.runtime.group import StoreAddress
from tmd.runtime.launch import host_store


@pytest.fixture
def store() -> Iterator[object]:
    yield host_store(0)


def _poll_until(channel: StoreControl, count: int) -> list[object]:
    got: list[object] = []
    deadline = time.monotonic() + 10
    while len(got) < count and time.monotonic() < deadline:
        got += channel.poll()
        time.sleep(0.01)
    return got


def test_commands_reach_the_channel_in_order_and_other_jobs_are_ignored(store) -> None:  # type: ignore[no-untyped-def]
    address = StoreAddress("127.0.0.1", store.port)
    channel = StoreControl(address, job="j", poll_interval=timedelta(milliseconds=5))
    try:
        JobController(store, job="other").abort("x")
        ctl = JobController(store, job="j")
        ctl.prepare("m1", leaver="a", joiner="b")
        ctl.switch("m1", at_step=9)
        append(store, CTL_LOG, b"not json")
        ctl.abort("m1")
        got = _poll_until(channel, 3)
    finally:
        channel.close()
    assert [type(m) for m in got] == [wire.Prepare, wire.Switch, wire.Abort]
    assert channel.rejected == 1
    assert isinstance(got[1], wire.Switch) and got[1].at_step == 9


def test_acks_are_collected_and_a_failed_ack_raises(store) -> None:  # type: ignore[no-untyped-def]
    address = StoreAddress("127.0.0.1", store.port)
    channel = StoreControl(address, job="j", poll_interval=timedelta(milliseconds=5))
    ctl = JobController(store, job="j")
    try:
        channel.ack(wire.Ack(ts=1.0, job="j", migration_id="m1", kind="prepared", node="a"))
        assert len(ctl.wait_acks("m1", "prepared", count=1, timeout=timedelta(seconds=5))) == 1
        channel.ack(wire.Ack(ts=1.0, job="j", migration_id="m1", kind="failed", node="b"))
        with pytest.raises(MigrationError):
            ctl.wait_acks("m1", "switched", count=1, timeout=timedelta(seconds=5))
    finally:
        channel.close()


def test_status_carries_the_standby_registry(store) -> None:  # type: ignore[no-untyped-def]
    address = StoreAddress("127.0.0.1", store.port)
    register_standby(store, wire.StandbyInfo(node="s0", state="warming"))
    register_standby(store, wire.StandbyInfo(node="s0", state="ready", warmup_s=2.5))
    assert standbys(store) == [wire.StandbyInfo(node="s0", state="ready", warmup_s=2.5)]
    # A standby machine of two slots is ready once both are, with its slower warm-up.
    two = wire.StandbyInfo(node="m", state="ready", warmup_s=1.0, slots=2)
    register_standby(store, two, local_rank=0)
    assert standbys(store)[1] == wire.StandbyInfo(node="m", state="warming", slots=2)
    register_standby(store, wire.StandbyInfo(node="m", state="ready", warmup_s=3.0, slots=2),
                     local_rank=1)  # fmt: skip
    assert standbys(store)[1] == wire.StandbyInfo(node="m", state="ready", warmup_s=3.0, slots=2)
    register_standby(store, wire.StandbyInfo(node="m", state="joining", slots=2), local_rank=1)
    assert standbys(store)[1].state == "joining"
    channel = StoreControl(address, job="j", poll_interval=timedelta(milliseconds=5))
    try:
        status = wire.JobStatus(ts=1.0, job="j", generation=0, world_size=1,
                                members=[wire.Member(0, "w0")], state="stopped")  # fmt: skip
        channel.publish_status(status)
        deadline = time.monotonic() + 5
        while not channel.stopped() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert channel.stopped()
        published = JobController(store, job="j").status()
        assert published is not None and [s.node for s in published.standbys] == ["s0", "m"]
    finally:
        channel.close()


def test_environment_contract() -> None:
    env = RuntimeEnv.from_environ(
        {"TMD_ROLE": "standby", "TMD_NODE": "sb0", "WORLD_SIZE": "4", "TMD_STORE": "10.0.0.1:29500"}
    )
    assert (env.role, env.node, env.world_size, env.store.port) == ("standby", "sb0", 4, 29500)
    assert env.host == ""  # not loopback: gloo resolves the hostname
    # A machine's name defaults to the host name, the agent's default too.
    env = RuntimeEnv.from_environ({"TMD_ROLE": "standby", "WORLD_SIZE": "4", "TMD_STORE": "h:1"})
    assert env.node == wire.default_node_name()
    env = RuntimeEnv.from_environ(
        {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
         "TMD_STORE": "h:1"}
    )  # fmt: skip
    assert (env.node, env.local_rank, env.local_world_size, env.slot) == (
        wire.default_node_name(),
        1,
        2,
        f"{wire.default_node_name()}/1",
    )
    for bad in ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, {"LOCAL_RANK": "x"}):  # fmt: skip
        with pytest.raises(ConfigError, match="LOCAL_RANK"):
            RuntimeEnv.from_environ({"WORLD_SIZE": "4", "TMD_STORE": "h:1", **bad})
    with pytest.raises(ConfigError):
        RuntimeEnv.from_environ({"RANK": "4", "WORLD_SIZE": "4", "TMD_STORE": "h:1"})


def test_a_late_status_does_not_undo_a_newer_one(store) -> None:  # type: ignore[no-untyped-def]
    def status(generation: int, step: int, ts: float, state: str) -> wire.JobStatus:
        return wire.JobStatus(
            ts=ts, job="j", generation=generation, world_size=2, step=step, state=state,  # type: ignore[arg-type]
            members=[wire.Member(0, "w0"), wire.Member(1, "w1")],
        )  # fmt: skip

    def stored() -> wire.JobStatus:
        return wire.decode(bytes(store.get(STATUS_KEY)), wire.JobStatus)  # type: ignore[no-any-return]

    assert put_status(store, status(0, 0, 1.0, "running")) is not None
    assert put_status(store, status(0, 12, 3.0, "stopped")) is not None
    # rank 1's status from the start of the job, written late by its thread
    assert put_status(store, status(0, 0, 2.0, "running")) is None
    assert stored().state == "stopped"
    assert put_status(store, status(1, 0, 0.5, "running")) is not None  # a new generation
    assert stored().generation == 1
    # At one step, the member that stopped last has a clock 30 s behind another's
    # "running" of that step: the job still reads as stopped.
    assert put_status(store, status(1, 40, 100.0, "running")) is not None
    assert put_status(store, status(1, 40, 70.0, "stopped")) is not None
    assert put_status(store, status(1, 40, 101.0, "running")) is None
    assert stored().state == "stopped"


def test_the_agent_and_the_runtime_name_a_machine_alike() -> None:
    from tmd.agent.agent import node_name
    from tmd.config import AgentConfig

    env = RuntimeEnv.from_environ({"WORLD_SIZE": "1", "TMD_STORE": "h:1"})
    assert node_name(AgentConfig()) == env.node == wire.default_node_name()


def test_srun_s_variables_stand_in_for_torchrun_s() -> None:
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
             "SLURM_NTASKS_PER_NODE": "4", "TMD_STORE": "h:1", "TMD_NODE": "gpu-07"}  # fmt: skip
    env = RuntimeEnv.from_environ(slurm)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (5, 8, 1, 4)
    env = RuntimeEnv.from_environ({**slurm, "RANK": "2", "LOCAL_RANK": "2"})  # torchrun's win
    assert (env.rank, env.local_rank) == (2, 2)
    with pytest.raises(ConfigError, match="TMD_NODE"):
        RuntimeEnv.from_environ({**slurm, "TMD_NODE": "gpu 07"})


def test_broker_options_are_the_daemon_s(tmp_path: Path) -> None:
    """A job reads the same ``[mqtt]`` table the agent and the daemon read (one file
    may serve all three), with the same ``TMD_MQTT__`` overrides; TMD_BROKER names the
    host and port; a bad key stops it at start, named."""
    base = {"WORLD_SIZE": "1", "TMD_STORE": "h:1"}
    assert RuntimeEnv.from_environ(base).mqtt is None  # no broker: control via the store
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    conf = tmp_path / "agent.toml"
    conf.write_text(f'[mqtt]\nhost = "head"\nport = 8883\nusername = "llm"\n'
                    f'password_file = "{secret}"\n[agent]\ninterval_s = 1.0\n')  # fmt: skip
    env = RuntimeEnv.from_environ({**base, "TMD_MQTT_CONFIG": str(conf)})
    assert env.mqtt is not None and env.broker == "head:8883"
    assert (env.mqtt.username, env.mqtt.read_password()) == ("llm", "s3cret")
    env = RuntimeEnv.from_environ(
        {**base, "TMD_MQTT_CONFIG": str(conf), "TMD_BROKER": "10.0.0.9:1884",
         "TMD_MQTT__USERNAME": "other"}
    )  # fmt: skip
    assert env.mqtt is not None and (env.broker, env.mqtt.username) == ("10.0.0.9:1884", "other")
    with pytest.raises(ConfigError, match=r"mqtt\.ca_file"):
        RuntimeEnv.from_environ({**base, "TMD_BROKER": "h:1", "TMD_MQTT__CA_FILE": "/nope"})
    with pytest.raises(ConfigError, match="TMD_BROKER"):
        RuntimeEnv.from_environ({**base, "TMD_BROKER": "nohost"})
