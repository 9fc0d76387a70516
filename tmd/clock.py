"""Time, injected. Logic never calls ``time.time()``: it takes a Clock, so the cluster
simulator and the tests can run detectors and policies on simulated time.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since the epoch (comparable with the ``ts`` of wire messages)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back; for intervals and timeouts."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class SystemClock:
    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)
