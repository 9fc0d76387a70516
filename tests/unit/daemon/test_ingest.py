"""Ingest edge without a broker: topic classification and the handler's verdicts."""

from __future__ import annotations

import json
import time
from typing import Any

import aiomqtt
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fakes.clock import FakeClock
from tmd import config, wire
from tmd.daemon.bus import Bus
from tmd.daemon.ingest import Ingest, classify
from tmd.daemon.metrics import Metrics
from tmd.daemon.view import DOUBT_S, ClusterView
from tmd.errors import ProtocolError, PublishError


@pytest.mark.parametrize(
    ("topic", "expected"),
    [
        ("tmd/v1/node/n-1/status", ("node_status", "n-1", None)),
        ("tmd/v1/node/n-1/gpu", ("gpu", "n-1", None)),
        ("tmd/v1/node/n-1/xid", ("xid", "n-1", None)),
        ("tmd/v1/node/n-1/iter", ("node_iter", "n-1", None)),
        ("tmd/v1/job/j/rank/0/iter", ("iter", "j", 0)),
        ("tmd/v1/job/j/rank/4095/iter", ("iter", "j", 4095)),
        ("tmd/v1/job/j/status", ("job_status", "j", None)),
        ("tmd/v1/job/j/ack", ("ack", "j", None)),
    ],
)
def test_classify(topic: str, expected: tuple[str, str, int | None]) -> None:
    assert classify(topic) == expected


@pytest.mark.parametrize(
    "topic",
    [
        "tmd/v2/node/n/gpu",
        "tmd/v1/node/n/temp",
        "tmd/v1/job/j/ctl",
        "tmd/v1/job/j/rank/-1/iter",
        "tmd/v1/job/j/rank/01/iter",
        "tmd/v1/job/j/rank/123456789/iter",
        "tmd/v1/job/j/rank/1/x",
        "other/topic",
        "",
        "tmd/v1",
    ],
)
def test_classify_rejects(topic: str) -> None:
    with pytest.raises(ProtocolError) as err:
        classify(topic)
    assert err.value.reason == "topic"


def make_ingest(**ingest: object) -> tuple[Ingest, ClusterView, Metrics, Bus]:
    view, metrics, bus = ClusterView(), Metrics(), Bus()
    cfg = config.from_dict({"ingest": ingest})
    return (
        Ingest(
            mqtt=cfg.mqtt,
            config=cfg.ingest,
            view=view,
            bus=bus,
            metrics=metrics,
            clock=FakeClock(time.time()),
        ),
        view,
        metrics,
        bus,
    )


def test_handler_applies_publishes_and_counts() -> None:
    ingest, view, metrics, bus = make_ingest()
    seen = bus.subscribe("t", (wire.IterBatch,))
    t = time.time()
    batch = wire.IterBatch(
        ts=t, job="j", rank=2, node="n", steps=[wire.StepTiming(1, t, 1, 1, 0, 0, 0)]
    )
    ingest.handle(wire.iter_topic("j", 2), wire.encode(batch))
    ingest.handle(wire.iter_topic("j", 2), wire.encode(batch))  # a duplicate delivery
    assert view.jobs["j"].ranks[2].total_steps == 1
    assert len(seen) == 2
    sample = metrics.registry.get_sample_value
    assert sample("tmd_rank_steps_total", {"outcome": "accepted"}) == 1
    assert sample("tmd_rank_steps_total", {"outcome": "duplicate"}) == 1
    assert sample("tmd_messages_received_total", {"kind": "iter"}) == 2


def test_a_machine_s_relayed_batches_count_as_if_each_rank_had_published_them() -> None:
    """``NodeIter`` (issue 16): each rank's batch and the agent's sample applied and
    passed on as their own messages; a batch the view refuses costs only itself; a
    message whose columns do not line up is refused whole."""
    ingest, view, metrics, bus = make_ingest()
    seen = bus.subscribe("t", (wire.IterBatch, wire.NodeGpu))
    t = time.time()
    members = [wire.Member(0, "n0", 0), wire.Member(1, "n0", 1)]
    status = wire.JobStatus(ts=t, job="j", generation=0, world_size=2, members=members)
    ingest.handle(wire.job_topic("j", "status"), wire.encode(status))

    def batch(rank: int, node: str = "n0") -> wire.IterBatch:
        step = wire.StepTiming(5, t, 1, 1, 0, 0, 0)
        return wire.IterBatch(ts=t, job="j", rank=rank, node=node, steps=[step])

    relayed = wire.NodeIter(ts=t, node="n0", jobs=wire.RelayedBatches.of([batch(0), batch(9),
                            batch(1)]), gpu=wire.NodeGpu(ts=t, node="n0"))  # fmt: skip
    ingest.handle(wire.node_topic("n0", "iter"), wire.encode(relayed))
    assert sorted(view.jobs["j"].ranks) == [0, 1] and view.nodes["n0"].sample is not None
    assert [type(m).__name__ for m in seen._queue] == ["NodeGpu", "IterBatch", "IterBatch"]
    sample = metrics.registry.get_sample_value
    assert sample("tmd_messages_received_total", {"kind": "node_iter"}) == 1
    assert sample("tmd_rank_steps_total", {"outcome": "accepted"}) == 2
    assert sample("tmd_messages_rejected_total", {"reason": "rank"}) == 1  # rank 9 of 2
    # Two batches, one step too few in the step columns: nothing of it applied.
    (columns,) = wire.RelayedBatches.of([batch(0), batch(1)])
    short = msgspec.structs.replace(columns, step=[6])
    ingest.handle(wire.node_topic("n0", "iter"),
                  wire.encode(wire.NodeIter(ts=t, node="n0", jobs=[short])))  # fmt: skip
    assert sample("tmd_messages_rejected_total", {"reason": "schema"}) == 1
    assert sample("tmd_rank_steps_total", {"outcome": "accepted"}) == 2
    # A sample with GPU 0 twice: refused whole, on its own topic and relayed.
    twice = wire.NodeGpu(ts=t, node="n0", gpus=[wire.GpuSample(index=0)] * 2)
    ingest.handle(wire.node_topic("n0", "gpu"), wire.encode(twice))
    ingest.handle(wire.node_topic("n0", "iter"), wire.encode(msgspec.structs.replace(
        relayed, jobs=wire.RelayedBatches.of([batch(0)]), gpu=twice)))  # fmt: skip
    assert sample("tmd_messages_rejected_total", {"reason": "schema"}) == 3
    assert sample("tmd_rank_steps_total", {"outcome": "accepted"}) == 2
    # n1's agent speaking for rank 1, which the job's status places on n0.
    elsewhere = wire.NodeIter(ts=t, node="n1", jobs=wire.RelayedBatches.of([batch(1, "n1")]))
    ingest.handle(wire.node_topic("n1", "iter"), wire.encode(elsewhere))
    assert sample("tmd_messages_rejected_total", {"reason": "mismatch"}) == 1
    assert sorted(view.jobs["j"].ranks) == [0, 1] and view.jobs["j"].ranks[1].node == "n0"


def test_brief_gpu_samples_repeat_the_full_one_held_and_are_counted_by_form() -> None:
    """A brief sample, on its own topic or relayed, keeps the full one it repeats in
    the view and goes on the bus; one whose full sample never came is a heartbeat
    (the node seen), counted ``unresolved``; a malformed one is refused."""
    ingest, view, metrics, bus = make_ingest()
    seen = bus.subscribe("t", (wire.NodeGpu,))
    t = time.time()
    gpus = [wire.GpuSample(index=i, temp_c=60.0, clock_event_reasons=0) for i in range(2)]
    full = wire.NodeGpu(ts=t, node="n0", gpus=gpus, rev=7)
    brief = wire.NodeGpu(ts=t, node="n0", rev=7, reasons=[0, 0x40])
    other = wire.NodeGpu(ts=t, node="n0", rev=8, reasons=[0, 0])
    topic = wire.node_topic("n0", "gpu")
    for message in (full, brief, other):
        ingest.handle(topic, wire.encode(message))
    iter_topic = wire.node_topic("n0", "iter")
    members = [wire.Member(0, "n0", 0)]
    status = wire.JobStatus(ts=t, job="j", generation=0, world_size=1, members=members)
    ingest.handle(wire.job_topic("j", "status"), wire.encode(status))
    step = wire.IterBatch(ts=t, job="j", rank=0, node="n0",
                          steps=[wire.StepTiming(1, t, 1, 1, 0, 0, 0)])  # fmt: skip
    relayed = wire.NodeIter(ts=t, node="n0", jobs=wire.RelayedBatches.of([step]), gpu=brief)
    ingest.handle(iter_topic, wire.encode(relayed))
    assert view.nodes["n0"].sample == full and view.nodes["n0"].state == "online"
    assert [m.rev for m in seen._queue] == [7, 7, 8, 7]
    sample = metrics.registry.get_sample_value
    forms = {f: sample("tmd_gpu_samples_total", {"form": f}) for f in metrics.samples_by}
    assert forms == {"full": 1, "brief": 2, "unresolved": 1}
    bad = wire.NodeGpu(ts=t, node="n0", gpus=gpus, rev=7, reasons=[0, 0])
    ingest.handle(topic, wire.encode(bad))
    assert sample("tmd_messages_rejected_total", {"reason": "schema"}) == 1


def test_cleared_retained_status_is_not_a_rejection() -> None:
    ingest, _, metrics, _ = make_ingest()
    ingest.handle(wire.job_topic("j", "status"), b"")
    ingest.handle(wire.node_topic("n", "status"), b"")
    ingest.handle(wire.node_topic("n", "gpu"), b"")  # not retained: empty is malformed
    total = sum(
        metrics.registry.get_sample_value("tmd_messages_rejected_total", {"reason": r}) or 0
        for r in ("json", "schema")
    )
    assert total == 1


def test_status_has_its_own_size_limit() -> None:
    ingest, view, metrics, _ = make_ingest(max_payload_bytes=4096)
    members = [wire.Member(r, f"node-{r:05d}") for r in range(1000)]
    status = wire.JobStatus(
        ts=time.time(), job="big", generation=0, world_size=1000, members=members
    )
    payload = wire.encode(status)
    assert len(payload) > 4096
    ingest.handle(wire.job_topic("big", "status"), payload)
    assert view.jobs["big"].world_size == 1000
    ingest.handle(wire.node_topic("n", "gpu"), b" " * 5000)
    assert (
        metrics.registry.get_sample_value("tmd_messages_rejected_total", {"reason": "oversize"})
        == 1
    )


def test_inputs_the_decoder_does_not_foresee_are_rejected_not_raised() -> None:
    ingest, view, metrics, _ = make_ingest()
    deep = b'{"v":1,"x":' + b"[" * 5000 + b"]" * 5000 + b"}"
    ingest.handle(wire.node_topic("n", "gpu"), deep)
    ingest.handle("tmd/v1/job/j/rank/\u00b2/iter", b"{}")  # a digit to str.isdigit, not int()
    ingest.handle("tmd/v1/job/j/rank/\u0661\u0662/iter", b"{}")  # Arabic-Indic "12"
    sample = metrics.registry.get_sample_value
    assert sample("tmd_messages_rejected_total", {"reason": "json"}) == 1
    assert sample("tmd_messages_rejected_total", {"reason": "topic"}) == 2
    assert view.jobs == {}


def test_a_bug_behind_the_checks_is_counted_as_internal() -> None:
    ingest, view, metrics, _ = make_ingest()

    def broken(*args: object) -> None:
        raise RuntimeError("bug")

    view.apply_gpu = broken  # type: ignore[method-assign]
    ingest.handle(wire.node_topic("n", "gpu"), wire.encode(wire.NodeGpu(ts=time.time(), node="n")))
    assert (
        metrics.registry.get_sample_value("tmd_messages_rejected_total", {"reason": "internal"})
        == 1
    )


@settings(max_examples=400, deadline=None)
@given(
    kind=st.sampled_from(
        [
            "node/{}/status",
            "node/{}/gpu",
            "node/{}/xid",
            "job/{}/rank/{}/iter",
            "job/{}/status",
            "job/{}/ack",
        ]
    ),
    a=st.text(max_size=12),
    b=st.text(max_size=12),
    payload=st.one_of(
        st.binary(max_size=200),
        st.recursive(
            st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
            lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
            max_leaves=20,
        ).map(lambda v: json.dumps(v).encode()),
    ),
    retained=st.booleans(),
)
def test_handle_never_raises_and_counts_every_message(
    kind: str, a: str, b: str, payload: bytes, retained: bool
) -> None:
    ingest, _, metrics, _ = make_ingest()
    ingest.handle("tmd/v1/" + kind.format(a, b), payload, retained=retained)
    received = sum(
        metrics.registry.get_sample_value("tmd_messages_received_total", {"kind": k}) or 0
        for k in ("node_status", "gpu", "xid", "iter", "job_status", "ack", "unknown")
    )
    assert received == 1


def test_retained_status_updates_the_view_but_is_not_news() -> None:
    ingest, view, _, bus = make_ingest()
    news = bus.subscribe("t", (wire.NodeStatus, wire.JobStatus))
    will = wire.NodeStatus(ts=time.time() - 86400, node="old", state="offline")
    ingest.handle(wire.node_topic("old", "status"), wire.encode(will), retained=True)
    assert view.nodes["old"].state == "offline"
    assert len(news) == 0
    ingest.handle(wire.node_topic("old", "status"), wire.encode(will))
    assert len(news) == 1


def test_cleared_retained_job_status_forgets_the_job() -> None:
    ingest, view, _, _ = make_ingest()
    status = wire.JobStatus(
        ts=time.time(), job="done", generation=0, world_size=1, members=[wire.Member(0, "n")]
    )
    ingest.handle(wire.job_topic("done", "status"), wire.encode(status), retained=True)
    assert "done" in view.jobs
    ingest.handle(wire.job_topic("done", "status"), b"", retained=True)
    assert "done" not in view.jobs


def test_refused_suback_codes() -> None:
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.reasoncodes import ReasonCode

    from tmd.daemon.ingest import _refused

    assert _refused((1, 1, 0)) == []
    assert _refused((1, 0x80)) == [0x80]
    ok, denied = (
        ReasonCode(PacketTypes.SUBACK, "Granted QoS 1"),
        ReasonCode(PacketTypes.SUBACK, "Not authorized"),
    )
    assert _refused([ok, denied]) == [denied]


async def test_publish_without_a_connection_raises_our_error() -> None:
    ingest, *_ = make_ingest()
    with pytest.raises(PublishError, match="not connected"):
        await ingest.publish(wire.job_topic("j", "ctl"), b"{}")


async def test_publish_translates_the_client_error(monkeypatch: pytest.MonkeyPatch) -> None:
    class Failing:
        async def publish(self, *args: Any, **kwargs: Any) -> None:
            raise aiomqtt.MqttError("Operation timed out")

    ingest, *_ = make_ingest()
    monkeypatch.setattr(ingest, "_client_now", Failing())
    with pytest.raises(PublishError, match="Operation timed out") as err:
        await ingest.publish(wire.job_topic("j", "ctl"), b"{}")
    assert isinstance(err.value.__cause__, aiomqtt.MqttError)


# One valid message of every type the daemon ingests, and its topic.
_NOW = 1_800_000_000.0
_SAMPLES: list[tuple[str, wire.Message]] = [
    (wire.node_topic("n0", "status"), wire.NodeStatus(ts=_NOW, node="n0", state="online",
                                                      gpus=[wire.GpuInfo(index=0, name="H100")])),
    (wire.node_topic("n0", "gpu"), wire.NodeGpu(ts=_NOW, node="n0")),
    (wire.node_topic("n0", "xid"), wire.XidEvent(ts=_NOW, node="n0", gpu=1, xid=79)),
    (wire.iter_topic("j", 1), wire.IterBatch(ts=_NOW, job="j", rank=1, node="n0",
                                              steps=[wire.StepTiming(3, _NOW, 1.0, 0.6, 0.3,
                                                                     0.05, 0.05)])),
    (wire.node_topic("n0", "iter"), wire.NodeIter(ts=_NOW, node="n0", jobs=wire.RelayedBatches.of(
        [wire.IterBatch(ts=_NOW, job="j", rank=1, node="n0", steps=[wire.StepTiming(
            3, _NOW, 1.0, 0.6, 0.3, 0.05, 0.05)])]))),
    (wire.job_topic("j", "status"), wire.JobStatus(
        ts=_NOW, job="j", generation=0, world_size=2,
        members=[wire.Member(0, "n0", 0), wire.Member(1, "n0", 1)],
        standbys=[wire.StandbyInfo(node="s0", state="ready", warmup_s=1.0, slots=2)])),
    (wire.job_topic("j", "ack"), wire.Ack(ts=_NOW, job="j", migration_id="m1", kind="switched",
                                          node="n0", local_rank=1,
                                          downtime=wire.Downtime(total_s=0.2))),
]  # fmt: skip
_JSON = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers() | st.text(max_size=8),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=12,
)


def _paths(value: object, prefix: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Every place in a decoded JSON value: keys of objects, indexes of arrays."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


@settings(max_examples=300, deadline=None)
@given(
    sample=st.sampled_from(_SAMPLES),
    pick=st.integers(min_value=0),
    value=_JSON,
    drop=st.booleans(),
)
def test_every_wire_type_mutated_anywhere_is_applied_or_counted_never_raised(
    sample: tuple[str, wire.Message], pick: int, value: object, drop: bool
) -> None:
    """Each type the daemon ingests, a valid message with one field anywhere in it
    replaced by any JSON value (or removed), through the real edge: ``handle`` never
    raises, and the message is either applied (and passed on) or counted as rejected,
    exactly once."""
    topic, message = sample
    body = json.loads(wire.encode(message))
    paths = _paths(body)
    *parents, last = paths[pick % len(paths)]
    node = body
    for key in parents:
        node = node[key]
    if drop and isinstance(node, dict):
        del node[last]
    else:
        node[last] = value
    ingest, _, metrics, bus = make_ingest()
    published = bus.subscribe("fuzz", (wire.Message,))
    ingest.handle(topic, json.dumps(body).encode())

    def total(name: str) -> float:
        return sum(s.value for m in metrics.registry.collect() if m.name == name for s in m.samples
                   if s.name.endswith("_total"))  # fmt: skip

    assert total("tmd_messages_received") == 1
    rejected = total("tmd_messages_rejected")
    assert rejected + len(published) == 1, (rejected, len(published), body)


def test_only_this_daemon_s_own_probe_says_its_view_is_current() -> None:
    """A probe on the daemon's topic counts only if this daemon sent it (its nonce and
    a send stamp it recorded), once: a forged one (any client may write the topic where
    the broker has no ACL) must neither hide a stale view nor keep a current one stale."""
    ingest, _, _, _ = make_ingest()
    now = ingest._clock.now()
    ingest.freshness.connection(True, now)
    ingest._probes_out[now] = True  # as ``probe`` records what it sends
    nonce = ingest._probe_nonce
    ingest.handle(ingest.probe_topic, f"{now + 3600!r} {nonce}".encode())  # never sent
    ingest.handle(ingest.probe_topic, f"{0.0!r} {nonce}".encode())  # never sent
    ingest.handle(ingest.probe_topic, f"{now!r} forged".encode())
    ingest.handle(ingest.probe_topic, b"\xff not even text")
    assert ingest.freshness.stale(now)
    ingest.handle(ingest.probe_topic, f"{now!r} {nonce}".encode())
    assert not ingest.freshness.stale(now) and ingest.freshness.fresh_since == now
    ingest.handle(ingest.probe_topic, f"{now!r} {nonce}".encode())  # a replay: once only
    assert ingest.freshness.fresh_since == now


@pytest.mark.parametrize("swallows", ["raises", "returns"])
async def test_a_cancelled_probe_ends_where_the_client_turns_the_cancel_into_an_error(
    swallows: str,
) -> None:
    """aiomqtt raises its own error when a publish is interrupted, or (CI, 83af51e)
    returns as if it had published: neither may swallow the cancellation (the
    daemon's task group would wait forever)."""
    import asyncio

    class Client:
        async def publish(self, *_: Any, **__: Any) -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if swallows == "raises":
                    raise aiomqtt.MqttError("Operation timed out") from None

    ingest, *_ = make_ingest()
    ingest._client_now = Client()  # type: ignore[assignment]
    probe = asyncio.create_task(ingest.probe())
    await asyncio.sleep(0.05)
    probe.cancel()
    done, _ = await asyncio.wait([probe], timeout=5)
    assert done == {probe} and probe.cancelled()


def test_gaps_in_an_agent_s_numbers_are_counted_as_lost_and_settle_the_view() -> None:
    """Each telemetry topic of an agent numbered apart (``wire``): a gap is counted in
    ``tmd_messages_lost_total`` and makes the view settle again; a number that goes
    back (the agent restarted) or the agent's live status (it reconnected) starts the
    count over, as does the daemon's own reconnect; a retained copy is not news."""
    ingest, view, metrics, _ = make_ingest()
    now = ingest._clock.now()
    ingest.freshness.connection(True, now - 10)
    for t in range(10, -1, -1):  # its probes came back, every second
        ingest.freshness.answered(now - t, now - t)
    assert ingest.freshness.since(now) is not None

    def lost(topic: str) -> float | None:
        return metrics.registry.get_sample_value("tmd_messages_lost_total", {"kind": topic})

    def gpu(seq: int | None, node: str = "n", *, retained: bool = False) -> None:
        sample = wire.NodeGpu(ts=now, node=node, seq=seq)
        ingest.handle(wire.node_topic(node, "gpu"), wire.encode(sample), retained=retained)

    def relayed(seq: int) -> None:
        t = time.time()
        batch = wire.IterBatch(
            ts=t, job="j", rank=0, node="n", steps=[wire.StepTiming(seq, t, 1, 1, 0, 0, 0)]
        )
        message = wire.NodeIter(ts=t, node="n", jobs=wire.RelayedBatches.of([batch]), seq=seq)
        ingest.handle(wire.node_topic("n", "iter"), wire.encode(message))

    for seq in (1, 2, 3):
        gpu(seq)
    relayed(1)
    relayed(2)  # the topics are numbered apart
    assert (lost("gpu"), lost("node_iter")) == (0, 0)
    assert ingest.freshness.since(now) is not None
    gpu(7)  # 4, 5 and 6 were dropped on the way
    assert lost("gpu") == 3 and ingest.freshness.since(now) is None
    relayed(4)
    assert (lost("gpu"), lost("node_iter")) == (3, 1)
    gpu(1)  # the agent restarted
    gpu(None)  # an agent that does not number
    gpu(2)
    gpu(9, retained=True)  # not news: a retained copy says nothing of what came between
    ingest.handle(wire.node_topic("n", "status"),
                  wire.encode(wire.NodeStatus(ts=now, node="n", state="online")))  # fmt: skip
    gpu(40)  # it reconnected: what it sent meanwhile is its own business
    view.restart_sequences()  # this daemon reconnected
    gpu(60)
    gpu(61, node="m")
    assert (lost("gpu"), lost("node_iter")) == (3, 1)

    shared, _, shared_metrics, _ = make_ingest()
    shared._mqtt = config.MqttConfig(shared_group="heads")
    for seq in (1, 5):  # each head of a shared group reads some of them
        sample = wire.NodeGpu(ts=now, node="n", seq=seq)
        shared.handle(wire.node_topic("n", "gpu"), wire.encode(sample))
    assert shared_metrics.registry.get_sample_value("tmd_messages_lost_total", {"kind": "gpu"}) == 0


def test_numbers_that_make_no_sense_neither_count_as_lost_nor_keep_the_view_settling() -> None:
    """A numbered message the checks refuse still arrived; two agents under one name
    (their numbers interleaved) or a forged jump are not believed: that node's gaps are
    not judged for a while, so no one agent keeps every finding of absence away."""
    ingest, _, metrics, _ = make_ingest()
    clock = ingest._clock
    ingest.freshness.connection(True, clock.now())
    ingest.freshness.answered(clock.now(), clock.now())

    def gpu(node: str, seq: int, *, twice: bool = False) -> None:
        gpus = [wire.GpuSample(index=0)] * (2 if twice else 1)
        sample = wire.NodeGpu(ts=clock.now(), node=node, seq=seq, gpus=gpus)
        ingest.handle(wire.node_topic(node, "gpu"), wire.encode(sample))

    def lost() -> float | None:
        return metrics.registry.get_sample_value("tmd_messages_lost_total", {"kind": "gpu"})

    for seq in (1, 2):  # the first makes the node, the second is its count's start
        gpu("a", seq)
    gpu("a", 3, twice=True)  # refused (a GPU index twice), yet it came
    gpu("a", 4)
    assert metrics.rejected_by["schema"].value == 1 and lost() == 0
    for k in range(20):  # a cloned machine: two agents publish as "b"
        gpu("b", 1000 + k)
        gpu("b", 5 + k)
    for seq in (1, 2, (1 << 62) - 1, 3):  # a forged jump
        gpu("c", seq)
    assert lost() == 0
    clock.advance(5.1)
    ingest.freshness.answered(clock.now(), clock.now())
    assert ingest.freshness.since(clock.now()) is not None  # nothing kept it settling
    clock.advance(DOUBT_S)
    gpu("b", 1030)
    gpu("b", 1032)  # believed again after a while: a real gap counts
    assert lost() == 1


def test_what_counts_as_lost_at_the_edges() -> None:
    """A node's first message starts its count; a clock that steps back starts it over;
    a relaying agent's backlog burst is believed; a message refused at decoding still
    came; a stamp far ahead is taken as no further than a minute."""
    ingest, _, metrics, _ = make_ingest()
    t = ingest._clock.now()

    def send(node: str, seq: int, ts: float, **gpu: Any) -> None:
        sample: dict[str, Any] = {"v": 1, "ts": ts, "node": node, "seq": seq}
        sample["gpus"] = [{"index": 0, **gpu}] if gpu else []
        ingest.handle(wire.node_topic(node, "gpu"), json.dumps(sample).encode())

    def lost() -> float | None:
        return metrics.registry.get_sample_value("tmd_messages_lost_total", {"kind": "gpu"})

    send("new", 1, t)
    send("new", 5, t + 0.1)  # the node's first message was its count's start
    assert lost() == 3
    for seq, stamp in ((1, t), (2, t + 1), (3, t + 2), (4, t + 1.5), (6, t + 2.5)):
        send("stepped", seq, stamp)  # NTP stepped its clock back before 4
    assert lost() == 4  # 5 only: still believed
    send("burst", 1, t)
    send("burst", 42, t + 0.1)  # 40 of a 64-message backlog dropped, sent in 0.1 s
    assert lost() == 44
    send("refused", 1, t)
    send("refused", 2, t)
    send("refused", 3, t, mem_used_mb=-1)  # out of bounds: refused whole, yet it came
    send("refused", 4, t)
    assert lost() == 44 and metrics.rejected_by["value"].value == 1
    send("ahead", 1, t)
    send("ahead", 9 * 10**12, 1e11)  # "sent" in the year 5138: as if a minute from now
    assert lost() == 44


def test_what_a_rank_publishes_itself_is_numbered_per_run_and_generation() -> None:
    """A rank's own batches: a gap counts and settles its job's view, not the whole
    view; a new generation (a switch: the joiner's count, while the leaver's last
    batches may still come) or run starts the count over; a batch refused at decoding
    still came."""
    ingest, _, metrics, _ = make_ingest()
    clock = ingest._clock
    ingest.freshness.connection(True, clock.now() - 10)
    for t in range(10, -1, -1):
        ingest.freshness.answered(clock.now() - t, clock.now() - t)
    t0 = clock.now()

    def batch(seq: int, step: int, *, generation: int = 0, run: int = 0, rank: int = 1) -> None:
        b = wire.IterBatch(ts=t0 + step, job="j", rank=rank, node="n", generation=generation,
                           run=run, seq=seq,
                           steps=[wire.StepTiming(step, t0 + step, 1, 1, 0, 0, 0)])  # fmt: skip
        ingest.handle(wire.iter_topic("j", rank), wire.encode(b))

    def lost() -> float | None:
        return metrics.registry.get_sample_value("tmd_messages_lost_total", {"kind": "iter"})

    for seq in (1, 2, 3):
        batch(seq, seq)
    assert lost() == 0 and ingest.freshness.since(clock.now()) is not None
    batch(6, 6)  # 4 and 5 dropped
    assert lost() == 2 and ingest._view.jobs["j"].lost_at == clock.now()
    assert ingest.freshness.since(clock.now()) is not None  # one job's loss, not all
    batch(1, 7, generation=1)  # the joiner, after a switch
    batch(7, 7)  # the leaver's last, late
    batch(2, 8, generation=1)
    assert lost() == 2
    batch(40, 9, run=1)  # the job restarted: counted apart from run 0's 7
    refused = {"v": 1, "ts": t0 + 10, "job": "j", "rank": 1, "node": "n", "run": 1,
               "seq": 41, "steps": [[10, t0 + 10, -1.0, 1, 0, 0, 0]]}  # fmt: skip
    ingest.handle(wire.iter_topic("j", 1), json.dumps(refused).encode())  # a negative time
    batch(42, 11, run=1)  # the refused one came all the same
    assert lost() == 2 and metrics.rejected_by["value"].value == 1
    ingest._view.restart_sequences()  # this daemon reconnected: what it missed is its own
    batch(90, 12, run=1)
    assert lost() == 2
