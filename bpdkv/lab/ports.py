"""Loopback ports for test and benchmark servers that nothing else can take before the server binds them.

Why not "bind port 0, read it, close it": that port comes from the kernel's ephemeral range, which every outgoing
connection also draws from (UCX over TCP opens many on loopback). Between the close and the server's own bind another
socket may take it — CI once lost a vLLM server's NIXL side channel that way ("Address already in use"), and the
server never became healthy. Ports here come from below the ephemeral range, are checked free for TCP and UDP (the
read fence listens on UDP at the side-channel port), and are never handed out twice by one process.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

LOWEST = 10000
_handed_out: set[int] = set()
_lock = threading.Lock()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _is_free(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def free_port() -> int:
    """A loopback port outside the ephemeral range, free now for TCP and UDP, not handed out before by this process."""
    high = _ephemeral_low() - 1
    if high <= LOWEST:
        raise RuntimeError(f"no port range below the ephemeral range (ip_local_port_range starts at {high + 1})")
    candidates = range(LOWEST, high + 1)
    # A random start keeps two processes (a benchmark and a test run) from walking the same ports in step.
    start = random.randrange(len(candidates))
    with _lock:
        for i in range(len(candidates)):
            port = candidates[(start + i) % len(candidates)]
            if port not in _handed_out and _is_free(port):
                _handed_out.add(port)
                return port
    raise RuntimeError(f"no free loopback port in {LOWEST}-{high}")
