"""Benchmarks: `tmd bench NAME` commands that print one JSON object."""

from __future__ import annotations

import sys
import time


class Progress:
    """What a long benchmark is doing, on stderr when that is a terminal; silent when
    piped or redirected, so the JSON on stdout stays the only output."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.shown = sys.stderr.isatty()

    def say(self, text: str) -> None:
        if self.shown:
            print(f"[{time.monotonic() - self.t0:6.1f}s] {text}", file=sys.stderr, flush=True)
