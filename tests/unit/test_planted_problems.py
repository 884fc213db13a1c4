"""Validation is all at once: in each planted-*.yaml of tests/data/bad, every planted problem is reported in one run.

A fixture marks each problem it plants on the line the error must point at (`# planted: <part of the message>`);
the schema-invalid and the semantically invalid sit side by side, in nodes and in EC2 node groups. `bpdkv validate`
must report each one as one line `file:line:col: path: message`, nothing else, exit 1 and no traceback.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bpdkv.cli import main
from bpdkv.errors import BpdkvError
from bpdkv.topology.validate import SKIPPED_ALL, validate_document
from bpdkv.topology.yaml_source import PathKey, parse_yaml
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


ODD = [None, -1, 0, 9, 70000, "", "Bad_Name", "a b", "p9.x", "tag:Name", "10.0.0.1", [], {}, [0, 0], {"a": 1}, True, 1.5]


def _paths(value: Any, path: PathKey = ()) -> list[PathKey]:
    out = [path] if path else []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    for key, child in items:
        out += _paths(child, path + (key,))
    return out


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_planted_fixtures_mutated_never_crash(data: st.DataObject) -> None:
    """Setting aside parts must cope with whatever is left: odd values or keys removed anywhere, never a traceback."""
    doc = yaml.safe_load((DATA / "bad" / data.draw(st.sampled_from(PLANTED))).read_text())
    for _ in range(data.draw(st.integers(1, 4))):
        path = data.draw(st.sampled_from(_paths(doc)))
        parent = doc
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict) and data.draw(st.booleans()):
            del parent[path[-1]]
        else:
            parent[path[-1]] = copy.deepcopy(data.draw(st.sampled_from(ODD)))
    try:
        validate_document(parse_yaml(yaml.safe_dump(doc), "mutated.yaml"))
    except BpdkvError:
        pass
