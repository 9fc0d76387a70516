"""The MQTT connection shared by the daemon's ingest and the node agent: clients built
from ``[mqtt]``, and the loop that reconnects them with a back-off."""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import aiomqtt

from tmd.config import MqttConfig


def _default_client_id() -> str:
    # Unique per connection: a broker drops the older of two clients with one id.
    return f"tmd-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class ClientFactory:
    """aiomqtt clients from ``[mqtt]``. Secrets are read and the TLS context is built
    here, once, so a bad file is a ConfigError at start rather than a crash later."""

    def __init__(self, config: MqttConfig) -> None:
        self.config = config
        self.password = config.read_password()
        self.tls_context = config.tls_context()

    def __call__(
        self,
        *,
        will: aiomqtt.Will | None = None,
        queue_type: type[asyncio.Queue[aiomqtt.Message]] | None = None,
        identifier: str | None = None,
    ) -> aiomqtt.Client:
        c = self.config
        return aiomqtt.Client(
            c.host,
            c.port,
            identifier=identifier or c.client_id or _default_client_id(),
            protocol=(
                aiomqtt.ProtocolVersion.V5 if c.protocol == "5" else aiomqtt.ProtocolVersion.V311
            ),
            username=c.username or None,
            password=self.password or None,
            tls_context=self.tls_context,
            tls_insecure=c.tls_insecure if c.tls else None,
            keepalive=int(c.keepalive_s),
            timeout=c.connect_timeout_s,
            will=will,
            queue_type=queue_type,
        )


class Backoff:
    """The wait between reconnect attempts: ``min_s`` at first, doubled after each
    attempt up to ``max_s``; each wait is jittered to 50-100 % of the delay so that many
    clients losing one broker do not come back in step. ``reset`` after a connection
    that worked starts over from ``min_s``."""

    def __init__(self, *, min_s: float, max_s: float) -> None:
        self.min_s = min_s
        self.max_s = max_s
        self.delay = min_s  # the delay the next wait is drawn from

    def next(self) -> float:
        """Seconds to wait now; the delay after this one doubles."""
        wait = self.delay * (0.5 + random.random() / 2)
        self.delay = min(self.delay * 2, self.max_s)
        return wait

    def reset(self) -> None:
        self.delay = self.min_s


async def reconnect_forever(
    session: Callable[[], Awaitable[None]],
    *,
    config: MqttConfig,
    log: Any,
    connected: Callable[[], bool],
    closed: Callable[[], None],
    failed: Callable[[], None] = lambda: None,
    errors: tuple[type[Exception], ...] = (aiomqtt.MqttError,),
) -> None:
    """Run ``session`` (connect, work, until the connection is lost) forever. A lost
    connection (one of ``errors``) is counted (``failed``) and logged; ``closed`` runs
    after every session; then the loop waits its ``Backoff`` and connects again. The
    back-off starts over after a session that got ``connected``, so a broker restart
    costs ``mqtt.reconnect_min_s``, and a broker that refuses us is not hammered."""
    backoff = Backoff(min_s=config.reconnect_min_s, max_s=config.reconnect_max_s)
    while True:
        try:
            await session()
        except errors as exc:
            if cancelling():
                # The session was cancelled, and aiomqtt's disconnect on the way out
                # timed out: the error replaced the CancelledError, which must not be
                # lost (the loop would reconnect, and its task group wait forever).
                raise asyncio.CancelledError from exc
            failed()
            if connected():
                backoff.reset()
            retry_in_s = round(backoff.delay, 2)
            log.warning("broker connection lost", error=str(exc), retry_in_s=retry_in_s)
        finally:
            closed()
        await asyncio.sleep(backoff.next())


def cancelling() -> bool:
    """Is the current task being cancelled? A library that turns the CancelledError
    into an error of its own (aiomqtt, when a publish or disconnect is interrupted)
    makes ``except Exception`` swallow a cancellation: such a handler re-raises
    ``CancelledError`` where this holds, or its loop runs on and its task group never
    ends."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
