"""``tmd bench downtime``: what replacing one machine of a running job costs.

Runs a reference job (a GPT-style byte-level decoder of about 25M parameters,
AdamW, gloo on CPU, trained on the Python standard library's own sources) and
replaces one rank with each method, on the same job:

- ``live``: tmd's migration (shadow-warmed standby, group and state prepared in the
  background, lock-step gradient forwarding, switch at an agreed step);
- ``cold_standby``: a standby process that is up but neither shadow-warmed nor
  prepared: group, full state transfer and first step all happen at the switch;
- ``checkpoint_restart``: every rank saves and exits, a new job starts, loads and
  steps;
- ``failover``: a rank is SIGKILLed mid-step; the standby takes its place with the
  state of a data-parallel replica.

Downtime is measured from the step records every process writes, as a user would
time it: end of the last step's optimizer update before the replacement to end of
the first step after it (latest rank at both points), minus one median step; the
switch, transfer or restart runs inside that window (``tmd.tools.bench.measure``).
Ratios divide by the larger of the downtime and the step noise of the unmigrated
run, so a downtime lost in the noise cannot inflate them. Prints one JSON object.
The "machines" of a run share this host's cores: a leaver, which on a cluster has
its machine to itself, exits as soon as it has written its record, so that its
teardown does not slow the stayers' first steps after the switch.

Those runs use machines of one process. With ``--nproc-per-node K`` (K > 1) the
object also holds ``machine``: the same job on machines of K ranks (its own
reference run at that layout), where ``live`` moves a whole machine (``worker1``,
all K ranks) to a standby machine of K slots, ``checkpoint_restart`` restarts the
job, and ``failover`` SIGKILLs all K processes of ``worker1`` mid-step with one
standby machine ready. Its ``shortfalls`` say which targets missed
(``measure.machine_shortfalls``) and ``holds_target`` whether none did. With K = 1,
``machine`` is null; with ``--machine-only`` the runs on machines of one process are
skipped and their fields left out.

The same module is the benchmark's training script (``python -m
tmd.tools.bench.downtime worker ...``), so the job trained is exactly the one measured.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec

from tmd.tools.bench import Progress, measure

JOB = "bench"
LAYOUTS = ("fsdp", "hsdp", "tp", "ddp")
"""``--parallel``: the job wrapped by torch's parallelism (``tmd.runtime.parallel``):
``fully_shard`` on a 1-D mesh; HSDP (replicate across machines, shard within); the
MLPs tensor-parallel within a machine, ``fully_shard`` across machines;
``DistributedDataParallel`` (``init_sync=False``) on the default world."""

# -- the training script ---------------------------------------------------------------


def _text_tokens(limit: int = 4 << 20) -> Any:
    import torch

    root = Path(os.__file__).parent
    chunks: list[bytes] = []
    size = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        size += len(data)
        if size >= limit:
            break
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8).long()


def _gpt(d: int, layers: int, heads: int, ctx: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, heads, d // heads).unbind(2)
            y = nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
            out: torch.Tensor = x + self.mlp(self.ln2(x))
            return out

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(ctx, d)
            self.blocks = nn.Sequential(*[Block() for _ in range(layers)])
            self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
            logits: torch.Tensor = self.head(self.ln(self.blocks(x)))
            return logits

    return GPT()


def _digest(model: Any) -> str:
    """sha256 of every parameter and buffer's bytes, in state-dict order."""
    import ctypes
    import hashlib

    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().cpu().contiguous()
        h.update(name.encode())
        h.update(ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size()))
    return h.hexdigest()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _worker_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tmd.tools.bench.downtime worker")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", default="plain", choices=["plain", "cold", "save", "resume"])
    parser.add_argument("--at-step", type=int, default=0, help="save at / kill at this step")
    parser.add_argument("--kill-rank", type=int, action="append", default=[],
                        help="kill these ranks (a machine: each of its ranks)")  # fmt: skip
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=64)
    # `tmd demo`: one machine made slow, and a stop step the controller sets later.
    parser.add_argument(
        "--slow-node", default="",
        help="the machine (TMD_NODE) whose ranks' compute is slowed, or one of its ranks "
        "(NODE/LOCAL_RANK: one slow GPU)",
    )  # fmt: skip
    parser.add_argument("--slow-s", type=float, default=0.0, help="seconds added to each step")
    parser.add_argument("--slow-from", type=int, default=0, help="from this step on")
    parser.add_argument("--stop-key", default="", help="store key holding the last step")
    parser.add_argument("--start-key", default="",
                        help="store key every rank waits for before its first step")  # fmt: skip
    # `tmd bench faults`: paced steps (sleeping changes no number) and a digest of the
    # final parameters to compare runs by.
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds slept after each step")
    parser.add_argument("--hash-params", action="store_true", help="record a parameter digest")
    parser.add_argument(
        "--hash-every-step", action="store_true", help="and after every step (a reference run)"
    )
    parser.add_argument("--parallel", default="", choices=["", *LAYOUTS],
                        help="wrap the model for this layout (tmd.runtime.parallel)")  # fmt: skip
    return parser.parse_args(argv)


def _wrap(model: Any, layout: str, world: int, per_node: int) -> tuple[Any, int, int]:
    """Wrap the GPT for ``layout``; the model to train, this rank's data-parallel rank
    and size (the ranks of a tensor-parallel group take the same batch)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if layout == "ddp":  # every rank built the same weights: no collective to start
        ddp = torch.nn.parallel.DistributedDataParallel(model, init_sync=False)
        return ddp, dist.get_rank(), world
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (world // per_node, per_node),
                                mesh_dim_names=("replicate", "shard"))  # fmt: skip
    else:
        tp = init_device_mesh("cpu", (world // per_node, per_node), mesh_dim_names=("dp", "tp"))
        plan = {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
        for block in model.blocks:
            # Every rank built the same weights: each takes its shard, no scatter.
            parallelize_module(block, tp["tp"], plan, src_data_rank=None)
        mesh = tp["dp"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if layout == "tp":
        return model, tp["dp"].get_local_rank(), world // per_node
    return model, mesh.get_rank(), world


def worker(argv: list[str]) -> int:
    t_start = time.time()
    args = _worker_args(argv)

    import torch

    from tmd.runtime import ResumableSampler, SessionConfig, parallel, session
    from tmd.runtime.checkpoint_io import load_checkpoint, save_checkpoint
    from tmd.runtime.env import RuntimeEnv

    t_imported = time.time()
    torch.set_num_threads(1)
    env = RuntimeEnv.from_environ()
    cold = args.mode == "cold"
    config = SessionConfig(shadow_steps=0 if cold else 2, prepare_ahead=not cold)
    tokens = _text_tokens()
    torch.manual_seed(0)
    model = _gpt(args.d, args.layers, 8, args.ctx)
    if args.parallel:
        # A standby, having loaded and built what needs no rank (the data, the model
        # unwrapped), waits here until a migration or a failover names the rank it
        # takes; only the wrapping waits for it.
        parallel.init(config=config, env=env)
    t_placed = time.time()
    dp_rank, dp_size = env.rank, env.world_size
    if args.parallel:
        model, dp_rank, dp_size = _wrap(model, args.parallel, env.world_size,
                                        env.local_world_size)  # fmt: skip
    t_wrapped = time.time()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    torch.manual_seed(1 + env.rank)
    window = args.ctx + 1
    windows = len(tokens) // window
    sampler = ResumableSampler(windows, batch_size=args.batch, rank=dp_rank,
                               world_size=dp_size)  # fmt: skip
    t_built = time.time()
    record: dict[str, Any] = {"node": env.node, "local_rank": env.local_rank,
                              "role": env.role, "t_start": t_start,
                              "t_imported": t_imported, "t_placed": t_placed,
                              "t_wrapped": t_wrapped, "t_built": t_built,
                              "steps": []}  # fmt: skip
    with session(model, optimizer, stateful={"sampler": sampler}, config=config, env=env) as s:
        record["t_entered"] = time.time()
        if args.mode == "resume":
            load_checkpoint(s, args.out.parent / "checkpoint")
            record["t_loaded"] = time.time()
        if args.start_key and s.role == "worker":
            # Until the bench saw its standby ready: under load a job of a few short
            # steps could otherwise end before the standby it is to move to is up.
            s.store.wait([args.start_key], timedelta(minutes=10))
        for step in s.steps(args.steps):
            idx = torch.tensor(sampler.next_batch())
            batch = tokens[(idx * window).unsqueeze(1) + torch.arange(window)]
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, 256), batch[:, 1:].reshape(-1)
            )
            doomed = env.role == "worker" and env.rank in args.kill_rank and step == args.at_step
            if doomed and args.parallel:
                # Mid-step for a wrapped job, before its backward: its gradients are
                # reduced inside backward, where the survivors' collectives now fail.
                _die(args.out, env.rank)
            loss.backward()  # type: ignore[no-untyped-call]
            slowed = args.slow_node in (env.node, env.slot)
            if slowed and s.role == "worker" and step >= args.slow_from:
                time.sleep(args.slow_s)  # an injected straggler: a slow GPU, throttled clocks
            if doomed:
                _die(args.out, env.rank)  # mid-step: gradients computed, not yet reduced
            shadow = s.is_shadow
            applied = s.step()
            if shadow or not applied:  # not applied: a failover undid it, it runs again
                continue
            t = s.last_timing
            assert t is not None
            # The end of this step's update, before the boundary that follows it (where
            # a switch runs): a switch lands inside the next step's window, as a user
            # timing the job would see it.
            record["steps"].append([s.rank, step, float(loss.item()), t.end_ts, t.step_s,
                                    _rss_bytes(), t.compute_s, t.allreduce_s,
                                    t.optimizer_s])  # fmt: skip
            if args.hash_every_step:
                record.setdefault("digests", {})[str(s.state.step)] = _digest(model)
            if s.rank == 0:
                s.store.set("bench/step", str(s.state.step))
            # Every rank reads the key each step, long before the step it names.
            if (
                args.stop_key
                and s.store.check([args.stop_key])
                and (s.state.step >= int(s.store.get(args.stop_key)))
            ):
                break
            if args.sleep:
                time.sleep(args.sleep)
            if args.mode == "save" and s.state.step == args.at_step:
                t0 = time.time()
                save_checkpoint(s, args.out.parent / "checkpoint")
                record["save"] = [t0, time.time()]
                break
        record["left"] = s.left
        record["warmup_s"] = s.warmup_s
        if args.hash_params and s.role == "worker" and not s.left:
            record["params_sha256"] = _digest(model)
            record["final_rank"], record["final_step"] = s.rank, s.state.step
        if s.last_downtime is not None:
            record["downtime"] = msgspec.structs.asdict(s.last_downtime)
    record["t_exit"] = time.time()
    # A machine's K processes share a node name; the local rank tells them apart.
    (args.out / f"{env.node}-{env.local_rank}.json").write_text(json.dumps(record))
    if record.get("left"):
        # On a cluster the leaver is on its own machine; here every machine shares
        # the host's cores, and its interpreter's teardown (seconds of CPU for a
        # sharded model) would be charged to the stayers' first steps. Done: go.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _die(out: Path, rank: int) -> None:
    (out / f"killed-{rank}.json").write_text(json.dumps({"t_kill": time.time()}))
    os.kill(os.getpid(), 9)


# -- orchestration ---------------------------------------------------------------------


def _job(
    out: Path, args: argparse.Namespace, *, per_node: int, standby: int, mode: str,
    extra: list[str],
) -> Any:  # fmt: skip
    """The job on machines of ``per_node`` ranks, with ``standby`` standby machines."""
    from tmd.runtime.launch import LocalJob

    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "tmd.tools.bench.downtime", "worker", "--steps", str(args.steps),
           "--out", str(out), "--mode", mode, "--layers", str(args.layers), *extra]  # fmt: skip
    if args.layout:
        cmd += ["--parallel", args.layout]
    return LocalJob(cmd, nproc=args.nproc, standby=standby, nproc_per_node=per_node, job=JOB)


def _process(node: str, local_rank: int | None, per_node: int) -> str:
    from tmd.runtime.launch import process_name

    return process_name(node, local_rank, per_node)


def _leaver_ranks(per_node: int) -> set[int]:
    """The ranks of ``worker1``, the machine every run replaces."""
    return set(range(per_node, 2 * per_node))


def _wait_step(job: Any, step: int, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if job.store.check(["bench/step"]) and int(job.store.get("bench/step")) >= step:
            return
        time.sleep(0.05)
    raise TimeoutError(f"job did not reach step {step}")


def _migration(
    out: Path,
    args: argparse.Namespace,
    reference_rows: dict[tuple[int, int], list[Any]],
    *,
    cold: bool,
    per_node: int = 1,
    held: bool = False,
) -> dict[str, Any]:
    """``worker1`` (all its ranks) moved to ``standby0``, a standby machine as large.
    ``held``: the job runs on until ``STOP_KEY`` says where to stop, set once it
    switched (a wrapped job's standby builds its model only once it knows its rank:
    the switch can come after ``--steps``)."""
    from tmd.runtime import JobController

    mid = "m-cold" if cold else "m-live"
    # A held job cannot end before its standby is up; one of --steps steps could.
    extra = ["--steps", "1000000", "--stop-key", STOP_KEY] if held else ["--start-key", START_KEY]
    job = _job(out, args, per_node=per_node, standby=1, mode="cold" if cold else "plain",
               extra=extra)  # fmt: skip
    try:
        ctl = JobController(job.store, job=JOB)
        if not held:
            ctl.wait_standbys("standby0", timeout=timedelta(minutes=10))
            job.store.set(START_KEY, "1")
        _wait_step(job, args.prepare_at)
        t_prepare = time.time()
        ctl.prepare(mid, leaver="worker1", joiner="standby0")
        # A cold joiner has nothing prepared before the switch; each process answers.
        ctl.wait_acks(mid, "prepared", count=args.nproc + (0 if cold else per_node))
        # Held prepared for a while, as a daemon waiting for its rebalancing tick.
        _wait_step(job, args.switch_at)
        t_switch = time.time()
        ctl.switch(mid)  # at the first boundary every member agrees on
        acks = ctl.wait_acks(mid, "switched", count=args.nproc + per_node)
        at = next(a for a in acks if a.node == "worker1").at_step  # steps before the switch
        assert at is not None
        if held:
            # Past the step any rank may be at (they are within one step of each
            # other), so all of them stop at the same step.
            now = int(job.store.get("bench/step"))
            job.store.set(STOP_KEY, str(max(args.steps, at + AFTER_SWITCH, now + 2)))
        job.wait()
    finally:
        job.terminate()
    rows = measure.step_rows(measure.records(out))
    median = measure.median_step(rows, 2, args.prepare_at)
    measured = {_process(a.node, a.local_rank, per_node): msgspec.structs.asdict(a.downtime)
                for a in acks if a.downtime}  # fmt: skip
    result: dict[str, Any] = {
        "downtime_s": measure.downtime(rows, rows, at, median),
        "median_step_s": median,
        "switched_after_step": at,
        # The runtime's own measurement, each member from its own last step end; the
        # worst member's parts, which add up to its total.
        "breakdown": measure.parts_of(measured),
        "runtime_downtime_s": max((d["total_s"] for d in measured.values()), default=None),
    }
    # Stayers' steps while prepared (phase 1) and while the joiner is fed in
    # lock-step (switch requested, not yet done), each against the same steps of
    # the unmigrated reference run, relative to the steps before the prepare.
    leaving = _leaver_ranks(per_node)
    stayers = [r for r in rows if r[0] not in leaving and r[1] < at]
    before = [r for r in stayers if r[3] < t_prepare and r[1] >= 2]
    windows = {
        "prepare_slowdown": [r for r in stayers if t_prepare < r[3] <= t_switch],
        "lockstep_slowdown": [r for r in stayers if r[3] > t_switch],
    }
    for name, during in windows.items():
        if before and during:
            result[name] = measure.slowdown(before, during, reference_rows)
            result[name.replace("slowdown", "steps")] = sorted({r[1] for r in during})
    after = [r for r in rows if r[0] not in leaving and r[3] > t_prepare]
    result["stayer_rss_overhead"] = measure.rss_growth(before, after)
    # The same ranks over the same steps of the unmigrated run: memory a job takes on
    # as it trains (allocator, caches), which no migration caused.
    keys = ({(r[0], r[1]) for r in before}, {(r[0], r[1]) for r in after})
    if all(k <= set(reference_rows) for k in keys):
        grown = measure.rss_growth(*([reference_rows[k] for k in ks] for ks in keys))
        result["reference_rss_growth"] = grown
        result["stayer_rss_overhead_net"] = result["stayer_rss_overhead"] - grown
    return result


def _checkpoint_restart(
    out: Path, args: argparse.Namespace, *, per_node: int = 1
) -> dict[str, Any]:
    at = args.switch_at
    first = _job(out / "before", args, per_node=per_node, standby=0, mode="save",
                 extra=["--at-step", str(at)])  # fmt: skip
    try:
        first.wait()
        t_all_exited = time.time()
        second = _job(out / "after", args, per_node=per_node, standby=0, mode="resume", extra=[])
        second.wait()
    finally:
        first.terminate()
    before, after = measure.records(out / "before"), measure.records(out / "after")
    rows_before, rows_after = measure.step_rows(before), measure.step_rows(after)
    median = measure.median_step(rows_before, 2, at)
    return {
        "loss": {(r[0], r[1]): r[2] for r in rows_before + rows_after},
        "downtime_s": measure.downtime(rows_before, rows_after, at, median),
        "median_step_s": median,
        "breakdown": measure.restart_parts(before, after, at, median, exited=t_all_exited),
    }


def _failover(out: Path, args: argparse.Namespace, *, per_node: int = 1) -> dict[str, Any]:
    """Every process of ``worker1`` SIGKILLed mid-step, one standby machine ready."""
    at = args.switch_at
    kill = [a for rank in sorted(_leaver_ranks(per_node)) for a in ("--kill-rank", str(rank))]
    job = _job(out, args, per_node=per_node, standby=1, mode="plain",
               extra=["--at-step", str(at), *kill])  # fmt: skip
    try:
        codes = job.wait()
    finally:
        job.terminate()
    records = measure.records(out)
    rows = measure.step_rows(records)
    median = measure.median_step(rows, 2, at)
    done = [r for r in rows if r[1] == at]
    measured = {_process(r["node"], r["local_rank"], per_node): r["downtime"]
                for r in records if "downtime" in r}  # fmt: skip
    return {
        # The survivors' steps; the killed ranks' died with them.
        "downtime_s": measure.downtime(rows, rows, at, median),
        "kill_to_step_end_s": max(r[3] for r in done) - measure.killed_at(out),
        "median_step_s": median,
        "breakdown": measure.parts_of(measured),
        "runtime_downtime_s": max((d["total_s"] for d in measured.values()), default=None),
        "ranks_completing_step": sorted(r[0] for r in done),
        "exit_codes": codes,
        "loss": {(r[0], r[1]): r[2] for r in rows},
    }


def _reference(
    out: Path, args: argparse.Namespace, *, per_node: int = 1
) -> dict[tuple[int, int], list[Any]]:
    job = _job(out, args, per_node=per_node, standby=0, mode="plain", extra=[])
    try:
        job.wait()
    finally:
        job.terminate()
    return {(r[0], r[1]): r for r in measure.step_rows(measure.records(out))}


def _one_process_machines(
    out: Path, args: argparse.Namespace, progress: Progress
) -> dict[str, Any]:
    """Every method on machines of one process, against a reference run."""
    progress.say(f"reference run: {args.nproc} ranks, {args.steps} steps")
    reference = _reference(out / "reference", args)
    progress.say("live migration")
    live = _migration(out / "live", args, reference, cold=False)
    progress.say("cold standby")
    cold = _migration(out / "cold", args, reference, cold=True)
    progress.say("checkpoint-restart")
    restart = _checkpoint_restart(out / "restart", args)
    progress.say("failover (a rank killed mid-step)")
    failover = _failover(out / "failover", args)
    failover_losses = failover.pop("loss")
    noise = measure.step_noise(list(reference.values()))
    for method in (live, cold, failover):
        method["ratio_checkpoint_restart_vs_noise"] = measure.ratio(
            restart["downtime_s"], measure.worst(method), noise
        )
    return {
        "live": live,
        "cold_standby": cold,
        "checkpoint_restart": restart,
        "median_step_s": live["median_step_s"],
        # How far an ordinary step of the unmigrated run strays (p90): a downtime
        # below it is not measurable.
        "step_noise_s": noise,
        # The headline: checkpoint-restart's downtime over the larger of the live
        # downtime (the worse of the step records' and the runtime's) and the
        # noise, so a live downtime lost in the noise cannot inflate it.
        "ratio_checkpoint_restart_vs_noise": live["ratio_checkpoint_restart_vs_noise"],
        # The plain ratio only where the live downtime is above the noise.
        "ratio_checkpoint_restart": measure.above_noise(
            restart["downtime_s"], measure.worst(live), noise
        ),
        "ratio_cold_standby_vs_noise": measure.ratio(
            measure.worst(cold), measure.worst(live), noise
        ),
        "loss_match": measure.loss_match(measure.losses(out / "live"), reference),
        "loss_match_cold_standby": measure.loss_match(measure.losses(out / "cold"), reference),
        "loss_match_checkpoint_restart": measure.loss_match(restart.pop("loss"), reference),
        # the killed rank's losses before the kill died with it
        "loss_match_failover": measure.loss_match(failover_losses, reference, complete=False),
        "failover": failover,
        "stayer_rss_overhead": live.get("stayer_rss_overhead"),
        "stayer_rss_overhead_net": live.get("stayer_rss_overhead_net"),
        "telemetry_overhead": _telemetry_overhead(live["median_step_s"]),
        "prepare_slowdown": live.get("prepare_slowdown"),
        "lockstep_slowdown": live.get("lockstep_slowdown"),
    }


def _machine(out: Path, args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    """The job on machines of ``--nproc-per-node`` ranks: every rank of ``worker1``
    moved live, the job checkpoint-restarted, and ``worker1`` lost whole, each measured
    as on machines of one process, against a reference run at the same layout."""
    k = args.nproc_per_node
    progress.say(f"machines of {k} ranks: reference run")
    reference = _reference(out / "reference", args, per_node=k)
    progress.say(f"machines of {k} ranks: live migration of worker1")
    live = _migration(out / "live", args, reference, cold=False, per_node=k)
    progress.say(f"machines of {k} ranks: checkpoint-restart")
    restart = _checkpoint_restart(out / "restart", args, per_node=k)
    progress.say(f"machines of {k} ranks: failover (worker1's {k} processes killed mid-step)")
    failover = _failover(out / "failover", args, per_node=k)
    noise = measure.step_noise(list(reference.values()))
    failover_losses = failover.pop("loss")
    failover["ratio_checkpoint_restart_vs_noise"] = measure.ratio(
        restart["downtime_s"], measure.worst(failover), noise
    )
    result: dict[str, Any] = {
        "leaver": "worker1",
        "joiner": "standby0",
        **_live_fields(live, restart, noise, k),
        "failover_downtime_s": failover["downtime_s"],
        "loss_match": measure.loss_match(measure.losses(out / "live"), reference),
        "loss_match_checkpoint_restart": measure.loss_match(restart.pop("loss"), reference),
        "loss_match_failover": measure.loss_match(failover_losses, reference, complete=False),
        "checkpoint_restart": restart,
        "failover": failover,
    }
    result["shortfalls"] = measure.machine_shortfalls(result)
    result["holds_target"] = not result["shortfalls"]
    return result


def _live_fields(
    live: dict[str, Any], restart: dict[str, Any], noise: float | None, per_node: int
) -> dict[str, Any]:
    """A machine's live migration, as ``_machine`` and ``_layout`` report it."""
    return {
        "nproc_per_node": per_node,
        **{
            key: live[key]
            for key in (
                "downtime_s",
                "runtime_downtime_s",
                "median_step_s",
                "switched_after_step",
                "breakdown",
            )
        },
        "step_noise_s": noise,
        "ratio_checkpoint_restart_vs_noise": measure.ratio(
            restart["downtime_s"], measure.worst(live), noise
        ),
        "stayer_rss_overhead": live["stayer_rss_overhead"],
        **{
            key: live.get(key)
            for key in ("stayer_rss_overhead_net", "prepare_slowdown", "lockstep_slowdown")
        },
    }


def _layout(out: Path, args: argparse.Namespace, progress: Progress) -> dict[str, Any]:
    """The job wrapped for ``args.layout`` on machines of ``--nproc-per-node`` ranks:
    ``worker1`` moved live, the job checkpoint-restarted (its checkpoint sharded,
    written and read by every rank) and, where its state has replicas (HSDP, DDP),
    ``worker1`` lost whole after its forward (the survivors' collectives then fail
    inside their backward), each against a reference run of the same
    layout. FSDP2 on one dimension and tensor parallelism hold no replica of a lost
    machine's shards: a loss rolls the job back, as checkpoint-restart measures."""
    k, layout = args.nproc_per_node, args.layout
    progress.say(f"{layout}: reference run, machines of {k} ranks")
    # Long enough for the live run, which stops AFTER_SWITCH steps past its switch.
    longer = argparse.Namespace(**{**vars(args), "steps": args.steps + SPARE_STEPS})
    reference = _reference(out / "reference", longer, per_node=k)
    progress.say(f"{layout}: live migration of worker1")
    live = _migration(out / "live", args, reference, cold=False, per_node=k, held=True)
    live_losses = measure.losses(out / "live")
    last = max(step for _, step in live_losses)
    reference_to_last = {key: row for key, row in reference.items() if key[1] <= last}
    reference_to_steps = {key: row for key, row in reference.items() if key[1] < args.steps}
    progress.say(f"{layout}: checkpoint-restart")
    restart = _checkpoint_restart(out / "restart", args, per_node=k)
    noise = measure.step_noise(list(reference.values()))
    failover: dict[str, Any] = {"replica": False, "reason": NO_REPLICA}
    failover_fields: dict[str, Any] = {"failover_downtime_s": None}
    if layout in REPLICATED:
        progress.say(f"{layout}: failover (worker1's {k} processes killed before backward)")
        failover = _failover(out / "failover", args, per_node=k)
        failover["ratio_checkpoint_restart_vs_noise"] = measure.ratio(
            restart["downtime_s"], measure.worst(failover), noise
        )
        failover_fields = {
            "failover_downtime_s": failover["downtime_s"],
            "loss_match_failover": measure.loss_match(
                failover.pop("loss"), reference_to_steps, complete=False
            ),
        }
    result: dict[str, Any] = {
        **_live_fields(live, restart, noise, k),
        **failover_fields,
        "failover": failover,
        "loss_match": measure.loss_match(live_losses, reference_to_last),
        "loss_match_checkpoint_restart": measure.loss_match(
            restart.pop("loss"), reference_to_steps
        ),
        "live_steps": last + 1,
        "checkpoint_restart": restart,
    }
    result["shortfalls"] = measure.machine_shortfalls(result)
    result["holds_target"] = not result["shortfalls"]
    return result


STOP_KEY = "bench/stop"
START_KEY = "bench/start"
"""Set once the standby machine is ready; the ranks of a migration run wait for it."""
AFTER_SWITCH = 4
"""A held live run stops this many steps past its switch, or at ``--steps``."""
SPARE_STEPS = 40
"""A held live run's reference runs this many steps past ``--steps``; a switch later
than that shows as ``loss_match`` false."""

REPLICATED = ("hsdp", "ddp")
"""The layouts in which a lost machine's state has a replica (in-place failover)."""
NO_REPLICA = (
    "no survivor holds a lost machine's shards (FSDP2 on one mesh dimension, tensor "
    "parallelism): the job rolls back to its sharded checkpoint (checkpoint_restart)"
)


def _telemetry_overhead(median_step_s: float, steps: int = 20_000) -> dict[str, float]:
    """What telemetry costs a step: one ``record`` on the training thread, plus the
    sender thread's encoding of its share of a batch (it competes for the CPU)."""
    from tmd import wire
    from tmd.runtime.telemetry import Telemetry

    sink_bytes = [0]

    def sink(topic: str, payload: bytes) -> None:
        sink_bytes[0] += len(payload)

    telemetry = Telemetry(sink, job=JOB, node="bench", rank=0, flush_interval=timedelta(hours=1),
                          max_queue=steps)  # fmt: skip
    start = time.perf_counter()
    for step in range(steps):
        telemetry.record(wire.StepTiming(step, time.time(), 1.0, 0.6, 0.2, 0.1, 0.1))
    recorded = time.perf_counter()
    telemetry.close()  # one flush: encodes every recorded step
    flushed = time.perf_counter()
    per_step = (flushed - start) / steps
    return {
        "record_us": (recorded - start) / steps * 1e6,
        "record_and_send_us": per_step * 1e6,
        "fraction_of_step": per_step / median_step_s,
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["worker"]:
        return worker(argv[1:])
    parser = argparse.ArgumentParser(prog="tmd bench downtime", description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prepare-at", type=int, default=6, help="prepare when at this step")
    parser.add_argument("--switch-at", type=int, default=10,
                        help="request the switch at this step; also where the checkpoint-"
                        "restart saves and the failover kills")  # fmt: skip
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--nproc-per-node", type=int, default=None,
                        help="also measure on machines of this many ranks ('machine'); "
                        "--nproc must be a multiple, of at least two machines")  # fmt: skip
    parser.add_argument("--machine-only", action="store_true",
                        help="only the runs on machines of --nproc-per-node ranks: 'machine', "
                        "without the fields of machines of one process")  # fmt: skip
    parser.add_argument("--parallel", default="",
                        help="comma-separated layouts of torch's parallelism to measure "
                        f"instead ({', '.join(LAYOUTS)}; machines of --nproc-per-node "
                        "ranks, 2 unless given): 'parallel', by layout")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs' records here")
    args = parser.parse_args(argv)
    layouts = [name for name in args.parallel.split(",") if name]
    if set(layouts) - set(LAYOUTS):
        parser.error(f"--parallel takes {', '.join(LAYOUTS)}, not {args.parallel}")
    if args.nproc_per_node is None:
        args.nproc_per_node = 2 if layouts else 1
    args.layout = ""
    k = args.nproc_per_node
    if k < 1 or args.nproc % k or args.nproc // k < 2:
        parser.error("--nproc must be a multiple of --nproc-per-node, of at least two machines")
    if args.machine_only and k == 1:
        parser.error("--machine-only needs --nproc-per-node above 1")
    if layouts and (args.machine_only or k < 2):
        parser.error("--parallel runs on machines of 2 or more ranks, without --machine-only")
    load = measure.Load()
    with tempfile.TemporaryDirectory(prefix="tmd-bench-") as tmp:
        out = args.out or Path(tmp)
        progress = Progress()
        result: dict[str, Any] = {"nproc": args.nproc, "nproc_per_node": k, "steps": args.steps}
        if layouts:
            result["parallel"] = {
                name: _layout(
                    out / name, argparse.Namespace(**{**vars(args), "layout": name}), progress
                )
                for name in layouts
            }
        elif not args.machine_only:
            result.update(_one_process_machines(out, args, progress))
        if not layouts:
            result["machine"] = _machine(out / "machine", args, progress) if k > 1 else None
        progress.say("done")
    result["host_load"] = load.as_dict()
    print(json.dumps(result, indent=None))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
