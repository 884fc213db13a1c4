"""Cohort apply: a compatibility break (a new vLLM release, model, KV dtype, block size or connector) rolled through the
fleet a cohort at a time instead of restarting every P and D together. Pure: node shapes in, steps out.

A cohort is a set of *nodes*, never single instances: a node's venv holds one vLLM release, and on one node P and D
import each other's KV memory through CUDA IPC (the imports stay pinned until the importer exits, vllm #58063), so a P
and the Ds that imported it move together. Across nodes NIXL registers memory without pinning the peer's.

Steps, each a set of nodes:
- surge: spare nodes (`spare: true` in the topology) start the new generation first; nothing drains;
- split: these nodes drain, move to the new generation and are gated there, then serve it;
- retire: the spares stop again once every regular node serves the new generation (their capacity was the surge's).

Each step moves at most `max_unavailable` P and D instances (the first split step takes at least one of each, so the
new generation is complete as soon as it ends); a step never takes the old generation's last P or D while other nodes
are left to keep it serving. `serving` per step says what each generation can serve while the step runs and after it;
a step during which no generation has a P and a D is downtime (`Roll.downtime`), which `apply` refuses unless told.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class StepKind(StrEnum):
    SURGE = "surge"
    SPLIT = "split"
    RETIRE = "retire"


@dataclass(frozen=True)
class Slot:
    """One node of the roll: how many P and D instances it runs (they move together)."""

    node: str
    prefill: int
    decode: int
    spare: bool = False


@dataclass(frozen=True)
class Capacity:
    prefill: int
    decode: int

    @property
    def complete(self) -> bool:
        return self.prefill > 0 and self.decode > 0

    def to_json(self) -> dict[str, int]:
        return {"prefill": self.prefill, "decode": self.decode}


@dataclass(frozen=True)
class CohortStep:
    kind: StepKind
    nodes: tuple[str, ...]
    during: dict[str, Capacity]  # generation → what serves while the step runs (its nodes drained or starting)
    after: dict[str, Capacity]  # generation → what serves once it passed its gates

    @property
    def serves_during(self) -> bool:
        return any(c.complete for c in self.during.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "nodes": list(self.nodes),
            "during": {g: c.to_json() for g, c in self.during.items()},
            "after": {g: c.to_json() for g, c in self.after.items()},
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> CohortStep:
        def caps(d: dict[str, Any]) -> dict[str, Capacity]:
            return {g: Capacity(int(c["prefill"]), int(c["decode"])) for g, c in d.items()}

        return CohortStep(StepKind(data["kind"]), tuple(data["nodes"]), caps(data["during"]), caps(data["after"]))


@dataclass(frozen=True)
class Roll:
    old: str  # the generation the fleet runs (from the hosts' manifests)
    new: str  # the generation the topology asks for
    steps: tuple[CohortStep, ...]

    @property
    def downtime(self) -> bool:
        """Some step leaves no generation with a P and a D (e.g. one P and one D and no spare)."""
        return not all(s.serves_during for s in self.steps)

    def downtime_steps(self) -> list[int]:
        return [i for i, s in enumerate(self.steps, 1) if not s.serves_during]


def _caps(old: tuple[int, int], new: tuple[int, int], old_id: str, new_id: str) -> dict[str, Capacity]:
    return {old_id: Capacity(*old), new_id: Capacity(*new)}


def plan_roll(slots: Sequence[Slot], old: str, new: str, max_unavailable: int = 1, moved: Sequence[Slot] = ()) -> Roll:
    """The steps that move every slot from generation `old` to `new` (slots in topology order); `moved`: nodes that
    serve the new generation already (a roll that stopped half-way and is resumed)."""
    k = max(1, max_unavailable)
    regular = [s for s in slots if not s.spare and (s.prefill or s.decode)]
    spares = [s for s in slots if s.spare and (s.prefill or s.decode)]
    old_p, old_d = sum(s.prefill for s in regular), sum(s.decode for s in regular)
    new_p, new_d = sum(s.prefill for s in moved if not s.spare), sum(s.decode for s in moved if not s.spare)
    steps: list[CohortStep] = []
    if spares:
        during = _caps((old_p, old_d), (new_p, new_d), old, new)
        new_p, new_d = new_p + sum(s.prefill for s in spares), new_d + sum(s.decode for s in spares)
        steps.append(CohortStep(StepKind.SURGE, tuple(s.node for s in spares), during, _caps((old_p, old_d), (new_p, new_d), old, new)))
    remaining = list(regular)
    while remaining:
        cohort = _next_cohort(remaining, k, need_p=new_p == 0, need_d=new_d == 0)
        cp, cd = sum(s.prefill for s in cohort), sum(s.decode for s in cohort)
        rest = [s for s in remaining if s not in cohort]
        during = _caps((old_p - cp, old_d - cd), (new_p, new_d), old, new)
        old_p, old_d, new_p, new_d = old_p - cp, old_d - cd, new_p + cp, new_d + cd
        steps.append(CohortStep(StepKind.SPLIT, tuple(s.node for s in cohort), during, _caps((old_p, old_d), (new_p, new_d), old, new)))
        remaining = rest
    if spares:
        sp, sd = sum(s.prefill for s in spares), sum(s.decode for s in spares)
        during = _caps((0, 0), (new_p, new_d), old, new)
        steps.append(CohortStep(StepKind.RETIRE, tuple(s.node for s in spares), during, _caps((0, 0), (new_p - sp, new_d - sd), old, new)))
    return Roll(old, new, tuple(steps))


def _next_cohort(remaining: list[Slot], k: int, need_p: bool, need_d: bool) -> list[Slot]:
    """Nodes for the next split step: at most k P and k D (at least one of each the new generation still lacks), never
    the old generation's last P or D while the nodes left after this step could keep it serving."""
    total_p, total_d = sum(s.prefill for s in remaining), sum(s.decode for s in remaining)
    cohort: list[Slot] = []
    cp = cd = 0

    def keeps_old(extra: Slot) -> bool:
        """The old generation still serves after this node leaves — or, once the new one serves, is simply done."""
        left_p, left_d = total_p - cp - extra.prefill, total_d - cd - extra.decode
        return (left_p > 0 and left_d > 0) or (left_p == 0 and left_d == 0 and not (need_p or need_d))

    def fits(s: Slot) -> bool:
        p_ok = s.prefill == 0 or cp + s.prefill <= k or (need_p and cp == 0)
        d_ok = s.decode == 0 or cd + s.decode <= k or (need_d and cd == 0)
        return p_ok and d_ok

    def useful(s: Slot) -> bool:
        return bool((s.prefill and (cp < k or (need_p and cp == 0))) or (s.decode and (cd < k or (need_d and cd == 0))))

    # Nodes with both roles first where the new generation lacks both: one node completes it.
    order = sorted(remaining, key=lambda s: 0 if (need_p and need_d and s.prefill and s.decode) else 1)
    for strict in (True, False):
        for s in order:
            if s in cohort or not fits(s) or not useful(s):
                continue
            if strict and not keeps_old(s):
                continue
            cohort.append(s)
            cp, cd = cp + s.prefill, cd + s.decode
        if cohort and (not need_p or cp) and (not need_d or cd):
            break
    if not cohort:  # every node is larger than k: one node at a time
        cohort = [remaining[0]]
    return [s for s in remaining if s in cohort]  # topology order


# ---- the roll as operations of the saved plan ------------------------------------------------------------------------
# Everything below is still pure: the topology, its artifacts and the hosts' facts in, the roll's operations out. The
# runner interprets them (bpdkv/deploy/runner.py, Runner.run_roll) and composes no shell of its own.


@dataclass(frozen=True)
class RollStepPlan:
    step: CohortStep
    router: Any  # ops.WriteRouterConfig: the router config once this step's nodes serve the new generation
    undrains: tuple[Any, ...]  # ops.Undrain of the step's instances, after the router re-read its config
    probes: tuple[Any, ...]  # ops.ProbePull inside the new generation (a P of it → a D of it)
    gate: Any  # ops.ServingGate: the router reports `step.after`
    drains: tuple[Any, ...] = ()  # retire: ops.Drain of the spares' instances before the router forgets them
    stops: tuple[Any, ...] = ()  # retire: (host, ops.StopUnit) of the spares' units once drained and forgotten

    def to_json(self) -> dict[str, Any]:
        from bpdkv.deploy import operations as ops

        return {
            **self.step.to_json(),
            "router": ops.to_json(self.router),
            "undrains": [ops.to_json(u) for u in self.undrains],
            "probes": [ops.to_json(p) for p in self.probes],
            "gate": ops.to_json(self.gate),
            "drains": [ops.to_json(d) for d in self.drains],
            "stops": [[host, ops.to_json(op)] for host, op in self.stops],
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> RollStepPlan:
        from bpdkv.deploy import operations as ops

        return RollStepPlan(
            CohortStep.from_json(data),
            ops.from_json(data["router"]),
            tuple(ops.from_json(u) for u in data["undrains"]),
            tuple(ops.from_json(p) for p in data["probes"]),
            ops.from_json(data["gate"]),
            tuple(ops.from_json(d) for d in data.get("drains", [])),
            tuple((host, ops.from_json(op)) for host, op in data.get("stops", [])),
        )


@dataclass(frozen=True)
class RollPlan:
    old: str  # generation ids (bpdkv/generations.py)
    new: str
    old_vllm: str
    new_vllm: str
    prepare: Any  # ops.WriteRouterConfig: both generations known to the router before any node moves
    steps: tuple[RollStepPlan, ...]
    downtime_steps: tuple[int, ...]  # 1-based steps during which no generation has a P and a D
    warnings: tuple[str, ...] = ()
    # Nodes whose manifest is behind but whose engines run the new release on the new files (a killed apply restarted
    # them, then stopped before their record): counted in the new generation, not moved again.
    adopted: tuple[str, ...] = ()
    # ops.Undrain of every node serving during step 1 (all but step 1's own): a killed apply may have left some drained.
    undrains: tuple[Any, ...] = ()

    @property
    def downtime(self) -> bool:
        return bool(self.downtime_steps)

    def to_json(self) -> dict[str, Any]:
        from bpdkv.deploy import operations as ops

        return {
            "old": self.old,
            "new": self.new,
            "old_vllm": self.old_vllm,
            "new_vllm": self.new_vllm,
            "prepare": ops.to_json(self.prepare),
            "steps": [s.to_json() for s in self.steps],
            "downtime_steps": list(self.downtime_steps),
            "warnings": list(self.warnings),
            "adopted": list(self.adopted),
            "undrains": [ops.to_json(u) for u in self.undrains],
        }

    @staticmethod
    def from_json(data: dict[str, Any]) -> RollPlan:
        from bpdkv.deploy import operations as ops

        return RollPlan(
            data["old"],
            data["new"],
            data["old_vllm"],
            data["new_vllm"],
            ops.from_json(data["prepare"]),
            tuple(RollStepPlan.from_json(s) for s in data["steps"]),
            tuple(data["downtime_steps"]),
            tuple(data.get("warnings", ())),
            tuple(data.get("adopted", ())),
            tuple(ops.from_json(u) for u in data.get("undrains", [])),
        )


def config_digest(content: str) -> str:
    """What the router reports for a config file (GET /admin/config `digest`): sha256 of its bytes, 16 hex digits."""
    import hashlib

    return hashlib.sha256(content.encode()).hexdigest()[:16]


def old_generation(manifests: dict[str, dict[str, Any]], desired: dict[str, Any], new_entry: dict[str, Any]) -> dict[str, Any] | None:
    """The generation the fleet's P/D nodes run, from their manifests: None when none differs from `desired`, or when
    they differ among themselves (more than one older generation: no single roll)."""
    from bpdkv.generations import generation_id

    olds = {json_key(m["compat"]): m for m in manifests.values() if m.get("compat") and m["compat"] != desired}
    if len(olds) != 1:
        return None
    manifest = next(iter(olds.values()))
    fingerprint = manifest["compat"]
    entry = manifest.get("router_generation")
    if isinstance(entry, dict) and entry.get("id") == generation_id(fingerprint):
        return dict(entry)
    # Manifests written before bpdkv recorded the router's entry: the release from the fingerprint, the same --model.
    return {
        "id": generation_id(fingerprint),
        "vllm": fingerprint.get("vllm"),
        "model_root": new_entry["model_root"],
        "fingerprint": fingerprint,
    }


def json_key(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True)


def stage_config(
    final: dict[str, Any],
    header: str,
    entries: dict[str, list[tuple[str, dict[str, str]]]],
    placement: dict[str, str],
    generations: list[dict[str, Any]],
) -> str:
    """The router config with `generations` (oldest first) and each placed node's upstreams in its generation; nodes
    not in `placement` are left out (spares before the surge and after the retire)."""
    import yaml

    config = dict(final)
    for role in ("prefill", "decode"):
        config[role] = [dict(e, generation=placement[node]) for node, e in entries[role] if node in placement]
    config["generations"] = generations
    return header + yaml.safe_dump(config, sort_keys=False)


ROLL_PROBE_TIMEOUT = 120.0


def build_roll(
    topology: Any,
    artifacts: list[Any],
    manifests: dict[str, dict[str, Any] | None],
    router: tuple[str, int] | None,
    admin_base: str,
    key_file: str | None,
    max_unavailable: int,
    undrains_by_node: dict[str, list[Any]],
    running_new: frozenset[str] = frozenset(),
) -> RollPlan | None:
    """The roll for a compatibility break, or None where it cannot be rolled (no running router to steer traffic, a P/D
    node never deployed or unreachable, more than one older generation): then P and D restart together as before.

    `manifests`: each P/D node's last manifest (None: none); `undrains_by_node`: the Undrain operations the planner
    made for each node's restarts (the roll runs them only after the router serves the node in its new generation);
    `running_new`: nodes whose engines already run the new release on the new files while their manifest is behind (a
    killed apply): they serve the new generation from step 0 on and are not moved again."""
    import yaml

    from bpdkv.deploy import efa
    from bpdkv.deploy import operations as ops
    from bpdkv.generations import compat_fingerprint, router_generation

    if router is None:
        return None
    desired = compat_fingerprint(topology)
    new_entry = router_generation(topology)
    pd_nodes = [n for n in topology.nodes if any(i.role in ("prefill", "decode") for i in n.instances)]
    known: dict[str, dict[str, Any]] = {}
    for node in pd_nodes:
        manifest = manifests.get(node.name)
        if manifest is None or not manifest.get("compat"):
            if getattr(node, "spare", False):
                continue  # a spare that never ran: the surge deploys it
            return None
        known[node.name] = manifest
    old_entry = old_generation(known, desired, new_entry)
    if old_entry is None:
        return None
    old, new = old_entry["id"], new_entry["id"]

    def slot(node: Any) -> Slot:
        roles = [i.role for i in node.instances]
        return Slot(node.name, roles.count("prefill"), roles.count("decode"), bool(getattr(node, "spare", False)))

    def is_moved(node: Any) -> bool:
        return not getattr(node, "spare", False) and (known[node.name]["compat"] == desired or node.name in running_new)

    moved = [slot(n) for n in pd_nodes if is_moved(n)]
    todo = [slot(n) for n in pd_nodes if not is_moved(n)]
    adopted = tuple(n.name for n in pd_nodes if is_moved(n) and known[n.name]["compat"] != desired)
    roll = plan_roll(todo, old, new, max_unavailable, moved)

    router_node = router[0]
    router_inst = next(i for n, i in topology.instances("router") if n.name == router_node)
    art = next(a for a in artifacts if a.host == router_node and a.instance == router_inst.name and a.path.endswith(".router.yaml"))
    header = "".join(line for line in art.content.splitlines(keepends=True) if line.startswith("#"))
    final = yaml.safe_load(art.content)
    entries: dict[str, list[tuple[str, dict[str, str]]]] = {
        role: [(n.name, {"name": i.name, "url": f"http://{n.data_plane_address}:{i.port}"}) for n, i in topology.instances(role)]
        for role in ("prefill", "decode")
    }
    placement = {s.node: new for s in moved}
    placement.update({s.node: old for s in todo if not s.spare})

    def write(place: dict[str, str]) -> Any:
        if old not in place.values() and not any(s.spare and s.node in place for s in todo):
            content = art.content  # the last step: exactly the rendered config (the router's manifest records it)
        else:
            gens = [old_entry, new_entry] if old in place.values() else [new_entry]
            content = stage_config(final, header, entries, place, gens)
        return ops.WriteRouterConfig(router_node, art.path, art.mode, content, config_digest(content), admin_base, key_file)

    admin = (router_node, router[1], admin_base, key_file)
    prepare = write(placement)
    placement_at_start = list(placement)
    nodes = {n.name: n for n in topology.nodes}
    length = efa.probe_length(topology.kv_transfer.kv_recompute_threshold, topology.model.max_model_len or 0)
    python = f"{topology.vllm.venv}/bin/python"
    steps: list[RollStepPlan] = []
    for step in roll.steps:
        drains: tuple[Any, ...] = ()
        stops: tuple[Any, ...] = ()
        undrains: tuple[Any, ...] = ()
        probes: tuple[Any, ...] = ()
        if step.kind is StepKind.RETIRE:
            spare_insts = [(n, i) for name in step.nodes for n in (nodes[name],) for i in n.instances if i.role in ("prefill", "decode")]
            drains = tuple(ops.Drain(i.name, *admin) for _, i in spare_insts)
            for name in step.nodes:
                placement.pop(name, None)
            stops = tuple((n.name, ops.StopUnit(i.unit, i.name, "retire: the spare's capacity was the surge's")) for n, i in spare_insts)
        else:
            for name in step.nodes:
                placement[name] = new
            undrains = tuple(u for name in step.nodes for u in undrains_by_node.get(name, []))
            serving_new = [nodes[name] for name in placement if placement[name] == new]
            mine = [nodes[name] for name in step.nodes]
            p = next(((n, i) for n in mine + serving_new for i in n.instances if i.role == "prefill"), None)
            d = next(((n, i) for n in mine + serving_new for i in n.instances if i.role == "decode"), None)
            if p is not None and d is not None:
                (p_node, p_inst), (d_node, d_inst) = p, d
                command = efa.probe_command(
                    python,
                    f"http://127.0.0.1:{p_inst.port}",
                    f"http://{d_node.data_plane_address}:{d_inst.port}",
                    length,
                    ROLL_PROBE_TIMEOUT,
                )
                probes = (ops.ProbePull(p_inst.name, d_inst.name, p_node.name, d_node.name, command, "", ROLL_PROBE_TIMEOUT, "any"),)
        after = {g: c.to_json() for g, c in step.after.items() if c.prefill or c.decode}
        members = (
            ()
            if step.kind is StepKind.RETIRE
            else tuple(f"{i.role}:{i.name}" for name in step.nodes for i in nodes[name].instances if i.role in ("prefill", "decode"))
        )
        gate = ops.ServingGate(router_node, admin_base, json_key(after), key_file, generation=new, members=members)
        steps.append(RollStepPlan(step, write(dict(placement)), undrains, probes, gate, drains, stops))
    first = set(roll.steps[0].nodes) if roll.steps else set()
    serving_first = [name for name in placement_at_start if name not in first]
    prepare_undrains = tuple(u for name in serving_first for u in undrains_by_node.get(name, []))
    warnings: list[str] = []
    # The old release's venv from the nodes still on it (a moved node's manifest records the new one).
    old_venv = next(((m.get("packages") or {}).get("venv") for m in known.values() if m["compat"] != desired), None)
    if old_entry.get("vllm") != new_entry.get("vllm") and old_venv == topology.vllm.venv:
        warnings.append(
            f"vllm.venv is {topology.vllm.venv} for both releases: a cohort that fails its gate gets its previous files back "
            f"but keeps the new packages, so it cannot serve the old generation again; give the new release its own vllm.venv "
            f"(e.g. {topology.vllm.venv}-{new_entry.get('vllm')})"
        )
    return RollPlan(
        old,
        new,
        str(old_entry.get("vllm")),
        str(new_entry.get("vllm")),
        prepare,
        tuple(steps),
        tuple(roll.downtime_steps()),
        tuple(warnings),
        adopted,
        prepare_undrains,
    )
