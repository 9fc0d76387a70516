"""Unplanned replacement: a rank died; a standby takes its place from a replica.

No rollback. A data-parallel rank dies during step ``t``; the survivors' gradient
all-reduce of ``t`` fails, and none of them has applied ``t``. Each survivor then:

1. registers as alive for the current generation in the store; once ``world - 1``
   have, the missing rank is the dead one (all survivors must have failed at the
   same step, else this is not a single clean failure and recovery refuses);
2. the lowest surviving rank (the *donor*) picks a ready standby and publishes the
   plan, addressed to that standby's key;
3. everyone builds the next generation's group with the standby in the dead
   rank's place, and the donor sends the standby its bulk state (still that of
   step ``t - 1``, identical on every replica) and the small state, with the data
   position the dead rank had at the start of ``t``;
4. the survivors re-run the all-reduce of ``t`` on the new group from their
   still-intact local gradients, while the standby computes the dead rank's
   gradients for ``t`` in the user's loop. Step ``t`` completes at full size.

The dead rank's RNG streams are lost with it; the joiner continues with the
donor's. Where no standby is ready, recovery raises (the checkpoint fallback with
a global rollback is ``tmd.runtime.baselines``).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from torch._C._distributed_c10d import Store

from tmd.errors import MigrationError
from tmd.runtime.control import put, standbys
from tmd.runtime.group import make_group
from tmd.runtime.migration import Membership
from tmd.runtime.transfer import Kind, TransferChannel

if TYPE_CHECKING:
    from tmd.runtime.session import Session


def plan_key(node: str) -> str:
    return f"tmd/failover/{node}"


def _prefix(generation: int) -> str:
    return f"tmd/fail/g{generation}"


def failure_reported(store: Store, generation: int) -> bool:
    """Has a member of ``generation`` reported a failed collective?"""
    return bool(store.check([f"{_prefix(generation)}/alive"]))


def recover(session: Session, error: BaseException) -> None:
    """Survivor side; on return ``session.group`` is the new full-size group."""
    store, me, gen = session.store, session.rank, session.membership.generation
    prefix = _prefix(gen)
    world = session.world_size
    cfg = session.config
    if session.migration is not None:  # a planned migration cannot survive this
        session.migration.close(tell_joiner=True)
        session.migration = None
    put(store, f"{prefix}/alive/{me}", str(session.state.step).encode())
    store.add(f"{prefix}/alive", 1)
    deadline = time.monotonic() + cfg.detect_timeout.total_seconds()
    while int(store.add(f"{prefix}/alive", 0)) < world - 1:
        if time.monotonic() > deadline:
            raise MigrationError(f"more than one rank lost in generation {gen}") from error
        time.sleep(0.002)
    alive = {r for r in range(world) if store.check([f"{prefix}/alive/{r}"])}
    steps = {int(store.get(f"{prefix}/alive/{r}")) for r in alive}
    if len(steps) != 1:
        raise MigrationError(f"survivors failed at different steps {steps}") from error
    dead = next(r for r in range(world) if r not in alive)
    donor = min(alive)
    if me == donor:
        plan = _make_plan(session, dead=dead, donor=donor, prefix=prefix)
    else:
        plan = json.loads(bytes(store.get(f"{prefix}/plan")))
    nodes = list(session.membership.nodes)
    nodes[dead] = plan["joiner"]
    if me == donor:
        pair = make_group(store, f"{prefix}/xfer", rank=0, size=2, timeout=cfg.group_timeout,
                          backend="gloo", host=session.env.host)  # fmt: skip
        channel = TransferChannel(pair, is_leaver=True)
        payload = {
            "rank": dead,
            "nodes": nodes,
            "generation": gen + 1,
            "migration_id": plan["id"],
            "manifest": session.state.manifest(),
        }
        channel.send(Kind.SNAPSHOT, session.state.step, payload, session.state.bulk_tensors())
        channel.flush()
        channel.send(Kind.SWITCH, session.state.step, _small_for(session, dead))
        channel.flush()
    group = make_group(store, f"{prefix}/world", rank=me, size=world,
                       timeout=cfg.group_timeout, backend=session.env.backend,
                       host=session.env.host)  # fmt: skip
    session._retired.append(session.group)
    session.group = group
    session.membership = Membership(gen + 1, nodes)
    session.telemetry.set_rank(me, gen + 1)
    session.publish_status()


def _make_plan(session: Session, *, dead: int, donor: int, prefix: str) -> dict[str, Any]:
    members = set(session.membership.nodes)
    ready = sorted(
        s.node for s in standbys(session.store) if s.state == "ready" and s.node not in members
    )
    if not ready:
        raise MigrationError("no ready standby to replace the lost rank")
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


def take_over(session: Session, plan: dict[str, Any]) -> None:
    """Standby side: receive the donor's state and become the dead rank."""
    cfg, env, store = session.config, session.env, session.store
    prefix = plan["prefix"]
    pair = make_group(store, f"{prefix}/xfer", rank=1, size=2, timeout=cfg.group_timeout,
                      backend="gloo", host=env.host)  # fmt: skip
    channel = TransferChannel(pair, is_leaver=False)
    _, meta = channel.recv()
    channel.recv_tensors(session.state.receive_tensors(meta["manifest"]))
    _, small = channel.recv()
    session.state.load_small_state(small)
    rank = int(meta["rank"])
    group = make_group(store, f"{prefix}/world", rank=rank, size=int(plan["world_size"]),
                       timeout=cfg.group_timeout, backend=env.backend, host=env.host)  # fmt: skip
    session.timing.durations.clear()
    session.timing.durations.append(float(small.get("median_step_s", 0.0)))
    session.role = "worker"
    session.rank = rank
    session.group = group
    session.membership = Membership(int(meta["generation"]), list(meta["nodes"]))
    session.telemetry.set_rank(rank, session.membership.generation)
