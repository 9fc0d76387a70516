"""Is the joiner still there while a prepared migration sits idle?

While the leaver streams state, a dead joiner shows up as a failed send. Between
``prepared`` and the switch request nothing flows, and gloo offers no cheap way to
watch an idle pair (a receive that outlives the group timeout closes the pair). So
the joiner beats a timestamp into the job's store from a thread, and the leaver
reads it from another thread; the step boundary only reads a flag.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from tmd.runtime.control import put
from tmd.runtime.group import StoreAddress, connect_store


def heartbeat_key(node: str) -> str:
    return f"tmd/alive/{node}"


class Heartbeat:
    """Writes ``time.time()`` under this node's key every ``interval`` until closed."""

    def __init__(
        self, store: StoreAddress, node: str, *, interval: timedelta = timedelta(seconds=0.5)
    ) -> None:
        self._store = connect_store(store, timeout=timedelta(seconds=30))
        self._key = heartbeat_key(node)
        self._stop = threading.Event()
        self._interval = interval.total_seconds()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="tmd-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        put(self._store, self._key, repr(time.time()).encode())

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except RuntimeError:
                return  # the store is gone: so is the job

    def close(self) -> None:
        self._stop.set()

    def __enter__(self) -> Heartbeat:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PeerWatch:
    """Reads a node's heartbeat every ``interval``; ``lost`` once it is ``stale_after``
    old (or never appeared within that long)."""

    def __init__(
        self,
        store: StoreAddress,
        node: str,
        *,
        interval: timedelta = timedelta(seconds=0.5),
        stale_after: timedelta = timedelta(seconds=5),
    ) -> None:
        self._store = connect_store(store, timeout=timedelta(seconds=30))
        self._key = heartbeat_key(node)
        self._interval = interval.total_seconds()
        self._stale = stale_after.total_seconds()
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._started = time.time()
        self._thread = threading.Thread(target=self._run, name="tmd-peer-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                if self._store.check([self._key]):
                    last = float(bytes(self._store.get(self._key)))
                else:
                    last = self._started
            except (RuntimeError, ValueError):
                continue  # a store hiccup is not evidence of death
            if time.time() - last > self._stale:
                self._lost.set()
                return

    def lost(self) -> bool:
        return self._lost.is_set()

    def close(self) -> None:
        self._stop.set()
