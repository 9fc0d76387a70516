"""Unplanned replacement: a rank died; a standby takes its place from a replica.

No rollback. A data-parallel rank dies during step ``t``; the survivors' gradient
all-reduce of ``t`` fails, and none of them has applied ``t``. Each survivor then:

1. registers as alive for the current generation in the store and waits up to
   ``SessionConfig.detect_timeout`` for ``world - 1`` registrations. What it saw
   (exactly one rank missing, every survivor at the same step; or not) is its
   proposal; the first proposal stored wins (``compare_set``), so all survivors
   act on one decision even when their views raced;
2. the lowest surviving rank (the *donor*) waits up to ``standby_wait`` for a ready
   standby and publishes the plan, addressed to that standby's key;
3. everyone builds the next generation's group with the standby in the dead
   rank's place, and the donor sends the standby its bulk state (still that of
   step ``t - 1``, identical on every replica) and the small state, with the data
   position the dead rank had at the start of ``t``;
4. the survivors re-run the all-reduce of ``t`` on the new group from their
   still-intact local gradients, while the standby computes the dead rank's
   gradients for ``t`` in the user's loop. Step ``t`` completes at full size, and
   the donor acks ``switched`` for ``failover-g{generation}`` with the downtime:
   step ``t``'s duration minus a median step (``Recovery.downtime``).

Should a member of the new group die during that re-run, the same protocol runs
again for the next generation. Where this cannot serve (more than one rank lost,
survivors at different steps, no standby ready within ``standby_wait``, or a
failure while recovering) every survivor acks ``failed`` for
``failover-g{generation}``, saying which checkpoint the job rolls back to, and
raises ``RestartRequired``: the job is restarted and every rank resumes from the
latest checkpoint (``tmd.runtime.checkpoint``).

The dead rank's RNG streams are lost with it; the joiner continues with the donor's.

Both sides end in a ``Reconfiguration`` (the survivors' in ``Recovery.change``) that
the session applies; nothing here writes the session's group or membership.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from torch._C._distributed_c10d import Store

from tmd import wire
from tmd.errors import MigrationError, RestartRequired
from tmd.runtime.checkpoint import latest_step
from tmd.runtime.control import put, standbys
from tmd.runtime.group import make_group
from tmd.runtime.membership import Membership, Reconfiguration
from tmd.runtime.transfer import Kind, TransferChannel

if TYPE_CHECKING:
    from tmd.runtime.session import Session

Decision = dict[str, Any]


@dataclass(frozen=True)
class Recovery:
    """One survivor's part in replacing a dead rank; durations in seconds."""

    id: str
    dead: int
    joiner: str
    is_donor: bool
    detect_s: float
    """From the start of the failed collective to the agreed decision."""
    transfer_s: float
    """The donor's state transfer to the joiner (0 on the other survivors)."""
    build_s: float
    """Building the next generation's group."""
    change: Reconfiguration
    """This survivor's place in the next generation's group."""

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


def plan_key(node: str) -> str:
    return f"tmd/failover/{node}"


def _prefix(generation: int) -> str:
    return f"tmd/fail/g{generation}"


class _Replaced(MigrationError):
    """This rank was counted dead by the others and replaced: the job goes on
    without this process, so this is no reason to restart the job."""


def failure_reported(store: Store, generation: int) -> bool:
    """Has a member of ``generation`` reported a failed collective?"""
    return bool(store.check([f"{_prefix(generation)}/alive"]))


def recover(session: Session, error: BaseException, *, collective_started: float) -> Recovery:
    """Survivor side, with no planned migration left open. Returns this survivor's
    part, its place in the new full-size group included (``Recovery.change``); where
    no standby can take the dead rank's place this acks ``failed`` and raises
    ``RestartRequired``."""
    gen = session.membership.generation
    prefix, migration_id = _prefix(gen), f"failover-g{gen}"
    try:
        decision = _agree(session, prefix)
        detect_s = time.monotonic() - collective_started
        if decision["action"] != "replace":
            _give_up(session, migration_id, decision["reason"], error)
        plan = _plan(session, decision, prefix)
        if "joiner" not in plan:
            _give_up(session, migration_id, plan["reason"], error)
        return _replace(session, plan, prefix, detect_s=detect_s)
    except _Replaced:
        raise
    except (MigrationError, RuntimeError) as exc:
        _give_up(session, migration_id, f"recovery of generation {gen} failed: {exc}", exc)


def _agree(session: Session, prefix: str) -> Decision:
    store, me, world = session.store, session.rank, session.world_size
    gen = session.membership.generation
    put(store, f"{prefix}/alive/{me}", str(session.state.step).encode())
    store.add(f"{prefix}/alive", 1)
    deadline = time.monotonic() + session.config.detect_timeout.total_seconds()
    while (count := int(store.add(f"{prefix}/alive", 0))) < world - 1:
        if time.monotonic() > deadline:
            break
        time.sleep(0.002)
    proposal: Decision
    if count < world - 1:
        lost = world - count
        proposal = {"action": "rollback", "reason": f"{lost} ranks lost in generation {gen}"}
    else:
        alive = [r for r in range(world) if store.check([f"{prefix}/alive/{r}"])]
        steps = sorted({int(store.get(f"{prefix}/alive/{r}")) for r in alive})
        if len(steps) != 1:
            proposal = {"action": "rollback", "reason": f"survivors failed at steps {steps}"}
        elif len(alive) == world:
            proposal = {"action": "rollback", "reason": "a collective failed, no rank was lost"}
        else:
            dead = next(r for r in range(world) if r not in alive)
            proposal = {"action": "replace", "alive": alive, "dead": dead}
    stored = store.compare_set(f"{prefix}/decision", "", json.dumps(proposal))
    decision: Decision = json.loads(bytes(stored))
    if decision["action"] == "replace" and me not in decision["alive"]:
        raise _Replaced(f"rank {me} registered too late in generation {gen} and was replaced")
    return decision


def _plan(session: Session, decision: Decision, prefix: str) -> dict[str, Any]:
    donor = min(decision["alive"])
    if session.rank == donor:
        return _make_plan(session, dead=int(decision["dead"]), donor=donor, prefix=prefix)
    cfg = session.config
    wait_s = (cfg.standby_wait + cfg.detect_timeout).total_seconds()
    deadline = time.monotonic() + wait_s
    while not session.store.check([f"{prefix}/plan"]):
        if time.monotonic() > deadline:
            return {"reason": f"no failover plan from rank {donor} within {wait_s:g} s"}
        time.sleep(0.005)
    plan: dict[str, Any] = json.loads(bytes(session.store.get(f"{prefix}/plan")))
    return plan


def _replace(session: Session, plan: dict[str, Any], prefix: str, *, detect_s: float) -> Recovery:
    store, me = session.store, session.rank
    cfg, dead, donor = session.config, int(plan["dead"]), int(plan["donor"])
    after = session.membership.replaced(dead, plan["joiner"])
    started = time.monotonic()
    if me == donor:
        pair = make_group(store, f"{prefix}/xfer", rank=0, size=2, timeout=cfg.group_timeout,
                          backend="gloo", host=session.env.host)  # fmt: skip
        channel = TransferChannel(pair, is_leaver=True)
        payload = {
            "rank": dead,
            "nodes": list(after.nodes),
            "generation": after.generation,
            "migration_id": plan["id"],
            "manifest": session.state.manifest(),
        }
        channel.send(Kind.SNAPSHOT, session.state.step, payload, session.state.bulk_tensors())
        channel.flush()
        channel.send(Kind.SWITCH, session.state.step, _small_for(session, dead))
        channel.flush()
    sent = time.monotonic()
    group = make_group(store, f"{prefix}/world", rank=me, size=session.world_size,
                       timeout=cfg.group_timeout, backend=session.env.backend,
                       host=session.env.host)  # fmt: skip
    built = time.monotonic()
    return Recovery(
        id=plan["id"], dead=dead, joiner=plan["joiner"], is_donor=me == donor,
        detect_s=detect_s, transfer_s=sent - started, build_s=built - sent,
        change=Reconfiguration(group, after, rank=me),
    )  # fmt: skip


def _give_up(session: Session, migration_id: str, reason: str, error: BaseException) -> NoReturn:
    directory = session.config.checkpoint_dir
    failure = RestartRequired(
        reason, checkpoint_step=None if directory is None else latest_step(Path(directory))
    )
    session.commands.settle(migration_id, "failed", detail=str(failure))
    session.publish_status()
    raise failure from error


def _make_plan(session: Session, *, dead: int, donor: int, prefix: str) -> dict[str, Any]:
    members = set(session.membership.nodes)
    wait_s = session.config.standby_wait.total_seconds()
    deadline = time.monotonic() + wait_s
    while True:  # a standby still warming up may become ready in time
        ready = wire.ready_standbys(standbys(session.store), members)
        if ready or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    plan: dict[str, Any]
    if not ready:
        plan = {"reason": f"no ready standby within {wait_s:g} s to replace rank {dead}"}
        put(session.store, f"{prefix}/plan", json.dumps(plan).encode())
        return plan
    plan = {
        "id": f"failover-g{session.membership.generation}",
        "dead": dead,
        "joiner": ready[0],
        "donor": donor,
        "prefix": prefix,
        "world_size": session.world_size,
    }
    data = json.dumps(plan).encode()
    put(session.store, f"{prefix}/plan", data)
    put(session.store, plan_key(ready[0]), data)
    return plan


def _small_for(session: Session, rank: int) -> dict[str, Any]:
    """The donor's small state as the dead rank had it at the start of this step:
    the data position captured at the last boundary, re-ranked."""
    small = session.state.small_state()
    stateful = {}
    for name, state in session.boundary_stateful.items():
        state = dict(state)
        if "rank" in state:
            state["rank"] = rank
        stateful[name] = state
    small["stateful"] = stateful
    small["median_step_s"] = session.timing.median_step_s()
    return small


def take_over(session: Session, plan: dict[str, Any]) -> Reconfiguration:
    """Standby side: receive the donor's state; returns the dead rank's place."""
    cfg, env, store = session.config, session.env, session.store
    prefix = plan["prefix"]
    pair = make_group(store, f"{prefix}/xfer", rank=1, size=2, timeout=cfg.group_timeout,
                      backend="gloo", host=env.host)  # fmt: skip
    channel = TransferChannel(pair, is_leaver=False)
    _, meta = channel.recv()
    channel.recv_tensors(session.state.receive_tensors(meta["manifest"]))
    _, small = channel.recv()
    session.state.load_small_state(small)
    session.capture_boundary()  # what to hand on should this step fail too
    rank = int(meta["rank"])
    group = make_group(store, f"{prefix}/world", rank=rank, size=int(plan["world_size"]),
                       timeout=cfg.group_timeout, backend=env.backend, host=env.host)  # fmt: skip
    membership = Membership(int(meta["generation"]), tuple(meta["nodes"]))
    return Reconfiguration(group, membership, rank=rank,
                           median_step_s=float(small.get("median_step_s", 0.0)))  # fmt: skip
