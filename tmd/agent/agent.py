"""The node agent (``tmd agent``): NVML health of this node's GPUs, published over MQTT.

Owns the sampling loop, the XID watcher thread, the MQTT session and its reconnect
loop, and the agent's systemd contract. What it publishes (DESIGN.md, ``tmd.wire``):

* ``tmd/v1/node/{node}/status``: retained, QoS 1, ``online`` with role and GPUs after
  every connect; the Last Will is the same status saying ``offline``, and a clean stop
  (SIGTERM) publishes that itself, since a clean disconnect does not fire the Will.
* ``tmd/v1/node/{node}/gpu``: QoS 0, one sample of every GPU each ``agent.interval_s``;
  the daemon also reads it as the heartbeat. A sample that cannot be sent is dropped.
  In full when a GPU's counters or flags change and every ``agent.full_sample_every_s``,
  brief in between (``wire.BriefSamples``).
* ``tmd/v1/node/{node}/xid``: QoS 1, each XID as the driver reports it; held while
  the broker is away (at most ``_MAX_PENDING_XIDS``) and sent after reconnecting.

NVML calls can hang on a sick GPU, so none runs on the event loop: a sample runs in a
daemon thread bounded by ``agent.sample_timeout_s`` (a hung one is abandoned, and no
second one starts until it returns), nvmlInit by ``agent.init_timeout_s``, and each
XID wait by ``agent.xid_wait_ms``. systemd: READY=1 once NVML is up and the online
status is published; WATCHDOG=1 after each sample, so hung NVML gets us restarted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Literal, TypeVar

import aiomqtt
import msgspec

import tmd
from tmd import config as config_mod
from tmd import log, sdnotify, wire
from tmd.agent.nvml import Nvml, NvmlError, NvmlUnavailable, Sample, Xid, XidEvents
from tmd.agent.relay import Relay
from tmd.config import Config
from tmd.connection import ClientFactory, reconnect_forever
from tmd.errors import ConfigError

T = TypeVar("T")
_MAX_PENDING_XIDS: Final = 1024
_STOP_PUBLISH_TIMEOUT_S: Final = 3.0  # the offline status on SIGTERM; TimeoutStopSec=15


class Agent:
    """Publishes ``nvml``'s samples and XIDs as node ``config.agent.node``.

    ``nvml`` is None in heartbeat-only mode. The caller opens and closes it."""

    def __init__(self, config: Config, *, nvml: Nvml | None) -> None:
        self._config = config.agent
        self._mqtt = config.mqtt
        self._nvml = nvml
        self.node = node_name(config.agent)
        self._log = log.get("agent").bind(node=self.node)
        self._client = ClientFactory(config.mqtt)
        self.ready = asyncio.Event()
        self.connected = False
        self.published_samples = 0
        self.sample_timeouts = 0
        self.skipped_samples = 0  # ticks passed while a hung NVML call was still out
        self.dropped_xids = 0
        self._latest: wire.NodeGpu | None = None
        self._xids: deque[wire.XidEvent] = deque()
        self._wakeup = asyncio.Event()
        self._pending: concurrent.futures.Future[Sample] | None = None
        self.relay = (
            Relay(self._config.relay_socket, self.node) if self._config.relay_socket else None
        )
        self.relayed_messages = 0
        # The sequence number last sent on each telemetry topic (``tmd.wire``): a gap
        # tells the daemon that the broker dropped some on the way to it.
        self._seq = {"gpu": 0, "iter": 0}
        self._briefs = wire.BriefSamples(self._config.full_sample_every_s)
        self._relay_due = False
        self._hung = False
        self._errors: dict[tuple[int, str], str] = {}

    @property
    def xids_waiting(self) -> int:
        """XID events seen and not yet published (the broker is away, say)."""
        return len(self._xids)

    def status(self, state: Literal["online", "offline"]) -> wire.NodeStatus:
        driver = f", driver {self._nvml.driver_version}" if self._nvml else ", heartbeat only"
        return wire.NodeStatus(
            ts=time.time(),
            node=self.node,
            state=state,
            role=self._config.role,
            gpus=self._nvml.gpus if self._nvml else [],
            hostname=socket.gethostname()[:256],
            agent=f"tmd {tmd.__version__}{driver}",
        )

    async def run(self) -> None:
        """Sample and publish until cancelled; on cancel, say offline if connected."""
        loop = asyncio.get_running_loop()

        def deliver(xid: Xid) -> None:  # called from the watcher thread
            with contextlib.suppress(RuntimeError):  # the loop is closed: we are exiting
                loop.call_soon_threadsafe(self._xid_arrived, xid)

        if self.relay is not None:
            try:
                self.relay.open()
            except OSError as exc:
                raise ConfigError(
                    "agent.relay_socket", f"cannot listen on {self.relay.path}: {exc}"
                ) from None
        watcher = None
        events = await self._xid_events()
        if events is not None:
            watcher = _XidWatcher(events, self._config.xid_wait_ms, deliver)
            watcher.start()
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._sample_loop(), name="sample")
                tg.create_task(self._connection_loop(), name="mqtt")
        finally:
            if watcher is not None:
                await watcher.stop()
            if self.relay is not None:
                self.relay.close()

    async def _xid_events(self) -> XidEvents | None:
        if self._nvml is None:
            return None
        timeout = self._config.init_timeout_s
        future = _in_thread(self._nvml.xid_events, "tmd-nvml-events")
        try:
            events = await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except (TimeoutError, NvmlError) as exc:
            # Samples still carry ECC, remap and throttle state: degrade, do not die.
            self._log.error("no XID events from NVML", error=str(exc) or "timed out")
            return None
        if events is None:
            self._log.warning("no GPU reports XID events")
        return events

    # -- sampling ------------------------------------------------------------------------

    async def _sample_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            gpus = await self._sample()
            if gpus is not None:
                self._latest = wire.NodeGpu(ts=time.time(), node=self.node, gpus=gpus)
                sdnotify.watchdog_ping()
            self._relay_due = True  # on the tick, whether or not NVML answered
            self._wakeup.set()
            # Keep the cadence; after an overrun start again from now rather than burst.
            next_at = max(next_at + self._config.interval_s, loop.time())
            await asyncio.sleep(next_at - loop.time())

    async def _sample(self) -> list[wire.GpuSample] | None:
        """Every GPU once, or None while NVML is hung or failing."""
        if self._nvml is None:
            return []
        if self._pending is not None and not self._pending.done():
            self.skipped_samples += 1
            return None  # the last call has not come back: do not stack threads on it
        if self._hung:
            self._hung = False
            self._log.warning("NVML answers again after a hung sample")
        self._pending = _in_thread(self._nvml.sample, "tmd-nvml-sample")
        timeout = self._config.sample_timeout_s
        try:
            sample = await asyncio.wait_for(asyncio.wrap_future(self._pending), timeout)
        except TimeoutError:
            self._hung = True
            self.sample_timeouts += 1
            self._log.error("NVML sample hung; abandoned", timeout_s=timeout)
            return None
        except NvmlError as exc:
            self._log.error("NVML sample failed", error=str(exc))
            return None
        self._note_errors(sample.errors)
        return sample.gpus

    def _note_errors(self, errors: dict[tuple[int, str], str]) -> None:
        # Logged when they change, not every second.
        if errors == self._errors:
            return
        new = {f"gpu{i}.{name}": why for (i, name), why in errors.items()}
        if errors:
            self._log.warning("NVML getters failing", errors=new)
        else:
            self._log.info("NVML getters recovered")
        self._errors = errors

    def _xid_arrived(self, xid: Xid) -> None:
        # An XID from a device NVML cannot name is still news for the node: filed
        # under GPU 0, and the detail says so.
        detail = "" if xid.gpu is not None else "device not identified by NVML"
        event = wire.XidEvent(
            ts=xid.ts, node=self.node, gpu=xid.gpu or 0, xid=xid.xid, detail=detail
        )
        self._log.warning("XID", gpu=event.gpu, xid=event.xid, detail=detail)
        if len(self._xids) >= _MAX_PENDING_XIDS:
            self.dropped_xids += 1
            self._log.error("XID queue full; oldest dropped", dropped_total=self.dropped_xids)
            self._xids.popleft()
        self._xids.append(event)
        self._wakeup.set()

    # -- MQTT ----------------------------------------------------------------------------

    async def _connection_loop(self) -> None:
        """Connect, publish, and on any connection loss back off and connect again;
        the back-off doubles (with jitter) up to ``mqtt.reconnect_max_s``."""
        await reconnect_forever(
            self._session, config=self._mqtt, log=self._log,
            connected=lambda: self.connected, closed=self._closed,
        )  # fmt: skip

    def _closed(self) -> None:
        self.connected = False

    async def _session(self) -> None:
        status_topic = wire.node_topic(self.node, "status")
        # The Will's ts is when we connected; the daemon dates the loss by its arrival.
        will = aiomqtt.Will(status_topic, wire.encode(self.status("offline")), qos=1, retain=True)
        timeout = self._mqtt.connect_timeout_s
        self._briefs.reset()  # what the last connection sent may not have arrived
        async with self._client(will=will) as client:
            try:
                online = wire.encode(self.status("online"))
                await client.publish(status_topic, online, qos=1, retain=True, timeout=timeout)
                self.connected = True
                self._log.info("online", host=self._mqtt.host, port=self._mqtt.port)
                if not self.ready.is_set():
                    self.ready.set()
                    gpus = len(self._nvml.gpus) if self._nvml else 0
                    sdnotify.ready(f"publishing {gpus} GPUs as {self.node}")
                await self._publish_forever(client)
            except asyncio.CancelledError:
                # Stopping: a clean disconnect does not fire the Will, so say it here.
                offline = wire.encode(self.status("offline"))
                try:
                    await client.publish(
                        status_topic, offline, qos=1, retain=True, timeout=_STOP_PUBLISH_TIMEOUT_S
                    )
                    self._log.info("offline")
                except aiomqtt.MqttError as exc:
                    self._log.warning("could not publish offline; the Will says it", error=str(exc))
                raise

    async def _publish_forever(self, client: aiomqtt.Client) -> None:
        # One sender, so a lost connection surfaces at the next publish (at most one
        # interval away) without a second task to watch it.
        timeout = self._mqtt.connect_timeout_s
        gpu_topic = wire.node_topic(self.node, "gpu")
        xid_topic = wire.node_topic(self.node, "xid")
        while True:
            while self._xids:
                # Removed only once the broker has it: at least once across reconnects.
                await client.publish(xid_topic, wire.encode(self._xids[0]), qos=1, timeout=timeout)
                self._xids.popleft()
            sample, self._latest = self._latest, None
            if sample is not None:
                sample = self._briefs.shape(sample, time.monotonic())
            if self._relay_due:
                self._relay_due = False
                if self.relay is not None and self.relay.pending:
                    carried = sample if self._config.relay_sample else None
                    if await self._relay(client, carried):
                        sample = None  # it went with the steps
                        self.published_samples += 1
            if sample is not None:
                seq = self._seq["gpu"] + 1  # counted once handed to the broker
                numbered = msgspec.structs.replace(sample, seq=seq)
                await client.publish(gpu_topic, wire.encode(numbered), qos=0, timeout=timeout)
                self._seq["gpu"] = seq
                self.published_samples += 1
            self._wakeup.clear()
            if not self._xids and self._latest is None and not self._relay_due:
                await self._wakeup.wait()

    async def _relay(self, client: aiomqtt.Client, sample: wire.NodeGpu | None) -> bool:
        """Every rank's batches relayed up to this tick, in as few messages as their
        size allows (what arrives meanwhile waits for the next tick), each at QoS 1:
        a sender hears of its batch once the broker has it. A batch whose publish
        failed is not confirmed: its rank publishes it itself. ``sample`` (where
        ``agent.relay_sample``) goes in the first message; whether it went."""
        assert self.relay is not None
        topic = wire.node_topic(self.node, "iter")
        gpu, carried = sample, False
        left = self.relay.pending
        while left > 0:
            taken = self.relay.take(limit=min(left, wire.MAX_RELAYED_BATCHES))
            if not taken:
                break
            left -= len(taken)
            batches = [b for _, _, b in taken]
            seq = self._seq["iter"] + 1
            message = wire.NodeIter(ts=time.time(), node=self.node, seq=seq,
                                    jobs=wire.RelayedBatches.of(batches), gpu=gpu)  # fmt: skip
            await client.publish(topic, wire.encode(message), qos=1,
                                 timeout=self._mqtt.connect_timeout_s)  # fmt: skip
            self._seq["iter"] = seq
            self.relay.confirm(taken)
            self.relayed_messages += 1
            carried, gpu = carried or gpu is not None, None
        return carried


class _XidWatcher:
    """A daemon thread blocked in ``nvmlEventSetWait_v2``, one wait at a time.

    ``stop`` returns within about one wait; a thread stuck inside NVML is left behind
    (it is a daemon thread and does not hold up exit)."""

    def __init__(self, events: XidEvents, wait_ms: int, deliver: Callable[[Xid], None]) -> None:
        self._events = events
        self._wait_ms = wait_ms
        self._deliver = deliver
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tmd-nvml-xid", daemon=True)
        self._log = log.get("agent")

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                xid = self._events.wait(self._wait_ms)
            except NvmlError as exc:
                failures += 1
                if failures == 1 or failures % 100 == 0:
                    self._log.error("waiting for XIDs failed", error=str(exc), times=failures)
                # Back off so a broken event set does not spin a core.
                self._stop.wait(min(self._wait_ms / 1000 * failures, 30.0))
                continue
            failures = 0
            if xid is not None:
                self._deliver(xid)
        self._events.close()

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.to_thread(self._thread.join, self._wait_ms / 1000 + 1.0)


# -- entry points ------------------------------------------------------------------------


def node_name(config: config_mod.AgentConfig) -> str:
    """The machine's name: ``agent.node``, else the name every rank on this machine
    takes by default too (``TMD_NODE``; ``tmd.wire.default_node_name``)."""
    name = config.node or wire.default_node_name()
    try:
        msgspec.convert(name, wire.Name)
    except msgspec.ValidationError:
        raise ConfigError("agent.node", f"hostname {name!r} is not a node name; set this") from None
    return name


def open_nvml(config: Config, lib: Any = None) -> Nvml | None:
    """NVML, or None in heartbeat-only mode. Raises NvmlUnavailable with the remedy."""
    if config.agent.heartbeat_only:
        return None
    timeout = config.agent.init_timeout_s
    try:
        return _in_thread(lambda: Nvml.open(lib), "tmd-nvml-init").result(timeout)
    except TimeoutError:
        raise NvmlUnavailable(f"nvmlInit did not return within {timeout} s") from None
    except NvmlUnavailable as exc:
        raise NvmlUnavailable(
            f"NVML unavailable: {exc}. On a node without GPUs set agent.heartbeat_only = true "
            "(or TMD_AGENT__HEARTBEAT_ONLY=true) to publish status and heartbeats only"
        ) from None


def run(
    config_path: str | None, *, once: bool = False, as_json: bool = False, lib: Any = None
) -> int:
    """``tmd agent``: serve until SIGTERM, or print one sample with ``once``."""
    config = config_mod.load(config_path)
    log.setup(level=config.log.level, format=config.log.format)
    node = node_name(config.agent)
    nvml = open_nvml(config, lib)
    try:
        if once:
            return _print_once(node, nvml, config.agent.sample_timeout_s, as_json)
        return asyncio.run(_serve(config, nvml))
    finally:
        if nvml is not None:
            # Bounded: on a GPU that hung NVML, shutdown can hang too.
            concurrent.futures.wait([_in_thread(nvml.close, "tmd-nvml-close")], timeout=5.0)


async def _serve(config: Config, nvml: Nvml | None) -> int:
    agent = Agent(config, nvml=nvml)
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def stop() -> None:
        sdnotify.stopping()
        task.cancel()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    try:
        await agent.run()
    except asyncio.CancelledError:
        log.get("agent").info("stopped", node=agent.node)
        return 0
    return 1  # run() only returns by failing


def _print_once(node: str, nvml: Nvml | None, timeout: float, as_json: bool) -> int:
    if nvml is None:
        sample = Sample([])
    else:
        try:
            sample = _in_thread(nvml.sample, "tmd-nvml-sample").result(timeout)
        except TimeoutError:
            raise NvmlError(f"NVML sample did not return within {timeout} s") from None
    message = wire.NodeGpu(ts=time.time(), node=node, gpus=sample.gpus)
    if as_json:
        print(msgspec.json.format(wire.encode(message), indent=2).decode())
    else:
        names = {g.index: g.name for g in nvml.gpus} if nvml else {}
        for s in sample.gpus:
            fields = msgspec.structs.asdict(s)
            del fields["index"]
            shown = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
            print(f"gpu {s.index} ({names.get(s.index, '?')}): {shown}")
        if not sample.gpus:
            print(f"{node}: heartbeat only, no GPUs sampled")
    for (i, name), why in sorted(sample.errors.items()):
        print(f"tmd agent: gpu {i} {name}: {why}", file=sys.stderr)
    return 0


def _in_thread(fn: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """Run ``fn`` in a new daemon thread. Unlike asyncio.to_thread's pool, a call that
    never returns neither blocks interpreter exit nor asyncio.run's shutdown."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def work() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=work, name=name, daemon=True).start()
    return future
