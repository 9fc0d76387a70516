"""``swap_group.Loopback``, the inner group a wrapped standby's shadow iterations run
on: every collective is answered from this rank's own tensors, with a completed work,
or refused where only another rank could answer it."""

from __future__ import annotations

import pytest
import torch

from tmd.errors import MigrationError
from tmd.runtime.swap_group import Loopback


def test_a_gather_repeats_its_part_in_place_and_a_reduce_scatter_keeps_its_chunk() -> None:
    group = Loopback(1, 3)
    out = torch.arange(6.0)
    work = group.all_gather_single(out, out[2:4])  # FSDP gathers in place
    assert work.is_completed() and work.wait()
    assert out.tolist() == [2.0, 3.0] * 3
    chunk = torch.empty(2)
    group.reduce_scatter_single(chunk, torch.arange(6.0))
    assert chunk.tolist() == [2.0, 3.0]


def test_lists_are_indexed_as_torch_indexes_them() -> None:
    group = Loopback(0, 2)
    parts = [torch.ones(2), torch.full((3,), 2.0)]
    # allgather: outputs[i][rank]; allgather_coalesced: outputs[rank][i]
    gathered = [[torch.empty(2), torch.empty(2)], [torch.empty(3), torch.empty(3)]]
    group.allgather(gathered, parts)
    assert [t.tolist() for t in gathered[1]] == [[2.0] * 3] * 2
    coalesced = [[torch.empty(2), torch.empty(3)], [torch.empty(2), torch.empty(3)]]
    group.allgather_coalesced(coalesced, parts)
    assert [t.tolist() for t in coalesced[1]] == [[1.0, 1.0], [2.0] * 3]


def test_an_answer_it_cannot_make_is_zeros_and_another_ranks_data_is_refused() -> None:
    group = Loopback(1, 2)
    out = torch.full((5,), float("nan"))
    group.all_gather_single(out, torch.ones(2))  # 5 is not 2 x 2
    assert out.tolist() == [0.0] * 5
    with pytest.raises(MigrationError, match="broadcast from rank 0"):
        group.broadcast([torch.empty(1)], 0)
    assert group.broadcast([torch.ones(1)], 1).is_completed()
    with pytest.raises(MigrationError, match="scattered from another rank"):
        group.scatter([torch.empty(1)], [])
    with pytest.raises(MigrationError, match="received from a peer"):
        group.recv([torch.empty(1)], 0, 0)


def test_a_ddp_standby_answers_its_own_broadcasts_and_its_bucket_layout_is_read() -> None:
    """DDP fills the buffer of its bucket-order broadcast on every rank: a standby's
    own is the answer. The layout it then rebuilds (gradients in the order they
    became ready) is what the joiner checks against the job's before committing."""
    from torch import nn

    from tmd.runtime.state import bucket_layout, ddp_warmup_steps
    from tmd.runtime.swap_group import SwappableGroup

    group = SwappableGroup(1, 2)
    group.swap(Loopback(1, 2, own_broadcasts=True))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ddp = nn.parallel.DistributedDataParallel(
        model, process_group=group, init_sync=False, bucket_cap_mb=1e-4
    )
    assert bucket_layout(model) is None and ddp_warmup_steps(model) == 0  # not DDP
    # At construction: one first bucket.
    assert bucket_layout(ddp) == {"rebuilt": False, "final": False, "buckets": [[0, 1, 2, 3]]}
    for _ in range(ddp_warmup_steps(ddp)):  # the second forward rebuilds the buckets
        ddp(torch.randn(3, 4)).sum().backward()
    # The last layer's gradients came first.
    assert bucket_layout(ddp) == {"rebuilt": True, "final": True, "buckets": [[3, 2, 1], [0]]}


def test_a_ddp_standby_still_refuses_an_object_broadcast() -> None:
    """Its receivers' buffers hold nothing: the standby's own would be garbage."""
    import torch.distributed as dist

    from tmd.runtime import swap_group

    swap_group.install(rank=1, size=2)
    try:
        swap_group.sandbox(own_broadcasts=True)
        t = torch.ones(2)
        dist.broadcast(t, src=0)  # a tensor's broadcast: its own is the answer
        assert t.tolist() == [1.0, 1.0]
        with pytest.raises(MigrationError, match="broadcast from rank 0"):
            dist.broadcast_object_list([None], src=0)
    finally:
        swap_group.release()
