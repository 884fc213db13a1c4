"""Plan output (issue 42 items 3 and 7): a failed host is one line; lines wrap at word boundaries of a terminal's width
and are never wrapped in a pipe."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
from click.testing import CliRunner

from bpdkv import printing
from bpdkv.cli import main
from bpdkv.deploy.fleet import connect, plan_topology
from tests.conftest import ROOT

EXAMPLE = str(ROOT / "examples" / "p5en-qwen3-32b.yaml")
LONG_LINE = "  install package nixl: (none) → 1.5.1 (tested with vllm 0.34.0; UCX 1.23.0 inside)"  # 86 columns
BPDKV = Path(sys.executable).parent / "bpdkv"


def test_a_pipe_gets_whole_lines_whatever_columns_says(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    result = CliRunner().invoke(main, ["plan", "--offline", EXAMPLE])
    lines = result.stdout.splitlines()
    assert LONG_LINE in lines, result.stdout  # before: "...(tested \nwith vllm ..." at 40 (or 80) columns
    assert "  + /etc/systemd/system/bpdkv-prefill-0.service" in lines
    assert all(line == line.rstrip() for line in lines)


def on_a_terminal(columns: int) -> str:
    """`bpdkv plan --offline` with stdout on a real pseudo-terminal of `columns` columns; its text without colours."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES", "NO_COLOR", "FORCE_COLOR", "TTY_COMPATIBLE")}
    proc = subprocess.Popen([str(BPDKV), "plan", "--offline", EXAMPLE], stdout=follower, stderr=subprocess.DEVNULL, env=env)
    os.close(follower)
    out = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(leader)
    assert proc.wait(timeout=60) in (0, 2)
    return re.sub(r"\x1b\[[0-9;]*m", "", out.decode()).replace("\r\n", "\n")


def test_a_terminal_gets_lines_wrapped_at_its_width_between_words() -> None:
    piped = subprocess.run([str(BPDKV), "plan", "--offline", EXAMPLE], capture_output=True, text=True, timeout=60).stdout
    shown = on_a_terminal(50)
    lines = shown.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 50
    assert LONG_LINE not in lines and "  install package nixl: (none) → 1.5.1 (tested" in [line.rstrip() for line in lines]
    assert shown.split() == piped.split()  # the same words: broken only at spaces, nothing cut


def test_an_unreachable_host_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    plan, _ = plan_topology(EXAMPLE, True, 1, connect(), (), None)
    error = "unreachable: ubuntu@10.0.0.12:22: proxy_command exited 1 (nothing on its stderr)"
    hosts = [dataclasses.replace(h, reachable=False, error=error) if h.host == "p5en-b" else h for h in plan.hosts]
    printing.print_plan_result(dataclasses.replace(plan, hosts=hosts), "text", False, None)
    out, err = capsys.readouterr()
    naming = [line for line in (out + err).splitlines() if "p5en-b" in line or "10.0.0.12" in line]
    assert naming == [f"p5en-b: reachable: {error}"], naming  # before: also "p5en-b (10.0.0.12): error: unreachable: ..."
    assert err.splitlines() == naming
    assert "p5en-a (10.0.0.11)" in out.splitlines()  # the reachable host is planned as usual


def test_a_preflight_problem_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from bpdkv.deploy.facts import PreflightProblem

    plan, _ = plan_topology(EXAMPLE, True, 1, connect(), (), None)
    problem = PreflightProblem("p5en-a", "disk", "/etc/bpdkv: 1 MB free, 2 MB needed")
    hosts = [dataclasses.replace(h, problems=[problem]) if h.host == "p5en-a" else h for h in plan.hosts]
    printing.print_plan_result(dataclasses.replace(plan, hosts=hosts), "text", False, None)
    out, err = capsys.readouterr()
    assert [line for line in (out + err).splitlines() if "MB free" in line] == ["p5en-a: disk: /etc/bpdkv: 1 MB free, 2 MB needed"]
