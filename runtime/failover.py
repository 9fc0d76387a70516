"""Unplanned replacement: a machine died; a standby machine takes its place from replicas.

No rollback. The machine is the unit: a host whose processes die (all K of them,
or only some: a machine that lost a rank is not trusted with the others) is
replaced as a whole by a ready standby machine of K slots, its rank of local rank i
by the standby's slot i. The ranks of a machine die during step ``t``; the
survivors' gradient all-reduce of ``t`` fails, and none of them has applied ``t``.
Each survivor then:

1. registers as alive for the current generation in the store and waits for the
   others: until ``world - 1`` registered, or the missing ranks are whole machines
   none of whose processes answered as present (``liveness.Presence``, a thread in
   every worker: a live member still computing its step answers at once) and nobody
   registered for ``SessionConfig.detect_settle``, or ``detect_timeout``. What it
   saw (the machines with a missing rank, every survivor outside them at the same
   step; or not) is its proposal; the first proposal stored wins (``compare_set``),
   so all survivors act on one decision even when their views raced. A live process
   on a lost machine leaves the job;
2. the lowest surviving rank waits up to ``standby_wait`` for one ready standby
   machine of the right size per lost machine and publishes the plan, addressed
   to every slot of those standbys; each rank to replace gets a *donor*, the
   survivors in turn;
3. everyone builds the next generation's group with the standby slots in the dead
   ranks' places, and each donor sends its slots its bulk state (still that of
   step ``t - 1``, identical on every replica) and the small state, with the data
   position the dead rank had at the start of ``t``;
4. the survivors re-run the all-reduce of ``t`` on the new group from their
   still-intact local gradients, while the standbys compute the dead ranks'
   gradients for ``t`` in the user's loop. Step ``t`` completes at full size, and
   the lowest survivor acks ``switched`` for ``failover-g{generation}`` with the
   downtime: step ``t``'s duration minus a median step (``Recovery.downtime``).

Two machines lost at once are replaced by two standby machines when two are
ready, in the same generation. Should a member of the new group die during that
re-run, the same protocol runs again for the next generation. Where this cannot
serve (survivors at different steps, no survivor outside the lost machines, too
few ready standby machines of the right size within ``standby_wait``, or a failure
while recovering) every survivor acks ``failed`` for ``failover-g{generation}``,
saying which checkpoint the job rolls back to, and raises ``RestartRequired``: the
job is restarted and every rank resumes from the latest checkpoint
(``tmd.runtime.checkpoint``).

The dead ranks' RNG streams are lost with them; each joiner continues with its
donor's.

A job wrapped by torch's parallelism (``tmd.runtime.parallel``: DDP, FSDP2, HSDP)
reduces its gradients inside the user's backward, so the survivors cannot re-run
the reduction alone. Their collectives of step ``t`` go through
``swap_group.Guard``, which answers them locally once one failed (or a member
reported a failure: ``report_failure``, ``Presence``), so the user's backward
ends; at ``step`` they run the same protocol, each lost rank's donor a survivor
holding what it held (``Session.replicas``: any survivor of a DDP job, the same
shard in another replica group of an HSDP one; none in FSDP2 on one mesh dimension
or tensor parallelism, which roll back), every group's next inner group built
along with the world (``swap_group.build_inner``), and every survivor undoes step
``t`` (gradients dropped, data position and RNG streams put back as ``t`` found
them) and runs it again with the standby slots, which learnt their ranks in
``parallel.init``.

Both sides end in a ``Reconfiguration`` (the survivors' in ``Recovery.change``) that
the session applies; nothing here writes the session's group or membership.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from torch._C._distributed_c10d import Store

from tmd import wire
from tmd.errors import MigrationError, RestartRequired
from tmd.runtime import swap_group
from tmd.runtime.checkpoint import latest_step
from tmd.runtime.control import put, standbys
from tmd.runtime.env import RuntimeEnv, slot_name
from tmd.runtime.group import Group, make_group
from tmd.runtime.liveness import fail_prefix, present, wake
from tmd.runtime.membership import Membership, Reconfiguration
from tmd.runtime.swap_group import Op
from tmd.runtime.transfer import Kind, TransferChannel

if TYPE_CHECKING:
    from tmd.runtime.session import Session

Decision = dict[str, Any]


@dataclass(frozen=True)
class Recovery:
    """One survivor's part in replacing lost machines; durations in seconds."""

    id: str
    swaps: dict[str, str]
    """Each lost machine and the standby machine that replaces it."""
    reports: bool
    """This survivor acks the failover for the job (the lowest surviving rank)."""
    detect_s: float
    """From the start of the failed collective to the agreed decision."""
    transfer_s: float
    """This survivor's state transfers to its joiners (0 if it donates to none)."""
    build_s: float
    """Building the next generation's group."""
    change: Reconfiguration
    """This survivor's place in the next generation's group."""
    prefix: str = ""
    """Where the survivors agreed (``liveness.fail_prefix``)."""
    survivors: tuple[int, ...] = ()
    """The ranks that survived (the plan's donors among them)."""

    def describe(self) -> str:
        return ", ".join(f"{lost} replaced by {new}" for lost, new in self.swaps.items())

    def downtime(self, step_start: float, step_end: float, median_step_s: float) -> wire.Downtime:
        """The failed step against a median one: what the failure cost the job, from
        the start of the step whose collective failed to the end of its re-run, minus
        a median step. Unclamped; ``first_step_s`` is the rest once detection,
        transfer and the group build are taken out, so the parts add up."""
        total = step_end - step_start - median_step_s
        return wire.Downtime(
            total_s=total,
            stop_s=self.detect_s,
            transfer_s=self.transfer_s,
            switch_s=self.build_s,
            first_step_s=total - self.detect_s - self.transfer_s - self.build_s,
        )


def plan_key(slot: str) -> str:
    return f"tmd/failover/{slot}"


class Replaced(MigrationError):
    """This process's machine was counted lost and replaced (it registered too late,
    or a sibling on its machine died): the job goes on without this process, so this
    is no reason to restart the job."""


def failure_reported(store: Store, generation: int) -> bool:
    """Has a member of ``generation`` reported a failed collective?"""
    return bool(store.check([f"{fail_prefix(generation)}/alive"]))


def report_failure(store: Store, generation: int) -> None:
    """Tell every member of ``generation`` that a collective failed here, before this
    process registers as a survivor (a wrapped job's rank finishes its step first):
    their ``Presence`` threads answer, and their guards stop waiting."""
    store.add(f"{fail_prefix(generation)}/alive", 0)  # the key exists: a failure
    wake(store, generation)


def recover(session: Session, error: BaseException, *, collective_started: float) -> Recovery:
    """Survivor side, with no planned migration left open. Returns this survivor's
    part, its place in the new full-size group included (``Recovery.change``); where
    no standby machine can take a lost machine's place this acks ``failed`` and
    raises ``RestartRequired``; a process on a lost machine raises ``Replaced``."""
    gen = session.membership.generation
    prefix, migration_id = fail_prefix(gen), f"failover-g{gen}"
    try:
        decision = _agree(session, prefix)
        detect_s = time.monotonic() - collective_started
        if decision["action"] != "replace":
            give_up(session, migration_id, decision["reason"], error)
        plan = _plan(session, decision, prefix)
        if "swaps" not in plan:
            give_up(session, migration_id, plan["reason"], error)
        return _replace(session, plan, prefix, detect_s=detect_s)
    except Replaced:
        raise
    except (MigrationError, RuntimeError) as exc:
        give_up(session, migration_id, f"recovery of generation {gen} failed: {exc}", exc)


def wrapped_failure(session: Session, error: BaseException) -> None:
    """A worker of a job wrapped by torch's parallelism (``tmd.runtime.parallel``)
    whose loop raised ``error`` outside the guarded part of a step (a checkpoint's
    collectives, the script's own between steps): no step to undo. If the survivors
    agree that members were lost, every one of them acks ``failed`` and raises
    ``RestartRequired``: the job rolls back to its checkpoint. Returns where nobody
    was lost (the error is not a lost member's) or this process was counted lost
    itself."""
    gen = session.membership.generation
    prefix, migration_id = fail_prefix(gen), f"failover-g{gen}"
    not_built = "a member lost outside a step of a wrapped job is not failed over in place"
    try:
        decision = _agree(session, prefix)
    except Replaced as exc:  # its machine lost a rank: the restart goes on without it
        give_up(session, migration_id, f"{exc}; {not_built}", error)
    except (MigrationError, RuntimeError):
        return
    # Lost: a rank that neither registered nor answered as present. A member still
    # blocked in the wrapper's collective answers (its Presence thread), so an error
    # of one rank's own (a bug, out of memory) blames no machine.
    alive = set(decision.get("alive") or _alive(session, prefix))
    gone = set(range(session.world_size)) - alive - present(session.store, gen)
    if not gone:
        return
    lost = sorted({session.membership.nodes[r] for r in gone})
    give_up(session, migration_id, f"lost {', '.join(lost)}: {not_built}", error)


def _wait_for_survivors(session: Session, prefix: str) -> None:
    """Until there is no point waiting for more members to register as alive: all but
    one did; or the missing ranks make up whole machines, none of their processes
    answered as present (``liveness.Presence``: a live one still computing its step
    does, at once) and nobody registered for ``detect_settle``; or a decision is
    already stored; or ``detect_timeout``."""
    store, world, cfg = session.store, session.world_size, session.config
    gen = session.membership.generation
    now = time.monotonic()
    deadline = now + cfg.detect_timeout.total_seconds()
    settle = cfg.detect_settle.total_seconds()
    last, changed, alive = -1, now, set[int]()
    while True:
        count = int(store.add(f"{prefix}/alive", 0))
        now = time.monotonic()
        if count != last:
            last, changed, alive = count, now, set(_alive(session, prefix))
        if count >= world - 1 or now > deadline or store.check([f"{prefix}/decision"]):
            return
        if now - changed >= settle and not _partial(session, alive):
            missing = set(range(world)) - alive
            if not missing & present(store, gen):
                return
            time.sleep(0.01)  # a live member is on its way: wait for it
        time.sleep(0.002)


def _alive(session: Session, prefix: str) -> list[int]:
    """The ranks registered alive (one store read, whatever the world size)."""
    if not session.store.check([f"{prefix}/alive-list"]):
        return []
    listed = bytes(session.store.get(f"{prefix}/alive-list")).decode().split(",")
    return sorted({int(r) for r in listed if r})


def _partial(session: Session, alive: set[int]) -> bool:
    """Is a machine missing only some of its ranks (the rest may still register)?"""
    return any(
        0 < len(alive & set(ranks)) < len(ranks) for ranks in session.membership.machines().values()
    )


def _agree(session: Session, prefix: str) -> Decision:
    store, me, world = session.store, session.rank, session.world_size
    membership = session.membership
    gen = membership.generation
    put(store, f"{prefix}/alive/{me}", str(session.state.step).encode())
    store.append(f"{prefix}/alive-list", f"{me},")  # type: ignore[attr-defined]
    store.add(f"{prefix}/alive", 1)
    wake(store, gen)  # every live member's Presence answers
    _wait_for_survivors(session, prefix)
    alive = _alive(session, prefix)
    lost = sorted({membership.nodes[r] for r in range(world) if r not in alive})
    keep = [r for r in alive if membership.nodes[r] not in lost]
    steps = sorted({int(store.get(f"{prefix}/alive/{r}")) for r in keep})
    proposal: Decision
    if not lost:
        proposal = {"action": "rollback", "reason": "a collective failed, no rank was lost"}
    elif not keep:
        proposal = {"action": "rollback", "reason": f"no survivor outside the lost {lost}"}
    elif len(steps) != 1:
        proposal = {"action": "rollback", "reason": f"survivors failed at steps {steps}"}
    else:
        proposal = {"action": "replace", "alive": keep, "lost": lost}
    stored = store.compare_set(f"{prefix}/decision", "", json.dumps(proposal))
    decision: Decision = json.loads(bytes(stored))
    if decision["action"] == "replace" and me not in decision["alive"]:
        raise Replaced(f"rank {me} on {membership.nodes[me]} was counted lost in generation {gen}")
    return decision


def _plan(session: Session, decision: Decision, prefix: str) -> dict[str, Any]:
    reporter = min(decision["alive"])
    if session.rank == reporter:
        return _make_plan(session, decision, prefix=prefix)
    cfg = session.config
    wait_s = (cfg.standby_wait + cfg.detect_timeout).total_seconds()
    deadline = time.monotonic() + wait_s
    while not session.store.check([f"{prefix}/plan"]):
        if time.monotonic() > deadline:
            return {"reason": f"no failover plan from rank {reporter} within {wait_s:g} s"}
        time.sleep(0.005)
    plan: dict[str, Any] = json.loads(bytes(session.store.get(f"{prefix}/plan")))
    return plan


def _match(
    registry: list[wire.StandbyInfo], members: set[str], sizes: dict[str, int]
) -> dict[str, str] | None:
    """A ready standby machine of the right size for every lost machine, or None."""
    swaps: dict[str, str] = {}
    for lost, size in sizes.items():
        taken = members | set(swaps.values())
        ready = wire.ready_standbys(registry, taken, slots=size)
        if not ready:
            return None
        swaps[lost] = ready[0]
    return swaps


def _make_plan(session: Session, decision: Decision, *, prefix: str) -> dict[str, Any]:
    membership = session.membership
    lost: list[str] = decision["lost"]
    sizes = {node: len(membership.ranks_of(node)) for node in lost}
    members = set(membership.nodes)
    plan: dict[str, Any]
    donors = _donors(session, decision)
    if isinstance(donors, str):
        plan = {"reason": donors}
        put(session.store, f"{prefix}/plan", json.dumps(plan).encode())
        return plan
    wait_s = session.config.standby_wait.total_seconds()
    deadline = time.monotonic() + wait_s
    while True:  # a standby still warming up may become ready in time
        swaps = _match(standbys(session.store), members, sizes)
        if swaps is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if swaps is None:
        want = ", ".join(f"{n} ({k} slot{'s' if k > 1 else ''})" for n, k in sizes.items())
        plan = {"reason": f"no ready standby machine within {wait_s:g} s to replace {want}"}
        put(session.store, f"{prefix}/plan", json.dumps(plan).encode())
        return plan
    dead = [r for node in lost for r in membership.ranks_of(node)]
    ranks: list[list[Any]] = [  # [rank, donor, joiner, local rank]
        [rank, donors[rank], swaps[membership.nodes[rank]], membership.local_rank(rank)]
        for rank in dead
    ]
    plan = {
        "id": f"failover-g{membership.generation}",
        "swaps": swaps,
        "ranks": ranks,
        "reporter": min(decision["alive"]),
        "prefix": prefix,
        "world_size": session.world_size,
    }
    data = json.dumps(plan).encode()
    put(session.store, f"{prefix}/plan", data)
    for _, _, joiner, local_rank in ranks:
        put(session.store, plan_key(slot_name(joiner, local_rank)), data)
    return plan


def _donors(session: Session, decision: Decision) -> dict[int, int] | str:
    """Each lost rank's donor: a survivor holding what it held (``Session.replicas``),
    the survivors taking turns; or why there is none (the job rolls back)."""
    membership = session.membership
    alive = sorted(decision["alive"])
    layout = session.bucket_layout()
    if layout is not None and not layout["final"]:
        return ("a DDP job failed before its reducer rebuilt its buckets (its first steps): "
                "a joiner, warmed alone, would bucket its gradients otherwise")  # fmt: skip
    load = dict.fromkeys(alive, 0)
    donors: dict[int, int] = {}
    for node in decision["lost"]:
        for rank in membership.ranks_of(node):
            candidates = [r for r in alive if r in session.replicas[rank]]
            if not candidates:
                return (f"lost {', '.join(decision['lost'])}, and no survivor holds the "
                        f"shards of its rank {rank} (no replica of them: FSDP2 on one mesh "
                        "dimension, tensor parallelism)")  # fmt: skip
            donor = min(candidates, key=lambda r: (load[r], r))
            load[donor] += 1
            donors[rank] = donor
    return donors


def _replace(session: Session, plan: dict[str, Any], prefix: str, *, detect_s: float) -> Recovery:
    store, me, cfg = session.store, session.rank, session.config
    after = session.membership.replaced(plan["swaps"])
    started = time.monotonic()
    for rank, donor, _, _ in plan["ranks"]:
        if donor != me:
            continue
        pair = make_group(store, f"{prefix}/xfer/{rank}", rank=0, size=2,
                          timeout=cfg.group_timeout, backend="gloo",
                          host=session.env.host)  # fmt: skip
        channel = TransferChannel(pair, is_leaver=True)
        payload = {
            "rank": rank,
            "nodes": list(after.nodes),
            "local_ranks": [after.local_rank(r) for r in range(len(after.nodes))],
            "generation": after.generation,
            "migration_id": plan["id"],
            "manifest": session.state.manifest(),
        }
        channel.send(Kind.SNAPSHOT, session.state.step, payload, session.state.bulk_tensors())
        channel.flush()
        channel.send(Kind.SWITCH, session.state.step, _small_for(session, rank))
        channel.flush()
    sent = time.monotonic()
    group, inner = _build(session, prefix, me, session.world_size)
    built = time.monotonic()
    dead = {int(r) for r, *_ in plan["ranks"]}
    return Recovery(
        id=plan["id"], swaps=dict(plan["swaps"]), reports=me == plan["reporter"],
        detect_s=detect_s, transfer_s=sent - started, build_s=built - sent,
        change=Reconfiguration(group, after, rank=me, inner=inner), prefix=prefix,
        survivors=tuple(r for r in range(session.world_size) if r not in dead),
    )  # fmt: skip


STUCK_GRACE = timedelta(milliseconds=500)
"""How long the failed step's collectives must have stood still (none ended on any
survivor) before those that can receive nothing more are let go: data already on
its way lands within it."""


def running_elsewhere(
    session: Session, recovery: Recovery
) -> Callable[[dict[Op, tuple[int, ...]]], bool]:
    """For ``Guard.drain``: whether this survivor's collectives of the failed step that
    still run on the old groups can receive nothing more. Each survivor publishes
    through the store which ones it still runs, once it has issued all of its step's.
    A collective of a group whose members all survived completes: it is waited for
    while another member still runs it, and let go once none does (that member
    failed its side and went on: in a ring, this one waits for its data until the
    group's timeout). A collective of a group that lost a member never completes; it
    ends by an error, or hangs, and in a ring every survivor after the one whose
    side ended hangs behind it, each still running it: it is let go once no
    collective ended on any survivor for ``STUCK_GRACE``. A process of a lost
    machine still alive (``Replaced``) is not asked; one of its collectives with a
    survivor ends or fails soon, as it is leaving. What is let go ends, failing, at
    the group's timeout, on a generation the guard has left."""
    store, me = session.store, session.rank
    key = f"{recovery.prefix}/running"
    survivors = set(recovery.survivors)
    others = sorted(survivors - {me})
    grace = STUCK_GRACE.total_seconds()
    published: list[Any] = [None]
    seen: list[Any] = [None]
    moved = [time.monotonic()]  # when a collective last ended on any survivor
    since: dict[Op, float] = {}

    def settled(running: dict[Op, tuple[int, ...]]) -> bool:
        now = time.monotonic()
        mine = sorted(running)
        if mine != published[0]:
            put(store, f"{key}/{me}", json.dumps(mine).encode())
            published[0], moved[0] = mine, now
        if not running:
            return True
        if not store.check([f"{key}/{r}" for r in others]):
            return False  # not every survivor has issued all of its step's collectives
        peers = sorted({r for members in running.values() for r in members} & set(others))
        values = store.multi_get([f"{key}/{r}" for r in peers]) if peers else []
        theirs = dict(zip(peers, values, strict=True))
        if theirs != seen[0]:
            seen[0], moved[0] = theirs, now
        elsewhere = {r: {(g, n) for g, n in json.loads(bytes(v))} for r, v in theirs.items()}
        for op, members in running.items():
            complete = set(members) <= survivors
            if complete and any(op in elsewhere[r] for r in members if r != me):
                since.pop(op, None)  # another member runs it: it may still send
            else:
                since.setdefault(op, now)
        return all(op in since and now - max(since[op], moved[0]) >= grace for op in running)

    return settled


def settle_drain(session: Session, recovery: Recovery, drained: bool) -> bool:
    """Every survivor's word on whether the failed step's collectives have ended on
    it or were let go (``swap_group.Guard.drain``, ``running_elsewhere``), through the
    store: the step runs again only where all did, else every survivor gives up
    alike."""
    store, key = session.store, f"{recovery.prefix}/drained"
    if not drained:
        put(store, f"{key}/no", str(session.rank).encode())
    store.add(key, 1)
    cfg = session.config
    deadline = time.monotonic() + (cfg.group_timeout + cfg.detect_timeout).total_seconds()
    while int(store.add(key, 0)) < len(recovery.survivors):
        if store.check([f"{key}/no"]) or time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return not store.check([f"{key}/no"])


def _build(
    session: Session, prefix: str, rank: int, size: int
) -> tuple[Group, dict[str, Group] | None]:
    """The next generation's group and, in a wrapped job, the next inner group of each
    of its groups (``swap_group``), in one order in every member."""
    cfg, env = session.config, session.env
    group = make_group(session.store, f"{prefix}/world", rank=rank, size=size,
                       timeout=cfg.group_timeout, backend=env.backend,
                       host=env.host)  # fmt: skip
    if not session.wrapped:
        return group, None
    inner = swap_group.build_inner(session.store, prefix, timeout=cfg.group_timeout,
                                   backend=env.backend, host=env.host)  # fmt: skip
    return group, inner


def give_up(session: Session, migration_id: str, reason: str, error: BaseException) -> NoReturn:
    directory = session.config.checkpoint_dir
    failure = RestartRequired(
        reason, checkpoint_step=None if directory is None else latest_step(Path(directory))
    )
    session.commands.settle(migration_id, "failed", detail=str(failure))
    session.publish_status()
    raise failure from error


def _small_for(session: Session, rank: int) -> dict[str, Any]:
    """The donor's small state as the dead rank had it at the start of this step:
    the data position captured at the last boundary, re-ranked."""
    small = session.state.small_state()
    if session.boundary_rng is not None:  # a wrapped job's survivors redo the step
        small["rng"] = session.boundary_rng
    small["buckets"] = session.bucket_layout()
    stateful = {}
    for name, state in session.boundary_stateful.items():
        state = dict(state)
        if "rank" in state:
            state["rank"] = rank
        stateful[name] = state
    small["stateful"] = stateful
    small["median_step_s"] = session.timing.median_step_s()
    return small


def take_plan(store: Store, slot: str) -> dict[str, Any] | None:
    """The failover plan addressed to standby ``slot``, once: the key goes as it is
    read, so a later process of the slot does not act on it."""
    key = plan_key(slot)
    if not store.check([key]):
        return None
    plan: dict[str, Any] = json.loads(bytes(store.get(key)))
    with contextlib.suppress(RuntimeError):
        store.delete_key(key)
    return plan


def failover_rank(plan: dict[str, Any], env: RuntimeEnv) -> int:
    """The lost rank a failover plan gives this standby slot."""
    mine = [r for r, _, node, lr in plan["ranks"] if node == env.node and lr == env.local_rank]
    if not mine:
        raise MigrationError(f"the failover plan {plan.get('id')} has no rank for {env.slot}")
    return int(mine[0])


def take_over(session: Session, plan: dict[str, Any]) -> Reconfiguration:
    """Standby slot side: receive a donor's state; returns the dead rank's place (in a
    wrapped job, with the next inner groups: ``tmd.runtime.parallel``)."""
    cfg, env, store = session.config, session.env, session.store
    prefix = plan["prefix"]
    pair = make_group(store, f"{prefix}/xfer/{failover_rank(plan, env)}", rank=1, size=2,
                      timeout=cfg.group_timeout, backend="gloo", host=env.host)  # fmt: skip
    channel = TransferChannel(pair, is_leaver=False)
    _, meta = channel.recv()
    channel.recv_tensors(session.state.receive_tensors(meta["manifest"]))
    _, small = channel.recv()
    session.state.load_small_state(small)
    session.capture_boundary()  # what to hand on should this step fail too
    rank = int(meta["rank"])
    layout = session.bucket_layout()  # its shadow iterations are done
    if layout != small.get("buckets"):
        raise MigrationError(f"this standby's DDP buckets {layout} are not the job's "
                             f"{small.get('buckets')}")  # fmt: skip
    group, inner = _build(session, prefix, rank, int(plan["world_size"]))
    membership = Membership(int(meta["generation"]), tuple(meta["nodes"]),
                            tuple(meta.get("local_ranks", ())))  # fmt: skip
    return Reconfiguration(group, membership, rank=rank, inner=inner,
                           median_step_s=float(small.get("median_step_s", 0.0)))  # fmt: skip
