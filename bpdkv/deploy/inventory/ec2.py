"""EC2 discovery: DescribeInstances (paginated, running instances only) with the standard boto3 credential chain.

Region: the group's `ec2.region`, else boto3's chain (AWS_DEFAULT_REGION, the profile), else AWS_REGION. Endpoint:
botocore honours AWS_ENDPOINT_URL and AWS_ENDPOINT_URL_EC2 itself (VPC endpoints, or a moto server in the tests).
Only ec2:DescribeInstances is called. Every failure becomes one line naming the group, region and what to do.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    CredentialRetrievalError,
    EndpointConnectionError,
    NoCredentialsError,
    NoRegionError,
    PartialCredentialsError,
    ReadTimeoutError,
    TokenRetrievalError,
)
from botocore.parsers import ResponseParserError

from bpdkv.errors import BpdkvError, InvalidTopology, one_line
from bpdkv.topology.groups import Inventory, Machine, expand_groups, group_problems
from bpdkv.topology.yaml_source import LoadedDocument

# The state filter every selection gets: a stopped instance is not a node (Ansible's aws_ec2 leaves it to the user).
RUNNING = "running"
DENIED = {
    "UnauthorizedOperation",
    "AccessDenied",
    "AccessDeniedException",
    "AuthFailure",
    "InvalidClientTokenId",
    "UnrecognizedClientException",
}
THROTTLED = {"RequestLimitExceeded", "Throttling", "ThrottlingException", "TooManyRequestsException"}
EXPIRED = {"ExpiredToken", "ExpiredTokenException", "RequestExpired", "TokenRefreshRequired", "InvalidToken"}


class InventoryError(BpdkvError):
    """EC2 could not be asked (credentials, permissions, throttling, endpoint): one line, exit 1."""


@dataclass(frozen=True)
class Ec2Selector:
    group: str
    where: str  # file:line: node_groups[i] — for messages
    region: str | None
    filters: tuple[tuple[str, tuple[str, ...]], ...]

    def api_filters(self) -> list[dict[str, Any]]:
        out = [{"Name": name, "Values": list(values)} for name, values in self.filters]
        if not any(name == "instance-state-name" for name, _ in self.filters):
            out.append({"Name": "instance-state-name", "Values": [RUNNING]})
        return out


def selectors(doc: LoadedDocument) -> list[Ec2Selector]:
    out = []
    for gi, group in enumerate(doc.data["node_groups"]):
        ec2 = group["ec2"]
        filters = []
        for name, value in ec2["filters"].items():
            values = value if isinstance(value, list) else [value]
            filters.append((str(name), tuple(str(v) for v in values)))
        pos = doc.source.locate(("node_groups", gi))
        where = f"{pos.file}:{pos.line}: " if pos else ""
        out.append(Ec2Selector(group["name"], f"{where}node_groups[{gi}] ({group['name']})", ec2.get("region"), tuple(filters)))
    return out


def machine_from(instance: dict[str, Any]) -> Machine:
    tags = tuple((t["Key"], t.get("Value", "")) for t in instance.get("Tags", []))
    return Machine(
        instance_id=instance["InstanceId"],
        instance_type=instance["InstanceType"],
        private_ip=instance.get("PrivateIpAddress") or None,
        public_ip=instance.get("PublicIpAddress") or None,
        private_dns=instance.get("PrivateDnsName") or None,
        public_dns=instance.get("PublicDnsName") or None,
        tags=tags,
    )


def _explain(exc: Exception, selector: Ec2Selector, region: str | None) -> str:
    """One line: the group (file:line), the region asked, the cause and what to do."""
    at = f"{selector.where}: EC2 DescribeInstances in {region or 'the default region'}"
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError, TokenRetrievalError)):
        return (
            f"{at}: no usable AWS credentials ({exc}); set AWS_PROFILE or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, "
            "or run where an instance role is available"
        )
    if isinstance(exc, NoRegionError):
        return f"{selector.where}: no AWS region; set ec2.region on the group, AWS_REGION or AWS_DEFAULT_REGION"
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", "?"))
        message = str(exc.response.get("Error", {}).get("Message", ""))
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in DENIED:
            return f"{at}: access denied ({code}: {message}); the caller needs ec2:DescribeInstances (docs/ec2.md)"
        if code in EXPIRED:
            return f"{at}: the AWS credentials have expired ({code}: {message}); refresh them (aws sso login, a new session token)"
        if code in THROTTLED:
            return f"{at}: throttled by AWS after retries ({code}); retry later or raise AWS_MAX_ATTEMPTS"
        if code.startswith("InvalidParameter") or code == "InvalidFilter":
            return f"{at}: EC2 rejected the group's filters ({code}: {message})"
        if code.isdigit():  # botocore's generic error: the body was no EC2 error document (an HTML page from a proxy?)
            return f"{at}: the endpoint answered HTTP {code} ({message or 'no reason'}) without an EC2 error document; check AWS_ENDPOINT_URL and proxies"
        if isinstance(status, int) and status >= 500:
            return f"{at}: the EC2 endpoint failed after retries (HTTP {status}, {code}: {message}); retry later"
        return f"{at} failed ({code}: {message})"
    if isinstance(exc, (ResponseParserError, NotEc2)):
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        return f"{at}: the endpoint's answer is not EC2's protocol ({first}); check AWS_ENDPOINT_URL and proxies"
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError)):
        return f"{at}: cannot reach the EC2 endpoint ({exc})"
    return f"{at} failed ({type(exc).__name__}: {exc})"


class NotEc2(Exception):
    """An answer botocore parsed without complaint that is not EC2's (an HTML page parses as an empty result)."""


def _check_protocol(page: dict[str, Any]) -> None:
    meta = page.get("ResponseMetadata", {}) if isinstance(page, dict) else {}
    headers = {str(k).lower(): str(v) for k, v in (meta.get("HTTPHeaders") or {}).items()}
    kind = headers.get("content-type", "no content type")
    if not meta.get("RequestId") or "html" in kind.lower():
        raise NotEc2(f"HTTP {meta.get('HTTPStatusCode', '?')}, {kind}, no EC2 request id")


def _env_attempts() -> int:
    text = os.environ.get("AWS_MAX_ATTEMPTS") or "5"
    if not text.isdigit() or int(text) < 1:
        raise InventoryError(f"AWS_MAX_ATTEMPTS={text!r} is not a positive whole number (attempts per EC2 call, e.g. 5)")
    return int(text)


class Ec2Inventory:
    """The loader's inventory hook for topologies with `node_groups`; `inventory` holds what it found.

    `session_factory` makes the boto3 session (the standard chain); `page_size` and `max_attempts` exist so the
    tests can force several pages and a short retry budget."""

    def __init__(
        self, session_factory: Callable[[], Any] = boto3.Session, page_size: int | None = None, max_attempts: int | None = None
    ) -> None:
        self.session_factory = session_factory
        self.page_size = page_size
        # Total attempts, as AWS_MAX_ATTEMPTS counts them (a Config in code overrides the variable, so it is read here).
        attempts = max_attempts if max_attempts is not None else _env_attempts()
        self.config = Config(retries={"total_max_attempts": attempts, "mode": "standard"}, connect_timeout=10, read_timeout=30)
        self.inventory: Inventory | None = None

    def describe(self, selector: Ec2Selector, session: Any) -> list[Machine]:
        # boto3 reads AWS_DEFAULT_REGION and the profile; AWS_REGION is what the other SDKs (and Lambda/ECS) set.
        region = selector.region or session.region_name or os.environ.get("AWS_REGION")
        try:
            client = session.client("ec2", region_name=region, config=self.config)
            paginator = client.get_paginator("describe_instances")
            pages = paginator.paginate(
                Filters=selector.api_filters(), PaginationConfig={"PageSize": self.page_size} if self.page_size else {}
            )
            machines = []
            for page in pages:
                _check_protocol(page)
                for reservation in page.get("Reservations", []):
                    for instance in reservation.get("Instances", []):
                        # Also checked here: a user filter on instance-state-name must still never yield a stopped node.
                        if instance.get("State", {}).get("Name") == RUNNING:
                            machines.append(machine_from(instance))
            return machines
        except (BotoCoreError, ClientError, ResponseParserError, NotEc2) as exc:
            raise InventoryError(one_line(_explain(exc, selector, region))) from None

    def __call__(self, doc: LoadedDocument) -> LoadedDocument:
        problems = group_problems(doc)
        if problems:
            raise InvalidTopology(problems)
        session = self.session_factory()
        found = {s.group: self.describe(s, session) for s in selectors(doc)}
        expanded, self.inventory = expand_groups(doc, found)
        return expanded
