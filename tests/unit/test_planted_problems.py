"""Validation is all at once: in each planted-*.yaml of tests/data/bad, every planted problem is reported in one run.

A fixture marks each problem it plants on the line the error must point at (`# planted: <part of the message>`);
the schema-invalid and the semantically invalid sit side by side, in nodes and in EC2 node groups. `bpdkv validate`
must report each one as one line `file:line:col: path: message`, nothing else, exit 1 and no traceback.
"""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from bpdkv.cli import main
from bpdkv.topology.validate import SKIPPED_ALL
from tests.conftest import DATA, ROOT

PLANTED = sorted(p.name for p in (DATA / "bad").glob("planted-*.yaml"))
MARK = re.compile(r"#\s*planted:\s*(.+?)\s*$")


def planted(name: str) -> list[tuple[int, str]]:
    """(line, part of the message) for every problem the fixture plants."""
    lines = (DATA / "bad" / name).read_text(encoding="utf-8").splitlines()
    return [(n, m.group(1)) for n, line in enumerate(lines, start=1) if (m := MARK.search(line))]


def test_corpus() -> None:
    assert len(PLANTED) >= 5
    for name in PLANTED:
        assert len(planted(name)) >= 5, name
    text = "".join((DATA / "bad" / name).read_text() for name in PLANTED)
    assert "node_groups:" in text and "nodes:" in text


@pytest.mark.parametrize("name", PLANTED)
def test_every_planted_problem_in_one_run(name: str) -> None:
    rel = f"tests/data/bad/{name}"
    result = CliRunner().invoke(main, ["validate", str(ROOT / rel)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    assert SKIPPED_ALL not in result.output
    where = re.escape(str(ROOT / rel))
    errors = [line for line in result.output.splitlines() if ": warning: " not in line and not line.endswith("error(s)")]
    shape = re.compile(rf"^{where}:(\d+):(\d+): (\S+): (.+)$")
    found = []
    for line in errors:
        match = shape.match(line)
        assert match, f"not one located line: {line!r}"
        found.append((int(match.group(1)), match.group(4)))
    missing = [(n, text) for n, text in planted(name) if not any(line == n and text in message for line, message in found)]
    assert not missing, f"planted but not reported: {missing}\n{result.output}"
    assert len(found) == len(planted(name)), f"reported but not planted:\n{result.output}"
