"""Built-in policies as pure functions over findings, requests and a cluster view."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tmd import wire
from tmd.clock import SystemClock
from tmd.config import ActuatorConfig, GuardrailsConfig
from tmd.daemon import events
from tmd.daemon.actuator import Actuator
from tmd.daemon.journal import Journal
from tmd.daemon.plugins import Context, configure
from tmd.daemon.view import ClusterView
from tmd.errors import ConfigError
from tmd.policies.alert import AlertConfig, AlertPolicy
from tmd.policies.drain import DrainPolicy
from tmd.policies.failover import FailoverConfig, FailoverPolicy
from tmd.policies.rebalance import RebalanceConfig, RebalancePolicy

T0 = 1_800_000_000.0


def view(standbys: dict[str, str] | None = None, offline: tuple[str, ...] = ()) -> ClusterView:
    v = ClusterView()
    for job, nodes in (("a", ["n0", "n1", "n2"]), ("b", ["n2", "n3"])):
        v.apply_job_status(
            wire.JobStatus(
                ts=T0,
                job=job,
                generation=0,
                world_size=len(nodes),
                members=[wire.Member(r, n) for r, n in enumerate(nodes)],
                standbys=[
                    wire.StandbyInfo(node=s, state=st)  # type: ignore[arg-type]
                    for s, st in ({"s0": "ready"} if standbys is None else standbys).items()
                ],
            ),
            T0,
        )
    for node in offline:
        v.apply_node_status(wire.NodeStatus(ts=T0, node=node, state="offline"), T0)
    return v


def ctx(v: ClusterView) -> Context:
    return Context(view=v, clock=SystemClock())


def decided(out: Any) -> list[tuple[str, str, str]]:
    return [(type(d).__name__, getattr(d, "job", ""), getattr(d, "node", "")) for d in out]


# -- failover ---------------------------------------------------------------------------


def test_failover_migrates_every_job_on_the_node_once() -> None:
    p = FailoverPolicy(FailoverConfig(), context=ctx(view()))
    fault = events.GpuFault(ts=T0, node="n2", gpu=1, cause="xid 79")
    out = list(p.observe(fault, T0))
    assert decided(out) == [("Migrate", "a", "n2"), ("Migrate", "b", "n2")]
    assert out[0].reason == "GpuFault on n2 GPU 1: xid 79"  # type: ignore[attr-defined]
    assert list(p.observe(events.NodeLost(ts=T0, node="n2", cause="heartbeat"), T0)) == []
    done = events.MigrationFinished(
        ts=T0, migration_id="m", job="a", node="n2", to="s0", outcome="done", downtime_s=0.3
    )
    list(p.observe(done, T0))
    assert decided(p.observe(fault, T0)) == [("Migrate", "a", "n2")]  # handled again for a
    held = events.Hold(ts=T0, policy="actuator", job="b", node="n2", reason="x", held="failover")
    list(p.observe(held, T0))
    assert decided(p.observe(fault, T0)) == [("Migrate", "b", "n2")]  # not run: decide again


@pytest.mark.parametrize(
    ("standbys", "offline"),
    [
        ({}, ()),
        ({"s0": "warming"}, ()),
        ({"s0": "ready"}, ("s0",)),
        ({"s0": "failed"}, ()),
    ],
)
def test_failover_without_a_ready_standby_is_a_checkpoint_restart(
    standbys: dict[str, str], offline: tuple[str, ...]
) -> None:
    p = FailoverPolicy(FailoverConfig(), context=ctx(view(standbys, offline)))
    out = list(p.observe(events.NodeLost(ts=T0, node="n0", cause="last_will"), T0))
    assert decided(out) == [("CheckpointRestart", "a", "n0")]
    assert "no ready standby" in out[0].reason  # type: ignore[attr-defined]


@pytest.mark.parametrize("unfit", ["gpu fault", "lost", "a member", "another gpu model"])
def test_no_migration_the_actuator_would_hold_for_want_of_a_healthy_standby(
    tmp_path: Path, unfit: str
) -> None:
    """The policies and the actuator ask the view the same question: a standby that is
    ready by its job's status but that the actuator would not take is no standby."""
    standby = "n1" if unfit == "a member" else "s0"  # n1 already runs in job a
    v = view({standby: "ready"})
    held: list[events.Event] = []
    actuator = Actuator(
        config=ActuatorConfig(), guard=GuardrailsConfig(min_standby_pool=0), view=v,
        journal=Journal(tmp_path / "j.sqlite3"), emit=lambda e, _source: held.append(e),
    )  # fmt: skip
    if unfit in ("gpu fault", "lost"):
        v.note_fault("s0", T0)  # as the daemon does when it emits the finding
    elif unfit == "another gpu model":
        for name, gpu in (("n0", "H100"), ("s0", "A100")):
            gpus = [wire.GpuInfo(index=0, name=gpu)]
            v.apply_node_status(wire.NodeStatus(ts=T0, node=name, state="online", gpus=gpus), T0)
    migrate = events.Migrate(ts=T0, policy="failover", job="a", node="n0", reason="test")
    assert actuator.on_event(migrate, T0 + 1) == []
    [hold] = held
    assert isinstance(hold, events.Hold) and "no ready standby" in hold.reason

    finding = events.NodeLost(ts=T0, node="n0", cause="last_will")
    out = list(FailoverPolicy(FailoverConfig(), context=ctx(v)).observe(finding, T0 + 1))
    assert decided(out) == [("CheckpointRestart", "a", "n0")]
    out = list(AlertPolicy(AlertConfig(), context=ctx(v)).observe(alert({"node": "n0"}), T0))
    assert decided(out) == [("CheckpointRestart", "a", "n0")]
    p = RebalancePolicy(RebalanceConfig(persist_s=0), context=ctx(v))
    list(p.observe(straggler("n0", 0.3), T0))
    [rebalance] = p.tick(T0)
    assert isinstance(rebalance, events.Hold) and "no ready standby" in rebalance.reason


def test_failover_triggers_are_configurable() -> None:
    p = FailoverPolicy(FailoverConfig(triggers=["GpuFault"]), context=ctx(view()))
    stall = events.RankStalled(ts=T0, node="n0", job="a", rank=0, last_step=5)
    assert list(p.observe(stall, T0)) == []
    with pytest.raises(ConfigError):
        FailoverConfig(triggers=["Nope"]).validate()


def test_a_finding_that_names_its_job_moves_only_that_job() -> None:
    p = FailoverPolicy(FailoverConfig(), context=ctx(view()))
    stall = events.RankStalled(ts=T0, node="n2", job="b", rank=0, last_step=5)
    assert decided(p.observe(stall, T0)) == [("Migrate", "b", "n2")]


# -- drain ------------------------------------------------------------------------------


def test_drain_and_migrate_requests() -> None:
    p = DrainPolicy(None, context=ctx(view()))
    out = list(p.observe(events.DrainRequested(ts=T0, node="n2", requested_by="alice"), T0))
    assert decided(out) == [("Migrate", "a", "n2"), ("Migrate", "b", "n2")]
    assert out[0].reason == "operator drain by alice"  # type: ignore[attr-defined]
    out = list(p.observe(events.MigrateRequested(ts=T0, job="a", node="n1", to="s0"), T0))
    assert decided(out) == [("Migrate", "a", "n1")] and out[0].to == "s0"  # type: ignore[attr-defined]
    assert decided(p.observe(events.DrainRequested(ts=T0, node="idle"), T0)) == [
        ("Hold", "", "idle")
    ]


def test_a_drain_not_carried_out_is_decided_again_with_a_growing_wait_until_done() -> None:
    v = view()
    p = drain_policy(v, {"retry_s": 10, "retry_max_s": 25})
    assert decided(p.observe(events.DrainRequested(ts=T0, node="n1", requested_by="bob"), T0)) == [
        ("Migrate", "a", "n1")
    ]
    assert list(p.tick(T0 + 100)) == []  # the decision is out: nothing to do again
    held = events.Hold(ts=T0, policy="actuator", job="a", node="n1", held="drain",
                       reason="a migration of a is in flight")  # fmt: skip
    p.observe(held, T0 + 1)
    p.observe(held, T0 + 2)  # a second word on the same decision: still one wait
    assert list(p.tick(T0 + 10)) == []
    [again] = p.tick(T0 + 11)
    assert decided([again]) == [("Migrate", "a", "n1")]
    assert again.reason == (  # type: ignore[attr-defined]
        "operator drain by bob, again (the last: a migration of a is in flight)"
    )
    p.observe(events.MigrationFinished(ts=T0, migration_id="m", job="a", node="n1", to="s0",
                                       outcome="aborted"), T0 + 20)  # fmt: skip
    assert list(p.tick(T0 + 39)) == []  # 20 s this time
    assert decided(p.tick(T0 + 40)) == [("Migrate", "a", "n1")]
    p.observe(held, T0 + 50)
    assert list(p.tick(T0 + 74)) == [] and len(list(p.tick(T0 + 75))) == 1  # capped at 25 s
    p.observe(events.MigrationFinished(ts=T0, migration_id="m", job="a", node="n1", to="s0",
                                       outcome="done"), T0 + 80)  # fmt: skip
    p.observe(held, T0 + 81)  # a late word about a drain that is over
    assert list(p.tick(T0 + 1000)) == []


def test_a_drain_is_forgotten_once_the_machine_left_the_job_another_way() -> None:
    v = view()
    p = drain_policy(v, {})
    list(p.observe(events.DrainRequested(ts=T0, node="n2"), T0))  # jobs a and b
    for job in ("a", "b"):
        p.observe(events.Hold(ts=T0, policy="actuator", job=job, node="n2", held="drain",
                              reason="no ready standby"), T0)  # fmt: skip
    # The runtime replaced n2 in job a; job b still runs on it.
    v.apply_job_status(wire.JobStatus(ts=T0 + 1, job="a", generation=1, world_size=3,
                                      members=[wire.Member(r, n) for r, n in
                                               enumerate(["n0", "n1", "s0"])]), T0 + 1)  # fmt: skip
    assert decided(p.tick(T0 + 60)) == [("Migrate", "b", "n2")]
    with pytest.raises(ConfigError, match=r"policies\.drain\.retry_max_s"):
        drain_policy(v, {"retry_s": 10, "retry_max_s": 5})


def drain_policy(v: ClusterView, table: dict[str, Any]) -> DrainPolicy:
    [spec] = configure("policies", {"drain": table}, {"drain": DrainPolicy})
    return spec.build(ctx(v))  # type: ignore[return-value]


# -- alert ------------------------------------------------------------------------------


def alert(
    labels: dict[str, str], *, status: str = "firing", fp: str = "f1", name: str = "GpuXid"
) -> events.AlertFired:
    return events.AlertFired(
        ts=T0,
        name=name,
        status=status,  # type: ignore[arg-type]
        fingerprint=fp,
        starts_at="2026-11-30T00:00:00Z",
        labels=labels,
    )


def test_alert_is_acted_on_once_per_fingerprint_and_start() -> None:
    p = AlertPolicy(AlertConfig(), context=ctx(view()))
    assert decided(p.observe(alert({"node": "n0:9100"}), T0)) == [("Migrate", "a", "n0")]
    assert list(p.observe(alert({"node": "n0:9100"}), T0)) == []  # Alertmanager resends
    assert list(p.observe(alert({"node": "n0"}, status="resolved", fp="f2"), T0)) == []
    assert decided(p.observe(alert({"node": "n2", "tmd_job": "b"}, fp="f3"), T0)) == [
        ("Migrate", "b", "n2")
    ]
    out = list(p.observe(alert({"severity": "critical"}, fp="f4"), T0))
    assert decided(out) == [("Hold", "", "")]
    assert "none of the labels 'node', 'Hostname', 'instance'" in out[0].reason  # type: ignore[attr-defined]


def test_alert_names_filter() -> None:
    p = AlertPolicy(AlertConfig(alertnames=["GpuXid"]), context=ctx(view()))
    assert list(p.observe(alert({"node": "n0"}, name="DiskFull"), T0)) == []


def test_a_dcgm_exporter_alert_moves_the_job_on_its_host() -> None:
    """What DCGM-exporter's alerts carry: the host in ``Hostname`` and ``instance``, and
    Prometheus's scrape job in ``job``, which names no training job."""
    p = AlertPolicy(AlertConfig(), context=ctx(view()))
    labels = {
        "alertname": "GpuXid", "instance": "n0:9400", "Hostname": "n0",
        "job": "dcgm-exporter", "gpu": "3", "UUID": "GPU-0a1b", "modelName": "H100",
    }  # fmt: skip
    out = list(p.observe(alert(labels), T0))
    assert decided(out) == [("Migrate", "a", "n0")]
    assert "dcgm-exporter" not in out[0].reason  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("labels", "expected"),
    [
        ({"node": "n0", "Hostname": "n3", "instance": "n3:9400"}, [("Migrate", "a", "n0")]),
        ({"Hostname": "n3", "instance": "n0:9400"}, [("Migrate", "b", "n3")]),
        ({"instance": "n3:9400"}, [("Migrate", "b", "n3")]),  # port stripped
        ({"node": "", "Hostname": "", "instance": "n3:9400"}, [("Migrate", "b", "n3")]),
        ({"instance": "10.0.0.7:9400"}, [("Hold", "", "10.0.0.7")]),  # runs no job
    ],
)
def test_the_first_node_label_present_names_the_machine(
    labels: dict[str, str], expected: list[tuple[str, str, str]]
) -> None:
    p = AlertPolicy(AlertConfig(), context=ctx(view()))
    assert decided(p.observe(alert(labels), T0)) == expected


def test_without_strip_port_the_instance_is_the_node_name() -> None:
    p = AlertPolicy(AlertConfig(strip_port=False), context=ctx(view()))
    out = list(p.observe(alert({"instance": "n3:9400"}), T0))
    assert decided(out) == [("Hold", "", "n3:9400")]
    assert "no job runs on n3:9400" in out[0].reason  # type: ignore[attr-defined]


def test_prometheus_job_label_never_names_the_training_job() -> None:
    p = AlertPolicy(AlertConfig(), context=ctx(view()))
    # The old default read `job`: this moved job b only, or restarted "dcgm-exporter".
    assert decided(p.observe(alert({"node": "n2", "job": "b"}, fp="f1"), T0)) == [
        ("Migrate", "a", "n2"),
        ("Migrate", "b", "n2"),
    ]
    assert decided(p.observe(alert({"node": "n0", "job": "dcgm-exporter"}, fp="f2"), T0)) == [
        ("Migrate", "a", "n0")
    ]
    assert decided(p.observe(alert({"node": "n2", "tmd_job": "b"}, fp="f3"), T0)) == [
        ("Migrate", "b", "n2")
    ]


@pytest.mark.parametrize(
    ("labels", "expected", "why"),
    [
        ({"node": "n0", "tmd_job": "zeta"}, ("Hold", "zeta", "n0"), "not known to this daemon"),
        ({"node": "n0", "tmd_job": "b"}, ("Hold", "b", "n0"), "does not run on n0"),
        ({"node": "n0", "tmd_job": "a/b"}, ("Hold", "", "n0"), "not known to this daemon"),
    ],
)
def test_an_alert_never_decides_for_a_job_the_daemon_does_not_hold_there(
    labels: dict[str, str], expected: tuple[str, str, str], why: str
) -> None:
    p = AlertPolicy(AlertConfig(), context=ctx(view()))
    out = list(p.observe(alert(labels), T0))
    assert decided(out) == [expected]
    reason = out[0].reason  # type: ignore[attr-defined]
    assert why in reason and repr(labels["tmd_job"]) in reason and "n0" in reason


def test_prometheus_job_label_is_refused_as_the_job_label() -> None:
    with pytest.raises(ConfigError) as caught:
        AlertConfig(job_label="job").validate()
    assert caught.value.key == "policies.alert.job_label"
    assert "scrape job" in caught.value.why
    # As the daemon reads a config file's table.
    with pytest.raises(ConfigError) as caught:
        configure("policies", {"alert": {"job_label": "job"}}, {"alert": AlertPolicy})
    assert caught.value.key == "policies.alert.job_label"
    with pytest.raises(ConfigError) as caught:
        AlertConfig(node_labels=[]).validate()
    assert caught.value.key == "policies.alert.node_labels"


def test_the_legacy_node_label_replaces_the_list() -> None:
    [spec] = configure("policies", {"alert": {"node_label": "host"}}, {"alert": AlertPolicy})
    assert spec.config.node_keys() == ["host"]
    p = AlertPolicy(spec.config, context=ctx(view()))
    labels = {"host": "n3:9100", "node": "n0", "instance": "n0:9400"}
    assert decided(p.observe(alert(labels, fp="f1"), T0)) == [("Migrate", "b", "n3")]
    assert decided(p.observe(alert({"node": "n0"}, fp="f2"), T0)) == [("Hold", "", "")]


@pytest.mark.parametrize(
    "instance", ["[fe80::1]:9400", "[fe80::1]", "fe80::1", "[2001:db8::7]:9400"]
)
def test_an_ipv6_instance_names_its_host(instance: str) -> None:
    host = instance.partition("]")[0].lstrip("[")
    v = view()
    v.apply_job_status(
        wire.JobStatus(
            ts=T0, job="v6", generation=0, world_size=2,
            members=[wire.Member(0, host), wire.Member(1, "n9")],
            standbys=[wire.StandbyInfo(node="s0", state="ready")],
        ),
        T0,
    )  # fmt: skip
    p = AlertPolicy(AlertConfig(), context=ctx(v))
    assert decided(p.observe(alert({"instance": instance}), T0)) == [("Migrate", "v6", host)]


@pytest.mark.parametrize("instance", ["gpu node/7:9400", "x" * 200, ":9400", "[fe80::1%eth0]:9400"])
def test_a_label_that_is_no_node_name_is_held(instance: str) -> None:
    p = AlertPolicy(AlertConfig(), context=ctx(view()))
    out = list(p.observe(alert({"instance": instance}), T0))
    assert decided(out) == [("Hold", "", "")]
    reason = out[0].reason  # type: ignore[attr-defined]
    assert "label instance=" in reason and "not a valid node name" in reason
    assert len(reason) < 300  # a 1 KiB label is not copied into the journal whole


# -- rebalance --------------------------------------------------------------------------


def straggler(node: str, slowdown: float, job: str = "a") -> events.StragglerFound:
    return events.StragglerFound(
        ts=T0, job=job, node=node, slowdown=slowdown, confidence=1, since_step=1
    )


def test_rebalance_migrates_the_worst_ripe_straggler_per_job_when_worth_it() -> None:
    p = RebalancePolicy(RebalanceConfig(persist_s=60), context=ctx(view()))
    list(p.observe(straggler("n0", 0.15), T0))
    list(p.observe(straggler("n1", 0.40), T0 + 30))
    assert decided(p.tick(T0 + 70)) == [("Migrate", "a", "n0")]  # n1 is not ripe yet
    out = list(p.tick(T0 + 100))
    assert decided(out) == [("Migrate", "a", "n1")]
    assert "n1 +40%" in out[0].reason  # type: ignore[attr-defined]
    list(p.observe(events.StragglerCleared(ts=T0, job="a", node="n1"), T0))
    list(p.observe(events.StragglerCleared(ts=T0, job="a", node="n0"), T0))
    assert list(p.tick(T0 + 200)) == []


def test_rebalance_weighs_saving_against_measured_downtime() -> None:
    p = RebalancePolicy(
        RebalanceConfig(persist_s=0, horizon_min=1, safety_factor=1), context=ctx(view())
    )
    list(p.observe(straggler("n0", 0.05), T0))  # saves 60 * 0.05/1.05 = 2.9 s per horizon
    assert decided(p.tick(T0)) == [("Hold", "a", "n0")]  # prior downtime 5 s
    for downtime in (1.0, 2.0, 1.5):
        list(
            p.observe(
                events.MigrationFinished(
                    ts=T0,
                    migration_id="m",
                    job="x",
                    node="y",
                    to="z",
                    outcome="done",
                    downtime_s=downtime,
                ),
                T0,
            )
        )
    assert p.expected_cost_s() == 1.5
    assert decided(p.tick(T0)) == [("Migrate", "a", "n0")]


def test_rebalance_tries_again_after_an_aborted_migration_and_not_after_a_done_one() -> None:
    p = RebalancePolicy(RebalanceConfig(persist_s=0), context=ctx(view()))
    list(p.observe(straggler("n0", 0.3), T0))
    assert decided(p.tick(T0)) == [("Migrate", "a", "n0")]

    def finished(outcome: str) -> events.MigrationFinished:
        return events.MigrationFinished(ts=T0, migration_id="m", job="a", node="n0", to="s0",
                                        outcome=outcome, downtime_s=None)  # fmt: skip

    list(p.observe(finished("aborted"), T0))  # still in the job, still slow
    assert decided(p.tick(T0 + 600)) == [("Migrate", "a", "n0")]
    list(p.observe(finished("done"), T0))  # gone
    assert list(p.tick(T0 + 1200)) == []


def test_rebalance_forgets_a_straggler_that_left_its_job_another_way() -> None:
    """Its migration aborted, then the runtime replaced it: not moved again."""
    v = view()
    p = RebalancePolicy(RebalanceConfig(persist_s=0), context=ctx(v))
    list(p.observe(straggler("n1", 0.3), T0))
    v.apply_job_status(wire.JobStatus(ts=T0, job="a", generation=1, world_size=3,
                                      members=[wire.Member(r, n) for r, n in
                                               enumerate(["n0", "s0", "n2"])]), T0)  # fmt: skip
    assert list(p.tick(T0)) == []


def test_stragglers_of_a_job_the_view_forgot_are_forgotten() -> None:
    """Not kept, nor decided about (a Hold for a job nobody sees), once the view let
    the job go; ``present`` reads the same without forgetting."""
    v = view()
    p = RebalancePolicy(RebalanceConfig(persist_s=0), context=ctx(v))
    list(p.observe(straggler("n1", 0.3), T0))
    assert v.forget_job("a")
    assert p._stragglers.present(v.jobs) == []
    assert ("a", "n1") in p._stragglers.by_key
    assert list(p.tick(T0)) == []
    assert p._stragglers.by_key == {}


def test_rebalance_holds_without_a_ready_standby() -> None:
    p = RebalancePolicy(RebalanceConfig(persist_s=0), context=ctx(view({})))
    list(p.observe(straggler("n0", 0.3), T0))
    out = list(p.tick(T0))
    assert decided(out) == [("Hold", "a", "n0")] and "no ready standby" in out[0].reason  # type: ignore[attr-defined]


def test_rebalance_ticks_at_its_configured_interval() -> None:
    p = RebalancePolicy(RebalanceConfig(interval_min=2.5), context=ctx(view()))
    assert p.tick_interval is not None and p.tick_interval.total_seconds() == 150
