"""gpu_health: every table entry and every scripted fault, as pure function calls."""

from __future__ import annotations

from typing import Any

import pytest

from tmd import wire
from tmd.clock import SystemClock
from tmd.daemon import events
from tmd.daemon.plugins import Context
from tmd.daemon.view import ClusterView
from tmd.detectors.gpu_health import GpuHealthConfig, GpuHealthDetector
from tmd.errors import ConfigError

T0 = 1_800_000_000.0


def make(**cfg: Any) -> GpuHealthDetector:
    config = GpuHealthConfig(**cfg)
    config.validate()
    return GpuHealthDetector(config, context=Context(view=ClusterView(), clock=SystemClock()))


def xid(code: int, node: str = "n", gpu: int = 0) -> wire.XidEvent:
    return wire.XidEvent(ts=T0, node=node, gpu=gpu, xid=code)


def sample(node: str = "n", **fields: Any) -> wire.NodeGpu:
    return wire.NodeGpu(ts=T0, node=node, gpus=[wire.GpuSample(index=0, **fields)])


def kinds(found: Any) -> list[tuple[str, str]]:
    return [(type(e).__name__, e.cause) for e in found]


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (79, [("GpuFault", "xid 79")]),  # fell off the bus
        (48, [("GpuFault", "xid 48")]),
        (94, [("GpuFault", "xid 94")]),
        (140, [("GpuFault", "xid 140")]),
        (63, [("GpuDegraded", "xid 63")]),
        (13, []),
        (31, []),
        (43, []),
        (45, []),
        (68, []),
        (109, []),  # the application's fault
        (999, [("GpuDegraded", "xid 999")]),  # unknown: degraded by default
    ],
)
def test_xid_table(code: int, expected: list[tuple[str, str]]) -> None:
    assert kinds(make().observe(xid(code), T0)) == expected


def test_xid_table_is_configurable() -> None:
    det = make(fatal_xids=[79, 13], application_xids=[31], unknown_xid="ignore")
    assert kinds(det.observe(xid(13), T0)) == [("GpuFault", "xid 13")]
    assert kinds(det.observe(xid(999), T0)) == []
    with pytest.raises(ConfigError) as err:
        make(fatal_xids=[79], degraded_xids=[79])
    assert err.value.key == "detectors.gpu_health.degraded_xids"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"ecc_dbe_volatile": 1}, [("GpuFault", "volatile DBE")]),
        ({"remap_failure": True}, [("GpuFault", "row remap failure")]),
        ({"recovery_action": 2}, [("GpuFault", "recovery action")]),  # node reboot
        ({"recovery_action": 0}, []),
        ({"remap_pending": True}, [("GpuDegraded", "pending row remap")]),
        ({"retired_pages_pending": True}, [("GpuDegraded", "pending page retirement")]),
        ({"ecc_sbe_volatile": 12, "temp_c": 70.0}, []),  # correctable errors alone: fine
        ({}, []),  # nothing supported: nothing known
    ],
)
def test_sample_conditions(fields: dict[str, Any], expected: list[tuple[str, str]]) -> None:
    assert kinds(make().observe(sample(**fields), T0)) == expected


def test_a_fault_is_reported_once_until_the_node_comes_back() -> None:
    det = make()
    assert kinds(det.observe(xid(79), T0)) == [("GpuFault", "xid 79")]
    assert kinds(det.observe(xid(79), T0 + 1)) == []
    assert kinds(det.observe(xid(79, gpu=3), T0 + 1)) == [("GpuFault", "xid 79")]  # another GPU
    list(det.observe(wire.NodeStatus(ts=T0, node="n", state="offline"), T0 + 2))
    list(det.observe(wire.NodeStatus(ts=T0, node="n", state="online"), T0 + 60))
    assert kinds(det.observe(xid(79), T0 + 61)) == [("GpuFault", "xid 79")]


def test_sustained_thermal_throttling_but_not_a_blip_or_a_power_cap() -> None:
    det = make(throttle_window_s=60)
    out = []
    for t in range(0, 120):
        reasons = 0x40 if t >= 30 else (0x04 if t % 2 else 0)  # power cap is not a fault
        if t == 10:
            reasons = 0x20  # one-sample blip
        out += kinds(det.observe(sample(clock_event_reasons=reasons), T0 + t))
    assert out == [("GpuDegraded", "throttling")]


def test_nvlink_replay_burst_and_counter_reset() -> None:
    det = make(nvlink_replay_per_min=100, rate_window_s=60)
    out = []
    value = 1000
    for t in range(0, 60):
        value += 1 if t < 30 else 20  # 60/min, then 1200/min
        out += kinds(det.observe(sample(nvlink_replay=value), T0 + t))
    assert out == [("GpuDegraded", "nvlink replays")]
    reset = make()
    found = []
    for t, v in enumerate([5000, 5001, 3, 4, 5]):  # driver reload resets the counter
        found += kinds(reset.observe(sample(pcie_replay=v), T0 + t))
    assert found == []


def test_degraded_rearms_after_being_clear_for_a_while() -> None:
    det = make(rearm_after_s=100)
    assert kinds(det.observe(sample(remap_pending=True), T0)) == [
        ("GpuDegraded", "pending row remap")
    ]
    assert kinds(det.observe(sample(remap_pending=False), T0 + 50)) == []
    assert kinds(det.observe(sample(remap_pending=True), T0 + 60)) == []  # not yet re-armed
    assert kinds(det.observe(sample(remap_pending=False), T0 + 200)) == []
    assert kinds(det.observe(sample(remap_pending=True), T0 + 210)) == [
        ("GpuDegraded", "pending row remap")
    ]
    assert all(
        isinstance(e, events.GpuDegraded)
        for e in det.observe(sample(retired_pages_pending=True), T0 + 211)
    )


def test_nodes_the_view_let_go_of_are_forgotten() -> None:
    """Publishers choose node names: what the detector keeps per node goes with the
    view's node (evicted past ingest.max_nodes, or silent past forget_after_s)."""
    d = make()
    view = d.context.view
    now = 1_800_000_000.0
    for node in ("kept", "gone"):
        view.apply_gpu(sample(node), now)
        list(d.observe(sample(node), now))
    view.nodes.pop("gone")
    list(d.tick(now + 1))
    assert set(d._nodes) == {"kept"}


def test_one_throttle_window_per_machine_judges_each_gpu_as_its_own_window_would() -> None:
    """The window is kept per machine, a sample each (``_Node``), and read per GPU only
    where one was throttled: on random samples of GPUs 0, 1 and 5 (throttled in runs,
    some samples without a GPU or without its reasons, uneven intervals) it finds the
    GPUs a window of each GPU's own samples finds."""
    import random
    from collections import deque

    from tmd.detectors.gpu_health import _Node

    det = make(throttle_window_s=20, throttle_fraction=0.5)
    node = _Node()
    rng = random.Random(7)
    own: dict[int, deque[tuple[float, bool]]] = {i: deque() for i in (0, 1, 5)}
    rate = {0: 0.0, 1: 0.0, 5: 0.0}
    t, agreed, throttled = T0, 0, 0
    for _ in range(3000):
        t += rng.choice([0.5, 1.0, 1.0, 2.0, 7.0])
        gpus = []
        expected = 0
        for i in own:
            if rng.random() < 0.02:
                rate[i] = rng.choice([0.0, 0.0, 0.3, 0.7, 1.0])  # a new run of throttling
            if rng.random() < 0.05:
                continue  # not in this sample
            reasons = None if rng.random() < 0.05 else (0x40 if rng.random() < rate[i] else 0)
            gpus.append(wire.GpuSample(index=i, clock_event_reasons=reasons))
            if reasons is None:
                continue
            window = own[i]  # the GPU's own samples of the last 20 s
            window.append((t, bool(reasons)))
            while window[0][0] < t - 20:
                window.popleft()
            hot = sum(h for _, h in window)
            full = window[-1][0] - window[0][0] >= 0.8 * 20
            expected |= (full and hot >= 0.5 * len(window)) << i
        node.place([g.index for g in gpus])  # as a full sample places them
        got = det._throttled(node, [g.clock_event_reasons for g in gpus], t)
        agreed += got == expected
        throttled += expected != 0
    assert agreed == 3000 and throttled > 100


def test_a_machine_throttled_for_long_costs_per_gpu_not_per_sample_of_its_window() -> None:
    """Every GPU of a machine throttled for 10 minutes, a sample a second: found once
    each, and each sample reads its window's counts, not the window (the counts stay
    equal to what the window holds)."""
    det = make(throttle_window_s=60)
    found: list[tuple[str, str]] = []
    for t in range(600):
        gpus = [wire.GpuSample(index=i, clock_event_reasons=0x40) for i in range(8)]
        found += kinds(det.observe(wire.NodeGpu(ts=T0, node="n", gpus=gpus), T0 + t))
    assert found == [("GpuDegraded", "throttling")] * 8
    node = det._nodes["n"]
    assert len(node.window) == 61 and node.reads == node.hot == {i: 61 for i in range(8)}
    for t in range(600, 662):  # cool again: the counts go once the window holds no throttle
        list(det.observe(sample(clock_event_reasons=0), T0 + t))
    assert node.reads is None and node.hot_samples == 0


def test_a_clock_stepped_back_starts_the_throttle_window_over() -> None:
    det = make(throttle_window_s=20)
    for t in range(10, 30):
        list(det.observe(sample(clock_event_reasons=0x40), T0 + t))
    list(det.observe(sample(clock_event_reasons=0x40), T0 + 5))  # the wall clock stepped back
    assert len(det._nodes["n"].window) == 1


def test_gpus_are_not_forgotten_within_their_windows() -> None:
    with pytest.raises(ConfigError) as err:
        make(forget_after_s=30, throttle_window_s=60)
    assert err.value.key == "detectors.gpu_health.forget_after_s"


def _random_samples(seed: int, n: int) -> list[tuple[float, wire.NodeGpu]]:
    """A machine of 4 GPUs over ``n`` samples with every condition gpu_health judges
    coming and going: throttling (and the power cap, not judged), replay counters that
    rise in bursts, pending flags, a volatile DBE, a recovery action, uneven intervals,
    a GPU whose reasons could not be read, and one that falls off the bus and back."""
    import random

    rng = random.Random(seed)
    t = T0
    state = [dict(nvlink_replay=0, pcie_replay=0, remap_pending=False, ecc_dbe_volatile=0,
                  retired_pages_pending=False, recovery_action=0) for _ in range(4)]  # fmt: skip
    hot = [0.0] * 4
    gone: int | None = None
    out: list[tuple[float, wire.NodeGpu]] = []
    for _ in range(n):
        t += rng.choice([0.5, 1.0, 1.0, 1.0, 3.0])
        for i, s in enumerate(state):
            if rng.random() < 0.01:
                hot[i] = rng.choice([0.0, 0.0, 0.6, 1.0])
            if rng.random() < 0.02:
                s["nvlink_replay"] += rng.choice([1, 50, 5000])
            if rng.random() < 0.005:
                s["remap_pending"] = not s["remap_pending"]
            if rng.random() < 0.003:
                s["retired_pages_pending"] = not s["retired_pages_pending"]
            if rng.random() < 0.001:
                s["ecc_dbe_volatile"] += 1
            if rng.random() < 0.001:
                s["recovery_action"] = rng.choice([0, 1])
        if rng.random() < 0.01:
            gone = rng.choice([None, None, 3])  # GPU 3 fell off the bus, or came back
        gpus = [
            wire.GpuSample(
                index=i, temp_c=rng.uniform(40, 80), power_w=rng.uniform(300, 700),
                clock_event_reasons=None if rng.random() < 0.01
                else (0x40 if rng.random() < hot[i] else 0) | (0x4 if rng.random() < 0.3 else 0),
                **state[i],
            )
            for i in range(4)
            if i != gone
        ]  # fmt: skip
        out.append((t, wire.NodeGpu(ts=t, node="n", gpus=gpus)))
    return out


@pytest.mark.parametrize(("seed", "every_s"), [(1, 10.0), (2, 10.0), (3, 3600.0)])
def test_brief_samples_find_what_full_samples_find(seed: int, every_s: float) -> None:
    """The same machine's samples as an agent sends them, brief between full ones
    (``wire.BriefSamples``), make exactly the findings, at the same times, that the
    same samples all in full make; each with its re-arming, as the ticks go."""
    samples = _random_samples(seed, 1500)
    full, brief = (make(rearm_after_s=20, forget_after_s=120) for _ in range(2))
    shaper = wire.BriefSamples(every_s)
    found: dict[str, list[tuple[float, str, int, str]]] = {"full": [], "brief": []}
    forms = set()
    for k, (t, s) in enumerate(samples):
        shaped = shaper.shape(s, t)
        forms.add(shaped.brief)
        for name, det, message in (("full", full, s), ("brief", brief, shaped)):
            det.context.view.apply_gpu(message, t)  # else a tick forgets the machine
            for e in det.observe(message, t):
                found[name].append((t, type(e).__name__, e.gpu, e.cause))
            if k % 30 == 0:
                list(det.tick(t))
            if k % 400 == 399:  # serviced: offline, then back with its first samples
                for state in ("offline", "online"):
                    status = wire.NodeStatus(ts=t, node="n", state=state)  # type: ignore[arg-type]
                    list(det.observe(status, t))
        if k % 400 == 399:
            shaper.reset()  # the agent restarted: in full first
    assert forms == {True, False}
    kinds_found = {(kind, cause) for _, kind, _, cause in found["full"]}
    assert {"throttling", "nvlink replays", "pending row remap", "volatile DBE"} <= {
        cause for _, cause in kinds_found
    }
    assert found["brief"] == found["full"]


def test_a_brief_sample_whose_full_one_never_came_judges_nothing() -> None:
    det = make()
    shaper = wire.BriefSamples(10.0, repeat=0)
    hot = sample(clock_event_reasons=0x40, ecc_dbe_volatile=2)
    lost = shaper.shape(hot, T0)  # full: lost on the way
    assert not lost.brief
    assert list(det.observe(shaper.shape(hot, T0 + 1), T0 + 1)) == []  # nothing to repeat
    shaper.reset()
    found = det.observe(shaper.shape(hot, T0 + 2), T0 + 2)  # the next full one
    assert kinds(found) == [("GpuFault", "volatile DBE")]


def test_gpus_seen_only_in_brief_samples_are_not_forgotten() -> None:
    det = make(forget_after_s=120)
    view = det.context.view
    shaper = wire.BriefSamples(3600.0)
    for t in range(0, 400, 10):
        message = shaper.shape(sample(clock_event_reasons=0), T0 + t)
        view.apply_gpu(message, T0 + t)
        list(det.observe(message, T0 + t))
        list(det.tick(T0 + t))
    assert message.brief and list(det._nodes["n"].gpus) == [0]


def test_a_fault_repeated_in_brief_samples_is_not_found_again() -> None:
    """A GPU's volatile DBE count stays in every brief sample as in its full one: its
    finding stays made (not forgotten and made again at the next full sample)."""
    det = make(forget_after_s=120)
    shaper = wire.BriefSamples(3600.0)
    found = []
    for t in range(0, 400):
        message = shaper.shape(sample(ecc_dbe_volatile=1, nvlink_replay=t // 300), T0 + t)
        det.context.view.apply_gpu(message, T0 + t)
        found += [(t, e.cause) for e in det.observe(message, T0 + t)]
        if t % 30 == 0:
            list(det.tick(T0 + t))
    assert found == [(0, "volatile DBE")]


def test_a_calm_machine_that_starts_throttling_is_found_from_brief_samples_as_soon() -> None:
    """The usual machine's brief samples go through the throttle window too: one that
    starts throttling is found at the same sample whichever way its samples come."""
    found = {}
    for brief in (False, True):
        det = make(throttle_window_s=30)
        shaper = wire.BriefSamples(10.0 if brief else 0.0)
        for t in range(200):
            message = shaper.shape(sample(clock_event_reasons=0x40 if t >= 100 else 0), T0 + t)
            assert message.brief == (brief and t not in (0, 1, 2) and (t - 2) % 10 != 0)
            det.context.view.apply_gpu(message, T0 + t)
            if kinds(det.observe(message, T0 + t)):
                found[brief] = t
                break
    assert found == {False: 115, True: 115}
