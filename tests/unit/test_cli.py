"""CLI behaviour: validate/render/init/profiles, exit codes, nothing written on failure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from bpdkv.cli import main
from bpdkv.topology.profiles import list_profiles
from bpdkv.topology.validate import load_topology
from tests.conftest import DATA, ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate(example: Path) -> None:
    result = CliRunner().invoke(main, ["validate", str(example)])
    assert result.exit_code == 0, result.output
    assert "valid" in result.output


def test_validate_json_ok() -> None:
    result = CliRunner().invoke(main, ["validate", str(ROOT / "examples" / "p5en-qwen3-32b.yaml"), "--output", "json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["valid"] is True and report["errors"] == []
    assert report["summary"] == {"name": "qwen3-32b-p5en", "nodes": 2, "prefill": 4, "decode": 2, "router": 1}


def test_warnings_are_separate_from_errors(tmp_path: Path) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "h200x2-qwen3-8b.yaml").read_text())
    doc["model"]["block_size"] = 16
    doc["nodes"][0]["instances"][0]["extra_args"] = ["--no-enable-prefix-caching"]
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(main, ["validate", str(path), "--output", "json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 0 and report["valid"]
    messages = [w["message"] for w in report["warnings"]]
    assert any("descriptor-bound" in m for m in messages)
    assert any("prefix caching is off" in m for m in messages)


def test_render_writes_per_host_folders(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["render", str(ROOT / "examples" / "local-cpu.yaml"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["_observability", "host1", "host2", "host3"]  # + the operator's monitoring
    unit = out / "host2" / "etc/systemd/system/bpdkv-decode-0.service"
    assert unit.is_file()
    assert (out / "host2" / "opt/bpdkv/bin/decode-0.sh").stat().st_mode & 0o777 == 0o755
    assert (out / "host2" / "etc/bpdkv/decode-0.env").stat().st_mode & 0o777 == 0o600
    assert (out / "host3" / "etc/bpdkv/router-0.router.yaml").is_file()


def test_render_writes_nothing_when_invalid(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["render", str(DATA / "bad" / "gpu-shared.yaml"), "--out", str(out)])
    assert result.exit_code == 1
    assert "GPU 0 is also used" in result.output
    assert not out.exists()


def test_render_refuses_file_as_out(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    result = CliRunner().invoke(main, ["render", str(ROOT / "examples" / "local-cpu.yaml"), "--out", str(f)])
    assert result.exit_code != 0 and "Traceback" not in result.output


@pytest.mark.parametrize("model", [p.name for p in list_profiles("models")])
@pytest.mark.parametrize("hardware", [p.name for p in list_profiles("hardware")])
def test_init_scaffolds_validate_for_every_profile_pair(model: str, hardware: str, tmp_path: Path) -> None:
    # TP defaults to the smallest that fits (capacity model); models whose FP8 weights exceed a whole node are refused.
    args = ["init", "--name", "scaffold", "--model", model, "--hardware", hardware, "--prefill", "3", "--decode", "2"]
    out = tmp_path / "t.yaml"
    result = CliRunner().invoke(main, args + ["-o", str(out)])
    if model in ("deepseek-r1", "glm-5-fp8") and hardware in ("p4d.24xlarge", "p5.48xlarge"):
        assert result.exit_code == 1 and f"model '{model}' does not fit one {hardware} node at any tp" in result.output
        assert "Traceback" not in result.output and not out.exists()
        return
    assert result.exit_code == 0, result.output
    validated = load_topology(out)
    assert len(validated.topology.instances("prefill")) == 3
    assert len(validated.topology.instances("decode")) == 2
    # refuses to overwrite without --force
    again = CliRunner().invoke(main, args + ["-o", str(out)])
    assert again.exit_code == 1 and "--force" in again.output


def test_init_unknown_profile_suggests() -> None:
    result = CliRunner().invoke(main, ["init", "--name", "x", "--model", "qwen3-32", "--hardware", "cpu"])
    assert result.exit_code == 1 and "did you mean 'qwen3-32b'" in result.output


def test_profiles_list_and_show() -> None:
    listed = CliRunner().invoke(main, ["profiles", "list"])
    assert listed.exit_code == 0
    for ref in list_profiles("models") + list_profiles("hardware"):
        assert ref.name in listed.output
    shown = CliRunner().invoke(main, ["profiles", "show", "p5en.48xlarge"])
    assert shown.exit_code == 0 and "efa_devices: 16" in shown.output and "#" in shown.output
    missing = CliRunner().invoke(main, ["profiles", "show", "p5en"])
    assert missing.exit_code == 1 and "unknown profile" in missing.output


def test_demo_without_the_lab_service_manager_says_so_in_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Root, but bpdkv installed without its `lab` extra: one line naming what is missing, exit 1, nothing built first."""
    import bpdkv.demo
    import bpdkv.lab.hosts

    monkeypatch.setattr(bpdkv.demo, "can_run_locally", lambda: None)
    monkeypatch.setattr(bpdkv.lab.hosts.os, "geteuid", lambda: 0)
    monkeypatch.setattr(bpdkv.lab.hosts.shutil, "which", lambda tool: "/usr/bin/" + tool)
    monkeypatch.setattr(bpdkv.lab.hosts, "_systemctl_replacement", lambda: None)
    built: list[object] = []
    monkeypatch.setattr(bpdkv.demo, "build_tiny_model", lambda *a: built.append(a))
    python = tmp_path / "python"
    python.write_text("")
    result = CliRunner().invoke(main, ["demo", "--vllm-python", str(python)])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.output.strip().splitlines() == [
        "the test hosts cannot start: the test hosts' service manager (docker-systemctl-replacement) is missing: pip install 'bpdkv[lab]'"
    ]
    assert built == []


def test_demo_without_root_explains_and_shows_the_offline_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    import bpdkv.demo

    monkeypatch.setattr(bpdkv.demo.os, "geteuid", lambda: 1000)
    result = CliRunner().invoke(main, ["demo"])
    assert result.exit_code == 0, result.output
    assert "the live demo cannot run here: test hosts need root" in result.output
    assert "plan for topology local-cpu" in result.output and "install package bpdkv" in result.output


def test_demo_names_the_system_packages_it_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    """As root with sshd and nsenter absent: one line naming the Debian packages and both ways to get them; --install
    without apt-get says what to install instead of failing later."""
    import bpdkv.demo

    real_which = bpdkv.demo.shutil.which
    monkeypatch.setattr(bpdkv.demo.os, "geteuid", lambda: 0)
    monkeypatch.setattr(
        bpdkv.demo.shutil, "which", lambda tool: None if tool in ("nsenter", "/usr/sbin/sshd", "apt-get") else real_which(tool)
    )
    monkeypatch.setattr(bpdkv.demo, "Path", lambda p: Path("/nonexistent") / str(p).lstrip("/"))
    assert bpdkv.demo.missing_system_packages() == ["util-linux", "openssh-server"]
    assert bpdkv.demo.can_run_locally() == (
        "missing util-linux openssh-server: run `sudo bpdkv demo --install`, or apt-get install -y util-linux openssh-server"
    )
    result = CliRunner().invoke(main, ["demo", "--install"])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        "the demo needs util-linux openssh-server: install them with this system's package manager, then run again"
    ]
