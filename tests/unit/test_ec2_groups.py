"""Node-group expansion without AWS: discovered machines in, nodes out (bpdkv/topology/groups.py is pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bpdkv.errors import InvalidTopology
from bpdkv.topology.groups import Machine, dns_label, expand_groups
from bpdkv.topology.validate import validate_document
from bpdkv.topology.yaml_source import load_yaml_file

DOC = """apiVersion: bpdkv/v1
name: groups
profile: qwen3-32b
node_groups:
  - name: prefill
    ec2:
      filters: {tag:role: prefill}
      hostnames: [tag:ssh, ip-address, private-ip-address]
    env: {EXTRA: "1"}
    ssh: {user: ec2-user}
    instances:
      - {role: prefill, gpus: [0, 1, 2, 3], tp: 4}
      - {role: prefill, name: second, gpus: [4, 5, 6, 7], tp: 4}
  - name: decode
    ec2:
      filters: {tag:role: decode}
      names: [tag:Host, instance-id]
    instances:
      - {role: decode, gpus: [0, 1, 2, 3, 4, 5, 6, 7], tp: 8}
      - {role: router, port: 8000}
"""


def machine(i: int, **kw: object) -> Machine:
    base: dict[str, object] = dict(instance_id=f"i-{i:017x}", instance_type="p5en.48xlarge", private_ip=f"10.0.1.{i}")
    base.update(kw)
    return Machine(**base)  # type: ignore[arg-type]


@pytest.fixture
def doc(tmp_path: Path):  # type: ignore[no-untyped-def]
    path = tmp_path / "groups.yaml"
    path.write_text(DOC)
    return load_yaml_file(path, str(path))


def test_hostnames_and_names_preferences(doc) -> None:  # type: ignore[no-untyped-def]
    found = {
        "prefill": [
            machine(1, public_ip="3.3.3.1", tags=(("Name", "Prefill A_01"),)),
            machine(2, tags=(("Name", "b"), ("ssh", "b.internal"))),
            machine(3),  # no tags, no public IP: private IP, name from the instance id
        ],
        "decode": [machine(4, tags=(("Host", "D.ONE"), ("Name", "ignored")))],
    }
    t = validate_document(doc, lambda d: expand_groups(d, found)[0]).topology
    inventory = expand_groups(doc, found)[1]
    nodes = {n.name: n for n in t.nodes}
    assert sorted(nodes) == ["b", "d-one", "i-00000000000000003", "prefill-a-01"]
    assert nodes["prefill-a-01"].host == "3.3.3.1" and nodes["b"].host == "b.internal" and nodes["i-00000000000000003"].host == "10.0.1.3"
    assert {n.data_plane_address for n in nodes.values()} == {"10.0.1.1", "10.0.1.2", "10.0.1.3", "10.0.1.4"}
    assert [i.name for i in nodes["b"].instances] == ["b-prefill-0", "b-second"]
    assert ("EXTRA", "1") in nodes["b"].instances[0].env and nodes["b"].ssh.user == "ec2-user"
    assert nodes["d-one"].ssh.user == "root" and [i.role for i in nodes["d-one"].instances] == ["decode", "router"]
    assert inventory.membership() == {
        "prefill": ["i-00000000000000001", "i-00000000000000002", "i-00000000000000003"],
        "decode": ["i-00000000000000004"],
    }


def test_node_names_stay_with_their_machine(doc) -> None:  # type: ignore[no-untyped-def]
    """A machine joining the group does not rename the others or their instances (no churn in the plan)."""
    one = {"prefill": [machine(2, tags=(("Name", "m"),))], "decode": [machine(4)]}
    two = {"prefill": [machine(1, tags=(("Name", "a"),)), machine(2, tags=(("Name", "m"),))], "decode": [machine(4)]}

    def names(found: dict[str, list[Machine]]) -> set[str]:
        t = validate_document(doc, lambda d: expand_groups(d, found)[0]).topology
        return {i.name for n in t.nodes if n.name == "m" for i in n.instances}

    names_one, names_two = names(one), names(two)
    assert names_one == names_two == {"m-prefill-0", "m-second"}


def test_every_problem_at_once_with_the_groups_line(doc) -> None:  # type: ignore[no-untyped-def]
    shared = machine(9, tags=(("Name", "x"),))
    found = {
        "prefill": [shared, machine(5, private_ip=None), machine(6, instance_type="g5.xlarge")],
        "decode": [shared],
    }
    with pytest.raises(InvalidTopology) as err:
        expand_groups(doc, found)
    lines = err.value.lines()
    assert len(lines) == 3, lines
    assert any("i-00000000000000009 (i-00000000000000009) is also selected by group prefill" in line and ":16:" in line for line in lines)
    assert any("has no private IP address" in line for line in lines)
    assert any("no hardware preset for instance type 'g5.xlarge'" in line for line in lines)


def test_dns_label() -> None:
    assert dns_label("GPU Node #7 (prefill)") == "gpu-node-7-prefill"
    assert dns_label("---") == ""
    assert len(dns_label("x" * 100)) == 63
