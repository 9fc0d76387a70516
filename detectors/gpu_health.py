"""``gpu_health``: classify NVML signals into ``GpuFault`` (replace the machine) and
``GpuDegraded`` (it still works but is getting worse).

The tables follow the tools operators already trust. Fatal: the XIDs that DCGM's
health watches treat as needing a reset or replacement (48 DBE, 61/62 internal
micro-controller halt, 64 row-remap failure, 74 NVLink, 79 fell off the bus, 94/95
contained/uncontained ECC, 119/120 GSP, 140 unrecovered ECC), a volatile double-bit ECC
count, a row-remap failure, and any driver recovery action other than none. Degraded:
XIDs 63 and 92 (remap/retirement events, high single-bit rate), pending row remap or
page retirement, throttling for thermal or hardware reasons in most samples of a
window, and NVLink or PCIe replay counters rising faster than a rate. Application
XIDs (13, 31, 43, 45, 68, 109, as in the Kubernetes device plugin) are the program's
fault, not the GPU's: the view records them, no finding is made. Every table is
configurable.

A finding is made once per (node, GPU, cause). Faults stay until the node comes back
online (serviced or rebooted); a degraded condition re-arms once it has been clear for
``rearm_after_s``.

A brief sample (``wire.BriefSamples``: each GPU's clock event reasons, its counters and
flags as in the node's last full one) is judged as that full one with these reasons
would be; one whose full sample never came here judges nothing until the next.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import msgspec

from tmd import wire
from tmd.daemon import events
from tmd.detectors.base import Detector
from tmd.errors import ConfigError
from tmd.plugins import Context

# nvmlClocksEventReasons: HW slowdown, SW thermal, HW thermal, HW power brake. The SW
# power cap (0x4) is left out: a GPU at its power limit under full load is normal.
DEFAULT_THROTTLE_MASK = 0x08 | 0x20 | 0x40 | 0x80
RECOVERY_ACTION_NONE = 0


@dataclass(frozen=True, kw_only=True)
class GpuHealthConfig:
    fatal_xids: list[int] = field(
        default_factory=lambda: [48, 61, 62, 64, 74, 79, 94, 95, 119, 120, 140]
    )
    degraded_xids: list[int] = field(default_factory=lambda: [63, 92])
    application_xids: list[int] = field(default_factory=lambda: [13, 31, 43, 45, 68, 109])
    unknown_xid: Literal["fatal", "degraded", "ignore"] = "degraded"
    throttle_mask: int = DEFAULT_THROTTLE_MASK
    throttle_window_s: float = 60.0
    throttle_fraction: float = 0.5
    nvlink_replay_per_min: float = 100.0
    pcie_replay_per_min: float = 100.0
    rate_window_s: float = 60.0
    rearm_after_s: float = 300.0
    forget_after_s: float = 3600.0

    def validate(self) -> None:
        key = "detectors.gpu_health."
        tables = {
            "fatal_xids": self.fatal_xids,
            "degraded_xids": self.degraded_xids,
            "application_xids": self.application_xids,
        }
        seen: dict[int, str] = {}
        for name, table in tables.items():
            for code in table:
                if code < 0:
                    raise ConfigError(key + name, f"XID {code} is negative")
                if code in seen:
                    raise ConfigError(key + name, f"XID {code} is also in {seen[code]}")
                seen[code] = name
        for name in ("throttle_window_s", "rate_window_s", "rearm_after_s", "forget_after_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(key + name, "must be > 0")
        if not 0 < self.throttle_fraction <= 1:
            raise ConfigError(key + "throttle_fraction", "must be in (0, 1]")
        for name in ("throttle_window_s", "rate_window_s"):
            if self.forget_after_s < getattr(self, name):
                raise ConfigError(
                    key + "forget_after_s", f"must be >= {name}: a GPU is judged on its window"
                )


class _Gpu:
    """One GPU as the samples showed it. A plain class with slots: a cluster's first
    samples make one per GPU (131,072 of them at once), and a dataclass with factory
    defaults cost several times more to make."""

    __slots__ = ("counters", "degraded", "last_seen", "nvlink", "nvlink_at", "pcie", "pcie_at")

    def __init__(self, nvlink: int | None, pcie: int | None, now: float) -> None:
        """Its first sample's replay counters, read at ``now`` (None: not read)."""
        self.last_seen = 0.0
        # Causes reported and not yet re-armed; None: none ever (the usual GPU: neither
        # this nor ``counters`` is made for it, each one object fewer for the collector).
        self.degraded: set[str] | None = None
        # Each replay counter's changes in the rate window (``_rising``), from its
        # second value on: the usual GPU's counters never move, and need none.
        self.counters: dict[str, deque[tuple[float, int]]] | None = None
        # The last value of each replay counter: the usual sample repeats it. And when
        # it was first read, where a rise is measured from until it has changed (a
        # counter first read later is ``_rising``'s to stamp).
        self.nvlink = nvlink
        self.pcie = pcie
        self.nvlink_at = self.pcie_at = now


class _Node:
    """A machine's GPUs, and one throttle window for all of them: a sample each
    ``(when, the GPUs throttled, the GPUs read)``, as bit masks by GPU index, so the
    usual sample (none throttled) costs one entry, not one per GPU. While one of its
    samples has a GPU throttled, ``reads`` and ``hot`` count each GPU's samples in the
    window and its throttled ones (by index); None while none has. A plain class with
    slots, as ``_Gpu``: a cluster's first samples make one per machine at once."""

    __slots__ = ("briefed", "busy", "gpus", "hot", "hot_samples", "indexes", "last",
                 "read_all", "reads", "window")  # fmt: skip

    def __init__(self) -> None:
        self.gpus: dict[int, _Gpu] = {}
        self.window: deque[tuple[float, int, int]] = deque()
        self.hot_samples = 0  # samples in ``window`` with a GPU throttled
        self.reads: dict[int, int] | None = None
        self.hot: dict[int, int] | None = None
        # The last full sample (brief ones repeat it), its GPUs' indexes and their bit
        # mask (-1: not yet worked out), and when a brief one last came.
        self.last: wire.NodeGpu | None = None
        self.indexes: list[int] = []
        self.read_all = -1
        self.briefed = -math.inf
        # Whether a GPU of the last sample judged (``_judge``) was not the usual one:
        # something fatal or pending, a cause reported or to re-arm, a counter rising
        # (while False, no GPU is degraded, and a brief repeat would raise nothing).
        self.busy = False

    def place(self, indexes: list[int]) -> None:
        """The GPUs of a full sample, by index, in its order (brief ones follow it)."""
        if indexes != self.indexes:
            self.indexes, self.read_all = indexes, -1

    def add(self, now: float, hot: int, read: int) -> None:
        """A sample into the window (none where no GPU was read), and into the counts
        while there are any; the first throttled one counts what the window holds."""
        window = self.window
        if window and now < window[-1][0]:
            self.clear()  # the clock stepped back: the window starts over
        if not read:
            return
        window.append((now, hot, read))
        if hot:
            self.hot_samples += 1
            if self.reads is None:
                self.reads, self.hot = {}, {}
                for _, h, r in window:
                    self._count(h, r, 1)
                return
        if self.reads is not None:
            self._count(hot, read, 1)

    def prune(self, horizon: float) -> None:
        """The samples before ``horizon`` out of the window and the counts, and the
        counts gone with the last throttled sample (the usual node again)."""
        window = self.window
        while window and window[0][0] < horizon:
            _, h, r = window.popleft()
            if self.reads is not None:
                self._count(h, r, -1)
            if h:
                self.hot_samples -= 1
                if not self.hot_samples:
                    self.reads = self.hot = None

    def clear(self) -> None:
        self.window.clear()
        self.hot_samples = 0
        self.reads = self.hot = None

    def _count(self, hot: int, read: int, by: int) -> None:
        """Add ``by`` to the counts of the GPUs in ``read``, and of those in ``hot``."""
        reads, counts = self.reads, self.hot
        assert reads is not None and counts is not None
        while read:  # as ``_bits``, inline: a sample of a throttled machine does this twice
            low = read & -read
            index = low.bit_length() - 1
            reads[index] = reads.get(index, 0) + by
            read ^= low
        while hot:
            low = hot & -hot
            index = low.bit_length() - 1
            counts[index] = counts.get(index, 0) + by
            hot ^= low


class GpuHealthDetector(Detector):
    name = "gpu_health"
    Config = GpuHealthConfig
    consumes = (wire.NodeGpu, wire.XidEvent, wire.NodeStatus)
    tick_interval = timedelta(seconds=30)
    config: GpuHealthConfig

    def __init__(self, config: GpuHealthConfig, *, context: Context) -> None:
        super().__init__(config, context=context)
        self._fatal = frozenset(config.fatal_xids)
        self._degraded = frozenset(config.degraded_xids)
        self._application = frozenset(config.application_xids)
        self._nodes: dict[str, _Node] = {}
        self._reported: dict[tuple[str, int, str], float] = {}  # -> when, for degraded: last true
        self._offline: set[str] = set()

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        if isinstance(event, wire.XidEvent):
            return self._xid(event, now)
        if isinstance(event, wire.NodeStatus):
            return self._status(event)
        return self._sample(event, now)

    def tick(self, now: float) -> Iterable[events.Event]:
        horizon = now - self.config.forget_after_s
        for key in [k for k, t in self._reported.items() if t < horizon]:
            del self._reported[key]
        # Nodes the view let go of (silent past ingest.forget_after_s, or evicted past
        # ingest.max_nodes) are forgotten here too: publishers choose node names.
        nodes = self.context.view.nodes
        self._offline = {n for n in self._offline if n in nodes}
        for name in list(self._nodes):
            node = self._nodes[name]
            gpus = node.gpus
            briefed = node.indexes if node.briefed >= horizon else ()  # seen in brief
            for index in [i for i, g in gpus.items() if g.last_seen < horizon and i not in briefed]:
                del gpus[index]
            if not gpus or name not in nodes:
                del self._nodes[name]
        return ()

    # -- XID events ----------------------------------------------------------------

    def classify_xid(self, xid: int) -> Literal["fatal", "degraded", "ignore"]:
        if xid in self._fatal:
            return "fatal"
        if xid in self._degraded:
            return "degraded"
        if xid in self._application:
            return "ignore"
        return self.config.unknown_xid

    def _xid(self, e: wire.XidEvent, now: float) -> Iterator[events.Event]:
        verdict = self.classify_xid(e.xid)
        if verdict == "ignore":
            return
        cause = f"xid {e.xid}"
        detail = e.detail or f"XID {e.xid} on GPU {e.gpu}"
        yield from self._report(verdict == "fatal", e.node, e.gpu, cause, detail, now)

    # -- samples -------------------------------------------------------------------

    def _sample(self, sample: wire.NodeGpu, now: float) -> Iterable[events.Event]:
        name = sample.node
        node = self._nodes.get(name)
        if node is None:
            node = self._nodes[name] = _Node()
        reasons = sample.reasons
        if reasons is not None:
            base = node.last
            if base is None or not sample.repeats(base):
                return ()  # its full sample never came here
            throttled = self._throttled(node, reasons, now)
            if not (throttled or node.busy):
                node.briefed = now  # its GPUs seen (``tick``)
                return ()  # the usual machine: every GPU would ``continue`` in ``_judge``
            return self._brief(name, node, base, reasons, throttled, now)
        node.last = sample
        node.place([g.index for g in sample.gpus])
        throttled = self._throttled(node, [g.clock_event_reasons for g in sample.gpus], now)
        # Judged now, not as the caller iterates: ``node.busy`` is read by the next
        # brief sample, whoever consumed this one's findings and how far.
        return self._judge(name, node, sample.gpus, throttled, now)

    def _brief(
        self,
        name: str,
        node: _Node,
        base: wire.NodeGpu,
        reasons: list[int | None],
        throttled: int,
        now: float,
    ) -> list[events.Event]:
        """A brief sample of a machine that is not the usual one: the full one
        ``base``'s GPUs, each with its clock event reasons now, judged as ``base``
        with these reasons would be."""
        replace = msgspec.structs.replace
        again = [replace(g, clock_event_reasons=r) for g, r in zip(base.gpus, reasons, strict=True)]
        return self._judge(name, node, again, throttled, now)

    def _judge(
        self, name: str, node: _Node, samples: list[wire.GpuSample], throttled: int, now: float
    ) -> list[events.Event]:
        """Each GPU of a sample of machine ``name``, judged now (``node.busy`` is read
        by the next brief sample); ``throttled``: those throttled for most of the
        window, as a bit mask by index."""
        cfg = self.config
        gpus = node.gpus
        found: list[events.Event] = []
        report = self._report
        busy = False
        for g in samples:
            index = g.index
            gpu = gpus.get(index)
            if gpu is None:
                gpu = gpus[index] = _Gpu(g.nvlink_replay, g.pcie_replay, now)
            gpu.last_seen = now
            # Fatal, found again in each sample: a brief repeat must say it again (busy).
            if g.ecc_dbe_volatile:
                busy = True
                detail = f"{g.ecc_dbe_volatile} double-bit ECC errors"
                found += report(True, name, index, "volatile DBE", detail, now)
            if g.remap_failure:
                busy = True
                detail = "the GPU ran out of spare rows"
                found += report(True, name, index, "row remap failure", detail, now)
            if g.recovery_action not in (None, RECOVERY_ACTION_NONE):
                busy = True
                detail = f"driver asks for recovery action {g.recovery_action}"
                found += report(True, name, index, "recovery action", detail, now)
            # A counter that did not move is not rising (``_rising``): the usual sample.
            nvlink = pcie = False
            value = g.nvlink_replay
            if value is not None and value != gpu.nvlink:
                nvlink = self._rising(gpu, "nvlink", value, now, cfg.nvlink_replay_per_min)
            value = g.pcie_replay
            if value is not None and value != gpu.pcie:
                pcie = self._rising(gpu, "pcie", value, now, cfg.pcie_replay_per_min)
            throttling = bool(throttled >> index & 1)
            pending_remap, pending_retire = bool(g.remap_pending), bool(g.retired_pages_pending)
            if not (
                gpu.degraded or pending_remap or pending_retire or throttling or nvlink or pcie
            ):
                continue  # the common case: a healthy GPU with nothing to re-arm
            busy = True
            conditions = {
                "pending row remap": pending_remap,
                "pending page retirement": pending_retire,
                "throttling": throttling,
                "nvlink replays": nvlink,
                "pcie replays": pcie,
            }
            for cause, bad in conditions.items():
                key = (name, index, cause)
                if bad:
                    if gpu.degraded is None:
                        gpu.degraded = set()
                    gpu.degraded.add(cause)
                    found += report(False, name, index, cause, _detail(cause, g), now)
                elif gpu.degraded and cause in gpu.degraded and self._rearmed(key, now):
                    gpu.degraded.discard(cause)
        node.busy = busy
        return found

    def _throttled(self, node: _Node, reasons: list[int | None], now: float) -> int:
        """The GPUs of this sample (``reasons``: their clock event reasons, in the
        order of ``node.indexes``) throttled for most samples of a window that is
        (nearly) full, as a bit mask by index. A GPU that could not read its clock event
        reasons is neither throttled nor counted. O(1) a sample while none of the
        window's samples has a GPU throttled; O(GPUs) while one has."""
        cfg = self.config
        if reasons.count(0) == len(reasons):  # the usual sample: each read, none set
            hot, read = 0, node.read_all
            if read < 0:
                read = node.read_all = sum(1 << i for i in node.indexes)
        else:
            mask = cfg.throttle_mask
            hot = read = 0
            for index, r in zip(node.indexes, reasons, strict=True):
                if r is not None:
                    read |= 1 << index
                    if r & mask:
                        hot |= 1 << index
        node.add(now, hot, read)
        node.prune(now - cfg.throttle_window_s)
        if node.reads is None or node.hot is None:
            return 0  # the usual node: not one sample of the window throttled
        reads, counts = node.reads, node.hot
        span = 0.8 * cfg.throttle_window_s  # of a window (nearly) full
        window = node.window
        oldest, _, oldest_read = window[0]
        out = 0
        for index in _bits(read & _mask(counts)):
            if counts[index] < cfg.throttle_fraction * reads[index]:
                continue
            bit = 1 << index
            # "Sustained": most samples of a window that is (nearly) full, from the
            # GPU's first sample in it (the window's first, unless not read then).
            first = oldest if oldest_read & bit else next(t for t, _, r in window if r & bit)
            if now - first >= span:
                out |= bit
        return out

    def _rising(self, gpu: _Gpu, name: str, value: int, now: float, per_min: float) -> bool:
        """Whether replay counter ``name`` (``nvlink`` or ``pcie``) of ``gpu``, read now
        at ``value``, another than its last, rises faster than ``per_min`` over the rate
        window. Its first reading is where a rise is measured from: its history starts
        at its first change, with that reading."""
        last = getattr(gpu, name)
        setattr(gpu, name, value)
        if last is None:
            setattr(gpu, name + "_at", now)
            return False
        if gpu.counters is None:
            gpu.counters = {}
        history = gpu.counters.get(name)
        if history is None:
            history = gpu.counters[name] = deque([(getattr(gpu, name + "_at"), last)])
        if history and value == history[-1][1]:
            return False  # not rising now; the next rise is measured from the last change
        if history and value < history[-1][1]:
            history.clear()  # the counter was reset (driver reload)
        history.append((now, value))
        while len(history) > 1 and history[0][0] < now - self.config.rate_window_s:
            history.popleft()
        elapsed = history[-1][0] - history[0][0]
        if elapsed <= 0:
            return False
        return (history[-1][1] - history[0][1]) / elapsed * 60 > per_min

    # -- reporting -----------------------------------------------------------------

    def _report(
        self, fatal: bool, node: str, gpu: int, cause: str, detail: str, now: float
    ) -> Iterator[events.Event]:
        key = (node, gpu, cause)
        first = key not in self._reported
        self._reported[key] = now
        if not first:
            return
        kind = events.GpuFault if fatal else events.GpuDegraded
        yield kind(ts=now, node=node, gpu=gpu, cause=cause, detail=detail)

    def _rearmed(self, key: tuple[str, int, str], now: float) -> bool:
        last_true = self._reported.get(key)
        if last_true is None:
            return True
        if now - last_true >= self.config.rearm_after_s:
            del self._reported[key]
            return True
        return False

    def _status(self, status: wire.NodeStatus) -> Iterator[events.Event]:
        if status.state == "offline":
            self._offline.add(status.node)
        elif status.node in self._offline:
            # Back after being offline: serviced or rebooted, its faults start over.
            self._offline.discard(status.node)
            for key in [k for k in self._reported if k[0] == status.node]:
                del self._reported[key]
            self._nodes.pop(status.node, None)
        return iter(())


def _mask(counts: dict[int, int]) -> int:
    """The GPUs with a count, as a bit mask by index."""
    out = 0
    for index, n in counts.items():
        if n:
            out |= 1 << index
    return out


def _bits(mask: int) -> Iterator[int]:
    """The indices of the bits set in ``mask``, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _detail(cause: str, g: wire.GpuSample) -> str:
    if cause == "throttling":
        return f"clock event reasons {g.clock_event_reasons:#x} in most recent samples"
    if cause == "nvlink replays":
        return f"NVLink replay counter at {g.nvlink_replay}"
    if cause == "pcie replays":
        return f"PCIe replay counter at {g.pcie_replay}"
    return cause
