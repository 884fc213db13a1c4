"""A Redis master, its replica and Redis Sentinels on loopback, as real processes (tests and benchmarks of the router's
session store under failover). Sentinels run as `redis-server CONF --sentinel` (the redis-server package's binary; the
separate redis-sentinel package only adds a service for it). Every process is ended by its PID; every wait is bounded.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bpdkv.lab.ports import free_port
from bpdkv.router.resp import _Incomplete, encode, parse


class SentinelLabError(Exception):
    pass


def ask(port: int, *args: Any, timeout: float = 1.0) -> Any:
    """One command to 127.0.0.1:port, its reply (error replies as RespError values); OSError if nothing answers."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(encode(args))
        buf = bytearray()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                raise OSError(f"127.0.0.1:{port} closed the connection")
            buf += chunk
            try:
                return parse(buf, 0)[0]
            except _Incomplete:
                continue
        raise OSError(f"127.0.0.1:{port}: no reply within {timeout:g} s")


@dataclass
class SentinelGroup:
    """`start()` → master + replica + n Sentinels (quorum n // 2 + 1) monitoring `name`; `stop()` ends what is left."""

    folder: Path
    sentinels: int = 3
    name: str = "bpdkv"
    down_after_ms: int = 1000
    failover_timeout_ms: int = 10000
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{self.ports[f'sentinel{i}']}" for i in range(self.sentinels))
        return f"redis+sentinel://{hosts}/{self.name}/0"

    def _start(self, key: str, args: list[str]) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SentinelLabError("redis-server is not installed (apt-get install -y redis-server)")
        log = open(self.folder / f"{key}.log", "wb")  # noqa: SIM115 - the process owns it until it ends
        self.procs[key] = subprocess.Popen([binary, *args], stdout=log, stderr=subprocess.STDOUT, cwd=self.folder)

    def _wait(self, what: str, check: Any, seconds: float = 20.0) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if check():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise SentinelLabError(f"{what} not within {seconds:g} s (logs in {self.folder})")

    def start(self) -> SentinelGroup:
        self.folder.mkdir(parents=True, exist_ok=True)
        for key in ("master", "replica"):
            self.ports[key] = free_port()
            args = ["--port", str(self.ports[key]), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            args += ["--dir", str(self.folder), "--dbfilename", f"{key}.rdb"]
            if key == "replica":
                args += ["--replicaof", "127.0.0.1", str(self.ports["master"])]
            self._start(key, args)
        self._wait("the replica in sync", lambda: b"master_link_status:up" in ask(self.ports["replica"], "INFO", "replication"))
        quorum = self.sentinels // 2 + 1
        for i in range(self.sentinels):
            key = f"sentinel{i}"
            self.ports[key] = free_port()
            conf = self.folder / f"{key}.conf"  # Sentinel rewrites its config file: one each, writable
            conf.write_text(
                f"port {self.ports[key]}\nbind 127.0.0.1\ndir {self.folder}\n"
                f"sentinel monitor {self.name} 127.0.0.1 {self.ports['master']} {quorum}\n"
                f"sentinel down-after-milliseconds {self.name} {self.down_after_ms}\n"
                f"sentinel failover-timeout {self.name} {self.failover_timeout_ms}\n"
            )
            self._start(key, [str(conf), "--sentinel"])
        for i in range(self.sentinels):
            port = self.ports[f"sentinel{i}"]
            self._wait(f"sentinel{i} knowing the replica", lambda p=port: len(ask(p, "SENTINEL", "replicas", self.name)) == 1)
            self._wait(
                f"sentinel{i} knowing the other Sentinels",
                lambda p=port: len(ask(p, "SENTINEL", "sentinels", self.name)) == self.sentinels - 1,
            )
        return self

    def master_port(self, sentinel: int = 0) -> int | None:
        """The master's port as Sentinel `sentinel` names it now (None: it does not answer)."""
        try:
            answer = ask(self.ports[f"sentinel{sentinel}"], "SENTINEL", "get-master-addr-by-name", self.name)
        except OSError:
            return None
        return int(answer[1]) if isinstance(answer, list) and len(answer) == 2 else None

    def kill_master(self) -> None:
        """SIGKILL the process that is the master now (by PID)."""
        port = self.master_port()
        key = next(k for k, p in self.ports.items() if p == port)
        self.procs[key].kill()
        self.procs[key].wait(10)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
