"""Cohort apply as data: the hosts' facts (manifests of the old release, units running) in → the roll's steps and
operations out (bpdkv/deploy/planner.py + cohorts.py). No host involved."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

from benchmarks import upgrade
from bpdkv import __version__
from bpdkv.deploy import operations as ops
from bpdkv.deploy.bootstrap import source_digest
from bpdkv.deploy.cohorts import StepKind
from bpdkv.deploy.facts import HostFacts
from bpdkv.deploy.planner import Plan, UnitVerb, generation_id, make_plan, manifest_for
from bpdkv.generations import router_generation
from bpdkv.render import render_topology
from bpdkv.topology.validate import load_topology


def load(tmp: Path, name: str, doc: dict[str, Any]) -> Any:
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return load_topology(path, str(path)).topology


def with_spare(doc: dict[str, Any]) -> dict[str, Any]:
    doc = json.loads(json.dumps(doc))
    spare = json.loads(json.dumps(doc["nodes"][0]))
    spare.update(name="spare1", host="10.213.0.14", spare=True)
    doc["nodes"].insert(2, spare)
    return doc


def facts_of(topology: Any, running: set[str], moved: dict[str, Any] | None = None) -> dict[str, HostFacts]:
    """Every node deployed from `topology` (or, for the nodes in `moved`, from that one), the units of `running` up."""
    out: dict[str, HostFacts] = {}
    for node in topology.nodes:
        source = (moved or {}).get(node.name, topology)
        arts = [a for a in render_topology(source) if a.host == node.name]
        manifest = manifest_for(source, node.name, arts, generation_id(arts))
        files = {
            a.path: {
                "sha256": hashlib.sha256(a.content.encode()).hexdigest(),
                "mode": a.mode,
                "content": base64.b64encode(a.content.encode()).decode(),
            }
            for a in arts
        }
        units = {a.unit: ("active" if node.name in running else "inactive") for a in arts if a.unit}
        versions = {"bpdkv": __version__, source.vllm.package: source.vllm.version, "nixl": "1.5.1"}
        out[node.name] = HostFacts(
            node.name, True, manifest=manifest, files=files, units=units, versions=versions, bpdkv_source=source_digest()
        )
    return out


def test_a_release_change_becomes_cohort_steps_with_the_router_reloaded_not_restarted(tmp_path: Path) -> None:
    old = load(tmp_path, "old", upgrade.topology(upgrade.OLD))
    new = load(tmp_path, "new", upgrade.topology(upgrade.NEW))
    plan = make_plan(new, render_topology(new), facts_of(old, {"host1", "host2", "host3"}))
    assert plan.compat_break and plan.roll is not None and not plan.downtime and plan.group == []
    roll = plan.roll
    g_old, g_new = router_generation(old)["id"], router_generation(new)["id"]
    assert (roll.old, roll.new, roll.old_vllm, roll.new_vllm) == (g_old, g_new, "0.31.0", "0.32.0")
    assert [(s.step.kind, s.step.nodes) for s in roll.steps] == [(StepKind.SPLIT, ("host1",)), (StepKind.SPLIT, ("host2",))]
    # The router re-reads its upstreams: never restarted by a roll.
    router = next(h for h in plan.hosts if h.host == "host3")
    assert [u.action for u in router.units] == [UnitVerb.NONE], router.units
    # Before any node moves, the router knows both generations, every node in the old one.
    prepared = yaml.safe_load(roll.prepare.content)
    assert [g["id"] for g in prepared["generations"]] == [g_old, g_new]
    assert {u["name"]: u["generation"] for u in prepared["prefill"] + prepared["decode"]} == {
        "prefill-0": g_old, "decode-0": g_old, "prefill-1": g_old, "decode-1": g_old
    }  # fmt: skip
    first = yaml.safe_load(roll.steps[0].router.content)
    assert {u["name"]: u["generation"] for u in first["prefill"] + first["decode"]} == {
        "prefill-0": g_new, "decode-0": g_new, "prefill-1": g_old, "decode-1": g_old
    }  # fmt: skip
    rendered = next(a for a in render_topology(new) if a.path.endswith(".router.yaml"))
    assert roll.steps[-1].router.content == rendered.content  # the last step leaves exactly the rendered config
    assert roll.steps[0].router.digest == hashlib.sha256(roll.steps[0].router.content.encode()).hexdigest()[:16]
    # Each step: undrains only after the router serves the node in the new generation; a probe inside the new one.
    host1 = next(h for h in plan.hosts if h.host == "host1")
    assert not any(isinstance(op, ops.Undrain) for op in host1.operations)
    assert [op.instance for op in host1.operations if isinstance(op, ops.Drain)] == ["prefill-0", "decode-0"]
    assert [u.instance for u in roll.steps[0].undrains] == ["prefill-0", "decode-0"]
    assert [(p.prefill, p.decode, p.transport) for p in roll.steps[0].probes] == [("prefill-0", "decode-0", "any")]
    assert roll.steps[0].gate.expected() == {g_old: {"prefill": 1, "decode": 1}, g_new: {"prefill": 1, "decode": 1}}
    assert roll.steps[1].gate.expected() == {g_new: {"prefill": 2, "decode": 2}}
    assert not roll.warnings  # each release has its own vllm.venv
    # The saved plan holds the roll: what apply runs is what was shown.
    again = Plan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again.roll == plan.roll


def test_a_spare_node_carries_the_surge_and_is_retired(tmp_path: Path) -> None:
    old = load(tmp_path, "old", with_spare(upgrade.topology(upgrade.OLD)))
    new = load(tmp_path, "new", with_spare(upgrade.topology(upgrade.NEW)))
    rendered = yaml.safe_load(next(a for a in render_topology(new) if a.path.endswith(".router.yaml")).content)
    assert [u["name"] for u in rendered["prefill"]] == ["prefill-0", "prefill-1"]  # a spare is not routed outside a roll
    plan = make_plan(new, render_topology(new), facts_of(old, {"host1", "host2", "host3"}))
    assert plan.roll is not None
    steps = plan.roll.steps
    assert [(s.step.kind, s.step.nodes) for s in steps] == [
        (StepKind.SURGE, ("spare1",)), (StepKind.SPLIT, ("host1",)), (StepKind.SPLIT, ("host2",)), (StepKind.RETIRE, ("spare1",))
    ]  # fmt: skip
    spare = next(h for h in plan.hosts if h.host == "spare1")
    assert {u.instance: u.action for u in spare.units} == {"prefill-2": UnitVerb.START, "decode-2": UnitVerb.START}
    surge = yaml.safe_load(steps[0].router.content)
    assert [u["name"] for u in surge["prefill"]] == ["prefill-0", "prefill-1", "prefill-2"]
    assert [d.instance for d in steps[-1].drains] == ["prefill-2", "decode-2"]
    assert [(host, op.unit) for host, op in steps[-1].stops] == [
        ("spare1", "bpdkv-prefill-2.service"),
        ("spare1", "bpdkv-decode-2.service"),
    ]
    assert all(s.step.serves_during for s in steps) and not plan.downtime
    # Outside a roll a spare is deployed but never started (and stopped if someone started it).
    idle = make_plan(new, render_topology(new), facts_of(new, {"host1", "host2", "host3", "spare1"}))
    assert idle.roll is None and {u.action for u in next(h for h in idle.hosts if h.host == "spare1").units} == {UnitVerb.STOP}


def test_one_p_and_one_d_is_downtime_apply_must_be_told(tmp_path: Path) -> None:
    def small(version: str) -> dict[str, Any]:
        doc = upgrade.topology(version)
        doc["nodes"][0]["instances"] = [{"role": "prefill", "port": 8100}]
        doc["nodes"][1]["instances"] = [{"role": "decode", "port": 8200}]
        return doc

    old, new = load(tmp_path, "old", small(upgrade.OLD)), load(tmp_path, "new", small(upgrade.NEW))
    plan = make_plan(new, render_topology(new), facts_of(old, {"host1", "host2", "host3"}))
    assert plan.roll is None and plan.group == ["host1", "host2"]  # P and D restart together, as before
    assert "no cohort step keeps a P and a D serving" in plan.downtime


def test_a_resumed_roll_moves_only_what_is_left(tmp_path: Path) -> None:
    old = load(tmp_path, "old", upgrade.topology(upgrade.OLD))
    new = load(tmp_path, "new", upgrade.topology(upgrade.NEW))
    facts = facts_of(old, {"host1", "host2", "host3"}, moved={"host1": new})
    plan = make_plan(new, render_topology(new), facts)
    assert plan.roll is not None
    assert [s.step.nodes for s in plan.roll.steps] == [("host2",)]
    assert {u.action for u in next(h for h in plan.hosts if h.host == "host1").units} == {UnitVerb.NONE}
    prepared = yaml.safe_load(plan.roll.prepare.content)
    assert {u["name"]: u["generation"] for u in prepared["prefill"]} == {"prefill-0": plan.roll.new, "prefill-1": plan.roll.old}


def test_the_same_venv_for_both_releases_is_warned(tmp_path: Path) -> None:
    docs = [upgrade.topology(v) for v in (upgrade.OLD, upgrade.NEW)]
    for doc in docs:
        doc["vllm"]["venv"] = "/opt/bpdkv/venv"
    old, new = load(tmp_path, "old", docs[0]), load(tmp_path, "new", docs[1])
    plan = make_plan(new, render_topology(new), facts_of(old, {"host1", "host2", "host3"}))
    assert plan.roll is not None and "cannot serve the old generation again" in plan.roll.warnings[0]


def test_a_roll_stopped_after_its_last_cohort_restarts_nothing(tmp_path: Path) -> None:
    """Killed after the last cohort's manifests but before the router's: the next plan finishes the router's record and
    restarts no P or D (the router's manifest is not a P/D host's)."""
    old = load(tmp_path, "old", upgrade.topology(upgrade.OLD))
    new = load(tmp_path, "new", upgrade.topology(upgrade.NEW))
    facts = facts_of(old, {"host1", "host2", "host3"}, moved={"host1": new, "host2": new})
    # The last step wrote the rendered router config already; the router's manifest and launch script are the old ones.
    rendered = next(a for a in render_topology(new) if a.path.endswith(".router.yaml"))
    facts["host3"].files[rendered.path] = {
        "sha256": hashlib.sha256(rendered.content.encode()).hexdigest(),
        "mode": rendered.mode,
        "content": base64.b64encode(rendered.content.encode()).decode(),
    }
    plan = make_plan(new, render_topology(new), facts)
    assert not plan.compat_break and plan.roll is None and not plan.downtime
    assert {u.action for h in plan.hosts for u in h.units} == {UnitVerb.NONE}  # the router too: it re-reads its config
