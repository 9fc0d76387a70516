"""Process groups that keep their identity while the machines behind them change: the
mechanism by which a model wrapped by torch's own parallelism (``fully_shard``, HSDP
on a 2-D mesh, tensor parallelism, DDP) keeps training after a migration
(issue 15; the session drives it through ``tmd.runtime.parallel``). What is tested
is at the end of this docstring.

Those wrappers hold their ``ProcessGroup`` objects, and the ``DeviceMesh`` behind
them, from the moment they wrap the model: FSDP2 caches the groups in every
parameter group's mesh info, DTensors find theirs by name on each collective, DDP's
reducer holds a pointer. Rebuilding the mesh after a migration would mean patching
all of them. So tmd does what torchft's ``ProcessGroupWrapper`` does, one level
further down: every group the job's mesh is made of is a ``SwappableGroup``, a
``ProcessGroup`` of fixed rank, size and name that forwards each collective to an
*inner* group, and a migration replaces the inner groups — built, as every group of
tmd is, by ``tmd.runtime.group`` on a store prefix of the new generation — at a
step boundary, when no collective is in flight. The joiner takes the leaver's rank,
so the mesh, every shard's place in it and every DTensor stay as they were.

``install`` makes the job's default world a ``SwappableGroup`` (the groups
``init_device_mesh`` creates for a mesh's dimensions come through the same backend),
``bind`` gives every group its inner group for a generation, keyed by the group's
name, which torch gives alike in every member. A joiner's groups have no inner group
until the switch; ``fully_shard`` and creating the optimizer issue no collective, so
it can build them before (DDP too, with ``init_sync=False``).

Tested with torch 2.13.0, gloo, CPU, eager, through the session
(``tests/integration/test_parallel.py``, ``tmd bench downtime --parallel``): a
machine of an FSDP2 job on a 1-D mesh, of an HSDP job on a 2-D mesh, of a job
tensor-parallel (``parallelize_module``) within a machine with ``fully_shard`` on
the (dp, tp) mesh, and of a DDP job, moved live at a step boundary; a machine of a
DDP and of an HSDP job killed between its forward and backward, its ranks replaced
from their replicas while the survivors' collectives fail under ``Guard``; in one
process, ``Guard`` releasing a collective left hanging once a failure elsewhere is
reported. Not yet: NCCL (the shell registers one backend for one device, so
CPU-side object collectives and barriers would miss; the guard's futures carry no
CUDA stream order). Every group must exist before the session binds them: a group
created later (``DeviceMesh._flatten``, ``set_separate_reduce_scatter_group`` after
the session opened) is refused. C++ callers reach the Python forwarders only
through torch's trampolined methods (``allgather``, ``allreduce``, ``broadcast``,
``reduce_scatter``, their coalesced forms, ``send``, ``recv``, ``barrier``): a
compiled FSDP2 calling ``all_gather_single`` from C++ would miss. ``install``
refuses a torch that lacks one of ``FORWARDED``.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (  # type: ignore[attr-defined]  # not in its stubs
    HashStore,
    Store,
    _create_work_from_future,
)

from tmd.errors import MigrationError
from tmd.runtime.group import Group, GroupBuilder, StoreAddress, make_group

BACKEND = "tmd"
# Every collective FSDP2, DTensor, DDP and torch.distributed.checkpoint were seen to
# call on a group (torch 2.13), and their relatives.
FORWARDED = (
    "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced",
    "all_gather_single", "all_gather_single_coalesced", "_allgather_base",
    "allreduce", "allreduce_coalesced", "alltoall", "alltoall_base", "all_to_all_single",
    "barrier",
    "broadcast", "gather", "scatter", "reduce", "reduce_scatter",
    "reduce_scatter_single", "_reduce_scatter_base", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "send", "recv", "recv_anysource",
)  # fmt: skip


class SwappableGroup(dist.ProcessGroup):
    """A group of fixed rank and size whose collectives run on ``inner``, which
    ``swap`` replaces; ``key`` names it the same in every member (its members' global
    ranks, sorted)."""

    def __init__(self, rank: int, size: int) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # the store-less overload
        self.inner: Any = None
        self._name = ""
        self._desc = ""
        self.key: tuple[int, ...] = ()

    def swap(self, inner: Any) -> Any:
        """Run every later collective on ``inner``; the old inner group, to shut down."""
        if inner.rank() != self.rank() or inner.size() != self.size():
            raise MigrationError(f"group {self._name}: inner group of rank {inner.rank()} in "
                                 f"{inner.size()}, not {self.rank()} in {self.size()}")  # fmt: skip
        old, self.inner = self.inner, inner
        return old

    def shutdown(self) -> None:
        if self.inner is not None:
            self.inner.shutdown()

    def abort(self) -> None:
        if self.inner is not None:
            self.inner.abort()

    def _get_backend(self, device: Any) -> Any:
        self._check_bound("_get_backend")
        return self.inner._get_backend(device)

    def _forward(self, name: str, *args: Any, **kwargs: Any) -> Any:
        self._check_bound(name)
        if _guard is not None and _guard.armed and not isinstance(self.inner, Loopback):
            return _guard.run(self, name, args, kwargs)
        return getattr(self.inner, name)(*args, **kwargs)

    def _check_bound(self, name: str) -> None:
        if self.inner is None:
            raise MigrationError(
                f"collective {name} on group {self.group_name} before the session bound "
                "it: the mesh and the model's wrappers must be built without "
                "communication, as a standby builds them before it joins (tensor "
                "parallelism: parallelize_module(..., src_data_rank=None); DDP: "
                "init_sync=False; every rank holding the same initial weights)"
            )

    # The name and description live in Python: the C++ base keeps none for a subclass.
    def getBackendName(self) -> str:
        return BACKEND

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    @property
    def group_desc(self) -> str:
        return self._desc


def _forwarder(name: str) -> Callable[..., Any]:
    def forward(self: SwappableGroup, *args: Any, **kwargs: Any) -> Any:
        return self._forward(name, *args, **kwargs)

    forward.__name__ = name
    return forward


for _name in FORWARDED:
    setattr(SwappableGroup, _name, _forwarder(_name))

_groups: list[SwappableGroup] = []  # every group of this process, in creation order


_bound = False  # the session gave the groups inner groups: no group may come after


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> SwappableGroup:
    if _bound:
        raise MigrationError(
            "a process group created after the session opened: tmd swaps only the groups "
            "that exist when it binds them; create the mesh and everything that makes "
            "groups (DeviceMesh._flatten, set_separate_reduce_scatter_group) before the "
            "session"
        )
    group = SwappableGroup(rank, size)
    _groups.append(group)
    return group


def shell(backend: Any, *, rank: int, size: int, store: Any) -> Any:
    """A ``ProcessGroup`` around one of ``tmd.runtime.group``'s backends (gloo, NCCL),
    what a ``SwappableGroup`` forwards to."""
    pg = dist.ProcessGroup(store, rank, size)
    kind = (dist.ProcessGroup.BackendType.NCCL if "nccl" in type(backend).__name__.lower()
            else dist.ProcessGroup.BackendType.GLOO)  # fmt: skip
    device = torch.device("cuda" if kind == dist.ProcessGroup.BackendType.NCCL else "cpu")
    pg._set_default_backend(kind)
    pg._register_backend(device, kind, backend)
    return pg


def install(*, rank: int, size: int) -> SwappableGroup:
    """Make the default world a ``SwappableGroup`` of ``rank`` in ``size``, with no
    rendezvous (the inner groups have their own); raises where it cannot."""
    missing = [n for n in FORWARDED if not hasattr(dist.ProcessGroup, n)]
    if missing:
        raise MigrationError(f"torch {torch.__version__} lacks {missing}: tmd's group swap "
                             "is tested with torch 2.13")  # fmt: skip
    if dist.is_initialized():
        raise MigrationError("a default process group exists: tmd.runtime.parallel.init() "
                             "must create it, once, before init_device_mesh and the model's "
                             "wrappers")  # fmt: skip
    if os.environ.get("TORCH_DIST_INIT_BARRIER", "0").strip() not in ("", "0"):
        raise MigrationError("TORCH_DIST_INIT_BARRIER=1 makes new groups run a barrier at "
                             "creation, which a joiner cannot: unset it")  # fmt: skip
    if BACKEND not in dist.Backend.backend_list:
        dist.Backend.register_backend(BACKEND, _create, devices=["cpu", "cuda"])
    dist.init_process_group(BACKEND, store=HashStore(), rank=rank, world_size=size)
    world = dist.group.WORLD
    assert isinstance(world, SwappableGroup)
    atexit.unregister(release)  # once, however often a test installs a world
    atexit.register(release)
    return world


_releasing: list[Callable[[], None]] = []


def on_release(let_go: Callable[[], None]) -> None:
    """Call ``let_go`` first when ``release`` runs (it must not keep its owner alive)."""
    _releasing.append(let_go)


def release() -> None:
    """Let go of every group while the interpreter still runs (``install`` registers
    it with ``atexit``). A gloo group freed later, in the interpreter's teardown, has
    worker threads that may still drop a work holding tensors: taking the GIL then
    ends the thread inside C++ and the process aborts ("terminate called without an
    active exception"; torch's own ``destroy_process_group`` exists for this). A
    session still alive (one opened at a script's top level) lets go of its own groups
    first (``on_release``)."""
    global _bound
    for let_go in _releasing:
        with contextlib.suppress(Exception):
            let_go()
    _releasing.clear()
    if installed():
        with contextlib.suppress(Exception):  # a teardown: nothing left to tell
            dist.destroy_process_group()
    guard_with(None)
    for g in _groups:
        g.inner = None
    _groups.clear()
    _bound = False
    gc.collect()


def groups() -> list[SwappableGroup]:
    """Every ``SwappableGroup`` of this process, each with its ``key`` (its members)."""
    for g in _groups:
        if not g.key:
            g.key = tuple(sorted(dist.get_process_group_ranks(g)))
    return list(_groups)


def installed() -> bool:
    """Is the default world a ``SwappableGroup`` (``install`` ran in this process)?"""
    return dist.is_initialized() and isinstance(dist.group.WORLD, SwappableGroup)


def swap_all(inner: Callable[[SwappableGroup], Any]) -> list[Any]:
    """Give every group the inner group ``inner(group)`` returns, all at once; the old
    inner groups, in no particular order. Every inner group is asked for before any is
    swapped in, so one that cannot be had leaves the job on its old ones. Call it at
    a step boundary, with no collective in flight."""
    global _bound
    ordered = sorted(groups(), key=lambda g: g.group_name)
    built = [inner(g) for g in ordered]
    _bound = True
    return [g.swap(new) for g, new in zip(ordered, built, strict=True)]


def bind(build: Callable[[str, int, int], Any], generation: int) -> None:
    """Give every group its inner group for ``generation``: ``build(prefix, rank,
    size)`` returns one (a ``shell`` around a built backend); the prefix is the
    group's name, the same in every member and distinct between groups of the same
    members. Every new inner group is built before any is swapped in, so a build that
    fails leaves the job on its old ones; then the old ones are shut down. Call it at
    a step boundary, with no collective in flight."""
    # One order in every process (by name), so that no two processes wait for each
    # other on two groups in opposite orders.
    old = swap_all(lambda g: build(f"gen{generation}/pg-{g.group_name}", g.rank(), g.size()))
    for inner in old:
        if inner is not None:
            inner.shutdown()


# -- the inner groups, built by tmd.runtime.group ---------------------------------------


def specs() -> list[tuple[str, int, int]]:
    """Every group of the job but the world, as ``(name, rank, size)``, by name: the
    world's inner group is tmd's own group of the generation."""
    world = dist.group.WORLD
    return sorted((g.group_name, g.rank(), g.size()) for g in groups() if g is not world)


def inner_prefix(prefix: str, name: str) -> str:
    return f"{prefix}/pg-{name}"


def build_inner(
    store: Store, prefix: str, *, timeout: timedelta, backend: str, host: str
) -> dict[str, Group]:
    """Build every group's next inner backend now, in one order in every process (by
    name, so that no two processes wait for each other on two groups in opposite
    orders); blocks until all are built."""
    return {
        name: make_group(
            store,
            inner_prefix(prefix, name),
            rank=rank,
            size=size,
            timeout=timeout,
            backend=backend,
            host=host,
        )
        for name, rank, size in specs()
    }


def start_inner(
    address: StoreAddress, prefix: str, *, timeout: timedelta, backend: str, host: str
) -> dict[str, GroupBuilder]:
    """Start building every group's next inner backend, each in its own thread."""
    return {
        name: GroupBuilder(
            address,
            inner_prefix(prefix, name),
            rank=rank,
            size=size,
            timeout=timeout,
            backend=backend,
            host=host,
        )
        for name, rank, size in specs()
    }


def bind_inner(world: Group, inner: dict[str, Group], store: Store) -> list[Any]:
    """Swap in tmd's group ``world`` beneath the default world and ``inner[name]``
    beneath every other group; the old inner groups (to keep until no collective of
    theirs can be in flight)."""
    want = {name for name, _, _ in specs()}
    if set(inner) != want:
        raise MigrationError(f"inner groups for {sorted(inner)}, the job has {sorted(want)}")
    top = dist.group.WORLD

    def wrap(g: SwappableGroup) -> Any:
        backend = world if g is top else inner[g.group_name]
        return shell(backend, rank=g.rank(), size=g.size(), store=store)

    return [old for old in swap_all(wrap) if old is not None]


# -- the sandbox ------------------------------------------------------------------------


class Loopback:
    """An inner group that answers every collective from this rank's own tensors, with
    no communication: a gather repeats this rank's part, a reduce-scatter keeps this
    rank's chunk, a reduction leaves its input (every replica agreeing). What a wrapped
    standby's sandboxed shadow iterations run on (real kernels, real allocations, no
    network); the numbers are disposable, the joiner's state is overwritten when the
    leaver's arrives. Point-to-point receives are refused, and so is a broadcast from
    another rank unless ``own_broadcasts`` (a DDP model's standby: DDP fills the
    buffers of its broadcasts, of its bucket order and of its buffers, on every rank,
    so this rank's own are the answer); an object broadcast (``broadcast_object_list``,
    whose receivers' buffers hold nothing yet) is refused even then."""

    def __init__(self, rank: int, size: int, *, own_broadcasts: bool = False) -> None:
        self._rank, self._size = rank, size
        self._own_broadcasts = own_broadcasts

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def shutdown(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def _get_backend(self, device: Any) -> Any:
        raise MigrationError("a sandboxed shadow iteration has no backend")

    @staticmethod
    def _done(result: Any = None) -> Any:
        future: torch.futures.Future[Any] = torch.futures.Future()
        future.set_result(result)
        return _create_work_from_future(future)

    def _gather_into(self, output: torch.Tensor, part: torch.Tensor) -> None:
        with torch.no_grad():
            if output.numel() == part.numel() * self._size:
                # FSDP gathers in place: its input is this rank's chunk of the output.
                output.view(self._size, -1).copy_(part.reshape(1, -1).clone())
            else:  # an answer it cannot make is zeros, never uninitialised memory
                output.zero_()

    def _chunk_into(self, output: torch.Tensor, whole: torch.Tensor) -> None:
        with torch.no_grad():
            if whole.numel() == output.numel() * self._size:
                output.view(-1).copy_(whole.reshape(self._size, -1)[self._rank].clone())
            else:
                output.zero_()

    @staticmethod
    def _copy(output: torch.Tensor, source: torch.Tensor) -> None:
        with torch.no_grad():
            if output.shape == source.shape:
                output.copy_(source)
            else:
                output.zero_()

    # Reductions, barriers, sends: this rank's tensors are the answer.
    def _identity(self, *args: Any, **kwargs: Any) -> Any:
        return self._done(args[0] if args else None)

    allreduce = allreduce_coalesced = barrier = reduce = send = _identity

    def broadcast(self, tensors: Any, root: Any = None, *_: Any) -> Any:
        """From this rank: its tensors are the answer. From another there is none to
        be had without the job (an object broadcast would read garbage): refused."""
        rank = getattr(root, "rootRank", root)
        if (
            rank is not None
            and rank != self._rank
            and (not self._own_broadcasts or _in_object_collective())
        ):
            raise MigrationError(
                f"a sandboxed shadow iteration broadcast from rank {rank}: a standby's "
                "shadow steps can only run collectives its own tensors answer"
            )
        return self._done(tensors)

    def all_gather_single(self, output: torch.Tensor, part: torch.Tensor, *_: Any) -> Any:
        self._gather_into(output, part)
        return self._done([output])

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], parts: list[torch.Tensor], *_: Any
    ) -> Any:
        return self._each(self._gather_into, outputs, parts)

    def _each(
        self, fill: Callable[[torch.Tensor, torch.Tensor], None],
        outputs: list[torch.Tensor], inputs: list[torch.Tensor],
    ) -> Any:  # fmt: skip
        for output, source in zip(outputs, inputs, strict=False):
            fill(output, source)
        return self._done(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(
        self, outputs: list[list[torch.Tensor]], parts: list[torch.Tensor], *_: Any
    ) -> Any:
        # outputs[i][r]: tensor i as rank r has it
        for out, part in zip(outputs, parts, strict=False):
            for t in out:
                self._copy(t, part)
        return self._done(outputs)

    gather = allgather

    def allgather_coalesced(
        self, outputs: list[list[torch.Tensor]], parts: list[torch.Tensor], *_: Any
    ) -> Any:
        # outputs[r][i]: tensor i as rank r has it
        for out in outputs:
            for t, part in zip(out, parts, strict=False):
                self._copy(t, part)
        return self._done(outputs)

    def reduce_scatter_single(self, output: torch.Tensor, whole: torch.Tensor, *_: Any) -> Any:
        self._chunk_into(output, whole)
        return self._done([output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], wholes: list[torch.Tensor], *_: Any
    ) -> Any:
        return self._each(self._chunk_into, outputs, wholes)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], *_: Any
    ) -> Any:
        for i, output in enumerate(outputs):
            parts = inputs[i] if i < len(inputs) else []
            self._copy(output, parts[self._rank] if len(parts) == self._size else output[:0])
        return self._done(outputs)

    def scatter(
        self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], *_: Any
    ) -> Any:
        if not inputs:  # the source is another rank
            raise MigrationError(
                "a sandboxed shadow iteration scattered from another rank: build the mesh "
                "and wrappers without communication (src_data_rank=None)"
            )
        return self.reduce_scatter(outputs, inputs)

    def alltoall_base(self, output: torch.Tensor, whole: torch.Tensor, *_: Any) -> Any:
        self._copy(output, whole)
        return self._done([output])

    all_to_all_single = alltoall_base

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], *_: Any) -> Any:
        return self._each(self._copy, outputs, inputs)

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        raise MigrationError("a sandboxed shadow iteration received from a peer: it has none")

    recv_anysource = recv


def _in_object_collective() -> bool:
    """Is a ``torch.distributed`` object collective (``broadcast_object_list`` and
    the like) among this call's callers?"""
    frame: Any = sys._getframe(1)
    for _ in range(32):
        if frame is None:
            return False
        code = frame.f_code
        if code.co_name.endswith("_object_list") and code.co_filename.endswith(
            "distributed_c10d.py"
        ):
            return True
        frame = frame.f_back
    return False


# -- the guard: a failed step rather than an exception in the user's code -------------


class Guard:
    """While ``armed`` (a worker's forward and backward, and the session's clipping),
    every collective of every group goes through here (torchft's managed process group
    does the same for its wrappers). A collective that fails, or that a member's
    failure elsewhere in the job leaves hanging, raises nothing inside the wrapper's
    code, which would end the user's loop: it completes with this rank's own tensors
    (``Loopback``'s answer), the failure is kept in ``error``, and every later
    collective is answered the same way at once, until the session has recovered and
    calls ``reset`` for the next generation. The step's numbers are disposable: the
    session undoes the step and runs it again on the next generation's groups
    (``tmd.runtime.failover``).

    After a failure the later collectives are still issued on the old groups, their
    answers not waited for: a survivor that stopped issuing them would leave another
    survivor's matching collective waiting for it until the group's timeout. Each
    then ends soon, failing where it meets the lost member, or completing among the
    survivors. They run on the step's tensors, which the wrapper may use again (DDP's
    buckets), so the session runs the step again only once ``drain`` saw every one
    of them end (gloo's ``abort`` does not stop them) or wait for data that no
    member will send (in a ring, one whose neighbour failed the same collective and
    went on waits until the group's timeout: ``failover.running_elsewhere``).

    A failure elsewhere comes through ``fail`` from the worker's ``Presence`` thread
    (in a ring, a collective hangs on the ranks not next to the dead one); a failure
    seen here is reported through ``report(error, generation)`` (so that the others
    stop waiting), on a thread of its own: ``fail`` may run on a backend's callback
    thread. A failure is counted only for the generation it happened in: a
    collective of a failed step that fails late, or a report that arrives after the
    session moved on, changes nothing."""

    def __init__(self, report: Callable[[BaseException, int], None], generation: int) -> None:
        self.armed = False
        self.error: BaseException | None = None
        self.failed_at = 0.0
        """When ``error`` was set (``time.monotonic``)."""
        self.generation = generation
        self._report = report
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._abandoned: list[_Pending] = []
        self._waits: dict[str, queue.SimpleQueue[_Pending | None]] = {}
        """Per group, the works without a future its waiter thread waits for in turn."""
        self._issued: dict[str, int] = {}
        """Guarded collectives issued on each group (by name) in this generation: the
        next one's number, alike in every member up to the failure (after it, a
        member that saw the failure may skip what another issues: clipping)."""

    def run(self, group: SwappableGroup, name: str, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:  # fmt: skip
        """``group``'s collective ``name`` on its inner group, as a work that never
        fails."""
        if not group.key:
            group.key = tuple(sorted(dist.get_process_group_ranks(group)))
        name_of_group = group.group_name or ",".join(map(str, group.key))
        with self._lock:
            generation = self.generation
            number = self._issued.get(name_of_group, 0)
            self._issued[name_of_group] = number + 1
        try:
            work = getattr(group.inner, name)(*args, **kwargs)
        except RuntimeError as exc:  # a broken group may refuse at once
            self.fail(exc, generation)
            return _answer(group, name, args, kwargs)
        pending = _Pending(generation, work, group, name, args, kwargs)
        pending.op = (name_of_group, number)
        with self._lock:
            failed = self.error is not None or generation != self.generation
            if failed:
                self._abandoned.append(pending)
            else:
                self._pending[id(pending)] = pending
        self._watch(pending)
        if failed:  # answered at once; it runs on, and ``drain`` waits for its end
            return _answer(group, name, args, kwargs)
        return _create_work_from_future(pending.future)

    def _watch(self, pending: _Pending) -> None:
        """Call ``_done`` once ``pending``'s work ends: from its future's callback, or
        (gloo's reduce-scatters have no future, and report complete only once waited
        on) from its group's waiter thread of this generation, in the order they were
        issued."""
        try:
            source: torch.futures.Future[Any] = pending.work.get_future()
        except RuntimeError:
            with self._lock:
                waits = self._waits.get(pending.op[0])
                if waits is None:  # one per group: a hung one holds up only its own
                    waits = self._waits[pending.op[0]] = queue.SimpleQueue()
                    threading.Thread(target=self._waiter, args=(waits,), daemon=True,
                                     name="tmd-guard-wait").start()  # fmt: skip
                waits.put(pending)
            return
        source.add_done_callback(lambda f: self._done(pending, f.value))

    def _waiter(self, waits: queue.SimpleQueue[_Pending | None]) -> None:
        while (pending := waits.get()) is not None:
            self._done(pending, lambda p=pending: _waited(p))  # type: ignore[misc]

    def _done(self, pending: _Pending, value: Callable[[], Any]) -> None:
        """``pending``'s collective ended: ``value()`` is its result, or raises its
        error."""
        try:
            result = value()
        except Exception as exc:  # the collective failed
            pending.ended.set()
            self.fail(exc, pending.generation)
            return
        pending.ended.set()
        with self._lock:
            if self._pending.pop(id(pending), None) is None:
                return  # completed by ``fail`` or ``reset`` already
        pending.future.set_result(result)

    def fail(self, error: BaseException, generation: int, *, report: bool = True) -> None:
        """The step of ``generation`` failed (ignored if the guard moved on): complete
        every pending collective with this rank's own answer, and answer every later
        one so, until ``reset``."""
        with self._lock:
            if self.error is not None or generation != self.generation:
                return
            self.error, self.failed_at = error, time.monotonic()
            pending, self._pending = list(self._pending.values()), {}
            self._abandoned += pending
        _complete(pending)
        if report:
            threading.Thread(target=self._report, args=(error, generation), daemon=True,
                             name="tmd-guard-report").start()  # fmt: skip

    def reset(self, generation: int) -> None:
        """The session recovered into ``generation``: collectives run on the (new)
        inner groups again. Any collective still pending (one the step never waited
        for) is answered locally and abandoned."""
        with self._lock:
            self.generation = generation
            self.error = None
            self._issued = {}
            pending, self._pending = list(self._pending.values()), {}
            self._abandoned += pending
            waits, self._waits = list(self._waits.values()), {}
        _complete(pending)
        for queued in waits:
            queued.put(None)  # its thread ends after the works queued before

    def advance(self, generation: int) -> None:
        """A switch moved the job to ``generation`` between steps (nothing guarded
        is pending then, and nothing failed): failures are counted, and collectives
        numbered, in that generation from now on."""
        with self._lock:
            self.generation = generation
            self._issued = {}

    def drain(
        self, timeout: timedelta, settled: Callable[[dict[Op, tuple[int, ...]]], bool] | None = None
    ) -> bool:
        """Wait up to ``timeout`` for every abandoned collective to end or, where
        ``settled`` is given, for it to say that those still running (each with its
        group's members; the empty dict too) can receive nothing more; it is asked
        every ``DRAIN_POLL``. Whether that came. Forgets them either way."""
        deadline = time.monotonic() + timeout.total_seconds()
        with self._lock:
            abandoned, self._abandoned = self._abandoned, []
        if settled is None:
            return all(p.ended.wait(max(0.0, deadline - time.monotonic())) for p in abandoned)
        while True:
            if settled({p.op: p.group.key for p in abandoned if not p.ended.is_set()}):
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(DRAIN_POLL.total_seconds())


DRAIN_POLL = timedelta(milliseconds=20)
"""How often ``Guard.drain`` asks whether the collectives still running are settled."""


Op = tuple[str, int]
"""A guarded collective of a generation, named alike in every member of its group:
the group's name and the collective's number on that group (``Guard.run``)."""


class _Pending:
    """A collective issued through the guard, until it ends."""

    def __init__(self, generation: int, work: Any, group: SwappableGroup, name: str,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:  # fmt: skip
        self.generation, self.work, self.group, self.name = generation, work, group, name
        self.args, self.kwargs = args, kwargs
        self.future: torch.futures.Future[Any] = torch.futures.Future()
        self.ended = threading.Event()
        """The inner work ended (completed or failed)."""
        self.op: Op = ("", 0)


def _complete(pending: list[_Pending]) -> None:
    """Complete each with this rank's own answer: whatever happens, none is left for a
    caller to wait on forever."""
    for p in pending:
        try:
            value = _answer(p.group, p.name, p.args, p.kwargs).get_future().value()
        except Exception:  # an answer it could not make: the outputs as they are
            value = p.args[0] if p.args else None
        with contextlib.suppress(RuntimeError):  # completed already
            p.future.set_result(value)


def _waited(pending: _Pending) -> None:
    """Wait for a work without a future (raising its error); it has no result."""
    pending.work.wait()


def _answer(group: SwappableGroup, name: str, args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:  # fmt: skip
    """A failed collective's stand-in, as a completed work: ``Loopback``'s answer
    (outputs filled from this rank's own tensors); where it has none (a receive, an
    object broadcast, outputs it cannot fill), the outputs as they are."""
    loop = Loopback(group.rank(), group.size(), own_broadcasts=True)
    try:
        return getattr(loop, name)(*args, **kwargs)
    except Exception:  # refused (MigrationError), or outputs it cannot fill in place
        return Loopback._done(args[0] if args else None)


_guard: Guard | None = None


def guard_with(guard: Guard | None) -> None:
    """Route every collective through ``guard`` while it is armed (None: never)."""
    global _guard
    _guard = guard


def sandbox(*, own_broadcasts: bool = False) -> None:
    """Run every group on a ``Loopback`` of its rank and size (a wrapped standby's
    shadow iterations), until the session binds the real inner groups."""
    swap_all(lambda g: Loopback(g.rank(), g.size(), own_broadcasts=own_broadcasts))
