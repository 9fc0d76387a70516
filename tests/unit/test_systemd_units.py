"""The shipped systemd units: they load cleanly, keep the contract the daemon relies on
(Type=notify, watchdog, restart, state directory) and stay tightly sandboxed."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import need_tool

UNITS = Path(__file__).resolve().parents[2] / "systemd"
HEAD = "tmd.service"
AGENT = "tmd-agent.service"
# systemd-analyze security's 0-10 scale; lower is better. The head node has no
# hardware and no reason to be anything but locked down.
HEAD_MAX_EXPOSURE = 2.0
# The agent must see /dev/nvidia* and /proc/driver/nvidia; measured 1.5.
AGENT_MAX_EXPOSURE = 2.5

_EXPOSURE = re.compile(r"Overall exposure level for (\S+): (\d+(?:\.\d+)?)")


def _directives(name: str) -> dict[str, list[str]]:
    """Key -> values of every assignment in the unit, sections flattened."""
    found: dict[str, list[str]] = {}
    for line in (UNITS / name).read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";", "[")):
            continue
        key, _, value = line.partition("=")
        found.setdefault(key.strip(), []).append(value.strip())
    return found


def _installable_copy(name: str, tmp_path: Path) -> Path:
    """The unit with only ExecStart's binary swapped for one that exists here.

    verify rejects a missing binary, and /usr/local/bin/tmd is not installed in the
    test environment; every other line, the hardening included, is checked as shipped.
    """
    original = (UNITS / name).read_text()
    rewritten, count = re.subn(
        r"^ExecStart=/usr/local/bin/tmd ", f"ExecStart={sys.executable} ", original, flags=re.M
    )
    assert count == 1, f"{name}: expected exactly one ExecStart=/usr/local/bin/tmd line"
    copy = tmp_path / name
    copy.write_text(rewritten)
    return copy


@pytest.fixture
def analyze() -> str:
    """systemd-analyze's path: skipped without it, failed under CI (tests/conftest.py)."""
    found = shutil.which("systemd-analyze")
    return need_tool("systemd-analyze", found, install="apt-get install -y systemd")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30, check=False)


def _exposure(analyze: str, name: str, tmp_path: Path) -> float:
    copy = _installable_copy(name, tmp_path)
    # --threshold=100 so the exit status only reports failures to analyse.
    result = _run(analyze, "security", "--offline=true", "--threshold=100", str(copy))
    assert result.returncode == 0, result.stdout + result.stderr
    match = _EXPOSURE.search(result.stdout)
    assert match is not None, result.stdout + result.stderr
    assert match.group(1) == name
    print(match.group(0))
    return float(match.group(2))


def test_head_unit_keeps_the_daemon_contract() -> None:
    unit = _directives(HEAD)
    assert unit["Type"] == ["notify"]
    assert unit["NotifyAccess"] == ["main"]
    assert unit["WatchdogSec"] == ["30"]
    assert unit["Restart"] == ["on-failure"]
    assert unit["ExecStart"] == ["/usr/local/bin/tmd run --config /etc/tmd/tmd.toml"]
    assert unit["DynamicUser"] == ["yes"]
    assert unit["StateDirectory"] == ["tmd"]
    assert unit["ConfigurationDirectory"] == ["tmd"]
    assert unit["PrivateDevices"] == ["yes"]
    assert unit["MemoryDenyWriteExecute"] == ["yes"]
    assert unit["CapabilityBoundingSet"] == [""]
    assert "network-online.target" in " ".join(unit["Wants"])
    assert "IPAddressDeny" not in unit, "the broker and API clients may be anywhere"
    # Every secret tmd reads from $CREDENTIALS_DIRECTORY is passed from the credstore
    # (a relative path: searched there, skipped when absent), and memory is capped.
    from tmd.config import CREDENTIALS

    passed = {v.split(":")[0]: v.split(":")[1] for v in unit["LoadCredential"]}
    assert passed == {name: f"tmd.{name}" for *_, name in CREDENTIALS}
    assert unit["MemoryMax"]


def test_agent_unit_reaches_the_gpus_and_nothing_else() -> None:
    unit = _directives(AGENT)
    assert unit["Type"] == ["notify"]
    assert "WatchdogSec" in unit
    assert unit["Restart"] == ["always"]
    assert unit["ExecStart"] == ["/usr/local/bin/tmd agent --config /etc/tmd/agent.toml"]
    assert unit.get("PrivateDevices", ["no"]) == ["no"]
    assert unit["DevicePolicy"] == ["closed"]
    allowed = {value.split()[0] for value in unit["DeviceAllow"]}
    assert {"/dev/nvidiactl", "/dev/nvidia-uvm", "char-nvidia-frontend"} <= allowed
    assert unit["DynamicUser"] == ["yes"]
    assert unit["NoNewPrivileges"] == ["yes"]


@pytest.mark.parametrize("name", [HEAD, AGENT])
def test_unit_verifies_without_complaints(name: str, tmp_path: Path, analyze: str) -> None:
    copy = _installable_copy(name, tmp_path)
    result = _run(analyze, "verify", "--man=no", str(copy))
    output = result.stdout + result.stderr
    # verify exits 0 on unknown keys and unparsable values ("..., ignoring"), so the
    # output has to be read too: any line about our unit is a defect.
    assert result.returncode == 0, output
    assert [line for line in output.splitlines() if name in line] == []


def test_head_unit_exposure(tmp_path: Path, analyze: str) -> None:
    assert _exposure(analyze, HEAD, tmp_path) <= HEAD_MAX_EXPOSURE


def test_agent_unit_exposure(tmp_path: Path, analyze: str) -> None:
    assert _exposure(analyze, AGENT, tmp_path) <= AGENT_MAX_EXPOSURE


_MDWE_PROBE = """
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN = 65, 1
if libc.prctl(PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN, 0, 0, 0) != 0:
    sys.exit(77)
import asyncio, sqlite3, ssl
import aiohttp, aiomqtt, msgspec, prometheus_client, structlog
import tmd.sdnotify
sqlite3.connect(":memory:").execute("create table t (x)")
ssl.create_default_context()
asyncio.run(asyncio.sleep(0))
import mmap
try:
    mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
except OSError:
    sys.exit(0)
sys.exit(3)  # W+X mapping allowed: the probe did not actually restrict anything
"""


def test_daemon_dependencies_run_under_memory_deny_write_execute() -> None:
    """MemoryDenyWriteExecute=yes is only safe if nothing the daemon loads JITs.

    The kernel's PR_SET_MDWE (Linux 6.3+) enforces the same rule systemd's seccomp
    filter does, so import the daemon's dependencies under it.
    """
    result = subprocess.run(
        [sys.executable, "-c", _MDWE_PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=UNITS.parent,
    )
    if result.returncode == 77:
        pytest.skip("kernel has no PR_SET_MDWE")
    assert result.returncode == 0, result.stdout + result.stderr
