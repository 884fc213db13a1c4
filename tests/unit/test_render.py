"""Rendered files: golden per example × profile, systemd-analyze clean, quoting survives any value."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft202012Validator

from bpdkv import contracts
from bpdkv.init import InitRequest, scaffold_topology
from bpdkv.render import Artifact, kv_transfer_config, render_topology
from bpdkv.topology.profiles import list_profiles
from bpdkv.topology.validate import load_topology, validate_document
from bpdkv.topology.yaml_source import parse_yaml
from tests.conftest import DATA, ROOT

GOLDEN = DATA / "golden"
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.yaml"))
MODEL_PROFILES = [p.name for p in list_profiles("models")]


def _hardware_for(model: str) -> str:
    return "cpu" if model == "tiny-cpu" else "p5en.48xlarge"


def _case_artifacts(case: str) -> tuple[str, list[Artifact]]:
    kind, name = case.split(":", 1)
    if kind == "example":
        return name.removesuffix(".yaml"), render_topology(load_topology(ROOT / "examples" / name).topology)
    text = scaffold_topology(InitRequest(f"init-{name}".replace(".", "-"), name, _hardware_for(name), 2, 1))  # TP: smallest that fits
    return f"profile-{name}", render_topology(validate_document(parse_yaml(text, name)).topology)


CASES = [f"example:{e}" for e in EXAMPLES] + [f"profile:{m}" for m in MODEL_PROFILES]


@pytest.mark.parametrize("case", CASES)
def test_golden(case: str, regen: bool) -> None:
    folder, artifacts = _case_artifacts(case)
    expected_dir = GOLDEN / folder
    rendered = {f"{a.host}{a.path}": a for a in artifacts}
    if regen:
        shutil.rmtree(expected_dir, ignore_errors=True)
        for key, art in rendered.items():
            target = expected_dir / key
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(art.content)
    on_disk = {str(p.relative_to(expected_dir)).replace(os.sep, "/"): p for p in expected_dir.rglob("*") if p.is_file()}
    assert sorted(on_disk) == sorted(rendered), "run pytest --regen and review the diff"
    for key, path in on_disk.items():
        assert rendered[key].content == path.read_text(), f"{key} differs from golden; run pytest --regen and review"


def _verify_host(tmp_path: Path, artifacts: list[Artifact]) -> None:
    """systemd-analyze verify each unit inside a root holding the host's files and the system's own units."""
    if not shutil.which("systemd-analyze"):
        pytest.fail("systemd-analyze missing: apt-get install -y systemd")
    by_host: dict[str, list[Artifact]] = {}
    for art in artifacts:
        by_host.setdefault(art.host, []).append(art)
    for host, arts in by_host.items():
        root = tmp_path / host
        shutil.copytree("/usr/lib/systemd/system", root / "usr/lib/systemd/system", symlinks=True, dirs_exist_ok=True)
        for art in arts:
            target = root / art.path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(art.content)
            target.chmod(art.mode)
        for art in arts:
            if art.unit:
                proc = subprocess.run(
                    ["systemd-analyze", "verify", f"--root={root}", art.path.lstrip("/")],
                    cwd=root,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert proc.returncode == 0, proc.stderr
                assert proc.stderr == "", f"{host}:{art.path}: {proc.stderr}"
            if art.path.endswith(".sh") or art.path.endswith(".env"):
                proc = subprocess.run(["sh", "-n", str(root / art.path.lstrip("/"))], capture_output=True, text=True)
                assert proc.returncode == 0, f"{art.path}: {proc.stderr}"


@pytest.mark.parametrize("case", CASES)
def test_units_pass_systemd_analyze_verify(case: str, tmp_path: Path) -> None:
    _, artifacts = _case_artifacts(case)
    assert any(a.unit for a in artifacts)
    _verify_host(tmp_path, artifacts)


def test_verify_catches_a_bad_directive(tmp_path: Path) -> None:
    # Guards the guard: misspelled keys only show on stderr with rc 0.
    _, artifacts = _case_artifacts("example:local-cpu.yaml")
    broken = [
        Artifact(a.host, a.path, a.mode, a.content.replace("Restart=on-failure", "Restrat=on-failure"), a.instance, a.unit)
        for a in artifacts
    ]
    with pytest.raises(AssertionError, match="Unknown key"):
        _verify_host(tmp_path, broken)


def test_units_give_their_service_a_private_tmp(tmp_path: Path) -> None:
    """vLLM's IPC sockets and the router's metrics files go to /tmp: systemd's own offline security review of each
    rendered unit must see PrivateTmp= in effect (and flag a unit without it)."""
    _, artifacts = _case_artifacts("example:local-cpu.yaml")
    units = [a for a in artifacts if a.unit]
    assert {a.instance for a in units} == {"prefill-0", "decode-0", "router-0"}

    def private_tmp_line(art: Artifact, content: str) -> str:
        root = tmp_path / art.host
        for other in (a for a in artifacts if a.host == art.host):
            target = root / other.path.lstrip("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content if other is art else other.content)
            target.chmod(other.mode)
        proc = subprocess.run(
            ["systemd-analyze", "security", "--offline=true", f"--root={root}", art.path.rsplit("/", 1)[1]],
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = [line.strip() for line in proc.stdout.splitlines() if "PrivateTmp=" in line]
        assert len(lines) == 1, proc.stdout + proc.stderr
        return lines[0]

    for art in units:
        assert private_tmp_line(art, art.content).startswith("✓"), art.path
    assert private_tmp_line(units[0], units[0].content.replace("PrivateTmp=yes\n", "")).startswith("✗")


def test_router_config_matches_schema() -> None:
    schema = json.loads((ROOT / "schemas" / "router.schema.json").read_text())
    for example in EXAMPLES:
        for art in render_topology(load_topology(ROOT / "examples" / example).topology):
            if art.path.endswith(".router.yaml"):
                config = yaml.safe_load(art.content)
                errors = list(Draft202012Validator(schema).iter_errors(config))
                assert not errors, (example, [e.message for e in errors])


def test_router_ttl_derived_from_decoder_ttl() -> None:
    t = load_topology(ROOT / "examples" / "local-cpu.yaml").topology
    config = yaml.safe_load(next(a for a in render_topology(t) if a.path.endswith(".router.yaml")).content)
    assert config["session_ttl"] == t.kv_transfer.decoder_kv_blocks_ttl - t.router.ttl_margin == 110
    generation = config["prefill"][0]["generation"]  # P and D of one topology: one generation (bpdkv/generations.py)
    assert [g["id"] for g in config["generations"]] == [generation]
    assert config["prefill"] == [{"name": "prefill-0", "url": "http://10.213.0.11:8100", "generation": generation}]
    assert config["decode"] == [{"name": "decode-0", "url": "http://10.213.0.12:8200", "generation": generation}]


NASTY = [
    "two words",
    'a "quoted" value',
    "it's",
    "$HOME and ${PATH}",
    "back\\slash",
    "ünïcødé ✓",
    "semi;colon && rm -rf /",
    "`uname`",
    "new\nline",
]
# As values of a flag: a bare value in extra_args is refused (vLLM would read it as the model to serve).
NASTY_ARGS = [arg for value in NASTY for arg in ("--chat-template", value)]


def test_quoting_survives_any_value(tmp_path: Path) -> None:
    """Run the rendered launch script for real with a fake python that dumps argv and env."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    dump = tmp_path / "dump.json"
    fake = venv / "bin" / "python"
    fake.write_text(
        f"#!/usr/bin/python3\nimport json, os, sys\njson.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(dump)!r}, 'w'))\n"
    )
    fake.chmod(0o755)
    env = {f"NASTY_{i}": v for i, v in enumerate(NASTY)}
    doc = {
        "apiVersion": "bpdkv/v1",
        "name": "quoting",
        "model": {"id": "m/x", "path": "/models/with space/ünï"},
        "vllm": {"venv": str(venv), "extra_args": NASTY_ARGS, "env": env},
        "nodes": [
            {
                "name": "a",
                "host": "10.0.0.1",
                "hardware": "generic-gpu",
                "instances": [
                    {"role": "prefill", "gpus": [0]},
                    {"role": "decode", "gpus": [1], "env": {"LAST": "$(echo pwned)"}},
                    {"role": "router"},
                ],
            }
        ],
    }
    artifacts = render_topology(validate_document(parse_yaml(yaml.safe_dump(doc, allow_unicode=True), "q.yaml")).topology)
    files = {a.path: a for a in artifacts if a.instance == "decode-0"}
    env_file = tmp_path / "decode-0.env"
    env_file.write_text(files["/etc/bpdkv/decode-0.env"].content)
    script = tmp_path / "decode-0.sh"
    script.write_text(files["/opt/bpdkv/bin/decode-0.sh"].content.replace(". /etc/bpdkv/decode-0.env", f". {env_file}"))
    script.chmod(0o755)
    subprocess.run([str(script)], check=True, timeout=30, env={"PATH": "/usr/bin:/bin"})
    seen = json.loads(dump.read_text())
    assert seen["argv"][-len(NASTY_ARGS) :] == NASTY_ARGS
    assert seen["argv"][:4] == ["-m", "vllm.entrypoints.cli.main", "serve", "/models/with space/ünï"]  # `vllm serve MODEL`
    for key, value in env.items():
        assert seen["env"][key] == value
    assert seen["env"]["LAST"] == "$(echo pwned)"
    assert seen["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert seen["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.0.0.1"
    kv = json.loads(seen["argv"][seen["argv"].index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_consumer" and kv["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True


def test_cpu_nodes_get_cpu_buffers_and_no_cuda() -> None:
    t = load_topology(ROOT / "examples" / "local-cpu.yaml").topology
    arts = {a.path: a.content for a in render_topology(t) if a.instance == "prefill-0"}
    assert "CUDA_VISIBLE_DEVICES" not in arts["/etc/bpdkv/prefill-0.env"]
    assert "UCX_NET_DEVICES=eth0" in arts["/etc/bpdkv/prefill-0.env"]
    assert '"kv_buffer_device":"cpu"' in arts["/opt/bpdkv/bin/prefill-0.sh"]


def test_efa_hardware_renders_libfabric_and_fi_env() -> None:
    t = load_topology(ROOT / "examples" / "p5en-qwen3-32b.yaml").topology
    arts = {a.path: a.content for a in render_topology(t) if a.instance == "decode-1"}
    assert '"backends":["LIBFABRIC"]' in arts["/opt/bpdkv/bin/decode-1.sh"]
    assert "FI_PROVIDER=efa" in arts["/etc/bpdkv/decode-1.env"]
    assert "CUDA_VISIBLE_DEVICES=4,5,6,7" in arts["/etc/bpdkv/decode-1.env"]
    assert "LimitMEMLOCK=infinity" in arts["/etc/systemd/system/bpdkv-decode-1.service"]


def test_pull_decision_rendered_for_prefill_only_when_set(tmp_path: Path) -> None:
    """kv_transfer.pull_decision reaches P's connector config (and only P's); unset, the plugin's default applies; a
    cost seed beside `threshold` would be unused: a warning naming it."""
    source = (ROOT / "examples" / "local-cpu.yaml").read_text()
    assert "  pull_decision: threshold\n" in source  # the lab pins it (the example says why)

    def extra(text: str, instance: str) -> dict[str, object]:
        path = tmp_path / "t.yaml"
        path.write_text(text)
        t = load_topology(path).topology
        node, inst = next((n, i) for n, i in t.instances() if i.name == instance)
        return kv_transfer_config(t, inst, node)["kv_connector_extra_config"]

    assert extra(source, "prefill-0")[contracts.EXTRA_PULL_DECISION] == contracts.PULL_DECISION_THRESHOLD
    assert contracts.EXTRA_PULL_DECISION not in extra(source, "decode-0")
    assert contracts.EXTRA_PULL_DECISION not in extra(source.replace("  pull_decision: threshold\n", ""), "prefill-0")
    explicit = source.replace("pull_decision: threshold", "pull_decision: cost")
    assert extra(explicit, "prefill-0")[contracts.EXTRA_PULL_DECISION] == contracts.PULL_DECISION_COST

    seeded = source.replace("  pull_decision: threshold\n", "  pull_decision: threshold\n  pull_cost_seed: {prefill_tokens_per_s: 5000}\n")
    (tmp_path / "s.yaml").write_text(seeded)
    warnings = [d.message for d in load_topology(tmp_path / "s.yaml").warnings]
    assert any("pull_cost_seed is unused with pull_decision: threshold" in w for w in warnings), warnings


def _router_paths_of(topology: object) -> dict[str, object] | None:
    from bpdkv.render import router_paths

    return router_paths(topology).get("paths")  # type: ignore[arg-type]


def test_the_step_budget_is_off_where_a_d_shares_its_device_with_a_p() -> None:
    """Sending a turn through P spares D's streams nothing when P computes on D's own GPU (or CPU)."""
    shared = load_topology(ROOT / "examples" / "h200-shared-qwen3-8b.yaml").topology
    apart = load_topology(ROOT / "examples" / "h200x2-qwen3-8b.yaml").topology
    assert _router_paths_of(shared) == {"local_max_step_cost": 0}
    assert _router_paths_of(apart) is None  # the router's default budget (contracts.ROUTER_PATHS_DEFAULTS)
    text = (ROOT / "examples" / "h200-shared-qwen3-8b.yaml").read_text()
    assert "\nrouter:" not in text
    chosen = text + "router:\n  paths: {local_max_step_cost: 0.1}\n"  # what the topology sets wins
    assert _router_paths_of(validate_document(parse_yaml(chosen, "shared")).topology) == {"local_max_step_cost": 0.1}
