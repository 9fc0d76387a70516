"""Ingest shards: processes that each own whole jobs (``ingest.shards``).

One process takes in the telemetry of 131,072 ranks with little to spare. With
``ingest.shards = N`` (1 or more) the daemon runs N shard processes beside its own,
and splits the work by job, as several head nodes would (DESIGN: each owns whole
jobs):

- The head (the daemon's process) keeps the one MQTT connection, the actuator, the
  policies, the API and the journal, and everything of machines: their statuses, GPU
  samples and XIDs, the detectors of machines (``gpu_health``, ``node_lost``), the
  jobs' statuses and acks, the lag probe, and every sequence number an agent puts on a
  machine's topic. It decodes no rank's steps: a rank's batch (``tmd/v1/job/J/rank/
  R/iter``) goes as it came to job J's shard (``owner``); an agent's relayed message
  (``tmd/v1/node/M/iter``) is read for its machine's part (its number, its GPU sample)
  and its jobs' names only, and goes as it came to the shard of each job in it.
- A shard applies what it is sent to a view of its own jobs (the same
  ``ClusterView`` and ``Ingest`` code, each job's statuses too), runs the detectors
  that read ranks (``Detector.reads_ranks``: ``straggler``, ``rank_stalled``), and
  sends their findings to the head, which journals and acts on them as on its own.
  Every ``REPORT_S`` it sends what it counted (rejected and lost messages, rank-steps,
  latencies: the head exports its own and theirs as one series; what was received, the
  head counts), its jobs' last reports, ranks and front steps, its ranks and steps, its
  plug-ins' state and its lag.
- The shard's view is as fresh as the head's intake and the pipe to it: the head
  passes on its connection's state, each probe it read back (in order with the
  messages, so a shard's lag includes its own backlog) and each loss it found.

A job's owner is a stable hash of its name (``owner``): the same in every process
and every run. Pipes carry the frames (``_HEADER``); a head never waits on a shard:
what a shard cannot take yet waits in the head up to ``MAX_BACKLOG_BYTES``, past which
its telemetry is dropped (``tmd_shard_dropped_total``) until it catches up, and the
shard is told so its view settles anew, as for messages a broker drops (``send``). A
shard whose reports stop is behind: the head's view is stale. A shard that dies ends
the daemon (systemd restarts it, as for any failure of its core); a head that dies
ends its shards (their pipe closes); a stop signal is the head's to handle.

Not the same as in one process: the API's rank rows come from the job's shard when
asked (``rank_rows``); an agent's relayed message is checked by part (its machine's here, each job's
in the shard that owns it), not refused whole for one bad job; ``ingest.max_ranks``
and ``max_jobs`` bound each shard's view, and the head's (the jobs' statuses, where a
job known only from a shard's report gives way to one with a status); plug-in metrics
(``tmd_plugin_batch_seconds``...) are of the head's plug-ins only; and the actuator
waits for the head's own view to be current, not for the shards' (a stale shard finds
no absence, but a straggler it found is acted on: ``/healthz`` and ``tmd_view_stale``
say when a shard is behind).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import math
import multiprocessing as mp
import os
import signal
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Union

import msgspec

from tmd import log
from tmd.clock import Clock, SystemClock
from tmd.config import ApiConfig, Config, MqttConfig
from tmd.daemon import events, plugins
from tmd.daemon.bus import Bus
from tmd.daemon.metrics import Metrics
from tmd.daemon.view import ClusterView, JobView, rank_rows
from tmd.errors import TmdError

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from tmd.daemon.ingest import Ingest

REPORT_S: Final = 0.5
HOUSEKEEPING_S: Final = 60.0
MAX_BACKLOG_BYTES: Final = 64 << 20
"""What a shard may have waiting in the head before the head drops what comes next."""
_PIPE_BYTES: Final = 1 << 20
_READ_BYTES: Final = 1 << 20
_F_SETPIPE_SZ: Final = 1031

# Head -> shard: a frame is ``_HEADER`` (op, retained, stamp, topic length, payload
# length), then the topic and the payload.
_HEADER: Final = struct.Struct("<BBdHI")
OP_MESSAGE: Final = 0
OP_CONNECTED: Final = 1  # the head subscribed (anew): numbers start over
OP_DISCONNECTED: Final = 2
OP_PROBE: Final = 3  # stamp: the probe's send time, read back by the head
OP_LOST: Final = 4  # the head found messages lost on the way to it
OP_FORGET_JOB: Final = 5  # topic: the job's name
OP_DUMP: Final = 6  # the shard sends what ``dump`` gives (benchmarks)
OP_DROPPED: Final = 7  # the head dropped telemetry for it here (``Shards.send``)
OP_RANKS: Final = 8  # topic: a job; stamp: the request's number (``Shards.rank_rows``)
RANK_ROWS_TIMEOUT_S: Final = 10.0

# Shard -> head: a 4-byte length, then a msgpack array (``_Out``).
_LEN: Final = struct.Struct("<I")


def owner(job: str, shards: int) -> int:
    """The shard that owns ``job``, of ``shards``: a hash of its name, the same in every
    process and every run (not Python's ``hash``, salted per process; not a CRC, whose
    low bits names that differ in their last character, ``train-0``, ``train-1``..., can
    share)."""
    digest = hashlib.blake2b(job.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % shards


class ShardError(TmdError):
    """A shard could not do what the head asked (``rank_rows``)."""


class ShardDied(ShardError):
    """A shard process exited: the daemon ends and its supervisor restarts it whole."""


class _Report(msgspec.Struct, array_like=True):
    """What a shard counted since its last report (not what it received: the head
    counts each message it passes on), and where it stands."""

    rejected: dict[str, int]
    steps: dict[str, int]
    lost: dict[str, int]
    latency: list[int]
    latency_sum: float
    lag_s: float
    stale: bool
    ranks: int
    total_steps: int
    jobs: dict[str, tuple[float, int, int]]  # each job's last report, ranks, front step
    forgotten: int  # the OP_FORGET_JOB frames it has read
    plugins: dict[str, bool]


class _Out(msgspec.Struct, array_like=True):
    """One message from a shard: an event of ``source``, a report, a dump, or a job's
    rank rows (``rows``: JSON in ``dump``, for the request numbered ``source``)."""

    what: str
    source: str = ""
    event: bytes = b""  # msgpack of the event
    report: _Report | None = None
    dump: bytes = b""


_ENCODER: Final = msgspec.msgpack.Encoder()
_OUT: Final = msgspec.msgpack.Decoder(_Out)
_EVENT: Final[msgspec.msgpack.Decoder[Any]] = msgspec.msgpack.Decoder(Union[events.ALL])  # noqa: UP007


def frame(op: int, topic: str = "", payload: bytes = b"", *, stamp: float = 0.0,
          retained: bool = False) -> bytes:  # fmt: skip
    """One head -> shard frame."""
    t = topic.encode()
    return _HEADER.pack(op, retained, stamp, len(t), len(payload)) + t + payload


def frames(buf: bytearray) -> list[tuple[int, bool, float, str, bytes]]:
    """The whole frames at the start of ``buf``, taken out of it."""
    out, at, n, size = [], 0, len(buf), _HEADER.size
    with memoryview(buf) as view:
        while n - at >= size:
            op, retained, stamp, tlen, plen = _HEADER.unpack_from(view, at)
            end = at + size + tlen + plen
            if end > n:
                break
            topic = bytes(view[at + size : at + size + tlen]).decode()
            out.append((op, bool(retained), stamp, topic, bytes(view[at + size + tlen : end])))
            at = end
    del buf[:at]
    return out


def _outs(buf: bytearray) -> list[_Out]:
    """The whole shard -> head messages at the start of ``buf``, taken out of it."""
    out, at, n = [], 0, len(buf)
    while n - at >= _LEN.size:
        (length,) = _LEN.unpack_from(buf, at)
        end = at + _LEN.size + length
        if end > n:
            break
        out.append(_OUT.decode(bytes(buf[at + _LEN.size : end])))
        at = end
    del buf[:at]
    return out


def _pack(out: _Out) -> bytes:
    body = _ENCODER.encode(out)
    return _LEN.pack(len(body)) + body


def _big_pipe(fd: int) -> None:
    with contextlib.suppress(OSError):  # past /proc/sys/fs/pipe-max-size: the default
        fcntl.fcntl(fd, _F_SETPIPE_SZ, _PIPE_BYTES)


# -- the head's side -----------------------------------------------------------------


@dataclass
class _Link:
    """The head's end of one shard: its process, the frames waiting for its pipe."""

    index: int
    process: Any
    out: Connection  # frames to it
    back: Connection  # what it sends back
    pending: bytearray = field(default_factory=bytearray)
    writing: bool = False
    dropping: bool = False  # its telemetry dropped (``Shards.send``) until it catches up
    inbox: bytearray = field(default_factory=bytearray)
    report: _Report | None = None
    report_at: float = -math.inf  # when (the loop's clock) its last report came
    forgets: int = 0  # OP_FORGET_JOB frames sent
    forgetting: deque[tuple[int, str]] = field(default_factory=deque)  # (number, job) unread
    dumps: list[bytes] = field(default_factory=list)

    @property
    def out_fd(self) -> int:
        return self.out.fileno()

    @property
    def in_fd(self) -> int:
        return self.back.fileno()


class Shards:
    """The head's shards: start them, send them frames, take their findings and
    reports (``emit`` each finding as the head's own), stop them."""

    def __init__(
        self,
        *,
        config: Config,
        specs: list[plugins.Spec],
        metrics: Metrics,
        view: ClusterView,
        emit: Callable[[events.Event, str], None],
        clock: Clock,
        ingest_class: str = "tmd.daemon.ingest:Ingest",
    ) -> None:
        self.count = config.ingest.shards
        self._config = config
        self._specs = specs
        self._metrics = metrics
        self._view = view
        self._emit = emit
        self._clock = clock
        self.ingest_class = ingest_class
        self._log = log.get("shards")
        self.links: list[_Link] = []
        self._flush_soon: set[int] = set()
        self._died: asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.max_backlog_bytes = MAX_BACKLOG_BYTES
        self._dumped = asyncio.Event()
        self._owners: dict[str, int] = {}
        self._asked: dict[int, asyncio.Future[msgspec.Raw]] = {}
        self._requests = 0

    def owner(self, job: str) -> int:
        """``owner(job, count)``, remembered (it is asked for every message)."""
        found = self._owners.get(job)
        if found is None:
            if len(self._owners) >= 65536:  # names of jobs long gone
                self._owners.clear()
            found = self._owners[job] = owner(job, self.count)
        return found

    def start(self) -> None:
        """Start every shard (a fresh interpreter each: ``spawn``, no copy of the head's
        threads or sockets) and watch their pipes."""
        self._loop = loop = asyncio.get_running_loop()
        self._died = loop.create_future()
        ctx = mp.get_context("spawn")
        for i in range(self.count):
            # Connections only to hand the pipes' ends over (spawn passes them on); the
            # bytes go through their descriptors directly.
            to_r, to_w = ctx.Pipe(duplex=False)
            back_r, back_w = ctx.Pipe(duplex=False)
            _big_pipe(to_w.fileno())
            _big_pipe(back_w.fileno())
            process = ctx.Process(
                target=shard_main,
                args=(i, self._shard_config(), self._specs, to_r, back_w, self.ingest_class),
                name=f"tmd-shard-{i}",
                daemon=True,
            )
            process.start()
            to_r.close()
            back_w.close()
            os.set_blocking(to_w.fileno(), False)
            os.set_blocking(back_r.fileno(), False)
            link = _Link(i, process, to_w, back_r)
            self.links.append(link)
            loop.add_reader(link.in_fd, self._readable, link)
        self._log.info("ingest shards started", shards=self.count,
                       pids=[link.process.pid for link in self.links])  # fmt: skip

    def _shard_config(self) -> Config:
        """The config a shard needs: no broker of its own, no API, so none of their
        secrets (what a shard is handed could be read from its memory)."""
        c = self._config
        mqtt = MqttConfig(shared_group=c.mqtt.shared_group)
        return dataclasses.replace(c, mqtt=mqtt, api=ApiConfig())

    async def wait_died(self) -> None:
        """Return never; raise ``ShardDied`` when a shard exits."""
        assert self._died is not None
        await self._died

    # -- frames out --------------------------------------------------------------------

    def send(self, shard: int, data: bytes, *, kind: str = "") -> None:
        """Queue ``data`` (a ``frame``) for ``shard``, written once this turn of the loop
        is done. Once ``max_backlog_bytes`` wait for it, telemetry (``kind`` ``iter`` or
        ``node_iter``, counted in ``tmd_shard_dropped_total``) and probes (``probe``: the
        shard's view goes stale, not current over a gap) are dropped until half as much
        waits; then the shard is told of the loss (``OP_DROPPED``), where the gap is: its
        view settles anew, and its ranks' numbers start over (the gap is counted here,
        not again as lost). Other frames (statuses, the connection's state) are never
        dropped."""
        if not self.links:
            return  # stopped
        link = self.links[shard]
        if kind:
            waiting = len(link.pending)
            if link.dropping and waiting >= self.max_backlog_bytes // 2:
                self._dropped(kind)
                return
            if not link.dropping and waiting >= self.max_backlog_bytes:
                link.dropping = True
                self._log.warning("ingest shard behind: its telemetry is dropped until it "
                                  "catches up", shard=shard, waiting_bytes=waiting)  # fmt: skip
                self._dropped(kind)
                return
            if link.dropping:
                link.dropping = False
                link.pending += frame(OP_DROPPED)
        link.pending += data
        if shard not in self._flush_soon and not link.writing:
            if not self._flush_soon:
                assert self._loop is not None
                self._loop.call_soon(self._flush_all)
            self._flush_soon.add(shard)

    def _dropped(self, kind: str) -> None:
        if kind in self._metrics.dropped_by:
            self._metrics.dropped_by[kind].inc()

    def broadcast(self, data: bytes, *, kind: str = "") -> None:
        for link in self.links:
            self.send(link.index, data, kind=kind)

    def _flush_all(self) -> None:
        shards, self._flush_soon = self._flush_soon, set()
        if not self.links:
            return  # stopped
        for i in shards:
            self._flush(self.links[i])

    def _flush(self, link: _Link) -> None:
        pending = link.pending
        while pending:
            try:
                n = os.write(link.out_fd, pending)
            except BlockingIOError:
                break
            except OSError:  # the shard is gone: its reader says so
                pending.clear()
                break
            del pending[:n]
        assert self._loop is not None
        if pending and not link.writing:
            link.writing = True
            self._loop.add_writer(link.out_fd, self._writable, link)
        elif not pending and link.writing:
            link.writing = False
            self._loop.remove_writer(link.out_fd)

    def _writable(self, link: _Link) -> None:
        self._flush(link)

    # -- what comes back ---------------------------------------------------------------

    def _readable(self, link: _Link) -> None:
        try:
            data = os.read(link.in_fd, _READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._gone(link)
            return
        link.inbox += data
        try:
            outs = _outs(link.inbox)
            for out in outs:
                if out.what == "event":
                    self._emit(_EVENT.decode(out.event), out.source)
                elif out.what == "report" and out.report is not None:
                    self._took(link, out.report)
                elif out.what == "dump":
                    link.dumps.append(out.dump)
                    self._dumped.set()
                elif out.what in ("rows", "rows_failed"):
                    asked = self._asked.pop(int(out.source), None)
                    if asked is None or asked.done():
                        continue
                    if out.what == "rows":
                        asked.set_result(msgspec.Raw(out.dump))  # passed on as it is
                    else:
                        asked.set_exception(ShardError(out.dump.decode(errors="replace")))
        except (msgspec.DecodeError, ValueError) as exc:  # a bug: one version, two processes
            self._log.exception("ingest shard sent what the head cannot read")
            self._fail(link, f"unreadable message from ingest shard {link.index}: {exc}")

    def _gone(self, link: _Link) -> None:
        assert self._loop is not None
        self._loop.remove_reader(link.in_fd)
        code = link.process.exitcode  # None: its pipe closed first
        self._log.error("ingest shard exited", shard=link.index, exitcode=code)
        self._fail(link, f"ingest shard {link.index} exited ({code})")

    def _fail(self, link: _Link, why: str) -> None:
        assert self._loop is not None
        self._loop.remove_reader(link.in_fd)
        if self._died is not None and not self._died.done():
            self._died.set_exception(ShardDied(why))
        self._fail_asked(why)

    def _fail_asked(self, why: str) -> None:
        """What the API waits for from the shards will not come."""
        for asked in self._asked.values():
            if not asked.done():
                asked.set_exception(ShardDied(why))
        self._asked.clear()

    def _took(self, link: _Link, r: _Report) -> None:
        m = self._metrics
        # Not what it received: the head counted each message it passed on.
        for got, tallies in ((r.rejected, m.rejected_by), (r.steps, m.steps_by),
                             (r.lost, m.lost_by)):  # fmt: skip
            for key, n in got.items():
                if key in tallies:
                    tallies[key].inc(n)
        counts = m.latency.counts
        for i, n in enumerate(r.latency[: len(counts)]):
            counts[i] += n
        m.latency.sum += r.latency_sum
        link.report = r
        assert self._loop is not None
        link.report_at = self._loop.time()
        now, after = self._clock.now(), self._config.ingest.forget_after_s
        forgetting = link.forgetting
        while forgetting and forgetting[0][0] <= r.forgotten:
            forgetting.popleft()  # the shard forgot it too: what it says now is news
        waiting = {job for _, job in forgetting}
        for name, (seen, ranks, step) in r.jobs.items():
            if name in waiting:
                continue  # a report made before its shard read that it was forgotten
            if now - seen > after:
                continue  # silent: forgotten here (housekeeping), and soon there
            self._view.note_shard(name, seen, ranks, step)
        reports = [lk.report for lk in self.links if lk.report is not None]
        self._view.elsewhere = (sum(x.ranks for x in reports), sum(x.total_steps for x in reports))
        for name, up in self.plugins_up().items():
            m.plugin_up.labels(plugin=name).set(1 if up else 0)

    def lag_s(self) -> float:
        """How far behind the most behind shard's view is: its last report's lag, or
        infinite for one that never measured one or whose report is overdue (a shard
        wedged, or so busy it cannot report, is behind)."""
        assert self._loop is not None
        now, worst = self._loop.time(), 0.0
        for link in self.links:
            r = link.report
            overdue = now - link.report_at > self._config.ingest.stale_lag_s
            lag = math.inf if r is None or overdue or r.lag_s < 0 else r.lag_s
            worst = max(worst, lag)
        return worst

    def stale(self) -> bool:
        """Whether a shard's view is stale or settling (or its report overdue)."""
        return not math.isfinite(self.lag_s()) or any(
            lk.report is not None and lk.report.stale for lk in self.links
        )

    def forget(self, job: str) -> None:
        """The head forgot ``job`` (its status cleared, the API): its shard forgets it too,
        and what its reports say of it until it has read so is not taken up again (the
        forgets are numbered on each pipe, and each report says how many were read)."""
        if self.links:
            link = self.links[self.owner(job)]
            link.forgets += 1
            link.forgetting.append((link.forgets, job))
            self.send(link.index, frame(OP_FORGET_JOB, job))

    async def rank_rows(self, job: str) -> msgspec.Raw:
        """The API's rank rows of ``job`` (a JSON array), from the shard that owns it
        (``TimeoutError`` past ``RANK_ROWS_TIMEOUT_S``: a shard far behind answers late;
        ``ShardError`` when it could not)."""
        if not self.links:
            raise ShardError("the ingest shards are stopped")
        assert self._loop is not None
        self._requests += 1
        number = self._requests
        asked: asyncio.Future[msgspec.Raw] = self._loop.create_future()
        self._asked[number] = asked
        self.send(self.owner(job), frame(OP_RANKS, job, stamp=float(number)))
        try:
            async with asyncio.timeout(RANK_ROWS_TIMEOUT_S):
                return await asked
        finally:
            self._asked.pop(number, None)

    def plugins_up(self) -> dict[str, bool]:
        """The shards' plug-ins: up where every shard last said so."""
        reports = [lk.report for lk in self.links if lk.report is not None]
        names = {name for r in reports for name in r.plugins}
        return {n: bool(reports) and all(r.plugins.get(n, False) for r in reports) for n in names}

    # -- the end -----------------------------------------------------------------------

    async def dump(self, timeout_s: float = 30.0) -> list[bytes]:
        """Ask every shard for its ``dump`` and wait for them all (benchmarks)."""
        self._dumped.clear()
        for link in self.links:
            link.dumps.clear()
            self.send(link.index, frame(OP_DUMP))
        async with asyncio.timeout(timeout_s):
            while any(not link.dumps for link in self.links):
                await self._dumped.wait()
                self._dumped.clear()
        return [link.dumps[0] for link in self.links]

    def stop(self) -> None:
        """Close the pipes (a shard ends when its input does) and reap the processes."""
        loop = self._loop
        for link in self.links:
            if loop is not None:
                loop.remove_reader(link.in_fd)
                if link.writing:
                    loop.remove_writer(link.out_fd)
            link.out.close()
            link.back.close()
        for link in self.links:
            link.process.join(5.0)
            if link.process.is_alive():
                link.process.kill()
                link.process.join(5.0)
        self.links.clear()
        if self._died is not None and not self._died.done():
            self._died.cancel()
        self._fail_asked("the ingest shards stopped")


# -- a shard's side ------------------------------------------------------------------


def shard_main(index: int, config: Config, specs: list[plugins.Spec], inbound: Connection,
               outbound: Connection, ingest_class: str) -> None:  # fmt: skip
    """A shard process: apply what the head sends, run the rank detectors, send back
    their findings and a report every ``REPORT_S``, until the head's pipe closes."""
    # The head ends its shards (it closes their pipes): a stop signal to the whole
    # group (systemd's, a terminal's ^C) is the head's to handle, not theirs.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    log.setup(level=config.log.level, format=config.log.format)
    log.bind(shard=index)
    module, _, name = ingest_class.partition(":")
    cls = getattr(__import__(module, fromlist=[name]), name)
    asyncio.run(_Shard(index, config, specs, inbound, outbound, cls).run())


class _Shard:
    def __init__(self, index: int, config: Config, specs: list[plugins.Spec], inbound: Connection,
                 outbound: Connection, ingest_class: type[Ingest]) -> None:  # fmt: skip
        self.index = index
        self.config = config
        self.clock: Clock = SystemClock()
        self.metrics = Metrics()
        ing = config.ingest
        self.view = ClusterView.of(config)
        self.bus = Bus()
        self.ingest = ingest_class(
            mqtt=config.mqtt, config=ing, view=self.view, bus=self.bus,
            metrics=self.metrics, clock=self.clock,
        )  # fmt: skip
        self.ingest.shard = (index, ing.shards)
        context = plugins.Context(view=self.view, clock=self.clock)
        self.runners = [
            plugins.Runner(s, context=context, bus=self.bus, metrics=self.metrics, emit=self.emit)
            for s in specs
        ]
        self.inbound, self.outbound = inbound, outbound  # kept: they close their pipes
        self.in_fd, self.out_fd = inbound.fileno(), outbound.fileno()
        self.inbox = bytearray()
        self.closed: asyncio.Future[None] | None = None
        self.sent = _Counts.of(self.metrics)
        self.forgotten = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._log = log.get("shard")

    def emit(self, event: events.Event, source: str) -> None:
        self._out(_Out("event", source=source, event=_ENCODER.encode(event)))

    def _out(self, out: _Out) -> None:
        data = memoryview(_pack(out))
        with contextlib.suppress(OSError):  # the head is gone: the input ends too
            while data:  # blocking: the head reads whenever its loop turns
                data = data[os.write(self.out_fd, data) :]

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self.closed = loop.create_future()
        os.set_blocking(self.in_fd, False)
        loop.add_reader(self.in_fd, self._readable)
        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(r.run(), name=f"plugin:{r.spec.name}") for r in self.runners]
            tasks.append(tg.create_task(self._report(), name="report"))
            tasks.append(tg.create_task(self._housekeeping(), name="housekeeping"))
            try:
                await self.closed
            finally:
                for task in tasks:
                    task.cancel()

    def _readable(self) -> None:
        try:
            data = os.read(self.in_fd, _READ_BYTES)
        except BlockingIOError:
            return
        if not data:
            assert self.closed is not None
            asyncio.get_running_loop().remove_reader(self.in_fd)
            if not self.closed.done():
                self.closed.set_result(None)
            return
        self.inbox += data
        ingest, fresh = self.ingest, self.ingest.freshness
        for op, retained, stamp, topic, payload in frames(self.inbox):
            if op == OP_MESSAGE:
                ingest.handle(topic, payload, retained=retained)
            elif op == OP_PROBE:
                fresh.answered(stamp, self.clock.now())
            elif op == OP_CONNECTED:
                fresh.connection(True, self.clock.now())
                self.view.restart_sequences()
            elif op == OP_DISCONNECTED:
                fresh.connection(False, self.clock.now())
            elif op == OP_LOST:
                fresh.lost(self.clock.now())
            elif op == OP_DROPPED:  # counted by the head: not a gap in the ranks' numbers
                # (nor is what the broker dropped for a rank just then: the view settles
                # anew all the same)
                fresh.lost(self.clock.now())
                self.view.restart_sequences()
            elif op == OP_FORGET_JOB:
                self.view.forget_job(topic)
                self.forgotten += 1
            elif op == OP_DUMP:
                self._out(_Out("dump", dump=ingest.dump()))
            elif op == OP_RANKS:  # in chunks, ingest going on between them
                self._tasks.add(task := asyncio.create_task(self._rows(int(stamp), topic)))
                task.add_done_callback(self._tasks.discard)

    async def _rows(self, number: int, job: str) -> None:
        """Job ``job``'s rank rows for the head's request ``number``, made in chunks with
        ingest going on between them; what went wrong, if anything, in their place."""
        try:
            rows: list[dict[str, Any]] = []
            found = self.view.jobs.get(job)
            if found is not None:
                for chunk in rank_rows(found, self.clock.now()):
                    rows += chunk
                    await asyncio.sleep(0)
            out = _Out("rows", source=str(number), dump=msgspec.json.encode(rows))
        except Exception as exc:  # a bug: said, not a request left waiting
            self._log.exception("rank rows not made", job=job)
            out = _Out("rows_failed", source=str(number), dump=repr(exc).encode())
        self._out(out)

    async def _report(self) -> None:
        while True:
            await asyncio.sleep(REPORT_S)
            self._out(_Out("report", report=self.report(self.clock.now())))

    async def _housekeeping(self) -> None:
        """Forget the jobs silent here as the head forgets its own (``Daemon.housekeep``)."""
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            self.view.forget_silent(self.clock.now(), self.config.ingest.forget_after_s)

    def report(self, now: float) -> _Report:
        m, sent = self.metrics, self.sent
        fresh = self.ingest.freshness
        lag = fresh.lag_s(now)
        counts = _Counts.of(m)
        report = _Report(
            rejected=_delta(counts.rejected, sent.rejected),
            steps=_delta(counts.steps, sent.steps),
            lost=_delta(counts.lost, sent.lost),
            latency=[a - b for a, b in zip(counts.latency, sent.latency, strict=True)],
            latency_sum=counts.latency_sum - sent.latency_sum,
            lag_s=lag if math.isfinite(lag) else -1.0,
            stale=fresh.state(now) != "current",
            ranks=self.view.total_ranks,
            total_steps=self.view.total_steps(),
            jobs={n: (j.last_seen, len(j.ranks), _front(j)) for n, j in self.view.jobs.items()},
            plugins={r.spec.name: r.up for r in self.runners},
            forgotten=self.forgotten,
        )
        self.sent = counts
        return report


def _front(job: JobView) -> int:
    """The job's front step: its ranks' last, at most."""
    cols = job.cols
    if cols is None or not job.ranks:
        return job.step
    return int(cols.last_step[cols.in_use()].max())


@dataclass
class _Counts:
    rejected: dict[str, int]
    steps: dict[str, int]
    lost: dict[str, int]
    latency: list[int]
    latency_sum: float

    @classmethod
    def of(cls, m: Metrics) -> _Counts:
        def values(tallies: dict[str, Any]) -> dict[str, int]:
            return {k: t.value for k, t in tallies.items()}

        return cls(values(m.rejected_by), values(m.steps_by),
                   values(m.lost_by), list(m.latency.counts), m.latency.sum)  # fmt: skip


def _delta(now: dict[str, int], then: dict[str, int]) -> dict[str, int]:
    return {k: v - then.get(k, 0) for k, v in now.items() if v != then.get(k, 0)}
