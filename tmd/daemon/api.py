"""HTTP API on one port: ``/metrics``, ``/healthz``, ``/api/v1/status``,
``/api/v1/events``, and the mutating endpoints behind a bearer token.

Every request whose method can change state (anything but GET, HEAD, OPTIONS) must
carry ``Authorization: Bearer <api.token>``, checked in one middleware before any
route runs; with no token configured, such requests are refused. Read endpoints are
open: bind the API to loopback (the default) or put it behind a proxy.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tmd import log
from tmd.clock import Clock
from tmd.config import ApiConfig
from tmd.daemon.journal import Journal
from tmd.daemon.metrics import Metrics
from tmd.daemon.view import ClusterView, rank_rows
from tmd.errors import ConfigError

_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def read_token(config: ApiConfig) -> str:
    if config.token_file:
        try:
            with open(config.token_file) as f:
                return f.read().strip()
        except OSError as exc:
            raise ConfigError("api.token_file", f"cannot read: {exc.strerror}") from None
    return config.token


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(data), status=status, content_type="application/json"
    )


class Api:
    def __init__(
        self,
        *,
        config: ApiConfig,
        view: ClusterView,
        journal: Journal,
        metrics: Metrics,
        clock: Clock,
        health: Callable[[], dict[str, Any]],
    ) -> None:
        self._config = config
        self._token = read_token(config)
        self._view = view
        self._journal = journal
        self._metrics = metrics
        self._clock = clock
        self._health = health
        # A job's rank rows (JSON) where its ranks live in an ingest shard
        # (``Shards.rank_rows``).
        self.shard_rows: Callable[[str], Awaitable[msgspec.Raw]] | None = None
        self._log = log.get("api")
        self._runner: web.AppRunner | None = None
        self.port: int | None = None
        self.app = web.Application(
            middlewares=[self._errors_as_json, self._auth], client_max_size=1 << 20
        )
        self.app.router.add_get("/metrics", self._get_metrics)
        self.app.router.add_get("/healthz", self._get_healthz)
        self.app.router.add_get("/api/v1/status", self._get_status)
        self.app.router.add_get("/api/v1/events", self._get_events)
        self.app.router.add_delete("/api/v1/jobs/{job}", self._delete_job)

    def add_route(self, method: str, path: str, handler: Handler) -> None:
        """For later components (actuator, alert receiver, drain): same auth, same port."""
        self.app.router.add_route(method, path, handler)

    async def start(self) -> None:
        self._runner = web.AppRunner(self.app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._config.host, self._config.port)
        await site.start()
        addresses = self._runner.addresses
        self.port = int(addresses[0][1]) if addresses else self._config.port
        self._log.info("listening", host=self._config.host, port=self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @web.middleware
    async def _errors_as_json(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """aiohttp's own refusals (no such path, wrong method, body too large) in the
        same JSON shape as ours: every 4xx says why as ``{"error": ...}``."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return web.json_response(
                {"error": exc.reason}, status=exc.status, headers=_kept(exc.headers)
            )

    @web.middleware
    async def _auth(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method not in _SAFE_METHODS:
            if not self._token:
                return _json({"error": "mutating endpoints are disabled: set api.token"}, 401)
            header = request.headers.get("Authorization", "")
            scheme, _, given = header.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode(), self._token.encode()
            ):
                self._log.warning(
                    "unauthorized", method=request.method, path=request.path, peer=request.remote
                )
                return web.json_response(
                    {"error": "missing or wrong bearer token"},
                    status=401,
                    headers={"WWW-Authenticate": 'Bearer realm="tmd"'},
                )
        return await handler(request)

    async def _get_metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self._metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _get_healthz(self, request: web.Request) -> web.Response:
        health = self._health()
        return _json(health, 200 if health.get("ok") else 503)

    async def _get_status(self, request: web.Request) -> web.Response:
        job = request.query.get("job") or None
        ranks = request.query.get("ranks", "1") not in ("0", "false", "no")
        now = self._clock.now()
        snapshot = self._view.snapshot(now, job=job)
        if ranks and self.shard_rows is not None:  # every job's shard asked at once
            asking = self.shard_rows
            answers = await asyncio.gather(
                *(asking(j["job"]) for j in snapshot["jobs"]), return_exceptions=True
            )
            for j, answer in zip(snapshot["jobs"], answers, strict=True):
                if isinstance(answer, BaseException):
                    j["ranks"] = []
                    j["ranks_error"] = f"its ingest shard did not answer: {answer!r}"[:300]
                else:
                    j["ranks"] = answer  # as the shard wrote it
        elif ranks:
            for j in snapshot["jobs"]:
                view_job = self._view.jobs.get(j["job"])
                j["ranks"] = []
                if view_job is None:
                    continue
                for rows in rank_rows(view_job, now):
                    j["ranks"].extend(rows)
                    await asyncio.sleep(0)  # let ingest run between chunks
        snapshot["health"] = self._health()
        snapshot["migrations"] = [
            row.__dict__
            for row in self._journal.latest_migrations(10)
            if job is None or row.job == job
        ]
        return _json(snapshot)

    async def _get_events(self, request: web.Request) -> web.Response:
        try:
            after = int(request.query.get("after_id", "0"))
            limit = int(request.query.get("limit", "100"))
        except ValueError:
            return _json({"error": "after_id and limit must be integers"}, 400)
        rows = self._journal.events(
            after_id=after,
            limit=limit,
            job=request.query.get("job") or None,
            kind=request.query.get("kind") or None,
            newest_first=request.query.get("order") == "desc",
        )
        return _json({"events": [row.__dict__ for row in rows]})

    async def _delete_job(self, request: web.Request) -> web.Response:
        """Forget a finished job: drop it from the view (its journal history stays)."""
        name = request.match_info["job"]
        if not self._view.forget_job(name):
            return _json({"error": f"no job {name!r}"}, 404)
        self._log.info("job forgotten", job=name)
        return _json({"forgotten": name})


def _kept(headers: Any) -> dict[str, str]:
    """The headers of a refusal worth keeping (``Allow`` on a 405)."""
    return {k: v for k, v in headers.items() if k in ("Allow", "WWW-Authenticate")}
