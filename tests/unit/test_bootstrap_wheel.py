"""The wheel a deploy ships to the nodes is bpdkv itself, built from this checkout (never an editable install's path hook)."""

from __future__ import annotations

import json
import zipfile
from importlib.metadata import distribution
from pathlib import Path

import pytest

import bpdkv
from bpdkv.deploy import bootstrap
from bpdkv.deploy.bootstrap import BootstrapError, build_bpdkv_wheel

pytestmark = pytest.mark.slow


def test_wheel_built_from_the_checkout_holds_the_package(tmp_path: Path) -> None:
    wheel = build_bpdkv_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    assert "bpdkv/__init__.py" in names and "bpdkv/deploy/bootstrap.py" in names
    # A .pth in the wheel would put the CLI machine's checkout on the node's sys.path.
    assert [n for n in names if n.endswith(".pth")] == []


def test_source_digest_covers_the_whole_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    package = Path(bpdkv.__file__).resolve().parent
    assert bootstrap._PACKAGE_DIR == package  # not bpdkv/deploy, where bootstrap.py lives
    copy = tmp_path / "bpdkv"
    copy.mkdir()
    for name in ("__init__.py", "resources.py"):
        (copy / name).write_bytes((package / name).read_bytes())
    monkeypatch.setattr(bootstrap, "_PACKAGE_DIR", copy)
    before = bootstrap.source_digest.__wrapped__()
    (copy / "resources.py").write_text("# changed outside bpdkv/deploy\n")
    assert bootstrap.source_digest.__wrapped__() != before  # nodes running other code must be reinstalled


def test_editable_install_without_its_source_tree_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if not json.loads(distribution("bpdkv").read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable"):
        pytest.skip("bpdkv is not an editable install here")
    monkeypatch.setattr(bootstrap, "_PACKAGE_DIR", tmp_path / "bpdkv")  # no pyproject.toml next to it
    with pytest.raises(BootstrapError, match="editable install"):
        build_bpdkv_wheel(tmp_path / "out")
