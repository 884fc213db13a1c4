"""Issue 35 item 2, EC2 side, against a real moto server: Name tags of any length AWS allows (256 characters, any
unicode) become node names whose instance names fit (a cut name and 8 hex digits of the tag's SHA-256: stable, and
apart for tags that share their beginning); where no name can fit beside the layout's instance names, one line per
instance names the instance and the tag, never the generated nodes[N] entries."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from bpdkv.deploy.inventory.ec2 import Ec2Inventory
from bpdkv.topology.hostnames import name_room, node_name, shown
from bpdkv.topology.validate import load_topology
from tests.unit.test_ec2_inventory import Fleet, _cli, aws, endpoint, network  # noqa: F401 - the moto fixtures

pytest.importorskip("moto.server")

LONG_ASCII = "gpu-prefill-node-" + "a" * 239  # 256 characters, AWS's limit for a tag value
LONG_SHARED = "gpu-prefill-node-" + "a" * 238 + "b"  # the same 255 first characters
LONG_UNICODE = "Präfill-Knoten für Qwen3 — 東京 " * 8  # 256 characters, not all ASCII
LONG_DECODE = "D" * 256
DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")


def expected(tag: str, room: int) -> str:
    label = re.sub(r"[^a-z0-9]+", "-", tag.lower()).strip("-")
    return f"{label[: room - 9].rstrip('-')}-{hashlib.sha256(tag.encode()).hexdigest()[:8]}"


def test_name_room_and_node_name() -> None:
    assert name_room([{"role": "prefill"}, {"role": "prefill"}]) == 63 - len("-prefill-1")
    assert name_room([{"role": "decode", "name": "d" * 40}]) == 22
    assert node_name("GPU Node #7", 53) == "gpu-node-7"  # short tags keep the names they always had
    assert node_name(LONG_ASCII, 53) == expected(LONG_ASCII, 53) and len(node_name(LONG_ASCII, 53)) == 53
    assert node_name(LONG_ASCII, 53) != node_name(LONG_SHARED, 53)
    assert node_name("\U0001f680" * 256, 53) == ""  # nothing of it is a letter or digit: the next preference answers
    assert node_name(LONG_ASCII, 9) == "" and node_name("short", 9) == "short"


def test_name_tags_of_256_characters_become_nodes_whose_units_fit(aws: Any, tmp_path: Path) -> None:  # noqa: F811
    fleet = Fleet(aws)
    prefill = fleet.launch("prefill", 3, names=[LONG_ASCII, LONG_SHARED, LONG_UNICODE])
    decode = fleet.launch("decode", 1, names=[LONG_DECODE])
    path = fleet.topology(tmp_path)
    names = []
    for _ in range(2):  # stable: the same tags make the same names
        topology = load_topology(path, None, Ec2Inventory()).topology
        names.append({n.name: [i.name for i in n.instances] for n in topology.nodes})
    assert names[0] == names[1]
    assert names[0] == {
        expected(LONG_ASCII, 53): [f"{expected(LONG_ASCII, 53)}-prefill-0", f"{expected(LONG_ASCII, 53)}-prefill-1"],
        expected(LONG_SHARED, 53): [f"{expected(LONG_SHARED, 53)}-prefill-0", f"{expected(LONG_SHARED, 53)}-prefill-1"],
        expected(LONG_UNICODE, 53): [f"{expected(LONG_UNICODE, 53)}-prefill-0", f"{expected(LONG_UNICODE, 53)}-prefill-1"],
        expected(LONG_DECODE, 54): [f"{expected(LONG_DECODE, 54)}-decode-0"],
        "router": ["router-0"],
    }
    assert all(DNS_LABEL.match(unit) for units in names[0].values() for unit in units)
    # The command line agrees, and says which instance each node is.
    result = _cli(dict(os.environ), "inventory", str(path), "--output", "json")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stdout + result.stderr
    rows = {row["name"]: row["instance_id"] for row in json.loads(result.stdout)["nodes"]}
    assert rows == {
        expected(LONG_ASCII, 53): prefill[0],
        expected(LONG_SHARED, 53): prefill[1],
        expected(LONG_UNICODE, 53): prefill[2],
        expected(LONG_DECODE, 54): decode[0],
    }


def test_a_name_that_cannot_fit_is_one_line_per_instance_naming_it_and_the_tag(aws: Any, tmp_path: Path) -> None:  # noqa: F811
    """The layout's own instance names leave 6 characters: a short tag still fits, a long one cannot."""
    fleet = Fleet(aws)
    ids = fleet.launch("prefill", 2, names=[LONG_ASCII, LONG_UNICODE])
    fleet.launch("decode", 1, names=["d1"])
    path = fleet.topology(tmp_path)
    long_name = "kv-prefill-worker-with-a-very-long-descriptive-name-0"  # 53 characters: 63 - 54 leaves 9
    text = path.read_text().replace(
        "{role: prefill, gpus: [0, 1, 2, 3], tp: 4}", f"{{role: prefill, name: {long_name}, gpus: [0, 1, 2, 3], tp: 4}}"
    )
    path.write_text(text.replace("      - {role: prefill, gpus: [4, 5, 6, 7], tp: 4}\n", ""))
    result = _cli(dict(os.environ), "inventory", str(path))
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
    tail = (
        " cannot become a node name: the layout's instance names leave 9 of 63 characters for it (at least 10 needed); "
        "shorten the instance names"
    )
    where = f"{path}:10:5: node_groups[0].instances: "
    assert sorted(lines) == sorted(
        [
            f"{where}instance {ids[0]}: tag:Name = {shown(LONG_ASCII)}{tail}",
            f"{where}instance {ids[1]}: tag:Name = {shown(LONG_UNICODE)}{tail}",
        ]
    ), lines
    assert "nodes[" not in result.stderr
