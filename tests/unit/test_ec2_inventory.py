"""EC2 inventory against a real moto server (HTTP on 127.0.0.1, reached through AWS_ENDPOINT_URL like any endpoint).

Error paths moto cannot produce (access denied, throttling) come from a small HTTP endpoint that answers with EC2's
own error documents; no credentials is the real boto3 credential chain with nothing to find.
"""

from __future__ import annotations

import http.server
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

from bpdkv.deploy.inventory import MembershipChanged, check_membership, load_with_inventory
from bpdkv.deploy.inventory.ec2 import Ec2Inventory, InventoryError
from bpdkv.errors import InvalidTopology
from bpdkv.topology.validate import load_topology
from tests.ec2_moto import moto_endpoint

pytest.importorskip("moto.server")

REGION = "us-east-1"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGION}


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    with moto_endpoint() as url:
        yield url


@pytest.fixture(scope="module")
def network(endpoint: str) -> tuple[str, str]:
    """One subnet and image for every fleet of the module: moto's first calls in a region take seconds."""
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=endpoint, aws_access_key_id="testing", aws_secret_access_key="testing")
    vpc = ec2.create_vpc(CidrBlock="10.120.0.0/16")["Vpc"]["VpcId"]
    subnet = ec2.create_subnet(VpcId=vpc, CidrBlock="10.120.0.0/20")["Subnet"]["SubnetId"]
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    return subnet, image


@pytest.fixture
def aws(endpoint: str, network: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> Any:
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent")
    client = boto3.client("ec2", region_name=REGION)
    client.bpdkv_network = network  # type: ignore[attr-defined]
    return client


class Fleet:
    """Instances launched in moto for one test, tagged with a fleet id no other test uses."""

    counter = 0

    def __init__(self, ec2: Any) -> None:
        Fleet.counter += 1
        self.ec2 = ec2
        self.tag = f"fleet-{Fleet.counter}-{os.getpid()}"
        self.subnet, self.image = ec2.bpdkv_network

    def launch(self, role: str, count: int = 1, instance_type: str = "p5en.48xlarge", names: list[str] | None = None) -> list[str]:
        ids = []
        for i in range(count):
            tags = [{"Key": "fleet", "Value": self.tag}, {"Key": "role", "Value": role}]
            if names:
                tags.append({"Key": "Name", "Value": names[i]})
            r = self.ec2.run_instances(
                ImageId=self.image,
                MinCount=1,
                MaxCount=1,
                InstanceType=instance_type,
                SubnetId=self.subnet,
                TagSpecifications=[{"ResourceType": "instance", "Tags": tags}],
            )
            ids.append(r["Instances"][0]["InstanceId"])
        return ids

    def topology(self, tmp_path: Path, extra_group: str = "") -> Path:
        path = tmp_path / "fleet.yaml"
        path.write_text(
            f"""apiVersion: bpdkv/v1
name: ec2-test
profile: qwen3-32b
ssh: {{user: ubuntu}}
node_groups:
  - name: prefill
    ec2:
      region: {REGION}
      filters: {{tag:fleet: {self.tag}, tag:role: prefill}}
    instances:
      - {{role: prefill, gpus: [0, 1, 2, 3], tp: 4}}
      - {{role: prefill, gpus: [4, 5, 6, 7], tp: 4}}
  - name: decode
    instance_type: p5en.48xlarge
    ec2:
      filters:
        tag:fleet: {self.tag}
        tag:role: [decode]
      names: [tag:Name]
    ssh:
      proxy_command: ssh -W %h:%p bastion
    instances:
      - {{role: decode, gpus: [0, 1, 2, 3, 4, 5, 6, 7], tp: 8}}
{extra_group}nodes:
  - name: router
    host: 10.9.9.9
    accelerator: cpu
    instances: [{{role: router}}]
""",
            encoding="utf-8",
        )
        return path


def test_groups_become_nodes_across_pages(aws: Any, tmp_path: Path) -> None:
    fleet = Fleet(aws)
    prefill = fleet.launch("prefill", 12, names=[f"P {i:02d}" for i in range(12)])
    decode = fleet.launch("decode", 3, names=["dec-a", "dec-b", "dec-c"])
    resolver = Ec2Inventory(page_size=5)  # 12 prefill machines: three pages
    t = load_topology(fleet.topology(tmp_path), None, resolver).topology
    inventory = resolver.inventory
    assert inventory is not None
    assert inventory.membership() == {"prefill": sorted(prefill), "decode": sorted(decode)}
    by_name = {n.name: n for n in t.nodes}
    assert sorted(by_name) == sorted([f"p-{i:02d}" for i in range(12)] + ["dec-a", "dec-b", "dec-c", "router"])
    first = next(n for n in inventory.nodes if n.name == "p-00")
    node = by_name["p-00"]
    # Data plane = private IP, SSH host = private IP by default, hardware from the instance type.
    assert node.data_plane_address == first.private_ip == node.host and first.private_ip.startswith("10.")
    assert node.hardware == "p5en.48xlarge" and node.gpus == 8 and node.efa_devices == 16
    assert [i.name for i in node.instances] == ["p-00-prefill-0", "p-00-prefill-1"]
    assert t.kv_transfer.backend == "LIBFABRIC"  # EFA presets choose it
    # The group's ssh settings (proxy_command) reach its nodes only; the top-level user reaches all.
    assert by_name["dec-a"].ssh.proxy_command == "ssh -W %h:%p bastion" and by_name["dec-a"].ssh.user == "ubuntu"
    assert by_name["p-00"].ssh.proxy_command is None


def test_stopped_instances_are_not_nodes(aws: Any, tmp_path: Path) -> None:
    fleet = Fleet(aws)
    prefill = fleet.launch("prefill", 3, names=["a", "b", "c"])
    fleet.launch("decode", 1, names=["d"])
    aws.stop_instances(InstanceIds=prefill[:2])
    resolver = Ec2Inventory()
    load_topology(fleet.topology(tmp_path), None, resolver)
    assert resolver.inventory is not None and resolver.inventory.membership()["prefill"] == [prefill[2]]


def test_unknown_instance_type_names_it(aws: Any, tmp_path: Path) -> None:
    fleet = Fleet(aws)
    fleet.launch("prefill", 1, names=["p"])
    odd = fleet.launch("prefill", 1, instance_type="m5.large", names=["small"])
    fleet.launch("decode", 1, instance_type="p5.48xlarge", names=["d"])  # the decode group expects p5en
    with pytest.raises(InvalidTopology) as err:
        load_topology(fleet.topology(tmp_path), None, Ec2Inventory())
    lines = err.value.lines()
    assert len(lines) == 2, lines
    assert any(odd[0] in line and "'m5.large'" in line and "no hardware preset" in line for line in lines)
    assert any("is p5.48xlarge, the group expects p5en.48xlarge" in line for line in lines)
    assert all(line.startswith(str(tmp_path / "fleet.yaml") + ":") for line in lines)


def test_empty_group_and_duplicate_names(aws: Any, tmp_path: Path) -> None:
    fleet = Fleet(aws)
    fleet.launch("decode", 2, names=["same", "same"])
    with pytest.raises(InvalidTopology) as err:
        load_topology(fleet.topology(tmp_path), None, Ec2Inventory())
    text = "\n".join(err.value.lines())
    assert "node_groups[0].ec2.filters: matched no running EC2 instance" in text
    assert "both make node name 'same'" in text


def test_membership_change_refuses_a_saved_plan(aws: Any, tmp_path: Path) -> None:
    fleet = Fleet(aws)
    fleet.launch("prefill", 2, names=["p1", "p2"])
    fleet.launch("decode", 1, names=["d1"])
    _, saved = load_with_inventory(str(fleet.topology(tmp_path)))
    assert saved is not None
    _, same = load_with_inventory(str(fleet.topology(tmp_path)))
    assert same is not None
    check_membership(saved.membership(), same)  # nothing changed: no error
    added = fleet.launch("prefill", 1, names=["p3"])
    aws.terminate_instances(InstanceIds=[saved.membership()["decode"][0]])
    replacement = fleet.launch("decode", 1, names=["d1"])
    _, now = load_with_inventory(str(fleet.topology(tmp_path)))
    assert now is not None
    with pytest.raises(MembershipChanged) as err:
        check_membership(saved.membership(), now)
    message = str(err.value)
    assert f"group prefill: +{added[0]}" in message and f"group decode: +{replacement[0]} -{saved.membership()['decode'][0]}" in message


def test_static_topologies_need_no_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # would fail if anything asked
    validated, inventory = load_with_inventory(str(Path(__file__).parent.parent.parent / "examples" / "p5en-qwen3-32b.yaml"))
    assert inventory is None and len(validated.topology.nodes) == 2


# ---- failures: one line each -----------------------------------------------------------------------------------


class ErrorEndpoint(http.server.BaseHTTPRequestHandler):
    """Answers every EC2 call with one fixed error document (EC2's Response/Errors XML)."""

    status = 403
    code = "UnauthorizedOperation"
    calls = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        type(self).calls += 1
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = (
            f'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>{self.code}</Code>'
            f"<Message>You are not authorized to perform this operation.</Message></Error></Errors>"
            f"<RequestID>0000</RequestID></Response>"
        ).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "text/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def error_endpoint(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[ErrorEndpoint]]:
    handler = type("Handler", (ErrorEndpoint,), {"calls": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for key, value in CREDENTIALS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{server.server_address[1]}")
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()


def test_access_denied_is_one_line(error_endpoint: type[ErrorEndpoint], tmp_path: Path) -> None:
    fleet_path = Fleet.__new__(Fleet)
    fleet_path.tag = "x"
    with pytest.raises(InventoryError) as err:
        load_topology(fleet_path.topology(tmp_path), None, Ec2Inventory(max_attempts=1))
    message = str(err.value)
    assert "\n" not in message and "access denied (UnauthorizedOperation" in message and "ec2:DescribeInstances" in message
    assert "node_groups[0] (prefill)" in message and REGION in message


def test_throttling_is_retried_then_one_line(error_endpoint: type[ErrorEndpoint], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    error_endpoint.status = 503
    error_endpoint.code = "RequestLimitExceeded"
    fleet_path = Fleet.__new__(Fleet)
    fleet_path.tag = "x"
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "3")
    with pytest.raises(InventoryError) as err:
        load_topology(fleet_path.topology(tmp_path), None, Ec2Inventory())
    assert "throttled by AWS after retries (RequestLimitExceeded)" in str(err.value)
    assert error_endpoint.calls == 3  # AWS_MAX_ATTEMPTS counts every attempt, the first included


def cli_inventory(path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bpdkv.cli", "inventory", str(path), *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_cli_without_credentials_is_one_line(tmp_path: Path) -> None:
    fleet_path = Fleet.__new__(Fleet)
    fleet_path.tag = "x"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_CONFIG_FILE="/nonexistent",
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent",
        AWS_EC2_METADATA_DISABLED="true",
        AWS_ENDPOINT_URL="http://127.0.0.1:9",
    )
    result = cli_inventory(fleet_path.topology(tmp_path), env)
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "no usable AWS credentials" in lines[0] and "Traceback" not in result.stderr


def test_cli_prints_nodes_as_json(aws: Any, tmp_path: Path) -> None:
    import json

    fleet = Fleet(aws)
    prefill = fleet.launch("prefill", 2, names=["p1", "p2"])
    fleet.launch("decode", 1, names=["d1"])
    result = cli_inventory(fleet.topology(tmp_path), dict(os.environ), "--output", "json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["groups"]["prefill"] == sorted(prefill)
    row = next(n for n in data["nodes"] if n["name"] == "p1")
    assert row["group"] == "prefill" and row["instance_type"] == row["preset"] == "p5en.48xlarge" and row["instance_id"] in prefill
    assert row["host"] == row["private_ip"]
    text = cli_inventory(fleet.topology(tmp_path), dict(os.environ))
    assert text.returncode == 0 and "p1" in text.stdout and prefill[0] in text.stdout


def test_validate_checks_groups_offline() -> None:
    """No AWS call: each group is one placeholder machine of its instance_type, and a warning says so."""
    example = Path(__file__).parent.parent.parent / "examples" / "ec2-p5en-qwen3-32b.yaml"
    validated = load_topology(example)
    assert [w.path for w in validated.warnings] == ["node_groups"] and "placeholder" in validated.warnings[0].message
    nodes = {n.name: n for n in validated.topology.nodes}
    assert nodes["prefill-example"].hardware == "p5en.48xlarge" and nodes["prefill-example"].data_plane_address.startswith("192.0.2.")
    result = subprocess.run(["bpdkv", "validate", str(example)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_bad_group_is_located(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(
        "apiVersion: bpdkv/v1\nname: bad\nprofile: qwen3-32b\nnode_groups:\n  - name: p\n    instance_type: p5en.48xlarge\n"
        "    ec2:\n      filters: {tag:x: y}\n      hostnames: [public-ip]\n    instances:\n"
        "      - {role: prefill, gpus: [0, 1, 2, 3, 4, 5, 6, 7, 8], tp: 9}\n"
    )
    with pytest.raises(InvalidTopology) as err:
        load_topology(path)
    lines = err.value.lines()
    assert any(line.startswith(f"{path}:9:") and "node_groups[0].ec2.hostnames[0]" in line for line in lines), lines


def test_no_region_and_unreachable_endpoint_are_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for key in list(os.environ):
        if key.startswith("AWS_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    fleet_path = Fleet.__new__(Fleet)
    fleet_path.tag = "x"
    path = fleet_path.topology(tmp_path)
    path.write_text(path.read_text().replace(f"      region: {REGION}\n", ""))  # no group names a region
    with pytest.raises(InventoryError) as err:
        load_topology(path, None, Ec2Inventory(max_attempts=1))
    assert str(err.value).endswith("no AWS region; set ec2.region on the group, AWS_REGION or AWS_DEFAULT_REGION")
    monkeypatch.setenv("AWS_REGION", REGION)  # honoured too
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(InventoryError) as err:
        load_topology(path, None, Ec2Inventory(max_attempts=1))
    assert "cannot reach the EC2 endpoint" in str(err.value) and "\n" not in str(err.value)


# ---- issue 25: every client failure one line; offline asks nothing; validate agrees with inventory -----------------


class OddEndpoint(http.server.BaseHTTPRequestHandler):
    """Answers every call with one fixed status, content type and body (an HTML page, as a proxy in the way would)."""

    status = 200
    content_type = "text/html"
    body = "<html><head><title>Proxy login</title></head><body><h1>Please sign in</h1></body></html>"
    calls = 0

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        type(self).calls += 1
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        data = self.body.encode()
        self.send_response(self.status)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def _ec2_error(code: str, message: str) -> str:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>{code}</Code><Message>{message}</Message>'
        "</Error></Errors><RequestID>0000</RequestID></Response>"
    )


@pytest.fixture
def odd_endpoint() -> Iterator[type[OddEndpoint]]:
    handler = type("Handler", (OddEndpoint,), {"calls": 0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handler.url = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()


def _cli_env(url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_CONFIG_FILE="/nonexistent", AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_EC2_METADATA_DISABLED="true", AWS_ENDPOINT_URL=url
    )
    env.update(extra)
    return env


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bpdkv.cli", *args], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize(
    ("status", "content_type", "body", "attempts", "cause"),
    [
        (200, "text/html", OddEndpoint.body, 1, "the endpoint's answer is not EC2's protocol"),
        (502, "text/html", "<html><body><h1>502 Bad Gateway</h1></body></html>", 3, "the endpoint answered HTTP 502"),
        (500, "text/xml", _ec2_error("InternalError", "An internal error has occurred"), 3, "the EC2 endpoint failed after retries"),
        (400, "text/xml", _ec2_error("RequestExpired", "Request has expired."), 1, "the AWS credentials have expired (RequestExpired"),
        (503, "text/xml", _ec2_error("RequestLimitExceeded", "Request limit exceeded."), 3, "throttled by AWS after retries"),
    ],
    ids=["html-200", "html-502", "endpoint-500", "expired", "throttled"],
)
def test_every_client_failure_is_one_line_naming_group_and_region(
    odd_endpoint: type[OddEndpoint], tmp_path: Path, status: int, content_type: str, body: str, attempts: int, cause: str
) -> None:
    odd_endpoint.status, odd_endpoint.content_type, odd_endpoint.body = status, content_type, body
    fleet_path = Fleet.__new__(Fleet)
    fleet_path.tag = "x"
    topo = fleet_path.topology(tmp_path)
    env = _cli_env(odd_endpoint.url, **CREDENTIALS, AWS_MAX_ATTEMPTS="3")  # type: ignore[attr-defined]
    for command in (["inventory", str(topo)], ["plan", str(topo)]):
        result = _cli(env, *command)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, (command, result.stderr)
        assert "node_groups[0] (prefill): EC2 DescribeInstances in us-east-1: " in lines[0] and cause in lines[0], lines[0]
    assert odd_endpoint.calls == 2 * attempts  # retried as AWS_MAX_ATTEMPTS says where AWS retries, once otherwise


def test_plan_offline_asks_aws_nothing_and_says_so(odd_endpoint: type[OddEndpoint], tmp_path: Path) -> None:
    fleet_path = Fleet.__new__(Fleet)
    fleet_path.tag = "x"
    env = _cli_env(odd_endpoint.url)  # type: ignore[attr-defined]  # and no credentials at all
    result = _cli(env, "plan", "--offline", str(fleet_path.topology(tmp_path)), "--no-diff")
    assert result.returncode == 2, result.stdout + result.stderr
    assert odd_endpoint.calls == 0
    assert "node_groups: checked with one placeholder machine per group, EC2 not asked" in result.stderr
    for node in ("prefill-example", "decode-example", "router"):
        assert node in result.stdout  # one placeholder machine per group, planned like any node


def untyped_next_to_p5en(tmp_path: Path, tag: str, backend: str = "") -> Path:
    """A decode group without instance_type (optional) next to a p5en prefill group."""
    path = tmp_path / "untyped.yaml"
    path.write_text(
        f"""apiVersion: bpdkv/v1
name: untyped
profile: qwen3-32b
{backend}ssh: {{user: ubuntu}}
node_groups:
  - name: prefill
    instance_type: p5en.48xlarge
    ec2: {{region: {REGION}, filters: {{tag:fleet: {tag}, tag:role: prefill}}}}
    instances: [{{role: prefill, gpus: [0, 1, 2, 3], tp: 4}}]
  - name: decode
    ec2: {{region: {REGION}, filters: {{tag:fleet: {tag}, tag:role: decode}}}}
    instances: [{{role: decode, gpus: [0, 1, 2, 3, 4, 5, 6, 7], tp: 8}}]
nodes:
  - {{name: router, host: 10.9.9.9, accelerator: cpu, instances: [{{role: router}}]}}
""",
        encoding="utf-8",
    )
    return path


def test_validate_and_plan_offline_agree_with_inventory_on_optional_instance_type(aws: Any, tmp_path: Path) -> None:
    fleet = Fleet(aws)
    fleet.launch("prefill", 1, names=["p"])
    fleet.launch("decode", 1, names=["d"])  # a p5en too: inventory takes its preset from the machine
    path = untyped_next_to_p5en(tmp_path, fleet.tag)
    resolver = Ec2Inventory()
    online = load_topology(path, None, resolver).topology
    assert online.kv_transfer.backend == "LIBFABRIC" and {n.name: n.efa_devices for n in online.nodes}["d"] == 16
    offline = load_topology(path).topology  # validate: placeholders, no AWS
    assert offline.kv_transfer.backend == "LIBFABRIC"
    checked = subprocess.run(["bpdkv", "validate", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    planned = _cli(_cli_env("http://127.0.0.1:9"), "plan", "--offline", str(path), "--no-diff")
    assert planned.returncode == 2, planned.stdout + planned.stderr


def test_p4d_with_libfabric_refused_from_the_topology_alone(tmp_path: Path) -> None:
    path = untyped_next_to_p5en(tmp_path, "x", "kv_transfer: {backend: LIBFABRIC}\n")
    path.write_text(path.read_text().replace("p5en.48xlarge", "p4d.24xlarge").replace("[0, 1, 2, 3], tp: 4", "[0, 1], tp: 2"))
    for args in (["validate", str(path)], ["plan", "--offline", str(path)]):
        result = _cli(_cli_env("http://127.0.0.1:9"), *args)
        refused = [line for line in result.stderr.splitlines() if "RDMA READ" in line]
        assert result.returncode == 1 and len(refused) == 1, result.stdout + result.stderr
        assert f"{path}:" in refused[0] and "p4d.24xlarge EFA has no hardware RDMA READ" in refused[0]


def test_a_malicious_tag_value_never_reaches_a_command_line(aws: Any, tmp_path: Path) -> None:
    """`hostnames: [tag:ssh]`: whoever may tag instances sets the value. A shell payload in it is refused (one line naming
    the instance and the tag) by inventory and plan, and nothing runs: not the payload, not the proxy command."""
    fleet = Fleet(aws)
    marker, proxied = tmp_path / "pwned", tmp_path / "proxy-ran"
    payload = f"10.120.0.9;touch {marker}"
    ids = fleet.launch("prefill", 1, names=["p"])
    fleet.launch("decode", 1, names=["d"])
    aws.create_tags(Resources=ids, Tags=[{"Key": "ssh", "Value": payload}])
    path = fleet.topology(tmp_path)
    text = path.read_text().replace(
        "      filters: {tag:fleet: " + fleet.tag + ", tag:role: prefill}\n",
        "      filters: {tag:fleet: " + fleet.tag + ", tag:role: prefill}\n      hostnames: [tag:ssh]\n",
    )
    text = text.replace("ssh: {user: ubuntu}", f"ssh: {{user: ubuntu, proxy_command: \"sh -c 'touch {proxied}; nc $0 22' %h\"}}")
    path.write_text(text)
    for command in ("inventory", "plan"):
        result = _cli(dict(os.environ), command, str(path))
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr, result.stdout + result.stderr
        assert f"instance {ids[0]} (p): tag:ssh = '10.120.0.9;touch " in lines[0] and "' contains ' ', '/', ';'" in lines[0], lines[0]
        assert "node_groups[0].ec2.hostnames" in lines[0]
    assert not marker.exists() and not proxied.exists()
