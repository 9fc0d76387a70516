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


def rules() -> list[tuple[str, str]]:
    """Each rule's name (``record`` or ``alert``) and expr (one line or a block)."""
    out = []
    lines = RULES.read_text().splitlines()
    name = ""
    for i, line in enumerate(lines):
        key, _, value = line.strip().removeprefix("- ").partition(": ")
        if key in ("record", "alert"):
            name = value
        if key != "expr":
            continue
        if value.strip() != "|":
            out.append((name, value))
            continue
        indent = len(lines[i + 1]) - len(lines[i + 1].lstrip())
        block = []
        for follow in lines[i + 1 :]:
            if follow.strip() and len(follow) - len(follow.lstrip()) < indent:
                break
            block.append(follow.strip())
        out.append((name, " ".join(block)))
    return out


def recording_rules() -> dict[str, set[str]]:
    """Each recorded series -> the labels it keeps (its first ``by``)."""
    out = {}
    for name, expr in rules():
        if ":" in name:
            by = re.search(r"\bby \(([^)]*)\)", expr)
            assert by is not None, name
            out[name] = {label.strip() for label in by.group(1).split(",")}
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
    for _, expr in found:
        assert_names_exist(expr, exported)
    for alert in re.findall(r"- alert: (\w+)\n\s+expr: .*\n(?:.*\n)*?\s+labels:\n\s+severity: "
                            r"(\w+)", RULES.read_text()):  # fmt: skip
        assert alert[1] in ("critical", "warning"), alert


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
    assert "SUCCESS: 20 rules found" in rules.stdout
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
