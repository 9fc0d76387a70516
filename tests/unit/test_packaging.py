"""What ``pip install`` puts in site-packages: every package of the source tree, so an
installed ``tmd run`` finds its daemon (an explicit list in ``pyproject.toml`` once
left out ``tmd.daemon``, ``tmd.agent`` and ``tmd.tools``, and only an editable install
worked)."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_of_the_tree_is_installed() -> None:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs: dict[str, str] = setup["package-dir"]
    installed = set(setup["packages"])
    found = set()
    for name, folder in dirs.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            found.add(".".join([name, *rel.parts]))
    assert found - installed == set(), "packages missing from [tool.setuptools] packages"
    assert installed - found == set(), "listed packages that do not exist"


def test_the_simulator_s_data_files_are_installed() -> None:
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = setup["package-data"]["tmd.sim"]
    data = ROOT / "tmd" / "sim"
    shipped = {p for pattern in patterns for p in data.glob(pattern)}
    assert {p.name for p in (data / "data").glob("*.toml")} <= {p.name for p in shipped}
