"""`bpdkv init`: scaffold a commented topology from a model + hardware preset and instance counts."""

from __future__ import annotations

from dataclasses import dataclass

from bpdkv.errors import UsageError
from bpdkv.topology.profiles import find_profile, list_profiles, load_profile, suggest


@dataclass(frozen=True)
class InitRequest:
    name: str
    model: str
    hardware: str
    prefill: int = 1
    decode: int = 1
    prefill_tp: int = 1
    decode_tp: int = 1


def _check_preset(kind: str, name: str) -> dict:
    ref = find_profile(kind, name)
    if ref is None:
        names = [p.name for p in list_profiles(kind)]
        raise UsageError(f"unknown {'model profile' if kind == 'models' else 'hardware preset'} '{name}'; {suggest(name, names)}")
    data = load_profile(ref).data
    assert isinstance(data, dict)
    return data


def scaffold_topology(req: InitRequest) -> str:
    """A topology the user can edit: P on node-p*, D on node-d*, router beside the first decode node."""
    model = _check_preset("models", req.model)
    hw = _check_preset("hardware", req.hardware)
    gpus_per_node = int(hw.get("gpus", 0))
    cpu = hw.get("accelerator") == "cpu"
    if req.decode_tp < req.prefill_tp and model.get("model", {}).get("arch") != "mla":
        raise UsageError(f"--decode-tp {req.decode_tp} < --prefill-tp {req.prefill_tp}: decode TP must be >= prefill TP for this model")

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
        f"# bpdkv topology scaffolded by `bpdkv init` from model profile '{req.model}' and hardware preset '{req.hardware}'.",
        "# Reference: docs/topology.md. Validate with `bpdkv validate`, preview with `bpdkv render`.",
        "apiVersion: bpdkv/v1",
        f"name: {req.name}",
        f"profile: {req.model}                # {model.get('description', '')}",
        "",
        "kv_transfer:",
        "  bidirectional: true             # D keeps its KV after a turn; P pulls it on the next turn",
        "  # decoder_kv_blocks_ttl: 480    # seconds D keeps finished KV (router TTL is derived from it)",
        "  # kv_recompute_threshold: 64    # pull only when at least this many tokens would be reused",
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
    for role, count, tp in (("prefill", req.prefill, req.prefill_tp), ("decode", req.decode, req.decode_tp)):
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
