"""The ControlChannel contract, run against ``StoreControl`` and ``MqttControl``.

Each test drives one job through ``tests.contracts.channels``: the channel as the
runtime's ``Session`` sees it, and a controller that sends commands and reads acks and
status as the real one does (``JobController`` for the store, the daemon's topics for
MQTT). Only what both channels do today is asserted here.

Where they differ, by design, nothing is asserted here. The store's side is in
tests/unit/runtime/test_control.py; MqttControl has no test file of its own (only
tests/integration/test_runtime_mqtt.py, end to end), so its side is untested today:

- A command sent before the channel exists: the store log is read from its first
  entry, so it is delivered; MQTT has no session, so it is lost. Worse, MqttControl's
  constructor waits for CONNACK but not for SUBACK, so a command sent right after it
  returns can be lost too (36 of 100 in one run here); the harness probes until its
  subscription is live.
- ``stopped()``: the store channel reads the status key, MQTT the status topic; only
  MQTT can receive a malformed status (counted in ``rejected``).
- ``standbys_changed()``: the store channel always answers False (its readers read
  the registry themselves); MQTT reports a registry change within about a second.
- Telemetry (``publish``) exists on MqttControl only.
"""

from __future__ import annotations

import time

import msgspec

from tests.contracts.channels import Harness, poll_through, promptly, until
from tmd import wire
from tmd.runtime.control import register_standby

NODE = "w0"


def status(
    h: Harness, *, generation: int = 0, step: int = 0, ts: float, state: str = "running"
) -> wire.JobStatus:
    return wire.JobStatus(
        ts=ts, job=h.job, generation=generation, world_size=2, step=step, state=state,  # type: ignore[arg-type]
        members=[wire.Member(0, "w0"), wire.Member(1, "w1")],
    )  # fmt: skip


def ack(h: Harness, migration_id: str, kind: str, node: str = NODE, **fields: object) -> wire.Ack:
    return wire.Ack(ts=time.time(), job=h.job, migration_id=migration_id, kind=kind,  # type: ignore[arg-type]
                    node=node, **fields)  # type: ignore[arg-type]  # fmt: skip


def test_each_command_is_polled_once_in_order_as_the_wire_command_sent(control: Harness) -> None:
    channel = control.open(NODE)
    sent = [
        control.command(wire.Prepare, "m1", leaver="w1", joiner="s0", deadline_s=12.5),
        control.command(wire.Switch, "m1", at_step=9),
        control.command(wire.Switch, "m2"),
        control.command(wire.Abort, "m3", reason="operator"),
    ]
    for command in sent:
        control.controller.send(command)
    marker = control.command(wire.Abort, "marker")
    control.controller.send(marker)

    got = poll_through(channel, marker)

    assert got == [*sent, marker]
    assert [type(c) for c in got] == [
        wire.Prepare,
        wire.Switch,
        wire.Switch,
        wire.Abort,
        wire.Abort,
    ]
    # Nothing comes back at a later boundary.
    later = control.command(wire.Abort, "later")
    control.controller.send(later)
    assert poll_through(channel, later) == [later]


def test_a_repeated_command_is_delivered_each_time_and_every_answer_is_read(
    control: Harness,
) -> None:
    """The channel does not deduplicate: a resend (the daemon's answer to a lost ack)
    reaches the session, which answers it again; the controller reads every answer."""
    channel = control.open(NODE)
    prepare = control.command(wire.Prepare, "m1", leaver="w1", joiner="s0")
    control.controller.send(prepare)
    control.controller.send(prepare)
    resent = control.command(wire.Prepare, "m1", leaver="w1", joiner="s0")
    control.controller.send(resent)
    assert poll_through(channel, resent) == [prepare, prepare, resent]

    downtime = wire.Downtime(total_s=1.5, stop_s=0.25, transfer_s=0.75, switch_s=0.25,
                             first_step_s=0.25)  # fmt: skip
    answers = [
        ack(control, "m1", "prepared", rank=0, generation=0),
        ack(control, "m1", "prepared", rank=0, generation=0, detail="already prepared"),
        ack(control, "m1", "switched", rank=0, generation=1, at_step=40),
        ack(control, "m1", "switched", rank=0, generation=1, at_step=40, downtime=downtime,
            detail="already switched"),
    ]  # fmt: skip
    for answer in answers:
        channel.ack(answer)
    until(lambda: len(control.controller.acks()) >= len(answers), "all acks read")
    assert control.controller.acks() == answers


def test_acks_reach_the_controller_with_every_field(control: Harness) -> None:
    w0, w1 = control.open("w0"), control.open("w1")
    downtime = wire.Downtime(total_s=2.0, stop_s=0.5, transfer_s=1.0, switch_s=0.25,
                             first_step_s=0.25)  # fmt: skip
    mine = [
        ack(control, "m1", "switched", "w0", rank=0, generation=1, at_step=40, downtime=downtime),
        ack(control, "m2", "failed", "w0", detail="leaver or joiner not valid"),
    ]
    theirs = ack(control, "m1", "aborted", "w1", rank=1, generation=0, detail="operator")
    for a in mine:
        w0.ack(a)
    w1.ack(theirs)

    until(lambda: len(control.controller.acks()) >= 3, "three acks read")
    got = control.controller.acks()
    assert sorted(got, key=lambda a: (a.node, a.migration_id)) == [*mine, theirs]
    assert [a for a in got if a.node == "w0"] == mine  # one member's acks keep their order
    assert got[got.index(mine[0])].downtime == downtime


def test_the_status_reaches_the_controller_with_the_spare_standbys(control: Harness) -> None:
    channel = control.open(NODE)
    register_standby(control.store, wire.StandbyInfo(node="s0", state="ready", warmup_s=2.5))
    register_standby(control.store, wire.StandbyInfo(node="w1", state="joining"))  # a member now
    sent = status(control, step=7, ts=time.time())

    channel.publish_status(sent)

    expected = msgspec.structs.replace(
        sent, standbys=[wire.StandbyInfo(node="s0", state="ready", warmup_s=2.5)]
    )
    until(lambda: control.controller.status() == expected, "the status read back")


def test_a_stopped_status_from_one_rank_stops_every_rank(control: Harness) -> None:
    rank0, rank1 = control.open("w0"), control.open("w1")
    assert not rank0.stopped() and not rank1.stopped()
    rank0.publish_status(status(control, step=3, ts=time.time()))
    until(lambda: control.controller.status() is not None, "a running status read")
    assert not rank0.stopped() and not rank1.stopped()

    rank0.publish_status(status(control, step=12, ts=time.time(), state="stopped"))

    until(lambda: rank1.stopped() and rank0.stopped(), "every rank sees the job stopped")


def test_a_late_status_never_replaces_a_newer_one(control: Harness) -> None:
    """Every member publishes at times, each from its own thread: rank 1's start-up
    status written after rank 0's newer one must not undo it (put_status's
    compare-and-set on (generation, step, ts))."""
    rank0, rank1 = control.open("w0"), control.open("w1")
    newer = status(control, step=12, ts=3.0)
    rank0.publish_status(newer)
    until(lambda: control.controller.status() == newer, "the newer status read")

    rank1.publish_status(status(control, step=0, ts=2.0))  # older step, older ts
    rank1.publish_status(status(control, step=12, ts=1.0))  # same step, older ts
    control.close_channel(rank1)  # sends what it queued
    control.controller.sync()
    assert control.controller.status() == newer

    next_generation = status(control, generation=1, step=0, ts=0.5)  # wins on generation
    rank0.publish_status(next_generation)
    until(lambda: control.controller.status() == next_generation, "the new generation read")


def test_malformed_or_foreign_commands_are_dropped_not_raised(control: Harness) -> None:
    channel = control.open(NODE)
    job = control.job
    malformed = [
        b"not json",
        b"",
        b'{"v": 2, "ts": 1, "cmd": "abort", "job": "%s", "migration_id": "m"}' % job.encode(),
        b'{"v": 1, "ts": 1, "cmd": "explode", "job": "%s", "migration_id": "m"}' % job.encode(),
        b'{"v": 1, "ts": 1, "cmd": "prepare", "job": "%s", "migration_id": "m"}' % job.encode(),
        b'{"v": 1, "ts": 1, "cmd": "abort", "job": "%s", "migration_id": "a/#"}' % job.encode(),
        b'{"v": 1, "ts": -5, "cmd": "switch", "job": "%s", "migration_id": "m"}' % job.encode(),
        wire.encode(ack(control, "m", "prepared")),  # an answer is no command
    ]
    for payload in malformed:
        control.controller.send_raw(payload)
    # Well-formed, but for another job (the store log is shared; on MQTT, a bad sender).
    control.controller.send_raw(wire.encode(wire.Abort(ts=1.0, job="other", migration_id="m")))
    marker = control.command(wire.Abort, "marker")
    control.controller.send(marker)

    assert poll_through(channel, marker) == [marker]
    assert channel.rejected == len(malformed)  # type: ignore[attr-defined]  # both count them
    assert not channel.stopped()


def test_poll_returns_at_once_when_nothing_is_pending(control: Harness) -> None:
    channel = control.open(NODE)
    for _ in range(3):
        assert promptly(channel.poll) == []
    assert promptly(channel.standbys_changed) is False  # nothing changed yet
    # The channel still delivers after empty polls.
    marker = control.command(wire.Abort, "marker")
    control.controller.send(marker)
    assert poll_through(channel, marker) == [marker]


def test_a_step_boundary_never_waits_for_a_lost_transport(control_own_transport: Harness) -> None:
    h = control_own_transport
    channel = h.open(NODE)
    h.cut()
    assert promptly(channel.poll) == []
    assert promptly(lambda: channel.ack(ack(h, "m1", "prepared"))) is None
    assert promptly(lambda: channel.publish_status(status(h, ts=time.time()))) is None
    assert promptly(channel.stopped) is False
    assert promptly(channel.standbys_changed) is False
    assert promptly(channel.poll) == []


def test_what_is_queued_before_close_is_sent(control: Harness) -> None:
    channel = control.open(NODE)
    last_ack = ack(control, "m1", "switched", rank=0, generation=1, at_step=5)
    last_status = status(control, generation=1, step=5, ts=time.time(), state="stopped")
    channel.ack(last_ack)
    channel.publish_status(last_status)

    control.close_channel(channel)

    control.controller.sync()
    until(lambda: control.controller.acks() == [last_ack], "the last ack read")
    until(lambda: control.controller.status() == last_status, "the last status read")
