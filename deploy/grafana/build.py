"""Writes tmd.json, the operators' Grafana dashboard (Grafana 10+), from the panels below.

    python3 deploy/grafana/build.py            # rewrite tmd.json next to this file
    python3 deploy/grafana/build.py --check    # exit 1 if tmd.json is not what it writes

Edit here, run it, commit both: a test checks that the committed JSON is this script's
output, and runs every panel's query against a real Prometheus scraping a real daemon
(tests/integration/prometheus.py). Standard library only.

Variables: ``datasource`` (any Prometheus), ``job`` (the *scrape* job of tmd's head
nodes, "tmd" in deploy/prometheus/prometheus.yml), ``instance`` (head nodes) and
``tmd_job`` (training jobs: tmd's own metric label, since Prometheus owns ``job``).
Panels marked "(recording rule)" read deploy/prometheus/tmd-rules.yml's recording rules.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("tmd.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
SEL = 'job=~"$job", instance=~"$instance"'
JOB_SEL = f'{SEL}, tmd_job=~"$tmd_job"'
RATE = "$__rate_interval"

Json = dict[str, Any]
Steps = Sequence[tuple[str, float | None]]

# Threshold steps: (colour, from value); the first is the base (from -infinity).
OK_ONLY = [("green", None)]
ANY_IS_BAD = [("green", None), ("red", 1)]
NONE_IS_BAD = [("red", None), ("green", 1)]
LOOP_LAG = [("green", None), ("yellow", 1), ("red", 5)]  # /healthz fails at 5 s
# Live migration downtime is ~0.1-0.3 s; ~4 s is what checkpoint-restart costs (DESIGN).
DOWNTIME = [("green", None), ("yellow", 1), ("red", 4)]

UP_DOWN = [(0, "down", "red"), (1, "up", "green")]


def _thresholds(steps: Steps) -> Json:
    return {"mode": "absolute", "steps": [{"color": c, "value": v} for c, v in steps]}


def _mappings(values: Sequence[tuple[int, str, str]]) -> list[Json]:
    """Value -> text and colour (stat panels' up/down, connected, stale...)."""
    options = {
        str(v): {"text": text, "color": color, "index": i}
        for i, (v, text, color) in enumerate(values)
    }
    return [{"type": "value", "options": options}]


def _target(
    expr: str,
    legend: str = "__auto",
    *,
    instant: bool = False,
    fmt: str = "time_series",
) -> Json:
    """A query; ``instant``: one value now (a query over ``$__range``, the whole time
    range, must be: as a range query each point would cover the range before it)."""
    return {
        "datasource": DS,
        "expr": expr,
        "legendFormat": legend,
        "range": not instant,
        "instant": instant,
        "format": fmt,
    }


def _panel(
    kind: str,
    title: str,
    description: str,
    targets: list[Json],
    *,
    unit: str,
    thresholds: Steps,
    width: int,
    height: int = 8,
    mappings: list[Json] | None = None,
    min_value: float | None = None,
    options: Json | None = None,
    custom: Json | None = None,
) -> Json:
    defaults: Json = {
        "unit": unit,
        "thresholds": _thresholds(thresholds),
        "color": {"mode": "thresholds" if kind in ("stat", "bargauge") else "palette-classic"},
        "mappings": mappings or [],
    }
    if min_value is not None:
        defaults["min"] = min_value
    if custom is not None:
        defaults["custom"] = custom
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": options or {},
        "gridPos": {"w": width, "h": height},
    }


def stat(
    title: str,
    description: str,
    *targets: Json,
    unit: str = "short",
    thresholds: Steps = OK_ONLY,
    width: int = 4,
    mappings: list[Json] | None = None,
    text: str = "auto",
) -> Json:
    """A stat: the last value of each series (``text="name"``: its legend instead)."""
    return _panel(
        "stat",
        title,
        description,
        list(targets),
        unit=unit,
        thresholds=thresholds,
        width=width,
        height=5,
        mappings=mappings,
        options={
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "colorMode": "background",
            "graphMode": "none",
            "textMode": text,
            "justifyMode": "auto",
            "orientation": "auto",
        },
    )


def series(
    title: str,
    description: str,
    *targets: Json,
    unit: str,
    thresholds: Steps = OK_ONLY,
    width: int = 12,
    bars: bool = False,
    mappings: list[Json] | None = None,
    min_value: float | None = 0,
) -> Json:
    """A time series; thresholds other than the base are drawn as dashed lines."""
    custom = {
        "drawStyle": "bars" if bars else "line",
        "lineWidth": 1,
        "fillOpacity": 60 if bars else 10,
        "showPoints": "never",
        "spanNulls": False,
        "thresholdsStyle": {"mode": "dashed" if len(thresholds) > 1 else "off"},
    }
    return _panel(
        "timeseries",
        title,
        description,
        list(targets),
        unit=unit,
        thresholds=thresholds,
        width=width,
        mappings=mappings,
        min_value=min_value,
        custom=custom,
        options={
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    )


def row(title: str, *panels: Json) -> tuple[str, list[Json]]:
    return title, list(panels)


def rows() -> list[tuple[str, list[Json]]]:
    return [
        row(
            "Cluster health",
            stat(
                "Head nodes up",
                "Whether Prometheus scrapes each tmd head node (`up`).",
                _target(f"up{{{SEL}}}", "{{instance}}"),
                unit="none",
                thresholds=NONE_IS_BAD,
                mappings=_mappings(UP_DOWN),
            ),
            stat(
                "Machines online",
                "Machines whose agent's last status is online, by role"
                " (worker, standby). 0 standby machines online: nothing to migrate to.",
                _target(f'sum by (role) (tmd_machines{{{SEL}, state="online"}})', "{{role}}"),
                thresholds=NONE_IS_BAD,
            ),
            stat(
                "Machines offline",
                "Machines whose agent's last word was offline (its"
                " Last Will, or a clean stop), by role.",
                _target(f'sum by (role) (tmd_machines{{{SEL}, state="offline"}})', "{{role}}"),
                thresholds=ANY_IS_BAD,
            ),
            stat(
                "Machines out of service",
                "Machines no migration moves work onto. gpu_fault:"
                " one of its GPUs had a fatal fault (XID, double-bit ECC, row-remap failure,"
                " fell off the bus) since its agent last started; it stays out until the"
                " agent restarts after the repair. lost: offline, or silent since a NodeLost.",
                _target(f"sum by (cause) (tmd_machines_out_of_service{{{SEL}}})", "{{cause}}"),
                thresholds=ANY_IS_BAD,
            ),
            stat(
                "In the view",
                "Jobs, machines and reporting ranks the daemon holds.",
                _target(f"sum(tmd_view_jobs{{{SEL}}})", "jobs"),
                _target(f"sum(tmd_view_nodes{{{SEL}}})", "machines"),
                _target(f"sum(tmd_view_ranks{{{SEL}}})", "ranks"),
                thresholds=[("blue", None)],
            ),
            stat(
                "Version",
                "tmd's version on each head node: upgrade the daemon before the jobs' runtime.",
                _target(f"tmd_build_info{{{SEL}}}", "{{instance}} {{version}}"),
                unit="none",
                thresholds=[("blue", None)],
                text="name",
            ),
            series(
                "GPU and machine findings",
                "Faults the detectors found per interval: a"
                " GpuFault moves the machine's work off it (failover), a GpuDegraded may"
                " (restart or drain), a NodeLost is a machine gone silent, a RankStalled a"
                " process that stopped stepping.",
                _target(
                    f'sum by (kind) (increase(tmd_events_total{{{SEL}, kind=~"GpuFault|'
                    f'GpuDegraded|NodeLost|RankStalled"}}[{RATE}]))',
                    "{{kind}}",
                ),
                unit="short",
                thresholds=ANY_IS_BAD,
                bars=True,
                width=8,
            ),
            _bargauge(
                "Ready standby machines per job",
                "Standby machines that may take a"
                " machine of the job now: ready, not a member, their machine neither"
                " offline nor faulty, with its slots and GPU model; for the job's"
                " worst-off machine. 0: a failure costs a checkpoint restart, and"
                " planned moves are held (alert TmdJobWithoutReadyStandby, for jobs"
                " that have not stopped). Each job with its state.",
                _target(
                    f"max by (tmd_job, state) (tmd_job_standbys_ready{{{JOB_SEL}}}"
                    " * on (job, instance, tmd_job) group_left (state)"
                    f" (tmd_job_state{{{JOB_SEL}}} == 1))",
                    "{{tmd_job}} ({{state}})",
                    instant=True,
                ),
            ),
            series(
                "Standby machines per job, by state",
                "What each job's status says of its"
                " standby machines: warming (shadow iterations), ready, joining (being"
                " switched in), failed.",
                _target(
                    f"sum by (tmd_job, state) (tmd_job_standbys{{{JOB_SEL}}})",
                    "{{tmd_job}} {{state}}",
                ),
                unit="short",
                width=8,
            ),
        ),
        row(
            "Stragglers",
            series(
                "Slowdown of machines flagged slow",
                "How much slower than its peers each"
                " flagged machine was when found (0.2 = 20%), until it is cleared or leaves"
                " its job. Empty while no machine straggles.",
                _target(
                    f"max by (tmd_job, node) (tmd_straggler_slowdown{{{JOB_SEL}}})",
                    "{{tmd_job}} {{node}}",
                ),
                unit="percentunit",
                thresholds=[("green", None), ("yellow", 0.1), ("red", 0.3)],
                width=12,
            ),
            stat(
                "Machines flagged slow now",
                "Machines the straggler detector flagged that"
                " are still in their job; the rebalance policy moves them at its next tick"
                " when that pays.",
                _target(f"count(tmd_straggler_slowdown{{{JOB_SEL}}}) or vector(0)", "flagged"),
                thresholds=[("green", None), ("yellow", 1)],
            ),
            series(
                "Straggler findings",
                "Machines found slow, and cleared (back to speed, or moved), per interval.",
                _target(
                    f'sum by (kind) (increase(tmd_events_total{{{SEL}, kind=~"StragglerFound|'
                    f'StragglerCleared"}}[{RATE}]))',
                    "{{kind}}",
                ),
                unit="short",
                thresholds=[("green", None), ("yellow", 1)],
                bars=True,
                width=8,
            ),
        ),
        row(
            "Migrations",
            series(
                "Migrations by outcome and policy (recording rule)",
                "Finished migrations"
                " per hour (5-minute rate), by outcome (done, aborted: everyone went back to"
                " the old group, failed: no answer, not even to the abort) and by the policy"
                " that decided them (runtime: a failover the job did by itself).",
                _target(
                    f"sum by (outcome, policy) (tmd:migrations:rate5m{{{SEL}}}) * 3600",
                    "{{policy}} {{outcome}}",
                ),
                unit="count:/h",
                width=8,
            ),
            series(
                "Decisions",
                "What the policies decided per interval: Migrate, Hold (not"
                " run, with its reason: `tmd events --kind Hold`), CheckpointRestart.",
                _target(
                    f'sum by (kind) (increase(tmd_events_total{{{SEL}, kind=~"Migrate|Hold|'
                    f'CheckpointRestart"}}[{RATE}]))',
                    "{{kind}}",
                ),
                unit="short",
                bars=True,
                width=8,
            ),
            series(
                "Migrations in flight",
                "Migrations the actuator is driving (checkpoint restarts not included).",
                _target(f"sum by (instance) (tmd_migrations_in_flight{{{SEL}}})", "{{instance}}"),
                unit="short",
                thresholds=[("green", None), ("yellow", 5)],
                width=8,
            ),
            _heatmap(
                "Migration downtime",
                "Downtime of finished migrations as the runtime"
                " measured it (end of the last step before the switch to the end of the"
                " first after it, minus a median step), counted per interval.",
                _target(
                    f"sum by (le) (increase(tmd_migration_downtime_seconds_bucket{{{SEL}}}"
                    f"[{RATE}]))",
                    "{{le}}",
                    fmt="heatmap",
                ),
            ),
            stat(
                "Downtime over the range",
                "Mean and 95th percentile downtime of the"
                " migrations finished in the time range. Live: about a step; a checkpoint"
                " restart costs seconds.",
                _target(
                    f"sum(increase(tmd_migration_downtime_seconds_sum{{{SEL}}}[$__range]))"
                    f" / sum(increase(tmd_migration_downtime_seconds_count{{{SEL}}}"
                    "[$__range]))",
                    "mean",
                    instant=True,
                ),
                _target(
                    "histogram_quantile(0.95, sum by (le) (increase("
                    f"tmd_migration_downtime_seconds_bucket{{{SEL}}}[$__range])))",
                    "p95",
                    instant=True,
                ),
                unit="s",
                thresholds=DOWNTIME,
                width=6,
            ),
            series(
                "Checkpoint restarts asked",
                "Restarts the actuator asked a job for (no"
                " standby could take a faulty machine), by outcome, per interval.",
                _target(
                    f"sum by (outcome) (increase(tmd_restarts_total{{{SEL}}}[{RATE}]))",
                    "{{outcome}}",
                ),
                unit="short",
                thresholds=ANY_IS_BAD,
                bars=True,
                width=6,
            ),
        ),
        row(
            "Ingest",
            series(
                "Messages received",
                "MQTT messages per second, valid or not, by kind of topic. And GPU"
                " samples by form: full, brief (each GPU's clock event reasons, the rest"
                " as in the last full one), unresolved (brief, its full one not held"
                " here, as after a restart: a heartbeat until the next full one,"
                " agent.full_sample_every_s).",
                _target(
                    f"sum by (kind) (rate(tmd_messages_received_total{{{SEL}}}[{RATE}]))",
                    "{{kind}}",
                ),
                _target(
                    f"sum by (form) (rate(tmd_gpu_samples_total{{{SEL}}}[{RATE}]))",
                    "GPU samples: {{form}}",
                ),
                unit="count:msg/s",
                width=8,
            ),
            series(
                "Messages rejected or lost",
                "Messages dropped as invalid, by reason (README, topic"
                " reference): version (a sender newer than the daemon), rank, schema, json,"
                " value, mismatch, limit (the view's caps), internal (a bug). And telemetry"
                " lost on the way (gaps in its senders' sequence numbers: the broker"
                " drops what a daemon that lags cannot take; TmdMessagesLost), and"
                " telemetry the daemon dropped for an ingest shard that fell behind"
                " (ingest.shards).",
                _target(
                    f"sum by (reason) (rate(tmd_messages_rejected_total{{{SEL}}}[{RATE}]))",
                    "{{reason}}",
                ),
                _target(
                    f"sum by (kind) (rate(tmd_messages_lost_total{{{SEL}}}[{RATE}]))",
                    "lost: {{kind}}",
                ),
                _target(
                    f"sum by (kind) (rate(tmd_shard_dropped_total{{{SEL}}}[{RATE}]))",
                    "dropped for a shard: {{kind}}",
                ),
                unit="count:msg/s",
                thresholds=[("green", None), ("red", 0.001)],
                width=8,
            ),
            series(
                "Rejected share (recording rule)",
                "Rejected over received, 5-minute rate:"
                " the TmdIngestRejecting alert fires over 1% for 10 minutes.",
                _target(
                    f"tmd:messages_rejected_per_received:ratio_rate5m{{{SEL}}}", "{{instance}}"
                ),
                unit="percentunit",
                thresholds=[("green", None), ("red", 0.01)],
                width=8,
            ),
            series(
                "Ingest lag",
                "How far behind the daemon's view is: its last probe's trip"
                " through the broker, or how overdue the next one is. -1: no probe came back"
                " yet (its own alert: TmdIngestNoProbe). Past ingest.stale_lag_s (5 s) the"
                " view is stale.",
                _target(f"tmd_ingest_lag_seconds{{{SEL}}}", "{{instance}}"),
                unit="s",
                thresholds=LOOP_LAG,
                min_value=-1,
                mappings=_mappings([(-1, "no probe back yet", "orange")]),
                width=8,
            ),
            series(
                "Sender to view latency",
                "From a message's timestamp to its place in the"
                " view, 50th and 95th percentile (includes the senders' clock skew).",
                _target(
                    f"histogram_quantile(0.5, sum by (le) (rate("
                    f"tmd_ingest_latency_seconds_bucket{{{SEL}}}[{RATE}])))",
                    "p50",
                ),
                _target(
                    f"histogram_quantile(0.95, sum by (le) (rate("
                    f"tmd_ingest_latency_seconds_bucket{{{SEL}}}[{RATE}])))",
                    "p95",
                ),
                unit="s",
                thresholds=LOOP_LAG,
                width=8,
            ),
            series(
                "Rank steps",
                "Step reports per second, by outcome: accepted, duplicate"
                " (sent twice), late (older than the window, or of a rolled-back timeline).",
                _target(
                    f"sum by (outcome) (rate(tmd_rank_steps_total{{{SEL}}}[{RATE}]))", "{{outcome}}"
                ),
                unit="count:steps/s",
                width=8,
            ),
            stat(
                "Broker",
                "Whether each head node is subscribed to the MQTT broker.",
                _target(f"tmd_mqtt_connected{{{SEL}}}", "{{instance}}"),
                unit="none",
                thresholds=NONE_IS_BAD,
                mappings=_mappings([(0, "disconnected", "red"), (1, "connected", "green")]),
            ),
            stat(
                "View",
                "stale (or settling): while the daemon cannot trust its view it finds"
                " no machine lost and starts no migration.",
                _target(f"tmd_view_stale{{{SEL}}}", "{{instance}}"),
                unit="none",
                thresholds=ANY_IS_BAD,
                mappings=_mappings([(0, "current", "green"), (1, "stale", "red")]),
            ),
            stat(
                "Broker connection losses",
                "Lost or failed broker connections over the time range.",
                _target(
                    f"sum by (instance) (increase(tmd_mqtt_connection_failures_total{{{SEL}}}"
                    "[$__range]))",
                    "{{instance}}",
                    instant=True,
                ),
                thresholds=ANY_IS_BAD,
            ),
        ),
        row(
            "The daemon",
            series(
                "Event-loop lag",
                "How late the daemon's event loop runs, as last measured"
                " when scraped. /healthz fails at 5 s; past half of WatchdogSec systemd"
                " restarts the daemon. A stall between two scrapes is not drawn here:"
                " the daemon counts each (tmd_event_loop_stalls_total, alert"
                " TmdEventLoopStalled).",
                _target(f"tmd_event_loop_lag_seconds{{{SEL}}}", "{{instance}}"),
                unit="s",
                thresholds=LOOP_LAG,
                width=8,
            ),
            series(
                "Plug-in restarts",
                "Detector and policy restarts after an error, per"
                " interval (alert TmdPluginRestarting).",
                _target(
                    f"sum by (plugin) (increase(tmd_plugin_restarts_total{{{SEL}}}[{RATE}]))",
                    "{{plugin}}",
                ),
                unit="short",
                thresholds=ANY_IS_BAD,
                bars=True,
                width=8,
            ),
            series(
                "Plug-in time per batch, p95",
                "Time a detector or policy spent on one batch"
                " of events or one tick; it runs on the event loop, so this is loop lag.",
                _target(
                    "histogram_quantile(0.95, sum by (le, plugin) (rate("
                    f"tmd_plugin_batch_seconds_bucket{{{SEL}}}[{RATE}])))",
                    "{{plugin}}",
                ),
                unit="s",
                thresholds=[("green", None), ("yellow", 0.1), ("red", 1)],
                width=8,
            ),
            stat(
                "Plug-ins up",
                "Each detector and policy: up, or down while it backs off after an error.",
                _target(f"min by (plugin) (tmd_plugin_up{{{SEL}}})", "{{plugin}}"),
                unit="none",
                thresholds=NONE_IS_BAD,
                mappings=_mappings(UP_DOWN),
                width=8,
            ),
            series(
                "Journal write errors",
                "Failed writes to the SQLite journal, per interval"
                " (alert TmdJournalFailing): migrations are journaled before each command.",
                _target(
                    f"sum by (instance) (increase(tmd_journal_errors_total{{{SEL}}}[{RATE}]))",
                    "{{instance}}",
                ),
                unit="short",
                thresholds=ANY_IS_BAD,
                bars=True,
                width=8,
            ),
            series(
                "Dropped events and actuator errors",
                "Events dropped because a plug-in or"
                " the actuator fell behind (by subscriber), and unexpected errors in the"
                " actuator (by what it was doing), per interval. Empty while there were none.",
                _target(
                    f"sum by (subscriber) (increase(tmd_bus_dropped_total{{{SEL}}}[{RATE}]))",
                    "dropped for {{subscriber}}",
                ),
                _target(
                    f"sum by (during) (increase(tmd_actuator_errors_total{{{SEL}}}[{RATE}]))",
                    "actuator error in {{during}}",
                ),
                unit="short",
                thresholds=ANY_IS_BAD,
                bars=True,
                width=8,
            ),
        ),
    ]


def _bargauge(title: str, description: str, target: Json) -> Json:
    return _panel(
        "bargauge",
        title,
        description,
        [target],
        unit="short",
        thresholds=NONE_IS_BAD,
        width=8,
        min_value=0,
        options={
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
            "orientation": "horizontal",
            "displayMode": "basic",
            "showUnfilled": True,
        },
    )


def _heatmap(title: str, description: str, target: Json) -> Json:
    return _panel(
        "heatmap",
        title,
        description,
        [target],
        unit="s",
        thresholds=DOWNTIME,
        width=12,
        options={
            "calculate": False,
            "yAxis": {"unit": "s"},
            "cellGap": 1,
            "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
            "tooltip": {"show": True, "yHistogram": True},
            "legend": {"show": True},
        },
    )


def _variables() -> list[Json]:
    def query(name: str, label: str, expr: str, description: str, *, multi: bool) -> Json:
        return {
            "name": name,
            "label": label,
            "description": description,
            "type": "query",
            "datasource": DS,
            "definition": expr,
            "query": {"query": expr, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2,
            "sort": 1,
            "regex": "",
            "hide": 0,
            "multi": multi,
            "includeAll": multi,
            "allValue": ".*" if multi else None,
            "current": {},
            "options": [],
        }

    return [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "regex": "",
            "hide": 0,
            "current": {},
            "options": [],
            "refresh": 1,
            "multi": False,
            "includeAll": False,
        },
        query(
            "job",
            "Scrape job",
            "label_values(tmd_build_info, job)",
            "Prometheus's scrape job of tmd's head nodes (\"tmd\" in"
            " deploy/prometheus/prometheus.yml), not a training job: tmd calls those"
            " tmd_job, since Prometheus sets job itself.",
            multi=False,
        ),
        query(
            "instance",
            "Head node",
            'label_values(tmd_build_info{job=~"$job"}, instance)',
            "tmd head nodes (each owns whole training jobs).",
            multi=True,
        ),
        query(
            "tmd_job",
            "Training job",
            f"label_values(tmd_job_state{{{SEL}}}, tmd_job)",
            "Training jobs, by tmd's label tmd_job.",
            multi=True,
        ),
    ]


def dashboard() -> Json:
    panels: list[Json] = []
    y = 0
    for title, members in rows():
        panels.append(
            {
                "type": "row",
                "title": title,
                "collapsed": False,
                "panels": [],
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            }
        )
        y += 1
        x, line_h = 0, 0
        for p in members:
            grid = p["gridPos"]
            if x + grid["w"] > 24:
                x, y, line_h = 0, y + line_h, 0
            grid.update(x=x, y=y)
            x += grid["w"]
            line_h = max(line_h, grid["h"])
            panels.append(p)
        y += line_h
    for i, p in enumerate(panels, start=1):
        p["id"] = i
    return {
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
        ],
        "uid": "tmd-operators",
        "title": "tmd: operators' view",
        "description": "tmd head nodes: cluster health, stragglers, migrations, ingest and"
        " the daemon itself. Alerts and recording rules: deploy/prometheus/tmd-rules.yml.",
        "tags": ["tmd", "training"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timezone": "browser",
        "schemaVersion": 38,
        "version": 1,
        "annotations": {
            "list": [
                {
                    "builtIn": 1,
                    "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                    "enable": True,
                    "hide": True,
                    "iconColor": "rgba(0, 211, 255, 1)",
                    "name": "Annotations & Alerts",
                    "type": "dashboard",
                }
            ]
        },
        "templating": {"list": _variables()},
        "links": [],
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text() != text:
            print(f"{OUT} is stale: run python3 {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
