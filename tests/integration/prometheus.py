"""A real Prometheus for the end-to-end tests: it scrapes a running ``tmd run`` with the
shipped scrape job and rules (``deploy/prometheus``), and runs the shipped dashboard's
queries (``deploy/grafana/tmd.json``) through its HTTP API, as Grafana would."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tmd.tools.mosquitto import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
RULES = ROOT / "deploy" / "prometheus" / "tmd-rules.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "tmd.json"
INSTALL = "apt-get install -y prometheus"
SCRAPE_JOB = "tmd"  # the shipped scrape config's job_name


def find_prometheus() -> str | None:
    return shutil.which("prometheus")


class Prometheus:
    """``prometheus`` on 127.0.0.1 with the shipped scrape config, its intervals cut to a
    second and its one target the daemon at ``target`` (host:port of its API)."""

    def __init__(self, binary: str, tmp: Path, target: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = tmp / "prometheus.yml"
        config.write_text(_config(target))
        self.log = tmp / "prometheus.log"
        self.started = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            _poll(lambda: self._get("/-/ready", raw=True), "Prometheus to be ready", 30)
        except BaseException as exc:
            self.stop()
            exc.add_note(self.log_tail())
            raise

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it is still up 10 s later."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log_tail(self, lines: int = 60) -> str:
        """The end of its log, for a failure's report."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError as exc:
            return f"prometheus's log {self.log}: {exc}"
        return f"prometheus's log ({self.log}), last {lines} lines:\n" + "".join(
            text.splitlines(True)[-lines:]
        )

    def _get(self, path: str, params: dict[str, str] | None = None, *, raw: bool = False) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(f"{self.url}{path}{query}", timeout=10) as r:
                body = r.read()
        except OSError:
            if raw:
                return None
            raise
        return body if raw else json.loads(body)

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one sample) ``expr`` gives now; raises
        AssertionError naming ``expr`` where Prometheus refuses it."""
        try:
            answer = self._get("/api/v1/query", {"query": expr})
        except urllib.error.HTTPError as exc:  # 400: bad_data, with Prometheus's reason
            raise AssertionError(f"{expr}: {exc.read().decode(errors='replace')}") from None
        assert answer["status"] == "success", (expr, answer)
        data = answer["data"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        assert data["resultType"] == "vector", (expr, data["resultType"])
        return list(data["result"])

    def label_values(self, label: str, match: str) -> list[str]:
        """What Grafana's ``label_values(match, label)`` lists."""
        answer = self._get(f"/api/v1/label/{label}/values", {"match[]": match})
        return list(answer["data"])

    def window(self) -> str:
        """A PromQL range that reaches back past this server's start: all it scraped."""
        return f"{int(time.monotonic() - self.started) + 60}s"

    def wait_for_scrapes(self, n: int = 2, timeout_s: float = 30) -> None:
        expr = f'count_over_time(up{{job="{SCRAPE_JOB}"}}[5m]) >= {n}'
        _poll(lambda: self.query(expr), f"{n} scrapes of tmd", timeout_s)

    def rule_groups(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/rules")["data"]["groups"])

    def alerts(self) -> list[dict[str, Any]]:
        return list(self._get("/api/v1/alerts")["data"]["alerts"])


def _config(target: str) -> str:
    """The shipped scrape config, for this test: scraped and evaluated every second, the
    rules by absolute path, and ``target`` in place of the example head node."""
    text = SCRAPE_CONFIG.read_text()
    for old, new in [
        ("scrape_interval: 15s", "scrape_interval: 1s"),
        ("evaluation_interval: 15s", "evaluation_interval: 1s"),
        ("  - tmd-rules.yml", f"  - {RULES}"),
        ('- targets: ["127.0.0.1:9464"]', f'- targets: ["{target}"]'),
    ]:
        assert text.count(old) == 1, f"{SCRAPE_CONFIG} no longer has {old!r} once"
        text = text.replace(old, new)
    return text


def _poll(check: Any, what: str, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return result


# -- the dashboard, as Grafana would run it -------------------------------------------


@dataclass(frozen=True)
class Query:
    panel: str
    ref: str
    expr: str


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def panel_queries(variables: dict[str, str]) -> list[Query]:
    """Every panel's query, with Grafana's variables replaced by ``variables`` (each
    ``$name``; regex values, as Grafana gives a multi-value variable)."""
    return [
        Query(panel["title"], target["refId"], substitute(target["expr"], variables))
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


def substitute(expr: str, variables: dict[str, str]) -> str:
    def value(m: re.Match[str]) -> str:
        name = m.group(1)
        assert name in variables, f"no value for ${name} in {expr}"
        return variables[name]

    # Longest names first is what the regex's greed gives: $__rate_interval, not $__r.
    return re.sub(r"\$(\w+)", value, expr)


def as_regex(value: str) -> str:
    """``value`` as Grafana puts a selected value into a query's ``=~"..."``: regex-escaped,
    each backslash doubled for PromQL's string literal."""
    return re.escape(value).replace("\\", "\\\\")


def variable_queries() -> dict[str, tuple[str, str]]:
    """Each query variable's ``label_values(match, label)``, as (label, match)."""
    out = {}
    for var in dashboard()["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.*), (\w+)\)", var["definition"])
        assert m is not None, var["definition"]
        out[var["name"]] = (m.group(2), m.group(1))
    return out


# -- the check ------------------------------------------------------------------------


def has_data(result: list[dict[str, Any]]) -> bool:
    """Whether Grafana would draw something: a sample that is a number (a quantile of
    no observations is NaN)."""
    return any(r["value"][1] not in ("NaN", "+Inf", "-Inf") for r in result)


def check_operators_view(
    prom: Prometheus, *, target: str, tmd_job: str, empty: dict[str, str]
) -> None:
    """What an operator sees of the daemon at ``target``, which ran the training job
    ``tmd_job``: every rule evaluates, no alert fires (none is even pending about the
    job, which stopped), every dashboard variable lists this daemon and job, every
    panel's query parses and has data, but for the panels in ``empty`` (title -> why),
    which must have none. A failure comes with the end of Prometheus's log."""
    try:
        _check_operators_view(prom, target=target, tmd_job=tmd_job, empty=empty)
    except AssertionError as exc:
        exc.add_note(prom.log_tail())
        raise


def _check_operators_view(
    prom: Prometheus, *, target: str, tmd_job: str, empty: dict[str, str]
) -> None:
    prom.wait_for_scrapes(2)
    # The rules: all evaluated without error (a rule over a label that does not exist
    # evaluates fine; promtool's tests check what they compute).
    rules = [r for g in prom.rule_groups() for r in g["rules"]]
    assert rules and all(r["health"] == "ok" for r in rules), [
        (r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"
    ]
    assert not [a["labels"] for a in prom.alerts() if a["state"] == "firing"]
    # While the job ran without a ready standby (its one standby warming, then in the
    # job), TmdJobWithoutReadyStandby was pending; once the job stopped, no alert is.
    was_pending = (
        f'ALERTS{{alertname="TmdJobWithoutReadyStandby", alertstate="pending",'
        f' tmd_job="{tmd_job}"}}'
    )
    assert prom.query(f"max_over_time({was_pending}[{prom.window()}])"), was_pending
    _poll(
        lambda: not [a for a in prom.alerts() if a["labels"].get("tmd_job") == tmd_job],
        f"no alert about {tmd_job}, which stopped",
        15,
    )

    # Labels: the scrape job and instance are Prometheus's, the training job is tmd_job
    # (nothing renamed exported_*: no metric of tmd's carries job or instance).
    series = prom.query('{__name__=~"tmd_.+"}')
    assert series
    for s in series:
        labels = s["metric"]
        assert (labels["job"], labels["instance"]) == (SCRAPE_JOB, target), labels
        assert not [k for k in labels if k.startswith("exported_")], labels
    variables = {"job": SCRAPE_JOB, "instance": as_regex(target), "tmd_job": as_regex(tmd_job)}
    for name, (label, match) in variable_queries().items():
        listed = prom.label_values(label, substitute(match, variables))
        want = {"job": SCRAPE_JOB, "instance": target, "tmd_job": tmd_job}[name]
        assert want in listed, (name, listed)

    # The migration, as the panels count it: by outcome and by the policy that decided it,
    # the other outcomes exported from 0 (so the first failure is an increase).
    done = prom.query('tmd_migrations_total{policy="rebalance"}')
    by_outcome = {s["metric"]["outcome"]: float(s["value"][1]) for s in done}
    assert by_outcome == {"done": 1.0, "aborted": 0.0, "failed": 0.0}, by_outcome

    # Grafana's $__rate_interval and $__range follow the dashboard's time range; here
    # both reach back past Prometheus's start, so that every query covers the whole run.
    # With a fixed 1m, a check that ran over a minute after the job's last message
    # (a slow machine) would find every rate 0, and the latency quantiles NaN: no data.
    window = prom.window()
    variables.update({"__rate_interval": window, "__range": window})
    queries = panel_queries(variables)
    titles = {q.panel for q in queries}
    assert set(empty) <= titles, set(empty) - titles
    for q in queries:
        result = prom.query(q.expr)  # raises, naming it, if Prometheus refuses it
        if q.panel in empty:
            assert not has_data(result), (q, result, empty[q.panel])
        else:
            assert has_data(result), (q, result)
