"""Every HTTP API body and query, fuzzed against the real server (aiohttp on a free
port, a real SQLite journal): no request makes it fail (no 5xx), every refusal says
why in JSON, and only accepted requests (202) reach the daemon."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tmd.clock import SystemClock
from tmd.config import ApiConfig
from tmd.daemon import routes
from tmd.daemon.api import Api
from tmd.daemon.journal import Journal
from tmd.daemon.metrics import Metrics
from tmd.daemon.view import ClusterView

TOKEN = "fuzz-token"


class Server:
    def __init__(self, tmp: Path) -> None:
        self.submitted: list[object] = []
        self.loop = asyncio.new_event_loop()
        self.api = Api(
            config=ApiConfig(port=0, token=TOKEN), view=ClusterView(),
            journal=Journal(tmp / "journal.sqlite3"), metrics=Metrics(), clock=SystemClock(),
            health=lambda: {"ok": True},
        )  # fmt: skip
        for route in routes.routes(lambda e, _s: self.submitted.append(e), now=time.time):
            self.api.add_route(route.method, route.path, route.handler)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.api.start(), self.loop).result(10)

    def request(self, method: str, path: str, body: bytes | None, auth: bool) -> tuple[int, Any]:
        headers = {"Content-Type": "application/json"}
        if auth:
            headers["Authorization"] = f"Bearer {TOKEN}"
        req = urllib.request.Request(f"http://127.0.0.1:{self.api.port}{path}", data=body,
                                     method=method, headers=headers)  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as err:
            return err.code, err.read()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.api.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = Server(tmp_path_factory.mktemp("api"))
    yield s
    s.close()


_JSON = st.recursive(
    st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | st.text(max_size=10),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=16,
)
_LABELS = st.dictionaries(st.sampled_from(["node", "Hostname", "instance", "tmd_job", "job",
                                           "alertname", "gpu"]), st.text(max_size=12))  # fmt: skip
# Bodies shaped like each endpoint's, with fields of any type, and anything at all.
_BODIES = st.one_of(
    _JSON.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.fixed_dictionaries({"job": _JSON, "node": _JSON}, optional={"to": _JSON,
                          "requested_by": _JSON}).map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries({"status": st.sampled_from(["firing", "resolved", "x"]),
                           "alerts": st.lists(st.fixed_dictionaries(
                               {"status": st.sampled_from(["firing", "resolved"]),
                                "labels": _LABELS}, optional={"fingerprint": _JSON}),
                               max_size=3)}).map(lambda v: json.dumps(v).encode()),
)  # fmt: skip
_REQUESTS = st.one_of(
    st.tuples(st.just("POST"), st.sampled_from(["/api/v1/alerts", "/api/v1/drain",
                                                "/api/v1/migrate"]), _BODIES),
    st.tuples(st.just("GET"), st.sampled_from(["/api/v1/status", "/api/v1/events"]).flatmap(
        lambda p: st.dictionaries(st.sampled_from(["job", "ranks", "after_id", "limit", "kind",
                                                   "order", "node"]), st.text(max_size=8))
        .map(lambda q: f"{p}?{urllib.parse.urlencode(q)}")), st.none()),
    st.tuples(st.just("DELETE"), st.text(max_size=12).map(
        lambda j: f"/api/v1/jobs/{urllib.parse.quote(j, safe='')}"), st.none()),
)  # fmt: skip


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(request=_REQUESTS, auth=st.booleans())
def test_no_request_breaks_the_api(
    server: Server, request: tuple[str, str, bytes | None], auth: bool
) -> None:
    method, path, body = request
    before = len(server.submitted)
    status, raw = server.request(method, path, body, auth)
    assert status < 500, (method, path, body, raw)
    if status >= 400:
        assert "error" in json.loads(raw), raw  # a refusal says why
    if method == "POST" and status != 202:
        assert len(server.submitted) == before  # only accepted requests reach the daemon
    if method == "POST" and not auth:
        assert status == 401
