"""Models wrapped by torch's own FSDP2 keep training when the groups beneath them are
swapped (``tmd.runtime.swap_group``): a standby takes a rank's place mid-run with
that rank's shards of the parameters and optimizer state, copied one to one from the
leaver (FSDP2, a live migration) or from its replica in the other replica group
(HSDP, a failover), and every rank ends where an unsharded copy trained on the whole
batch ends. Real processes, gloo, a real TCPStore (issue 15's mechanism; the session
does not drive it yet)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("swap_worker.py")
WORLD = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("mode", ["fsdp", "hsdp"])
def test_a_standby_takes_a_rank_s_shards_and_the_job_ends_where_it_would_have(
    mode: str,
) -> None:
    port = free_port()
    files = [(tempfile.TemporaryFile(), tempfile.TemporaryFile())  # noqa: SIM115 (closed below)
             for _ in range(WORLD + 1)]  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), str(i), str(WORLD), mode, str(port)],
                         stdout=out, stderr=err)
        for i, (out, err) in enumerate(files)
    ]  # fmt: skip
    results = []
    try:
        for p, (out, err) in zip(procs, files, strict=True):
            p.wait(timeout=240)
            err.seek(0)
            assert p.returncode == 0, err.read()[-3000:].decode(errors="replace")
            out.seek(0)
            results.append(json.loads(out.read().decode().strip().splitlines()[-1]))
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for out, err in files:
            out.close()
            err.close()
    left = [r for r in results if r.get("left")]
    assert [r["process"] for r in left] == [WORLD - 1]
    trained = [r for r in results if not r.get("left")]
    # Ranks 0..2 stayed; the standby (process 4) trained on as rank 3.
    assert sorted((r["process"], r["rank"]) for r in trained) == [(0, 0), (1, 1), (2, 2), (4, 3)]
    for r in trained:
        assert r["max_diff"] < 1e-5, r  # float reassociation only
    # Each process's groups: the world, and on a 2-D mesh its row (a replica group's
    # shards) and its column (one shard's replicas); the standby's are rank 3's.
    for r in trained:
        rank = r["rank"]
        expected = [[0, 1, 2, 3]]
        if mode == "hsdp":
            row, col = [rank // 2 * 2, rank // 2 * 2 + 1], [rank % 2, rank % 2 + 2]
            expected = sorted([[0, 1, 2, 3], row, col])
        assert r["groups"] == expected, r
