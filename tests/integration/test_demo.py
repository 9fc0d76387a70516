"""``tmd demo``, the README's main command, end to end: it exits 0, prints the summary
and writes a PNG. Run on the embedded broker, the path a machine without mosquitto takes
(the e2e tests cover mosquitto)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import need_tool

pytestmark = pytest.mark.slow


def test_demo_migrates_the_slow_machine_and_draws_the_timeline(tmp_path: Path) -> None:
    png = tmp_path / "timeline.png"
    done = subprocess.run(
        [sys.executable, "-m", "tmd.cli", "demo", "--png", str(png), "--embedded-broker",
         "--keep", str(tmp_path / "keep")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "broker EmbeddedBroker" in out
    assert "StragglerFound: worker1" in out
    assert "MigrationFinished: worker1 -> standby0, done" in out
    summary = out[out.index("SUMMARY") :]
    for line in ("detection latency", "downtime", "checkpoint-restart", "step gap", "ratio"):
        assert line in summary
    assert "1 malformed message counted and dropped" in summary
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --keep leaves a scrape config for the demo's daemon, with the rules beside it.
    port = re.search(r"daemon API http://127\.0\.0\.1:(\d+)", out)
    scrape = tmp_path / "keep" / "prometheus.yml"
    assert port is not None and f'"127.0.0.1:{port[1]}"' in scrape.read_text()
    promtool = need_tool("promtool", shutil.which("promtool"), install="apt-get install prometheus")
    checked = subprocess.run([promtool, "check", "config", str(scrape)], capture_output=True,
                             text=True, timeout=60)  # fmt: skip
    assert checked.returncode == 0 and "SUCCESS" in checked.stdout + checked.stderr, checked
