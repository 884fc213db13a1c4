"""`bpdkv init`: scaffold a commented topology from a model + hardware preset and instance counts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from bpdkv import contracts
from bpdkv.errors import UsageError
from bpdkv.topology.profiles import find_profile, list_profiles, load_profile, suggest


@dataclass(frozen=True)
class InitRequest:
    name: str
    model: str
    hardware: str
    prefill: int = 1
    decode: int = 1
    prefill_tp: int | None = None  # None: the smallest TP whose engine holds the weights and one max_model_len sequence
    decode_tp: int | None = None


def _check_preset(kind: str, name: str) -> dict:
    ref = find_profile(kind, name)
    if ref is None:
        names = [p.name for p in list_profiles(kind)]
        raise UsageError(f"unknown {'model profile' if kind == 'models' else 'hardware preset'} '{name}'; {suggest(name, names)}")
    data = load_profile(ref).data
    assert isinstance(data, dict)
    return data


# Where `bpdkv init -o FILE` puts the editor schema, beside FILE; the modeline names it relative to the topology.
SCHEMA_FILE = "topology.schema.json"
MODELINE = f"# yaml-language-server: $schema={SCHEMA_FILE}"


def _auto_tp(req: InitRequest, model: dict, hw: dict) -> int:
    """The smallest TP that fits the model on this hardware (1 when the sizes or the GPU memory are unknown)."""
    from bpdkv.topology.capacity import sized, smallest_fitting_tp
    from bpdkv.topology.model import build_topology

    memory = hw.get("gpu_memory_gib")
    if hw.get("accelerator") == "cpu" or memory is None:
        return 1
    spec = build_topology({"name": "x", "model": model["model"], "vllm": model.get("vllm", {}), "nodes": []}).model
    if not sized(spec.size):
        return 1
    tp = smallest_fitting_tp(spec, float(memory), int(hw.get("gpus", 0)))
    if tp is None:
        raise UsageError(
            f"model '{req.model}' does not fit one {req.hardware} node at any tp (its weights and one max_model_len sequence "
            f"need more than {hw.get('gpus')} x {memory} GiB); see `bpdkv profiles show {req.model}` for hardware that fits"
        )
    return tp


def _no_rdma_read_lines(hardware: str) -> list[str]:
    """Hardware whose EFA cannot serve NIXL's READs (validate refuses LIBFABRIC there): say so, and scaffold UCX knowingly."""
    from bpdkv.topology.checks import PRESETS_WITHOUT_RDMA_READ

    if hardware not in PRESETS_WITHOUT_RDMA_READ:
        return []
    return [
        f"  # {hardware}: its EFA has no hardware RDMA READ, which NIXL's LIBFABRIC backend pulls KV with (validate refuses it);",
        "  # KV moves over UCX on TCP here, slower than EFA. Use p5/p5e/p5en for EFA KV transfer.",
        "  backend: UCX",
        "  allow_ucx_on_efa: true",
    ]


def scaffold_topology(req: InitRequest) -> str:
    """A topology the user can edit: P on node-p*, D on node-d*, router beside the first decode node."""
    model = _check_preset("models", req.model)
    hw = _check_preset("hardware", req.hardware)
    gpus_per_node = int(hw.get("gpus", 0))
    cpu = hw.get("accelerator") == "cpu"
    mla = model.get("model", {}).get("arch") == "mla"
    fitting = _auto_tp(req, model, hw) if req.prefill_tp is None or req.decode_tp is None else 1
    prefill_tp = req.prefill_tp if req.prefill_tp is not None else fitting
    decode_tp = req.decode_tp if req.decode_tp is not None else (fitting if mla else max(fitting, prefill_tp))
    req = InitRequest(req.name, req.model, req.hardware, req.prefill, req.decode, prefill_tp, decode_tp)
    if decode_tp < prefill_tp and not mla:
        raise UsageError(f"--decode-tp {decode_tp} < --prefill-tp {prefill_tp}: decode TP must be >= prefill TP for this model")

    def place(role: str, count: int, tp: int) -> list[list[str]]:
        nodes: list[list[str]] = []
        per_node = max(gpus_per_node // tp, 1) if not cpu else 1
        if not cpu and tp > gpus_per_node:
            raise UsageError(f"--{role}-tp {tp} needs more GPUs than a {req.hardware} node has ({gpus_per_node})")
        for i in range(count):
            if i % per_node == 0:
                nodes.append([])
            slot = i % per_node
            if cpu:
                nodes[-1].append(f"      - {{role: {role}}}")
            else:
                gpus = ", ".join(str(g) for g in range(slot * tp, slot * tp + tp))
                nodes[-1].append(f"      - {{role: {role}, gpus: [{gpus}], tp: {tp}}}")
        return nodes

    lines = [
        MODELINE,
        f"# Editors validate while you type against {SCHEMA_FILE} beside this file (`bpdkv schema > {SCHEMA_FILE}`).",
        f"# bpdkv topology scaffolded by `bpdkv init` from model profile '{req.model}' and hardware preset '{req.hardware}'.",
        "# Every key is described in `bpdkv schema` (and docs/topology.md of the sdist). Check: `bpdkv validate`; preview: `bpdkv render`.",
        "apiVersion: bpdkv/v1",
        f"name: {req.name}",
        f"profile: {req.model}                # {model.get('description', '')}",
        "",
        "kv_transfer:",
        "  bidirectional: true             # D keeps its KV after a turn; P pulls it on the next turn",
        f"  # decoder_kv_blocks_ttl: {contracts.DEFAULT_BLOCKS_TTL}    # seconds D keeps finished KV (router TTL is derived from it)",
        f"  # kv_recompute_threshold: {contracts.DEFAULT_RECOMPUTE_THRESHOLD}    # pull only when at least this many tokens would be reused",
        *_no_rdma_read_lines(req.hardware),
        "",
        "router:",
        "  state: memory                   # or redis://host:6379/0 to share sessions between routers",
        "",
        "ssh:",
        "  user: root                      # per-node `ssh:` overrides these",
        "  # identity_file: ~/.ssh/id_ed25519",
        "  # jump_host: bastion.example.com",
        "",
        "nodes:",
    ]
    n = 0
    for role, count, tp in (("prefill", req.prefill, prefill_tp), ("decode", req.decode, decode_tp)):
        for ni, block in enumerate(place(role, count, tp)):
            n += 1
            lines += [
                f"  - name: {role}-node-{ni}",
                f"    host: 10.0.0.{10 + n}              # SSH address: replace",
                f"    # data_plane_address: 10.0.1.{10 + n}  # address NIXL advertises (default: host)",
                f"    hardware: {req.hardware}",
                "    instances:",
                *block,
            ]
            if role == "decode" and ni == 0:
                lines.append("      - {role: router, port: 8000}")
    return "\n".join(lines) + "\n"


def write_schema_beside(topology_file: Path) -> Path | None:
    """Write the editor schema next to a scaffolded topology; keep a file there that is not bpdkv's. Returns what was written."""
    from bpdkv.topology.schema import editor_schema

    target = topology_file.parent / SCHEMA_FILE
    schema = editor_schema()
    text = json.dumps(schema, indent=2) + "\n"
    if target.exists():
        try:
            existing = json.loads(target.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(existing, dict) or existing.get("$id") != schema["$id"] or existing == schema:
            return None
    target.write_text(text, encoding="utf-8")
    return target
