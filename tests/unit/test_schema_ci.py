"""Schema validation in editors and CI: `bpdkv schema`, init's modeline, `validate --output github`, the pre-commit hook."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import yaml
from click.testing import CliRunner

from bpdkv.cli import main
from tests.conftest import DATA, ROOT


def _editor_validator() -> jsonschema.Draft202012Validator:
    result = CliRunner().invoke(main, ["schema"])
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_schema_accepts_examples_as_written_and_flags_typos() -> None:
    validator = _editor_validator()
    for example in sorted((ROOT / "examples").glob("*.yaml")):
        assert list(validator.iter_errors(yaml.safe_load(example.read_text()))) == [], example.name
    typo = yaml.safe_load((DATA / "bad" / "unknown-instance-key.yaml").read_text())
    assert any("Additional properties" in e.message for e in validator.iter_errors(typo))
    # Without a profile, model (with its id) is required; with one, the profile provides it.
    assert any(
        "'model' is a required property" in e.message for e in validator.iter_errors({"apiVersion": "bpdkv/v1", "name": "x", "nodes": []})
    )


def test_init_writes_modeline_and_schema_beside_the_file(tmp_path: Path) -> None:
    out = tmp_path / "fleet.yaml"
    result = CliRunner().invoke(main, ["init", "--name", "f", "--model", "qwen3-8b", "--hardware", "p5en.48xlarge", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text().splitlines()[0] == "# yaml-language-server: $schema=topology.schema.json"
    schema = json.loads((tmp_path / "topology.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(yaml.safe_load(out.read_text()))
    # A user's own file of that name is left alone.
    other = tmp_path / "sub"
    other.mkdir()
    (other / "topology.schema.json").write_text('{"title": "mine"}')
    CliRunner().invoke(main, ["init", "--name", "f", "--model", "qwen3-8b", "--hardware", "cpu", "-o", str(other / "t.yaml")])
    assert (other / "topology.schema.json").read_text() == '{"title": "mine"}'


def test_init_picks_smallest_tp_that_fits() -> None:
    text = CliRunner().invoke(main, ["init", "--name", "g", "--model", "glm-5-fp8", "--hardware", "p5en.48xlarge"]).stdout
    assert "{role: prefill, gpus: [0, 1, 2, 3, 4, 5, 6, 7], tp: 8}" in text
    text = CliRunner().invoke(main, ["init", "--name", "q", "--model", "qwen3-32b", "--hardware", "p4d.24xlarge"]).stdout
    assert "{role: prefill, gpus: [0, 1, 2, 3], tp: 4}" in text and "{role: decode, gpus: [0, 1, 2, 3], tp: 4}" in text
    refused = CliRunner().invoke(main, ["init", "--name", "g", "--model", "glm-5-fp8", "--hardware", "p5en.48xlarge", "--prefill-tp", "1"])
    assert refused.exit_code == 1 and "tp 1 on H200-141GB): weights need 692.9 GiB per GPU" in refused.output


def test_validate_github_annotations() -> None:
    bad = DATA / "bad" / "many-errors.yaml"
    result = CliRunner().invoke(main, ["validate", "--output", "github", str(bad), str(ROOT / "examples" / "local-cpu.yaml")])
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0] == (
        f"::error file={bad},line=5,col=10,title=bpdkv validate::router.session_ttl: router session_ttl 60 s is not below "
        "decoder_kv_blocks_ttl 30 s minus ttl_margin 10 s; use <= 20 or omit it to derive it"
    )
    assert sum(line.startswith("::error ") for line in lines) == 4
    assert lines[-1].endswith("local-cpu.yaml: valid")


def test_github_annotation_escapes_workflow_command_characters() -> None:
    from bpdkv.errors import Diagnostic
    from bpdkv.topology.report import github_annotation

    d = Diagnostic("50% of a,b: c", path="x", file="a:b,c.yaml", line=1, column=2, severity="warning")
    assert github_annotation(d, "f") == "::warning file=a%3Ab%2Cc.yaml,line=1,col=2,title=bpdkv validate::x: 50%25 of a,b: c"


def test_validate_several_files_json() -> None:
    result = CliRunner().invoke(
        main, ["validate", "--output", "json", str(ROOT / "examples" / "local-cpu.yaml"), str(DATA / "bad" / "no-router.yaml")]
    )
    assert result.exit_code == 1
    reports = json.loads(result.stdout)
    assert [r["valid"] for r in reports] == [True, False]


def _source_copy(dest: Path) -> Path:
    """The files a pip install of bpdkv needs, as a committed git repository (what pre-commit installs hooks from)."""
    for name in ("bpdkv", "templates", "schemas", "profiles", "examples"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for name in ("pyproject.toml", "README.md", ".pre-commit-hooks.yaml"):
        shutil.copy2(ROOT / name, dest / name)
    _git(dest, "init", "-q")
    _git(dest, "add", "-A")
    _git(dest, "-c", "user.email=ci@bpdkv", "-c", "user.name=ci", "commit", "-qm", "bpdkv")
    return dest


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.mark.slow
def test_pre_commit_hook_with_try_repo(tmp_path: Path) -> None:
    """pre-commit installs bpdkv from the repository (pip, local indexes only) and runs the hook on a user's repo."""
    hooks = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    assert [h["id"] for h in hooks] == ["bpdkv-validate"] and hooks[0]["language"] == "python"
    source = _source_copy(tmp_path / "bpdkv-src")
    user = tmp_path / "user"
    user.mkdir()
    _git(user, "init", "-q")
    shutil.copy2(ROOT / "examples" / "local-cpu.yaml", user / "fleet-topology.yaml")
    shutil.copy2(DATA / "bad" / "many-errors.yaml", user / "bad-topology.yaml")
    (user / "notes.yaml").write_text("not: [a topology\n")  # outside the hook's files pattern: never validated
    _git(user, "add", "-A")
    env = dict(os.environ, PRE_COMMIT_HOME=str(tmp_path / "cache"), PRE_COMMIT_COLOR="never")

    def try_repo(*files: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "pre_commit", "try-repo", str(source), "bpdkv-validate", "--files", *files]
        return subprocess.run(cmd, cwd=user, env=env, capture_output=True, text=True, timeout=600)

    start = time.monotonic()
    bad = try_repo("fleet-topology.yaml", "bad-topology.yaml", "notes.yaml")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "bad-topology.yaml:12:24: nodes[0].instances[1].gpus: GPU 9 does not exist" in bad.stdout
    assert "fleet-topology.yaml: valid" in bad.stdout and "notes.yaml" not in bad.stdout.split("=====")[-1]
    good = try_repo("fleet-topology.yaml")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "Passed" in good.stdout
    print(f"pre-commit try-repo: {time.monotonic() - start:.0f} s including the hook environment's install")


def test_docs_annotated_example_matches_the_schema() -> None:
    text = (ROOT / "docs" / "topology.md").read_text()
    block = text.split("## Full annotated example\n```yaml\n", 1)[1].split("```", 1)[0]
    assert list(_editor_validator().iter_errors(yaml.safe_load(block))) == []
