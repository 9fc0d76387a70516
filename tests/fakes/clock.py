"""A clock the test moves by hand."""

from __future__ import annotations

import asyncio


class FakeClock:
    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._mono = 1000.0

    def now(self) -> float:
        return self._now

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        self._now += seconds
        self._mono += seconds

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)
