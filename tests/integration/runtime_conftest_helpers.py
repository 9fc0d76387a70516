"""A tiny data-parallel training script, and the harness the runtime tests drive it with.

Run as a script (by ``LocalJob``), it trains a small MLP with dropout, AdamW, a
learning-rate schedule, and inputs perturbed by numpy and python RNG, so every
kind of migrated state (parameters, optimizer, scheduler, three RNG streams, data
position) changes the result if it is lost. Each process writes what it computed
to ``--out``: the final parameters of the rank it ends as, and its losses by
(rank, step). Faults (``--kill-rank``) are injected in the job's first start only,
so a restarted job runs clean.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy
import torch

SCRIPT = str(Path(__file__).resolve())


def build(seed: int, dropout: float = 0.1) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(dropout), torch.nn.Linear(32, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=7, gamma=0.9)
    return model, optimizer, scheduler


def dataset(seed: int, n: int = 240) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(n, 16, generator=gen)
    y = x[:, :4] * 2.0 + torch.randn(n, 4, generator=gen) * 0.1
    return x, y


def train(argv: list[str]) -> None:
    from tmd.runtime import ResumableSampler, SessionConfig, session
    from tmd.runtime.env import RuntimeEnv

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sleep", type=float, default=0.02)
    parser.add_argument(
        "--hold", default="", help="while this file exists, each step sleeps --held-sleep"
    )
    parser.add_argument("--held-sleep", type=float, default=0.25)
    parser.add_argument("--out", required=True)
    parser.add_argument("--shadow-steps", type=int, default=2)
    parser.add_argument("--fault", default="", help="inject a failure (tests)")
    parser.add_argument(
        "--kill-rank", type=int, action="append", default=[], help="SIGKILL these ranks ..."
    )
    parser.add_argument("--kill-step", type=int, default=-1, help="... inside this step")
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--detect-timeout", type=float, default=10.0, help="seconds")
    parser.add_argument("--standby-wait", type=float, default=5.0, help="seconds")
    parser.add_argument(
        "--no-noise", action="store_true", help="no per-rank randomness (failover tests)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    env = RuntimeEnv.from_environ()
    if args.fault == "joiner-dies-at-switch" and env.role == "standby":
        from tmd.runtime.state import TrainState

        def die(self: TrainState, state: Any) -> None:
            os._exit(3)

        TrainState.load_small_state = die  # type: ignore[method-assign]
    seed = 1234
    model, optimizer, scheduler = build(seed, 0.0 if args.no_noise else 0.1)
    # Per-rank streams: a joiner must continue the leaver's, not start its own.
    torch.manual_seed(seed + 1 + env.rank)
    numpy.random.seed(seed + 2 + env.rank)
    random.seed(seed + 3 + env.rank)
    x, y = dataset(seed)
    sampler = ResumableSampler(len(x), batch_size=4, rank=env.rank, world_size=env.world_size)
    losses: list[tuple[int, int, float]] = []
    config = SessionConfig(
        shadow_steps=args.shadow_steps,
        group_timeout=timedelta(seconds=20),
        joiner_timeout=timedelta(seconds=1),
        detect_timeout=timedelta(seconds=args.detect_timeout),
        standby_wait=timedelta(seconds=args.standby_wait),
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
    )
    out = Path(args.out)
    doomed = env.role == "worker" and env.rank in args.kill_rank and env.restart_count == 0
    joiner_dies = args.fault == "standby0-dies-after-joining" and env.node == "standby0"
    with session(
        model, optimizer, scheduler=scheduler, stateful={"sampler": sampler}, config=config, env=env
    ) as s:
        for step in s.steps(args.steps):
            with s.loading():
                idx = sampler.next_batch()
                noise = torch.from_numpy(numpy.random.normal(size=(len(idx), 16)).astype("float32"))
                xb = x[idx] if args.no_noise else x[idx] + 0.01 * noise * random.random()
                yb = y[idx]
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            loss.backward()  # type: ignore[no-untyped-call]
            if doomed and step == args.kill_step:
                os.kill(os.getpid(), signal.SIGKILL)  # mid-step: before the all-reduce
            if joiner_dies and s.role == "worker":
                os.kill(os.getpid(), signal.SIGKILL)  # inside its first step as a worker
            if not s.is_shadow:
                losses.append((s.rank, step, float(loss.item())))
            s.step()
            pause = args.held_sleep if args.hold and os.path.exists(args.hold) else args.sleep
            if pause:
                time.sleep(pause)
        (out / f"losses-{env.node}-{env.local_rank}.json").write_text(json.dumps(losses))
        if s.role == "worker" and not s.left:
            torch.save(
                {"params": model.state_dict(), "step": s.state.step, "rank": s.rank},
                out / f"final-rank{s.rank}.pt",
            )


# -- harness ---------------------------------------------------------------------------


def run_job(
    out: Path,
    *,
    nproc: int = 3,
    standby: int = 0,
    nproc_per_node: int = 1,
    steps: int = 60,
    extra: list[str] | None = None,
    job: str = "job",
    broker: str | None = None,
    max_restarts: int = 0,
    held: bool = False,
) -> Any:
    """Start the script as a job writing to ``out``. ``held``: its steps run slowly
    (``--held-sleep`` each) until ``release(out)``, so a test's sequence of commands
    is over before the job's last step however loaded the machine is; then at full
    speed (``--sleep 0`` unless ``extra`` says otherwise)."""
    from tmd.runtime.launch import LocalJob

    out.mkdir(parents=True, exist_ok=True)
    full_speed = ["--sleep", "0"] if held else []
    cmd = [sys.executable, SCRIPT, "--steps", str(steps), "--out", str(out), *full_speed,
           *(extra or [])]  # fmt: skip
    if held:
        (out / "hold").touch()
        cmd += ["--hold", str(out / "hold")]
    return LocalJob(
        cmd, nproc=nproc, standby=standby, nproc_per_node=nproc_per_node, job=job, broker=broker,
        max_restarts=max_restarts,
    )  # fmt: skip


def release(out: Path) -> None:
    """Let a job started with ``held`` run at full speed again."""
    (out / "hold").unlink(missing_ok=True)


def final_params(out: Path, rank: int = 0) -> dict[str, torch.Tensor]:
    result: dict[str, torch.Tensor] = torch.load(out / f"final-rank{rank}.pt")["params"]
    return result


def losses(
    out: Path, *, again: frozenset[tuple[int, int]] = frozenset()
) -> dict[tuple[int, int], float]:
    """Every (rank, step) loss the processes computed. ``again``: the (rank, step)s a
    live process on a lost machine computed before it left, which its replacement
    computes again (the same); any other (rank, step) computed twice fails."""
    merged: dict[tuple[int, int], float] = {}
    for path in out.glob("losses-*.json"):
        for rank, step, loss in json.loads(path.read_text()):
            if (rank, step) in merged:
                assert (rank, step) in again, f"two processes computed rank {rank} step {step}"
                assert merged[(rank, step)] == loss, f"rank {rank} step {step} differs"
            merged[(rank, step)] = loss
    return merged


def assert_same_as(
    out: Path, reference: Path, nproc: int, *, losses_from: int = 0,
    again: frozenset[tuple[int, int]] = frozenset(),
) -> None:  # fmt: skip
    """Final parameters of every rank equal the reference's, and so does every loss;
    ``losses_from``: losses before that step may be missing (a killed process never
    wrote them)."""
    for rank in range(nproc):
        got, want = final_params(out, rank), final_params(reference, rank)
        for name, tensor in want.items():
            assert torch.equal(got[name], tensor), f"rank {rank} {name} differs"
    have, expected = losses(out, again=again), losses(reference)
    assert {k: expected[k] for k in have} == have
    assert {k for k in expected if k[1] >= losses_from} <= set(have)
    if losses_from == 0:
        assert have == expected


if __name__ == "__main__":
    from tmd.runtime import run

    # Everything loaded so far (torch) lives until the process ends: frozen, the
    # collector leaves it alone, at exit too (a job's end was 1 to 2 s slower).
    gc.freeze()
    run(train, sys.argv[1:])
