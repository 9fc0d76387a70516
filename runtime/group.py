"""Communication groups that can be built while training continues on another one.

``torch.distributed`` will not add a rank to the default world, so tmd never uses it:
every generation of the job's group, and every leaver-to-joiner transfer channel, is
a backend object built directly on its own ``PrefixStore`` of the job's store. A
group for generation ``g`` can then be built in a background thread (the backend's
rendezvous releases the GIL) by stayers and joiner alike, while the stayers keep
running collectives on generation ``g - 1``.

The same calls build ``ProcessGroupGloo`` (CPU) and ``ProcessGroupNCCL`` (GPU);
nothing above this module knows which backend it talks to.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from tmd.errors import MigrationError

Group = Any
"""A ``torch.distributed.Backend`` (``ProcessGroupGloo`` or ``ProcessGroupNCCL``)."""


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> StoreAddress:
        host, _, port = text.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"store address must be host:port, got {text!r}")
        return cls(host, int(port))

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def connect_store(address: StoreAddress, *, timeout: timedelta) -> Store:
    """A client of the job's TCPStore. Each thread that blocks on the store gets its
    own client, so a slow ``get`` in the control poller never delays a group build."""
    return TCPStore(
        address.host,
        address.port,
        is_master=False,
        timeout=timeout,
        wait_for_workers=False,
    )


def make_group(
    store: Store,
    prefix: str,
    *,
    rank: int,
    size: int,
    timeout: timedelta,
    backend: str = "gloo",
    host: str = "",
) -> Group:
    """Build one group over ``PrefixStore(prefix, store)``; blocks until all ``size``
    members have called it with the same prefix, or ``timeout``.

    ``timeout`` also bounds every collective of the group: a dead peer that leaves
    its socket open is noticed after this long at the latest.
    """
    scoped = PrefixStore(prefix, store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = timeout
        # One device on the interface that reaches the peers; the loopback address is
        # what a single-machine job resolves to, clusters set TMD_HOST.
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        return dist.ProcessGroupGloo(scoped, rank, size, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(scoped, rank, size, options)
        # NCCL connects lazily; a barrier makes the rendezvous happen here, in the
        # builder thread, and not inside the first training step after the switch.
        group.barrier().wait()  # type: ignore[attr-defined]
        return group
    raise MigrationError(f"unsupported backend {backend!r}")


class GroupBuilder:
    """Builds one group in a daemon thread; the caller polls ``done`` at step
    boundaries and never joins the thread, so a peer that never arrives costs the
    training loop nothing (the build fails after its timeout).

    An abandoned builder's group is dropped when it completes.
    """

    def __init__(
        self,
        store_address: StoreAddress,
        prefix: str,
        *,
        rank: int,
        size: int,
        timeout: timedelta,
        backend: str = "gloo",
        host: str = "",
    ) -> None:
        self.prefix = prefix
        self._group: Group | None = None
        self._error: BaseException | None = None
        self._abandoned = False
        self._done = threading.Event()

        def build() -> None:
            try:
                store = connect_store(store_address, timeout=timeout)
                group = make_group(
                    store, prefix, rank=rank, size=size, timeout=timeout, backend=backend, host=host
                )
                if not self._abandoned:
                    self._group = group
            except BaseException as exc:  # reported at the next boundary, never raised here
                self._error = exc
            finally:
                self._done.set()

        self._thread = threading.Thread(target=build, name=f"tmd-group-{prefix}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return self._done.is_set()

    def failed(self) -> bool:
        return self._done.is_set() and self._error is not None

    def wait(self, timeout: timedelta | None = None) -> bool:
        return self._done.wait(None if timeout is None else timeout.total_seconds())

    def result(self) -> Group:
        """The built group; raises MigrationError if the build failed or is not done."""
        if not self._done.is_set():
            raise MigrationError(f"group {self.prefix} is not built yet")
        if self._error is not None:
            raise MigrationError(f"building group {self.prefix} failed: {self._error}")
        if self._group is None:
            raise MigrationError(f"group {self.prefix} was abandoned")
        return self._group

    @property
    def error(self) -> BaseException | None:
        return self._error

    def abandon(self) -> None:
        self._abandoned = True
        self._group = None
