"""Who is still there: the joiner while a prepared migration sits idle, and every
member after a collective failed.

While the leaver streams state, a dead joiner shows up as a failed send. Between
``prepared`` and the switch request nothing flows, and gloo offers no cheap way to
watch an idle pair (a receive that outlives the group timeout closes the pair). So
the joiner counts up a beat counter in the job's store from a thread, and the leaver
reads it from another thread, noting on its own monotonic clock when the count last
changed; the step boundary only reads a flag. No wall clock crosses machines, so two
machines whose clocks disagree still see each other right. The counter only ever
grows (a standby that joins a later migration counts on from where it stopped), and
only a change seen after the watch started counts as a beat: what an earlier
beating period left in the store is no sign of life.

After a collective failed, the survivors must tell a dead member from a slow one (one
still computing its step registers as alive only once it reaches the collective).
Every worker keeps a thread blocked in the store on its generation's wake key
(``Presence``), which costs the store nothing while nothing fails; the first survivor
sets that key, and every live process's thread answers at once, whatever its
training thread is doing. A process that does not answer is dead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

from torch._C._distributed_c10d import Store

from tmd.runtime.control import put
from tmd.runtime.group import StoreAddress, connect_store


def heartbeat_key(node: str) -> str:
    return f"tmd/alive/{node}"


def fail_prefix(generation: int) -> str:
    """Where the survivors of a failed collective of ``generation`` agree."""
    return f"tmd/fail/g{generation}"


def wake_key(generation: int) -> str:
    """Set once a member of ``generation`` reported a failure, or moved on from it."""
    return f"{fail_prefix(generation)}/wake"


def present_key(generation: int) -> str:
    """The ranks of ``generation`` whose process answered the wake: alive."""
    return f"{fail_prefix(generation)}/present"


def wake(store: Store, generation: int) -> None:
    """Wake every ``Presence`` of ``generation``."""
    put(store, wake_key(generation), b"1")


def present(store: Store, generation: int) -> set[int]:
    if not store.check([present_key(generation)]):
        return set()
    listed = bytes(store.get(present_key(generation))).decode().split(",")
    return {int(r) for r in listed if r}


class Presence:
    """A worker's thread that answers, for its current generation and rank (``where``),
    that this process is alive once a failure of that generation is reported (a member
    set the wake key and ``failed(generation)`` holds), then calls ``on_failure``
    with the generation (a wrapped job's guard stops waiting on its collectives). A
    wake without a failure means the generation moved on; it then follows the new
    one."""

    def __init__(
        self,
        store: StoreAddress,
        where: Callable[[], tuple[int, int]],
        failed: Callable[[Store, int], bool],
        on_failure: Callable[[int], None] | None = None,
    ) -> None:
        self._store = connect_store(store, timeout=timedelta(days=1))
        self._where = where
        self._failed = failed
        self._on_failure = on_failure
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tmd-presence", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            generation, rank = self._where()
            try:
                self._store.wait([wake_key(generation)])
                # Woken: a failure, or the generation moved on (a switch, or a member
                # that ended); a failure may still follow while it has not.
                while not self._stop.is_set() and self._where()[0] == generation:
                    if self._failed(self._store, generation):
                        self._store.append(present_key(generation), f"{rank},")  # type: ignore[attr-defined]
                        if self._on_failure is not None:
                            self._on_failure(generation)
                        break
                    self._stop.wait(0.5)
            except RuntimeError:
                return  # the store is gone: so is the job
            while not self._stop.is_set() and self._where()[0] == generation:
                self._stop.wait(0.02)  # until this process moves to the next generation

    def close(self) -> None:
        self._stop.set()

    def join(self, timeout: timedelta) -> None:
        """Wait for the thread to end (``close`` it and wake it first). A process must
        not exit with it inside the store's wait: a thread that comes back from C++
        while the interpreter finalizes aborts the process."""
        self._thread.join(timeout.total_seconds())


class Heartbeat:
    """Counts up this node's beat counter every ``interval`` until closed."""

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
        self._store.add(self._key, 1)

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
    """Reads a node's beat counter every ``interval``; ``lost`` once it has not changed
    for ``stale_after`` on this process's monotonic clock (or not once within that long
    of the watch starting: the count it first reads may be an earlier period's)."""

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
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="tmd-peer-watch", daemon=True)
        self._thread.start()

    def _count(self) -> int:
        # Adding 0 reads the counter in one round trip; an absent key reads as 0.
        return int(self._store.add(self._key, 0))

    def _run(self) -> None:
        seen: int | None = None  # the count as last read; None until a read succeeded
        changed = self._started  # when the count was last seen to change
        while True:
            try:
                count = self._count()
            except (RuntimeError, ValueError):
                pass  # a store hiccup is not evidence of death
            else:
                if seen is not None and count != seen:
                    changed = time.monotonic()
                seen = count
                if time.monotonic() - changed > self._stale:
                    self._lost.set()
                    return
            if self._stop.wait(self._interval):
                return

    def lost(self) -> bool:
        return self._lost.is_set()

    def close(self) -> None:
        self._stop.set()
