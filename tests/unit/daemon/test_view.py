"""Cluster view: bounded per-rank windows; duplicate, late and out-of-order steps;
rank bounds from the job's status; caps on jobs and nodes."""

from __future__ import annotations

import msgspec
import pytest

from tmd import wire
from tmd.daemon.view import ClusterView, StepsApplied
from tmd.errors import ProtocolError

TS = 1_800_000_000.0


def batch(rank: int, steps: list[int], *, job: str = "j", compute: float = 0.5) -> wire.IterBatch:
    return wire.IterBatch(
        ts=TS,
        job=job,
        rank=rank,
        node=f"n{rank}",
        steps=[wire.StepTiming(s, TS + s, 1.0, compute, 0.4, 0.05, 0.05) for s in steps],
    )


def test_steps_land_and_duplicates_late_out_of_order_are_handled() -> None:
    view = ClusterView(window_steps=8)
    assert view.apply_iter(batch(0, [1, 2, 3]), TS).accepted == 3
    dup = view.apply_iter(batch(0, [3, 2]), TS)
    assert (dup.accepted, dup.duplicate) == (0, 2)
    view.apply_iter(batch(0, [10]), TS)  # a gap: steps 4..9 missing
    assert view.apply_iter(batch(0, [5]), TS).accepted == 1  # out of order, still in window
    late = view.apply_iter(batch(0, [2]), TS)  # 2 <= 10 - 8: older than the window
    assert (late.accepted, late.late) == (0, 1)
    rank = view.jobs["j"].ranks[0]
    assert rank.last_step == 10
    assert rank.total_steps == 5
    assert (rank.duplicates, rank.late) == (2, 1)
    assert len(rank.recent("compute_s")) == 3  # 3, 5, 10 are within the last 8 steps


def test_window_is_bounded() -> None:
    view = ClusterView(window_steps=16)
    for s in range(1, 1000):
        view.apply_iter(batch(0, [s], compute=float(s % 7) / 10), TS)
    rank = view.jobs["j"].ranks[0]
    assert len(rank.steps) == 16
    assert len(rank.recent("step_s")) == 16
    # float32 storage: approx.
    assert rank.recent("compute_s", last=2) == pytest.approx([(998 % 7) / 10, (999 % 7) / 10])


def test_rank_bound_comes_from_job_status() -> None:
    view = ClusterView(max_ranks_per_job=100)
    with pytest.raises(ProtocolError) as err:
        view.apply_iter(batch(100, [1]), TS)
    assert err.value.reason == "rank"
    view.apply_iter(batch(5, [1]), TS)
    view.apply_iter(batch(3, [1]), TS)
    status = wire.JobStatus(
        ts=TS,
        job="j",
        generation=1,
        world_size=4,
        members=[wire.Member(r, f"n{r}") for r in range(4)],
    )
    view.apply_job_status(status, TS)
    assert sorted(view.jobs["j"].ranks) == [3]  # rank 5 no longer exists
    assert view.total_ranks == 1
    with pytest.raises(ProtocolError):
        view.apply_iter(batch(4, [2]), TS)


def test_caps_on_jobs_and_nodes() -> None:
    view = ClusterView(max_jobs=2, max_nodes=1)
    view.apply_iter(batch(0, [1], job="a"), TS)
    view.apply_iter(batch(0, [1], job="b"), TS)
    with pytest.raises(ProtocolError) as err:
        view.apply_iter(batch(0, [1], job="c"), TS)
    assert err.value.reason == "limit"
    view.apply_gpu(wire.NodeGpu(ts=TS, node="x"), TS)
    with pytest.raises(ProtocolError):
        view.apply_gpu(wire.NodeGpu(ts=TS, node="y"), TS)


def test_forget_silent_and_snapshot() -> None:
    view = ClusterView()
    view.apply_iter(batch(0, [1]), TS)
    view.apply_node_status(wire.NodeStatus(ts=TS, node="n0", state="online"), TS)
    view.apply_xid(wire.XidEvent(ts=TS, node="n0", gpu=1, xid=79), TS)
    view.apply_iter(batch(0, [1], job="fresh"), TS + 100)
    snap = view.snapshot(TS + 100)
    assert snap["totals"] == {"jobs": 2, "nodes": 1, "ranks": 2}
    assert snap["nodes"][0]["last_xid"] == {"gpu": 1, "xid": 79, "ts": TS}
    assert view.forget_silent(TS + 100, after_s=50) == (1, 1)
    assert list(view.jobs) == ["fresh"] and view.total_ranks == 1


def test_last_will_after_newer_status_is_applied_in_arrival_order() -> None:
    view = ClusterView()
    view.apply_node_status(wire.NodeStatus(ts=TS + 10, node="n", state="online"), TS + 10)
    # A Last Will is composed at connect time, so its ts is older than what it replaces.
    view.apply_node_status(wire.NodeStatus(ts=TS, node="n", state="offline"), TS + 20)
    assert view.nodes["n"].state == "offline"


def test_ring_boundary() -> None:
    view = ClusterView(window_steps=8)
    view.apply_iter(batch(0, [20]), TS)
    assert view.apply_iter(batch(0, [13]), TS).accepted == 1  # 20 - 8 + 1: the oldest held
    assert view.apply_iter(batch(0, [12]), TS).late == 1  # 20 - 8: just out
    assert view.jobs["j"].ranks[0].recent("step_s", last=8) == [1.0, 1.0]


def test_rollback_to_an_earlier_step_in_a_new_generation_restarts_the_ring() -> None:
    view = ClusterView(window_steps=8)
    view.apply_iter(batch(0, list(range(1, 101)), compute=0.5), TS)
    rollback = wire.IterBatch(
        ts=TS,
        job="j",
        rank=0,
        node="n0",
        generation=1,
        steps=[wire.StepTiming(s, TS + s, 1.0, 0.9, 0.05, 0.03, 0.02) for s in range(50, 55)],
    )
    applied = view.apply_iter(rollback, TS)
    rank = view.jobs["j"].ranks[0]
    assert applied.accepted == 5 and rank.last_step == 54 and rank.generation == 1
    assert rank.recent("compute_s") == pytest.approx([0.9] * 5)
    # A late batch of the rolled-back generation neither rewinds the generation nor moves
    # the ring past the new timeline; its steps below the new front are harmless.
    stale = view.apply_iter(batch(0, [99, 53]), TS)
    assert (stale.late, stale.duplicate) == (1, 1)
    assert rank.generation == 1 and rank.last_step == 54
    # The job went back once, at generation 1, however many of its ranks show it.
    other = msgspec.structs.replace(rollback, rank=1, node="n1")
    view.apply_iter(batch(1, list(range(1, 101))), TS)
    assert (view.jobs["j"].rewinds, view.jobs["j"].rewound) == (1, (0, 1))
    assert view.jobs["j"].behind(view.jobs["j"].ranks[1])  # not yet back
    view.apply_iter(other, TS)
    assert (view.jobs["j"].rewinds, view.jobs["j"].rewound) == (1, (0, 1))
    assert not view.jobs["j"].behind(view.jobs["j"].ranks[1])


def test_a_new_run_counts_its_generations_from_zero_and_its_steps_land() -> None:
    """A job its launcher started again (``run`` 1) from a checkpoint: its runtime's
    generation is 0 again and its steps go back. Found by ``tmd sim``: before, every
    step of such a run past the old front was counted late, and the straggler
    detector went blind on every job restarted after a migration."""
    view = ClusterView(window_steps=8)

    def status(run: int, generation: int) -> wire.JobStatus:
        return wire.JobStatus(ts=TS, job="j", generation=generation, world_size=1,
                              members=[wire.Member(0, "n0", 0)], run=run)  # fmt: skip

    view.apply_job_status(status(0, 3), TS)
    old = wire.IterBatch(ts=TS, job="j", rank=0, node="n0", generation=3,
                         steps=[wire.StepTiming(s, TS + s, 1.0, 0.5, 0.4, 0.05, 0.05)
                                for s in range(1, 101)])  # fmt: skip
    view.apply_iter(old, TS)
    assert view.jobs["j"].rewinds == 0
    view.apply_job_status(status(1, 0), TS)
    assert (view.jobs["j"].rewinds, view.jobs["j"].rewound) == (1, (1, 0))
    resumed = view.apply_iter(batch(0, list(range(60, 120)), compute=0.9), TS)
    rank = view.jobs["j"].ranks[0]
    assert (resumed.accepted, resumed.late, resumed.duplicate) == (60, 0, 0)
    assert rank.last_step == 119 and rank.generation == 0
    assert rank.recent("compute_s") == pytest.approx([0.9] * 8)


def test_a_late_batch_of_the_old_run_neither_counts_nor_blinds_the_new_one() -> None:
    """The broker may deliver a batch queued before the restart after the new run's
    status (across topics MQTT keeps no order): it names its run, and is late."""
    view = ClusterView(window_steps=8)

    def iters(run: int | None, generation: int, steps: range) -> wire.IterBatch:
        return wire.IterBatch(ts=TS, job="j", rank=0, node="n0", generation=generation,
                              run=run, steps=[wire.StepTiming(s, TS + s, 1.0, 0.5, 0.4, 0.05,
                                                              0.05) for s in steps])  # fmt: skip

    view.apply_iter(iters(0, 3, range(1, 101)), TS)
    view.apply_job_status(wire.JobStatus(ts=TS, job="j", generation=0, world_size=1,
                                         members=[wire.Member(0, "n0", 0)], run=1), TS)  # fmt: skip
    late = view.apply_iter(iters(0, 3, range(101, 111)), TS)
    assert (late.accepted, late.late) == (0, 10)
    resumed = view.apply_iter(iters(1, 0, range(60, 200)), TS)
    assert (resumed.accepted, resumed.late, resumed.duplicate) == (140, 0, 0)
    # A batch of the new run that comes before its status moves the rank on by itself.
    early = view.apply_iter(iters(2, 0, range(10, 20)), TS)
    assert early.accepted == 10 and view.jobs["j"].ranks[0].run == 2
    assert (view.jobs["j"].rewinds, view.jobs["j"].rewound) == (2, (2, 0))


def test_a_rejected_batch_takes_no_job_slot() -> None:
    view = ClusterView(max_jobs=1, max_ranks_per_job=4)
    with pytest.raises(ProtocolError):
        view.apply_iter(batch(9, [1], job="bad"), TS)
    view.apply_iter(batch(0, [1], job="good"), TS)
    assert list(view.jobs) == ["good"]


def test_cap_on_ranks_over_all_jobs() -> None:
    view = ClusterView(max_ranks=2)
    view.apply_iter(batch(0, [1], job="a"), TS)
    view.apply_iter(batch(0, [1], job="b"), TS)
    view.apply_iter(batch(0, [2], job="b"), TS)  # an existing rank still reports
    with pytest.raises(ProtocolError) as err:
        view.apply_iter(batch(1, [1], job="b"), TS)
    assert err.value.reason == "limit"


def job_status(job: str, members: int, *, standbys: int = 0, excluded: int = 0) -> wire.JobStatus:
    return wire.JobStatus(
        ts=TS, job=job, generation=0, world_size=max(1, members),
        members=[wire.Member(r, f"{job}-m{r}") for r in range(members)],
        standbys=[wire.StandbyInfo(node=f"{job}-s{i}", state="ready") for i in range(standbys)],
        excluded=[f"{job}-x{i}" for i in range(excluded)],
    )  # fmt: skip


def test_the_members_a_status_lists_count_against_the_rank_cap() -> None:
    view = ClusterView(max_ranks=10)
    view.apply_job_status(job_status("a", 6), TS)
    with pytest.raises(ProtocolError) as err:
        view.apply_job_status(job_status("b", 5), TS)  # 6 + 5 > 10
    assert err.value.reason == "limit" and "b" not in view.jobs
    with pytest.raises(ProtocolError):  # standbys and excluded machines count too
        view.apply_job_status(job_status("b", 2, standbys=1, excluded=2), TS)
    view.apply_job_status(job_status("b", 2, standbys=1, excluded=1), TS)  # exactly 10
    # A member that reports costs nothing more; a rank beyond the members does.
    view.apply_iter(batch(1, [1], job="a"), TS)
    assert view.held_ranks == 10 and view.total_ranks == 1
    with pytest.raises(ProtocolError) as err:
        view.apply_iter(batch(0, [1], job="c"), TS)
    assert err.value.reason == "limit" and "c" not in view.jobs
    # A refused status leaves its job as it was; one that shrinks it frees its ranks.
    with pytest.raises(ProtocolError):
        view.apply_job_status(job_status("a", 7), TS)
    assert len(view.jobs["a"].members) == 6
    view.apply_job_status(job_status("a", 2), TS)
    assert view.held_ranks == 6
    view.apply_job_status(job_status("c", 4), TS)
    assert view.forget_job("a") and view.held_ranks == 8  # b and c
    assert view.forget_silent(TS + 100, after_s=50) == (2, 0) and view.held_ranks == 0


def test_the_view_stays_within_its_caps_whatever_names_come() -> None:
    view = ClusterView(max_jobs=64, max_nodes=256, max_ranks=1024, max_ranks_per_job=64)
    refused = 0

    def feed(i: int, now: float) -> None:
        job, name = f"job{i}", f"node{i}"
        view.note_fault(name, now, lost=i % 2 == 0)
        view.apply_node_status(node(name), now)
        view.apply_job_status(job_status(job, i % 40, standbys=i % 3), now)
        view.apply_iter(batch(i % 64, [i], job=job), now)

    for i in range(20_000):
        now = TS + i * 0.01
        try:
            feed(i, now)
        except ProtocolError as exc:
            assert exc.reason in ("limit", "rank")  # rank: past the job's world size
            refused += exc.reason == "limit"
        if i % 100 == 0:
            view.forget_silent(now, after_s=0.5)
        assert len(view.jobs) <= 64 and len(view.nodes) <= 256
        assert view.total_ranks <= view.held_ranks <= 1024
        held = sum(
            max(len(j.ranks), len(j.members)) + len(j.standbys) + len(j.excluded)
            for j in view.jobs.values()
        )
        assert view.held_ranks == held
    assert refused > 5_000  # the caps were reached, again and again
    assert len(view._faults) <= 256 and len(view._lost) <= 256


# -- ready standbys: the one definition policies, actuator and guardrails share ---------


def standby_view(standbys: dict[str, str], *, same_gpu_model: bool = True) -> ClusterView:
    view = ClusterView(same_gpu_model=same_gpu_model)
    view.apply_job_status(
        wire.JobStatus(
            ts=TS,
            job="j",
            generation=1,
            world_size=2,
            members=[wire.Member(0, "w0"), wire.Member(1, "w1")],
            standbys=[
                wire.StandbyInfo(node=n, state=s)  # type: ignore[arg-type]
                for n, s in standbys.items()
            ],
        ),
        TS,
    )
    return view


def node(name: str, *, ts: float = TS, state: str = "online", gpu: str = "") -> wire.NodeStatus:
    gpus = [wire.GpuInfo(index=0, name=gpu)] if gpu else []
    return wire.NodeStatus(ts=ts, node=name, state=state, gpus=gpus)  # type: ignore[arg-type]


def test_a_ready_standby_is_ready_by_its_job_and_not_already_a_member() -> None:
    view = standby_view(
        {"s3": "ready", "s0": "ready", "s1": "warming", "s2": "failed", "w1": "ready"}
    )
    assert view.ready_standbys("j") == ["s0", "s3"]
    assert view.ready_standbys("nope") == []
    assert wire.ready_standbys(view.jobs["j"].standbys.values(), {"s3"}) == ["s0", "w1"]


def test_a_standby_on_an_offline_node_is_not_ready() -> None:
    view = standby_view({"s0": "ready", "s1": "ready"})
    view.apply_node_status(node("s0", state="offline"), TS)
    assert view.ready_standbys("j") == ["s1"]


def test_a_faulty_standby_is_out_until_its_agent_reports_after_the_fault() -> None:
    view = standby_view({"s0": "ready", "s1": "ready"})
    view.apply_node_status(node("s0"), TS)
    view.note_fault("s0", TS + 5)  # a GpuFault
    view.note_fault("s1", TS + 5, lost=True)  # a NodeLost, its node never reported
    assert view.ready_standbys("j") == [] and not view.healthy("s0")
    view.apply_node_status(node("s0", ts=TS + 4), TS + 6, live=False)  # a retained copy
    view.apply_gpu(wire.NodeGpu(ts=TS + 6, node="s0"), TS + 6)  # a GPU fault outlives beats
    assert view.ready_standbys("j") == []
    # Its agent restarted, on a clock an hour behind the daemon's: received after.
    view.apply_node_status(node("s0", ts=TS - 3600), TS + 7)
    assert view.ready_standbys("j") == ["s0"] and view.healthy("s0")
    # s1 was lost: a retained status the broker replays on a reconnect is no sign of
    # life (a dead agent's last one is such); anything its agent sends live after the
    # loss is, whatever its clock says.
    view.apply_node_status(node("s1"), TS + 7.5, live=False)
    assert view.ready_standbys("j") == ["s0"]
    view.apply_gpu(wire.NodeGpu(ts=TS - 3600, node="s1"), TS + 8)
    assert view.ready_standbys("j") == ["s0", "s1"]


def test_a_standby_must_carry_the_leavers_gpu_model_when_both_are_known() -> None:
    for same in (True, False):
        view = standby_view({"s0": "ready", "s1": "ready", "s2": "ready"}, same_gpu_model=same)
        for name, gpu in [("w0", "H100"), ("s0", "A100"), ("s1", "H100")]:  # s2: unknown
            view.apply_node_status(node(name, gpu=gpu), TS)
        assert view.ready_standbys("j") == ["s0", "s1", "s2"]  # no leaver, no model to match
        want = ["s1", "s2"] if same else ["s0", "s1", "s2"]
        assert view.ready_standbys("j", leaver="w0") == want
        assert view.ready_standbys("j", leaver="w1") == ["s0", "s1", "s2"]  # w1's unknown


# -- machines: a member is (rank, machine, local rank) -----------------------------------


def machines_view(standbys: dict[str, int]) -> ClusterView:
    """Job j on h0 and h1, two ranks each (h1's listed out of order), and standby
    machines of the given slots, all ready."""
    view = ClusterView()
    members = [wire.Member(0, "h0", 0), wire.Member(1, "h0", 1), wire.Member(3, "h1", 1),
               wire.Member(2, "h1", 0)]  # fmt: skip
    infos = [wire.StandbyInfo(node=n, state="ready", slots=k) for n, k in standbys.items()]
    view.apply_job_status(
        wire.JobStatus(ts=TS, job="j", generation=0, world_size=4, members=members, standbys=infos),
        TS,
    )
    return view


def test_a_job_knows_its_machines_and_the_local_rank_of_each_rank() -> None:
    job = machines_view({}).jobs["j"]
    assert job.local_ranks == {0: 0, 1: 1, 2: 0, 3: 1}
    assert job.machines() == {"h0": [0, 1], "h1": [2, 3]}
    assert (job.slots("h1"), job.slots("elsewhere")) == (2, 0)


def test_ready_standbys_for_a_machine_have_as_many_slots_as_it_has_ranks() -> None:
    view = machines_view({"s1": 1, "s2": 2, "s4": 4})
    assert view.ready_standbys("j", leaver="h0") == ["s2"]
    assert view.ready_standbys("j") == ["s1", "s2", "s4"]  # no machine to fit
    assert view.ready_standbys("j", leaver="elsewhere") == ["s1", "s2", "s4"]  # runs none
    view.note_fault("s2", TS)  # the other checks still apply
    assert view.ready_standbys("j", leaver="h0") == []


def test_a_status_from_before_machines_is_one_rank_per_machine() -> None:
    view = standby_view({"s0": "ready"})
    job = view.jobs["j"]
    assert job.local_ranks == {0: None, 1: None}
    assert job.machines() == {"w0": [0], "w1": [1]}
    assert view.ready_standbys("j", leaver="w0") == ["s0"]  # a standby of one slot


def test_a_job_keeps_its_run_and_the_machines_it_excludes() -> None:
    view = ClusterView()
    status = wire.JobStatus(
        ts=TS, job="j", generation=0, world_size=1, members=[wire.Member(0, "w0")],
        state="restarting", run=2, excluded=["w1"],
    )  # fmt: skip
    view.apply_job_status(status, TS)
    job = view.jobs["j"]
    assert (job.run, job.excluded) == (2, {"w1"})


def test_a_machine_is_lost_until_its_agent_reports_again() -> None:
    view = ClusterView()
    view.apply_node_status(node("w0"), TS)
    view.note_fault("w0", TS + 1)  # a GpuFault: the machine is up
    assert not view.lost("w0")
    view.note_fault("w0", TS + 2, lost=True)  # a NodeLost
    assert view.lost("w0") and not view.lost("w9")
    view.apply_gpu(wire.NodeGpu(ts=TS, node="w0"), TS + 2)  # no later than the loss
    assert view.lost("w0")
    view.apply_gpu(wire.NodeGpu(ts=TS, node="w0"), TS + 3)  # a sample after it
    assert not view.lost("w0")
    view.apply_node_status(node("w0", ts=TS + 4, state="offline"), TS + 4)  # its Last Will
    assert view.lost("w0")
    view.note_fault("w8", TS, lost=True)  # a machine never heard of
    assert view.lost("w8")


def test_a_reader_that_must_change_nothing_gets_the_same_answers() -> None:
    """``forget=False`` (``/metrics``): the same answers, and the faults and losses the
    agents have since got over stay noted until a reader that may forget asks."""
    view = standby_view({"s0": "ready", "s1": "ready"})
    view.apply_node_status(node("s0"), TS)
    view.note_fault("s0", TS + 1)
    view.note_fault("s1", TS + 1, lost=True)
    assert view.gpu_faulty("s0", forget=False) and view.lost("s1", forget=False)
    view.apply_node_status(node("s0"), TS + 2)  # its agent restarted after the fault
    view.apply_gpu(wire.NodeGpu(ts=TS, node="s1"), TS + 2)  # a sign of life after the loss
    noted = (dict(view._faults), dict(view._lost))
    assert not view.gpu_faulty("s0", forget=False) and not view.lost("s1", forget=False)
    assert view.healthy("s0", forget=False) and view.healthy("s1", forget=False)
    assert view.ready_standbys("j", forget=False) == ["s0", "s1"]
    assert (view._faults, view._lost) == noted  # nothing forgotten
    assert view.ready_standbys("j") == ["s0", "s1"]
    assert (view._faults, view._lost) == ({}, {})


def test_columns_grow_and_are_given_back_without_losing_steps() -> None:
    """A job's columns double as ranks join (what was written before stays, what is
    written after lands in the new arrays), and a rank that leaves frees its column
    for the next, emptied."""
    view = ClusterView(window_steps=8)
    for r in range(20):  # 8 columns at first: grown twice
        view.apply_iter(batch(r, [1, 2], compute=0.1 * (r % 5)), TS)
    for r in range(20):
        view.apply_iter(batch(r, [3], compute=0.1 * (r % 5)), TS)
    job = view.jobs["j"]
    assert job.cols is not None and job.cols.capacity == 32
    for r in (0, 7, 19):
        assert job.ranks[r].recent("compute_s") == pytest.approx([0.1 * (r % 5)] * 3)
        assert job.ranks[r].busy_at(3) == pytest.approx(0.6)
    assert job.cols.held(3).sum() == 20
    status = wire.JobStatus(ts=TS, job="j", generation=0, world_size=19,
                            members=[wire.Member(r, f"n{r}") for r in range(19)])  # fmt: skip
    view.apply_job_status(status, TS)  # rank 19 leaves
    assert 19 not in job.ranks and job.cols.held(3).sum() == 19
    view.apply_job_status(msgspec.structs.replace(status, world_size=20), TS)
    view.apply_iter(batch(19, [3], compute=0.9), TS)  # back, in a fresh column
    assert job.ranks[19].recent("compute_s") == pytest.approx([0.9])


def test_relayed_batches_land_as_the_same_batches_published_by_their_ranks() -> None:
    """``apply_relayed`` takes the usual batch (a held rank, in its run and generation)
    straight into its column: the same view, the same counts and the same refusals as
    each batch through ``apply_steps``, over every case it must hand on: new ranks,
    steps twice and too late, several steps a batch, a rank placed on another machine,
    a new generation that rolled back, one of an older generation, a new run, a rank
    beyond the job's size, and a leaver's last batch of an earlier generation from the
    machine it left."""
    # Rank 2 unplaced (a status that lists only some members): any agent may relay it.
    members = [wire.Member(0, "m0"), wire.Member(1, "m0"), wire.Member(3, "m1")]
    status = wire.JobStatus(ts=TS, job="j", generation=0, world_size=4, members=members)

    def b(rank: int, steps: list[int], gen: int = 0, run: int | None = None) -> wire.IterBatch:
        timings = [wire.StepTiming(s, TS + s + rank / 10, 1.0, 0.5 + rank / 100, 0.4, 0.05,
                                   0.01 * s) for s in steps]  # fmt: skip
        return wire.IterBatch(ts=TS, job="j", rank=rank, node="m0", generation=gen, run=run,
                              steps=timings)  # fmt: skip

    messages = [
        [b(0, [1]), b(1, [1, 2]), b(2, [1])],  # new ranks
        [b(0, [2]), b(1, [2, 3]), b(3, [2]), b(2, [2, 3, 4])],  # a duplicate; 3 is on m1
        # 0's new generation; 1's step 1 again; 2's step 5 too late after 14 (window 8)
        [b(0, [3], gen=1), b(1, [1]), b(2, [14]), b(2, [5])],
        [b(0, [2], gen=1), b(1, [5]), b(2, [15]), b(1, [6], run=1)],  # 0 rolled back; new run
        [b(0, [9], gen=0), b(4, [1]), b(1, [1], run=0)],  # old generation; old run
        [b(2, [16], run=0), b(0, [3], gen=1)],  # rank 2 moved to m2; 0 is m0's
        # After the job's generation 2 (below): from m1, rank 0's last batch of
        # generation 1 (a leaver's, from where it ran) is taken, rank 1's of 2 is not.
        [b(0, [4], gen=1), b(1, [7], gen=2, run=1)],
    ]
    nodes = ["m0"] * 5 + ["m2", "m1"]  # the sixth relayed by m2's agent, the last by m1's
    by_rank, relayed = ClusterView(window_steps=8), ClusterView(window_steps=8)
    for view in (by_rank, relayed):
        view.apply_job_status(status, TS)
    for t, (node, batches) in enumerate(zip(nodes, messages, strict=True)):
        now = TS + t  # so that a view not told when it heard of a rank shows
        if t == len(messages) - 1:
            newer = msgspec.structs.replace(status, generation=2)
            for view in (by_rank, relayed):
                view.apply_job_status(newer, now - 0.5)
        job = by_rank.jobs["j"]
        refusals, want_counts = [], StepsApplied()
        for i, batch_ in enumerate(batches):
            placed = job.members.get(batch_.rank, node)
            if placed != node and batch_.generation >= job.generation:
                refusals.append((i, "mismatch"))
                continue
            try:
                by_rank.apply_steps("j", batch_.rank, node, batch_.generation, batch_.run,
                                    batch_.rows(), now, want_counts)  # fmt: skip
            except ProtocolError as exc:
                refusals.append((i, exc.reason))
        (columns,) = wire.RelayedBatches.of(batches)
        counts = StepsApplied()
        taken, refused = relayed.apply_relayed(columns, node, now, counts)
        assert [(i, exc.reason) for i, exc in refused] == refusals
        assert sorted(taken + [i for i, _ in refused]) == list(range(len(batches)))
        assert counts == want_counts
    assert refusals == [(1, "mismatch")]  # the last message: rank 0's taken
    want, got = by_rank.jobs["j"], relayed.jobs["j"]
    assert sorted(got.ranks) == sorted(want.ranks) == [0, 1, 2]
    assert (got.last_seen, got.held) == (want.last_seen, want.held)
    assert (relayed.held_ranks, relayed.total_ranks) == (by_rank.held_ranks, by_rank.total_ranks)
    assert sum(state.late for state in got.ranks.values()) > 0  # the cases above happened
    for r, state in want.ranks.items():
        mine = got.ranks[r]
        for name in ("generation", "run", "last_step", "total_steps", "duplicates", "late",
                     "node", "steps", "last_seen"):  # fmt: skip
            assert getattr(mine, name) == getattr(state, name), (r, name)
        for step in state.steps:
            if step >= 0:
                assert mine.busy_at(step) == state.busy_at(step)
    assert (got.cols.timings[:, :, : got.cols.n] == want.cols.timings[:, :, : want.cols.n]).all()


def test_columns_are_made_for_a_status_members_at_once_within_max_ranks() -> None:
    """A job's columns are made for the members its status lists (one allocation, not
    a copy at each doubling); columns are never given back to memory, so a status that
    lists many members and then none does not leave room for the next job's status to
    add to: what all jobs' columns hold stays within ``max_ranks``."""
    view = ClusterView(window_steps=8, max_ranks=256, max_jobs=8)
    row = (1, TS, 1.0, 0.5, 0.1, 0.1, 0.1)
    for j in range(4):
        name = f"j{j}"
        members = [wire.Member(r, "n0") for r in range(200)]
        view.apply_job_status(wire.JobStatus(ts=TS, job=name, generation=0, world_size=256,
                                             members=members), TS)  # fmt: skip
        view.apply_steps(name, 0, "n0", 0, 0, [row], TS)
        cols = view.jobs[name].cols
        assert cols is not None
        if j == 0:
            assert cols.capacity == 200  # made at once
        view.apply_job_status(wire.JobStatus(ts=TS, job=name, generation=0, world_size=256,
                                             members=[]), TS)  # fmt: skip
    # (each job's first 8 columns aside, as before: unbounded, this was 800)
    assert sum(v.cols.capacity for v in view.jobs.values() if v.cols is not None) <= 256 + 4 * 8
    assert view.jobs["j0"].ranks[0].steps.count(1) == 1


def test_a_relayed_rank_new_to_the_view_takes_its_first_step_inline() -> None:
    """A cluster's first second brings every rank's first step: a relayed batch of a
    rank the view does not hold yet is taken where the usual one is (not through
    ``apply_steps``, a call and rows per step), in its generation, within the job's
    bounds; one of a new run still goes through ``apply_steps``, which notes the run."""
    view = ClusterView()
    members = [wire.Member(r, "n0", r) for r in range(3)]
    view.apply_job_status(wire.JobStatus(ts=TS, job="j", generation=4, world_size=3,
                                         members=members), TS)  # fmt: skip

    def relayed(rank: int, run: int | None) -> wire.RelayedBatches:
        step = wire.StepTiming(7, TS, 1, 0.6, 0.3, 0.05, 0.05)
        batch = wire.IterBatch(ts=TS, job="j", rank=rank, node="n0", generation=4, run=run,
                               steps=[step])  # fmt: skip
        (columns,) = wire.RelayedBatches.of([batch])
        return columns

    calls = []
    apply_steps = view.apply_steps
    view.apply_steps = lambda *a, **k: calls.append(a[1]) or apply_steps(*a, **k)  # type: ignore[method-assign]
    for rank, run in ((0, None), (1, 0), (2, 3)):
        taken, refused = view.apply_relayed(relayed(rank, run), "n0", TS, StepsApplied())
        assert (taken, refused) == ([0], [])
    assert calls == [2]  # the new run only
    ranks = view.jobs["j"].ranks
    assert [(ranks[r].generation, ranks[r].last_step, ranks[r].total_steps) for r in (0, 1)] == [
        (4, 7, 1),
        (4, 7, 1),
    ]
    assert (ranks[2].run, view.total_ranks) == (3, 3)
    taken, refused = view.apply_relayed(relayed(5, None), "n0", TS, StepsApplied())
    assert taken == [] and refused[0][1].reason == "rank"


def test_step_zero_is_held_only_by_the_ranks_that_reported_it() -> None:
    """The columns tag each row with its step + 1 (new columns are zeros, untouched
    memory): a row never written holds no step, not step 0."""
    view = ClusterView(window_steps=8)
    for rank in (0, 1):
        step = wire.StepTiming(rank * 8, TS, 1, 0.6, 0.3, 0.05, 0.05)
        view.apply_iter(wire.IterBatch(ts=TS, job="j", rank=rank, node="n", steps=[step]), TS)
    cols, ranks = view.jobs["j"].cols, view.jobs["j"].ranks
    assert cols is not None
    assert cols.held(0).tolist() == [True, False] and cols.held(8).tolist() == [False, True]
    assert ranks[0].steps == [0, -1, -1, -1, -1, -1, -1, -1]
    assert ranks[1].busy_at(0) is None and ranks[0].busy_at(0) == pytest.approx(0.7)
    again = wire.IterBatch(ts=TS, job="j", rank=0, node="n",
                           steps=[wire.StepTiming(0, TS, 1, 0.6, 0.3, 0.05, 0.05)])  # fmt: skip
    assert view.apply_iter(again, TS).duplicate == 1
