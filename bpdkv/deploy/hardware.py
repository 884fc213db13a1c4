"""Hardware facts (GPUs, EFA, libfabric, GPUDirect RDMA) and the preflight check that a host is what its preset claims.

Each fact is a read-only shell command plus a pure parser (fixtures: tests/data/facts/hardware/). `check_hardware`
compares the parsed facts with the node's preset (GPU count/model, EFA devices) and with what NIXL's LIBFABRIC backend
needs, and returns typed problems that make `plan` refuse the host before anything is written.

Sources for the requirements:
- NIXL src/plugins/libfabric/README.md: libfabric >= v1.21.0; GPU Direct RDMA "currently required"; verify EFA with
  `ls /sys/class/infiniband/` and `fi_info -p efa`.
- AWS EFA user guide (GPUDirect RDMA): either the efa_nv_peermem module, or DMA-BUF (Linux >= 5.12 with
  CONFIG_DMA_SHARED_BUFFER) with the open NVIDIA kernel modules.
- AWS EFA user guide: hardware RDMA read only on instances with Nitro v4 and later; bpdkv.topology.checks.PRESETS_WITHOUT_RDMA_READ (refused from the topology alone).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bpdkv.deploy.facts import Fact, PreflightProblem
from bpdkv.render import Artifact
from bpdkv.topology.capacity import host_tier_gib, host_tier_problems
from bpdkv.topology.model import Node, Topology

MIN_LIBFABRIC = (1, 21, 0)  # NIXL libfabric plugin README: "Minimum required version: v1.21.0"
MIN_DMABUF_KERNEL = (5, 12)  # dma-buf import for RDMA MRs landed in Linux 5.12
EFA_BIN = "/opt/amazon/efa/bin"  # the EFA installer's tools, not always on a login shell's PATH


# ---- GPUs ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str  # as nvidia-smi reports it, e.g. "NVIDIA H200"
    memory_mib: int


@dataclass(frozen=True)
class GpuReport:
    gpus: tuple[Gpu, ...]
    error: str | None  # why nvidia-smi gave no list (missing, driver not loaded), None when it answered


class NvidiaGpus(Fact[GpuReport]):
    """`nvidia-smi --query-gpu` as CSV; a missing tool or an unloaded driver is a report, not an exception."""

    name = "gpus"
    command = (
        "if command -v nvidia-smi >/dev/null 2>&1; then "
        "nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits 2>&1; "
        "else echo 'bpdkv: nvidia-smi not found'; fi"
    )

    def parse(self, stdout: str) -> GpuReport:
        gpus = []
        errors = []
        for line in stdout.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
                gpus.append(Gpu(int(parts[0]), parts[1], int(parts[2])))
            elif line.strip():
                errors.append(line.strip())
        if gpus:
            return GpuReport(tuple(gpus), None)
        return GpuReport((), errors[0][:200] if errors else "nvidia-smi listed no GPUs")


def gpu_family(text: str) -> str | None:
    """The model family both a preset ("H200-141GB") and nvidia-smi ("NVIDIA H200") name: H200, H100, A100, L40S…"""
    match = re.search(r"\b([A-Z]{1,2}\d{2,3}[A-Z]?)\b", text.upper().replace("-", " "))
    return match.group(1) if match else None


# ---- EFA -------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RdmaDevice:
    name: str  # e.g. rdmap16s27
    driver: str  # kernel driver bound to it, "efa" for EFA


class RdmaDevices(Fact[tuple[RdmaDevice, ...]]):
    """Devices under /sys/class/infiniband with their driver (an empty answer: no RDMA devices at all)."""

    name = "rdma devices"
    command = (
        'for d in /sys/class/infiniband/*; do [ -e "$d" ] || continue; '
        'echo "$(basename "$d") $(basename "$(readlink -f "$d/device/driver")")"; done'
    )

    def parse(self, stdout: str) -> tuple[RdmaDevice, ...]:
        out = []
        for line in stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                out.append(RdmaDevice(parts[0], parts[1]))
        return tuple(out)


@dataclass(frozen=True)
class FabricInfo:
    provider: str
    fabric: str
    domain: str
    endpoint_type: str


@dataclass(frozen=True)
class EfaProviderReport:
    entries: tuple[FabricInfo, ...]
    error: str | None  # fi_info missing or "No data available"

    @property
    def rdm_domains(self) -> tuple[str, ...]:
        """One RDM domain per EFA device on the `efa` fabric (libfabric 2.x also lists `efa-direct`)."""
        return tuple(
            sorted({e.domain for e in self.entries if e.provider == "efa" and e.fabric != "efa-direct" and "RDM" in e.endpoint_type})
        )


class EfaProvider(Fact[EfaProviderReport]):
    """`fi_info -p efa`: what libfabric itself can open (the EFA installer's fi_info first on PATH)."""

    name = "fi_info -p efa"
    command = (
        f"PATH={EFA_BIN}:$PATH; if command -v fi_info >/dev/null 2>&1; then fi_info -p efa 2>&1; else echo 'bpdkv: fi_info not found'; fi"
    )

    def parse(self, stdout: str) -> EfaProviderReport:
        entries = []
        current: dict[str, str] = {}

        def flush() -> None:
            if "provider" in current:
                entries.append(
                    FabricInfo(current["provider"], current.get("fabric", ""), current.get("domain", ""), current.get("type", ""))
                )

        errors = []
        for line in stdout.splitlines():
            key, sep, value = line.strip().partition(":")
            if not sep:
                continue
            if key == "provider":
                flush()
                current = {"provider": value.strip()}
            elif key in ("fabric", "domain", "type") and current:
                current[key] = value.strip()
            elif line.startswith(("bpdkv:", "fi_getinfo", "fi_info")) or "No data available" in line:
                errors.append(line.strip())
        flush()
        if entries:
            return EfaProviderReport(tuple(entries), None)
        return EfaProviderReport((), errors[0][:200] if errors else "fi_info listed no efa provider")


class LibfabricVersion(Fact["tuple[int, int, int] | None"]):
    """`fi_info --version` ("libfabric: 1.22.0amzn4.0"); None when fi_info is not installed."""

    name = "libfabric"
    command = f"PATH={EFA_BIN}:$PATH; fi_info --version 2>&1 || true"

    def parse(self, stdout: str) -> tuple[int, int, int] | None:
        match = re.search(r"^libfabric:\s*(\d+)\.(\d+)(?:\.(\d+))?", stdout, re.MULTILINE)
        if not match:
            return None
        return int(match.group(1)), int(match.group(2)), int(match.group(3) or 0)


# ---- kernel: GPUDirect RDMA ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelReport:
    release: str  # uname -r
    version: tuple[int, int]
    dma_buf: bool  # CONFIG_DMA_SHARED_BUFFER=y
    modules: tuple[str, ...]  # the loaded ones among efa, efa_nv_peermem, nvidia, nvidia_peermem (None known: empty)
    modules_known: bool  # /proc/modules was readable

    @property
    def gpudirect_rdma(self) -> str | None:
        """How GPU memory can be registered with EFA, or None when neither way is available."""
        if "efa_nv_peermem" in self.modules:
            return "efa_nv_peermem"
        if self.version >= MIN_DMABUF_KERNEL and self.dma_buf:
            return "dma-buf"
        return None


class KernelRdma(Fact[KernelReport]):
    """Kernel release, DMA-BUF in its config, and the loaded EFA/NVIDIA peer-memory modules."""

    name = "kernel"
    command = (
        "uname -r; echo '--config'; "
        "( zcat /proc/config.gz 2>/dev/null || cat /boot/config-$(uname -r) 2>/dev/null ) | grep -E '^CONFIG_DMA_SHARED_BUFFER='; "
        "echo '--modules'; "
        "if [ -r /proc/modules ]; then cut -d' ' -f1 /proc/modules | grep -E '^(efa|efa_nv_peermem|nvidia|nvidia_peermem)$'; "
        "else echo '(unreadable)'; fi"
    )

    def parse(self, stdout: str) -> KernelReport:
        lines = stdout.splitlines()
        release = lines[0].strip() if lines else ""
        match = re.match(r"(\d+)\.(\d+)", release)
        version = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
        section = ""
        dma_buf = False
        modules: list[str] = []
        known = True
        for line in lines[1:]:
            text = line.strip()
            if text in ("--config", "--modules"):
                section = text
            elif section == "--config" and text == "CONFIG_DMA_SHARED_BUFFER=y":
                dma_buf = True
            elif section == "--modules" and text:
                if text == "(unreadable)":
                    known = False
                else:
                    modules.append(text)
        return KernelReport(release, version, dma_buf, tuple(modules), known)


# ---- host memory -----------------------------------------------------------------------------------------------


class HostMemory(Fact[float | None]):
    """The node's RAM in GiB (/proc/meminfo MemTotal, kB), for the host-memory KV tiers; None when not readable."""

    name = "host memory"
    command = "grep -m1 '^MemTotal:' /proc/meminfo 2>/dev/null || echo 'bpdkv: /proc/meminfo not readable'"

    def parse(self, stdout: str) -> float | None:
        match = re.search(r"^MemTotal:\s+(\d+)\s+kB", stdout, re.MULTILINE)
        return int(match.group(1)) / (1 << 20) if match else None


HARDWARE_FACTS: tuple[Fact[Any], ...] = (NvidiaGpus(), RdmaDevices(), EfaProvider(), LibfabricVersion(), KernelRdma(), HostMemory())


# ---- the check -------------------------------------------------------------------------------------------------


def _needs_hardware(node: Node) -> bool:
    return any(i.role != "router" for i in node.instances)


def _efa_used(topology: Topology, node: Node) -> bool:
    return topology.kv_transfer.backend == "LIBFABRIC" and _needs_hardware(node)


def check_hardware(topology: Topology, node: Node, facts: Mapping[str, Any]) -> list[PreflightProblem]:
    """Problems that make this host unfit for its preset and backend. `facts` maps fact name → parsed value
    (HARDWARE_FACTS); a fact missing from the mapping is not checked. Router-only nodes need no accelerator."""
    if not _needs_hardware(node):
        return []
    problems: list[PreflightProblem] = []
    preset = node.hardware or "the topology"

    def problem(fact: str, message: str) -> None:
        problems.append(PreflightProblem(node.name, fact, message))

    gpus = facts.get(NvidiaGpus.name)
    if node.accelerator == "gpu" and isinstance(gpus, GpuReport):
        if gpus.error is not None:
            problem("gpus", f"no GPU list ({gpus.error}); install the NVIDIA driver (docs/ec2.md, AMI requirements)")
        elif len(gpus.gpus) < node.gpus:
            problem("gpus", f"nvidia-smi lists {len(gpus.gpus)} GPU(s), {preset} needs {node.gpus}; check the instance type and driver")
        elif node.gpu_model and gpu_family(node.gpu_model):
            found = sorted({gpu_family(g.name) or g.name for g in gpus.gpus})
            if found != [gpu_family(node.gpu_model)]:
                problem("gpus", f"GPUs are {', '.join(found)}, {preset} says {node.gpu_model}; use the preset of this instance type")

    if node.efa_devices > 0 or _efa_used(topology, node):
        devices = facts.get(RdmaDevices.name)
        if isinstance(devices, tuple):
            efa = [d for d in devices if d.driver == "efa"]
            if len(efa) < max(node.efa_devices, 1):
                problem(
                    "efa devices",
                    f"{len(efa)} EFA device(s) in /sys/class/infiniband, {preset} has {node.efa_devices}; "
                    "launch with every EFA network card (InterfaceType efa) and load the efa driver",
                )
        provider = facts.get(EfaProvider.name)
        if isinstance(provider, EfaProviderReport) and not provider.rdm_domains:
            problem("fi_info -p efa", f"libfabric opens no EFA RDM domain ({provider.error}); install the EFA installer (docs/ec2.md)")

    if _efa_used(topology, node):
        if "libfabric" in facts:
            version = facts["libfabric"]
            if version is None:
                problem("libfabric", f"fi_info not found (looked in {EFA_BIN} and PATH); install the EFA installer")
            elif tuple(version) < MIN_LIBFABRIC:
                have = ".".join(str(x) for x in version)
                problem(
                    "libfabric", f"libfabric {have} is older than 1.21.0, which NIXL's LIBFABRIC backend requires; update the EFA installer"
                )
        kernel = facts.get(KernelRdma.name)
        if isinstance(kernel, KernelReport) and node.accelerator == "gpu" and kernel.gpudirect_rdma is None:
            problem(
                "kernel",
                f"no GPUDirect RDMA: kernel {kernel.release} "
                + ("has no DMA-BUF" if kernel.version >= MIN_DMABUF_KERNEL else "is older than 5.12")
                + " and efa_nv_peermem is not loaded; NIXL's LIBFABRIC backend requires GPUDirect RDMA "
                "(use a kernel >= 5.12 with the open NVIDIA modules, or load efa_nv_peermem)",
            )

    ram = facts.get(HostMemory.name)
    if isinstance(ram, float) and host_tier_gib(node) > 0:
        for _, message in host_tier_problems(node, ram, "MemTotal"):
            problem("host memory", message)
    return problems


def memlock_problems(node: Node, artifacts: list[Artifact]) -> list[PreflightProblem]:
    """NIXL registers the whole KV cache: every vLLM unit on an EFA node must run with LimitMEMLOCK=infinity."""
    if node.efa_devices == 0:
        return []
    engines = {i.name for i in node.instances if i.role != "router"}
    out = []
    for artifact in artifacts:
        if artifact.host == node.name and artifact.unit and artifact.instance in engines:
            if not re.search(r"^LimitMEMLOCK=infinity\s*$", artifact.content, re.MULTILINE):
                out.append(
                    PreflightProblem(
                        node.name, "ulimit -l", f"{artifact.path} does not set LimitMEMLOCK=infinity; NIXL cannot pin the KV cache"
                    )
                )
    return out
