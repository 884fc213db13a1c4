"""Every bad fixture fails with its expected one-line errors; arbitrary input never gives a traceback."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bpdkv.cli import main
from bpdkv.errors import InvalidTopology
from bpdkv.topology.validate import SKIPPED_ALL, load_topology, validate_document
from bpdkv.topology.yaml_source import parse_yaml
from tests.conftest import DATA, ROOT

BAD = DATA / "bad"
EXPECTED = BAD / "expected.json"
FIXTURES = sorted(p.name for p in BAD.glob("*.yaml"))


def _errors(name: str) -> list[str]:
    rel = f"tests/data/bad/{name}"
    try:
        load_topology(ROOT / rel, rel)
    except InvalidTopology as exc:
        return exc.lines()
    return []


def test_enough_fixtures() -> None:
    assert len(FIXTURES) >= 40


def test_expected_file_matches_fixtures(regen: bool) -> None:
    if regen:
        EXPECTED.write_text(json.dumps({n: _errors(n) for n in FIXTURES}, indent=2, ensure_ascii=False) + "\n")
    expected = json.loads(EXPECTED.read_text())
    assert sorted(expected) == FIXTURES, "run pytest --regen and review tests/data/bad/expected.json"


@pytest.mark.parametrize("name", FIXTURES)
def test_bad_fixture(name: str) -> None:
    expected = json.loads(EXPECTED.read_text())[name]
    assert expected, f"{name} has no expected errors; every bad fixture must fail"
    assert _errors(name) == expected


@pytest.mark.parametrize("name", FIXTURES)
def test_cli_reports_bad_fixture_in_one_line_each(name: str) -> None:
    rel = f"tests/data/bad/{name}"
    result = CliRunner().invoke(main, ["validate", str(ROOT / rel)])
    assert result.exit_code == 1
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if ": warning: " not in line and not line.endswith("error(s)")]
    assert len(errors) == len(json.loads(EXPECTED.read_text())[name])


def test_json_output_lists_all_errors() -> None:
    result = CliRunner().invoke(main, ["validate", str(BAD / "loopback-side-channel.yaml"), "--output", "json"])
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert report["valid"] is False
    assert [e["line"] for e in report["errors"]] == [7, 13]
    assert all(e["severity"] == "error" for e in report["errors"])


def test_all_problems_reported_at_once() -> None:
    lines = _errors("many-errors.yaml")
    assert [line.split(": ")[0].rsplit(":", 2)[1] for line in lines] == ["5", "12", "12", "13"]  # sorted by line
    joined = "\n".join(lines)
    for part in ("session_ttl 60", "decode tp 1 < prefill tp 2", "GPU 9 does not exist", "HTTP port 8000 collides"):
        assert part in joined


def test_huge_file_refused(tmp_path: Path) -> None:
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (10 * 1024 * 1024) + "\n")
    with pytest.raises(InvalidTopology, match="a topology must be under"):
        load_topology(big)


def test_directory_and_missing_path(tmp_path: Path) -> None:
    for path, message in ((tmp_path, "is a directory"), (tmp_path / "nope.yaml", "no such file")):
        result = CliRunner().invoke(main, ["validate", str(path)])
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output


def test_yaml_bomb_refused_quickly() -> None:
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 9):
        levels.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    start = time.perf_counter()
    with pytest.raises(InvalidTopology, match="alias bomb"):
        parse_yaml("\n".join(levels) + "\n", "bomb.yaml")
    # 10^9 values if expanded; refusing must not depend on expanding them.
    assert time.perf_counter() - start < 5


def test_deep_nesting_refused() -> None:
    with pytest.raises(InvalidTopology, match="nesting deeper"):
        parse_yaml("a: " + "[" * 200 + "]" * 200 + "\n", "deep.yaml")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=30,
)
plausible_keys = st.sampled_from(
    ["apiVersion", "name", "model", "nodes", "profile", "kv_transfer", "router", "instances", "role", "gpus", "host"]
)
plausible = st.recursive(
    st.none() | st.integers(-5, 70000) | st.sampled_from(["bpdkv/v1", "prefill", "decode", "router", "qwen3-8b", "cpu", "a"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(plausible_keys, children, max_size=6),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(json_values, plausible))
def test_arbitrary_documents_only_produce_errors(doc: object) -> None:
    text = yaml.safe_dump(doc)
    try:
        validate_document(parse_yaml(text, "fuzz.yaml"))
    except InvalidTopology as exc:
        assert exc.lines() and all("\n" not in line for line in exc.lines())


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_only_produces_errors(text: str) -> None:
    try:
        validate_document(parse_yaml(text, "fuzz.yaml"))
    except InvalidTopology as exc:
        assert exc.lines()


def test_schema_errors_do_not_hide_semantic_errors() -> None:
    """A bad instance, an unknown key and an unknown preset are reported together with the other parts' problems."""
    joined = "\n".join(_errors("schema-and-semantic.yaml"))
    for part in ("expected an integer", "GPU 9 does not exist", "'-dp'", "HTTP port 8000 collides", "unknown key 'prot'", "'p5.48xlarg'"):
        assert part in joined
    # The dropped parts produce no follow-on noise: node b (unknown preset) is not checked, prefill-0 (bad tp) neither.
    assert "lists no GPUs" not in joined and "no decode instance" not in joined


def test_parts_left_out_of_the_semantic_checks_are_named() -> None:
    """A part that fails the schema is not silently unchecked: one warning says which checks were skipped for it."""
    rel = "tests/data/bad/schema-and-semantic.yaml"
    with pytest.raises(InvalidTopology) as info:
        load_topology(ROOT / rel, rel)
    warnings = [w.format() for w in info.value.warnings]
    assert warnings == [
        f"{rel}:10:9: warning: nodes[0].instances[0]: instance not checked further until its errors are fixed: "
        "its GPU, port, P/D and capacity checks were skipped",
        f"{rel}:17:5: warning: nodes[1].instances: the node's instances not checked until its errors are fixed: "
        "their GPU, port, P/D and capacity checks were skipped",
    ]
    result = CliRunner().invoke(main, ["validate", str(ROOT / rel), "--output", "json"])
    assert [(w["path"], w["line"]) for w in json.loads(result.stdout)["warnings"]] == [
        ("nodes[0].instances[0]", 10),
        ("nodes[1].instances", 17),
    ]


def test_nothing_checkable_says_semantic_checks_were_skipped() -> None:
    rel = "tests/data/bad/missing-nodes.yaml"
    with pytest.raises(InvalidTopology) as info:
        load_topology(ROOT / rel, rel)
    assert [w.message for w in info.value.warnings] == [SKIPPED_ALL]


def test_one_of_failure_is_one_line() -> None:
    """oneOf/anyOf: the best-matching branch's error (or one combined line), never one line per branch."""
    lines = _errors("one-of-branches.yaml")
    assert [line.split(": ", 1)[1] for line in lines] == [
        "router.workers: expected an integer or 'auto', got str 'fast'",
        "router.tls.cert: str 'relative/cert.pem' is not valid; expected an absolute path",
        "router.tls.key.secret: expected a mapping, got int 5",
    ]


@pytest.mark.parametrize(
    ("router", "line"),
    [
        ("{workers: 0}", "router.workers: must be >= 1, got 0"),
        ("{admin_key: {secret: {}}}", "router.admin_key.secret: needs exactly one of: env, file, aws_secretsmanager, ssm"),
        (
            "{admin_key: {secret: {env: A, file: b}}}",
            "router.admin_key.secret: needs exactly one of: env, file, aws_secretsmanager, ssm (got env and file)",
        ),
    ],
)
def test_one_of_picks_the_branch_that_fits(tmp_path: Path, router: str, line: str) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text(
        f"apiVersion: bpdkv/v1\nname: t\nmodel: {{id: m/x}}\nrouter: {router}\nnodes:\n  - name: a\n    host: h\n"
        "    hardware: generic-gpu\n    instances:\n      - {role: prefill, gpus: [0]}\n      - {role: decode, gpus: [1]}\n"
        "      - {role: router}\n"
    )
    with pytest.raises(InvalidTopology) as info:
        load_topology(bad, "t.yaml")
    assert [text.split(": ", 1)[1] for text in info.value.lines()] == [line]


def test_dropped_instance_keeps_original_positions(tmp_path: Path) -> None:
    bad = tmp_path / "t.yaml"
    bad.write_text(
        "apiVersion: bpdkv/v1\nname: t\nmodel: {id: m/x}\nnodes:\n  - name: a\n    host: h\n    hardware: generic-gpu\n"
        "    instances:\n      - {role: prefill, gpus: [0], dp: 0}\n      - {role: decode, gpus: [0, 1], tp: 1}\n      - {role: router}\n"
    )
    with pytest.raises(InvalidTopology) as info:
        load_topology(bad, "t.yaml")
    lines = info.value.lines()
    assert lines[0].startswith("t.yaml:9:") and "must be >= 1" in lines[0]
    # decode-0 is the second item in the file even though the broken first one was dropped before checking.
    assert any(line.startswith("t.yaml:10:") and "nodes[0].instances[1]" in line and "tp*dp" in line for line in lines)
