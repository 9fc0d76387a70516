"""``tmd launch``: workers and standbys from one command line, ended cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from tests.integration.runtime_conftest_helpers import SCRIPT, final_params, losses
from tmd import wire
from tmd.runtime.control import STATUS_KEY
from tmd.runtime.launch import LocalJob, main

pytestmark = pytest.mark.slow


def test_launch_runs_the_job_and_idle_standbys_exit_when_it_stops(tmp_path: Path) -> None:
    rc = main(["--nproc", "2", "--standby", "1", "--job", "launched", SCRIPT,
               "--steps", "12", "--sleep", "0", "--out", str(tmp_path)])  # fmt: skip

    assert rc == 0
    assert torch_equal_all(final_params(tmp_path, 0), final_params(tmp_path, 1))
    assert {step for _, step in losses(tmp_path)} == set(range(12))
    assert (tmp_path / "losses-standby0-0.json").read_text() == "[]"  # shadow losses not kept


def test_launch_restarts_a_job_that_lost_a_rank_without_a_standby(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["--nproc", "2", "--max-restarts", "1", SCRIPT, "--steps", "8", "--sleep", "0",
               "--out", str(tmp_path), "--checkpoint-dir", str(tmp_path / "ckpt"),
               "--checkpoint-every", "2", "--standby-wait", "0",
               "--kill-rank", "1", "--kill-step", "5"])  # fmt: skip

    assert rc == 0
    assert "restart 1 after worker0 75, worker1 -9" in capsys.readouterr().err
    assert {step for _, step in losses(tmp_path)} == set(range(4, 8))  # resumed at 4
    assert torch_equal_all(final_params(tmp_path, 0), final_params(tmp_path, 1))


def torch_equal_all(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_launch_rejects_a_bad_world(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--nproc", "0", SCRIPT])
    assert "--nproc" in capsys.readouterr().err


def test_a_leaver_finishing_its_epilogue_is_not_killed_like_an_idle_standby(
    tmp_path: Path,
) -> None:
    # worker1 left the job (standby0 holds its rank) and is still busy after the job
    # stopped, as a leaver at nice 19 on a loaded host is; standby1 never joined. The
    # idle standby is killed at once past the grace; the leaver may finish.
    go = tmp_path / "go"
    script = (
        "import os, pathlib, time\n"
        "node = os.environ['TMD_NODE']\n"
        f"go = pathlib.Path({str(go)!r})\n"
        "while node != 'worker0' and not go.exists():\n"
        "    time.sleep(0.01)\n"
    )
    job = LocalJob([sys.executable, "-c", script], nproc=2, standby=2, job="leaving")
    try:
        status = wire.JobStatus(
            ts=time.time(), job="leaving", generation=1, world_size=2, state="stopped",
            members=[wire.Member(0, "worker0"), wire.Member(1, "standby0")],
        )  # fmt: skip
        job.store.set(STATUS_KEY, wire.encode(status).decode())

        def release_once_the_idle_standby_is_gone() -> None:
            job.procs["standby1"].wait()
            go.touch()

        releaser = threading.Thread(target=release_once_the_idle_standby_is_gone)
        releaser.start()
        codes = job.wait(timedelta(seconds=120), grace=timedelta(seconds=1))
        releaser.join()
    finally:
        job.terminate()

    assert codes == {"worker0": 0, "worker1": 0, "standby0": 0, "standby1": -signal.SIGKILL}


def test_tmd_store_serves_a_job_s_store_until_stopped() -> None:
    from torch._C._distributed_c10d import TCPStore

    proc = subprocess.Popen([sys.executable, "-m", "tmd.cli", "store", "--port", "0"],
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        port = int(line.rsplit(" ", 1)[1])
        client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
        client.set("tmd/status", "x")
        assert bytes(client.get("tmd/status")) == b"x"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        proc.kill()
