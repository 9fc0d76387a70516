"""A tiny job wrapped by torch's own parallelism, run by ``tmd launch`` under a session
(``tmd.runtime.parallel``), for ``test_parallel``:

- ``fsdp``: ``fully_shard`` on a 1-D mesh of every rank;
- ``hsdp``: ``fully_shard`` on a 2-D mesh (replicate across machines, shard within);
- ``tp``: tensor parallelism within a machine (the first layer column-wise, the last
  row-wise) on the ``tp`` dimension of a (dp, tp) mesh, ``fully_shard`` on ``dp``;
- ``ddp``: ``DistributedDataParallel`` on the default world.

Every process trains an unsharded copy of the model beside it on the whole global
batch of each step (the reference); a joiner first replays the steps the job made
before it joined. Each worker still in the job at the end writes, as JSON, how far
its parameters (gathered whole) ended from the reference's; every process writes its
rank's losses.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

BATCH = 4  # per data-parallel rank
N = 256


class StepData:
    """The data position: which samples a data-parallel rank takes at each step."""

    def __init__(self, dp_rank: int, dp_size: int) -> None:
        self.dp_rank, self.dp_size, self.step = dp_rank, dp_size, 0

    def indices(self, step: int, dp_rank: int) -> torch.Tensor:
        start = (step * self.dp_size + dp_rank) * BATCH
        return torch.arange(start, start + BATCH) % N

    def next_batch(self) -> torch.Tensor:
        idx = self.indices(self.step, self.dp_rank)
        self.step += 1
        return idx

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


class Forwards(nn.Module):
    """Counts its forwards in a buffer (as BatchNorm counts its batches): a step run
    twice must count once."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("forwards", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.forwards += 1
        return x


def build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4), Forwards())


def wrap(layout: str, model: nn.Module, world: int, per_node: int) -> tuple[nn.Module, int, int]:
    """Wrap ``model`` for ``layout``; the model to train, this rank's data-parallel
    rank and size."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if layout == "ddp":  # no collective at construction: a joiner builds it unbound
        ddp = nn.parallel.DistributedDataParallel(model, init_sync=False)
        return ddp, dist.get_rank(), world
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model[0], mesh=mesh)  # type: ignore[index]
        fully_shard(model, mesh=mesh)
        return model, mesh.get_local_rank(), world
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (world // per_node, per_node),
                                mesh_dim_names=("replicate", "shard"))  # fmt: skip
        fully_shard(model[0], mesh=mesh)  # type: ignore[index]
        fully_shard(model, mesh=mesh)
        return model, mesh.get_rank(), world  # every rank takes its own batch
    mesh = init_device_mesh("cpu", (world // per_node, per_node), mesh_dim_names=("dp", "tp"))
    # Every rank built the same weights: each takes its shard, no scatter (a joiner's
    # groups carry no collective before the switch).
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    parallelize_module(model, mesh["tp"], plan, src_data_rank=None)  # type: ignore[dict-item]
    fully_shard(model, mesh=mesh["dp"])
    return model, mesh["dp"].get_local_rank(), world // per_node


def train(argv: list[str]) -> None:
    from tmd.runtime import SessionConfig, parallel, session
    from tmd.runtime.env import RuntimeEnv

    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=("ddp", "fsdp", "hsdp", "tp"), required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hold", default="", help="while this file exists, steps are slow")
    parser.add_argument("--held-sleep", type=float, default=0.25)
    # Small enough that every step clips: a joiner must apply the job's clipped
    # gradients, not clip its shard by its own norm.
    parser.add_argument("--max-grad-norm", type=float, default=0.05)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--kill-rank", type=int, action="append", default=[],
                        help="SIGKILL these ranks in the job's first run ...")  # fmt: skip
    parser.add_argument("--kill-step", type=int, default=-1, help="... in this step ...")
    parser.add_argument("--kill-in", choices=("forward", "after-backward"),
                        default="after-backward",
                        help="... inside the last layer's forward (the wrapper's collectives "
                        "of that step half done), or once its backward is done")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    env = RuntimeEnv.from_environ()
    config = SessionConfig(group_timeout=timedelta(seconds=30),
                           joiner_timeout=timedelta(seconds=2), detect_timeout=timedelta(seconds=5),
                           max_grad_norm=args.max_grad_norm, checkpoint_dir=args.checkpoint_dir,
                           checkpoint_every=args.checkpoint_every)  # fmt: skip
    doomed = env.role == "worker" and env.rank in args.kill_rank and env.restart_count == 0
    rank = parallel.init(config=config, env=env)
    model, dp_rank, dp_size = wrap(args.layout, build(), env.world_size, env.local_world_size)
    reference = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=5, gamma=0.8)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 16, generator=gen)
    y = x[:, :4] * 2.0 + 0.1 * torch.randn(N, 4, generator=gen)
    data = StepData(dp_rank, dp_size)
    if doomed and args.kill_in == "forward":

        def die(*_: object) -> None:
            if s.state.step == args.kill_step and s.role == "worker":
                os.kill(os.getpid(), signal.SIGKILL)

        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        inner[2].register_forward_pre_hook(die)  # type: ignore[index]

    def reference_step(step: int) -> None:
        idx = torch.cat([data.indices(step, r) for r in range(dp_size)])
        nn.functional.mse_loss(reference(x[idx]), y[idx]).backward()
        nn.utils.clip_grad_norm_(reference.parameters(), args.max_grad_norm)
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()

    out = Path(args.out)
    losses: list[tuple[int, int, float]] = []
    with session(model, optimizer, scheduler=scheduler, stateful={"data": data},
                 config=config, env=env) as s:  # fmt: skip
        done = shadows = redone = 0
        for step in s.steps(args.steps):
            shadow = s.is_shadow  # a standby's sandboxed iterations: disposable
            while not shadow and done < step:  # a joiner catches its reference up
                reference_step(done)
                done += 1
            idx = data.next_batch()
            loss = nn.functional.mse_loss(model(x[idx]), y[idx])
            loss.backward()  # type: ignore[no-untyped-call]
            if doomed and step == args.kill_step and args.kill_in == "after-backward":
                os.kill(os.getpid(), signal.SIGKILL)  # its shards of the gradients are out
            if not shadow:
                losses.append((s.rank, step, float(loss.item())))
            if not s.step():
                redone += 1
                continue  # a failover undid it: the same step again, on the new groups
            if shadow:
                shadows += 1
                continue
            reference_step(step)
            done = step + 1
            if args.hold and os.path.exists(args.hold):
                time.sleep(args.held_sleep)
        name = f"losses-{env.node}-{env.local_rank}-run{env.restart_count}.json"
        (out / name).write_text(json.dumps(losses))
        if s.role == "worker" and not s.left:
            whole = {k.removeprefix("module."): getattr(v, "full_tensor", lambda v=v: v)()
                     for k, v in model.state_dict().items()}  # fmt: skip
            diff = max(float((whole[k] - v).abs().max()) for k, v in reference.state_dict().items())
            result = {"rank": s.rank, "node": env.node, "step": s.state.step, "max_diff": diff,
                      "init_rank": rank, "run": env.restart_count, "shadow_steps": shadows,
                      "restored_step": s.restored_step, "redone": redone}  # fmt: skip
            (out / f"final-rank{s.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    from tmd.runtime import run

    # Everything loaded so far (torch) lives until the process ends: frozen, the
    # collector leaves it alone, at exit too (a job's end was 1 to 2 s slower).
    gc.freeze()
    run(train, sys.argv[1:])
