"""CI: what a user who installs only ``tmd[runtime]`` gets, checked in a fresh venv.

Runs one live migration of a machine with ``tmd.runtime`` alone (none of the other
extras: no matplotlib, no pytest): two workers and a standby under ``LocalJob``,
driven by ``JobController``; exits non-zero unless every process switched and ended
cleanly and the two workers end with equal parameters.

    python .ci/runtime_only.py          # the harness
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path


def train(out: Path) -> None:
    import torch

    from tmd.runtime import SessionConfig, session

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(64, 8), torch.randn(64, 2)
    with session(model, optimizer, config=SessionConfig(shadow_steps=1)) as s:
        for step in s.steps(300):
            i = (step * 4 + s.rank * 2) % 64
            torch.nn.functional.mse_loss(model(x[i : i + 2]), y[i : i + 2]).backward()
            s.step()
        if s.role == "worker" and not s.left:
            torch.save(model.state_dict(), out / f"rank{s.rank}.pt")


def main() -> int:
    for other in ("matplotlib", "pytest", "pynvml"):  # the demo, sim, dev and agent extras
        if importlib.util.find_spec(other) is not None:
            print(
                f"runtime_only: {other} is installed here; run this in a venv with only "
                "tmd[runtime]"
            )
            return 2
    import torch

    from tmd.runtime import JobController
    from tmd.runtime.launch import LocalJob

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        job = LocalJob([sys.executable, __file__, "--train", tmp], nproc=2, standby=1)
        try:
            ctl = JobController(job.store, job="job")
            ctl.prepare("m1", leaver="worker1", joiner="standby0")
            ctl.wait_acks("m1", "prepared", count=3, timeout=timedelta(seconds=120))
            ctl.switch("m1")
            switched = ctl.wait_acks("m1", "switched", count=3, timeout=timedelta(seconds=120))
            codes = job.wait(timedelta(seconds=300))
        finally:
            job.terminate()
        a, b = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
        equal = all(torch.equal(a[k], b[k]) for k in a)
    print(f"runtime_only: switched by {sorted(x.node for x in switched)}, exit codes {codes}, "
          f"workers equal: {equal}")  # fmt: skip
    return 0 if equal and set(codes.values()) == {0} else 1


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--train":
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        train(Path(sys.argv[2]))
    else:
        sys.exit(main())
