"""The operators' view: the Grafana dashboard (``deploy/grafana``) and the Prometheus rules
(``deploy/prometheus``). Here without a server: the dashboard is its script's output,
every panel has a unit and thresholds, and every query and rule names metrics the daemon
exports, with labels they carry; ``promtool`` checks the rules and runs their unit tests
(every alert firing and not). A real Prometheus scraping a real daemon runs every panel's
query in ``tests/integration/test_e2e.py``."""

from __future__ import annotations

import json
import re
import runpy
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import need_tool
from tmd import config as config_mod
from tmd import wire
from tmd.daemon import events
from tmd.daemon.daemon import Daemon

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
PROMETHEUS = ROOT / "deploy" / "prometheus"
RULES = PROMETHEUS / "tmd-rules.yml"
SCRAPE = {"job", "instance"}  # the labels Prometheus gives every series it scrapes

# -- what the daemon exports ------------------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, set[str]]]:
    """Every series name a daemon exports -> its label names (the scrape's added), with
    every labelled metric given a child (as a running daemon with a job would)."""
    path = tmp_path_factory.mktemp("journal") / "j.sqlite3"
    daemon = Daemon(config_mod.from_dict({"journal": {"path": str(path)}}))
    try:
        status = wire.JobStatus(
            ts=0.0, job="a", generation=0, world_size=1, members=[wire.Member(0, "n0")],
            standbys=[wire.StandbyInfo(node="s0", state="ready")],
        )  # fmt: skip
        daemon.view.apply_job_status(status, 0.0)
        daemon.emit(events.StragglerFound(ts=0.0, job="a", node="n0", slowdown=0.2,
                                          confidence=1.0, since_step=0), "straggler")  # fmt: skip
        m = daemon.metrics
        m.migration_started("rebalance")
        for plugin in ("straggler",):
            m.plugin_started(plugin)
            m.plugin_up.labels(plugin=plugin)
            m.plugin_seconds.labels(plugin=plugin)
        m.bus_dropped.labels(subscriber="actuator")
        m.actuator_errors.labels(during="tick")
        m.actuator_ignored.labels(reason="stale")
        found: dict[str, set[str]] = {"up": set(SCRAPE)}
        for family in m.registry.collect():
            for sample in family.samples:
                found.setdefault(sample.name, set(SCRAPE)).update(sample.labels)
        yield found
    finally:
        daemon.journal.close()


# -- reading PromQL well enough to name its metrics and labels --------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_NOT_METRICS = {
    "sum", "min", "max", "count", "rate", "increase", "histogram_quantile", "max_over_time",
    "quantile_over_time",
    "count_over_time", "absent", "vector", "and", "or", "unless", "by", "on", "ignoring",
    "without", "group_left", "group_right",
}  # fmt: skip


def names_and_labels(expr: str) -> tuple[dict[str, set[str]], set[str]]:
    """The metric names ``expr`` reads, each with the labels its selectors match on, and
    the labels it groups or matches by (``by``, ``on``...)."""
    metrics: dict[str, set[str]] = {}
    bare = _STRING.sub('""', expr)  # what a label value says is no name
    for name, inside in _SELECTOR.findall(bare):
        metrics.setdefault(name, set()).update(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", inside))
    grouped = {label.strip() for g in _GROUPING.findall(bare) for label in g.split(",")}
    rest = _GROUPING.sub(" ", _SELECTOR.sub(r"\1", bare))
    rest = re.sub(r"\[[^\]]*\]|\$\w+|\b\d+(?:\.\d+)?\b", " ", rest)
    for name in _NAME.findall(rest):
        if name not in _NOT_METRICS:
            metrics.setdefault(name, set())
    return metrics, grouped - {""}


def test_the_promql_reader_finds_names_and_labels() -> None:
    metrics, grouped = names_and_labels(
        'sum by (outcome, policy) (rate(tmd_x_total{job=~"$job", a="b{c} by (d)"}[1m]))'
        " / on (job) tmd:y:rate5m > 0.5 unless up == 0"
    )
    assert metrics == {"tmd_x_total": {"job", "a"}, "tmd:y:rate5m": set(), "up": set()}
    assert grouped == {"outcome", "policy", "job"}


Rule = dict[str, Any]


def rules() -> list[Rule]:
    """Each rule of the rules file: its ``record`` or ``alert``, ``expr``, ``labels``
    and ``for``, read by PyYAML where it is installed (tmd does not need it), else by
    ``rule_blocks``."""
    text = RULES.read_text()
    try:
        import yaml
    except ImportError:
        return rule_blocks(text)
    return [rule for group in yaml.safe_load(text)["groups"] for rule in group["rules"]]


_RULE_START = re.compile(r"^(\s*)- (alert|record): (.+)$")


def rule_blocks(text: str) -> list[Rule]:
    """The rules, as ``rules`` gives them, from the indentation of a Prometheus rules
    file (the subset of YAML it is written in). Each rule is read from its own lines
    only (from its ``- alert:`` or ``- record:`` to the next line indented as little),
    so nothing of one rule is taken for another's."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _RULE_START.match(line)]
    out = []
    for i in starts:
        m = _RULE_START.match(lines[i])
        assert m is not None
        indent = len(m.group(1))
        end = i + 1
        while end < len(lines) and (
            not lines[end].strip() or len(lines[end]) - len(lines[end].lstrip()) > indent
        ):
            end += 1
        out.append(_rule(m.group(2), m.group(3), lines[i + 1 : end]))
    return out


def _rule(kind: str, name: str, body: list[str]) -> Rule:
    lines = [(len(line) - len(line.lstrip()), line.strip()) for line in body]
    return {kind: _scalar(name), **_mapping(lines)}


def _mapping(lines: list[tuple[int, str]]) -> dict[str, Any]:
    """A mapping from its lines, as (indent, text): each key at the first key's indent,
    with a scalar, a block scalar (``|``, ``>-``: its deeper lines, joined) or a mapping
    (its deeper lines) for value."""
    keys = [indent for indent, text in lines if text and not text.startswith("#")]
    if not keys:
        return {}
    top, out, j = keys[0], {}, 0
    while j < len(lines):
        indent, text = lines[j]
        j += 1
        if not text or text.startswith("#"):
            continue
        assert indent == top, f"not a key of this mapping: {text!r}"
        key, _, value = text.partition(":")
        value = value.strip()
        nested_from = j
        while j < len(lines) and (not lines[j][1] or lines[j][0] > top):
            j += 1
        nested = lines[nested_from:j]
        if value in ("|", "|-", ">", ">-"):
            out[key] = " ".join(t for _, t in nested if t)
        elif not value:
            out[key] = _mapping(nested)
        else:
            out[key] = _scalar(value)
    return out


def _scalar(value: str) -> str:
    value = value.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        return value[1:-1]
    return value


def _one_line(expr: str) -> str:
    return " ".join(expr.split())


def _folded(rule: Rule) -> Rule:
    """``rule`` with its expr and annotations on one line each (a block scalar's line
    breaks are YAML's to keep or fold)."""
    out = {**rule, "expr": _one_line(rule["expr"])}
    if "annotations" in rule:
        out["annotations"] = {k: _one_line(v) for k, v in rule["annotations"].items()}
    return out


def recording_rules() -> dict[str, set[str]]:
    """Each recorded series -> the labels it keeps (its first ``by``)."""
    out = {}
    for rule in rules():
        if "record" in rule:
            by = re.search(r"\bby \(([^)]*)\)", rule["expr"])
            assert by is not None, rule["record"]
            out[rule["record"]] = {label.strip() for label in by.group(1).split(",")}
    return out


def dashboard() -> dict[str, object]:
    loaded: dict[str, object] = json.loads((GRAFANA / "tmd.json").read_text())
    return loaded


def dashboard_exprs() -> list[str]:
    panels = dashboard()["panels"]
    assert isinstance(panels, list)
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def assert_names_exist(expr: str, exported: dict[str, set[str]]) -> None:
    recorded = recording_rules()
    known = {**exported, **recorded}
    metrics, grouped = names_and_labels(expr)
    assert metrics, expr
    carried: set[str] = set(SCRAPE)
    for name, labels in metrics.items():
        assert name in known, f"{name} is not exported ({expr})"
        assert labels <= known[name] | SCRAPE, f"{name} has no {labels - known[name]} ({expr})"
        carried |= known[name]
    assert grouped <= carried, f"no metric of {expr} has {grouped - carried}"


# -- the dashboard ---------------------------------------------------------------------


def test_the_dashboard_is_what_its_script_writes() -> None:
    build = runpy.run_path(str(GRAFANA / "build.py"))
    assert (GRAFANA / "tmd.json").read_text() == build["render"](), (
        "deploy/grafana/tmd.json is stale: run python3 deploy/grafana/build.py"
    )


def test_every_panel_reads_the_chosen_data_source_with_a_unit_and_thresholds() -> None:
    board = dashboard()
    panels = [p for p in board["panels"] if p["type"] != "row"]  # type: ignore[attr-defined]
    assert len(panels) >= 20
    for p in panels:
        defaults = p["fieldConfig"]["defaults"]
        assert defaults["unit"], p["title"]
        assert defaults["thresholds"]["steps"][0]["value"] is None, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"] and all(t["datasource"] == p["datasource"] for t in p["targets"])
        assert p["description"], p["title"]
    rows = [p["title"] for p in board["panels"] if p["type"] == "row"]  # type: ignore[attr-defined]
    assert rows == ["Cluster health", "Stragglers", "Migrations", "Ingest", "The daemon"]
    variables = {v["name"]: v for v in board["templating"]["list"]}  # type: ignore[index]
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    # job is the scrape job; the training job is tmd's label tmd_job (Prometheus owns job).
    assert variables["job"]["definition"] == "label_values(tmd_build_info, job)"
    assert variables["tmd_job"]["definition"].endswith(", tmd_job)")


def test_every_panel_has_its_own_id_and_place_on_the_grid() -> None:
    """Grafana keys panels by id (a repeated one loses a panel's edits, links and
    state) and lays out gridPos as given: two panels on one cell hide each other."""
    panels = dashboard()["panels"]
    assert isinstance(panels, list)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)) and all(isinstance(i, int) and i > 0 for i in ids)
    cells: dict[tuple[int, int], str] = {}
    for p in panels:
        g = p["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] >= 0 and g["y"] >= 0, p["title"]
        assert g["x"] + g["w"] <= 24, f"{p['title']} is wider than the grid's 24 columns"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_a_query_over_the_whole_range_is_an_instant_query() -> None:
    """Over ``$__range`` as a range query, each point would sum the range before it:
    a stat's last value would be right, its sparkline and the others wrong."""
    targets = [t for p in dashboard()["panels"] for t in p.get("targets", [])]  # type: ignore[attr-defined]
    over_range = [t for t in targets if "$__range" in t["expr"]]
    assert len(over_range) >= 3
    for t in over_range:
        assert t["instant"] is True and t["range"] is False, t["expr"]


def test_every_query_names_metrics_the_daemon_exports_with_their_labels(
    exported: dict[str, set[str]],
) -> None:
    for expr in dashboard_exprs():
        assert_names_exist(expr, exported)
    board = dashboard()
    for var in board["templating"]["list"]:  # type: ignore[index]
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.*), (\w+)\)", var["definition"])
            assert m is not None, var["definition"]
            assert_names_exist(m.group(1), exported)
            metric = _NAME.match(m.group(1))
            assert metric is not None and m.group(2) in exported[metric.group(0)]


def test_every_rule_names_metrics_the_daemon_exports_with_their_labels(
    exported: dict[str, set[str]],
) -> None:
    found = rules()
    assert len(found) == len(re.findall(r"^\s+- (?:alert|record): ", RULES.read_text(), re.M))
    assert len(recording_rules()) == 4
    for rule in found:
        assert_names_exist(rule["expr"], exported)


def test_every_alert_has_a_severity_a_summary_and_what_to_do() -> None:
    alerts = [rule for rule in rules() if "alert" in rule]
    assert len(alerts) == 17
    for alert in alerts:
        assert alert["labels"]["severity"] in ("critical", "warning"), alert["alert"]
        assert set(alert["annotations"]) == {"summary", "description"}, alert["alert"]
    severity = {a["alert"]: a["labels"]["severity"] for a in alerts}
    assert severity["TmdDown"] == "critical"
    assert severity["TmdJobWithoutReadyStandby"] == "warning"


def test_the_rule_reader_without_yaml_reads_what_yaml_reads() -> None:
    """``rule_blocks``, what reads the rules where PyYAML is not installed, against
    PyYAML; and one rule's lines never reach into the next's."""
    yaml = pytest.importorskip("yaml")
    text = RULES.read_text()
    want = [r for g in yaml.safe_load(text)["groups"] for r in g["rules"]]
    got = rule_blocks(text)
    assert [_folded(r) for r in got] == [_folded(r) for r in want]
    # A rule without labels takes none from the next rule.
    two = (
        "groups:\n  - name: g\n    rules:\n      - alert: A\n        expr: up == 0\n"
        "      - alert: B\n        expr: |\n          up\n            == 1\n"
        "        labels:\n          severity: warning\n"
    )
    assert rule_blocks(two) == [
        {"alert": "A", "expr": "up == 0"},
        {"alert": "B", "expr": "up == 1", "labels": {"severity": "warning"}},
    ]


# -- the rules, by promtool --------------------------------------------------------------


@pytest.fixture
def promtool() -> str:
    return need_tool("promtool", shutil.which("promtool"), install="apt-get install -y prometheus")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(args), capture_output=True, text=True, timeout=60, check=False, cwd=PROMETHEUS
    )


def test_promtool_accepts_the_rules_and_the_scrape_config(promtool: str) -> None:
    rules = _run(promtool, "check", "rules", "tmd-rules.yml")
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS: 21 rules found" in rules.stdout
    config = _run(promtool, "check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr


def test_every_alert_fires_and_stays_quiet_in_promtools_unit_tests(promtool: str) -> None:
    """Each alert has a test where it fires (labels and annotations compared in full)
    and one where it does not; promtool runs them."""
    alerts = set(re.findall(r"- alert: (\w+)", RULES.read_text()))
    tests = (PROMETHEUS / "tmd-rules.test.yml").read_text()
    firing = set(re.findall(r"alertname: (\w+)\n\s+exp_alerts:\n", tests))
    quiet = set(re.findall(r"alertname: (\w+)\n\s+exp_alerts: \[\]", tests))
    assert alerts == firing == quiet, (alerts - firing, alerts - quiet)
    result = _run(promtool, "test", "rules", "tmd-rules.test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
