"""What operators and Alertmanager ask of tmd over HTTP, decoded once at the edge into
``tmd.daemon.events.Request``s: an Alertmanager webhook (payload version 4), a drain of a
node, a migration of one job's node. Each handler answers 202 once the request is
journaled and handed to the policies, 4xx naming what is wrong otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal, TypeVar

import msgspec
from aiohttp import web

from tmd.daemon import events
from tmd.wire import Name

MAX_ALERTS = 1000
Short = Annotated[str, msgspec.Meta(max_length=1024)]


class _Alert(msgspec.Struct, rename="camel"):  # Alertmanager's names: startsAt
    status: Literal["firing", "resolved"]
    labels: Annotated[dict[Short, Short], msgspec.Meta(max_length=256)]
    starts_at: Short
    fingerprint: Short = ""


class _Webhook(msgspec.Struct):
    version: Literal["4"]
    alerts: Annotated[list[_Alert], msgspec.Meta(max_length=MAX_ALERTS)]
    receiver: Short = ""


class _Drain(msgspec.Struct, forbid_unknown_fields=True):
    node: Name
    requested_by: Short = ""


class _Migrate(msgspec.Struct, forbid_unknown_fields=True):
    job: Name
    node: Name
    to: Name | None = None
    requested_by: Short = ""


Submit = Callable[[events.Event, str], None]
T = TypeVar("T")


def _decode(data: bytes, kind: type[T]) -> T:
    try:
        return msgspec.json.decode(data, type=kind)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise web.HTTPBadRequest(
            text=msgspec.json.encode({"error": str(exc)}).decode(), content_type="application/json"
        ) from None


def _accepted(count: int) -> web.Response:
    return web.json_response({"accepted": count}, status=202)


def routes(submit: Submit, *, now: Callable[[], float]) -> list[web.RouteDef]:
    """The request endpoints; ``submit`` journals an event and puts it on the bus."""

    async def alerts(request: web.Request) -> web.Response:
        hook = _decode(await request.read(), _Webhook)
        for a in hook.alerts:
            submit(
                events.AlertFired(
                    ts=now(),
                    name=a.labels.get("alertname", ""),
                    status=a.status,
                    fingerprint=a.fingerprint or _fingerprint(a.labels),
                    starts_at=a.starts_at,
                    labels=dict(a.labels),
                    requested_by=f"alertmanager:{hook.receiver}",
                ),
                "alertmanager",
            )
        return _accepted(len(hook.alerts))

    async def drain(request: web.Request) -> web.Response:
        body = _decode(await request.read(), _Drain)
        submit(
            events.DrainRequested(ts=now(), node=body.node, requested_by=body.requested_by),
            "operator",
        )
        return _accepted(1)

    async def migrate(request: web.Request) -> web.Response:
        body = _decode(await request.read(), _Migrate)
        submit(
            events.MigrateRequested(
                ts=now(), job=body.job, node=body.node, to=body.to, requested_by=body.requested_by
            ),
            "operator",
        )
        return _accepted(1)

    return [
        web.post("/api/v1/alerts", alerts),
        web.post("/api/v1/drain", drain),
        web.post("/api/v1/migrate", migrate),
    ]


def _fingerprint(labels: dict[str, str]) -> str:
    """Alertmanager always sends one; for hand-made payloads, a stable stand-in."""
    return msgspec.json.encode(sorted(labels.items())).hex()[:32]
