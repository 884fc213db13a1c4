"""`bpdkv logs`: journald JSON parsing, the merge across hosts, instance selection, per-host failures and follow cursors."""

from __future__ import annotations

import json
import shlex

import pytest

from bpdkv.deploy.connectors import CommandResult, ConnectorError
from bpdkv.errors import UsageError
from bpdkv.logs import JournalReader, LogEntry, journal_command, merge, parse_journal_json, select_sources
from bpdkv.topology.model import Node
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT

EXAMPLE = ROOT / "examples" / "local-cpu.yaml"


def record(us: int, message: object, cursor: str) -> str:
    """A journald export record as `journalctl -o json` prints it (all values strings; MESSAGE may be a byte array)."""
    return json.dumps(
        {
            "__CURSOR": cursor,
            "__REALTIME_TIMESTAMP": str(us),
            "__MONOTONIC_TIMESTAMP": "123",
            "_SYSTEMD_UNIT": "bpdkv-decode-0.service",
            "PRIORITY": "6",
            "MESSAGE": message,
        }
    )


def test_parse_journal_json_keeps_time_cursor_and_decodes_byte_messages() -> None:
    out = "\n".join(
        [record(1_700_000_000_000_001, "INFO started", "s=a;i=1"), record(1_700_000_000_500_000, list(b"bad \xff byte"), "s=a;i=2")]
    )
    first, second = parse_journal_json(out + "\n", "host2", "decode-0")
    assert first == LogEntry(1_700_000_000_000_001, "host2", "decode-0", "INFO started", "s=a;i=1")
    assert second.message == "bad \ufffd byte" and second.cursor == "s=a;i=2"
    assert first.format() == "2023-11-14T22:13:20.000001Z host2/decode-0: INFO started"


def test_merge_orders_by_time_across_hosts_and_keeps_untimed_entries_in_their_stream() -> None:
    p = [LogEntry(10, "host1", "prefill-0", "p1", None), LogEntry(30, "host1", "prefill-0", "p3", None)]
    d = [LogEntry(20, "host2", "decode-0", "d2", None), LogEntry(None, "host2", "decode-0", "d2-continued", None)]
    r = [LogEntry(None, "host3", "router-0", "r-untimed", None), LogEntry(5, "host3", "router-0", "r5", None)]
    assert [e.message for e in merge([p, d, r])] == ["r-untimed", "r5", "p1", "d2", "d2-continued", "p3"]


def test_journal_command_asks_for_json_and_quotes() -> None:
    assert shlex.split(journal_command("bpdkv-p.service", "10 min ago", None, None)) == [
        "journalctl", "-u", "bpdkv-p.service", "-o", "json", "--no-pager", "-q", "--since", "10 min ago",
    ]  # fmt: skip
    assert journal_command("u", None, 50, None).endswith("-n 50")
    assert "--after-cursor 's=a;i=2'" in journal_command("u", "today", 5, "s=a;i=2")


def test_unknown_instance_is_one_line_naming_the_known_ones() -> None:
    topology = load_topology(EXAMPLE, str(EXAMPLE)).topology
    with pytest.raises(UsageError, match=r"--instance nope: not in topology local-cpu \(instances: decode-0, prefill-0, router-0\)"):
        select_sources(topology, ["nope"])
    assert [s.instance.name for s in select_sources(topology, ["decode-0"])] == ["decode-0"]


class ScriptedNode:
    """A connector double: answers journalctl with records; `down` raises the transport error a dead host gives."""

    def __init__(self, node: Node, journal: dict[str, list[str]], down: bool = False) -> None:
        self.host, self.journal, self.down, self.commands = node.name, journal, down, []  # type: list[str]

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        if self.down:
            raise ConnectorError(self.host, "unreachable: root@10.213.0.12:22 timed out after 3s")
        self.commands.append(command)
        argv = shlex.split(command)
        lines = self.journal.get(argv[argv.index("-u") + 1], [])
        if "--after-cursor" in argv:
            lines = lines[int(argv[argv.index("--after-cursor") + 1].split("=")[-1]) :]
        return CommandResult(0, "\n".join(lines) + "\n", "")

    def close(self) -> None:
        pass


def test_reader_reports_a_dead_host_and_prints_the_others_then_follows_by_cursor() -> None:
    topology = load_topology(EXAMPLE, str(EXAMPLE)).topology
    journal = {
        "bpdkv-prefill-0.service": [record(100, "p-a", "c=1"), record(300, "p-b", "c=2")],
        "bpdkv-router-0.service": [record(200, "r-a", "c=1")],
    }
    nodes: dict[str, ScriptedNode] = {}

    def connect(node: Node) -> ScriptedNode:
        nodes[node.name] = ScriptedNode(node, journal, down=node.name == "host2")
        return nodes[node.name]

    reader = JournalReader(select_sources(topology, []), connect)
    entries, failures = reader.read()
    assert [(e.instance, e.message) for e in entries] == [("prefill-0", "p-a"), ("router-0", "r-a"), ("prefill-0", "p-b")]
    assert [f.format() for f in failures] == ["host2/decode-0: unreachable: root@10.213.0.12:22 timed out after 3s"]

    journal["bpdkv-prefill-0.service"].append(record(400, "p-c", "c=3"))
    journal["bpdkv-router-0.service"].append(record(350, "r-b", "c=2"))
    entries, _ = reader.read()
    assert [e.message for e in entries] == ["r-b", "p-c"]  # only what is new, still in time order
    assert "--after-cursor c=2" in nodes["host1"].commands[-1]
