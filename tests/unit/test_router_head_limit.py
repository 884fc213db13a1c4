"""router.max_header_bytes (the router's request-head limit) in the topology: schema, model, rendered router config."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from bpdkv import contracts
from bpdkv.cli import main
from bpdkv.render import render_topology
from bpdkv.router.config import config_from_bytes
from bpdkv.topology.validate import load_topology

TOPOLOGY = """\
apiVersion: bpdkv/v1
name: t
model: {{id: m/x}}
router: {{{router}}}
nodes:
  - name: a
    host: 10.0.0.1
    hardware: generic-gpu
    instances:
      - {{role: prefill, gpus: [0]}}
      - {{role: decode, gpus: [1]}}
      - {{role: router}}
"""


def _write(tmp_path: Path, router: str) -> Path:
    path = tmp_path / "t.yaml"
    path.write_text(TOPOLOGY.format(router=router))
    return path


def _router_config(path: Path) -> tuple[bytes, Path]:
    art = next(a for a in render_topology(load_topology(path).topology) if a.path.endswith(".router.yaml"))
    return art.content.encode(), Path(art.path)


def test_rendered_router_config_carries_it(tmp_path: Path) -> None:
    path = _write(tmp_path, "max_header_bytes: 131072")
    assert load_topology(path).topology.router.max_header_bytes == 131072
    raw, where = _router_config(path)
    assert b"\nmax_header_bytes: 131072\n" in raw
    assert config_from_bytes(raw, where).max_header_bytes == 131072  # the router reads what render wrote


def test_unset_leaves_the_routers_default(tmp_path: Path) -> None:
    path = _write(tmp_path, "reuse: true")
    assert load_topology(path).topology.router.max_header_bytes is None
    raw, where = _router_config(path)
    assert b"max_header_bytes" not in raw
    assert config_from_bytes(raw, where).max_header_bytes == contracts.ROUTER_DEFAULTS["max_header_bytes"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("512", "router.max_header_bytes: must be >= 1024, got 512"),
        ("64k", "router.max_header_bytes: expected an integer, got str '64k'"),
        ("65536.5", "router.max_header_bytes: expected an integer, got float 65536.5"),
        ("true", "router.max_header_bytes: expected an integer, got boolean true"),
        ("[65536]", "router.max_header_bytes: expected an integer, got a list"),
    ],
)
def test_bad_value_is_one_clear_line(tmp_path: Path, value: str, message: str) -> None:
    path = _write(tmp_path, f"max_header_bytes: {value}")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if ": warning: " not in line and not line.endswith("error(s)")]
    assert errors == [f"{path}:4:10: {message}"], result.output
