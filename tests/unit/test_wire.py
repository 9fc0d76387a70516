"""Wire types: every v1 message round-trips; every class of bad payload is rejected
with its reason; arbitrary bytes never raise anything but ProtocolError."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tmd import wire
from tmd.errors import ProtocolError

TS = 1_800_000_000.0

GOOD = [
    wire.NodeStatus(
        ts=TS,
        node="n1",
        state="online",
        role="standby",
        gpus=[wire.GpuInfo(index=0, uuid="GPU-1", name="H200")],
    ),
    wire.NodeGpu(ts=TS, node="n1", gpus=[wire.GpuSample(index=0, temp_c=60.5, ecc_dbe_volatile=0)]),
    wire.XidEvent(ts=TS, node="n1", gpu=3, xid=79),
    wire.IterBatch(
        ts=TS,
        job="j",
        rank=7,
        node="n1",
        steps=[wire.StepTiming(10, TS, 1.0, 0.6, 0.3, 0.05, 0.05)],
    ),
    wire.JobStatus(
        ts=TS,
        job="j",
        generation=2,
        world_size=2,
        members=[wire.Member(0, "a"), wire.Member(1, "b")],
        standbys=[wire.StandbyInfo(node="s", state="ready", warmup_s=3.0)],
    ),
    wire.Ack(
        ts=TS,
        job="j",
        migration_id="m1",
        kind="switched",
        node="s",
        rank=1,
        downtime=wire.Downtime(total_s=0.2, transfer_s=0.01),
    ),
]


@pytest.mark.parametrize("message", GOOD, ids=lambda m: type(m).__name__)
def test_round_trip(message: wire.Message) -> None:
    assert wire.decode(wire.encode(message), type(message)) == message


@pytest.mark.parametrize(
    "command",
    [
        wire.Prepare(ts=TS, job="j", migration_id="m1", leaver="a", joiner="s"),
        wire.Switch(ts=TS, job="j", migration_id="m1", at_step=100),
        wire.Abort(ts=TS, job="j", migration_id="m1", reason="operator"),
        wire.Restart(ts=TS, job="j", migration_id="r1", node="h", reason="ECC"),
    ],
)
def test_control_union_decodes_by_cmd_tag(command: wire.Message) -> None:
    data = wire.encode(command)
    assert json.loads(data)["cmd"] in ("prepare", "switch", "abort", "restart")
    assert wire.decode(data, wire.Control) == command


def _iter(**changes: object) -> bytes:
    body: dict[str, object] = {
        "v": 1,
        "ts": TS,
        "job": "j",
        "rank": 1,
        "node": "n",
        "steps": [[1, TS, 1.0, 0.5, 0.4, 0.05, 0.05]],
    }
    body.update(changes)
    return json.dumps({k: v for k, v in body.items() if v is not ...}).encode()


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"not json", "json"),
        (b'{"v": 1, "ts": 1', "json"),
        (b'{"v":1,"ts":NaN,"job":"j","rank":1,"node":"n","steps":[]}', "json"),
        (_iter(v=2), "version"),
        (_iter(v=2, steps=...), "version"),  # a v2 payload shaped differently is still "version"
        (_iter(job=...), "schema"),
        (_iter(rank="one"), "schema"),
        (b"[1, 2]", "schema"),
        (_iter(rank=-1), "value"),
        (_iter(rank=1 << 30), "value"),
        (_iter(steps=[[1, TS, -0.5, 0.5, 0.4, 0.05, 0.05]]), "value"),  # negative duration
        (_iter(steps=[[1, TS, 7.0, 0.5, 0.4, 0.05, 0.05]]).replace(b"7.0", b"1e400"), "value"),
        (_iter(steps=[]), "value"),
        (
            _iter(steps=[[1, TS, 1.0, 0.5, 0.4, 0.05, 0.05]] * (wire.MAX_STEPS_PER_BATCH + 1)),
            "value",
        ),
        (_iter(job="a/b"), "value"),  # not a single topic segment
        (_iter(node="#"), "value"),
    ],
)
def test_bad_payloads_are_rejected_with_their_reason(payload: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError) as err:
        wire.decode(payload, wire.IterBatch)
    assert err.value.reason == reason


def test_unknown_command_is_a_value_error() -> None:
    with pytest.raises(ProtocolError) as err:
        wire.decode(b'{"cmd":"explode","v":1,"ts":1,"job":"j","migration_id":"m"}', wire.Control)
    assert err.value.reason == "value"


def test_unknown_fields_are_ignored_for_forward_compatibility() -> None:
    data = _iter(new_field={"x": 1})
    assert wire.decode(data, wire.IterBatch).rank == 1


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_raise_only_protocol_errors(data: bytes) -> None:
    for kind in (wire.IterBatch, wire.NodeGpu, wire.JobStatus, wire.Control):
        with contextlib.suppress(ProtocolError):
            wire.decode(data, kind)


def test_topics() -> None:
    assert wire.iter_topic("j", 3) == "tmd/v1/job/j/rank/3/iter"
    assert wire.node_topic("n", "xid") == "tmd/v1/node/n/xid"
    assert wire.job_topic("j", "ctl") == "tmd/v1/job/j/ctl"


def test_machine_fields_are_additive() -> None:
    # A status from a runtime before machines: members are [rank, node], standbys
    # have no slots. It still decodes, as machines of one rank.
    old = b'{"v":1,"ts":1,"job":"j","generation":0,"world_size":2,"members":[[0,"a"],[1,"b"]],'
    old += b'"standbys":[{"node":"s","state":"ready"}]}'
    status = wire.decode(old, wire.JobStatus)
    assert [(m.rank, m.node, m.local_rank) for m in status.members] == [
        (0, "a", None),
        (1, "b", None),
    ]
    assert status.standbys[0].slots == 1
    # A new member is [rank, node, local_rank]; a decoder that knows only two
    # elements (an old daemon) ignores the third.
    new = wire.encode(wire.Member(3, "h", 1))
    assert json.loads(new) == [3, "h", 1]

    class OldMember(wire.msgspec.Struct, array_like=True, frozen=True):
        rank: int
        node: str

    assert wire.msgspec.json.decode(new, type=OldMember) == OldMember(3, "h")


def test_ready_standbys_match_the_machine_size() -> None:
    infos = [
        wire.StandbyInfo(node="s1", state="ready", slots=2),
        wire.StandbyInfo(node="s2", state="ready", slots=1),
        wire.StandbyInfo(node="s3", state="warming", slots=2),
    ]
    assert wire.ready_standbys(infos, set()) == ["s1", "s2"]
    assert wire.ready_standbys(infos, set(), slots=2) == ["s1"]
    assert wire.ready_standbys(infos, {"s1"}, slots=2) == []


def test_default_node_name_is_a_topic_segment() -> None:
    name = wire.default_node_name()
    assert (
        wire.decode(
            wire.encode(wire.NodeStatus(ts=1.0, node=name, state="online")), wire.NodeStatus
        ).node
        == name
    )


def test_relayed_batches_as_columns_give_back_the_batches() -> None:
    """A machine's relayed batches (``NodeIter``) travel as columns per job, in order,
    and read back as the batches their ranks made, through JSON."""

    def batch(job: str, rank: int, *steps: int, run: int | None = None) -> wire.IterBatch:
        timings = [wire.StepTiming(s, 1e9 + s, 1.0, 0.5 + rank / 8, 0.3, 0.1, 0.1) for s in steps]
        return wire.IterBatch(ts=1e9 + rank, job=job, rank=rank, node="n0", generation=rank % 2,
                              run=run, steps=timings)  # fmt: skip

    batches = [batch("a", 0, 1, 2, 3), batch("b", 4, 7, run=2), batch("a", 1, 3), batch("a", 0, 4)]
    message = wire.NodeIter(ts=1e9, node="n0", jobs=wire.RelayedBatches.of(batches))
    got = wire.decode(wire.encode(message), wire.NodeIter)
    assert [j.job for j in got.jobs] == ["a", "b"]
    for relayed in got.jobs:
        relayed.check()
    assert got.jobs[0].count == [3, 1, 1] and got.jobs[0].step == [1, 2, 3, 3, 4]
    back = got.jobs[0].batches("n0") + got.jobs[1].batches("n0")
    assert back == [batches[0], batches[2], batches[3], batches[1]]
    (a, _) = got.jobs
    with pytest.raises(ProtocolError, match="steps") as err:
        msgspec.structs.replace(a, compute_s=a.compute_s[:-1]).check()
    assert err.value.reason == "schema"
    with pytest.raises(ProtocolError, match="lengths"):
        msgspec.structs.replace(a, ts=a.ts[:-1]).check()


def _gpus(**fields: Any) -> list[wire.GpuSample]:
    return [wire.GpuSample(index=i, temp_c=50.0 + i, clock_event_reasons=0, ecc_sbe_volatile=0,
                           **fields) for i in range(2)]  # fmt: skip


def test_brief_samples_in_full_first_on_change_and_every_period() -> None:
    """An agent's samples: in full (numbered ``rev``) first, when a counter or flag
    changes and for the next ``repeat`` after, and every ``every_s``; brief between,
    each GPU's clock event reasons alone; temperatures change without a full one."""
    briefs = wire.BriefSamples(10.0, repeat=1)
    shaped = []
    for t in range(26):
        sbe = 0 if t < 14 else 3  # a single-bit count rises at t=14
        gpus = [wire.GpuSample(index=i, temp_c=50.0 + t, clock_event_reasons=t % 2 * 0x40,
                               ecc_sbe_volatile=sbe) for i in range(2)]  # fmt: skip
        shaped.append(briefs.shape(wire.NodeGpu(ts=TS + t, node="n", gpus=gpus, seq=t), TS + t))
    full = [t for t, s in enumerate(shaped) if not s.brief]
    assert full == [0, 1, 11, 14, 15, 25]  # a period after the last full one
    revs = {s.rev for s in shaped[:14]}
    assert len(revs) == 1 and shaped[14].rev == shaped[13].rev + 1  # the change, a new rev
    brief = shaped[3]
    assert brief.gpus == [] and brief.reasons == [0x40, 0x40] and brief.seq == 3
    assert brief.repeats(shaped[1]) and not brief.repeats(shaped[14])
    assert shaped[16].repeats(shaped[15]) and not shaped[16].repeats(None)
    wire.decode(wire.encode(brief), wire.NodeGpu).check()


def test_brief_samples_start_over_on_reset_and_never_when_off() -> None:
    briefs = wire.BriefSamples(10.0, repeat=0)
    sample = wire.NodeGpu(ts=TS, node="n", gpus=_gpus())
    first, second = briefs.shape(sample, 0.0), briefs.shape(sample, 1.0)
    briefs.reset()  # a new connection: a full one under a new rev, briefs after it
    third, fourth = briefs.shape(sample, 2.0), briefs.shape(sample, 3.0)
    assert [s.brief for s in (first, second, third, fourth)] == [False, True, False, True]
    assert third.rev == first.rev + 1 and not fourth.repeats(first) and fourth.repeats(third)
    # A restarted agent numbers on from its clock, not from where its last life began.
    assert wire.BriefSamples(10.0).rev >= first.rev
    off = wire.BriefSamples(0.0)
    assert all(off.shape(sample, t) is sample for t in range(3))


@pytest.mark.parametrize(
    "message",
    [
        wire.NodeGpu(ts=TS, node="n", gpus=_gpus(), rev=3, reasons=[0, 0]),  # gpus and reasons
        wire.NodeGpu(ts=TS, node="n", reasons=[0, 0]),  # brief without a rev
    ],
)
def test_a_malformed_brief_sample_is_a_schema_error(message: wire.NodeGpu) -> None:
    decoded = wire.decode(wire.encode(message), wire.NodeGpu)
    with pytest.raises(ProtocolError) as err:
        decoded.check()
    assert err.value.reason == "schema"


def test_brief_samples_of_agents_started_at_once_spread_their_full_ones() -> None:
    """``phase_s``: the first periodic full sample that much sooner, then every period
    (a simulated cluster's agents, all started at once, as agents started apart)."""
    sample = wire.NodeGpu(ts=TS, node="n", gpus=_gpus())
    full = {}
    for phase in (0.0, 4.0):
        briefs = wire.BriefSamples(10.0, phase_s=phase)
        full[phase] = [t for t in range(30) if not briefs.shape(sample, float(t)).brief]
    assert full == {0.0: [0, 1, 2, 12, 22], 4.0: [0, 1, 2, 8, 18, 28]}
    heartbeat = wire.NodeGpu(ts=TS, node="n")  # no GPUs: nothing to abbreviate
    assert wire.BriefSamples(10.0).shape(heartbeat, 5.0) is heartbeat
