"""The router's config file, watched: its upstreams and generations are applied without a restart.

Every router process (each worker by itself) reads its config file about once a second: a stat, and the bytes with
their digest when the stat changed (or every FULL_READ_EVERY polls, for a rewrite the stat cannot tell). A file whose
digest differs from the one loaded is parsed and validated as at start; one that fails is logged (once per digest)
and ignored, and the running config stays. Of a valid file, the upstream lists (`prefill`, `decode`) and the
`generations` are applied in place (upstreams.Pool.reconcile says what becomes of each member); any other key that
changed is logged as needing a restart and not applied — it stays listed in `pending_restart` until the file says
what the router runs again.

Nothing here blocks: the file is small (MAX_CONFIG_BYTES), read on the event loop between requests.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

from bpdkv import contracts
from bpdkv.router.config import RouterConfig, RouterConfigError, config_from_bytes

log = logging.getLogger("bpdkv.router")

RELOADABLE = contracts.ROUTER_RELOADABLE_KEYS
NOT_COMPARED = ("config_file",)
POLL_S = 1.0
FULL_READ_EVERY = 10  # polls: the digest is read at least this often even when the stat did not change
MAX_CONFIG_BYTES = 4 * 1024 * 1024


def digest_of(raw: bytes) -> str:
    """What /admin/config and /admin/upstreams show of the loaded file: its SHA-256, first 16 hex digits."""
    return hashlib.sha256(raw).hexdigest()[:16]


def restart_keys(old: RouterConfig, new: RouterConfig) -> list[str]:
    """The keys that changed between two file configs and that only a restart applies."""
    skip = set(RELOADABLE) | set(NOT_COMPARED)
    return [f.name for f in fields(RouterConfig) if f.name not in skip and getattr(old, f.name) != getattr(new, f.name)]


def upstreams_changed(old: RouterConfig, new: RouterConfig) -> bool:
    return any(getattr(old, key) != getattr(new, key) for key in RELOADABLE)


@dataclass(frozen=True)
class Loaded:
    """What the router runs of its file: the digest of the last valid file it read (None: no file, or none read yet),
    when it applied it, and the keys the file changed that wait for a restart."""

    digest: str | None
    loaded_at: float
    pending_restart: tuple[str, ...] = ()


class ConfigWatch:
    """Polls one config file; `apply` gets a config whose upstreams and generations are to be applied (every other
    key is the running one's)."""

    def __init__(
        self,
        running: RouterConfig,
        apply: Callable[[RouterConfig], Awaitable[None]],
        clock: Callable[[], float] = time.time,
        poll_s: float = POLL_S,
    ) -> None:
        assert running.config_file is not None, "only a config loaded from a file is watched"
        self.path = Path(running.config_file)
        self.running = running
        self.apply = apply
        self.clock = clock
        self.poll_s = poll_s
        self.loaded = Loaded(None, clock())
        self._file: RouterConfig | None = None  # the file as last read (the base of what changed)
        self._stat: tuple[int, int, int] | None = None
        self._polls = 0
        self._refused: str | None = None  # digest of the last invalid file (logged once)
        self._unreadable: str | None = None  # why the file could not be read last time (logged once)

    async def first(self) -> None:
        """At start: the file the running config came from. If it changed since (a worker starting after the
        supervisor read it), its upstreams are applied now; other keys are taken as the running ones (flags may
        override them)."""
        raw = self._read()
        if raw is None:
            return
        try:
            parsed = config_from_bytes(raw, self.path)
        except RouterConfigError as exc:
            log.error("router config %s does not load (%s); serving with the config it started with", self.path, exc)
            self._refused, self._file = digest_of(raw), self.running
            return
        self._file = parsed
        if upstreams_changed(self.running, parsed):
            await self._apply(parsed)
        self.loaded = Loaded(digest_of(raw), self.clock())

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`: one poll every poll_s; a failure of one poll is logged, never the end of the watch."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.poll_s)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await self.poll()
            except Exception:  # noqa: BLE001 - a bug here must not stop serving; the running config stays
                log.exception("router config %s: reload failed; the running config stays", self.path)

    async def poll(self) -> bool:
        """Read the file if it may have changed; apply what may be applied. True when a new file was taken."""
        self._polls += 1
        try:
            st = os.stat(self.path)
            stat = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stat = None
        if stat == self._stat and self._polls % FULL_READ_EVERY:
            return False
        self._stat = stat
        raw = self._read()
        if raw is None:
            return False
        digest = digest_of(raw)
        if digest == self.loaded.digest or digest == self._refused:
            return False
        try:
            new = config_from_bytes(raw, self.path)
        except RouterConfigError as exc:
            self._refused = digest
            log.error("router config %s not applied (%s): the running config stays", self.path, exc)
            return False
        self._refused = None
        base = self._file or self.running
        pending = restart_keys(base, new)
        if pending:
            log.warning("config change of %s needs a restart; kept the running config for them", ", ".join(pending))
        if upstreams_changed(base, new):
            await self._apply(new)
        else:
            log.info("router config %s read (digest %s): no upstream or generation changed", self.path, digest)
        # The base of the next comparison keeps the keys not applied: they are reported again until the file says
        # what runs (or the router restarts).
        self._file = replace(base, **{key: getattr(new, key) for key in RELOADABLE})
        self.loaded = Loaded(digest, self.clock(), tuple(pending))
        return True

    async def _apply(self, new: RouterConfig) -> None:
        self.running = replace(self.running, **{key: getattr(new, key) for key in RELOADABLE})
        await self.apply(self.running)

    def _read(self) -> bytes | None:
        problem = None
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_CONFIG_BYTES + 1)
            if len(raw) > MAX_CONFIG_BYTES:
                problem = f"larger than {MAX_CONFIG_BYTES} bytes"
        except OSError as exc:
            problem = f"cannot be read: {exc.strerror or exc}"
        if problem is not None:
            if problem != self._unreadable:  # logged once per problem, not every poll
                log.error("router config %s %s: the running config stays", self.path, problem)
            self._unreadable = problem
            return None
        self._unreadable = None
        return raw
