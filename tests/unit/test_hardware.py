"""Hardware facts: parsers on captured/documented outputs, and check_hardware against presets (no host needed)."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path
from typing import Any

import pytest

from bpdkv.deploy import efa
from bpdkv.deploy.hardware import (
    HARDWARE_FACTS,
    EfaProvider,
    KernelRdma,
    LibfabricVersion,
    NvidiaGpus,
    RdmaDevices,
    check_hardware,
    gpu_family,
    memlock_problems,
)
from bpdkv.errors import InvalidTopology
from bpdkv.render import render_topology
from bpdkv.topology.model import Node, Topology
from bpdkv.topology.validate import load_topology

FIXTURES = Path(__file__).parent.parent / "data" / "facts" / "hardware"
EXAMPLES = Path(__file__).parent.parent.parent / "examples"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def facts(gpus: str, devices: str, provider: str, version: str, kernel: str) -> dict[str, Any]:
    return {
        NvidiaGpus.name: NvidiaGpus().parse(fixture(gpus)),
        RdmaDevices.name: RdmaDevices().parse(fixture(devices)),
        EfaProvider.name: EfaProvider().parse(fixture(provider)),
        LibfabricVersion.name: LibfabricVersion().parse(fixture(version)),
        KernelRdma.name: KernelRdma().parse(fixture(kernel)),
    }


GOOD_P5EN = (
    "nvidia-smi.p5en.doc.txt",
    "infiniband.p5en.doc.txt",
    "fi_info-efa.p5en-libfabric-1.22.doc.txt",
    "fi_info-version.1.22.doc.txt",
    "kernel.ubuntu-6.8-aws-dmabuf.doc.txt",
)


@pytest.fixture(scope="module")
def p5en() -> tuple[Topology, Node, Node]:
    t = load_topology(EXAMPLES / "p5en-qwen3-32b.yaml").topology
    return t, t.nodes[0], t.nodes[1]


# ---- parsers ---------------------------------------------------------------------------------------------------


def test_nvidia_smi_parser() -> None:
    report = NvidiaGpus().parse(fixture("nvidia-smi.p5en.doc.txt"))
    assert report.error is None and len(report.gpus) == 8
    assert report.gpus[7].index == 7 and report.gpus[0].name == "NVIDIA H200" and report.gpus[0].memory_mib == 143771
    missing = NvidiaGpus().parse(fixture("nvidia-smi.none.real.txt"))
    assert missing.gpus == () and missing.error and "not found" in missing.error
    unloaded = NvidiaGpus().parse(fixture("nvidia-smi.driver-not-loaded.doc.txt"))
    assert unloaded.gpus == () and unloaded.error and "couldn't communicate" in unloaded.error


def test_gpu_family_matches_presets_and_nvidia_smi_names() -> None:
    assert gpu_family("H200-141GB") == gpu_family("NVIDIA H200") == "H200"
    assert gpu_family("A100-40GB") == gpu_family("NVIDIA A100-SXM4-40GB") == "A100"
    assert gpu_family("NVIDIA H100 80GB HBM3") == "H100"


def test_infiniband_parser_counts_efa_driver_only() -> None:
    devices = RdmaDevices().parse(fixture("infiniband.p5en.doc.txt"))
    assert len(devices) == 16 and {d.driver for d in devices} == {"efa"}
    assert RdmaDevices().parse(fixture("infiniband.none.real.txt")) == ()


def test_fi_info_parser_one_rdm_domain_per_device() -> None:
    old = EfaProvider().parse(fixture("fi_info-efa.p5en-libfabric-1.22.doc.txt"))
    assert len(old.rdm_domains) == 16 and old.error is None
    new = EfaProvider().parse(fixture("fi_info-efa.p5en-libfabric-2.x.doc.txt"))
    assert len(new.rdm_domains) == 16  # efa-direct entries are not extra devices
    none = EfaProvider().parse(fixture("fi_info-efa.no-device.doc.txt"))
    assert none.rdm_domains == () and none.error and "No data available" in none.error
    assert EfaProvider().parse(fixture("fi_info-efa.none.real.txt")).error == "bpdkv: fi_info not found"


def test_libfabric_version_parser() -> None:
    assert LibfabricVersion().parse(fixture("fi_info-version.1.22.doc.txt")) == (1, 22, 0)
    assert LibfabricVersion().parse(fixture("fi_info-version.1.19.doc.txt")) == (1, 19, 0)
    assert LibfabricVersion().parse(fixture("fi_info-version.none.real.txt")) is None


def test_kernel_parser_on_this_machine_and_samples() -> None:
    here = KernelRdma().parse(fixture("kernel.this-machine.real.txt"))
    assert here.version >= (5, 12) and here.dma_buf and not here.modules_known and here.gpudirect_rdma == "dma-buf"
    assert KernelRdma().parse(fixture("kernel.al2-5.10-peermem.doc.txt")).gpudirect_rdma == "efa_nv_peermem"
    assert KernelRdma().parse(fixture("kernel.5.4-no-gdr.doc.txt")).gpudirect_rdma is None


def test_fact_commands_run_here_and_parse() -> None:
    """The commands themselves are valid shell on a host without GPU or EFA, and their output parses."""
    for fact in HARDWARE_FACTS:
        out = subprocess.run(["bash", "-c", fact.command], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, (fact.name, out.stderr)
        fact.parse(out.stdout)


# ---- check_hardware --------------------------------------------------------------------------------------------


def test_a_real_p5en_passes(p5en: tuple[Topology, Node, Node]) -> None:
    t, prefill, decode = p5en
    assert check_hardware(t, prefill, facts(*GOOD_P5EN)) == []
    assert check_hardware(t, decode, facts(*GOOD_P5EN)) == []


@pytest.mark.parametrize(
    ("index", "replacement", "fact", "words"),
    [
        (0, "nvidia-smi.p4d.doc.txt", "gpus", "A100"),
        (0, "nvidia-smi.none.real.txt", "gpus", "install the NVIDIA driver"),
        (1, "infiniband.p5en-4-of-16.doc.txt", "efa devices", "4 EFA device(s)"),
        (1, "infiniband.none.real.txt", "efa devices", "0 EFA device(s)"),
        (2, "fi_info-efa.no-device.doc.txt", "fi_info -p efa", "No data available"),
        (3, "fi_info-version.1.19.doc.txt", "libfabric", "1.19.0 is older than 1.21.0"),
        (3, "fi_info-version.none.real.txt", "libfabric", "fi_info not found"),
        (4, "kernel.5.4-no-gdr.doc.txt", "kernel", "older than 5.12"),
    ],
)
def test_each_wrong_fact_is_one_problem_naming_host_and_fact(
    p5en: tuple[Topology, Node, Node], index: int, replacement: str, fact: str, words: str
) -> None:
    t, prefill, _ = p5en
    names = list(GOOD_P5EN)
    names[index] = replacement
    problems = check_hardware(t, prefill, facts(*names))
    assert [p.fact for p in problems] == [fact], problems
    assert problems[0].host == prefill.name and words in problems[0].message
    assert problems[0].line().startswith(f"{prefill.name}: {fact}: ")


def test_this_machine_is_no_p5en(p5en: tuple[Topology, Node, Node]) -> None:
    """The real outputs of a host without GPU/EFA: every missing part is named at once."""
    t, prefill, _ = p5en
    real = facts(
        "nvidia-smi.none.real.txt",
        "infiniband.none.real.txt",
        "fi_info-efa.none.real.txt",
        "fi_info-version.none.real.txt",
        "kernel.this-machine.real.txt",
    )
    assert [p.fact for p in check_hardware(t, prefill, real)] == ["gpus", "efa devices", "fi_info -p efa", "libfabric"]


def test_router_only_node_needs_no_accelerator() -> None:
    from bpdkv.deploy.inventory import offline_inventory

    t = load_topology(EXAMPLES / "ec2-p5en-qwen3-32b.yaml", None, offline_inventory).topology
    router_only = next(n for n in t.nodes if all(i.role == "router" for i in n.instances))
    assert check_hardware(t, router_only, {}) == []


def test_p4d_refuses_libfabric_for_lack_of_rdma_read(tmp_path: Path) -> None:
    """Known from the topology alone: validate (and plan --offline) refuse it, before any host is asked."""
    doc = (EXAMPLES / "p5en-qwen3-32b.yaml").read_text().replace("p5en.48xlarge", "p4d.24xlarge")
    doc = doc.replace("\nkv_transfer:", "\nmodel: {id: Qwen/Qwen3-32B, max_model_len: 8192}  # fits tp 2 on 40 GB\nkv_transfer:", 1)
    path = tmp_path / "p4d.yaml"
    path.write_text(doc)
    with pytest.raises(InvalidTopology) as err:
        load_topology(path)
    lines = [line for line in err.value.lines() if "RDMA READ" in line]
    assert len(lines) == 2 and all(".hardware: p4d.24xlarge EFA has no hardware RDMA READ" in line for line in lines), err.value.lines()
    ucx = path.read_text().replace("kv_transfer:", "kv_transfer:\n  backend: UCX\n  allow_ucx_on_efa: true", 1)
    path.write_text(ucx)
    assert load_topology(path).topology.kv_transfer.backend == "UCX"  # said knowingly: accepted


def test_rendered_units_lock_unlimited_memory(p5en: tuple[Topology, Node, Node]) -> None:
    t, prefill, decode = p5en
    artifacts = render_topology(t)
    assert memlock_problems(prefill, artifacts) == [] and memlock_problems(decode, artifacts) == []
    unit = next(a for a in artifacts if a.host == prefill.name and a.unit and a.instance)
    broken = [dataclasses.replace(unit, content=unit.content.replace("LimitMEMLOCK=infinity", "LimitMEMLOCK=64K"))]
    problems = memlock_problems(prefill, broken)
    assert len(problems) == 1 and problems[0].fact == "ulimit -l" and unit.path in problems[0].message


# ---- post-deploy: processes and telemetry (bpdkv/deploy/efa.py) ------------------------------------------------


def test_processes_with_libfabric_from_the_efa_installer_pass() -> None:
    assert efa.check_processes(fixture("processes.efa-libfabric.doc.txt")) is None


def test_real_ucx_agent_fails_the_libfabric_check() -> None:
    problem = efa.check_processes(fixture("processes.nixl-ucx-cpu.real.txt"))
    assert problem is not None and "libplugin_LIBFABRIC.so" in problem and "libplugin_UCX.so" in problem


def test_distro_libfabric_and_memlock_are_reported() -> None:
    problem = efa.check_processes(fixture("processes.distro-libfabric.doc.txt"))
    assert problem is not None and "/usr/lib/x86_64-linux-gnu/libfabric.so.1.17.0" in problem and "LD_LIBRARY_PATH" in problem
    limited = fixture("processes.efa-libfabric.doc.txt").replace(
        "Max locked memory         unlimited            unlimited", "Max locked memory         8388608              8388608", 1
    )
    problem = efa.check_processes(limited)
    assert problem is not None and "4242" in problem and "LimitMEMLOCK=infinity" in problem
    assert efa.check_processes("bpdkv: no main process\n") == "no running process found for the unit"


def test_maps_excerpt_is_what_the_process_command_greps() -> None:
    """The real /proc/PID/maps excerpt holds the UCX plugin path the real process listing reported."""
    listing = efa.parse_processes(fixture("processes.nixl-ucx-cpu.real.txt"))
    plugin = next(lib for p in listing for lib in p.libraries)
    assert plugin in fixture("maps.nixl-ucx-cpu.real.txt")
