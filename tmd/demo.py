"""``tmd demo``: the daemon at work on a private broker, on a bare machine.

What it shows today: a private mosquitto, the real daemon (ingest, cluster view,
detectors, journal, HTTP API), a simulated 8-rank training job whose rank 5 computes
35% slower (the straggler detector must find its node), a node agent killed mid-run
whose Last Will the daemon turns into a ``NodeLost`` finding, and a malformed message
that is counted and dropped. Live migration joins the demo with the policies and
actuator (issue 5).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import sys
import tempfile
import time
from typing import Any

import aiohttp

from tmd import config as config_mod
from tmd import log, synth, wire
from tmd.app import Daemon
from tmd.broker import Mosquitto
from tmd.tables import render_events, render_status

SLOW_RANK = 5
SLOWDOWN = 1.35


def run(*, seconds: float = 45.0, ranks: int = 8) -> int:
    log.setup(level="warning", format="console")
    with Mosquitto() as broker, tempfile.TemporaryDirectory(prefix="tmd-demo-") as state:
        cfg = config_mod.from_dict(
            {
                "mqtt": {"host": broker.host, "port": broker.port},
                "api": {"port": 0},
                "journal": {"path": f"{state}/journal.sqlite3"},
                "detectors": {"node_lost": {"heartbeat_timeout_s": 5.0}},
            }
        )
        return asyncio.run(_demo(cfg, broker, seconds=seconds, ranks=ranks))


def _say(text: str) -> None:
    print(text, flush=True)


async def _demo(cfg: config_mod.Config, broker: Mosquitto, *, seconds: float, ranks: int) -> int:
    daemon = Daemon(cfg)
    task = asyncio.create_task(daemon.run())
    await asyncio.wait_for(daemon.ready.wait(), 30)
    base = f"http://127.0.0.1:{daemon.api.port}"
    _say(
        f"tmd demo: broker 127.0.0.1:{broker.port}, daemon API {base} "
        f"(try: tmd status --api {base})"
    )
    spec = synth.SynthSpec(
        host=broker.host,
        port=broker.port,
        job="demo",
        ranks=ranks,
        ranks_per_node=1,
        step_s=0.5,
        flush_s=1.0,
        seconds=seconds,
        slow={SLOW_RANK: SLOWDOWN},
    )
    job_proc, _ = synth.start(spec)
    agent = mp.get_context("spawn").Process(
        target=synth.heartbeat_agent, args=(broker.host, broker.port, "standby-0"), daemon=True
    )
    agent.start()
    _say(
        f"  a {ranks}-rank job publishes step timings; rank {SLOW_RANK} computes "
        f"{SLOWDOWN:.2f}x slower; node agent 'standby-0' sends heartbeats"
    )
    start = time.monotonic()
    killed = sent_bad = False
    async with aiohttp.ClientSession() as http:
        while time.monotonic() - start < seconds:
            await asyncio.sleep(1.0)
            elapsed = time.monotonic() - start
            if not sent_bad and elapsed > seconds * 0.3:
                _publish_garbage(broker)
                sent_bad = True
                _say(
                    f"  [{elapsed:4.0f}s] published a malformed message (it must be counted "
                    "and dropped)"
                )
            if not killed and elapsed > seconds * 0.5:
                agent.kill()
                killed = True
                _say(
                    f"  [{elapsed:4.0f}s] killed agent 'standby-0' with SIGKILL; the broker "
                    "delivers its Last Will"
                )
            if int(elapsed) % 10 == 0:
                status = await _get(http, f"{base}/api/v1/status?ranks=0")
                job = next((j for j in status["jobs"] if j["job"] == "demo"), None)
                if job:
                    _say(
                        f"  [{elapsed:4.0f}s] job demo: step {job['step']}, "
                        f"{job['reporting_ranks']} ranks reporting"
                    )
        status = await _get(http, f"{base}/api/v1/status?job=demo")
        events = await _get(http, f"{base}/api/v1/events?limit=20")
        metrics = await (await http.get(f"{base}/metrics")).text()
    job_proc.join(10)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    _say("\n" + render_status(status))
    _say("\nEVENTS\n" + render_events(events["events"]))
    rejected = [
        ln
        for ln in metrics.splitlines()
        if ln.startswith("tmd_messages_rejected_total{") and not ln.endswith(" 0.0")
    ]
    _say("\nREJECTED\n" + ("\n".join(rejected) or "none"))
    return _verdict(status, events["events"], rejected)


def _verdict(status: dict[str, Any], events: list[dict[str, Any]], rejected: list[str]) -> int:
    slow_node = f"node-{SLOW_RANK:05d}"
    straggler = next(
        (e for e in events if e["kind"] == "StragglerFound" and e["node"] == slow_node), None
    )
    wrong = [e["node"] for e in events if e["kind"] == "StragglerFound" and e["node"] != slow_node]
    lost = any(e["kind"] == "NodeLost" and e["node"] == "standby-0" for e in events)
    ok = bool(straggler and not wrong and lost and rejected)
    found = (
        f"{slow_node} ({straggler['body']['slowdown']:+.0%} since step "
        f"{straggler['body']['since_step']})"
        if straggler
        else "none"
    )
    _say(
        f"\nsummary: straggler found: {found}; wrong stragglers: {wrong or 'none'}; "
        f"NodeLost(standby-0) journaled: {lost}; malformed message counted: {bool(rejected)}"
        f" -> {'OK' if ok else 'FAILED'}"
    )
    return 0 if ok else 1


async def _get(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        return await resp.json()


def _publish_garbage(broker: Mosquitto) -> None:
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    client = paho.Client(CallbackAPIVersion.VERSION2)
    client.connect(broker.host, broker.port)
    client.loop_start()
    client.publish(
        wire.iter_topic("demo", 0), b'{"v": 1, "ts": "yesterday"}', qos=1
    ).wait_for_publish(5)
    client.loop_stop()
    client.disconnect()


if __name__ == "__main__":
    sys.exit(run())
