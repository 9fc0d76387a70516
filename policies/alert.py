"""``alert``: Alertmanager alerts about a node become failover migrations.

The HTTP receiver (``POST /api/v1/alerts``) turns each alert of a version-4 webhook
into an ``AlertFired``; this policy maps its labels to a node (and optionally a job)
and migrates. Alertmanager resends firing alerts on every group interval, so an alert
is acted on once per (fingerprint, startsAt); resolved alerts change nothing.

Labels follow Prometheus conventions: the machine is named by ``node``, DCGM-exporter's
``Hostname`` or the scrape target's ``instance`` (its port stripped); ``job`` is the
scrape job (``dcgm-exporter``, ``node``) and never names a training job, which only a
label of ours (``tmd_job``) can.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tmd.daemon import events
from tmd.errors import ConfigError
from tmd.plugins import Context
from tmd.policies.base import Policy, jobs_on
from tmd.wire import Name

MAX_REMEMBERED = 10_000
# A label value quoted in a reason is cut here: values may be 1 KiB, reasons are read.
MAX_SHOWN = 64
PROMETHEUS_JOB = "job"


@dataclass(frozen=True, kw_only=True)
class AlertConfig:
    """How an alert's labels name the machine and the job.

    ``node_label`` is deprecated: set ``node_labels`` instead. It is kept so that
    config files written for the single-label form still load; when set it replaces
    ``node_labels`` with ``[node_label]``."""

    # Labels that may name the machine, in order: the first present and non-empty wins.
    # Ours, then DCGM-exporter's, then the Prometheus scrape target's.
    node_labels: list[str] = field(default_factory=lambda: ["node", "Hostname", "instance"])
    node_label: str | None = None  # deprecated alias, see the docstring
    # Our label that names the training job; without it, every job on the machine.
    job_label: str = "tmd_job"
    # Only these alert names act (empty: any alert that names a node).
    alertnames: list[str] = field(default_factory=list)
    # Prometheus-style "host:9400" and "[fe80::1]:9400" name the host before the port.
    strip_port: bool = True

    def node_keys(self) -> list[str]:
        """The labels that name the machine, in the order they are tried."""
        return [self.node_label] if self.node_label is not None else list(self.node_labels)

    def validate(self) -> None:
        if self.job_label == PROMETHEUS_JOB:
            raise ConfigError(
                "policies.alert.job_label",
                "'job' is Prometheus's scrape job (dcgm-exporter, node), never a training "
                "job: label alerts with tmd_job (the default) or another label of yours",
            )
        key = "policies.alert." + ("node_label" if self.node_label is not None else "node_labels")
        if not self.node_keys():
            raise ConfigError(key, "needs at least one label")
        if not all(self.node_keys()):
            raise ConfigError(key, "a label name cannot be empty")


class AlertPolicy(Policy):
    name = "alert"
    Config = AlertConfig
    consumes = (events.AlertFired,)
    config: AlertConfig

    def __init__(self, config: AlertConfig, *, context: Context) -> None:
        super().__init__(config, context=context)
        self._node_keys = config.node_keys()
        self._seen: OrderedDict[tuple[str, str], None] = OrderedDict()

    def observe(self, event: Any, now: float) -> Iterable[events.Event]:
        if event.status != "firing":
            return ()
        if self.config.alertnames and event.name not in self.config.alertnames:
            return ()
        key = (event.fingerprint, event.starts_at)
        if key in self._seen:
            return ()
        self._seen[key] = None
        if len(self._seen) > MAX_REMEMBERED:
            self._seen.popitem(last=False)
        return self._decide(event, now)

    def _decide(self, alert: events.AlertFired, now: float) -> Iterator[events.Event]:
        why = f"alert {alert.name} ({alert.fingerprint})"
        found = self._node_of(alert.labels)
        if found is None:
            keys = ", ".join(map(repr, self._node_keys))
            yield events.Hold(
                ts=now, policy=self.name, reason=f"{why} has none of the labels {keys}"
            )
            return
        label, node = found
        if not _is_name(node):
            yield events.Hold(
                ts=now,
                policy=self.name,
                reason=f"{why}: label {label}={_shown(alert.labels[label])} names no machine "
                f"({_shown(node)} is not a valid node name)",
            )
            return
        view = self.context.view
        job = alert.labels.get(self.config.job_label)
        if job:
            # Only a job this daemon holds and that runs on the machine: a job another
            # head node owns, or a stale label, must not move anything here.
            known = view.jobs.get(job)
            if known is None or node not in known.members.values():
                whose = (
                    "is not known to this daemon" if known is None else f"does not run on {node}"
                )
                yield events.Hold(
                    ts=now,
                    policy=self.name,
                    job=job if _is_name(job) else "",
                    node=node,
                    reason=f"{why} names job {_shown(job)} and node {node}, but the job {whose}",
                )
                return
            jobs = [job]
        else:
            jobs = jobs_on(view, node)
        if not jobs:
            yield events.Hold(
                ts=now, policy=self.name, node=node, reason=f"{why}: no job runs on {node}"
            )
        for j in jobs:
            if view.ready_standbys(j, leaver=node):
                yield events.Migrate(ts=now, policy=self.name, job=j, node=node, reason=why)
            else:
                yield events.CheckpointRestart(
                    ts=now,
                    policy=self.name,
                    job=j,
                    node=node,
                    reason=f"{why}; no ready standby, so restart from the last checkpoint",
                )

    def _node_of(self, labels: Mapping[str, str]) -> tuple[str, str] | None:
        """The first node label present and non-empty, and the machine it names."""
        for label in self._node_keys:
            value = labels.get(label)
            if value:
                return label, host_of(value) if self.config.strip_port else value
        return None


def host_of(value: str) -> str:
    """The host of a Prometheus ``instance``-style value: ``h:9400`` → ``h``,
    ``[fe80::1]:9400`` and ``[fe80::1]`` → ``fe80::1``. A value with no numeric port is
    returned whole, and so is a bare IPv6 address (``fe80::1``): unbracketed, its last
    group cannot be told from a port."""
    if value.startswith("["):
        host, bracket, rest = value[1:].partition("]")
        if bracket and (not rest or (rest[:1] == ":" and _is_port(rest[1:]))):
            return host
        return value
    host, colon, port = value.rpartition(":")
    if colon and ":" not in host and _is_port(port):
        return host
    return value


def _is_port(text: str) -> bool:
    return text.isascii() and text.isdigit()


def _is_name(value: str) -> bool:
    """Whether ``value`` is a name the wire accepts for a node or job."""
    try:
        msgspec.convert(value, Name)
    except msgspec.ValidationError:
        return False
    return True


def _shown(value: str) -> str:
    return repr(value if len(value) <= MAX_SHOWN else value[:MAX_SHOWN] + "…")
