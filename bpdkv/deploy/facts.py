"""Facts: what a node looks like, read-only. Each fact is a shell command run on the node plus a pure parser.

No SSH library here (tests check sys.modules): connectors run `command`, parsers turn its stdout into typed values, and
the parsers are tested on captured real outputs (tests/data/facts/*). Several facts travel in one round trip:
`batch_command` joins them behind markers and `split_batch` cuts the output back into one stdout per fact.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

MARKER = "==bpdkv-fact=="


@dataclass(frozen=True)
class PreflightProblem:
    """One reason a host may not be written: host, the fact that says so, what is wrong and what would be right."""

    host: str
    fact: str
    message: str

    def line(self) -> str:
        return f"{self.host}: {self.fact}: {self.message}"


class Fact(Generic[T]):
    """A read-only question to a node. Subclasses set `name` and `command` and implement the pure `parse`."""

    name: str = ""
    command: str = ""

    def parse(self, stdout: str) -> T:  # pragma: no cover - abstract
        raise NotImplementedError


# ---- disk ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DiskSpace:
    path: str
    free_bytes: int
    read_only: bool


class DiskFree(Fact[list[DiskSpace]]):
    """Free space (POSIX `df -Pk`) and writability of the folders a deploy writes to."""

    name = "disk"

    def __init__(self, paths: Sequence[str]) -> None:
        self.paths = list(paths)
        quoted = " ".join(shlex.quote(p) for p in self.paths)
        # The deepest existing ancestor answers for a folder that does not exist yet; `test -w` on a read-only mount is
        # false even for root, which is exactly the early warning wanted.
        self.command = (
            f"for p in {quoted}; do d=$p; while [ ! -e \"$d\" ]; do d=$(dirname \"$d\"); done; "
            'if [ -w "$d" ] && touch "$d/.bpdkv-probe" 2>/dev/null; then rm -f "$d/.bpdkv-probe"; w=rw; else w=ro; fi; '
            'echo "path $w $p"; df -Pk "$d" | tail -n 1; done'
        )

    def parse(self, stdout: str) -> list[DiskSpace]:
        out: list[DiskSpace] = []
        current: tuple[str, bool] | None = None
        for line in stdout.splitlines():
            if line.startswith("path "):
                _, mode, path = line.split(" ", 2)
                current = (path, mode == "ro")
                continue
            fields = line.split()
            if current and len(fields) >= 6 and fields[3].isdigit():
                out.append(DiskSpace(current[0], int(fields[3]) * 1024, current[1]))
                current = None
        return out


# ---- ports -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Listener:
    port: int
    address: str
    process: str  # command name as ss reports it ("" when unknown)
    pid: int | None


_SS_USERS = re.compile(r'users:\(\("(?P<name>[^"]*)",pid=(?P<pid>\d+)')


class ListeningPorts(Fact[list[Listener]]):
    """TCP listeners (`ss -Htlnp`), to tell a free port from one taken by something that is not a bpdkv unit."""

    name = "ports"
    command = "ss -Htlnp 2>/dev/null || ss -tlnp 2>/dev/null | tail -n +2"

    def parse(self, stdout: str) -> list[Listener]:
        out: list[Listener] = []
        for line in stdout.splitlines():
            fields = line.split()
            if len(fields) < 4 or fields[0] != "LISTEN":
                continue
            local = fields[3]
            address, _, port = local.rpartition(":")
            if not port.isdigit():
                continue
            match = _SS_USERS.search(line)
            out.append(
                Listener(
                    int(port), address.strip("[]"), match.group("name") if match else "", int(match.group("pid")) if match else None
                )
            )
        return out


# ---- limits ----------------------------------------------------------------------------------------------------


class MemlockLimit(Fact[int | None]):
    """`ulimit -l` of a login shell in KiB; None means unlimited (what NIXL's memory registration wants)."""

    name = "ulimit -l"
    command = "ulimit -l"

    def parse(self, stdout: str) -> int | None:
        value = stdout.strip().splitlines()[-1].strip() if stdout.strip() else ""
        if value == "unlimited":
            return None
        if not value.isdigit():
            raise ValueError(f"ulimit -l printed {value!r}, expected a number or 'unlimited'")
        return int(value)


# ---- units -----------------------------------------------------------------------------------------------------


class UnitStates(Fact[dict[str, str]]):
    """`systemctl is-active` for several units in one process: one state per line, in the order asked."""

    name = "units"

    def __init__(self, units: Sequence[str]) -> None:
        self.units = list(units)
        self.command = "systemctl is-active " + " ".join(shlex.quote(u) for u in self.units) + " 2>/dev/null; true"

    def parse(self, stdout: str) -> dict[str, str]:
        states = [line.strip() for line in stdout.splitlines() if line.strip()]
        return {u: (states[i] if i < len(states) else "unknown") for i, u in enumerate(self.units)}


# ---- batching --------------------------------------------------------------------------------------------------


def batch_command(facts: Sequence[Fact[object]]) -> str:
    """One shell text that runs every fact, each behind a marker line, each in its own subshell (a failing one does
    not stop the others)."""
    parts = [f"echo {MARKER}{i}; ( {f.command} ) 2>&1" for i, f in enumerate(facts)]
    return "; ".join(parts) + "; true"


def split_batch(stdout: str, count: int) -> list[str]:
    outputs = [""] * count
    current: int | None = None
    buffer: list[str] = []
    for line in stdout.splitlines(keepends=True):
        if line.startswith(MARKER):
            if current is not None:
                outputs[current] = "".join(buffer)
            current = int(line[len(MARKER) :].strip())
            buffer = []
        elif current is not None:
            buffer.append(line)
    if current is not None:
        outputs[current] = "".join(buffer)
    return outputs
