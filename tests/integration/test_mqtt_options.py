"""Broker options against a real mosquitto: TLS with a private CA and password auth,
a wrong password (the daemon stays up, unready and unhealthy, and keeps retrying),
MQTT 5 and 3.1.1 side by side, and a shared-subscription group splitting the load."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.conftest import DaemonFactory, _need_mosquitto, need_tool
from tests.helpers import Publisher, eventually
from tests.integration.test_daemon import iter_batch
from tmd import config as config_mod
from tmd import wire
from tmd.daemon.daemon import Daemon
from tmd.tools.mosquitto import Mosquitto


def _pki(d: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "2",
        "-subj",
        "/CN=tmd-test-ca",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    )
    (d / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    run(
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.crt",
        "-days",
        "2",
        "-extfile",
        "san.ext",
    )


@pytest.fixture
def tls_broker(tmp_path: Path) -> Iterator[Mosquitto]:
    _need_mosquitto()
    for tool, package in (("mosquitto_passwd", "mosquitto"), ("openssl", "openssl")):
        need_tool(tool, shutil.which(tool), install=f"apt-get install -y {package}")
    _pki(tmp_path)
    pw = tmp_path / "passwd"
    subprocess.run(
        ["mosquitto_passwd", "-b", "-c", str(pw), "tmd", "s3cret"], check=True, capture_output=True
    )
    pw.chmod(0o600)
    listener = (
        f"cafile {tmp_path / 'ca.crt'}\ncertfile {tmp_path / 'server.crt'}\n"
        f"keyfile {tmp_path / 'server.key'}\npassword_file {pw}\n"
    )
    with Mosquitto(listener_config=listener, allow_anonymous=False) as b:
        yield b


def _tls_publisher(b: Mosquitto, ca: Path) -> paho.Client:
    c = paho.Client(CallbackAPIVersion.VERSION2)
    c.tls_set(ca_certs=str(ca))
    c.username_pw_set("tmd", "s3cret")
    c.connect(b.host, b.port)
    c.loop_start()
    return c


async def test_tls_and_password(
    tls_broker: Mosquitto, tmp_path: Path, start_daemon: DaemonFactory
) -> None:
    secret = tmp_path / "mqtt-password"
    secret.write_text("s3cret\n")
    daemon = await start_daemon(
        tls_broker,
        mqtt={
            "tls": True,
            "ca_file": str(tmp_path / "ca.crt"),
            "username": "tmd",
            "password_file": str(secret),
        },
    )
    pub = _tls_publisher(tls_broker, tmp_path / "ca.crt")
    try:
        batch = iter_batch("tls", 0, range(1, 3))
        pub.publish(wire.iter_topic("tls", 0), wire.encode(batch), qos=1).wait_for_publish(5)
        await eventually(lambda: "tls" in daemon.view.jobs)
    finally:
        pub.disconnect()
        pub.loop_stop()


async def test_wrong_password_keeps_retrying_unready_and_unhealthy(
    tls_broker: Mosquitto, tmp_path: Path
) -> None:
    cfg = config_mod.from_dict(
        {
            "mqtt": {
                "host": tls_broker.host,
                "port": tls_broker.port,
                "tls": True,
                "ca_file": str(tmp_path / "ca.crt"),
                "username": "tmd",
                "password": "nope",
                "reconnect_min_s": 0.1,
                "reconnect_max_s": 0.2,
            },
            "api": {"port": 0},
            "journal": {"path": str(tmp_path / "j.sqlite3")},
        }
    )
    daemon = Daemon(cfg)
    task = asyncio.create_task(daemon.run())
    try:
        failures = daemon.metrics.registry.get_sample_value
        await eventually(
            lambda: (failures("tmd_mqtt_connection_failures_total") or 0) >= 3, timeout_s=20
        )
        assert not daemon.ready.is_set()
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{daemon.api.port}/healthz") as resp,
        ):
            assert resp.status == 503
            assert (await resp.json())["mqtt"] == "disconnected"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_shared_subscription_splits_jobs_between_v5_and_v311_daemons(
    broker: Mosquitto, publisher: Publisher, start_daemon: DaemonFactory
) -> None:
    # Watching heads: a shared group splits messages, so none of them may actuate.
    off = {"enabled": False}
    a = await start_daemon(broker, mqtt={"protocol": "5", "shared_group": "heads"}, actuator=off)
    b = await start_daemon(
        broker, mqtt={"protocol": "3.1.1", "shared_group": "heads"}, actuator=off
    )
    for rank in range(40):
        publisher.send(
            wire.iter_topic("shared", rank), wire.encode(iter_batch("shared", rank, range(1, 2)))
        )

    def ranks(d: Daemon) -> set[int]:
        job = d.view.jobs.get("shared")
        return set(job.ranks) if job else set()

    await eventually(lambda: len(ranks(a) | ranks(b)) == 40)
    assert ranks(a) and ranks(b), "both members of the group get a share"
    assert not ranks(a) & ranks(b), "each message goes to one member only"
