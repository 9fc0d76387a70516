"""Every module imports on its own, in a fresh interpreter, as a user's first line
would (``import tmd.plugins`` in a third-party plug-in), and the light roles stay light:
the agent on every GPU node loads no daemon module, ``tmd.config`` no plug-in package
and no metrics."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import tmd


def all_modules() -> list[str]:
    names = ["tmd"]
    for info in pkgutil.walk_packages(tmd.__path__, "tmd."):
        names.append(info.name)
    return sorted(set(names))


def loaded_after(module: str) -> tuple[int, str, list[str]]:
    """Exit code, stderr, and the tmd and heavy third-party modules loaded by
    ``import {module}`` (a comma-separated list imports several)."""
    code = (
        f"import sys, json; import {module}; "
        "print(json.dumps(sorted(m for m in sys.modules "
        "if m.startswith(('tmd', 'prometheus_client', 'aiohttp', 'torch')))))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    loaded = json.loads(proc.stdout) if proc.returncode == 0 else []
    return proc.returncode, proc.stderr, loaded


def test_every_module_imports_on_its_own() -> None:
    modules = all_modules()
    # The walk itself must see every role; a broken package would hide its modules.
    for expected in (
        "tmd.plugins",
        "tmd.detectors",
        "tmd.policies",
        "tmd.runtime",
        "tmd.agent.agent",
        "tmd.tools.bench.detect",
        "tmd.daemon.actuator",
    ):
        assert expected in modules
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(modules, pool.map(loaded_after, modules), strict=True))
    failed = {m: err for m, (rc, err, _) in results.items() if rc != 0}
    assert failed == {}


@pytest.mark.parametrize(
    ("module", "must_not_load"),
    [
        # `tmd agent`: the command line, then the agent
        (
            "tmd.cli, tmd.agent.agent",
            (
                "tmd.daemon",
                "tmd.detectors",
                "tmd.policies",
                "tmd.runtime",
                "prometheus_client",
                "aiohttp",
                "torch",
            ),
        ),
        # The runtime shares the broker options type (tmd.config.MqttConfig) with the
        # daemon and the agent: the config module loads nothing but the standard library.
        (
            "tmd.config",
            (
                "tmd.daemon",
                "tmd.detectors",
                "tmd.policies",
                "prometheus_client",
                "aiomqtt",
                "aiohttp",
                "structlog",
                "msgspec",
                "torch",
            ),
        ),
        ("tmd.runtime", ("tmd.daemon", "tmd.agent", "tmd.connection", "prometheus_client")),
        ("tmd.plugins", ("tmd.runtime", "tmd.agent", "torch")),
    ],
)
def test_light_roles_stay_light(module: str, must_not_load: tuple[str, ...]) -> None:
    rc, err, loaded = loaded_after(module)
    assert rc == 0, err
    assert [m for m in loaded if m.startswith(must_not_load)] == []
