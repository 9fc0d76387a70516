"""Failure mixes: published failure rates and root causes, and the seeded sampler that
turns them into the failures one simulated job meets.

A mix (``llama3``, ``rsc1``, ``rsc2``) and the fail-slow model (``failslow``) are TOML
files in ``tmd/sim/data``; every number there names its source. This module owns only
their validation and the sampling: a file is checked once, at load, and a bad one
raises ``ValueError`` naming the file and the key. ``sample`` is pure and
deterministic for a seed; each kind of event (unexpected, planned, fail-slow, slow
machines) draws from its own stream, so switching one kind on or off leaves the others'
draws unchanged.
"""

from __future__ import annotations

import math
import random
import re
import tomllib
from dataclasses import dataclass
from importlib.resources import files
from itertools import accumulate
from pathlib import Path
from typing import Any, Final, Literal, get_args

Signal = Literal["xid", "node_lost", "hang", "straggler", "crash", "planned"]
"""How a failure shows itself to tmd, which decides what tmd can do about it:

- ``xid``: a fatal NVML XID on one GPU; the machine is replaced.
- ``node_lost``: the machine stops answering (host, NIC, PSU, cable); replaced.
- ``hang``: a collective hangs (NCCL watchdog), no machine named; the whole job
  restarts from its checkpoint.
- ``straggler``: fail-slow; the machine still works, slowly, for a while.
- ``crash``: a software bug or a dependency; no standby fixes it, restart from a
  checkpoint.
- ``planned``: maintenance or an operator, known ahead; drained by live migration.
"""

SIGNALS: Final[frozenset[str]] = frozenset(get_args(Signal))
MIXES: Final = ("llama3", "rsc1", "rsc2")
"""The mixes shipped in ``tmd/sim/data``."""
PLANNED_CAUSE: Final = "planned_maintenance"
SLOW_MACHINE_CAUSE: Final = "slow_machine"
SECONDS_PER_DAY: Final = 86_400.0
_UNEXPECTED: Final = SIGNALS - {"planned", "straggler"}
"""A mix's own causes: planned work comes from ``planned_per_day``, fail-slows from
``failslow.toml``."""

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_MIX_KEYS: Final = frozenset(
    {
        "name",
        "source",
        "gpus_per_node",
        "failures_per_node_day",
        "planned_per_day",
        "notes",
        "causes",
        "causes_from",
    }
)
_CAUSE_KEYS: Final = frozenset({"name", "count", "weight", "signal", "xid", "source"})
_FAILSLOW_KEYS: Final = frozenset(
    {
        "source",
        "episodes_per_node_day",
        "duration_log_mean_s",
        "duration_log_sigma",
        "duration_max_s",
        "slowdown_log_mean",
        "slowdown_log_sigma",
        "slowdown_max",
        "slow_machine_fraction",
        "slow_machine_slowdown",
        "slow_machine_source",
        "notes",
        "causes",
    }
)


@dataclass(frozen=True)
class Cause:
    """One root cause of a mix."""

    name: str  # snake_case, e.g. "faulty_gpu"
    count: int  # as published; 0 when the source gives shares, not counts
    weight: float  # share of the mix's failures (count/total, computed at load)
    signal: Signal
    xid: int | None  # a representative XID when signal == "xid", else None
    source: str


@dataclass(frozen=True)
class Mix:
    """The unexpected failures of a cluster: a rate per machine-day and its causes."""

    name: str
    source: str  # full citation
    gpus_per_node: int
    failures_per_node_day: float  # unexpected failures per machine-day
    planned_per_day: float  # planned interruptions per job-day
    causes: tuple[Cause, ...]
    notes: str  # caveats: where published numbers disagree, what was borrowed


@dataclass(frozen=True)
class FailSlow:
    """Fail-slow episodes (lognormal duration and slowdown) and persistently slow
    machines."""

    source: str
    episodes_per_node_day: float
    duration_log_mean_s: float  # mean of ln(duration in seconds)
    duration_log_sigma: float
    duration_max_s: float
    slowdown_log_mean: float  # mean of ln(fractional slowdown)
    slowdown_log_sigma: float
    slowdown_max: float
    slow_machine_fraction: float  # share of machines slow for the whole run
    slow_machine_slowdown: float
    slow_machine_source: str
    causes: tuple[Cause, ...]
    notes: str


@dataclass(frozen=True, order=True)
class Failure:
    """One event a simulated job meets."""

    t_s: float  # seconds since the run started
    cause: str
    signal: Signal
    machine: int  # index among the job's machines; drawn but meaningless for hang/crash
    xid: int | None
    slowdown: float  # straggler only: fractional slowdown (0.2 = 20% slower), else 0
    duration_s: float  # straggler only: how long the fail-slow lasts, else 0


# -- loading -----------------------------------------------------------------------


def load(name_or_path: str | Path) -> Mix:
    """A packaged mix by name (``llama3``, ``rsc1``, ``rsc2``) or a TOML file by path.

    Raises ``ValueError`` naming the file and key when the file is malformed, and
    ``OSError`` when a path cannot be read.
    """
    label, table = _read(name_or_path, MIXES)
    r = _Reader(table, where=label)
    r.only(_MIX_KEYS)
    return Mix(
        name=r.text("name"),
        source=r.text("source"),
        gpus_per_node=r.integer("gpus_per_node", minimum=1),
        failures_per_node_day=r.number("failures_per_node_day"),
        planned_per_day=r.number("planned_per_day"),
        causes=_mix_causes(r),
        notes=r.text("notes"),
    )


def load_failslow(name_or_path: str | Path = "failslow") -> FailSlow:
    """The packaged fail-slow model, or one from a TOML file by path."""
    label, table = _read(name_or_path, ("failslow",))
    r = _Reader(table, where=label)
    r.only(_FAILSLOW_KEYS)
    return FailSlow(
        source=r.text("source"),
        episodes_per_node_day=r.number("episodes_per_node_day"),
        duration_log_mean_s=r.number("duration_log_mean_s", signed=True),
        duration_log_sigma=r.number("duration_log_sigma"),
        duration_max_s=r.number("duration_max_s", positive=True),
        slowdown_log_mean=r.number("slowdown_log_mean", signed=True),
        slowdown_log_sigma=r.number("slowdown_log_sigma"),
        slowdown_max=r.number("slowdown_max", positive=True),
        slow_machine_fraction=r.number("slow_machine_fraction", maximum=1.0),
        slow_machine_slowdown=r.number("slow_machine_slowdown"),
        slow_machine_source=r.text("slow_machine_source"),
        causes=_causes(r, "causes", allowed=frozenset({"straggler"})),
        notes=r.text("notes"),
    )


def _read(name_or_path: str | Path, packaged: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    if isinstance(name_or_path, Path) or name_or_path.endswith(".toml") or "/" in name_or_path:
        path = Path(name_or_path)
        return str(path), _parse(path.read_text(encoding="utf-8"), str(path))
    if name_or_path not in packaged:
        choices = ", ".join(packaged)
        raise ValueError(f"unknown name {name_or_path!r}: one of {choices}, or a .toml path")
    label = f"{name_or_path}.toml"
    text = files("tmd.sim").joinpath("data", label).read_text(encoding="utf-8")
    return label, _parse(text, label)


def _parse(text: str, label: str) -> dict[str, Any]:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{label}: not valid TOML: {e}") from e


def _mix_causes(r: _Reader) -> tuple[Cause, ...]:
    """A mix's own causes, or another packaged mix's (``causes_from = "llama3"``, one
    level deep: the RSC papers give rates but no root-cause mix)."""
    if r.has("causes") == r.has("causes_from"):
        raise r.error("causes", "give exactly one of 'causes' and 'causes_from'")
    if r.has("causes"):
        return _causes(r, "causes", allowed=_UNEXPECTED)
    name = r.text("causes_from")
    if name not in MIXES:
        raise r.error("causes_from", f"{name!r} is not a packaged mix ({', '.join(MIXES)})")
    label, table = _read(name, MIXES)
    other = _Reader(table, where=label)
    if not other.has("causes"):
        raise r.error("causes_from", f"{name!r} borrows its causes too; point at the original")
    return _causes(other, "causes", allowed=_UNEXPECTED)


def _causes(r: _Reader, key: str, *, allowed: frozenset[str]) -> tuple[Cause, ...]:
    raw = r.get(key)
    if not isinstance(raw, list) or not raw:
        raise r.error(key, "expected a non-empty array of tables ([[causes]])")
    rows: list[tuple[str, int, float, Signal, int | None, str]] = []
    kinds: set[str] = set()
    seen: set[str] = set()
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise r.error(f"{key}[{i}]", "expected a table")
        c = _Reader(item, where=r.where, prefix=f"{r.prefix}{key}[{i}].")
        c.only(_CAUSE_KEYS)
        name = c.text("name")
        if not _NAME.match(name):
            raise c.error("name", f"{name!r} is not snake_case")
        if name in seen:
            raise c.error("name", f"{name!r} appears twice")
        seen.add(name)
        if c.has("count") == c.has("weight"):
            raise c.error("count", "give exactly one of 'count' and 'weight'")
        kind = "count" if c.has("count") else "weight"
        kinds.add(kind)
        if len(kinds) > 1:
            raise c.error(kind, "mixes counts and weights; use one for every cause")
        count = c.integer("count") if kind == "count" else 0
        share = float(count) if kind == "count" else c.number("weight", positive=True)
        signal = c.signal("signal", allowed)
        xid: int | None = None
        if signal == "xid":
            xid = c.integer("xid", minimum=1)
        elif c.has("xid"):
            raise c.error("xid", f"only a cause with signal 'xid' has one, not {signal!r}")
        rows.append((name, count, share, signal, xid, c.text("source")))
    total = math.fsum(row[2] for row in rows)
    if total <= 0:
        raise r.error(key, "the counts sum to 0")
    return tuple(
        Cause(name=n, count=k, weight=s / total, signal=sig, xid=x, source=src)
        for n, k, s, sig, x, src in rows
    )


class _Reader:
    """Typed reads from one TOML table; every error names the file and dotted key."""

    def __init__(self, table: dict[str, Any], *, where: str, prefix: str = "") -> None:
        self.table = table
        self.where = where
        self.prefix = prefix

    def error(self, key: str, why: str) -> ValueError:
        return ValueError(f"{self.where}: {self.prefix}{key}: {why}")

    def only(self, keys: frozenset[str]) -> None:
        for key in self.table:
            if key not in keys:
                raise self.error(key, "unknown key")

    def has(self, key: str) -> bool:
        return key in self.table

    def get(self, key: str) -> Any:
        if key not in self.table:
            raise self.error(key, "missing")
        return self.table[key]

    def text(self, key: str) -> str:
        value = self.get(key)
        if not isinstance(value, str) or not value.strip():
            raise self.error(key, f"expected a non-empty string, got {value!r}")
        return value

    def integer(self, key: str, *, minimum: int = 0) -> int:
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(key, f"expected an integer, got {value!r}")
        if value < minimum:
            raise self.error(key, f"must be >= {minimum}, got {value}")
        return value

    def number(
        self,
        key: str,
        *,
        signed: bool = False,
        positive: bool = False,
        maximum: float = math.inf,
    ) -> float:
        """A finite float (an integer is accepted); >= 0 unless ``signed``."""
        value = self.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(key, f"expected a number, got {value!r}")
        x = float(value)
        if not math.isfinite(x):
            raise self.error(key, f"must be finite, got {x}")
        if positive and x <= 0:
            raise self.error(key, f"must be > 0, got {x}")
        if not signed and x < 0:
            raise self.error(key, f"must be >= 0, got {x}")
        if x > maximum:
            raise self.error(key, f"must be <= {maximum}, got {x}")
        return x

    def signal(self, key: str, allowed: frozenset[str]) -> Signal:
        value = self.get(key)
        if value not in SIGNALS:
            raise self.error(key, f"unknown signal {value!r}; one of {', '.join(sorted(SIGNALS))}")
        if value not in allowed:
            raise self.error(key, f"{value!r} is not allowed here; one of {sorted(allowed)}")
        signal: Signal = value
        return signal


# -- sampling ----------------------------------------------------------------------


def machines_for(mix: Mix, gpus: int) -> int:
    """How many machines a job of ``gpus`` GPUs occupies."""
    return math.ceil(gpus / mix.gpus_per_node)


def sample(
    mix: Mix,
    *,
    gpus: int,
    days: float,
    seed: int,
    failslow: FailSlow | None = None,
    planned: bool = True,
) -> list[Failure]:
    """The failures a job of ``gpus`` GPUs meets in ``days``, sorted by time.

    Unexpected failures are a Poisson process of rate machines x
    ``failures_per_node_day``, each with a cause drawn by weight and a machine drawn
    uniformly; planned interruptions a Poisson process of ``planned_per_day`` per job;
    with ``failslow``, fail-slow episodes a Poisson process of rate machines x
    ``episodes_per_node_day`` plus the persistently slow machines, at t = 0 and lasting
    the whole run. Each kind draws from its own stream of ``seed``.
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus must be a positive integer, got {gpus!r}")
    if not (math.isfinite(days) and days >= 0):
        raise ValueError(f"days must be finite and >= 0, got {days!r}")
    machines = machines_for(mix, gpus)
    horizon_s = days * SECONDS_PER_DAY
    out: list[Failure] = []

    rng = _stream(seed, "unexpected")
    cum = list(accumulate(c.weight for c in mix.causes))
    for t in _arrivals(rng, machines * mix.failures_per_node_day, horizon_s):
        cause = rng.choices(mix.causes, cum_weights=cum)[0]
        machine = rng.randrange(machines)
        out.append(Failure(t, cause.name, cause.signal, machine, cause.xid, 0.0, 0.0))

    if planned:
        rng = _stream(seed, "planned")
        for t in _arrivals(rng, mix.planned_per_day, horizon_s):
            machine = rng.randrange(machines)
            out.append(Failure(t, PLANNED_CAUSE, "planned", machine, None, 0.0, 0.0))

    if failslow is not None:
        out.extend(_fail_slows(failslow, machines=machines, horizon_s=horizon_s, seed=seed))

    out.sort()
    return out


def _fail_slows(fs: FailSlow, *, machines: int, horizon_s: float, seed: int) -> list[Failure]:
    out: list[Failure] = []
    rng = _stream(seed, "failslow")
    cum = list(accumulate(c.weight for c in fs.causes))
    for t in _arrivals(rng, machines * fs.episodes_per_node_day, horizon_s):
        cause = rng.choices(fs.causes, cum_weights=cum)[0]
        machine = rng.randrange(machines)
        duration = min(
            rng.lognormvariate(fs.duration_log_mean_s, fs.duration_log_sigma), fs.duration_max_s
        )
        slowdown = min(
            rng.lognormvariate(fs.slowdown_log_mean, fs.slowdown_log_sigma), fs.slowdown_max
        )
        out.append(Failure(t, cause.name, "straggler", machine, None, slowdown, duration))
    if horizon_s > 0:
        rng = _stream(seed, "slow_machines")
        for machine in range(machines):
            if rng.random() < fs.slow_machine_fraction:
                out.append(
                    Failure(
                        0.0,
                        SLOW_MACHINE_CAUSE,
                        "straggler",
                        machine,
                        None,
                        fs.slow_machine_slowdown,
                        horizon_s,
                    )
                )
    return out


def _stream(seed: int, kind: str) -> random.Random:
    # A str seed is hashed with SHA-512, so the streams are stable across processes and
    # Python builds (no hash randomisation) and independent of each other.
    return random.Random(f"tmd.sim.mixes/{seed}/{kind}")


def _arrivals(rng: random.Random, rate_per_day: float, horizon_s: float) -> list[float]:
    """Arrival times of a Poisson process of ``rate_per_day`` in [0, ``horizon_s``)."""
    if rate_per_day <= 0:
        return []
    rate_per_s = rate_per_day / SECONDS_PER_DAY
    times: list[float] = []
    t = rng.expovariate(rate_per_s)
    while t < horizon_s:
        times.append(t)
        t += rng.expovariate(rate_per_s)
    return times
