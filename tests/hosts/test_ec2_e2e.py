"""EC2 end to end: instances in a real moto server carry the test hosts' private IPs; `bpdkv inventory`, `plan` and
`apply` deploy to the real SSH test hosts through the EC2 inventory, one host reached through `proxy_command`
(`ssh -W` via another test host), and a saved plan is refused once a group's membership changed."""

from __future__ import annotations

import json
import os
import shlex
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from tests.ec2_moto import moto_endpoint
from tests.hosts.conftest import topology_doc, write_topology

pytestmark = pytest.mark.hosts
pytest.importorskip("moto.server")

REGION = "us-east-1"
INSTANCE_TYPE = "c7i.8xlarge"  # a CPU preset, like the test hosts


@pytest.fixture(scope="module")
def ec2_endpoint() -> Iterator[str]:
    with moto_endpoint() as url:
        yield url


@pytest.fixture
def aws_env(ec2_endpoint: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION=REGION,
        AWS_ENDPOINT_URL=ec2_endpoint,
        AWS_CONFIG_FILE="/nonexistent",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
    )
    return env


def launch(ec2: Any, subnet: str, image: str, role: str, address: str, name: str) -> str:
    answer = ec2.run_instances(
        ImageId=image,
        MinCount=1,
        MaxCount=1,
        InstanceType=INSTANCE_TYPE,
        SubnetId=subnet,
        PrivateIpAddress=address,
        TagSpecifications=[
            {
                "ResourceType": "instance",
                "Tags": [{"Key": "fleet", "Value": "e2e"}, {"Key": "role", "Value": role}, {"Key": "Name", "Value": name}],
            }
        ],
    )
    return str(answer["Instances"][0]["InstanceId"])


def run(env: dict[str, str], *args: str, timeout: float = 240) -> Any:
    import subprocess

    return subprocess.run(["bpdkv", *args], capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)


def test_ec2_inventory_plan_apply_on_test_hosts(hosts, aws_env: dict[str, str], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ec2 = boto3.client(
        "ec2", region_name=REGION, endpoint_url=aws_env["AWS_ENDPOINT_URL"], aws_access_key_id="testing", aws_secret_access_key="testing"
    )
    vpc = ec2.create_vpc(CidrBlock="10.213.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.213.0.0/24")["Subnet"]["SubnetId"]
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    ids = {
        "host1": launch(ec2, subnet, image, "prefill", "10.213.0.11", "host1"),
        "host2": launch(ec2, subnet, image, "decode", "10.213.0.12", "host2"),
        "host3": launch(ec2, subnet, image, "router", "10.213.0.13", "host3"),
    }
    stopped = launch(ec2, subnet, image, "prefill", "10.213.0.50", "stopped-one")
    ec2.stop_instances(InstanceIds=[stopped])

    proxy_log = tmp_path / "proxy.log"
    ssh = (
        f"ssh -i {hosts.key} -o UserKnownHostsFile={hosts.known_hosts} -o StrictHostKeyChecking=yes -o BatchMode=yes "
        "-o ConnectTimeout=5 -W $0:$1 root@10.213.0.13"
    )
    # A real ProxyCommand: host2 is reached through host3 (ssh -W); each use is logged so the test sees bpdkv used it.
    proxy = f"sh -c {shlex.quote(f'echo $0:$1 >> {proxy_log}; exec {ssh}')} %h %p"
    doc = topology_doc(hosts)
    del doc["nodes"]

    def group(name: str, role: str, layout: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {
            "name": name,
            "instance_type": INSTANCE_TYPE,
            "ec2": {"region": REGION, "filters": {"tag:fleet": "e2e", "tag:role": role}, "names": ["tag:Name"]},
            "instances": [layout],
            **extra,
        }

    doc["node_groups"] = [
        group("prefill", "prefill", {"role": "prefill", "port": 8100}),
        group("decode", "decode", {"role": "decode", "port": 8200}, ssh={"proxy_command": proxy}),
        group("router", "router", {"role": "router", "port": 8000}),
    ]
    topo = write_topology(tmp_path / "ec2.yaml", doc)

    listed = run(aws_env, "inventory", str(topo), "--output", "json")
    assert listed.returncode == 0, listed.stderr
    nodes = {n["name"]: n for n in json.loads(listed.stdout)["nodes"]}
    assert sorted(nodes) == ["host1", "host2", "host3"]  # the stopped instance is not a node
    assert {n: (v["instance_id"], v["private_ip"], v["preset"]) for n, v in nodes.items()} == {
        "host1": (ids["host1"], "10.213.0.11", INSTANCE_TYPE),
        "host2": (ids["host2"], "10.213.0.12", INSTANCE_TYPE),
        "host3": (ids["host3"], "10.213.0.13", INSTANCE_TYPE),
    }

    plan_file = tmp_path / "plan.json"
    planned = run(aws_env, "plan", str(topo), "--out", str(plan_file))
    assert planned.returncode == 2, planned.stdout + planned.stderr
    saved = json.loads(plan_file.read_text())
    assert saved["inventory"]["groups"] == {"prefill": [ids["host1"]], "decode": [ids["host2"]], "router": [ids["host3"]]}

    applied = run(aws_env, "apply", str(plan_file), "-y")
    assert applied.returncode == 0, applied.stdout + applied.stderr
    for address, port in (("10.213.0.11", 8100), ("10.213.0.12", 8200)):
        with urllib.request.urlopen(f"http://{address}:{port}/version", timeout=5) as resp:
            assert resp.read().decode() == "v1"
    assert "10.213.0.12:22" in proxy_log.read_text()  # host2 went through the proxy command
    assert "10.213.0.11" not in proxy_log.read_text()  # the others did not

    # Membership changes between plan and apply: the saved plan is refused, with the instance named.
    doc["vllm"]["env"] = {"FAKE_VERSION": "v2"}
    write_topology(topo, doc)
    second = tmp_path / "plan2.json"
    assert run(aws_env, "plan", str(topo), "--out", str(second)).returncode == 2
    extra = launch(ec2, subnet, image, "prefill", "10.213.0.60", "host9")
    refused = run(aws_env, "apply", str(second), "-y")
    assert refused.returncode == 1
    assert f"group prefill: +{extra}" in refused.stdout + refused.stderr
    with urllib.request.urlopen("http://10.213.0.11:8100/version", timeout=5) as resp:
        assert resp.read().decode() == "v1"  # nothing was applied


def test_plan_refuses_hosts_that_are_not_their_instance_type(hosts, aws_env: dict[str, str], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Instances claim to be p5en.48xlarge but are the CPU test hosts: the hardware facts, gathered over SSH, make
    plan refuse them with one line per host and fact, and nothing is written."""
    ec2 = boto3.client(
        "ec2", region_name=REGION, endpoint_url=aws_env["AWS_ENDPOINT_URL"], aws_access_key_id="testing", aws_secret_access_key="testing"
    )
    vpc = ec2.create_vpc(CidrBlock="10.213.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.213.0.0/24")["Subnet"]["SubnetId"]
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    for role, address in (("gpu-prefill", "10.213.0.11"), ("gpu-decode", "10.213.0.12")):
        ec2.run_instances(
            ImageId=image,
            MinCount=1,
            MaxCount=1,
            InstanceType="p5en.48xlarge",
            SubnetId=subnet,
            PrivateIpAddress=address,
            TagSpecifications=[{"ResourceType": "instance", "Tags": [{"Key": "role", "Value": role}, {"Key": "Name", "Value": role}]}],
        )
    doc = topology_doc(hosts)
    doc["nodes"] = [n for n in doc["nodes"] if n["name"] == "host3"]  # the router stays a written CPU node
    doc["model"] = {"max_model_len": 2048}
    doc["node_groups"] = [
        {
            "name": role,
            "ec2": {"region": REGION, "filters": {"tag:role": f"gpu-{role}"}, "names": ["tag:Name"]},
            "instances": [{"role": role, "gpus": [0, 1, 2, 3, 4, 5, 6, 7], "tp": 8}],
        }
        for role in ("prefill", "decode")
    ]
    topo = write_topology(tmp_path / "gpu.yaml", doc)
    planned = run(aws_env, "plan", str(topo))
    output = planned.stdout + planned.stderr
    assert planned.returncode == 1, output
    for node in ("gpu-prefill", "gpu-decode"):
        assert f"{node}: gpus: no GPU list (bpdkv: nvidia-smi not found)" in output, output
        assert f"{node}: efa devices: 0 EFA device(s) in /sys/class/infiniband, p5en.48xlarge has 16" in output
        assert f"{node}: libfabric: fi_info not found" in output
    assert not (hosts.hosts[0].fs / "etc/bpdkv/manifest.json").exists()


def test_a_malicious_tag_value_runs_nothing(hosts, aws_env: dict[str, str], tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The SSH address comes from a tag (`hostnames: [tag:ssh]`) that carries a shell payload next to a real test host's
    address: inventory and plan refuse it with one line, and nothing runs — not the payload, not the proxy command
    (which would hand %h to a shell), and no SSH session reaches any host."""
    ec2 = boto3.client(
        "ec2", region_name=REGION, endpoint_url=aws_env["AWS_ENDPOINT_URL"], aws_access_key_id="testing", aws_secret_access_key="testing"
    )
    vpc = ec2.create_vpc(CidrBlock="10.213.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.213.0.0/24")["Subnet"]["SubnetId"]
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    pwned, proxied = tmp_path / "pwned", tmp_path / "proxy-ran"
    instance = launch(ec2, subnet, image, "evil", "10.213.0.12", "evil")
    ec2.create_tags(Resources=[instance], Tags=[{"Key": "ssh", "Value": f"10.213.0.12 -oProxyCommand=touch {pwned};touch {pwned}"}])
    doc = topology_doc(hosts)
    doc["nodes"] = [n for n in doc["nodes"] if n["name"] != "host2"]
    doc["ssh"]["proxy_command"] = f"sh -c 'touch {proxied}; exec nc $0 $1' %h %p"
    doc["node_groups"] = [
        {
            "name": "decode",
            "instance_type": INSTANCE_TYPE,
            "ec2": {"region": REGION, "filters": {"tag:role": "evil"}, "hostnames": ["tag:ssh"], "names": ["tag:Name"]},
            "instances": [{"role": "decode", "port": 8200}],
        }
    ]
    topo = write_topology(tmp_path / "evil.yaml", doc)
    auth_log = [(h.dir / "host.log").read_text() for h in hosts.hosts]
    for command in ("inventory", "plan"):
        result = run(aws_env, command, str(topo))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
        assert f"instance {instance} (evil): tag:ssh = '10.213.0.12 -oProxyCommand" in lines[0] and "contains" in lines[0], lines[0]
    assert not pwned.exists() and not proxied.exists()
    assert [(h.dir / "host.log").read_text() for h in hosts.hosts] == auth_log  # no SSH session was even opened
    assert not (hosts.hosts[1].fs / "etc/bpdkv/manifest.json").exists()
