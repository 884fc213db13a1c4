"""Post-deploy EFA check: on EFA nodes, NIXL must have instantiated LIBFABRIC on the EFA provider, not a TCP fallback.

Reads the vLLM unit's log after its health gate passed. NIXL logs "Backend LIBFABRIC was instantiated" (the same
line reads "Backend UCX was instantiated" on the H200 runs); libfabric names its provider when it falls back. Checked
against log samples only: no EFA hardware was available to bpdkv's tests.
"""

from __future__ import annotations

import json
import re
import shlex
import uuid
from dataclasses import dataclass
from enum import Enum

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


# ---- the probe pull: one real P→D turn after the gates, and NIXL's own transfer telemetry around it ----------------
# vLLM's NixlConnector creates its NIXL agent with capture_telemetry=True and exports, per transfer it completed, NIXL's
# own nixlXferTelemetry (totalBytes, transfer time) as these series on the puller's /metrics (D on a first turn). They
# need no NIXL_TELEMETRY_ENABLE, no exporter port per agent and no shared-memory reader, so they are what apply reads.
PROBE_SERIES = (
    "vllm:nixl_bytes_transferred_sum",
    "vllm:nixl_bytes_transferred_count",
    "vllm:nixl_num_failed_transfers_total",
    "vllm:prompt_tokens_by_source_total",
)


@dataclass(frozen=True)
class TransferCounters:
    """NIXL transfer counters of one vLLM instance (sums over engines and ranks)."""

    exported: bool  # the NIXL series are on /metrics at all (a NixlConnector with telemetry is loaded)
    bytes: float
    transfers: float
    failed: float
    external_tokens: float  # prompt tokens whose KV came over KV transfer


def parse_transfer_counters(metrics: str) -> TransferCounters:
    from bpdkv.prometheus_text import metric_value  # the one Prometheus-text reader

    return TransferCounters(
        exported=any(line.startswith("vllm:nixl_") for line in metrics.splitlines()),
        bytes=metric_value(metrics, "vllm:nixl_bytes_transferred_sum"),
        transfers=metric_value(metrics, "vllm:nixl_bytes_transferred_count"),
        failed=metric_value(metrics, "vllm:nixl_num_failed_transfers_total"),
        external_tokens=metric_value(metrics, "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
    )


class ProbeVerdict(Enum):
    MOVED = "moved"
    NOT_EXPORTED = "not exported"
    FAILED_TRANSFERS = "failed transfers"
    NOT_MOVED = "not moved"
    WRONG_TRANSPORT = "wrong transport"


@dataclass(frozen=True)
class ProbeResult:
    verdict: ProbeVerdict
    message: str  # one line; empty when MOVED
    moved_bytes: float = 0.0


def judge_probe(before: str, after: str, processes: str, transport: str = "efa") -> ProbeResult:
    """The decode instance's /metrics before and after one probe turn, and `process_command`'s output for it.

    Bytes moved only count when they moved over EFA: the same process must have NIXL's LIBFABRIC plugin and the EFA
    installer's libfabric mapped — a transfer that succeeded while UCX (TCP) did the work is the silent fallback."""
    b, a = parse_transfer_counters(before), parse_transfer_counters(after)
    if not a.exported:
        return ProbeResult(ProbeVerdict.NOT_EXPORTED, "D's /metrics has no vllm:nixl_* series: its NixlConnector records no transfers")
    if a.failed > b.failed:
        return ProbeResult(ProbeVerdict.FAILED_TRANSFERS, f"NIXL reported {a.failed - b.failed:g} failed transfer(s) during the probe turn")
    moved = a.bytes - b.bytes
    if a.transfers <= b.transfers or moved <= 0:
        return ProbeResult(
            ProbeVerdict.NOT_MOVED,
            f"the probe turn moved no KV (NIXL transfers {b.transfers:g}→{a.transfers:g}, bytes {b.bytes:g}→{a.bytes:g}): D recomputed the prompt",
        )
    wrong = check_processes(processes) if transport == "efa" else None  # "any": a cohort's gate, any transport
    if wrong:
        return ProbeResult(ProbeVerdict.WRONG_TRANSPORT, f"{moved:g} bytes moved, but not over EFA: {wrong}", moved)
    return ProbeResult(ProbeVerdict.MOVED, "", moved)


def probe_length(threshold: int, max_model_len: int) -> int:
    """Words in the probe prompt: above kv_recompute_threshold tokens (or D recomputes instead of pulling) with any
    tokenizer, and small enough that even one that spends ~8 tokens per word stays inside the context."""
    length = max(threshold * 2, 64)
    return max(1, min(length, max_model_len // 10)) if max_model_len else length


WORDS = "the quick brown fox jumps over a lazy dog while seven old sailors count their silver coins".split()


def probe_prompt(length: int) -> str:
    """Plain words (about one token each in any tokenizer, unlike token ids, which must fit the vocabulary), behind a
    random nonce so that neither P nor D has any of it cached from an earlier probe: D must pull all of it."""
    return f"bpdkv probe {uuid.uuid4().hex}: " + " ".join(WORDS[i % len(WORDS)] for i in range(length))


def probe_command(python: str, prefill_url: str, decode_url: str, prompt_tokens: int, timeout: float) -> str:
    """Shell text run on P's node with the node's venv (bpdkv is installed there): one P→D turn via the one turn
    implementation, D's NIXL series scraped around it; prints one JSON line (see `probe_main`)."""
    args = [python, "-m", "bpdkv.deploy.efa", prefill_url, decode_url, str(prompt_tokens), f"{timeout:g}"]
    return " ".join(shlex.quote(a) for a in args)


def parse_probe_output(stdout: str) -> tuple[str, str, str | None]:
    """(D's series before, after, the turn's error) from `probe_command`'s last line."""
    try:
        data = json.loads(stdout.strip().splitlines()[-1])
        return str(data["before"]), str(data["after"]), data.get("error")
    except (ValueError, IndexError, KeyError, TypeError):
        return "", "", f"the probe printed no result: {stdout.strip()[-200:] or 'nothing'}"


def probe_main(argv: list[str]) -> int:
    """On the node: scrape D, run one P→D turn with a long token-id prompt, scrape D again; print one JSON line."""
    import urllib.request

    from bpdkv.turn_client import TurnClient, TurnError

    prefill, decode, tokens, timeout = argv[0], argv[1], int(argv[2]), float(argv[3])

    def series(url: str) -> str:
        with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as resp:
            text = resp.read().decode(errors="replace")
        return "\n".join(line for line in text.splitlines() if line.startswith(PROBE_SERIES) or line.startswith("vllm:nixl_"))

    out: dict[str, object] = {"before": "", "after": "", "error": None}
    try:
        out["before"] = series(decode)
        with urllib.request.urlopen(prefill.rstrip("/") + "/v1/models", timeout=timeout) as resp:
            model = json.loads(resp.read())["data"][0]["id"]
        body = {"model": model, "prompt": probe_prompt(tokens), "max_tokens": 1, "temperature": 0}
        TurnClient(prefill, decode, timeout).turn("/v1/completions", body, None)
        out["after"] = series(decode)
    except (TurnError, OSError, ValueError, KeyError, IndexError) as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"[:300]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(probe_main(sys.argv[1:]))
