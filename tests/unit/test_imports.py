"""Every module imports on its own, in a fresh interpreter, as a user's first line
would (``import tmd.plugins`` in a third-party plug-in), and the light roles stay light:
the agent on every GPU node loads no daemon module, ``tmd.config`` no plug-in package
and no metrics."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

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


# Imports each module named in argv in a child forked from an interpreter that loaded
# the heavy third-party packages first, but no tmd module: as a fresh interpreter for
# what this test is about (tmd's own import order), without paying torch's import once
# per module. Prints {module: traceback or ""}.
_FORKED = """
import importlib, json, os, sys, tempfile, traceback
for heavy in ("torch", "numpy", "aiohttp", "aiomqtt", "prometheus_client", "structlog",
              "msgspec"):
    try:
        importlib.import_module(heavy)
    except ImportError:
        pass
assert not [m for m in sys.modules if m == "tmd" or m.startswith("tmd.")]
out = {}
for module in sys.argv[1:]:
    with tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:
            try:
                importlib.import_module(module)
            except BaseException:
                err.write(traceback.format_exc())
                err.flush()
                os._exit(1)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        err.seek(0)
        out[module] = "" if status == 0 else (err.read() or f"exit status {status}")
print(json.dumps(out))
"""


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
    proc = subprocess.run(
        [sys.executable, "-c", _FORKED, *modules],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    results: dict[str, str] = json.loads(proc.stdout)
    assert sorted(results) == modules
    assert {m: err for m, err in results.items() if err} == {}


def test_an_import_that_fails_is_reported() -> None:
    """The forked check itself: a module that cannot import is named, with its error."""
    proc = subprocess.run(
        [sys.executable, "-c", _FORKED, "tmd.wire", "tmd.no_such_module"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    results = json.loads(proc.stdout)
    assert results["tmd.wire"] == ""
    assert "ModuleNotFoundError" in results["tmd.no_such_module"]


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
