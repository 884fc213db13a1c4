"""Packaging facts the CLI relies on at run time."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()


def test_a_plain_install_can_build_the_node_wheel() -> None:
    """`bpdkv wheelhouse build` builds bpdkv's wheel with `pip wheel --no-build-isolation`, which imports the build
    backend from the CLI's own environment: every build requirement must come with a plain `pip install bpdkv`
    (no dev extras), else a user's first wheelhouse build fails for want of hatchling."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    runtime = {_name(r) for r in project["project"]["dependencies"]}
    build = {_name(r) for r in project["build-system"]["requires"]}
    assert build and build <= runtime, f"build requirements missing from [project] dependencies: {sorted(build - runtime)}"


def test_without_the_build_backend_the_wheel_build_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from bpdkv.deploy import bootstrap

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hatchling" else real_find_spec(name, *a))
    with pytest.raises(bootstrap.BootstrapError) as info:
        bootstrap.build_bpdkv_wheel(tmp_path / "out")
    message = str(info.value)
    assert "\n" not in message and "its build backend hatchling is not installed" in message
    assert "pip install 'hatchling>=1.21'" in message
    assert not (tmp_path / "out").exists()  # nothing half-made
