"""``tmd bench faults``: every known fault injected into a real job under the real
daemon; each must be survived.

Each fault runs its own stack: a real mosquitto, ``tmd run`` in its own process, a job
of two machines of two ranks and a standby machine (``tmd.tools.bench.downtime``'s
training script, a small model, paced steps) and, where a fault needs them, stand-in
node agents. The fault is injected at a journaled phase of a migration an operator
asked for (``POST /api/v1/migrate``), or into the running job, and the job is then
stopped at a step every rank agrees on. A fault is *survived* when every process
that held a rank at the end exited 0, each final rank's parameters and every
(rank, step) loss equal those of an undisturbed reference run (one, shared by every
fault, recording each rank's parameter digest after every step) at that step, and
each migration the daemon journaled ended exactly once (``exactly_once``).

Faults:

- ``forged``: on the shipped secure broker configuration (``deploy/mosquitto``: TLS,
  passwords, the topic ACL), an anonymous client and clients of the wrong role (an
  agent, another job) publish forged ``prepare``/``switch``/``abort`` commands, an
  ack, a job status, an XID and an ``offline`` status; ``forged_accepted`` counts
  what changed anything (a journaled migration or finding, an answer from the job);
  then the legitimate path must still migrate.
- ``broker_restart_{preparing,switching}``: the broker restarts in that phase.
- ``daemon_kill_{preparing,switching}``: the daemon is SIGKILLed in that journaled
  state (frozen the moment the journal shows it) and started again.
- ``joiner_kill_preparing``, ``leaver_kill_preparing``: the standby machine, or the
  machine being replaced, is SIGKILLed (both processes) while the migration prepares.
- ``paused_broker``: the broker is SIGSTOPped for three heartbeat timeouts under a
  running job whose machines' agents keep beating; ``partition_decisions`` counts the
  migrations and lost-machine findings it caused.

- ``ctl_{duplicated,reordered,dropped}``: the daemon and the job on brokers of their
  own, joined by a test-only relay (``Relay``) that delivers the daemon's commands
  three times, in swapped pairs, or loses the first copy of each.

Fuzzing of every wire type and HTTP body is in the test suite. Prints one JSON
object: ``faults``, ``survived``, ``exactly_once``, ``params_equal``,
``forged_accepted``, ``partition_decisions`` and ``results`` (one entry per fault).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tmd import wire
from tmd.tools.bench import Progress, measure
from tmd.tools.mosquitto import Mosquitto, free_port

JOB = "faults"
TOKEN = "bench-faults"
PER_NODE = 2  # ranks per machine; the job has two machines and one standby machine
STOP_KEY = "faults/stop"
SLEEP_S = 0.05
HEARTBEAT_S = 3.0
TERMINAL = ("done", "aborted", "failed")
WORKER = [sys.executable, "-m", "tmd.tools.bench.downtime", "worker", "--layers", "1",
          "--d", "64", "--ctx", "16", "--batch", "2", "--hash-params"]  # fmt: skip
DEPLOY = Path(__file__).resolve().parents[3] / "deploy" / "mosquitto"
FAULTS = (
    "forged",
    "broker_restart_preparing",
    "broker_restart_switching",
    "daemon_kill_preparing",
    "daemon_kill_switching",
    "joiner_kill_preparing",
    "leaver_kill_preparing",
    "paused_broker",
    "ctl_duplicated",
    "ctl_reordered",
    "ctl_dropped",
    "ctl_mangled",
)


def wait_for(check: Callable[[], Any], what: str, timeout_s: float, poll: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(poll)


# -- the broker --------------------------------------------------------------------------


class Secure:
    """The shipped secure broker configuration, with a throw-away CA and passwords."""

    USERS = {"tmd-daemon": "d43m0n", JOB: "j0b", "worker0": "n0de", "rival": "r1v"}

    def __init__(self, root: Path) -> None:
        self.dir = root / "pki"
        self.dir.mkdir()
        for tool in ("openssl", "mosquitto_passwd"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} not found (apt-get install -y openssl mosquitto)")

        def ssl(*args: str) -> None:
            subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=self.dir)

        ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.crt", "-days", "2", "-subj", "/CN=tmd-bench-ca")  # fmt: skip
        ssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
            "server.csr", "-subj", "/CN=localhost")  # fmt: skip
        (self.dir / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
        ssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "server.crt", "-days", "2",
            "-extfile", "san.ext")  # fmt: skip
        passwd = self.dir / "passwd"
        passwd.touch(mode=0o600)
        for user, password in self.USERS.items():
            subprocess.run(["mosquitto_passwd", "-b", str(passwd), user, password],
                           check=True, capture_output=True)  # fmt: skip
            (self.dir / f"pw-{user}").write_text(password)
        shutil.copy(DEPLOY / "tmd.acl", self.dir / "acl")

    def config(self, port: int) -> str:
        shipped = (DEPLOY / "tmd.conf").read_text()
        return shipped.replace("/etc/mosquitto/tmd/", f"{self.dir}/").replace(
            "listener 8883\n", f"listener {port} 127.0.0.1\n"
        )

    def mqtt(self, user: str) -> dict[str, Any]:
        """The ``[mqtt]`` options of ``user``."""
        return {"tls": True, "ca_file": str(self.dir / "ca.crt"), "username": user,
                "password_file": str(self.dir / f"pw-{user}")}  # fmt: skip

    def client(self, port: int, user: str) -> Any:
        """A connected paho client of ``user`` (anonymous for ""), or None if the
        broker refused it."""
        import threading

        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion

        answered, refused = threading.Event(), []
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"forger-{user or 'anon'}")
        c.tls_set(ca_certs=str(self.dir / "ca.crt"))
        if user:
            c.username_pw_set(user, self.USERS[user])

        def connected(_c: Any, _u: Any, _f: Any, reason: Any, _p: Any) -> None:
            if reason.is_failure:
                refused.append(str(reason))
            answered.set()

        c.on_connect = connected
        c.connect("127.0.0.1", port)
        c.loop_start()
        if not answered.wait(10) or refused:
            c.loop_stop()
            c.disconnect()
            return None
        return c


# -- the daemon --------------------------------------------------------------------------


def _toml(name: str, table: dict[str, Any]) -> str:
    lines = [f"[{name}]"]
    nested = []
    for key, value in table.items():
        if isinstance(value, dict):
            nested.append(_toml(f"{name}.{key}", value))
        else:
            lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n" + "".join(nested)


class Daemon:
    """``tmd run`` in its own process, its HTTP API and its journal."""

    def __init__(self, root: Path, mqtt: dict[str, Any], **sections: dict[str, Any]) -> None:
        self.port = free_port()
        self.journal = root / "journal.sqlite3"
        tables: dict[str, dict[str, Any]] = {
            "mqtt": {"reconnect_min_s": 0.1, "reconnect_max_s": 1.0, **mqtt},
            "api": {"port": self.port, "token": TOKEN},
            "journal": {"path": str(self.journal)},
            "log": {"format": "json"},
            "ingest": {"probe_interval_s": 0.25, "stale_lag_s": 0.75, "stale_settle_s": 2.0},
            "actuator": {"settle_s": 0.5, "resend_s": 1.0},
            "guardrails": {"min_standby_pool": 0, "node_cooldown_s": 1.0},
            "detectors": {"straggler": {"enabled": False},
                          "node_lost": {"heartbeat_timeout_s": HEARTBEAT_S}},
            "policies": {"rebalance": {"enabled": False}},
        }  # fmt: skip
        for name, table in sections.items():
            tables[name] = {**tables.get(name, {}), **table}
        self.config = root / "tmd.toml"
        self.config.write_text("".join(_toml(n, t) for n, t in tables.items()))
        self.log = root / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tmd.cli", "run", "--config", str(self.config)],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        wait_for(self._current, "the daemon to be ready with a current view", 60, poll=0.1)

    def _current(self) -> bool:
        try:
            health = self.get("/healthz")
        except OSError:
            return False
        return bool(health["ok"]) and health.get("view") == "current"

    def freeze_and_kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return json.load(r)

    def get_text(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:
            return str(r.read().decode())

    def post(self, path: str, body: dict[str, Any]) -> None:
        """A request to a mutating endpoint, with the token; it must be accepted."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=json.dumps(body).encode(),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=5) as r:
            if r.status != 202:
                raise RuntimeError(f"POST {path}: {r.status}")

    def migrate(self, node: str) -> None:
        self.post("/api/v1/migrate", {"job": JOB, "node": node})

    def rows(self, sql: str) -> list[Any]:
        db = sqlite3.connect(f"file:{self.journal}?mode=ro", uri=True, timeout=5)
        try:
            return db.execute(sql).fetchall()
        except sqlite3.OperationalError:
            return []  # not created yet
        finally:
            db.close()

    def migration_states(self) -> list[tuple[str, str]]:
        return self.rows("SELECT id, state FROM migrations")

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [
            json.loads(b) for (b,) in self.rows(f"SELECT body FROM events WHERE kind = '{kind}'")
        ]


# -- a stand-in agent ---------------------------------------------------------------------


def _agent(port: int, node: str, role: str) -> None:
    """An agent's heartbeat: its status at every (re)connection, a sample a second."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    client = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-agent-{node}")
    offline = wire.NodeStatus(ts=time.time(), node=node, state="offline", role=role)  # type: ignore[arg-type]
    client.will_set(wire.node_topic(node, "status"), wire.encode(offline), qos=1, retain=True)

    def online(c: Any, *_: Any) -> None:
        status = wire.NodeStatus(ts=time.time(), node=node, state="online", role=role)  # type: ignore[arg-type]
        c.publish(wire.node_topic(node, "status"), wire.encode(status), qos=1, retain=True)

    client.on_connect = online
    client.connect("127.0.0.1", port, keepalive=30)
    client.loop_start()
    while True:
        beat = wire.NodeGpu(ts=time.time(), node=node)
        client.publish(wire.node_topic(node, "gpu"), wire.encode(beat), qos=0)
        time.sleep(1.0)


# -- one fault ------------------------------------------------------------------------------


class Relay:
    """A test-only MQTT relay between the daemon's broker and the job's: what the job
    and the agents publish goes up as it is (retain flag kept, MQTT 5's
    retain-as-published); the daemon's commands come down through ``fault``:

    - ``duplicated``: each command is delivered three times, the last 0.5 s later;
    - ``reordered``: commands are delivered in swapped pairs (the second of a pair
      before the first; a command left alone is delivered after 2 s);
    - ``dropped``: the first copy of each command (kind and migration id) is lost,
      so only the daemon's resends arrive;
    - ``mangled``: all three at once: the first copy lost, the others in swapped
      pairs, each delivered three times.
    """

    UP = ("tmd/v1/node/#", "tmd/v1/job/+/status", "tmd/v1/job/+/ack",
          "tmd/v1/job/+/rank/+/iter")  # fmt: skip

    def __init__(self, daemon_port: int, job_port: int, fault: str) -> None:
        import threading

        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion
        from paho.mqtt.subscribeoptions import SubscribeOptions

        self.fault = fault
        self.counts = {"down": 0, "delivered": 0, "up": 0}
        self._lock = threading.Lock()
        self._held: tuple[str, bytes] | None = None
        self._seen: set[bytes] = set()
        self._timers: list[threading.Timer] = []

        def client(port: int, name: str) -> Any:
            c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"relay-{name}",
                            protocol=paho.MQTTv5)  # fmt: skip
            c.connect("127.0.0.1", port)
            c.loop_start()
            return c

        self.to_daemon, self.to_job = client(daemon_port, "up"), client(job_port, "down")
        self.from_job, self.from_daemon = client(job_port, "up-in"), client(daemon_port, "down-in")
        options = SubscribeOptions(qos=1, retainAsPublished=True)
        self.from_job.on_message = self._up
        self.from_job.subscribe([(t, options) for t in self.UP])
        self.from_daemon.on_message = self._down
        self.from_daemon.subscribe([("tmd/v1/job/+/ctl", options)])
        time.sleep(0.5)  # both subscriptions in place before the job starts

    def _up(self, _c: Any, _u: Any, m: Any) -> None:
        self.counts["up"] += 1
        self.to_daemon.publish(m.topic, m.payload, qos=m.qos, retain=m.retain)

    def _deliver(self, topic: str, payload: bytes) -> None:
        if self.fault == "mangled":  # three times, the last 0.5 s later
            self._once(topic, payload)
            self._once(topic, payload)
            self._later(0.5, topic, payload)
        else:
            self._once(topic, payload)

    def _once(self, topic: str, payload: bytes) -> None:
        self.counts["delivered"] += 1
        self.to_job.publish(topic, payload, qos=1)

    def _later(self, delay_s: float, topic: str, payload: bytes) -> None:
        import threading

        timer = threading.Timer(delay_s, self._once, (topic, payload))
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def _down(self, _c: Any, _u: Any, m: Any) -> None:
        topic, payload = m.topic, bytes(m.payload)
        with self._lock:
            self.counts["down"] += 1
            if self.fault == "duplicated":
                self._deliver(topic, payload)
                self._deliver(topic, payload)
                self._later(0.5, topic, payload)
            elif self.fault == "dropped":
                if self._seen_before(payload):
                    self._deliver(topic, payload)
            elif self.fault == "mangled" and not self._seen_before(payload):
                pass  # the first copy is lost; the resends go on, reordered
            elif self.fault in ("reordered", "mangled"):
                if self._held is None:
                    self._held = (topic, payload)
                    held = self._held
                    self._later_flush(held)
                else:
                    first, self._held = self._held, None
                    self._deliver(topic, payload)
                    self._deliver(*first)
            else:
                self._deliver(topic, payload)

    def _seen_before(self, payload: bytes) -> bool:
        """Whether a copy of this command (kind and migration id) came before; from
        now on it has."""
        message = json.loads(payload)
        key = f"{message.get('cmd')} {message.get('migration_id')}".encode()
        seen = key in self._seen
        self._seen.add(key)
        return seen

    def _later_flush(self, held: tuple[str, bytes]) -> None:
        import threading

        def flush() -> None:
            with self._lock:
                if self._held is held:
                    self._held = None
                    self._deliver(*held)

        timer = threading.Timer(2.0, flush)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def close(self) -> None:
        for timer in self._timers:
            timer.cancel()
        for c in (self.to_daemon, self.to_job, self.from_job, self.from_daemon):
            c.loop_stop()
            c.disconnect()


class Stack:
    def __init__(
        self, root: Path, *, secure: Secure | None = None, agents: bool = False,
        relay: str = "", per_node: int = PER_NODE,
    ) -> None:  # fmt: skip
        from tmd.runtime.launch import LocalJob

        self.root, self.secure = root, secure
        self.nproc = 2 * per_node
        self.out = root / "job"
        self.out.mkdir()
        port = free_port()
        self.broker = Mosquitto(port=port, config=secure.config(port) if secure else "")
        self.broker.start()
        # With a relay, the job talks to a broker of its own, the daemon to ``broker``.
        self.job_broker: Mosquitto | None = None
        self.relay: Relay | None = None
        job_port = port
        if relay:
            self.job_broker = Mosquitto().start()
            job_port = self.job_broker.port
            self.relay = Relay(port, job_port, relay)
        self.agents: list[Any] = []
        if agents:
            ctx = mp.get_context("spawn")
            for node, role in (("worker0", "worker"), ("worker1", "worker"),
                               ("standby0", "standby")):  # fmt: skip
                proc = ctx.Process(target=_agent, args=(port, node, role), daemon=True)
                proc.start()
                self.agents.append(proc)
        mqtt: dict[str, Any] = {"host": "127.0.0.1", "port": port}
        env: dict[str, str] = {}
        if secure is not None:
            mqtt.update(secure.mqtt("tmd-daemon"))
            job_conf = root / "job-mqtt.toml"
            job_conf.write_text(_toml("mqtt", secure.mqtt(JOB)))
            env["TMD_MQTT_CONFIG"] = str(job_conf)
        self.daemon = Daemon(root, mqtt)
        cmd = [*WORKER, "--steps", "1000000", "--out", str(self.out), "--sleep", str(SLEEP_S),
               "--stop-key", STOP_KEY]  # fmt: skip
        self.job = LocalJob(cmd, nproc=self.nproc, standby=1, nproc_per_node=per_node, job=JOB,
                            broker=f"127.0.0.1:{job_port}", extra_env=env)  # fmt: skip

    def standby_ready(self) -> None:
        def known() -> bool:
            jobs = self.daemon.get(f"/api/v1/status?job={JOB}&ranks=0").get("jobs", [])
            return any(s.get("state") == "ready" for j in jobs for s in j.get("standbys", []))

        wait_for(known, "the daemon to see the standby machine ready", 120, poll=0.2)

    def step(self) -> int:
        store = self.job.store
        return int(store.get("bench/step")) if store.check(["bench/step"]) else 0

    def wait_state(self, state: str, timeout_s: float = 60) -> bool:
        """Poll the journal until a migration is in ``state``; False if it went past it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = {s for _, s in self.daemon.migration_states()}
            if state in states:
                return True
            if states & set(TERMINAL):
                return False
            time.sleep(0.002)
        return False

    def wait_finished(self, timeout_s: float = 120) -> list[tuple[str, str]]:
        rows: list[tuple[str, str]] = wait_for(
            lambda: (rows := self.daemon.migration_states())
            and all(s in TERMINAL for _, s in rows)
            and rows,
            "every migration to end", timeout_s, poll=0.1,
        )  # fmt: skip
        return rows

    def stop_job(self) -> dict[str, int]:
        """Stop every rank at one step, far enough ahead that all read it first."""
        from datetime import timedelta

        self.job.store.set(STOP_KEY, str(self.step() + 40))
        codes = self.job.wait(timedelta(seconds=180))
        return {k: int(v) for k, v in codes.items()}

    def close(self) -> None:
        self.job.terminate()
        self.daemon.stop()
        for proc in self.agents:
            proc.kill()
        if self.relay is not None:
            self.relay.close()
        if self.job_broker is not None:
            self.job_broker.stop()
        self.broker.stop()


def _exactly_once(daemon: Daemon) -> bool:
    """Each journaled migration started once and ended once, and was reported once."""
    per: dict[str, list[str]] = {}
    for body in daemon.events("MigrationState"):
        per.setdefault(body["migration_id"], []).append(body["state"])
    finished: dict[str, int] = {}
    for body in daemon.events("MigrationFinished"):
        finished[body["migration_id"]] = finished.get(body["migration_id"], 0) + 1
    return all(
        sum(s in TERMINAL for s in states) == 1 and finished.get(mid) == 1
        for mid, states in per.items()
    )


class Reference:
    """An undisturbed run of the same job, shared by every fault: it records each rank's
    parameter digest after every step, so one run answers for any step a faulted run
    stopped at (it is run again, longer, when a faulted run went past its end)."""

    def __init__(self, root: Path, *, per_node: int = PER_NODE) -> None:
        self.root, self.per_node, self.nproc = root, per_node, 2 * per_node
        self.steps = 0
        self._digests: dict[tuple[int, int], str] = {}
        self._rows: dict[tuple[int, int], Any] = {}

    def ensure(self, steps: int) -> None:
        if steps <= self.steps:
            return
        from datetime import timedelta

        from tmd.runtime.launch import LocalJob

        steps = max(steps, 2 * self.steps, 400)
        out = self.root / f"reference-{steps}"
        out.mkdir(parents=True)
        job = LocalJob([*WORKER, "--steps", str(steps), "--out", str(out), "--hash-every-step"],
                       nproc=self.nproc, standby=0, nproc_per_node=self.per_node,
                       job="reference")  # fmt: skip
        try:
            codes = job.wait(timedelta(seconds=300))
        finally:
            job.terminate()
        if set(codes.values()) != {0}:
            raise RuntimeError(f"the reference run failed: {codes}")
        records = measure.records(out)
        self._digests = {
            (r["final_rank"], int(step)): digest
            for r in records if "final_rank" in r
            for step, digest in r["digests"].items()
        }  # fmt: skip
        self._rows = {(r[0], r[1]): r for r in measure.step_rows(records)}
        self.steps = steps

    def compare(self, out: Path) -> tuple[bool, dict[str, Any]]:
        """Parameters and losses of the run in ``out`` against this reference at the
        step the run stopped at."""
        finals = [r for r in measure.records(out) if "params_sha256" in r]
        steps = {r["final_step"] for r in finals}
        if len(steps) != 1 or len(finals) != self.nproc:
            return False, {"why": f"{len(finals)} final ranks at steps {sorted(steps)}"}
        step = steps.pop()
        self.ensure(step)
        got = {r["final_rank"]: r["params_sha256"] for r in finals}
        want = {rank: self._digests.get((rank, step)) for rank in got}
        # Losses of ranks whose process died with its machine are not all written.
        losses = measure.loss_match(measure.losses(out), self._rows, complete=False)
        return got == want and losses, {"params_equal": got == want, "loss_match": losses}


def run_fault(
    name: str, root: Path, p: Progress, *, reference: Reference, per_node: int = PER_NODE
) -> dict[str, Any]:
    root.mkdir(parents=True)
    secure = Secure(root) if name == "forged" else None
    relay = name.removeprefix("ctl_") if name.startswith("ctl_") else ""
    stack = Stack(root, secure=secure, agents=name == "paused_broker", relay=relay,
                  per_node=per_node)  # fmt: skip
    result: dict[str, Any] = {"fault": name, "injected": False}
    try:
        stack.standby_ready()
        p.say(f"{name}: the job runs, its standby machine is ready")
        inject = _INJECTORS[name]
        result.update(inject(stack))
        codes = stack.stop_job()
        result["exit_codes"] = codes
        stack.daemon.get("/healthz")  # the daemon is still serving
        result["migrations"] = stack.daemon.migration_states()
        result["exactly_once"] = _exactly_once(stack.daemon)
    except Exception as exc:  # a fault not survived is a result, not a crash of the bench
        result["error"] = f"{type(exc).__name__}: {exc}"
        return {**result, "survived": False, "exactly_once": False, "params_equal": False}
    finally:
        stack.close()
    equal, detail = reference.compare(stack.out)
    result.update(detail, params_equal=equal)
    members = {n: c for n, c in result["exit_codes"].items() if c != -signal.SIGKILL}
    result["survived"] = bool(
        result["injected"] and equal and result["exactly_once"]
        and all(c == 0 for c in members.values()) and result.get("expected", True)
    )  # fmt: skip
    return result


# -- the injections ----------------------------------------------------------------------------


def _migrate_with(stack: Stack, state: str, act: Callable[[], None]) -> dict[str, Any]:
    stack.daemon.migrate("worker1")
    injected = stack.wait_state(state)
    if injected:
        act()
    rows = stack.wait_finished()
    return {"injected": injected, "outcomes": [s for _, s in rows]}


def _broker_restart(state: str) -> Callable[[Stack], dict[str, Any]]:
    def inject(stack: Stack) -> dict[str, Any]:
        out = _migrate_with(stack, state, stack.broker.restart)
        out["expected"] = out["outcomes"] == ["done"]
        return out

    return inject


def _daemon_kill(state: str) -> Callable[[Stack], dict[str, Any]]:
    def inject(stack: Stack) -> dict[str, Any]:
        killed_in: list[str] = []

        def kill_and_start() -> None:
            stack.daemon.freeze_and_kill()
            killed_in.extend(s for _, s in stack.daemon.migration_states())
            stack.daemon.start()

        out = _migrate_with(stack, state, kill_and_start)
        # Resumed once, from the state it was killed in (a migration killed before its
        # prepare was journaled is resumed by preparing it), or, killed while switching,
        # found switched by the job's status at the next start and not resumed at all.
        resumed = [b["state"] for b in stack.daemon.events("MigrationState") if b.get("resumed")]
        [was] = killed_in or [""]
        out.update(killed_in=was, resumed=resumed)
        out["injected"] = out["injected"] and was not in ("", *TERMINAL)
        switching = was in ("prepared", "switching")
        want = [["switching"], []] if switching else [["preparing"]]
        out["expected"] = out["outcomes"] == ["done"] and resumed in want
        return out

    return inject


def _process_kill(node: str, ends: tuple[str, ...]) -> Callable[[Stack], dict[str, Any]]:
    def inject(stack: Stack) -> dict[str, Any]:
        out = _migrate_with(stack, "preparing", lambda: stack.job.kill(node, signal.SIGKILL))
        out["expected"] = len(out["outcomes"]) == 1 and out["outcomes"][0] in ends
        return out

    return inject


def _paused_broker(stack: Stack) -> dict[str, Any]:
    assert stack.broker.pid is not None
    time.sleep(3.0)  # the agents have beaten for a while
    os.kill(stack.broker.pid, signal.SIGSTOP)
    try:
        time.sleep(3 * HEARTBEAT_S)
    finally:
        os.kill(stack.broker.pid, signal.SIGCONT)
    wait_for(stack.daemon._current, "the daemon's view to be current again", 60, poll=0.1)
    time.sleep(HEARTBEAT_S + 2.0)  # long enough for a wrong finding to show
    decisions = len(stack.daemon.migration_states()) + len(stack.daemon.events("NodeLost"))
    return {"injected": True, "partition_decisions": decisions, "expected": decisions == 0}


def _forged(stack: Stack) -> dict[str, Any]:
    secure, port = stack.secure, stack.broker.port
    assert secure is not None
    now = time.time()
    forged_id = "forged-1"
    commands = [
        wire.Prepare(ts=now, job=JOB, migration_id=forged_id, leaver="worker1",
                     joiner="standby0"),
        wire.Switch(ts=now, job=JOB, migration_id=forged_id),
        wire.Abort(ts=now, job=JOB, migration_id=forged_id),
    ]  # fmt: skip
    members = [wire.Member(r, "worker0") for r in range(stack.nproc)]
    status = wire.JobStatus(ts=now, job=JOB, generation=7, world_size=stack.nproc, members=members)
    ack = wire.Ack(ts=now, job=JOB, migration_id=forged_id, kind="switched", node="worker1")
    xid = wire.XidEvent(ts=now, node="worker1", gpu=0, xid=79)
    offline = wire.NodeStatus(ts=now, node="worker1", state="offline")
    sent, refused = 0, 0
    for user in ("", "rival", "worker0"):  # anonymous, another job, an agent
        client = secure.client(port, user)
        if client is None:
            refused += 1
            continue
        for c in commands:
            client.publish(wire.job_topic(JOB, "ctl"), wire.encode(c), qos=1).wait_for_publish(5)
            client.publish(wire.job_topic(JOB, "ctl"), wire.encode(c), qos=1,
                           retain=True).wait_for_publish(5)  # fmt: skip
        for topic, message in ((wire.job_topic(JOB, "status"), status),
                               (wire.job_topic(JOB, "ack"), ack),
                               (wire.node_topic("worker1", "xid"), xid),
                               (wire.node_topic("worker1", "status"), offline)):  # fmt: skip
            client.publish(topic, wire.encode(message), qos=1).wait_for_publish(5)
        sent += 2 * len(commands) + 4
        client.loop_stop()
        client.disconnect()
    time.sleep(3.0)  # what got through has been acted on by now
    from tmd.runtime.control import ACK_LOG, read_from

    answered = [a for a in read_from(stack.job.store, ACK_LOG, 1) if forged_id.encode() in a]
    d = stack.daemon
    accepted = (
        len(d.migration_states())
        + len(d.events("GpuFault")) + len(d.events("NodeLost"))
        + len(answered)
        + (1 if any(st.get("generation") == 7 for st in _statuses(d)) else 0)
    )  # fmt: skip
    # The legitimate path still works.
    out = _migrate_with(stack, "done", lambda: None)
    return {"injected": sent > 0, "forged_sent": sent, "clients_refused": refused,
            "forged_accepted": accepted, "outcomes": out["outcomes"],
            "expected": accepted == 0 and out["outcomes"] == ["done"]}  # fmt: skip


def _statuses(d: Daemon) -> list[dict[str, Any]]:
    jobs: list[dict[str, Any]] = d.get(f"/api/v1/status?job={JOB}&ranks=0").get("jobs", [])
    return jobs


def _through_relay(stack: Stack) -> dict[str, Any]:
    out = _migrate_with(stack, "done", lambda: None)
    assert stack.relay is not None
    out["relayed"] = dict(stack.relay.counts)
    out["expected"] = out["outcomes"] == ["done"]
    return out


_INJECTORS: dict[str, Callable[[Stack], dict[str, Any]]] = {
    "forged": _forged,
    "broker_restart_preparing": _broker_restart("preparing"),
    "broker_restart_switching": _broker_restart("switching"),
    "daemon_kill_preparing": _daemon_kill("preparing"),
    "daemon_kill_switching": _daemon_kill("switching"),
    # The joiner dead: the migration is aborted and the job goes on without it.
    "joiner_kill_preparing": _process_kill("standby0", ("aborted", "failed")),
    # The leaver dead: the job replaces it from replicas with the standby machine (the
    # joiner leaves the migration for the failover), so the machine is replaced as
    # asked, or the migration ends aborted if the failover came first; either once.
    "leaver_kill_preparing": _process_kill("worker1", ("done", "aborted", "failed")),
    "paused_broker": _paused_broker,
    "ctl_duplicated": _through_relay,
    "ctl_reordered": _through_relay,
    "ctl_dropped": _through_relay,
    "ctl_mangled": _through_relay,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tmd bench faults", description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="", help=f"comma-separated subset of {', '.join(FAULTS)}")
    parser.add_argument("--json", action="store_true", help="print the JSON object only")
    parser.add_argument("--keep", action="store_true", help="keep the run's files")
    parser.add_argument(
        "--per-node", type=int, default=PER_NODE, help="ranks per machine (two, and a standby)"
    )
    args = parser.parse_args(argv)
    if args.per_node < 1:
        parser.error("--per-node must be >= 1")
    chosen = [f for f in args.only.split(",") if f] or list(FAULTS)
    unknown = sorted(set(chosen) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults: {', '.join(unknown)}")
    p = Progress()
    root = Path(tempfile.mkdtemp(prefix="tmd-bench-faults-"))
    results = []
    reference = Reference(root / "reference", per_node=args.per_node)
    try:
        for name in chosen:
            p.say(f"{name}: starting")
            r = run_fault(name, root / name, p, reference=reference, per_node=args.per_node)
            p.say(f"{name}: {'survived' if r['survived'] else 'NOT survived'}")
            results.append(r)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    forged = [r for r in results if r["fault"] == "forged"]
    paused = [r for r in results if r["fault"] == "paused_broker"]
    summary = {
        "faults": len(results),
        "survived": sum(r["survived"] for r in results),
        "exactly_once": all(r["exactly_once"] for r in results),
        "params_equal": all(r["params_equal"] for r in results),
        "forged_accepted": sum(r.get("forged_accepted", 0) for r in forged) if forged else None,
        "partition_decisions": (
            sum(r.get("partition_decisions", 0) for r in paused) if paused else None
        ),
        "per_node": args.per_node,
        "load": os.getloadavg()[0],
        "results": results,
        "kept": str(root) if args.keep else None,
    }
    print(json.dumps(summary, indent=None if args.json else 2, default=str))
    return 0 if summary["survived"] == summary["faults"] else 1
