"""Plain-text tables for ``tmd status`` and ``tmd events`` (from the API's JSON)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from typing import Any

MAX_RANKS_SHOWN = 64


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    cells = [[_cell(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells
    ]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def render_status(data: dict[str, Any], *, all_ranks: bool = False) -> str:
    jobs = data.get("jobs", [])
    out = [_daemon_line(data), "\nJOBS", _jobs_table(jobs)]
    migrations = data.get("migrations", [])
    if migrations:
        out += ["\nMIGRATIONS (newest first)", _migrations_table(migrations)]
    for j in jobs:
        out += _ranks_table(j, all_ranks=all_ranks)
    nodes = data.get("nodes", [])
    out += ["\nNODES", _nodes_table(nodes[:MAX_RANKS_SHOWN])]
    if len(nodes) > MAX_RANKS_SHOWN:
        out.append(f"... and {len(nodes) - MAX_RANKS_SHOWN} more nodes (--json for all)")
    return "\n".join(out)


def _daemon_line(data: dict[str, Any]) -> str:
    health = data.get("health", {})
    totals = data.get("totals", {})
    return (
        f"daemon: mqtt {health.get('mqtt', '?')}, loop lag {health.get('loop_lag_s', '?')} s; "
        f"{totals.get('jobs', 0)} jobs, {totals.get('ranks', 0)} ranks, "
        f"{totals.get('nodes', 0)} nodes"
    )


def _jobs_table(jobs: Sequence[dict[str, Any]]) -> str:
    return table(
        ["JOB", "STATE", "WORLD", "GEN", "STEP", "REPORTING", "STANDBYS", "SEEN"],
        [
            [
                j["job"],
                j["state"],
                j["world_size"],
                j["generation"],
                j["step"],
                j["reporting_ranks"],
                ", ".join(f"{s['node']}({s['state']})" for s in j["standbys"]) or "-",
                _age(j["last_seen_s"]),
            ]
            for j in jobs
        ],
    )


def _migrations_table(migrations: Sequence[dict[str, Any]]) -> str:
    return table(
        ["ID", "JOB", "LEAVER", "JOINER", "STATE", "DOWNTIME S", "REASON"],
        [
            [
                m["id"],
                m["job"],
                m["leaver"],
                m["joiner"],
                m["state"],
                m["detail"].get("downtime_s", "-"),
                m["reason"][:60],
            ]
            for m in migrations
        ],
    )


def _ranks_table(job: dict[str, Any], *, all_ranks: bool) -> list[str]:
    """The title and table of a job's ranks; nothing for a job without ranks."""
    ranks = job.get("ranks", [])
    if not ranks:
        return []
    if len(ranks) > MAX_RANKS_SHOWN and not all_ranks:
        # The slowest by compute first: that is where a straggler shows.
        ranks = sorted(ranks, key=lambda r: -(r["median_compute_s"] or 0))[:10]
        title = (
            f"\nRANKS of {job['job']} (10 slowest by compute of {job['reporting_ranks']};"
            " --ranks for all)"
        )
    else:
        title = f"\nRANKS of {job['job']}"
    headers = [
        "RANK",
        "NODE",
        "LAST STEP",
        "SEEN",
        "MEDIAN STEP S",
        "MEDIAN COMPUTE S",
        "DUP",
        "LATE",
    ]
    rows = [
        [
            r["rank"],
            r["node"],
            r["last_step"],
            _age(r["last_seen_s"]),
            r["median_step_s"],
            r["median_compute_s"],
            r["duplicates"],
            r["late"],
        ]
        for r in ranks
    ]
    return [title, table(headers, rows)]


def _nodes_table(nodes: Sequence[dict[str, Any]]) -> str:
    return table(
        ["NODE", "STATE", "ROLE", "GPUS", "MAX TEMP C", "LAST XID", "SEEN"],
        [
            [
                n["node"],
                n["state"],
                n["role"],
                n["gpus"],
                n["max_temp_c"],
                f"{n['last_xid']['xid']} (gpu {n['last_xid']['gpu']})" if n["last_xid"] else "-",
                _age(n["last_seen_s"]),
            ]
            for n in nodes
        ],
    )


def render_events(rows: Sequence[dict[str, Any]]) -> str:
    def when(ts: float) -> str:
        return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S")

    def what(body: dict[str, Any]) -> str:
        skip = {"ts", "type", "job", "node"}
        return " ".join(
            f"{k}={v}" for k, v in body.items() if k not in skip and v not in ("", None)
        )

    return table(
        ["ID", "TIME (UTC)", "KIND", "JOB", "NODE", "SOURCE", "DETAIL"],
        [
            [
                r["id"],
                when(r["ts"]),
                r["kind"],
                r["job"] or "-",
                r["node"] or "-",
                r["source"] or "-",
                what(r["body"]),
            ]
            for r in rows
        ],
    )
