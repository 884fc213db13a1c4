"""Local connector: this machine, by subprocess (a node with `host: localhost`, and unit tests that need a real shell)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from bpdkv.deploy.connectors import CommandResult, ConnectorError, plain_errno


class LocalConnector:
    def __init__(self, host: str = "localhost", timeout: float = 120.0) -> None:
        self.host = host
        self.timeout = timeout

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        try:
            proc = subprocess.run(
                ["sh", "-c", command], capture_output=True, text=True, timeout=timeout or self.timeout, stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            raise ConnectorError(self.host, f"command timed out after {timeout or self.timeout:g}s: {command.split()[0]}") from None
        return CommandResult(proc.returncode, proc.stdout, proc.stderr)

    def put(self, data: bytes, path: str) -> None:
        try:
            Path(path).write_bytes(data)
        except OSError as exc:
            raise ConnectorError(self.host, f"upload of {path} failed: {plain_errno(os.strerror(exc.errno or 0))}") from None

    def get(self, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ConnectorError(self.host, f"download of {path} failed: {plain_errno(os.strerror(exc.errno or 0))}") from None

    def close(self) -> None:
        pass
