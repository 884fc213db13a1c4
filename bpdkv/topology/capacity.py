"""Weights and KV-cache capacity per instance, from the model's sizes and the node's GPU memory.

Per GPU of an instance with tensor parallelism ``tp`` (one engine = one DP rank):

    usable   = gpu_memory_gib x gpu_memory_utilization - ACTIVATION_HEADROOM_GIB
    weights  = parameters x bytes_per_parameter / tp
    kv       = usable - weights
    per token: GQA/MHA  2 (K and V) x layers x ceil(kv_heads / tp) x head_dim x kv bytes  (heads are split over TP)
               MLA      layers x (kv_lora_rank + qk_rope_head_dim) x kv bytes              (every TP rank holds it all)
    kv_tokens = kv / per token

vLLM measures the real activation peak at start-up by a profiling forward pass; bpdkv cannot, so it reserves
ACTIVATION_HEADROOM_GIB per GPU (activations of one max-size batch, CUDA graphs, NCCL buffers) and says so in every
figure it prints. What is not modelled: expert parallelism sharding MoE weights over DP ranks (weights are counted
whole per engine: conservative), sliding-window layers (counted as full layers: conservative), the indexer cache of
sparse-attention MLA models and fp8 scale factors (small). On CPU nodes vLLM's KV space is VLLM_CPU_KVCACHE_SPACE GiB;
weights are not checked there (host RAM is not in the topology).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from bpdkv.contracts import DEFAULT_HOLD_BUDGET
from bpdkv.topology.model import DTYPE_BYTES, Instance, ModelSize, ModelSpec, Node, Topology, build_topology
from bpdkv.topology.vllm_args import option_value

GIB = 1024**3
# vLLM's default --gpu-memory-utilization.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Reserved per GPU for what vLLM's profiling run finds at start (see the module docstring); an estimate, stated as such.
ACTIVATION_HEADROOM_GIB = 2.0
KV_DTYPE_BYTES = {"bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# A hold budget that leaves live requests fewer tokens than this many max_model_len sequences draws a warning.
MIN_LIVE_SEQUENCES = 2
TP_CHOICES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class Capacity:
    """Memory figures of one engine (one DP rank of an instance); GiB per device unless named otherwise."""

    device: str  # "gpu" | "cpu"
    tp: int
    memory_gib: float  # one GPU's memory, or the CPU KV space
    gpu_memory_utilization: float
    activation_headroom_gib: float
    weights_gib: float  # per device (0 on CPU: not checked)
    kv_gib: float  # per device, what is left for the KV cache
    kv_bytes_per_token: int  # per device
    kv_tokens: int  # tokens the engine's KV cache holds
    max_model_len: int | None
    hold_budget: float | None = None  # share of the KV cache D may keep for finished turns (node plugin)

    @property
    def weights_fit(self) -> bool:
        return self.kv_gib > 0 or self.device == "cpu"

    @property
    def live_tokens(self) -> int:
        """Tokens left for running requests when the hold budget is full."""
        return int(self.kv_tokens * (1 - (self.hold_budget or 0.0)))

    def to_json(self) -> dict[str, object]:
        out = asdict(self)
        out["live_tokens"] = self.live_tokens
        for key in ("memory_gib", "weights_gib", "kv_gib"):
            out[key] = round(float(out[key]), 2)
        return out


def sized(size: ModelSize | None) -> bool:
    """Whether the sizes describe the KV layout (GQA/MHA heads or an MLA latent), not only the weights."""
    return size is not None and (size.kv_lora_rank is not None or (size.kv_heads is not None and size.head_dim is not None))


def kv_bytes(model: ModelSpec, kv_cache_dtype: str) -> int:
    if kv_cache_dtype in KV_DTYPE_BYTES:
        return KV_DTYPE_BYTES[kv_cache_dtype]
    return DTYPE_BYTES[model.dtype]  # "auto": the model's dtype


def kv_bytes_per_token(size: ModelSize, tp: int, element_bytes: int) -> int:
    """KV bytes one token takes on one TP rank."""
    if size.kv_lora_rank is not None:
        return size.layers * (size.kv_lora_rank + (size.qk_rope_head_dim or 0)) * element_bytes
    heads = math.ceil((size.kv_heads or 1) / tp)  # fewer KV heads than ranks: each rank keeps a copy of one
    return 2 * size.layers * heads * (size.head_dim or 0) * element_bytes


def weights_gib(size: ModelSize, tp: int) -> float:
    return size.parameters * size.bytes_per_parameter / tp / GIB


def gpu_capacity(
    model: ModelSpec,
    size: ModelSize,
    gpu_memory_gib: float,
    tp: int,
    kv_cache_dtype: str,
    utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    hold_budget: float | None = None,
) -> Capacity:
    weights = weights_gib(size, tp)
    kv = gpu_memory_gib * utilization - ACTIVATION_HEADROOM_GIB - weights
    per_token = kv_bytes_per_token(size, tp, kv_bytes(model, kv_cache_dtype))
    tokens = int(kv * GIB // per_token) if kv > 0 and per_token > 0 else 0
    return Capacity(
        "gpu", tp, gpu_memory_gib, utilization, ACTIVATION_HEADROOM_GIB, weights, kv, per_token, tokens, model.max_model_len, hold_budget
    )


def _hold_budget(t: Topology, inst: Instance) -> float | None:
    """D's hold budget as the node plugin applies it: the topology's value, else the plugin's default."""
    if inst.role != "decode" or not t.kv_transfer.bidirectional or t.kv_transfer.connector != "bpdkv":
        return None
    return inst.kv_hold_budget if inst.kv_hold_budget is not None else DEFAULT_HOLD_BUDGET


def instance_capacity(t: Topology, node: Node, inst: Instance) -> Capacity | None:
    """The figures of one P or D instance, or None when the model's sizes or the node's memory are unknown."""
    size = t.model.size
    if inst.role == "router" or size is None or not sized(size):
        return None
    args = list(t.vllm.extra_args) + list(inst.extra_args)
    hold = _hold_budget(t, inst)
    if node.accelerator == "cpu":
        space = dict(inst.env).get("VLLM_CPU_KVCACHE_SPACE")
        try:
            space_gib = float(space) if space is not None else None
        except ValueError:
            space_gib = None
        if not space_gib:
            return None
        per_token = kv_bytes_per_token(size, inst.tp, kv_bytes(t.model, inst.kv_cache_dtype))
        tokens = int(space_gib * GIB // per_token) if per_token else 0
        return Capacity("cpu", inst.tp, space_gib, 1.0, 0.0, 0.0, space_gib, per_token, tokens, t.model.max_model_len, hold)
    if node.gpu_memory_gib is None:
        return None
    utilization, _ = gpu_memory_utilization(args)
    if inst.gpu_memory_share is not None:  # the shared-GPU layout: the topology's share is what bpdkv renders
        utilization = inst.gpu_memory_share
    return gpu_capacity(t.model, size, node.gpu_memory_gib, inst.tp, inst.kv_cache_dtype, utilization, hold)


def gpu_memory_utilization(args: list[str]) -> tuple[float, str | None]:
    """--gpu-memory-utilization from extra_args (any spelling), vLLM's default without it; and what is wrong with it."""
    raw = option_value(args, "gpu_memory_utilization")
    if raw is None:
        return DEFAULT_GPU_MEMORY_UTILIZATION, None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1:
        return DEFAULT_GPU_MEMORY_UTILIZATION, f"--gpu-memory-utilization {raw!r} must be a share of GPU memory in (0, 1]"
    return value, None


def fits(cap: Capacity) -> bool:
    """Weights fit and the KV cache holds at least one max_model_len sequence."""
    return cap.weights_fit and cap.kv_tokens >= (cap.max_model_len or 1)


def smallest_fitting_tp(
    model: ModelSpec,
    gpu_memory_gib: float,
    max_gpus: int,
    kv_cache_dtype: str | None = None,
    utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
) -> int | None:
    """The smallest power-of-two TP (<= max_gpus) whose engine holds the weights and one max_model_len sequence."""
    if model.size is None or not sized(model.size):
        return None
    for tp in TP_CHOICES:
        if tp > max_gpus:
            break
        if fits(gpu_capacity(model, model.size, gpu_memory_gib, tp, kv_cache_dtype or model.kv_cache_dtype, utilization)):
            return tp
    return None


def describe(cap: Capacity) -> str:
    """One line of figures, e.g. for `bpdkv profiles show`."""
    if cap.device == "cpu":
        return f"KV space {cap.memory_gib:g} GiB (VLLM_CPU_KVCACHE_SPACE): {cap.kv_tokens:,} tokens at {cap.kv_bytes_per_token:,} B/token"
    return (
        f"tp {cap.tp}: weights {cap.weights_gib:.1f} GiB/GPU, KV {max(cap.kv_gib, 0):.1f} GiB/GPU = {cap.kv_tokens:,} tokens "
        f"({cap.kv_bytes_per_token:,} B/token/GPU; {cap.memory_gib:g} GiB x {cap.gpu_memory_utilization:g} - "
        f"{cap.activation_headroom_gib:g} GiB headroom)"
    )


def capacity_problems(t: Topology) -> Iterator[tuple[Instance, str, str]]:
    """(instance, severity, message) for weights or one sequence that do not fit, and hold budgets that crowd out live requests."""
    for node, inst in t.instances():
        if inst.role != "router":
            _, wrong = gpu_memory_utilization(list(t.vllm.extra_args) + list(inst.extra_args))
            if wrong:
                yield inst, "error", f"{inst.role} '{inst.name}': {wrong}"
                continue
        cap = instance_capacity(t, node, inst)
        if cap is None:
            continue
        where = f"{inst.role} '{inst.name}' (tp {inst.tp} on {node.gpu_model or node.hardware or node.name})"
        better = None
        if cap.device == "gpu":
            better = smallest_fitting_tp(t.model, cap.memory_gib, node.gpus, inst.kv_cache_dtype, cap.gpu_memory_utilization)
        if better is not None and better > inst.tp:
            hint = f"use tp {better} or more"
        elif better is not None:
            hint = "raise --gpu-memory-utilization"
        else:
            hint = f"no tp up to the node's {node.gpus} GPUs fits: use GPUs with more memory"
        if not cap.weights_fit:
            usable = cap.memory_gib * cap.gpu_memory_utilization - cap.activation_headroom_gib
            yield (
                inst,
                "error",
                f"{where}: weights need {cap.weights_gib:.1f} GiB per GPU but {usable:.1f} GiB is usable "
                f"({cap.memory_gib:g} GiB x gpu_memory_utilization {cap.gpu_memory_utilization:g} - "
                f"{cap.activation_headroom_gib:g} GiB activation headroom); {hint}",
            )
            continue
        if cap.max_model_len and cap.kv_tokens < cap.max_model_len:
            fix = hint if cap.device == "gpu" else "raise VLLM_CPU_KVCACHE_SPACE"
            yield (
                inst,
                "error",
                f"{where}: KV cache holds {cap.kv_tokens:,} tokens ({max(cap.kv_gib, 0):.1f} GiB per device after weights), "
                f"less than one max_model_len {cap.max_model_len:,} sequence; {fix} or lower model.max_model_len",
            )
            continue
        if cap.hold_budget and cap.max_model_len and cap.live_tokens < MIN_LIVE_SEQUENCES * cap.max_model_len:
            yield (
                inst,
                "warning",
                f"{where}: hold budget {cap.hold_budget:g} leaves {cap.live_tokens:,} of {cap.kv_tokens:,} KV tokens for live requests, "
                f"fewer than {MIN_LIVE_SEQUENCES} max_model_len sequences; lower the hold budget or raise tp",
            )


def profile_figures(profile: dict[str, Any], hardware: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """Lines for `bpdkv profiles show MODEL`: per GPU hardware preset, the smallest TP that fits and its figures."""
    model = build_topology({"name": "x", "model": profile["model"], "vllm": profile.get("vllm", {}), "nodes": []}).model
    size = model.size
    if size is None or not sized(size):
        return ["no sizes in this profile (parameters, layers, KV heads or MLA latent): capacity is not checked"]
    weights = size.parameters * size.bytes_per_parameter / GIB
    lines = [
        f"weights {weights:.1f} GiB ({size.parameters:,} parameters x {size.bytes_per_parameter:g} B); "
        f"KV {kv_bytes_per_token(size, 1, kv_bytes(model, model.kv_cache_dtype)):,} B/token at tp 1; "
        f"max_model_len {model.max_model_len or 'from the model'}"
    ]
    space = profile.get("vllm", {}).get("env", {}).get("VLLM_CPU_KVCACHE_SPACE")
    if space is not None:
        per_token = kv_bytes_per_token(size, 1, kv_bytes(model, model.kv_cache_dtype))
        lines.append(f"CPU node, VLLM_CPU_KVCACHE_SPACE {space} GiB: {int(float(space) * GIB // per_token):,} tokens")
    for name, preset in hardware:
        memory = preset.get("gpu_memory_gib")
        if preset.get("accelerator") != "gpu" or memory is None:
            continue
        gpus = int(preset.get("gpus", 0))
        tp = smallest_fitting_tp(model, float(memory), gpus)
        if tp is None:
            lines.append(f"{name}: no tp up to {gpus} GPUs fits ({memory:g} GiB per GPU)")
        else:
            lines.append(f"{name}: smallest fitting {describe(gpu_capacity(model, size, float(memory), tp, model.kv_cache_dtype))}")
    return lines


# ---- the host-memory KV tier (kv_host_memory_gib: vLLM's OffloadingConnector CPU tier) -----------------------------
# The share of a node's RAM its engines' host tiers may take together. The rest is for the OS, each engine's own
# process (API server, scheduler, CUDA context, pinned staging: several GiB each) and the page cache weights load through.
HOST_TIER_MAX_SHARE = 0.8


def host_tier_gib(node: Node) -> float:
    """RAM the node's engines pin for their host tiers: each DP rank is its own engine with its own tier."""
    return sum(i.kv_host_memory_gib * i.dp for i in node.instances if i.kv_host_memory_gib)


def host_tier_problems(node: Node, ram_gib: float, source: str) -> Iterator[tuple[Instance, str]]:
    """(instance, message) for each engine with a host tier when the node's tiers add up to more than
    HOST_TIER_MAX_SHARE of its RAM; the message says what this instance's field would have to be. `source` names
    where the RAM figure comes from (the topology's host_memory_gib, or MemTotal read at plan time)."""
    total = host_tier_gib(node)
    budget = ram_gib * HOST_TIER_MAX_SHARE
    if total <= budget + 1e-9:
        return
    tiers = [i for i in node.instances if i.kv_host_memory_gib]
    parts = " + ".join(f"{i.name} {i.kv_host_memory_gib:g}" + (f" x dp {i.dp}" if i.dp > 1 else "") for i in tiers)
    for inst in tiers:
        others = total - (inst.kv_host_memory_gib or 0.0) * inst.dp
        room = max(budget - others, 0.0) / inst.dp
        fix = f"at most {math.floor(room * 10) / 10:g}" if room >= 0.1 else "0 (the other tiers take the budget: lower them)"
        yield (
            inst,
            f"host-memory KV tiers on node {node.name} take {parts} = {total:g} GiB, more than "
            f"{HOST_TIER_MAX_SHARE:.0%} of its {ram_gib:g} GiB RAM ({source}); kv_host_memory_gib of {inst.name}: {fix}",
        )


def host_tier_tokens(t: Topology, inst: Instance) -> int | None:
    """Tokens one engine's host tier holds (cpu_bytes_to_use spans all its TP workers), None when unknown."""
    size = t.model.size
    if not inst.kv_host_memory_gib or size is None or not sized(size):
        return None
    per_token = kv_bytes_per_token(size, inst.tp, kv_bytes(t.model, inst.kv_cache_dtype)) * inst.tp
    return int(inst.kv_host_memory_gib * GIB // per_token) if per_token else None
