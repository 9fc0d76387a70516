"""What a rank's training state is, and how it is taken apart and put back.

A rank's state splits in two. The *bulk* (parameters, buffers, optimizer moments) is
a fixed list of tensors, the same on every data-parallel replica; it moves once, in
the background, as raw tensors into the joiner's already allocated ones. The *small*
state (step, RNG of torch / numpy / python, data position, scheduler, optimizer
hyper-parameters, anything else the user registered) is a few kilobytes and is the
only thing that moves at the switch.

The small state, every other payload of the transfer channel and the checkpoint's
``small-rank{N}.pt`` are encoded with ``torch.save`` and decoded with
``torch.load(weights_only=True)``, not pickled: whoever can write a checkpoint or
reach the channel could make a pickle run any code on load, while these bytes can
build only tensors, numbers, strings, bytes, None, torch dtypes and devices, and
lists, tuples, sets and dicts of those. So the small state holds only such values
(numpy's RNG key travels as a list), and ``encode`` refuses anything else where it
is sent or saved, naming where it sits, rather than leave the receiver with a
payload it will not open.
"""

from __future__ import annotations

import ctypes
import io
import itertools
import pickle
import random
import re
import sys
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import torch

StateDict = dict[str, Any]


class Stateful(Protocol):
    def state_dict(self) -> StateDict: ...
    def load_state_dict(self, state_dict: StateDict, /) -> None: ...


def rng_state() -> StateDict:
    state: StateDict = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy

        name, key, *rest = cast("tuple[Any, ...]", numpy.random.get_state(legacy=True))
        state["numpy"] = (name, key.tolist(), *rest)  # an ndarray would not load safely
    except ImportError:  # numpy is optional; a run without it has no numpy stream
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(tuple(state["numpy"]))  # takes the key as a list
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# One entry per optimizer-state key of one parameter: ("t", shape, dtype) for a tensor
# that travels in the bulk, ("v", value) for anything else.
Manifest = list[list[tuple[str, tuple[Any, ...]]]]


@dataclass
class TrainState:
    """The objects a session keeps consistent across ranks; owned by the user."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Stateful | None = None
    stateful: dict[str, Stateful] = field(default_factory=dict)
    step: int = 0

    def params(self) -> list[torch.Tensor]:
        """Every parameter the optimizer updates, in a stable order."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # -- bulk --------------------------------------------------------------------------

    def manifest(self) -> Manifest:
        out: Manifest = []
        for p in self.params():
            entries: list[tuple[str, tuple[Any, ...]]] = []
            for key, value in sorted(self.optimizer.state.get(p, {}).items()):
                if is_dtensor(value):
                    # Sharded like its parameter (torch's optimizers keep the moments
                    # of a DTensor as DTensors of its placement): this rank's shard
                    # travels, into a tensor the receiver allocates like the parameter.
                    entries.append((key, ("d", tuple(value.shape), value.dtype)))
                elif isinstance(value, torch.Tensor):
                    entries.append((key, ("t", tuple(value.shape), value.dtype)))
                else:
                    entries.append((key, ("v", value)))
            out.append(entries)
        return out

    def bulk_tensors(self) -> list[torch.Tensor]:
        """Model parameters and buffers, then optimizer tensors in manifest order.
        Views of the live storage: sending them copies nothing. A DTensor (a model
        wrapped by ``fully_shard`` or tensor parallelism) is this rank's shard of it,
        the tensor its collectives read and write."""
        tensors = [local(t.detach()) for t in self.model.state_dict(keep_vars=True).values()]
        for p in self.params():
            for _, value in sorted(self.optimizer.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    tensors.append(local(value))
        return tensors

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Every buffer of the model (persistent or not), this rank's part of each:
        what a step's forward may change besides the parameters (BatchNorm's running
        statistics), which a lock-step joiner takes from its leaver every step."""
        return [local(b.detach()) for b in self.model.buffers()]

    def receive_tensors(self, manifest: Manifest) -> list[torch.Tensor]:
        """The tensors to receive a peer's bulk into, matching its ``manifest``.

        A warmed standby already holds optimizer state of the right shapes (its shadow
        iterations allocated it), so this allocates only on a cold standby.
        """
        params = self.params()
        if len(manifest) != len(params):
            raise ValueError(f"peer has {len(manifest)} parameters, this rank {len(params)}")
        for p, entries in zip(params, manifest, strict=True):
            if not entries:  # no state on the peer: none here (a shadow step's goes)
                self.optimizer.state.pop(p, None)
                continue
            state = self.optimizer.state.setdefault(p, {})
            for extra in set(state) - {key for key, _ in entries}:
                del state[extra]
            for key, (kind, *rest) in entries:
                if kind == "v":
                    state[key] = rest[0]
                    continue
                shape, dtype = rest
                have = state.get(key)
                if (
                    isinstance(have, torch.Tensor)
                    and tuple(have.shape) == shape
                    and have.dtype == dtype
                    and is_dtensor(have) == (kind == "d")
                ):
                    continue
                if kind == "d":
                    if tuple(p.shape) != shape:
                        raise ValueError(
                            f"optimizer state {key!r} of shape {shape} is sharded, but its "
                            f"parameter has shape {tuple(p.shape)}: tmd moves sharded state "
                            "only where it is sharded like its parameter"
                        )
                    # Allocated like the parameter, placement and mesh included: no
                    # communication, and the shard comes in place.
                    state[key] = torch.empty_like(p, dtype=dtype)
                else:
                    state[key] = torch.empty(shape, dtype=dtype, device=p.device)
        return self.bulk_tensors()

    def local_grads(self) -> tuple[list[bool], list[torch.Tensor]]:
        """Which parameters have a gradient, and this rank's part of each of those (the
        local shard of a DTensor's): what a leaver of a wrapped model forwards."""
        params = self.params()
        for p in params:
            g = p.grad
            placed = getattr(g, "placements", None)
            if is_dtensor(p) and g is not None and placed != p.placements:  # type: ignore[attr-defined]
                raise ValueError(
                    f"a gradient placed {placed} for a parameter placed "
                    f"{p.placements}: the joiner could not apply it as the leaver does"  # type: ignore[attr-defined]
                )
        grads = [p.grad for p in params]
        return [g is not None for g in grads], [local(g) for g in grads if g is not None]

    def receive_grads(self, has_grad: list[bool]) -> list[torch.Tensor]:
        """Give the parameters a peer's ``local_grads`` says have a gradient a fresh
        one (a DTensor like the parameter), the others none; the tensors to receive
        the peer's into, this rank's part of each."""
        params = self.params()
        if len(has_grad) != len(params):
            raise ValueError(f"peer has {len(has_grad)} parameters, this rank {len(params)}")
        out = []
        for p, has in zip(params, has_grad, strict=True):
            p.grad = torch.empty_like(p) if has else None
            if p.grad is not None:
                out.append(local(p.grad))
        return out

    # -- small -------------------------------------------------------------------------

    def hyperparams(self) -> list[StateDict]:
        """What the optimizer reads besides gradients (lr, betas, weight decay, ...)."""
        return [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]

    def load_hyperparams(self, groups: list[StateDict]) -> None:
        for group, values in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(values)

    def small_state(self) -> StateDict:
        return {
            "step": self.step,
            "rng": rng_state(),
            "hyperparams": self.hyperparams(),
            "scheduler": None if self.scheduler is None else self.scheduler.state_dict(),
            "stateful": {name: obj.state_dict() for name, obj in self.stateful.items()},
        }

    def load_small_state(self, state: Mapping[str, Any]) -> None:
        self.step = int(state["step"])
        set_rng_state(state["rng"])
        self.load_hyperparams(state["hyperparams"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        for name, obj in self.stateful.items():
            obj.load_state_dict(state["stateful"][name])


def bucket_layout(model: torch.nn.Module) -> dict[str, Any] | None:
    """How a ``DistributedDataParallel`` model's reducer buckets its gradients: whether
    it has rebuilt its buckets, and the indices (in ``model.parameters()`` order) of
    each bucket's parameters; None for any other model. Every member must agree, or
    their all-reduces mix up gradients (or one broadcasts the new order while another
    all-reduces): DDP rebuilds its buckets once, in the second forward (the third
    with ``static_graph``), in the order gradients became ready, and rank 0's order
    wins; a joiner, alone until the switch, rebuilds its own in its shadow
    iterations (``ddp_warmup_steps``). Allocates a zero copy of the gradients: read
    it outside the switch."""
    reducer = getattr(model, "reducer", None)  # none: every all-reduce delayed
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel) or reducer is None:
        return None
    index = {id(p): i for i, p in enumerate(model.parameters())}
    buckets = reducer._get_zeros_like_grad_buckets()
    rebuilt = bool(getattr(model, "_has_rebuilt_buckets", False))
    # With unused parameters searched for and no static graph it never rebuilds.
    final = rebuilt or (model.find_unused_parameters and not model.static_graph)
    return {"rebuilt": rebuilt, "final": final,
            "buckets": [[index[id(p)] for p in b.parameters()] for b in buckets]}  # fmt: skip


def replicas(model: torch.nn.Module, params: list[torch.Tensor], world_size: int,
             *, wrapped: bool) -> list[frozenset[int]]:  # fmt: skip
    """For each rank, the ranks that hold what it holds of the parameters (and so of
    the optimizer state), itself included: who can stand in for it as a failover's
    donor. Every rank, where the session averages the gradients or DDP does; on a
    wrapped model, the ranks at the same coordinates of every parameter's mesh on
    each dimension where the parameter is not replicated (HSDP: the same shard in
    another replica group; FSDP2 on one dimension and tensor parallelism: none but
    itself). A parameter not on a mesh of the whole job, or not a DTensor (outside
    DDP over the whole world), has no replica known. Buffers are not compared: a
    donor's stand in for the lost rank's, as in data parallelism."""
    everyone = frozenset(range(world_size))
    if not wrapped:
        return [everyone] * world_size
    on_mesh = any(is_dtensor(p) for p in params)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not on_mesh:
        group = model.process_group
        if group is None or group.size() == world_size:  # DDP over every rank
            return [everyone] * world_size
    alone = [frozenset({r}) for r in range(world_size)]
    peers = [everyone] * world_size
    for p in params:
        if not is_dtensor(p):
            return alone
        grid = p.device_mesh.mesh  # type: ignore[attr-defined]
        if grid.numel() != world_size or set(grid.flatten().tolist()) != set(everyone):
            return alone
        sharded = [d for d, pl in enumerate(p.placements) if not pl.is_replicate()]  # type: ignore[attr-defined]
        where = {int(grid[c].item()): tuple(c[d] for d in sharded)
                 for c in itertools.product(*(range(n) for n in grid.shape))}  # fmt: skip
        peers = [peers[r] & {q for q in everyone if where[q] == where[r]}
                 for r in range(world_size)]  # fmt: skip
    return peers


def ddp_warmup_steps(model: torch.nn.Module) -> int:
    """The iterations after which a ``DistributedDataParallel`` model has rebuilt its
    buckets (0 for any other model)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return 0
    return 3 if model.static_graph else 2


def can_rebuild_ddp_buckets(model: torch.nn.Module) -> bool:
    """Can ``rebuild_ddp_buckets`` rebuild this model's buckets after one iteration?"""
    return (
        isinstance(model, torch.nn.parallel.DistributedDataParallel)
        and not model.static_graph
        and not model.find_unused_parameters  # never rebuilds: nothing to do early
        and hasattr(getattr(model, "reducer", None), "_rebuild_buckets")
    )


def rebuild_ddp_buckets(model: torch.nn.Module) -> bool:
    """Rebuild a DDP model's buckets now, in the order its first backward recorded,
    as its next forward would (the reducer's ``_rebuild_buckets``, which DDP's forward
    calls; private). True where rebuilt; False where it cannot (this torch lacks it,
    a static graph, unused parameters searched for) or there was nothing to rebuild
    from: then the model rebuilds when DDP's own rules say, if ever."""
    if not can_rebuild_ddp_buckets(model) or not model.reducer._rebuild_buckets():  # type: ignore[union-attr,operator]
        return False
    model._has_rebuilt_buckets = True  # type: ignore[assignment]  # as its forward records it
    return True


def is_dtensor(value: object) -> bool:
    """Is ``value`` a ``torch.distributed.tensor.DTensor``? (None can exist before
    that module is imported, so a job without one never imports it.)"""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (an alias of the
    storage its collectives use, under ``no_grad``), else ``t`` itself."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()  # type: ignore[attr-defined,no-any-return]
    return t


# The types ``torch.load(weights_only=True)`` rebuilds by default, by exact type:
# a subclass (numpy.float64, an IntEnum, a namedtuple, a defaultdict) pickles under
# its own name, which the receiver refuses.
_LEAVES: frozenset[type] = frozenset(
    {type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype,
     torch.device, torch.Tensor, torch.nn.Parameter}
)  # fmt: skip
_MAPPINGS: frozenset[type] = frozenset({dict, OrderedDict, Counter})
_SEQUENCES: frozenset[type] = frozenset({list, tuple, set, torch.Size})
_ALLOWED = (
    "tensors, numbers, strings, bytes, None, torch dtypes and devices, and lists, "
    "tuples, sets and dicts of these"
)


def check_safe(obj: Any, path: str = "") -> None:
    """Raise ``ValueError`` naming the first value, by its dotted key path, that the
    receiver of ``encode``-d bytes would refuse to rebuild."""
    kind = type(obj)
    if kind in _LEAVES:
        return
    if kind in _MAPPINGS:
        for key, value in obj.items():
            if type(key) is not str:
                check_safe(key, f"{path}.<key {key!r}>" if path else f"<key {key!r}>")
            check_safe(value, f"{path}.{key}" if path else str(key))
        return
    if kind in _SEQUENCES:
        for i, value in enumerate(obj):
            check_safe(value, f"{path}.{i}" if path else str(i))
        return
    where = path or "the payload"
    raise ValueError(
        f"{where}: type {kind.__module__}.{kind.__qualname__} cannot be sent or "
        f"checkpointed safely; state may hold only {_ALLOWED}"
    )


def encode(obj: Any) -> bytes:
    """``obj`` as bytes that ``decode`` rebuilds without running code; ``ValueError``
    (see ``check_safe``) if it holds a value that would not come back."""
    check_safe(obj)
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


# What torch's refusal names: a global it will not call, or another instruction.
_REFUSAL = re.compile(r"Unsupported global: GLOBAL (\S+)|WeightsUnpickler error:\s*(.*)")


def decode(data: bytes, *, source: str) -> Any:
    """Rebuild what ``encode`` wrote. Bytes that would build anything else, or that
    are no such encoding, raise ``ValueError`` naming ``source`` and what was
    refused; nothing in them runs."""
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _REFUSAL.search(str(exc))
        if found and found.group(1):
            what = f"it refers to {found.group(1)}"
        else:
            what = found.group(2) if found else str(exc).split("\n", 1)[0]
        raise ValueError(f"{source}: refused to load ({what}); tmd loads only {_ALLOWED}") from exc
    except (RuntimeError, EOFError) as exc:  # not a torch.save archive at all
        raise ValueError(f"{source}: not a tmd state encoding: {exc}") from exc


def pack(obj: Any) -> torch.Tensor:
    """``encode`` ``obj`` into a uint8 tensor a backend can send."""
    return torch.frombuffer(bytearray(encode(obj)), dtype=torch.uint8)


def unpack(tensor: torch.Tensor) -> Any:
    # Read straight from the tensor's memory: ``.numpy()`` would make numpy a
    # requirement of the runtime, which it is not.
    flat = tensor.detach().to("cpu", torch.uint8).contiguous()
    return decode(ctypes.string_at(flat.data_ptr(), flat.numel()), source="transfer payload")
