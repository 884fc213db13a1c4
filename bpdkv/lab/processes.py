"""Ending the servers tests and benchmarks start: by their own process group, politely first."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_group(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM the process group of `proc` (started with start_new_session=True), SIGKILL it after `grace` seconds."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
