"""Ending the servers tests and benchmarks start: by their own process group, politely first; and, as a backstop,
every process a run left behind (its descendants), read from /proc."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the process group of `proc` (started with start_new_session=True), SIGKILL it after `grace` seconds."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def _parents(proc: Path = Path("/proc")) -> dict[int, int]:
    """pid → parent pid of every process now (Linux /proc; empty elsewhere)."""
    out: dict[int, int] = {}
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; the last ")" ends it.
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1 and fields[0] != "Z":  # a zombie is already ended (its parent has yet to reap it)
            out[int(entry.name)] = int(fields[1])
    return out


def descendants(pid: int) -> list[int]:
    """Every living process below `pid` (children first, then theirs), whatever session or group they started."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    todo = list(children.get(pid, []))
    while todo:
        nxt = todo.pop(0)
        found.append(nxt)
        todo.extend(children.get(nxt, []))
    return found


def end_descendants(pid: int, grace: float = 10.0) -> list[int]:
    """SIGTERM every descendant of `pid`, SIGKILL those left after `grace` seconds; returns the pids that were found.
    For a run being stopped (SIGTERM, Ctrl-C) or one that leaked a server: nothing it started may outlive it. The tree
    is read again after each round of signals: a process started meanwhile (a server starting up) is ended too."""
    found: list[int] = []
    deadline = time.monotonic() + grace
    while True:
        alive = descendants(pid)
        fresh = [p for p in alive if p not in found]
        found += fresh
        if not alive:
            return found
        late = time.monotonic() >= deadline
        for p in alive if late else fresh:
            try:
                os.kill(p, signal.SIGKILL if late else signal.SIGTERM)
            except OSError:
                pass
        if late and time.monotonic() >= deadline + 10:
            return found  # unkillable (D state): give up rather than hang the run
        time.sleep(0.1)
