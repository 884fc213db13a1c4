"""Post-deploy EFA check: on EFA nodes, NIXL must have instantiated LIBFABRIC on the EFA provider, not a TCP fallback.

Reads the vLLM unit's log after its health gate passed. NIXL logs "Backend LIBFABRIC was instantiated" (the same
line reads "Backend UCX was instantiated" on the H200 runs); libfabric names its provider when it falls back. Checked
against log samples only: no EFA hardware was available to bpdkv's tests.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

INSTANTIATED = re.compile(r"Backend (\w+) was instantiated")
# A provider other than efa chosen, or an explicit fallback message, from NIXL's libfabric plugin or libfabric itself.
FALLBACK = re.compile(r"(?i)(\bprovider\b[^\n]*\b(tcp|sockets|udp|shm)\b(?![^\n]*\befa\b))|(fall(ing)?\s*back[^\n]*\b(tcp|sockets)\b)")
FAILED = re.compile(r"(?i)(failed to (create|instantiate)[^\n]*libfabric|libfabric[^\n]*(error|failed))")


def check_log(log: str) -> str | None:
    """None when LIBFABRIC came up without a TCP fallback; else one line saying what the log shows."""
    backends = INSTANTIATED.findall(log)
    for line in log.splitlines():
        if FAILED.search(line):
            return f"NIXL's LIBFABRIC backend failed: {line.strip()[-200:]}"
        if FALLBACK.search(line):
            return f"libfabric fell back from EFA: {line.strip()[-200:]} (check the EFA driver, FI_PROVIDER and the security group)"
    if "LIBFABRIC" not in backends:
        seen = ", ".join(sorted(set(backends))) or "none"
        return f"NIXL did not instantiate LIBFABRIC (backends in the log: {seen}); KV transfer would not use EFA"
    return None


# ---- beyond the log line: what the running processes really loaded, their memlock limit, and NIXL's counters --------

# The EFA installer's libfabric; another copy (a distro's, or one bundled in a wheel) lacks the EFA provider's GPU
# support. NIXL's own LIBFABRIC plugin is a separate library it loads with dlopen() when the backend is created.
EFA_LIBFABRIC_PREFIX = "/opt/amazon/efa/"
LIBFABRIC_PLUGIN = "libplugin_LIBFABRIC.so"


def process_command(unit: str) -> str:
    """Shell text run on the node: every process of the unit (the main PID and its descendants: NIXL lives in vLLM's
    engine/worker processes), the NIXL plugins and libfabric each has mapped, and its memlock limit."""
    return _process_command(f"$(systemctl show -p MainPID --value {shlex.quote(unit)} 2>/dev/null)")


def _process_command(main_pid: str) -> str:
    return (
        f"main={main_pid}; "
        'if [ -z "$main" ] || [ "$main" = 0 ]; then echo "bpdkv: no main process"; exit 0; fi; '
        'for p in $(ps -e -o pid=,ppid= | awk -v root="$main" '
        "'{ parent[$1] = $2 } END { for (k in parent) { x = k; n = 0; "
        "while (x != root && (x in parent) && n < 64) { x = parent[x]; n++ } if (x == root) print k } }'); do "
        'echo "== pid $p"; '
        "grep -oE '/[^ ]*(libplugin_[A-Za-z0-9_]+\\.so|libfabric\\.so[.0-9]*)$' /proc/$p/maps 2>/dev/null | sort -u; "
        "grep '^Max locked memory' /proc/$p/limits 2>/dev/null; done"
    )


@dataclass(frozen=True)
class ProcessLibraries:
    pid: int
    libraries: tuple[str, ...]  # mapped plugin/libfabric paths
    memlock_unlimited: bool | None  # None: /proc/PID/limits unreadable


def parse_processes(stdout: str) -> list[ProcessLibraries]:
    out: list[ProcessLibraries] = []
    pid: int | None = None
    libs: list[str] = []
    memlock: bool | None = None

    def flush() -> None:
        if pid is not None:
            out.append(ProcessLibraries(pid, tuple(libs), memlock))

    for line in stdout.splitlines():
        if line.startswith("== pid "):
            flush()
            pid, libs, memlock = int(line.split()[-1]), [], None
        elif line.startswith("Max locked memory"):
            fields = line.split()
            memlock = fields[3] == "unlimited" and fields[4] == "unlimited"  # soft and hard
        elif line.startswith("/"):
            libs.append(line.strip())
    flush()
    return out


def check_processes(stdout: str) -> str | None:
    """None when some process of the unit has NIXL's LIBFABRIC plugin and the EFA installer's libfabric mapped and
    every process may lock unlimited memory; else one line saying what is wrong."""
    processes = parse_processes(stdout)
    if not processes:
        return "no running process found for the unit"
    mapped = {lib for p in processes for lib in p.libraries}
    plugins = sorted({lib.rsplit("/", 1)[-1] for lib in mapped if "libplugin_" in lib})
    if not any(lib.endswith(LIBFABRIC_PLUGIN) for lib in mapped):
        return f"no process maps NIXL's {LIBFABRIC_PLUGIN} (NIXL plugins mapped: {', '.join(plugins) or 'none'})"
    fabrics = sorted(lib for lib in mapped if "libfabric.so" in lib)
    wrong = [lib for lib in fabrics if not lib.startswith(EFA_LIBFABRIC_PREFIX)]
    if not fabrics:
        return "the LIBFABRIC plugin is mapped but no libfabric.so is (the backend did not load)"
    if wrong:
        return f"libfabric loaded from {wrong[0]}, not the EFA installer's {EFA_LIBFABRIC_PREFIX}: put /opt/amazon/efa/lib and lib64 first on LD_LIBRARY_PATH"
    limited = [str(p.pid) for p in processes if p.memlock_unlimited is False]
    if limited:
        return f"process(es) {', '.join(limited)} run with a memlock limit; the unit needs LimitMEMLOCK=infinity"
    return None


# NIXL telemetry (docs/telemetry.md: NIXL_TELEMETRY_ENABLE=y with the prometheus exporter): per-agent byte counters.
TELEMETRY_COUNTERS = ("agent_tx_bytes_total", "agent_rx_bytes_total")


def telemetry_moved(before: str, after: str) -> str | None:
    """None when NIXL's transfer byte counters grew between two scrapes around a probe pull; else why not."""
    from bpdkv.bench.runner import metric_value  # the one Prometheus-text reader

    if not any(name in after for name in TELEMETRY_COUNTERS):
        return "NIXL telemetry exports no agent_*_bytes_total counters (NIXL_TELEMETRY_ENABLE=y and the prometheus exporter needed)"
    grown = sum(metric_value(after, n) for n in TELEMETRY_COUNTERS) - sum(metric_value(before, n) for n in TELEMETRY_COUNTERS)
    if grown <= 0:
        return "NIXL moved no bytes during the probe pull (agent_tx/rx_bytes_total unchanged): KV transfer is not working"
    return None
