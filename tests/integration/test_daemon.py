"""The daemon against a real mosquitto: telemetry lands in the view, every class of bad
payload is rejected and counted while the daemon keeps serving, a broker restart is
survived, /metrics parses, and mutating requests need the bearer token."""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import DaemonFactory
from tests.helpers import Publisher, eventually
from tmd import wire
from tmd.connection import _Lane
from tmd.daemon.daemon import Daemon
from tmd.tools import synth
from tmd.tools.mosquitto import Mosquitto


def now() -> float:
    return time.time()


def iter_batch(job: str, rank: int, steps: range, *, node: str = "n0") -> wire.IterBatch:
    t = now()
    return wire.IterBatch(
        ts=t,
        job=job,
        rank=rank,
        node=node,
        steps=[wire.StepTiming(s, t, 1.0, 0.6, 0.3, 0.05, 0.05) for s in steps],
    )


def rejected(daemon: Daemon, reason: str) -> float:
    value = daemon.metrics.registry.get_sample_value(
        "tmd_messages_rejected_total", {"reason": reason}
    )
    return value or 0.0


async def get_json(url: str, **kw: Any) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as http, http.get(url, **kw) as resp:
        return resp.status, await resp.json()


async def test_valid_telemetry_lands_in_the_view(
    broker: Mosquitto, publisher: Publisher, start_daemon: DaemonFactory
) -> None:
    daemon = await start_daemon(broker)
    job = "valid"
    status = wire.JobStatus(
        ts=now(),
        job=job,
        generation=3,
        world_size=2,
        members=[wire.Member(0, "va"), wire.Member(1, "vb")],
        standbys=[wire.StandbyInfo(node="vs", state="ready", warmup_s=2.5)],
    )
    publisher.send(wire.job_topic(job, "status"), wire.encode(status), retain=True)
    publisher.send(wire.iter_topic(job, 0), wire.encode(iter_batch(job, 0, range(1, 4), node="va")))
    publisher.send(wire.iter_topic(job, 1), wire.encode(iter_batch(job, 1, range(1, 3), node="vb")))
    publisher.send(
        wire.node_topic("va", "status"),
        wire.encode(
            wire.NodeStatus(ts=now(), node="va", state="online", gpus=[wire.GpuInfo(index=0)])
        ),
    )
    publisher.send(
        wire.node_topic("va", "gpu"),
        wire.encode(wire.NodeGpu(ts=now(), node="va", gpus=[wire.GpuSample(index=0, temp_c=71.0)])),
    )
    publisher.send(
        wire.node_topic("va", "xid"), wire.encode(wire.XidEvent(ts=now(), node="va", gpu=0, xid=79))
    )

    await eventually(lambda: daemon.view.nodes.get("va") and daemon.view.nodes["va"].xids)
    await eventually(lambda: job in daemon.view.jobs and len(daemon.view.jobs[job].ranks) == 2)
    view_job = daemon.view.jobs[job]
    assert (view_job.world_size, view_job.generation) == (2, 3)
    assert view_job.ranks[0].last_step == 3 and view_job.ranks[1].total_steps == 2
    assert view_job.standbys["vs"].state == "ready"

    code, body = await get_json(f"http://127.0.0.1:{daemon.api.port}/api/v1/status?job={job}")
    assert code == 200
    (j,) = body["jobs"]
    assert j["world_size"] == 2 and j["step"] == 3
    assert [r["rank"] for r in j["ranks"]] == [0, 1]
    node = next(n for n in body["nodes"] if n["node"] == "va")
    assert node["max_temp_c"] == 71.0 and node["last_xid"]["xid"] == 79


BAD = [
    # (topic, payload, reason)
    ("tmd/v1/job/bad/rank/0/iter", b"{not json", "json"),
    (
        "tmd/v1/job/bad/rank/0/iter",
        b'{"v":1,"ts":1,"job":"bad","rank":0,"node":"n","steps":[[1,1,NaN,0,0,0,0]]}',
        "json",
    ),
    (
        "tmd/v1/job/bad/rank/0/iter",
        b'{"v":1,"ts":"now","job":"bad","rank":0,"node":"n","steps":[[1,1,1,1,0,0,0]]}',
        "schema",
    ),
    (
        "tmd/v1/job/bad/rank/0/iter",
        b'{"v":1,"ts":1,"rank":0,"node":"n","steps":[[1,1,1,1,0,0,0]]}',
        "schema",
    ),
    ("tmd/v1/job/bad/rank/0/iter", b'{"v":9,"ts":1,"job":"bad","rank":0}', "version"),
    (
        "tmd/v1/job/bad/rank/0/iter",
        b'{"v":1,"ts":1,"job":"bad","rank":0,"node":"n","steps":[[1,1,-2.0,1,0,0,0]]}',
        "value",
    ),
    ("tmd/v1/job/bad/rank/0/iter", b"x" * 300_000, "oversize"),
    ("tmd/v1/job/bad/rank/0/iter", wire.encode(iter_batch("other", 0, range(1, 2))), "mismatch"),
    ("tmd/v1/job/bad/rank/5/iter", wire.encode(iter_batch("bad", 9, range(1, 2))), "mismatch"),
    ("tmd/v1/job/bad/rank/007/iter", wire.encode(iter_batch("bad", 7, range(1, 2))), "topic"),
    ("tmd/v1/job/bad/rank/x/iter", b"{}", "topic"),
    ("tmd/v1/node/n/gpu/extra", b"{}", "topic"),
    ("tmd/v1/job/bad/rank/99/iter", wire.encode(iter_batch("bad", 99, range(1, 2))), "rank"),
]


async def test_every_bad_payload_is_rejected_counted_and_the_daemon_keeps_serving(
    broker: Mosquitto, publisher: Publisher, start_daemon: DaemonFactory
) -> None:
    daemon = await start_daemon(broker)
    # World size 4, so rank 99 is out of range.
    status = wire.JobStatus(
        ts=now(),
        job="bad",
        generation=0,
        world_size=4,
        members=[wire.Member(r, f"b{r}") for r in range(4)],
    )
    publisher.send(wire.job_topic("bad", "status"), wire.encode(status))
    await eventually(lambda: daemon.view.jobs.get("bad") and daemon.view.jobs["bad"].world_size)
    # "topic" rejections need a subscription that matches them: the daemon's do not
    # cover tmd/v1/node/+/gpu/extra, so feed those through the handler as the broker would.
    expected: dict[str, float] = {}
    for topic, payload, reason in BAD:
        expected[reason] = expected.get(reason, 0) + 1
        if reason == "topic" and topic.count("/") != 6:
            daemon.ingest.handle(topic, payload)
        else:
            publisher.send(topic, payload)
    for reason, count in expected.items():
        await eventually(lambda r=reason, c=count: rejected(daemon, r) == c)  # type: ignore[misc]
    assert "bad" in daemon.view.jobs and daemon.view.jobs["bad"].ranks == {}

    # Still serving: a valid message lands, the API answers healthy.
    publisher.send(wire.iter_topic("bad", 1), wire.encode(iter_batch("bad", 1, range(1, 5))))
    await eventually(lambda: 1 in daemon.view.jobs["bad"].ranks)
    code, health = await get_json(f"http://127.0.0.1:{daemon.api.port}/healthz")
    assert code == 200 and health["ok"] and health["mqtt"] == "connected"


async def test_bad_messages_are_logged_once_per_interval(
    broker: Mosquitto,
    publisher: Publisher,
    start_daemon: DaemonFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from tmd import log

    log.setup(level="info", format="json")
    daemon = await start_daemon(broker, ingest={"reject_log_interval_s": 3600})
    for _ in range(20):
        publisher.send("tmd/v1/job/spam/rank/0/iter", b"garbage")
    await eventually(lambda: rejected(daemon, "json") == 20)
    lines = [json.loads(ln) for ln in capsys.readouterr().err.splitlines() if ln.startswith("{")]
    rejects = [ln for ln in lines if ln.get("event") == "message rejected"]
    assert len(rejects) == 1
    assert rejects[0]["topic"] == "tmd/v1/job/spam/rank/0/iter" and rejects[0]["reason"] == "json"


def reading_lane(daemon: Any) -> _Lane:
    """The QoS 0 read path of the daemon's connection now (``handle_qos0_inline``)."""
    lane = daemon.ingest._client_now._client._sock
    assert isinstance(lane, _Lane)
    return lane


async def test_broker_restart_is_survived(
    own_broker: Mosquitto, start_daemon: DaemonFactory
) -> None:
    daemon = await start_daemon(own_broker)
    lane = reading_lane(daemon)
    own_broker.restart()  # same port; the daemon's connection is cut
    await eventually(lambda: not daemon.ingest.connected, timeout_s=10)
    await eventually(lambda: daemon.ingest.connected, timeout_s=20)
    assert reading_lane(daemon) is not lane  # the new connection reads through its own
    pub = Publisher(own_broker.host, own_broker.port)
    try:
        pub.send(wire.iter_topic("after", 0), wire.encode(iter_batch("after", 0, range(1, 2))))
        await eventually(lambda: "after" in daemon.view.jobs)
    finally:
        pub.close()
    connects = daemon.metrics.registry.get_sample_value("tmd_mqtt_connects_total")
    assert connects is not None and connects >= 2


async def test_metrics_parse_with_the_prometheus_parser(
    broker: Mosquitto, publisher: Publisher, start_daemon: DaemonFactory
) -> None:
    daemon = await start_daemon(broker)
    publisher.send(wire.iter_topic("metrics", 0), wire.encode(iter_batch("metrics", 0, range(3))))
    await eventually(lambda: "metrics" in daemon.view.jobs)
    url = f"http://127.0.0.1:{daemon.api.port}/metrics"
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        assert resp.status == 200
        text = await resp.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "tmd_messages_received",
        "tmd_messages_rejected",
        "tmd_rank_steps",
        "tmd_ingest_latency_seconds",
        "tmd_mqtt_connected",
        "tmd_plugin_up",
        "tmd_plugin_restarts",
        "tmd_view_ranks",
    ):
        assert name in families, name
    steps = {
        s.labels.get("outcome"): s.value
        for s in families["tmd_rank_steps"].samples
        if s.name == "tmd_rank_steps_total"
    }
    assert steps["accepted"] == 3
    up = {s.labels["plugin"]: s.value for s in families["tmd_plugin_up"].samples}
    assert up["node_lost"] == 1.0


async def test_mutating_requests_need_the_bearer_token(
    broker: Mosquitto, publisher: Publisher, start_daemon: DaemonFactory, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t0ken-from-file\n")
    daemon = await start_daemon(broker, api={"token_file": str(token_file)})
    publisher.send(wire.iter_topic("gone", 0), wire.encode(iter_batch("gone", 0, range(1, 2))))
    await eventually(lambda: "gone" in daemon.view.jobs)
    url = f"http://127.0.0.1:{daemon.api.port}/api/v1/jobs/gone"
    async with aiohttp.ClientSession() as http:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "t0ken-from-file"},
        ):
            async with http.delete(url, headers=headers) as resp:
                assert resp.status == 401, headers
                assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        # Unknown routes are refused before routing, too: no probing without the token.
        async with http.post(f"http://127.0.0.1:{daemon.api.port}/api/v1/nothing") as resp:
            assert resp.status == 401
        assert "gone" in daemon.view.jobs
        async with http.delete(url, headers={"Authorization": "Bearer t0ken-from-file"}) as resp:
            assert resp.status == 200
        assert "gone" not in daemon.view.jobs
        async with http.get(f"http://127.0.0.1:{daemon.api.port}/api/v1/status") as resp:
            assert resp.status == 200  # reads stay open


async def test_without_a_configured_token_mutations_are_refused(
    broker: Mosquitto, start_daemon: DaemonFactory
) -> None:
    daemon = await start_daemon(broker)
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{daemon.api.port}/api/v1/jobs/x"
        async with http.delete(url, headers={"Authorization": "Bearer "}) as resp:
            assert resp.status == 401
            assert "api.token" in (await resp.json())["error"]


async def test_killed_agent_last_will_becomes_a_journaled_node_lost(
    broker: Mosquitto, start_daemon: DaemonFactory
) -> None:
    # Trusted 0.5 s after its probes came back in time (5 s by default).
    daemon = await start_daemon(broker, ingest={"stale_settle_s": 0.5})
    agent = mp.get_context("spawn").Process(
        target=synth.heartbeat_agent, args=(broker.host, broker.port, "will-node"), daemon=True
    )
    agent.start()
    try:
        await eventually(
            lambda: (
                daemon.view.nodes.get("will-node")
                and daemon.view.nodes["will-node"].state == "online"
            ),
            timeout_s=20,
        )
        # Once the daemon trusts its view (a Will read before that is a silence, judged
        # only past the heartbeat timeout), a Will is a loss at once.
        await eventually(lambda: daemon.health()["view"] == "current", timeout_s=20)
        agent.kill()
        await eventually(lambda: daemon.view.nodes["will-node"].state == "offline")
    finally:
        agent.kill()
        agent.join()
    rows = await eventually(lambda: daemon.journal.events(kind="NodeLost"))
    assert rows[0].node == "will-node" and rows[0].body["cause"] == "last_will"
    code, body = await get_json(f"http://127.0.0.1:{daemon.api.port}/api/v1/events?kind=NodeLost")
    assert code == 200 and body["events"][0]["node"] == "will-node"


async def test_status_of_a_large_job_is_served_in_chunks(
    broker: Mosquitto, start_daemon: DaemonFactory
) -> None:
    daemon = await start_daemon(broker)
    t = now()
    n = 3000
    status = wire.JobStatus(
        ts=t,
        job="large",
        generation=0,
        world_size=n,
        members=[wire.Member(r, f"l{r // 8}") for r in range(n)],
    )
    daemon.ingest.handle(wire.job_topic("large", "status"), wire.encode(status))
    for r in range(n):
        daemon.ingest.handle(
            wire.iter_topic("large", r),
            wire.encode(iter_batch("large", r, range(1, 3), node=f"l{r // 8}")),
        )
    code, body = await get_json(f"http://127.0.0.1:{daemon.api.port}/api/v1/status?job=large")
    assert code == 200
    ranks = body["jobs"][0]["ranks"]
    assert [r["rank"] for r in ranks] == list(range(n))
    assert all(r["last_step"] == 2 for r in ranks)


async def test_a_core_failure_ends_the_daemon_with_an_error(
    broker: Mosquitto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plug-ins restart; the core does not: systemd restarts the whole daemon."""
    from tmd import config as config_mod
    from tmd.daemon import daemon as daemon_mod

    monkeypatch.setattr(daemon_mod, "HOUSEKEEPING_INTERVAL_S", 0.05)
    daemon = Daemon(
        config_mod.from_dict(
            {
                "mqtt": {"host": broker.host, "port": broker.port},
                "api": {"port": 0},
                "journal": {"path": str(tmp_path / "j.sqlite3")},
            }
        )
    )

    def broken(now: float, after_s: float) -> tuple[int, int]:
        raise RuntimeError("view corrupted")

    daemon.view.forget_silent = broken  # type: ignore[method-assign]
    with pytest.raises(ExceptionGroup) as err:
        await asyncio.wait_for(daemon.run(), 20)
    assert err.group_contains(RuntimeError, match="view corrupted")


async def test_journal_write_failure_is_counted_and_the_event_still_flows(
    broker: Mosquitto, start_daemon: DaemonFactory
) -> None:
    from tmd.daemon import events

    daemon = await start_daemon(broker)
    sub = daemon.bus.subscribe("t", (events.Finding,))
    daemon.journal.close()  # every write now fails
    daemon.emit(events.NodeLost(ts=now(), node="x", cause="heartbeat"), "test")
    assert daemon.metrics.registry.get_sample_value("tmd_journal_errors_total") == 1
    assert len(sub) == 1


async def test_fatal_xid_becomes_a_journaled_gpu_fault_and_app_xids_do_not(
    broker: Mosquitto, publisher: Publisher, start_daemon: DaemonFactory
) -> None:
    daemon = await start_daemon(broker)
    for code in (13, 43, 79):
        publisher.send(
            wire.node_topic("xid-n", "xid"),
            wire.encode(wire.XidEvent(ts=now(), node="xid-n", gpu=2, xid=code)),
        )
    rows = await eventually(lambda: daemon.journal.events(kind="GpuFault"))
    assert [(r.node, r.body["gpu"], r.body["cause"]) for r in rows] == [("xid-n", 2, "xid 79")]
    assert daemon.journal.events(kind="GpuDegraded") == []
    assert len(daemon.view.nodes["xid-n"].xids) == 3  # all recorded in the view


async def test_a_slow_rank_is_found_through_the_whole_pipeline(
    broker: Mosquitto, start_daemon: DaemonFactory
) -> None:
    daemon = await start_daemon(broker)
    spec = synth.SynthSpec(
        host=broker.host,
        port=broker.port,
        job="slowjob",
        ranks=8,
        ranks_per_node=1,
        step_s=0.05,
        flush_s=0.2,
        seconds=20,
        gpu_health=False,
        slow={5: 1.3},
    )
    proc, _ = synth.start(spec)
    try:
        rows = await eventually(lambda: daemon.journal.events(kind="StragglerFound"), timeout_s=30)
    finally:
        proc.kill()
        proc.join()
    (row,) = rows
    assert row.job == "slowjob" and row.node == "node-00005"
    assert row.body["slowdown"] == pytest.approx(0.3, abs=0.08)
