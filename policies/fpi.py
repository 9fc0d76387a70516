"""``fpi``: the learned safe policy. Every ``tick_s`` (the model's), for each job with
a straggler, it looks up what a table trained by Feasible Policy Iteration says
(``tmd policy train``, ``tmd.sim.fpi``): migrate the straggler's machine, restart
without it, or hold. Off unless configured: ``[policies.fpi] model = "PATH"``.

The state is the model's: the job's worst straggler (its slowdown, in the model's
buckets, and how many ticks it has lasted), the ready standbys that could take its
machine, and the migrations of the job that finished done in the last hour. Each
decision's reason carries the state, ``F`` (the discounted chance of breaking a
limit from there, under the policy) and ``Q`` of the action taken against holding.
A state the model was not trained on — a job much larger or smaller than the one it
was trained for, more stragglers' slowdown than its last bucket can say — is held,
and the reason says so. The guardrails still apply to whatever it decides.

Reads the model with the standard library only: a daemon needs no numpy to run it.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from tmd.daemon import events
from tmd.errors import ConfigError
from tmd.plugins import Context
from tmd.policies.base import Policy, Straggler, Stragglers

MODEL_VERSION = 2  # tmd.sim.fpi.MODEL_VERSION
SIZE_RANGE = 2.0  # a job within this factor of the model's GPUs is what it knows


@dataclass(frozen=True, kw_only=True)
class FpiConfig:
    model: str = ""  # the JSON `tmd policy train --out` wrote

    def validate(self) -> None:
        if self.model:
            load_model(self.model)

    def validate_enabled(self) -> None:
        if not self.model:
            raise ConfigError("policies.fpi.model", "set it to a model from `tmd policy train`")


@dataclass(frozen=True)
class Model:
    actions: tuple[str, ...]
    edges: tuple[float, ...]
    max_age: int
    pool: int
    max_per_hour: int
    gpus: int
    tick_s: float
    p: float
    table: dict[tuple[int, ...], tuple[int, float, tuple[float, ...]]]  # state -> a, F, Q
    G: dict[tuple[int, ...], tuple[float, ...]]  # state -> every action's G (may be empty)


def load_model(path: str) -> Model:
    """The model at ``path``, checked; a ConfigError naming ``policies.fpi.model``."""
    key = "policies.fpi.model"
    try:
        raw = json.loads(Path(path).read_text())
        if raw.get("version") != MODEL_VERSION:
            raise ConfigError(key, f"{path}: model version {raw.get('version')!r}, "
                              f"this tmd reads {MODEL_VERSION}")  # fmt: skip
        states, policy, F, Q = raw["states"], raw["policy"], raw["F"], raw["Q"]
        if not (len(states) == len(policy) == len(F) == len(Q)):
            raise ConfigError(key, f"{path}: states, policy, F and Q differ in length")
        table = {tuple(int(v) for v in x): (int(a), float(f), tuple(float(v) for v in q))
                 for x, a, f, q in zip(states, policy, F, Q, strict=True)}  # fmt: skip
        G = raw.get("G", [])  # each action's constraint value: why a move was not taken
        if G and len(G) != len(states):
            raise ConfigError(key, f"{path}: states and G differ in length")
        per_action = {tuple(int(v) for v in x): tuple(float(v) for v in g)
                      for x, g in zip(states, G, strict=False)}  # fmt: skip
        return Model(
            actions=tuple(raw["actions"]), edges=tuple(float(e) for e in raw["slowdown_edges"]),
            max_age=int(raw["max_age"]), pool=int(raw["pool"]),
            max_per_hour=int(raw["limits"]["max_per_hour"]), gpus=int(raw["gpus"]),
            tick_s=float(raw["tick_s"]), p=float(raw["p"]), table=table, G=per_action,
        )  # fmt: skip
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(key, f"cannot read {path}: {exc}") from exc


class FpiPolicy(Policy):
    name = "fpi"
    Config = FpiConfig
    enabled_by_default = False
    consumes = (events.StragglerFound, events.StragglerCleared, events.MigrationFinished)
    config: FpiConfig

    def __init__(self, config: FpiConfig, *, context: Context) -> None:
        super().__init__(config, context=context)
        self.model = load_model(config.model)
        self.tick_interval = timedelta(seconds=self.model.tick_s)  # type: ignore[misc]
        self._stragglers = Stragglers()
        self._done: dict[str, deque[float]] = {}  # job -> when its migrations finished done

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        self._stragglers.observe(event, now)
        done = isinstance(event, events.MigrationFinished) and event.outcome == "done"
        if done and event.to:  # a migration, not a restart
            self._done.setdefault(event.job, deque(maxlen=64)).append(now)
        return ()

    def tick(self, now: float) -> Iterable[events.Event]:
        jobs = self.context.view.jobs
        self._stragglers.forget_gone(jobs)
        for job in [j for j in self._done if j not in jobs]:
            del self._done[job]  # the view forgot the job
        worst: dict[str, tuple[str, Straggler]] = {}
        for (job, node), s in self._stragglers.by_key.items():
            if job not in worst or s.slowdown > worst[job][1].slowdown:
                worst[job] = (node, s)
        for job, (node, s) in sorted(worst.items()):
            yield from self._decide(job, node, s, now)

    def _decide(self, job: str, node: str, s: Straggler, now: float) -> Iterator[events.Event]:
        m = self.model
        view = self.context.view
        ranks = view.jobs[job].world_size if job in view.jobs else 0
        if ranks and not (m.gpus / SIZE_RANGE <= ranks <= m.gpus * SIZE_RANGE):
            yield events.Hold(ts=now, policy=self.name, job=job, node=node,
                              reason=f"outside what the model was trained on: a job of {ranks} "
                              f"ranks, the model's {m.gpus} GPUs")  # fmt: skip
            return
        bucket = sum(1 for e in m.edges if s.slowdown >= e)
        age = min(m.max_age, int((now - s.since) // m.tick_s))
        ready = min(m.pool, len(view.ready_standbys(job, leaver=node)))
        recent = self._done.get(job, deque())
        while recent and now - recent[0] > 3600:
            recent.popleft()
        hour = min(m.max_per_hour + 1, len(recent))
        state = (bucket, age if bucket else 0, ready, hour)
        row = m.table.get(state)
        if row is None:
            why = f"outside what the model was trained on: state {state}"
            yield events.Hold(ts=now, policy=self.name, job=job, node=node, reason=why)
            return
        action, f, q = row
        name = m.actions[action]
        numbers = (f"{node} {s.slowdown:+.0%} for {now - s.since:.0f} s, {ready} ready, "
                   f"{hour} moved this hour: state {state}, F {f:.3g} (p {m.p:g}), "
                   f"Q {q[action]:.4g} vs hold {q[0]:.4g}")  # fmt: skip
        g = m.G.get(state, ())
        moving = m.actions.index("migrate") if "migrate" in m.actions else -1
        if name != "migrate" and f <= m.p and 0 <= moving < len(g) and g[moving] > m.p:
            numbers += f", G of migrate {g[moving]:.3g} > p"  # why not: a limit at risk
        if name == "migrate" and ready:
            yield events.Migrate(ts=now, policy=self.name, job=job, node=node,
                                 reason=f"migrate: {numbers}")  # fmt: skip
        elif name == "restart":
            why = f"restart without it: {numbers}"
            yield events.CheckpointRestart(ts=now, policy=self.name, job=job, node=node,
                                           reason=why)  # fmt: skip
        else:
            yield events.Hold(ts=now, policy=self.name, job=job, node=node,
                              reason=f"hold: {numbers}")  # fmt: skip
