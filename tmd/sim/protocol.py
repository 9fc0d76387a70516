"""How a simulated job answers the daemon's control commands, as the runtime's processes
do (``runtime/control.py``): shared by the simulation on simulated time
(``tmd.sim.engine``) and the live one over a real broker (``tmd.sim.live``)."""

from __future__ import annotations

from collections.abc import Iterable

from tmd import wire


def acks(
    *,
    job: str,
    migration_id: str,
    kind: str,
    nodes: Iterable[str],
    per_node: int,
    generation: int,
    ts: float,
    detail: str = "",
    downtime: wire.Downtime | None = None,
    leaver: str | None = None,
) -> list[wire.Ack]:
    """One ack from every process of ``nodes``, one per local rank: a machine of K ranks
    answers K times. ``leaver``'s processes say they ``left`` (a switch: the stayers and
    the joiner answer in the new generation, the leaving machine as it goes)."""
    return [
        wire.Ack(
            ts=ts,
            job=job,
            migration_id=migration_id,
            kind=kind,  # type: ignore[arg-type]
            node=node,
            local_rank=r,
            generation=generation,
            downtime=downtime,
            detail="left" if node == leaver else detail,
        )
        for node in nodes
        for r in range(per_node)
    ]


def members(nodes: Iterable[str], per_node: int) -> list[wire.Member]:
    """The job's members, machine by machine: ranks ``i * K .. i * K + K - 1`` on the
    ``i``-th machine, by local rank."""
    return [
        wire.Member(slot * per_node + r, node, r)
        for slot, node in enumerate(nodes)
        for r in range(per_node)
    ]


def failover_answer(
    *,
    job: str,
    generation: int,
    swaps: dict[str, str],
    survivors: list[str],
    per_node: int,
    ts: float,
    downtime_s: float = 0.0,
) -> list[wire.Ack]:
    """The runtime's answer about a failover it did by itself in ``generation``
    (``runtime/failover.py``), id ``failover-g{generation}``: with ``swaps`` (lost
    machine -> the standby machine in its place), the lowest survivor's ``switched``
    from the next generation, with the downtime, naming the swaps as the runtime's
    ``Recovery.describe`` does; without, every survivor's ``failed`` (the job rolls
    back to its checkpoint). With no survivor nobody answers."""
    mid = f"failover-g{generation}"
    if not survivors:
        return []
    if swaps:
        detail = ", ".join(f"{lost} replaced by {new}" for lost, new in swaps.items())
        donor = wire.Ack(ts=ts, job=job, migration_id=mid, kind="switched", node=survivors[0],
                         local_rank=0, generation=generation + 1, detail=detail,
                         downtime=wire.Downtime(total_s=downtime_s))  # fmt: skip
        return [donor]
    return acks(job=job, migration_id=mid, kind="failed", nodes=survivors, per_node=per_node,
                generation=generation, ts=ts,
                detail="no ready standby machine: rolling back to the checkpoint")  # fmt: skip
