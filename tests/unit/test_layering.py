"""The house's layering, read from the import statements of every module.

Folders are roles: ``tmd/`` holds what every role shares, ``tmd/daemon`` the head-node
daemon, ``tmd/agent`` the node agent, ``tmd/tools`` demo and benchmarks, ``tmd/sim``
the cluster simulator, ``runtime/`` what runs inside training processes. Imports flow
one way (``shared/DESIGN.md``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHARED = (
    "tmd.wire",
    "tmd.errors",
    "tmd.config",
    "tmd.log",
    "tmd.clock",
    "tmd.connection",
    "tmd.mqtt_codec",
)
SHARED_ALL = (*SHARED, "tmd.sdnotify")
PLUGIN_API = (
    "tmd.plugins",
    "tmd.daemon.plugins",
    "tmd.daemon.view",
    "tmd.daemon.ranks",
    "tmd.daemon.events",
)

# folder -> the tmd modules (and their submodules) its files may import
ALLOWED: dict[str, tuple[str, ...]] = {
    "runtime": ("tmd.runtime", "tmd.wire", "tmd.errors", "tmd.config"),
    "tmd/agent": ("tmd.agent", *SHARED_ALL),
    "detectors": ("tmd.detectors", *PLUGIN_API, *SHARED),
    "policies": ("tmd.policies", *PLUGIN_API, *SHARED),
    "tmd/daemon": ("tmd.daemon", "tmd.detectors", "tmd.policies", "tmd.plugins", *SHARED_ALL),
    # The simulator drives the daemon's own parts; it never loads the runtime or agent.
    "tmd/sim": (
        "tmd.sim",
        "tmd.daemon",
        "tmd.detectors",
        "tmd.policies",
        "tmd.plugins",
        "tmd.tools",
        *SHARED_ALL,
    ),
}
SHARED_FILES = [f"tmd/{m.split('.')[1]}.py" for m in SHARED_ALL]


def tmd_imports(path: Path) -> set[str]:
    """Every ``tmd...`` module a file imports, at top level or inside functions."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.add(f"tmd.<relative import at line {node.lineno}>")  # never allowed
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return {name for name in found if name == "tmd" or name.startswith("tmd.")}


def violations(files: list[Path], allowed: tuple[str, ...]) -> list[str]:
    """``file: module`` for each import outside ``allowed`` (prefixes; bare ``tmd`` is
    the version string, allowed everywhere)."""
    return [
        f"{f.name}: {name}"
        for f in files
        for name in sorted(tmd_imports(f))
        if name != "tmd" and not any(name == p or name.startswith(p + ".") for p in allowed)
    ]


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_each_role_imports_only_what_it_may(folder: str) -> None:
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, folder
    assert violations(files, ALLOWED[folder]) == []


def test_shared_modules_import_only_shared_modules() -> None:
    assert violations([ROOT / f for f in SHARED_FILES], SHARED_ALL) == []


def test_a_violation_is_seen(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from tmd.daemon.actuator import Actuator\nimport tmd.wire\n")
    assert violations([bad], ALLOWED["runtime"]) == ["bad.py: tmd.daemon.actuator.Actuator"]
