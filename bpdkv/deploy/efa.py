"""Post-deploy EFA check: on EFA nodes, NIXL must have instantiated LIBFABRIC on the EFA provider, not a TCP fallback.

Reads the vLLM unit's log after its health gate passed. NIXL logs "Backend LIBFABRIC was instantiated" (the same
line reads "Backend UCX was instantiated" on the H200 runs); libfabric names its provider when it falls back. Checked
against log samples only: no EFA hardware was available to bpdkv's tests.
"""

from __future__ import annotations

import re

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
