"""What a host may be: a DNS host name (RFC 1123 labels) or an IP address, nothing else.

Hosts reach command lines: OpenSSH-style `proxy_command` (%h), `ssh -W host:port`, URLs in shell snippets run on the
nodes. They come from the topology and from EC2 (`hostnames: [tag:…]`: a tag value anyone with ec2:CreateTags sets),
so every one is checked here before it is used, and quoted (shlex) where it is substituted.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re

_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")
_USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}$")
MAX_NAME = 253
RULE = "a host name (letters, digits, '-' and '.' between labels of at most 63 characters) or an IP address"


def host_problem(value: str) -> str | None:
    """None for a valid host name or IP address; else what is wrong, in words (never the whole value echoed raw)."""
    if not isinstance(value, str) or not value:
        return "is empty; expected " + RULE
    try:
        ipaddress.ip_address(value)
        return None
    except ValueError:
        pass
    name = value[:-1] if value.endswith(".") else value
    bad = sorted({ch for ch in name if not (ch.isascii() and (ch.isalnum() or ch in "-."))})
    if bad:
        shown = ", ".join(repr(ch) for ch in bad[:5])
        return f"contains {shown}; expected {RULE}"
    if len(name) > MAX_NAME:
        return f"is {len(name)} characters long (at most {MAX_NAME}); expected {RULE}"
    for label in name.split("."):
        if not _LABEL.match(label):
            what = "an empty label" if not label else f"label '{label}'"
            return f"has {what} (labels are 1-63 letters, digits or '-', not starting or ending with '-'); expected {RULE}"
    if all(part.isdigit() for part in name.split(".")):
        return f"looks like an IPv4 address but is not one; expected {RULE}"
    return None


def shown(value: str) -> str:
    """A user value quoted for a message: repr (control characters escaped), cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:56] + "...'"


def jump_host_problem(value: str) -> str | None:
    """`[user@]host[:port]`: each part checked (the host by host_problem, the port 1-65535, the user a login name)."""
    user, at, rest = value.rpartition("@")
    host, colon, port = rest.partition(":") if not rest.startswith("[") else (rest[1:].partition("]")[0], "", "")
    if at and not _USER.match(user):
        return f"user '{user}' is not a login name (letters, digits, '_', '.', '-'); expected [user@]host[:port]"
    if colon and not (port.isdigit() and 1 <= int(port) <= 65535):
        return f"port '{port}' is not a port number (1-65535); expected [user@]host[:port]"
    problem = host_problem(host)
    return f"its host {problem}" if problem else None


def user_problem(value: str) -> str | None:
    return None if _USER.match(value) else "is not a login name (letters, digits, '_', '.', '-', at most 32 characters)"


MAX_UNIT_NAME = 63  # node and instance names are DNS labels (schema: dnsName)
NAME_HASH = 8  # hex digits of SHA-256 that keep a shortened name apart from its neighbours


def name_room(layout: list[dict[str, object]]) -> int:
    """How long a node name may be for a group's layout: every instance is named `<node>-<name>` (or
    `<node>-<role>-<k>`), and that too must be a DNS label of at most 63 characters."""
    per_role: dict[str, int] = {}
    longest = 0
    for inst in layout:
        role = str(inst.get("role", ""))
        k = per_role.get(role, 0)
        per_role[role] = k + 1
        suffix = str(inst["name"]) if "name" in inst else f"{role}-{k}"
        longest = max(longest, len(suffix) + 1)
    return MAX_UNIT_NAME - longest


def node_name(value: str, room: int) -> str:
    """A tag value (any length AWS allows, any unicode) as a node name of at most `room` characters: lowercase
    letters, digits and '-'. A longer one is cut and ends in '-' and 8 hex digits of the SHA-256 of the whole value,
    so the same tag always makes the same name and two long tags that share their beginning stay apart.
    '' when nothing fits (room < 10 for a value that needs the hash) or the value has no letter or digit."""
    label = re.sub(r"[^a-z0-9]+", "-", value.lower()).strip("-")
    if len(label) <= room:
        return label
    keep = room - NAME_HASH - 1
    if keep < 1:
        return ""
    digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:NAME_HASH]
    return f"{label[:keep].rstrip('-')}-{digest}"
