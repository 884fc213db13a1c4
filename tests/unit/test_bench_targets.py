"""Where `bpdkv bench` sends its load when given a topology: the first router as a client reaches it (https when the
router serves TLS), and P's and D's own URLs for /metrics unless the command line names them."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bpdkv.bench.command import bench_targets, router_url
from bpdkv.bench.runner import Servers
from bpdkv.errors import UsageError
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT

EXAMPLE = ROOT / "examples" / "local-cpu.yaml"


def _topology(tmp_path: Path, edit: object = None) -> object:
    doc = yaml.safe_load(EXAMPLE.read_text())
    if callable(edit):
        edit(doc)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    return load_topology(path, str(path)).topology


def _router(topology: object) -> tuple[str, int]:
    node, inst = topology.instances("router")[0]  # type: ignore[attr-defined]
    return node.host, inst.port


def test_plain_router_is_http(tmp_path: Path) -> None:
    topology = _topology(tmp_path)
    host, port = _router(topology)
    url, servers = bench_targets("t.yaml", topology, Servers())
    assert url == f"http://{host}:{port}"
    assert servers.prefill and servers.decode and all(u.startswith("http://") for u in servers.all)


def test_tls_router_is_https(tmp_path: Path) -> None:
    def tls(doc: dict) -> None:
        doc.setdefault("router", {})["tls"] = {"cert": "/etc/bpdkv/tls/cert.pem", "key": "/etc/bpdkv/tls/key.pem"}

    topology = _topology(tmp_path, tls)
    host, port = _router(topology)
    assert router_url(topology, "t.yaml") == f"https://{host}:{port}"
    # P and D serve plain HTTP whatever the router does.
    _, servers = bench_targets("t.yaml", topology, Servers())
    assert all(u.startswith("http://") for u in servers.all)


def test_servers_given_on_the_command_line_win(tmp_path: Path) -> None:
    given = Servers(("http://p:1",), ("http://d:2",))
    assert bench_targets("t.yaml", _topology(tmp_path), given)[1] == given


def test_a_url_is_taken_as_given() -> None:
    assert bench_targets("https://r:8443", None, Servers()) == ("https://r:8443", Servers())


def test_no_router_is_one_line() -> None:
    class NoRouter:  # a valid topology always has a router: this stands for a future one without
        def instances(self, role: str) -> list[object]:
            return []

    with pytest.raises(UsageError, match="no router instance"):
        router_url(NoRouter(), "t.yaml")
