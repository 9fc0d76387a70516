"""Feasible Policy Iteration with small networks (Yang et al., "Feasible Policy
Iteration", arXiv 2304.08845; the update of its reference code,
``yangyujie-jack/Feasible-Policy-Iteration``, ``fpi/algorithm/fpi_exp.py``), as a
discrete soft actor-critic on ``tmd.sim.job_env``: the exact, tabular variant
(``tmd.sim.fpi``) cannot hold that environment's continuous state.

What it learns, from transitions ``(x, a, r, c, x')`` (``c``: a limit broken in the
tick) of a replay buffer:

- twin ``Q`` networks, each fitted to ``r + gamma * sum_a' pi(a'|x') min(Q1', Q2')``
  (the primed: Polyak-averaged targets, ``tau``); no entropy in the backup, as the
  reference;
- twin ``G`` networks, the constraint decay function ``G(x, a) = E[gamma^N]`` (``N``
  the first tick a limit is broken), each fitted to ``c + (1 - c) * gamma * g'``
  with ``g' = sum_a' pi(a'|x') max(G1', G2')`` clipped to [0, 1]: pessimistic;
- a categorical policy, region by region: where ``g = sum_a pi(a|x) max(G1, G2)`` is
  under ``pf`` (the feasible region) it maximises ``q = sum_a pi(a|x) min(Q1, Q2)``
  weighted against the barrier ``b * (g - pf)``, ``b = t * (1 / (pf - g) - 1 / pf)``
  (``b`` held constant in the gradient), ``(-q + b * (g - pf)) / (1 + b)``; outside
  it minimises ``g``; an entropy bonus ``alpha`` throughout. The reference samples
  one action; with five, every expectation over the action set is exact.

Acting, a trained policy takes its most likely action, and gives per state ``F``
(``max(G1, G2)`` of that action) and ``Q`` (``min(Q1, Q2)`` of every action) for the
decision's reason. Training runs on one CPU thread, seeded: the same config gives
the same networks. Its data: copies of the environment on seeds from
``job_env.TRAIN_SEEDS``, each acting on the current policy with its own chance of a
random action (``explore``), restarted every ``episode_ticks`` from a random state so
that states a good policy avoids are seen too.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from tmd.sim import fpi, job_env

EPS = 1e-6  # the barrier's edge: g this close under pf is outside the region
# A random action's odds, per job_env.ACTIONS: restarts rarer, or a copy exploring
# would spend its downtime budget for good and show little else.
RANDOM = (0.4, 0.2, 0.2, 0.1, 0.1)


@dataclass(frozen=True)
class NetConfig:
    """The defaults were chosen (updates, ``alpha``, ``batch``) on 20 days of seeds
    3000..3003, none of ``tmd bench policy``'s."""

    hidden: int = 64  # two hidden layers of this many units, every network
    gamma: float = 0.95  # Q's and G's discount: 20 ticks, about the hour's limit times 3
    pf: float = 0.1  # the feasible region: G at most this (the reference's default)
    t: float = 1.0  # the barrier's weight (the reference's)
    alpha: float = 0.01  # the entropy bonus, in ticks of useful time
    lr: float = 1e-3
    tau: float = 0.01  # Polyak averaging of the targets
    batch: int = 256
    updates: int = 15000
    copies: int = 32  # environments stepped together
    updates_per_tick: int = 4
    warmup_ticks: int = 50  # random actions only, before the first update
    explore: tuple[float, ...] = (0.02, 0.1, 0.3)  # per copy, in turn: a random action's chance
    episode_ticks: int = 144  # then every copy restarts from a random state
    epochs: int = 10  # the feasible share is reported per this many parts of the run
    seed: int = 0


class Ensemble(nn.Module):
    """``members`` independent MLPs of the same shape, run as one batched product:
    the twin ``Q`` and twin ``G`` networks, trained together for speed."""

    def __init__(self, members: int, sizes: tuple[int, ...]) -> None:
        super().__init__()
        self.weights = nn.ParameterList()
        self.biases = nn.ParameterList()
        for n_in, n_out in itertools.pairwise(sizes):
            bound = 1 / n_in**0.5  # nn.Linear's initialisation
            for params, shape in ((self.weights, (n_in, n_out)), (self.biases, (1, n_out))):
                params.append(nn.Parameter(torch.empty(members, *shape).uniform_(-bound, bound)))
        self.members = members

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, in] to [members, B, out]."""
        h = x.expand(self.members, *x.shape)
        last = len(self.weights) - 1
        for i, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            h = torch.baddbmm(b, h, w)
            h = torch.relu(h) if i < last else h
        return h


def mlp(sizes: tuple[int, ...]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for n_in, n_out in itertools.pairwise(sizes):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class Learner:
    """The networks and one FPI update; see the module's docstring."""

    def __init__(self, n_features: int, n_actions: int, config: NetConfig) -> None:
        torch.set_num_threads(1)  # small networks: more threads only contend
        torch.manual_seed(config.seed)
        sizes = (n_features, config.hidden, config.hidden, n_actions)
        self.config = config
        self.critics = Ensemble(4, sizes)  # Q1, Q2, G1, G2
        self.targets = Ensemble(4, sizes)
        self.targets.load_state_dict(self.critics.state_dict())
        self.targets.requires_grad_(False)
        self.actor = mlp(sizes)
        self.critic_opt = torch.optim.Adam(self.critics.parameters(), lr=config.lr)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=config.lr)

    def update(
        self, x: torch.Tensor, a: torch.Tensor, r: torch.Tensor, c: torch.Tensor,
        x2: torch.Tensor,
    ) -> float:  # fmt: skip
        """One step of every network on a batch; the share of its states inside the
        policy's feasible region."""
        cf = self.config
        cost = (c > 0).float()
        with torch.no_grad():
            pi2 = torch.softmax(self.actor(x2), dim=-1)
            t2 = self.targets(x2)
            q2 = (pi2 * torch.minimum(t2[0], t2[1])).sum(-1)
            g2 = (pi2 * torch.maximum(t2[2], t2[3])).sum(-1).clamp(0.0, 1.0)
            backup = torch.stack([r + cf.gamma * q2, cost + (1 - cost) * cf.gamma * g2])
        taken = self.critics(x).gather(-1, a.expand(4, -1).unsqueeze(-1)).squeeze(-1)
        critic_loss = ((taken - backup.repeat_interleave(2, dim=0)) ** 2).mean(-1).sum()
        self.critic_opt.zero_grad()
        critic_loss.backward()
        self.critic_opt.step()

        with torch.no_grad():
            v = self.critics(x)
            q, g = torch.minimum(v[0], v[1]), torch.maximum(v[2], v[3])
        logp = torch.log_softmax(self.actor(x), dim=-1)
        pi = logp.exp()
        q_pi, g_pi = (pi * q).sum(-1), (pi * g).sum(-1)
        entropy = -(pi * logp).sum(-1)
        feasible = (g_pi.detach() - cf.pf < -EPS).float()
        cons = (g_pi - cf.pf).clamp(-cf.pf, -EPS)
        b = cf.t * (-1 / cons.detach() - 1 / cf.pf)
        actor_loss = ((feasible * (-q_pi + b * cons) / (1 + b)).mean()
                      + ((1 - feasible) * g_pi).mean() - cf.alpha * entropy.mean())  # fmt: skip
        self.actor_opt.zero_grad()
        actor_loss.backward()  # type: ignore[no-untyped-call]
        self.actor_opt.step()

        with torch.no_grad():
            for p, tp in zip(self.critics.parameters(), self.targets.parameters(), strict=True):
                tp.lerp_(p, cf.tau)
        return float(feasible.mean())

    def values(self, features: npt.NDArray[np.float64]) -> tuple[torch.Tensor, torch.Tensor]:
        """``min(Q1, Q2)`` and ``max(G1, G2)``, [B, actions]."""
        with torch.no_grad():
            v = self.critics(torch.as_tensor(features, dtype=torch.float32))
        return torch.minimum(v[0], v[1]), torch.maximum(v[2], v[3])

    def probabilities(self, features: npt.NDArray[np.float64]) -> torch.Tensor:
        with torch.no_grad():
            return torch.softmax(self.actor(torch.as_tensor(features, dtype=torch.float32)), -1)


@dataclass
class Trained:
    """A trained network policy and what its training saw."""

    learner: Learner
    seeds: range  # the environment copies' seeds
    feasible_share: list[float] = field(default_factory=list)  # per epoch
    train_s: float = 0.0  # CPU seconds (process time)

    def decide(
        self, features: npt.NDArray[np.float64]
    ) -> tuple[job_env.Ints, npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """Per state: the action, its ``F`` and every action's ``Q``."""
        actions = self.learner.probabilities(features).argmax(-1)
        q, g = self.learner.values(features)
        F = g.gather(-1, actions[:, None]).squeeze(-1).clamp(0.0, 1.0)
        return actions.numpy().astype(np.int64), F.numpy().astype(float), q.numpy().astype(float)

    def policy(self) -> job_env.Policy:
        return lambda obs: self.decide(obs.features)[0]


class Replay:
    """Every transition ``(x, a, r, c, x')`` of a run, kept: a run is small."""

    def __init__(self, size: int, n_features: int) -> None:
        self.x, self.x2 = np.zeros((2, size, n_features), np.float32)
        self.a = np.zeros(size, np.int64)
        self.r, self.c = np.zeros((2, size), np.float32)
        self.n = 0

    def add(self, obs: job_env.Obs, a: job_env.Ints, step: job_env.Step, nxt: job_env.Obs) -> None:
        part = slice(self.n, self.n + len(a))
        self.x[part], self.a[part], self.x2[part] = obs.features, a, nxt.features
        # The share lost rather than the share used: the same policy, but Q's values sit
        # near 0, not near 1 / (1 - gamma), which the networks' outputs would take long
        # to reach. Q reads as ticks of useful time lost against a job never held up.
        self.r[part] = step.reward - 1
        self.c[part] = step.breach.any(axis=1)
        self.n += len(a)

    def sample(self, rng: np.random.Generator, batch: int) -> tuple[torch.Tensor, ...]:
        i = rng.integers(0, self.n, batch)
        return tuple(torch.from_numpy(v[i]) for v in (self.x, self.a, self.r, self.c, self.x2))


def train(sm: fpi.SimModel, limits: fpi.Limits, config: NetConfig | None = None) -> Trained:
    """FPI's networks trained on copies of ``job_env`` for ``config.updates`` updates;
    ``train_s`` the CPU time it took."""
    cf = config or NetConfig()
    t0 = time.process_time()
    rng = np.random.default_rng(cf.seed)
    ticks = cf.warmup_ticks + -(-cf.updates // cf.updates_per_tick)
    seeds = job_env.TRAIN_SEEDS[: cf.copies]
    env = job_env.JobEnv(sm, limits, job_env.Outside.draw(sm, seeds, ticks))
    n_a = len(job_env.ACTIONS)
    learner = Learner(len(job_env.FEATURES), n_a, cf)
    replay = Replay(ticks * cf.copies, len(job_env.FEATURES))
    explore = np.resize(np.asarray(cf.explore, dtype=float), cf.copies)
    obs = env.reset(rng)
    shares: list[float] = []
    for tick in range(ticks):
        if tick and tick % cf.episode_ticks == 0:
            obs = env.reset(rng)
        pi = learner.probabilities(obs.features).numpy().astype(float)
        on_policy = (pi.cumsum(-1) < rng.random((cf.copies, 1))).sum(-1).clip(0, n_a - 1)
        randomly = (tick < cf.warmup_ticks) | (rng.random(cf.copies) < explore)
        a = np.where(randomly, rng.choice(n_a, cf.copies, p=RANDOM), on_policy)
        step = env.step(a)
        nxt = env.observe()
        replay.add(obs, a, step, nxt)
        obs = nxt
        if tick >= cf.warmup_ticks:
            for _ in range(min(cf.updates_per_tick, cf.updates - len(shares))):
                shares.append(learner.update(*replay.sample(rng, cf.batch)))
    parts = np.array_split(np.asarray(shares), cf.epochs)
    return Trained(learner, seeds, [round(float(p.mean()), 4) for p in parts if len(p)],
                   time.process_time() - t0)  # fmt: skip
