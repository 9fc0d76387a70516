"""One process of ``test_swap_group``: a tiny model wrapped by ``fully_shard`` on a
mesh of ``SwappableGroup``s, trained 6 steps on gloo. Ranks ``0..world-1`` start; the
process numbered ``world`` is a standby that takes rank ``world - 1``'s place before
step 3, its shards of the parameters and of the optimizer state copied one to one:

- ``fsdp`` (a 1-D mesh): from the leaver itself, a live migration;
- ``hsdp`` (replicate x shard, 2 x world/2): rank ``world - 1`` is lost, and its
  replica in the other replica group (the same shard) sends them: a failover.

Every process trains an unsharded copy of the model on the whole batch beside it and
prints, as JSON, how far its parameters (gathered whole) ended from that copy's.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from tmd.runtime import group, swap_group

TIMEOUT = timedelta(seconds=60)
SWITCH = 3
STEPS = 6


def model_and_reference(world: int, mode: str) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ref.load_state_dict(model.state_dict())
    if mode == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
    else:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, ref


def local_state(model: nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards: every parameter's, then every optimizer state's, in order."""
    out: list[torch.Tensor] = []
    for p in model.parameters():
        out.append(p.to_local() if isinstance(p, DTensor) else p)
    for p in model.parameters():
        for _, v in sorted(opt.state[p].items()):
            out.append(v.to_local() if isinstance(v, DTensor) else v)
    return out


def main() -> None:
    me, world, mode, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    store = dist.TCPStore("127.0.0.1", port, is_master=(me == 0), timeout=TIMEOUT,
                          wait_for_workers=False)  # fmt: skip
    leaver = world - 1
    donor = leaver if mode == "fsdp" else leaver - world // 2
    joiner = me == world
    rank = leaver if joiner else me

    def build(prefix: str, rank: int, size: int) -> object:
        backend = group.make_group(
            store, prefix, rank=rank, size=size, timeout=TIMEOUT, host="127.0.0.1"
        )
        return swap_group.shell(backend, rank=rank, size=size, store=store)

    swap_group.install(rank=rank, size=world)
    model, ref = model_and_reference(world, mode)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    if not joiner:
        swap_group.bind(build, 0)
    data = torch.Generator().manual_seed(1)
    first = SWITCH if joiner else 0
    for _ in range(first):  # the joiner's data and reference catch up, without the job
        x, y = torch.randn(world * 2, 8, generator=data), torch.randn(world * 2, 4, generator=data)
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    for step in range(first, STEPS):
        if step == SWITCH:
            if me in (donor, world):
                channel = group.make_group(store, "transfer", rank=int(joiner), size=2,
                                           timeout=TIMEOUT, host="127.0.0.1")  # fmt: skip
                if joiner:
                    # The optimizer's state, allocated locally like the parameters
                    # (zeros_like of a DTensor keeps its placement), then filled.
                    for p in model.parameters():
                        opt.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                        "exp_avg_sq": torch.zeros_like(p)}  # fmt: skip
                    with torch.no_grad():
                        for t in local_state(model, opt):
                            channel.recv([t], 0, 0).wait()
                else:
                    for t in local_state(model, opt):
                        channel.send([t.detach().contiguous()], 1, 0).wait()
            if me == leaver:
                print(json.dumps({"process": me, "left": True}), flush=True)
                return
            swap_group.bind(build, 1)
        x, y = torch.randn(world * 2, 8, generator=data), torch.randn(world * 2, 4, generator=data)
        mine = slice(rank * 2, rank * 2 + 2)  # gradients average over every rank
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    whole = {k: v.full_tensor() for k, v in model.state_dict().items()}
    diff = max(float((whole[k] - v).abs().max()) for k, v in ref.state_dict().items())
    keys = sorted(g.key for g in swap_group.groups())
    print(json.dumps({"process": me, "rank": rank, "max_diff": diff, "groups": keys}), flush=True)


if __name__ == "__main__":
    main()
