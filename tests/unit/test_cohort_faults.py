"""The roll as a state machine under faults (issue 47), on the in-memory fleet of tests/unit/roll_sim.py driven by the
real planner and runner: `bpdkv apply` SIGKILLed after any one of its operations, then `plan` + `apply --force-unlock`,
always ends with every node on the new release, its record written, the router serving only the new generation and a
next plan with nothing to do — and at no moment were more P or D out of service than the plan allows. An engine of the
old generation dying during step 1 never rolls back the step whose own nodes serve the new generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks import upgrade
from bpdkv.deploy import runner as runner_module
from bpdkv.deploy.facts import MANIFEST_PATH
from bpdkv.deploy.operations import TMP_SUFFIX
from bpdkv.deploy.runner import HostStatus
from tests.unit.roll_sim import FakeClock, Killed, Sim
from tests.unit.test_cohort_plan import with_spare

TOTAL_P = TOTAL_D = 2  # the lab's roll: host1 and host2 run one P and one D each, host3 the router


@pytest.fixture(autouse=True)
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    clock = FakeClock()
    monkeypatch.setattr(runner_module, "time", clock)
    return clock


def calls_of_a_whole_roll(tmp: Path) -> int:
    sim = Sim.deployed(tmp)
    _, report = sim.apply()
    assert report.exit_code == 0, report.failed_lines()
    return sim.calls


def assert_finished(sim: Sim) -> None:
    """Every node on the new release with its record, the router serving exactly the new generation, nothing left."""
    new = sim.new_topology
    for name, host in sim.hosts.items():
        assert host.manifest is not None and host.manifest["compat"] == json.loads(json.dumps(host.manifest["compat"]))
        assert host.lock is None, name
        spare = any(n.name == name and getattr(n, "spare", False) for n in new.nodes)
        for instance, runs in host.engines.items():
            assert runs == (None if spare else upgrade.NEW), (name, instance, runs, sim.events[-20:])  # a spare: stopped again
    final = next(a for a in sim.new_artifacts if a.path == sim.router_path)
    assert sim.hosts["host3"].files[sim.router_path][0] == final.content
    assert not sim.drained & {u["name"] for u in sim.listing()}, sim.drained
    gen = next(iter(g["id"] for g in sim.router_config()["generations"]))
    assert sim.serving() == {gen: {"prefill": TOTAL_P, "decode": TOTAL_D}}
    again = sim.plan_now()
    assert again.exit_code == 0, [(h.host, h.repair, [u.reason for u in h.units if u.action != "none"]) for h in again.hosts if h.changed]
    assert all(h.manifest is not None and h.manifest["compat"]["vllm"] == new.vllm.version for h in sim.hosts.values())


def assert_capacity(sim: Sim, max_unavailable: int = 1) -> None:
    """At every moment: at most the plan's capacity out of service, and some generation with a P and a D."""
    for i, (p, d, complete) in enumerate(sim.capacity):
        assert p >= TOTAL_P - max_unavailable and d >= TOTAL_D - max_unavailable and complete, (i, sim.capacity[i], sim.events)


def test_a_whole_roll_without_faults_keeps_the_capacity_the_plan_allows(tmp_path: Path) -> None:
    sim = Sim.deployed(tmp_path)
    plan, report = sim.apply()
    assert report.exit_code == 0, report.failed_lines()
    assert plan.roll is not None and [s.step.nodes for s in plan.roll.steps] == [("host1",), ("host2",)]
    assert_finished(sim)
    assert_capacity(sim)
    # apply's last lines: each step, then what serves per generation.
    assert report.summary[-2].startswith("the roll finished"), report.summary
    assert report.summary[-1] == f"serving now (the router's count): vLLM {upgrade.NEW} ({plan.roll.new}) 2 P + 2 D"


@pytest.mark.parametrize("spare", [False, True], ids=["two nodes", "two nodes and a spare"])
def test_sigkill_after_every_operation_then_plan_and_apply_force_unlock_finish_the_roll(tmp_path: Path, spare: bool) -> None:
    """Exhaustive: every kill point of a whole roll (each command or upload sent to a node is one operation). With a
    spare: surge, two splits, retire."""
    docs = (with_spare(upgrade.topology(upgrade.OLD)), with_spare(upgrade.topology(upgrade.NEW))) if spare else (None, None)
    whole = Sim.deployed(tmp_path / "count", *docs)
    _, report = whole.apply()
    assert report.exit_code == 0, report.failed_lines()
    total = whole.calls
    assert total > 40
    for k in range(1, total):  # after the last one there is nothing left to kill
        sim = Sim.deployed(tmp_path / f"k{k}", *docs)
        sim.kill_after = k
        with pytest.raises(Killed):
            sim.apply()
        sim.kill_after = None
        resumed_plan, report = sim.apply()
        assert report.exit_code == 0, (k, report.failed_lines(), report.problems, sim.events[-30:])
        assert_finished(sim)
        assert_capacity(sim)
        # Nothing waits on a state that cannot occur any more, and nothing already on the new release is moved again.
        assert resumed_plan.roll is None or all(n not in resumed_plan.roll.adopted for s in resumed_plan.roll.steps for n in s.step.nodes)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=st.integers(min_value=1, max_value=400), second=st.integers(min_value=1, max_value=400))
def test_two_kills_in_a_row_then_a_third_apply_finishes(tmp_path_factory: pytest.TempPathFactory, first: int, second: int) -> None:
    sim = Sim.deployed(tmp_path_factory.mktemp("two"))
    for k in (first, second):
        sim.kill_after = sim.calls + k
        try:
            sim.apply()
        except Killed:
            pass
    sim.kill_after = None
    _, report = sim.apply()
    assert report.exit_code == 0, report.failed_lines()
    assert_finished(sim)
    assert_capacity(sim)


def test_killed_after_the_last_cohort_restarted_resumes_without_waiting_on_mismatched_engines(tmp_path: Path) -> None:
    """The issue's case: host2's engines run the new release, its manifest is old (so the router, still placing host2
    in the old generation, reports them mismatched). The resumed plan counts host2 in the new generation (adopted:
    no restart), and apply finishes."""
    sim = Sim.deployed(tmp_path)
    total = calls_of_a_whole_roll(tmp_path / "count")
    for k in range(1, total):
        trial = Sim.deployed(tmp_path / f"t{k}")
        trial.kill_after = k
        with pytest.raises(Killed):
            trial.apply()
        if (
            trial.hosts["host2"].engines == {"prefill-1": upgrade.NEW, "decode-1": upgrade.NEW}
            and trial.hosts["host2"].manifest is not None
        ):
            if trial.hosts["host2"].manifest["compat"]["vllm"] == upgrade.OLD:
                sim = trial
                break
    else:
        pytest.fail("no kill point leaves host2 restarted on the new release with its old manifest")
    states = {u["name"]: u["state"] for u in sim.listing()}
    assert states["prefill-1"] == "mismatched", states
    sim.kill_after = None
    plan = sim.plan_now()
    assert plan.exit_code == 1  # only the lock the killed apply left: apply --force-unlock removes it
    plan, report = sim.apply()
    assert plan.roll is not None and plan.roll.adopted == ("host2",) and not plan.roll.steps
    assert not any(u.action != "none" for h in plan.hosts for u in h.units), [(h.host, h.units) for h in plan.hosts]
    # No venv warning: 0.31.0 had its own venv. No drift: the router config the roll wrote is not an edit by hand.
    assert not plan.roll.warnings
    assert not any(f.drift for h in plan.hosts for f in h.files), [f for h in plan.hosts for f in h.files if f.drift]
    assert report.exit_code == 0, report.failed_lines()
    assert_finished(sim)


def test_an_old_generation_d_killed_during_step_1_does_not_roll_the_step_back(tmp_path: Path) -> None:
    """decode-1 (host2, old generation) dies while step 1 moves host1: the step's own nodes serve the new generation, so
    the step passes (the loss is said, not undone), and step 2 moves host2 — its D comes back on the new release."""
    sim = Sim.deployed(tmp_path)

    original_after = sim.after_call

    def kill_d_once_host1_restarted() -> None:
        if (
            "decode-1" not in sim.dead
            and sim.hosts["host1"].engines["decode-0"] == upgrade.NEW
            and sim.hosts["host2"].engines["decode-1"] == upgrade.OLD
        ):
            sim.hosts["host2"].engines["decode-1"] = None
            sim.hosts["host2"].units["bpdkv-decode-1.service"] = "failed"
            sim.dead.add("decode-1")
            sim.events.append("fault: decode-1 killed")
        original_after()

    sim.after_call = kill_d_once_host1_restarted  # type: ignore[method-assign]
    plan, report = sim.apply()
    assert "fault: decode-1 killed" in sim.events
    assert report.exit_code == 0, report.failed_lines()
    assert not any(e.startswith("undo restart") or e.startswith("restore") for e in sim.events), sim.events
    assert any("a loss outside the step's nodes" in line for line in report.summary), report.summary
    assert_finished(sim)


def test_a_failed_step_is_paused_not_rolled_back_when_its_generation_is_the_only_one_serving(tmp_path: Path) -> None:
    """Step 1's nodes serve the new generation, the old generation's D died meanwhile, then host1's record cannot be
    written: rolling host1 back would leave no generation with a P and a D, so nothing is undone — apply exits 1 with
    host1 paused, says what serves, and the next apply finishes the roll."""
    sim = Sim.deployed(tmp_path)
    original_after = sim.after_call

    def fault() -> None:
        if (
            "decode-1" not in sim.dead
            and sim.hosts["host1"].engines["decode-0"] == upgrade.NEW
            and sim.hosts["host2"].engines["decode-1"] == upgrade.OLD
        ):
            sim.hosts["host2"].engines["decode-1"] = None
            sim.dead.add("decode-1")
            sim.fail_put.add(f"host1:{MANIFEST_PATH}{TMP_SUFFIX}")
            sim.events.append("fault: decode-1 killed")
        original_after()

    sim.after_call = fault  # type: ignore[method-assign]
    plan, report = sim.apply()
    assert report.exit_code == 1
    assert report.outcomes["host1"].status is HostStatus.PAUSED, report.outcomes["host1"]
    assert "only generation serving" in report.outcomes["host1"].message
    assert report.outcomes["host2"].status is HostStatus.NOT_STARTED
    assert not any(e.startswith(("restore", "undo restart")) for e in sim.events), sim.events
    assert report.summary[-1].startswith("serving now (the router's count): "), report.summary
    assert f"vLLM {upgrade.NEW}" in report.summary[-1] and "1 P + 1 D" in report.summary[-1], report.summary
    sim.after_call = original_after  # type: ignore[method-assign]
    _, report = sim.apply()
    assert report.exit_code == 0, report.failed_lines()
    assert_finished(sim)


def test_status_is_not_ok_for_an_engine_the_router_refuses() -> None:
    from bpdkv.deploy.fleet import refusals

    listing = {
        "upstreams": [
            {"name": "prefill-1", "state": "mismatched", "problem": "runs vLLM 0.32.0; its generation d63e80f42b64 is vLLM 0.31.0"},
            {"name": "decode-1", "state": "serving"},
            {"name": "decode-0", "state": "drained"},
        ]
    }
    assert refusals(listing) == {
        "prefill-1": "refused by the router: not of its generation (runs vLLM 0.32.0; its generation d63e80f42b64 is vLLM 0.31.0)"
    }
    assert refusals({"upstreams": "nonsense"}) == {} and refusals([]) == {}


def test_the_deploy_state_fact_reads_each_engines_release(tmp_path: Path) -> None:
    """The fact a resumed plan relies on, run for real here: GET /version of each engine unit's port; no answer: None."""
    import http.server
    import subprocess
    import threading

    from bpdkv.deploy.facts import DeployState

    class Version(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps({"version": "0.32.0+cpu"}).encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Version)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fact = DeployState(
            [], [], str(tmp_path / "no-venv"), (), {"bpdkv-decode-1.service": server.server_address[1], "bpdkv-prefill-1.service": 1}
        )
        out = subprocess.run(["sh", "-c", fact.command], capture_output=True, text=True, timeout=60)
        assert fact.parse(out.stdout)["engines"] == {"bpdkv-decode-1.service": "0.32.0+cpu", "bpdkv-prefill-1.service": None}
    finally:
        server.shutdown()
