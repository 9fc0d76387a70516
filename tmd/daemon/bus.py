"""The in-process event bus between ingest, detectors, policies and the actuator.

``publish`` is synchronous and O(subscribers of that type): the ingest loop calls it
for every decoded message, so it must never wait. Each subscriber owns a bounded
queue that drops its oldest event with a counter when the subscriber falls behind,
and drains in batches, so asyncio costs one wake-up per batch, not per message.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class Subscription:
    def __init__(
        self,
        name: str,
        kinds: tuple[type, ...],
        maxlen: int,
        on_drop: Callable[[str], None],
    ) -> None:
        self.name = name
        self.kinds = kinds
        self.dropped = 0
        self._queue: deque[object] = deque()
        self._maxlen = maxlen
        self._wakeup = asyncio.Event()
        self._on_drop = on_drop

    def put(self, event: object) -> None:
        if len(self._queue) >= self._maxlen:
            self._queue.popleft()
            self.dropped += 1
            self._on_drop(self.name)
        self._queue.append(event)
        self._wakeup.set()

    async def batch(self, max_wait_s: float | None = None) -> list[object]:
        """Everything queued, waiting up to ``max_wait_s`` seconds for at least one event."""
        if not self._queue:
            self._wakeup.clear()
            if max_wait_s is None:
                await self._wakeup.wait()
            else:
                try:
                    async with asyncio.timeout(max_wait_s):  # no task, unlike wait_for
                        await self._wakeup.wait()
                except TimeoutError:
                    return []
        out = list(self._queue)
        self._queue.clear()
        return out

    def __len__(self) -> int:
        return len(self._queue)


class Bus:
    def __init__(self, *, on_drop: Callable[[str], None] = lambda name: None) -> None:
        self._subs: list[Subscription] = []
        self._routes: dict[type, list[Subscription]] = {}
        self._on_drop = on_drop

    def subscribe(
        self, name: str, kinds: tuple[type, ...], *, maxlen: int = 100_000
    ) -> Subscription:
        sub = Subscription(name, kinds, maxlen, self._on_drop)
        self._subs.append(sub)
        self._routes.clear()
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)
            self._routes.clear()

    def publish(self, event: object) -> None:
        for sub in self._route(type(event)):
            sub.put(event)

    def wants(self, kind: type) -> bool:
        """Whether a subscriber takes events of ``kind``: what costs to make need not
        be made for no one."""
        return bool(self._route(kind))

    def _route(self, kind: type) -> list[Subscription]:
        route = self._routes.get(kind)
        if route is None:
            route = self._routes[kind] = [s for s in self._subs if issubclass(kind, s.kinds)]
        return route
