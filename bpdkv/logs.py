"""`bpdkv logs`: the instances' journal, fetched over each node's connector, prefixed host/instance, merged in time order.

Nodes are asked for journald's JSON (`journalctl -u UNIT -o json`): every entry carries its own wall-clock time
(__REALTIME_TIMESTAMP, microseconds) and a cursor, which is what makes a merge across hosts and an exact
follow (`--after-cursor`) possible. An entry without a time (a service manager that records none) keeps its place in
its own instance's stream. Fetching is read-only; a host that cannot be read is reported and the others still print.
"""

from __future__ import annotations

import heapq
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

from bpdkv.deploy.connectors import Connector, ConnectorError
from bpdkv.errors import UsageError
from bpdkv.topology.model import Instance, Node, Topology

DEFAULT_LINES = 50  # per instance, when neither --since nor --lines is given


@dataclass(frozen=True)
class LogSource:
    node: Node
    instance: Instance


@dataclass(frozen=True)
class LogEntry:
    time_us: int | None  # journald's __REALTIME_TIMESTAMP; None when the journal recorded none
    host: str
    instance: str
    message: str
    cursor: str | None

    def format(self) -> str:
        if self.time_us is None:
            when = "-"
        else:
            when = datetime.fromtimestamp(self.time_us / 1e6, timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")
        return f"{when} {self.host}/{self.instance}: {self.message}"


@dataclass(frozen=True)
class FetchFailure:
    host: str
    instance: str
    message: str

    def format(self) -> str:
        return f"{self.host}/{self.instance}: {self.message}"


def select_sources(topology: Topology, instances: Iterable[str]) -> list[LogSource]:
    wanted = set(instances)
    known = {i.name for n in topology.nodes for i in n.instances}
    unknown = sorted(wanted - known)
    if unknown:
        raise UsageError(f"--instance {', '.join(unknown)}: not in topology {topology.name} (instances: {', '.join(sorted(known))})")
    return [LogSource(n, i) for n in topology.nodes for i in n.instances if not wanted or i.name in wanted]


def journal_command(unit: str, since: str | None, lines: int | None, after_cursor: str | None) -> str:
    """One unit's entries as JSON: after a cursor (follow), else since a time and/or the last N."""
    argv = ["journalctl", "-u", unit, "-o", "json", "--no-pager", "-q"]
    if after_cursor:
        argv += ["--after-cursor", after_cursor]
    else:
        argv += ["--since", since] if since else []
        argv += ["-n", str(lines)] if lines is not None else []
    return " ".join(shlex.quote(a) for a in argv)


def _message(value: object) -> str:
    if isinstance(value, list):  # journald sends non-UTF-8 or control-character messages as a byte array
        return bytes(int(b) for b in value).decode(errors="replace")
    return "" if value is None else str(value)


def parse_journal_json(stdout: str, host: str, instance: str) -> list[LogEntry]:
    """One JSON object per line (journalctl -o json). Lines that are not JSON are kept as messages without a time."""
    entries = []
    for line in stdout.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            entries.append(LogEntry(None, host, instance, line, None))
            continue
        stamp = record.get("__REALTIME_TIMESTAMP")
        entries.append(
            LogEntry(int(stamp) if stamp else None, host, instance, _message(record.get("MESSAGE")).rstrip("\n"), record.get("__CURSOR"))
        )
    return entries


def merge(streams: Iterable[list[LogEntry]]) -> list[LogEntry]:
    """Time order across streams; each stream keeps its own order (an entry without a time sorts with the one before)."""

    def keyed(stream: list[LogEntry], index: int) -> list[tuple[int, int, int, LogEntry]]:
        out, last = [], 0
        for pos, entry in enumerate(stream):
            last = entry.time_us if entry.time_us is not None else last
            out.append((last, index, pos, entry))
        return out

    return [item[3] for item in heapq.merge(*(keyed(s, i) for i, s in enumerate(streams)))]


class JournalReader:
    """Reads every source's journal through one connector per node; remembers cursors for follow."""

    def __init__(self, sources: list[LogSource], connect: Callable[[Node], Connector], parallel: int = 8) -> None:
        self.sources = sources
        self.connect = connect
        self.parallel = parallel
        self.conns: dict[str, Connector] = {}
        self.cursors: dict[str, str] = {}
        self.seen: set[str] = set()  # instances read once: later reads (follow) take everything after that

    def _read_node(
        self, node: Node, sources: list[LogSource], since: str | None, lines: int | None
    ) -> tuple[list[list[LogEntry]], list[FetchFailure]]:
        streams: list[list[LogEntry]] = []
        failures: list[FetchFailure] = []
        try:
            conn = self.conns.get(node.name) or self.connect(node)
            self.conns[node.name] = conn
            for src in sources:
                name = src.instance.name
                if name in self.seen:  # follow: everything after the last entry seen (all of it if there was none)
                    command = journal_command(src.instance.unit, None, None, self.cursors.get(name))
                else:
                    # -n 0 still reads the last entry: its cursor is where a follow starts.
                    wanted = DEFAULT_LINES if lines is None and since is None else lines
                    command = journal_command(src.instance.unit, since, 1 if wanted == 0 else wanted, None)
                result = conn.run(command, timeout=60)
                if result.exited != 0:
                    said = (result.stderr or result.stdout).strip().splitlines()
                    failures.append(
                        FetchFailure(node.name, name, f"journalctl exited {result.exited}: {said[-1] if said else 'no output'}")
                    )
                    continue
                entries = parse_journal_json(result.stdout, node.name, name)
                cursors = [e.cursor for e in entries if e.cursor]
                if cursors:
                    self.cursors[name] = cursors[-1]
                streams.append(entries if lines != 0 or name in self.seen else [])
                self.seen.add(name)
        except ConnectorError as exc:
            self.conns.pop(node.name, None)
            failures += [FetchFailure(node.name, s.instance.name, exc.reason) for s in sources]
        return streams, failures

    def read(self, since: str | None = None, lines: int | None = None) -> tuple[list[LogEntry], list[FetchFailure]]:
        by_node: dict[str, tuple[Node, list[LogSource]]] = {}
        for src in self.sources:
            by_node.setdefault(src.node.name, (src.node, []))[1].append(src)
        with ThreadPoolExecutor(max_workers=max(1, min(self.parallel, len(by_node)))) as pool:
            results = list(pool.map(lambda item: self._read_node(item[0], item[1], since, lines), by_node.values()))
        streams = [s for r in results for s in r[0]]
        failures = [f for r in results for f in r[1]]
        return merge(streams), failures

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()


def print_journal(
    reader: JournalReader,
    since: str | None,
    lines: int | None,
    follow: bool,
    interval: float,
    echo: Callable[[str], None],
    error: Callable[[str], None],
) -> int:
    """`bpdkv logs`: print the entries (and with `follow`, new ones every `interval` s until Ctrl-C); the exit code:
    1 when a host could not be read."""
    failed: set[str] = set()
    if follow:

        def stop(signum: int, frame: object) -> None:
            # Ctrl-C ends a follow at once: a read in flight on a slow host and the connections' closing are dropped,
            # not awaited (waiting on them took up to a keepalive bound, 15 s, in CI). Nothing is left half-written.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1 if failed else 0)

        signal.signal(signal.SIGINT, stop)
    try:
        entries, failures = reader.read(since, lines)
        while True:
            for entry in entries:
                echo(entry.format())
            for failure in failures:
                failed.add(failure.host)
                error(failure.format())
            if not follow:
                break
            time.sleep(interval)
            entries, failures = reader.read()
    except KeyboardInterrupt:
        pass
    finally:
        reader.close()
    return 1 if failed else 0
