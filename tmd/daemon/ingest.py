"""MQTT ingest: subscribe to the v1 topics, decode once at the edge, update the view,
hand the decoded message to the bus.

Supervision is a plain loop: connect, subscribe, read until the connection drops,
back off (``tmd.connection.Backoff``), reconnect. Input never kills it: a bad message
is counted in ``tmd_messages_rejected_total{reason}``, logged at most once per (topic
kind, reason) per interval, and dropped.

Messages are handled inline, in the callback that reads them from the socket: the
default aiomqtt iterator costs an asyncio task per message, which at tens of
thousands of messages a second is most of a core. ``handle`` is synchronous and
O(size of the message).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import secrets
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Final

import aiomqtt
import msgspec

from tmd import log, wire
from tmd.clock import Clock
from tmd.config import IngestConfig, MqttConfig
from tmd.connection import ClientFactory, cancelling, handle_qos0_inline, reconnect_forever
from tmd.daemon.bus import Bus
from tmd.daemon.freshness import Freshness
from tmd.daemon.metrics import Metrics
from tmd.daemon.ranks import StepsApplied
from tmd.daemon.shards import (
    OP_CONNECTED,
    OP_DISCONNECTED,
    OP_LOST,
    OP_MESSAGE,
    OP_PROBE,
    Shards,
    frame,
    owner,
)
from tmd.daemon.view import DOUBT_S, ClusterView
from tmd.errors import ProtocolError, PublishError, TmdError

_NODE_KINDS: Final = {"status": "node_status", "gpu": "gpu", "xid": "xid", "iter": "node_iter"}
_JOB_KINDS: Final = {"status": "job_status", "ack": "ack"}
_TYPES: Final[dict[str, type[wire.Message]]] = {
    "node_status": wire.NodeStatus,
    "gpu": wire.NodeGpu,
    "xid": wire.XidEvent,
    "iter": wire.IterBatch,
    "node_iter": wire.NodeIter,
    "job_status": wire.JobStatus,
    "ack": wire.Ack,
}


_NUMBERED: Final = frozenset({"gpu", "node_iter", "iter"})  # each topic numbered apart
_NODE_NUMBERED: Final = frozenset({"gpu", "node_iter"})  # by the machine's agent


class _RelayedJob(msgspec.Struct, frozen=True):
    job: wire.Name


class _RelayedJobs(wire.Message, kw_only=True, frozen=True):
    """What a shard reads of a ``NodeIter`` at first: its jobs, each as it came, so it
    decodes (and checks) only its own, the head having taken its machine's part."""

    node: wire.Name
    jobs: Annotated[list[msgspec.Raw], msgspec.Meta(min_length=1, max_length=wire.MAX_RELAYED_JOBS)]
    seq: wire.Count | None = None


class _RelayedHead(wire.Message, kw_only=True, frozen=True):
    """What the head reads of a ``NodeIter`` when shards apply its steps: its machine's
    part (its number, its GPU sample) and the names of its jobs, to route it by."""

    node: wire.Name
    jobs: Annotated[list[_RelayedJob], msgspec.Meta(min_length=1, max_length=wire.MAX_RELAYED_JOBS)]
    gpu: wire.NodeGpu | None = None
    seq: wire.Count | None = None


class _SeqHeader(msgspec.Struct):
    """What a refused numbered message is read for: its number and stamp (and a
    rank's run and generation), bounded."""

    seq: wire.Count | None = None
    ts: wire.Timestamp = 0.0
    run: wire.Count | None = None
    generation: wire.Count = 0


_SEQ_HEADER: Final = msgspec.json.Decoder(_SeqHeader)
_RANK: Final = re.compile(r"0|[1-9][0-9]{0,7}", re.ASCII)


def classify(topic: str) -> tuple[str, str, int | None]:
    """``(kind, node or job, rank)`` of a v1 topic; ProtocolError ``topic`` otherwise."""
    parts = topic.split("/")
    n = len(parts)
    if n >= 5 and parts[0] == "tmd" and parts[1] == "v1":
        if n == 5 and parts[2] == "node" and parts[4] in _NODE_KINDS:
            return _NODE_KINDS[parts[4]], parts[3], None
        if n == 5 and parts[2] == "job" and parts[4] in _JOB_KINDS:
            return _JOB_KINDS[parts[4]], parts[3], None
        if n == 7 and parts[2] == "job" and parts[4] == "rank" and parts[6] == "iter":
            text = parts[5]
            if _RANK.fullmatch(text):
                return "iter", parts[3], int(text)
            raise ProtocolError("topic", f"bad rank {text[:16]!r} in topic")
    raise ProtocolError("topic", "not a tmd v1 topic")


class SubscriptionRefused(TmdError):
    """The broker refused some of our subscriptions (an ACL, most likely)."""


class Ingest:
    def __init__(
        self,
        *,
        mqtt: MqttConfig,
        config: IngestConfig,
        view: ClusterView,
        bus: Bus,
        metrics: Metrics,
        clock: Clock,
    ) -> None:
        self._mqtt = mqtt
        self._config = config
        self._view = view
        self._bus = bus
        self._metrics = metrics
        self._clock = clock
        self._log = log.get("ingest")
        self._reject_logged: dict[tuple[str, str], tuple[float, int]] = {}
        self._client = ClientFactory(mqtt)
        self.subscribed = asyncio.Event()
        self.connected = False
        self._client_now: aiomqtt.Client | None = None
        self._lane_missing = False
        # The head's shards (``tmd.daemon.shards``): where a job's steps go. None: here.
        self.shards: Shards | None = None
        # (index, count): this ingest is that shard's, fed frames by the head.
        self.shard: tuple[int, int] | None = None
        self._owned: dict[str, bool] = {}
        # This daemon's lag probe, on a topic of its own (not shared with other heads).
        self.probe_topic = wire.probe_topic(f"d{secrets.token_hex(6)}")
        self._probe_nonce = secrets.token_hex(8)
        self._probes_out: dict[float, bool] = {}  # send stamps not read back yet
        self.freshness = view.freshness = Freshness(
            interval_s=config.probe_interval_s,
            max_lag_s=config.stale_lag_s,
            settle_s=config.stale_settle_s,
        )

    # -- the edge: one message in ----------------------------------------------------

    def handle(self, topic: str, payload: bytes, *, retained: bool = False) -> None:
        """Decode, check and apply one message. Never raises: whatever goes wrong is
        counted as a rejection (``internal`` for what the checks did not foresee).

        A retained message is state, not news: it updates the view but is not put on
        the bus, so a daemon restart does not replay old Last Wills as new losses
        (policies reconcile such state from the view on their ticks)."""
        now = self._clock.now()
        if topic == self.probe_topic:
            self._probe_back(payload, now)
            return
        kind = "unknown"
        try:
            try:
                kind, owner, rank = classify(topic)
            finally:
                self._metrics.received_by[kind].inc()
            if self.shards is not None and kind == "iter":
                # As it came, to its job's shard: checked there, where the rank's numbers
                # are kept (a batch refused still arrived).
                self.shards.send(self.shards.owner(owner), self._frame(topic, payload, retained),
                                 kind=kind)  # fmt: skip
                return
            limit = (
                self._config.max_status_bytes
                if kind == "job_status"
                else self._config.max_payload_bytes
            )
            if len(payload) > limit:
                raise ProtocolError("oversize", f"{len(payload)} bytes > {limit}")
            if not payload and kind in ("node_status", "job_status"):
                if kind == "job_status":
                    self._view.forget_job(owner)  # the job's retained status was cleared
                return
            if self.shards is not None and kind == "node_iter":
                self._route_relayed(owner, topic, payload, now, retained=retained)
                return
            if self.shard is not None and kind == "node_iter":
                self._apply_own_relayed(owner, payload, now, publish=not retained)
                return
            message = wire.decode(payload, _TYPES[kind])
            self._apply(kind, owner, rank, message, now, publish=not retained)
            if self.shards is not None and kind == "job_status":  # for its ranks' view too
                self.shards.send(self.shards.owner(owner), self._frame(topic, payload, retained))
        except ProtocolError as exc:
            if kind in _NUMBERED and not retained:
                self._refused_numbered(owner, kind, rank, payload, now)
            self._reject(topic, kind, exc, now)
        except Exception as exc:  # a bug, not bad input: count it, keep serving
            self._reject(topic, kind, ProtocolError("internal", repr(exc)), now)

    def _apply(
        self, kind: str, owner: str, rank: int | None, message: Any, now: float, *, publish: bool
    ) -> None:
        view = self._view
        if kind in _NODE_NUMBERED and message.seq is not None and publish:
            # Arrived, whatever the checks below say of it: not a gap.
            self._numbered(owner, kind, None, message, now)
        if kind == "iter":
            if message.job != owner or message.rank != rank:
                raise ProtocolError("mismatch", "job or rank differs from the topic")
            self._apply_iter(message, now)
            if message.seq is not None and publish:  # numbered once its rank is held
                self._numbered(owner, kind, rank, message, now)
        elif kind == "node_iter":
            self._apply_relayed(message, owner, now, publish=publish)
            return  # what it carries went on the bus
        elif kind in ("node_status", "gpu", "xid"):
            if message.node != owner:
                raise ProtocolError("mismatch", "node differs from the topic")
            if kind == "node_status":
                view.apply_node_status(message, now, live=publish)
            elif kind == "gpu":
                self._metrics.samples_by[view.apply_gpu(message, now)].inc()
            else:
                view.apply_xid(message, now)
        else:
            if message.job != owner:
                raise ProtocolError("mismatch", "job differs from the topic")
            if kind == "job_status":
                view.apply_job_status(message, now)
        if publish:
            self._bus.publish(message)

    def _apply_iter(self, batch: wire.IterBatch, now: float) -> None:
        rows = batch.rows()
        applied = self._view.apply_steps(
            batch.job, batch.rank, batch.node, batch.generation, batch.run, rows, now
        )
        self._count(applied)
        self._applied(batch.ts, rows, now)

    def _count(self, applied: StepsApplied) -> None:
        """Count steps the view took, by outcome."""
        m = self._metrics
        if applied.accepted:
            m.steps_by["accepted"].inc(applied.accepted)
        if applied.duplicate:
            m.steps_by["duplicate"].inc(applied.duplicate)
        if applied.late:
            m.steps_by["late"].inc(applied.late)

    def _applied(self, sent: float, rows: Sequence[wire.Row], now: float) -> None:
        """A batch the view took (``rows``, sent at ``sent`` on its rank's clock): its
        latency."""
        self._metrics.latency.observe(max(0.0, now - sent))

    def _relayed_applied(self, relayed: wire.RelayedBatches, taken: list[int], now: float) -> None:
        """The batches of ``relayed`` the view took (their indexes): their latencies,
        each from when its rank made it."""
        observe, sent = self._metrics.latency.observe, relayed.ts
        for i in taken:
            observe(max(0.0, now - sent[i]))

    def _apply_relayed(
        self, message: wire.NodeIter, node: str, now: float, *, publish: bool
    ) -> None:
        """A machine's agent relayed its ranks' batches (and its GPU sample): each
        applied as if its rank had published it (a batch the view refuses is counted
        and the rest go on), and put on the bus as ``IterBatch`` where a plug-in takes
        those. The whole message is checked before any of it is applied: its parts
        name the topic's machine (an agent speaks for the ranks on its own machine
        only) and its columns line up."""
        if message.node != node or (message.gpu is not None and message.gpu.node != node):
            raise ProtocolError("mismatch", "node differs from the topic")
        jobs = message.jobs
        if self.shard is None:  # a shard's own, each checked as it took it
            for relayed in jobs:
                relayed.check()
        view = self._view
        if message.gpu is not None and self.shard is None:
            self._metrics.samples_by[view.apply_gpu(message.gpu, now)].inc()
            if publish:
                self._bus.publish(message.gpu)
        bus_wants = publish and self._bus.wants(wire.IterBatch)
        total = StepsApplied()  # counted once per message
        for relayed in jobs:
            taken, refused = view.apply_relayed(relayed, node, now, total)
            for i, exc in refused:  # that rank's batch only: the others count
                self._reject(wire.iter_topic(relayed.job, relayed.rank[i]), "node_iter", exc, now)
            self._relayed_applied(relayed, taken, now)
            if bus_wants and taken:
                batches = relayed.batches(node)
                for i in taken:
                    self._bus.publish(batches[i])
        self._count(total)

    @staticmethod
    def _frame(topic: str, payload: bytes, retained: bool) -> bytes:
        return frame(OP_MESSAGE, topic, payload, retained=retained)

    def _route_relayed(
        self, owner_: str, topic: str, payload: bytes, now: float, *, retained: bool
    ) -> None:
        """An agent's relayed message, with ingest shards: its machine's part (its number,
        its GPU sample) applied here, the message as it came to the shard of each of its
        jobs (``_RelayedHead``). Each shard checks and applies its own jobs' batches
        (``_apply_own_relayed``; without shards one bad batch refuses the whole
        message)."""
        shards = self.shards
        assert shards is not None
        kind = "node_iter"
        head = wire.decode(payload, _RelayedHead)
        if head.node != owner_ or (head.gpu is not None and head.gpu.node != owner_):
            raise ProtocolError("mismatch", "node differs from the topic")
        publish = not retained
        if head.seq is not None and publish:
            self._numbered(owner_, kind, None, head, now)
        if head.gpu is not None:
            self._metrics.samples_by[self._view.apply_gpu(head.gpu, now)].inc()
            if publish:
                self._bus.publish(head.gpu)
        data = self._frame(topic, payload, retained)
        for shard in {shards.owner(j.job) for j in head.jobs}:
            shards.send(shard, data, kind=kind)

    def _apply_own_relayed(self, node: str, payload: bytes, now: float, *, publish: bool) -> None:
        """A shard's part of an agent's relayed message: the batches of the jobs it owns,
        each decoded and checked apart (another shard's job, good or bad, is not its
        to judge; one of its own that is bad is refused, once, and the rest applied)."""
        envelope = wire.decode(payload, _RelayedJobs)
        jobs, refused = [], None
        for raw in envelope.jobs:
            try:
                if not self._owns(wire.decode(raw, _RelayedJob).job):
                    continue
                relayed = wire.decode(raw, wire.RelayedBatches)
                relayed.check()
                jobs.append(relayed)
            except ProtocolError as exc:
                refused = exc
        if jobs:
            message = wire.NodeIter(ts=envelope.ts, node=envelope.node, jobs=jobs, seq=envelope.seq)
            self._apply("node_iter", node, None, message, now, publish=publish)
        if refused is not None:
            raise refused

    def _owns(self, job: str) -> bool:
        """Whether this shard owns ``job`` (``tmd.daemon.shards.owner``), remembered."""
        found = self._owned.get(job)
        if found is None:
            assert self.shard is not None
            if len(self._owned) >= 65536:  # names of jobs long gone
                self._owned.clear()
            found = self._owned[job] = owner(job, self.shard[1]) == self.shard[0]
        return found

    def dump(self) -> bytes:
        """What a benchmark's shard sends back when asked (``tmd.daemon.shards``)."""
        return b""

    def _refused_numbered(
        self, owner: str, kind: str, rank: int | None, payload: bytes, now: float
    ) -> None:
        """A numbered message refused (too big, a field out of bounds, a check failed)
        still came: its number, where one can be read, is not a gap (``_numbered``
        twice over one message is as once)."""
        try:
            header = _SEQ_HEADER.decode(payload)
        except (msgspec.DecodeError, RecursionError):
            return
        if header.seq is not None:  # on this topic: its sender's, whatever it says
            with contextlib.suppress(ProtocolError):  # the view is full: refused anyway
                self._numbered(owner, kind, rank, header, now)

    def _numbered(self, owner: str, kind: str, rank: int | None, message: Any, now: float) -> None:
        """``message`` (``seq``, ``ts``; a rank's ``run`` and ``generation``) came on
        the ``kind`` topic of ``owner`` (a machine; a job where ``rank``): those its
        sender numbered before it and that never came were lost on the way here (a
        broker drops what a subscriber that lags cannot take), so the view is whole
        again only from now (``Freshness.lost``; a rank's loss, its job's view only:
        ``JobView.lost_at``). Not judged under a shared subscription, where each head
        reads some of them."""
        if self._mqtt.shared_group or (rank is None and self.shard is not None):
            return  # a shard's machines' topics are numbered by its head
        view = self._view
        job_lost_at = -math.inf
        if rank is None:
            lost = view.gap(owner, kind, message.seq, message.ts, now)
        else:
            if (job := view.jobs.get(owner)) is not None:
                job_lost_at = job.lost_at
            lost = view.rank_gap(owner, rank, message.run, message.generation,
                                 message.seq, message.ts, now)  # fmt: skip
        where = owner if rank is None else f"{owner} rank {rank}"
        if lost is None:
            self._log.warning(
                "sequence numbers that make no sense: two senders under one name, or "
                "a forged message; their gaps are not judged for a while",
                sender=where, kind=kind, seq=message.seq, for_s=DOUBT_S,
            )  # fmt: skip
            return
        if not lost:
            return
        self._metrics.lost_by[kind].inc(lost)
        if rank is not None:  # its job's alone (``ClusterView.rank_gap``)
            if now - job_lost_at >= self._config.stale_settle_s:  # once an episode
                self._log.warning(
                    "a rank's messages lost on the way to this daemon: no rank of its "
                    "job found stalled until it settles",
                    sender=where, lost=lost, settle_s=self._config.stale_settle_s,
                )  # fmt: skip
            return
        if self.shards is not None:
            self.shards.broadcast(frame(OP_LOST))
        if self.freshness.lost(now):
            self._log.warning(
                "messages lost on the way to this daemon: no finding of absence until "
                "the view settles",
                sender=where, kind=kind, lost=lost,
                settle_s=self._config.stale_settle_s,
            )  # fmt: skip

    def _reject(self, topic: str, kind: str, exc: ProtocolError, now: float) -> None:
        self._metrics.rejected_by[exc.reason].inc()
        key = (kind, exc.reason)
        last, suppressed = self._reject_logged.get(key, (-1e18, 0))
        if now - last < self._config.reject_log_interval_s:
            self._reject_logged[key] = (last, suppressed + 1)
            return
        self._reject_logged[key] = (now, 0)
        self._log.warning(
            "message rejected",
            topic=topic[:200],
            reason=exc.reason,
            detail=exc.detail[:300],
            suppressed_since_last=suppressed,
        )

    # -- the daemon's own lag ------------------------------------------------------------

    def _probe_back(self, payload: bytes, now: float) -> None:
        sent_text, _, nonce = payload.decode(errors="replace").partition(" ")
        try:
            sent = float(sent_text)
        except ValueError:
            return
        if nonce != self._probe_nonce or self._probes_out.pop(sent, None) is None:
            # Not a probe this daemon sent, or one already read: on a broker without an
            # ACL anyone can write (and read) the topic, and a stamp ahead would hide a
            # stale view, one far behind would keep it stale.
            return
        self.freshness.answered(sent, now)
        if self.shards is not None:  # behind every message routed so far
            self.shards.broadcast(frame(OP_PROBE, stamp=sent), kind="probe")
        self._metrics.ingest_lag.set(self.freshness.last_lag_s)

    async def probe(self) -> None:
        """Publish a probe stamped with the daemon's clock every ``probe_interval_s``,
        and export how far behind the view is (``tmd_ingest_lag_seconds``)."""
        while True:
            now = self._clock.now()
            client = self._client_now
            if client is not None:
                payload = f"{now!r} {self._probe_nonce}".encode()
                self._probes_out[now] = True
                while len(self._probes_out) > 64:  # probes that never came back
                    del self._probes_out[next(iter(self._probes_out))]
                try:
                    await client.publish(self.probe_topic, payload, qos=0)
                except Exception as exc:  # never ends the daemon: the view goes stale
                    if cancelling():  # aiomqtt's error in place of the cancellation
                        raise asyncio.CancelledError from exc
                    self._log.debug("probe not sent", error=str(exc))
            if cancelling():  # a publish that swallowed the cancellation and returned
                raise asyncio.CancelledError
            lag = self.freshness.lag_s(now)
            stale = self.freshness.state(now) != "current"
            if self.shards is not None:  # the view of ranks is theirs
                lag, stale = max(lag, self.shards.lag_s()), stale or self.shards.stale()
            self._metrics.ingest_lag.set(lag if math.isfinite(lag) else -1.0)
            self._metrics.view_stale.set(1 if stale else 0)
            await asyncio.sleep(self._config.probe_interval_s)

    # -- the way out: the actuator's commands ------------------------------------------

    async def publish(self, topic: str, payload: bytes, *, qos: int = 1) -> None:
        """Publish on the ingest connection (one connection per daemon, so one set of
        broker credentials and ACLs). Returns once the broker acknowledged (QoS 1);
        raises ``PublishError`` when not connected, refused or timed out: callers retry."""
        client = self._client_now
        if client is None:
            raise PublishError("not connected to the broker")
        try:
            await client.publish(topic, payload, qos=qos, timeout=self._mqtt.connect_timeout_s)
        except (aiomqtt.MqttError, TimeoutError) as exc:
            raise PublishError(str(exc) or "timed out") from exc

    # -- the connection loop -----------------------------------------------------------

    async def run(self) -> None:
        """Connect, subscribe, read; on any connection loss back off and do it again.

        The back-off doubles on each failed attempt (with jitter, up to
        ``mqtt.reconnect_max_s``) and starts over after a session that got subscribed.
        """
        await reconnect_forever(
            self._session, config=self._mqtt, log=self._log,
            connected=lambda: self.connected, closed=self._closed,
            failed=self._metrics.mqtt_failures.inc,
            errors=(aiomqtt.MqttError, SubscriptionRefused),
        )  # fmt: skip

    def _closed(self) -> None:
        self.connected = False
        self._client_now = None
        self._metrics.mqtt_connected.set(0)
        self.freshness.connection(False, self._clock.now())
        if self.shards is not None:
            self.shards.broadcast(frame(OP_DISCONNECTED))

    def _reads_inline(self) -> bool:
        """Whether messages are handled in the callback that reads them, QoS 0 ones
        without paho (always, but in the ingest benchmark's baseline)."""
        return True

    def _queue_type(self) -> type[asyncio.Queue[aiomqtt.Message]] | None:
        """How the client queues incoming messages: not at all, handled inline."""
        return _inline_queue(self.handle) if self._reads_inline() else None

    def _handle_qos0(self, topic: str, payload: bytes, retained: bool) -> None:
        self.handle(topic, payload, retained=retained)

    async def _session(self) -> None:
        client = self._client(queue_type=self._queue_type())
        if self._mqtt.protocol == "3.1.1" and self._reads_inline():
            installed = handle_qos0_inline(client, self._handle_qos0)  # telemetry sans paho
            if not installed and not self._lane_missing:
                self._lane_missing = True  # said once: paho reads it all, as it can
                self._log.warning("QoS 0 read path not installed on this aiomqtt/paho")
        async with client:
            prefix = f"$share/{self._mqtt.shared_group}/" if self._mqtt.shared_group else ""
            granted = await client.subscribe(
                [(prefix + t, qos) for t, qos in wire.SUBSCRIPTIONS],
                timeout=self._mqtt.connect_timeout_s,
            )
            granted = [
                *granted,
                *await client.subscribe(self.probe_topic, qos=0,
                                        timeout=self._mqtt.connect_timeout_s),
            ]  # fmt: skip
            if refused := _refused(granted):
                # Not ready, not healthy: an ACL that refuses us must not look like a
                # quiet cluster. Retried with back-off like a lost connection.
                raise SubscriptionRefused(f"broker refused the subscriptions: {refused}")
            self.freshness.connection(True, self._clock.now())
            self._view.restart_sequences()
            if self.shards is not None:  # before any message of this session
                self.shards.broadcast(frame(OP_CONNECTED))
            self.connected = True
            self._client_now = client
            self._metrics.mqtt_connects.inc()
            self._metrics.mqtt_connected.set(1)
            self._log.info("subscribed", host=self._mqtt.host, port=self._mqtt.port)
            self.subscribed.set()
            # The inline queue never holds a message, so with it this loop only ends
            # by raising MqttError when the connection drops.
            async for message in client.messages:
                self.handle(message.topic.value, _payload_bytes(message), retained=message.retain)


def _inline_queue(handle: Callable[..., None]) -> type[asyncio.Queue[aiomqtt.Message]]:
    class InlineQueue(asyncio.Queue[aiomqtt.Message]):
        def put_nowait(self, item: aiomqtt.Message) -> None:
            handle(item.topic.value, _payload_bytes(item), retained=item.retain)

    return InlineQueue


def _payload_bytes(message: aiomqtt.Message) -> bytes:
    # aiomqtt declares payload as bytes; paho hands it bytes. Guard against a change.
    payload: object = message.payload
    return payload if isinstance(payload, bytes) else bytes(str(payload), "utf-8")


def _refused(granted: Any) -> list[Any]:
    """SUBACK codes that refuse: 0x80 in MQTT 3.1.1, any failure reason code in 5."""
    return [g for g in granted if (g.is_failure if hasattr(g, "is_failure") else g >= 0x80)]
