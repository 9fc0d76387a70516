"""Requests over real HTTP: an Alertmanager webhook and operator drain/migrate become
journaled requests and policy decisions; bad input is a 4xx naming the problem."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from typing import Any

import aiohttp

from tests.conftest import DaemonFactory
from tests.helpers import Publisher, eventually
from tmd import wire
from tmd.daemon.daemon import Daemon
from tmd.tools.mosquitto import Mosquitto

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def job_status(job: str, nodes: list[str], standbys: dict[str, str]) -> bytes:
    return wire.encode(
        wire.JobStatus(
            ts=time.time(),
            job=job,
            generation=0,
            world_size=len(nodes),
            members=[wire.Member(r, n) for r, n in enumerate(nodes)],
            standbys=[wire.StandbyInfo(node=s, state=st) for s, st in standbys.items()],  # type: ignore[arg-type]
        )
    )


def webhook(*alerts: dict[str, Any]) -> dict[str, Any]:
    return {
        "version": "4",
        "groupKey": "{}:{}",
        "truncatedAlerts": 0,
        "status": "firing",
        "receiver": "tmd",
        "groupLabels": {},
        "commonLabels": {},
        "commonAnnotations": {},
        "externalURL": "http://alertmanager:9093",
        "alerts": list(alerts),
    }


def alert(node: str, fp: str, status: str = "firing") -> dict[str, Any]:
    return {
        "status": status,
        "labels": {"alertname": "GpuXid79", "node": f"{node}:9400"},
        "annotations": {"summary": "GPU fell off the bus"},
        "startsAt": "2026-11-30T03:00:00Z",
        "endsAt": "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus/graph",
        "fingerprint": fp,
    }


async def post(daemon: Daemon, path: str, body: Any, headers: dict[str, str] = AUTH) -> int:
    url = f"http://127.0.0.1:{daemon.api.port}{path}"
    async with aiohttp.ClientSession() as http:
        kw: dict[str, Any] = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with http.post(url, headers=headers, **kw) as resp:
            return resp.status


async def test_alertmanager_webhook_triggers_failover_once(
    broker: Mosquitto, publisher: Publisher, start_daemon: DaemonFactory
) -> None:
    daemon = await start_daemon(broker, api={"token": TOKEN})
    publisher.send(
        wire.job_topic("am", "status"), job_status("am", ["am-0", "am-1"], {"am-s": "ready"})
    )
    await eventually(lambda: "am" in daemon.view.jobs)
    hook = webhook(alert("am-1", "fp1"), alert("am-0", "fp0", status="resolved"))
    assert await post(daemon, "/api/v1/alerts", hook) == 202
    assert await post(daemon, "/api/v1/alerts", hook) == 202  # Alertmanager resends
    # A sentinel alert after the resend, about a node that runs no job: the policy takes
    # alerts in order, so once it has held the sentinel it has weighed the resend.
    assert await post(daemon, "/api/v1/alerts", webhook(alert("idle", "sentinel"))) == 202
    await eventually(
        lambda: any("sentinel" in r.body["reason"] for r in daemon.journal.events(kind="Hold"))
    )
    rows = daemon.journal.events(kind="Migrate")
    assert [(r.job, r.node, r.source) for r in rows] == [("am", "am-1", "alert")]
    assert "GpuXid79" in rows[0].body["reason"]
    fired = daemon.journal.events(kind="AlertFired")
    assert len(fired) == 5 and fired[0].source == "alertmanager"


async def test_bad_webhooks_are_4xx(broker: Mosquitto, start_daemon: DaemonFactory) -> None:
    daemon = await start_daemon(broker, api={"token": TOKEN})
    assert await post(daemon, "/api/v1/alerts", webhook(alert("x", "f")), headers={}) == 401
    assert await post(daemon, "/api/v1/alerts", {**webhook(), "version": "3"}) == 400
    assert await post(daemon, "/api/v1/alerts", b"{not json") == 400
    assert await post(daemon, "/api/v1/alerts", webhook({"status": "firing"})) == 400
    assert await post(daemon, "/api/v1/drain", {"node": "a/b"}) == 400
    assert await post(daemon, "/api/v1/drain", {"node": "n", "extra": 1}) == 400
    assert daemon.journal.events() == []


async def test_drain_and_migrate_from_the_cli(
    broker: Mosquitto, publisher: Publisher, start_daemon: DaemonFactory, tmp_path: Any
) -> None:
    daemon = await start_daemon(broker, api={"token": TOKEN})
    publisher.send(wire.job_topic("dr", "status"), job_status("dr", ["dr-0", "dr-1"], {}))
    await eventually(lambda: "dr" in daemon.view.jobs)
    api = f"http://127.0.0.1:{daemon.api.port}"
    env = {**os.environ, "TMD_API_TOKEN": TOKEN}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "tmd.cli", *args, "--api", api],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    done = await asyncio.to_thread(cli, "drain", "dr-0", "--by", "alice")
    assert done.returncode == 0, done.stderr
    done = await asyncio.to_thread(
        cli, "migrate", "--job", "dr", "--node", "dr-1", "--to", "s9", "--by", "bob"
    )
    assert done.returncode == 0, done.stderr
    rows = await eventually(
        lambda: (
            len(daemon.journal.events(kind="Migrate")) == 2
            and daemon.journal.events(kind="Migrate")
        )
    )
    assert [(r.node, r.body["reason"], r.body["to"]) for r in rows] == [
        ("dr-0", "operator drain by alice", None),
        ("dr-1", "operator migrate by bob", "s9"),
    ]
    bad = await asyncio.to_thread(
        lambda: subprocess.run(
            [sys.executable, "-m", "tmd.cli", "drain", "dr-0", "--api", api],
            capture_output=True,
            text=True,
            env={**os.environ, "TMD_API_TOKEN": "wrong"},
            timeout=60,
        )
    )
    assert bad.returncode == 1 and "refused (401)" in bad.stderr
