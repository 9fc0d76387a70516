"""Per-step timings of one rank, batched and sent from a background thread.

``record`` is all the training thread does: append a ``StepTiming`` to a bounded
deque (the oldest entry is dropped, and counted, when the sender falls behind). A
daemon thread wakes every ``flush_interval``, wraps what accumulated in one
``IterBatch`` and hands it to the sink (an MQTT publish). A sink error is counted
and the batch dropped; training never waits for it.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from tmd import wire

Sink = Callable[[str, bytes], None]
"""``sink(topic, payload)``: publish one message, without blocking for long."""


class Telemetry:
    def __init__(
        self,
        sink: Sink | None,
        *,
        job: str,
        node: str,
        rank: int,
        run: int = 0,
        flush_interval: timedelta = timedelta(seconds=1),
        max_queue: int = 4096,
    ) -> None:
        self.job = job
        self.node = node
        self.rank = rank
        self.generation = 0
        self.run = run  # the launcher's restart count: a new run's steps go back
        self.dropped = 0  # steps dropped because the queue was full
        self.sent_batches = 0
        self.errors = 0
        self._sink = sink
        self._queue: collections.deque[wire.StepTiming] = collections.deque()
        self._max_queue = max_queue
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._interval = flush_interval.total_seconds()
        self._thread: threading.Thread | None = None
        if sink is not None:
            self._thread = threading.Thread(target=self._run, name="tmd-telemetry", daemon=True)
            self._thread.start()

    def record(self, timing: wire.StepTiming) -> None:
        if self._sink is None:
            return
        with self._lock:
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(timing)

    def set_rank(self, rank: int, generation: int) -> None:
        """After a switch: the joiner reports under the rank it took over."""
        self.flush()
        self.rank = rank
        self.generation = generation

    def flush(self) -> None:
        if self._sink is None:
            return
        with self._lock:
            steps = list(self._queue)
            self._queue.clear()
        for start in range(0, len(steps), wire.MAX_STEPS_PER_BATCH):
            batch = wire.IterBatch(
                ts=time.time(),
                job=self.job,
                rank=self.rank,
                node=self.node,
                generation=self.generation,
                steps=steps[start : start + wire.MAX_STEPS_PER_BATCH],
                run=self.run,
            )
            try:
                self._sink(wire.iter_topic(self.job, self.rank), wire.encode(batch))
                self.sent_batches += 1
            except Exception:  # a broken sink costs the batch, never the step
                self.errors += 1

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.flush()
            poll = getattr(self._sink, "poll", None)  # ``AgentRelay``: its confirmations
            if poll is not None:
                poll()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.flush()
        close = getattr(self._sink, "close", None)  # ``AgentRelay``: the last confirmations
        if close is not None:
            close()
