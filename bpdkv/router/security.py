"""The router's secrets at run time: API keys kept as hashes, HTTPS with certificates reloaded on change, Redis auth/TLS.

Keys files hold one key per line, optionally after a tenant name: ``[tenant ]KEY`` where KEY is the key itself or
``sha256:<hex>`` of it (what `bpdkv render` writes, so the node never holds inbound keys in the clear). The router keeps
only SHA-256 digests in memory and compares them in constant time; requests are attributed to the tenant *name*, which
is what may appear in logs and metric labels — never a key.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import ssl
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bpdkv import contracts
from bpdkv.contracts import hashed_key_line as hashed_key_line  # re-exported: the keys file's one format
from bpdkv.errors import BpdkvError

log = logging.getLogger("bpdkv.router.security")

DIGEST_PREFIX = contracts.KEY_DIGEST_PREFIX
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class SecurityConfigError(BpdkvError):
    pass


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class KeyRing:
    """Digests of accepted keys, each with its tenant name."""

    entries: tuple[tuple[bytes, str], ...] = ()

    def __bool__(self) -> bool:
        return bool(self.entries)

    def tenant(self, presented: str | None) -> str | None:
        """The tenant a presented key belongs to, or None. Every entry is compared, in constant time each."""
        if not presented or not self.entries:
            return None
        digest = key_digest(presented)
        found: str | None = None
        for known, tenant in self.entries:
            if hmac.compare_digest(known, digest) and found is None:
                found = tenant
        return found

    @staticmethod
    def parse(text: str, source: str = "keys file") -> KeyRing:
        entries: list[tuple[bytes, str]] = []
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            parts = line.split()
            if len(parts) > 2 or (len(parts) == 2 and not TENANT_NAME.match(parts[0])):
                # The line may hold a key: say where, never what.
                raise SecurityConfigError(f"{source}:{number}: expected '[tenant ]KEY' (tenant: letters, digits, '.', '_', '-')")
            secret = parts[-1]
            if secret.startswith(DIGEST_PREFIX):
                hexdigest = secret[len(DIGEST_PREFIX) :]
                if not re.fullmatch(r"[0-9a-fA-F]{64}", hexdigest):
                    raise SecurityConfigError(f"{source}:{number}: sha256: needs 64 hex digits")
                digest = bytes.fromhex(hexdigest)
            else:
                digest = key_digest(secret)
            # A key without a tenant name is named by a short digest prefix: stable, useless to an attacker.
            tenant = parts[0] if len(parts) == 2 else "key-" + digest.hex()[:8]
            entries.append((digest, tenant))
        return KeyRing(tuple(entries))

    @staticmethod
    def load(path: str | None) -> KeyRing:
        if not path:
            return KeyRing()
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise SecurityConfigError(f"{path}: cannot read keys file: {exc.strerror or exc}") from None
        return KeyRing.parse(text, path)


def load_admin_key(path: str | None) -> KeyRing:
    """The admin key file holds one key (in the clear: apply reads it on the node to call the admin API)."""
    ring = KeyRing.load(path)
    if path and len(ring.entries) != 1:
        raise SecurityConfigError(f"{path}: the admin key file must hold exactly one key (found {len(ring.entries)})")
    return KeyRing(tuple((digest, "admin") for digest, _ in ring.entries))


# ---- HTTPS ----------------------------------------------------------------------------------------------------------
class ReloadingTLS:
    """A server SSLContext whose certificate and key are re-read when either file changes (checked at most once a
    `check_interval`, at a handshake). A renewal therefore needs no restart; open connections keep their session.
    A half-written or mismatched pair is refused with a warning and the previous pair keeps serving."""

    def __init__(self, cert_file: str, key_file: str, check_interval: float = 1.0) -> None:
        self.cert_file, self.key_file, self.check_interval = cert_file, key_file, check_interval
        self._lock = threading.Lock()
        self._stamp = self._files_stamp()
        self._current = self._build()  # a bad pair at start is an error: nothing to fall back to
        self._checked = time.monotonic()
        self.reloads = 0
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.minimum_version = ssl.TLSVersion.TLSv1_2
        self.context.load_cert_chain(cert_file, key_file)  # used only if a client hello never reaches the callback
        self.context.sni_callback = self._on_hello

    def _files_stamp(self) -> tuple[int, int, int, int]:
        try:
            c, k = os.stat(self.cert_file), os.stat(self.key_file)
        except OSError as exc:
            raise SecurityConfigError(f"TLS: cannot read {exc.filename}: {exc.strerror}") from None
        return (c.st_mtime_ns, c.st_size, k.st_mtime_ns, k.st_size)

    def _build(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise SecurityConfigError(f"TLS: {self.cert_file} / {self.key_file}: {exc}") from None
        return ctx

    def current(self) -> ssl.SSLContext:
        now = time.monotonic()
        if now - self._checked < self.check_interval:
            return self._current
        with self._lock:
            self._checked = now
            try:
                stamp = self._files_stamp()
                if stamp != self._stamp:
                    self._current = self._build()
                    self._stamp = stamp
                    self.reloads += 1
                    log.info("TLS certificate reloaded from %s", self.cert_file)
            except SecurityConfigError as exc:
                log.warning("%s; still serving the previous certificate", exc)
        return self._current

    def _on_hello(self, sock: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, _: ssl.SSLContext) -> None:
        sock.context = self.current()


def uvicorn_tls(uv_config: Any, tls: ReloadingTLS) -> None:
    """Make a loaded uvicorn.Config serve with the reloading context (works on every uvicorn >= 0.29)."""
    if not uv_config.loaded:
        uv_config.load()
    uv_config.ssl = tls.context


# ---- Redis ---------------------------------------------------------------------------------------------------------
def redis_options(password_file: str | None, ca_file: str | None) -> dict[str, Any]:
    """Keyword arguments for redis.from_url: the password from its 0600 file (never in the URL), the CA to verify."""
    options: dict[str, Any] = {}
    if password_file:
        try:
            options["password"] = Path(password_file).read_text(encoding="utf-8").strip("\n")
        except OSError as exc:
            raise SecurityConfigError(f"{password_file}: cannot read the Redis password file: {exc.strerror or exc}") from None
    if ca_file:  # given only for rediss://; check the host name too (redis-py < 6 does not by default)
        options["ssl_ca_certs"] = ca_file
        options["ssl_check_hostname"] = True
    return options
