"""Policies (``tmd.policies``): turn findings and the cluster view into decisions.

Each policy is a ``tmd.daemon.plugins.Plugin`` whose ``observe``/``tick`` return decisions
(``tmd.daemon.events.Decision``), always with a reason that is journaled. Built-ins are
listed here by name; the name is also the config section (``[policies.NAME]``).
"""

from __future__ import annotations

from tmd.policies.alert import AlertPolicy
from tmd.policies.base import Policy
from tmd.policies.drain import DrainPolicy
from tmd.policies.failover import FailoverPolicy
from tmd.policies.fpi import FpiPolicy
from tmd.policies.rebalance import RebalancePolicy

BUILTIN: dict[str, type[Policy]] = {
    p.name: p for p in (AlertPolicy, DrainPolicy, FailoverPolicy, FpiPolicy, RebalancePolicy)
}

__all__ = ["BUILTIN", "Policy"]
