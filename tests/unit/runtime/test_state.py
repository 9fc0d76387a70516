"""State capture and restore, sampler position, and the bucketed reducer, in-process."""

from __future__ import annotations

import random
import subprocess
import sys

import numpy
import pytest
import torch

from tmd.runtime.data import ResumableSampler
from tmd.runtime.reducer import GradientReducer
from tmd.runtime.state import TrainState, pack, unpack


def _train_state(seed: int, *, steps: int) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    sampler = ResumableSampler(40, batch_size=4, rank=0, world_size=2)
    state = TrainState(model, optimizer, scheduler, {"sampler": sampler})
    for _ in range(steps):
        sampler.next_batch()
        model(torch.randn(4, 6)).sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        state.step += 1
    return state


def test_bulk_and_small_state_make_a_fresh_replica_identical() -> None:
    source = _train_state(0, steps=3)
    target = _train_state(1, steps=0)  # a cold standby: no optimizer state yet
    for dst, src in zip(
        target.receive_tensors(source.manifest()), source.bulk_tensors(), strict=True
    ):
        dst.copy_(src)
    target.load_small_state(unpack(pack(source.small_state())))

    assert target.step == 3
    assert target.hyperparams() == source.hyperparams()
    src_model, dst_model = source.model.state_dict(), target.model.state_dict()
    for name, tensor in src_model.items():
        assert torch.equal(dst_model[name], tensor)
    assert target.scheduler.state_dict() == source.scheduler.state_dict()  # type: ignore[union-attr]
    for p_src, p_dst in zip(source.params(), target.params(), strict=True):
        for key, value in source.optimizer.state[p_src].items():
            assert torch.equal(target.optimizer.state[p_dst][key], value)
    # Both read the same batches from here on.
    target_sampler, source_sampler = target.stateful["sampler"], source.stateful["sampler"]
    assert isinstance(target_sampler, ResumableSampler)
    assert isinstance(source_sampler, ResumableSampler)
    assert target_sampler.next_batch() == source_sampler.next_batch()


def test_rng_state_round_trip_restores_all_three_streams() -> None:
    from tmd.runtime.state import rng_state, set_rng_state

    saved = rng_state()
    first = (torch.rand(2), numpy.random.rand(), random.random())
    set_rng_state(saved)
    again = (torch.rand(2), numpy.random.rand(), random.random())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]


def test_sampler_resumes_mid_epoch_and_rolls_over() -> None:
    a = ResumableSampler(24, batch_size=2, rank=1, world_size=3, seed=7)
    seen = [a.next_batch() for _ in range(5)]  # 4 batches per epoch: crosses into epoch 1
    b = ResumableSampler(24, batch_size=2, rank=0, world_size=3, seed=7)
    b.load_state_dict(a.state_dict())
    assert b.rank == 1 and b.epoch == 1
    assert [b.next_batch() for _ in range(3)] == [a.next_batch() for _ in range(3)]
    first_epoch = {i for batch in seen[:4] for i in batch}
    assert len(first_epoch) == 8  # disjoint, no repeats within an epoch


def test_sampler_rejects_a_dataset_smaller_than_a_global_batch() -> None:
    with pytest.raises(ValueError):
        ResumableSampler(5, batch_size=2, rank=0, world_size=3)


def test_reducer_buckets_split_by_size_and_round_trip_gradients() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 3))
    reducer = GradientReducer(list(model.parameters()), bucket_bytes=200)
    assert len(reducer.buckets) > 1
    assert sum(b.buffer.numel() for b in reducer.buckets) == sum(
        p.numel() for p in model.parameters()
    )
    model(torch.randn(2, 10)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
    reducer.pack()
    for p in model.parameters():
        p.grad = None
    reducer.load(reducer.buffers)
    for p, g in zip(model.parameters(), grads, strict=True):
        assert torch.equal(p.grad, g)  # type: ignore[arg-type]


def test_reducer_gives_a_parameter_without_gradient_zeros() -> None:
    used, unused = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    reducer = GradientReducer([*used.parameters(), *unused.parameters()])
    used(torch.randn(1, 3)).sum().backward()
    reducer.load(None)
    assert unused.weight.grad is not None and not unused.weight.grad.any()


def test_small_state_travels_without_numpy() -> None:
    """``pip install 'tmd[runtime]'`` brings torch, not numpy: packing and unpacking the
    small state must not need it (``Tensor.numpy()`` aborted every migration)."""
    code = (
        "import sys; sys.modules['numpy'] = None\n"
        "import torch\n"
        "from tmd.runtime.state import pack, unpack\n"
        "state = {'step': 7, 'rng': list(range(5)), 'name': 'w1'}\n"
        "assert unpack(pack(state)) == state\n"
        "both = torch.cat([pack('x'), pack(state)])\n"
        "assert unpack(both[len(pack('x')):]) == state  # a view at an offset\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_replicas_follow_each_parameter_s_mesh_and_placements() -> None:
    """Who holds what a rank holds: every rank in data parallelism, the same shard of
    the other replica group in HSDP, nobody else in FSDP2 on one dimension or in
    tensor parallelism with FSDP2 (one process, torch's fake process group of 4)."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tmd.runtime.state import replicas

    def model() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        plain = model()
        assert replicas(plain, list(plain.parameters()), 4, wrapped=False) == [{0, 1, 2, 3}] * 4
        hsdp = model()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        fully_shard(hsdp[0], mesh=mesh)
        fully_shard(hsdp, mesh=mesh)
        assert replicas(hsdp, list(hsdp.parameters()), 4, wrapped=True) == [
            {0, 2}, {1, 3}, {0, 2}, {1, 3}
        ]  # fmt: skip
        fsdp = model()
        fully_shard(fsdp, mesh=init_device_mesh("cpu", (4,)))
        assert replicas(fsdp, list(fsdp.parameters()), 4, wrapped=True) == [{0}, {1}, {2}, {3}]
        tp = model()
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        parallelize_module(tp, mesh["tp"], plan, src_data_rank=None)  # type: ignore[arg-type]
        fully_shard(tp, mesh=mesh["dp"])
        assert replicas(tp, list(tp.parameters()), 4, wrapped=True) == [{0}, {1}, {2}, {3}]
    finally:
        dist.destroy_process_group()


def test_one_iteration_and_a_rebuild_bucket_a_ddp_model_as_two_iterations_do() -> None:
    """``rebuild_ddp_buckets``: a failover's DDP joiner rebuilds after one iteration
    what DDP's second forward rebuilds (one process, gloo; buckets small enough that
    the order of readiness shows)."""
    import torch.distributed as dist
    from torch import nn

    from tmd.runtime.state import bucket_layout, rebuild_ddp_buckets

    def trained(iterations: int, rebuild: bool) -> object:
        torch.manual_seed(0)
        inner = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                              nn.Linear(64, 4))  # fmt: skip
        ddp = nn.parallel.DistributedDataParallel(inner, bucket_cap_mb=0.01, init_sync=False)
        for _ in range(iterations):
            ddp(torch.ones(2, 16)).sum().backward()
        assert not bucket_layout(ddp)["rebuilt"]  # type: ignore[index]
        if rebuild:
            assert rebuild_ddp_buckets(ddp) and not rebuild_ddp_buckets(ddp)  # once
        else:
            ddp(torch.ones(2, 16)).sum().backward()  # the second forward rebuilds
        return bucket_layout(ddp)

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        early, usual = trained(1, rebuild=True), trained(1, rebuild=False)
        assert early == usual and early["rebuilt"]  # type: ignore[index]
        assert len(early["buckets"]) > 1  # type: ignore[index]
    finally:
        dist.destroy_process_group()
