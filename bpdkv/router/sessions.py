"""Session identity (which stored D location belongs to this request) and the session stores.

Identity, automatic by default: a chained digest over the canonical chat history, so the digest of
"messages of turn k + assistant reply k" equals the digest of the first messages of turn k+1 — clients need
no change. Everything is scoped by tenant, model and whatever changes the prompt's tokens (tools,
chat_template_kwargs, cache_salt), so sessions can never cross tenants or templates.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Protocol

log = logging.getLogger("bpdkv.router")

TOKEN_BLOCK = 64  # token-id prompts are matched at 64-token boundaries
MAX_CANDIDATES = 512


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return h.digest()


def _canon(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def scope_digest(tenant: str, route: str, body: dict[str, Any]) -> bytes:
    scope = {
        "tenant": tenant,
        "route": route,
        "model": body.get("model"),
        "tools": body.get("tools"),
        "chat_template_kwargs": body.get("chat_template_kwargs"),
        "chat_template": body.get("chat_template"),
        "cache_salt": body.get("cache_salt"),
    }
    return _h(_canon(scope))


def _canon_content(content: Any) -> Any:
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")).strip())
            else:
                parts.append(part)
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)
        return parts
    return content


def canonical_message(msg: Any) -> bytes:
    if not isinstance(msg, dict):
        return _canon(msg)
    canon: dict[str, Any] = {"role": msg.get("role"), "content": _canon_content(msg.get("content")) or ""}
    if msg.get("name"):
        canon["name"] = msg["name"]
    if msg.get("tool_call_id"):
        canon["tool_call_id"] = msg["tool_call_id"]
    calls = msg.get("tool_calls")
    if isinstance(calls, list) and calls:
        canon["tool_calls"] = [
            {"name": (c.get("function") or {}).get("name"), "arguments": (c.get("function") or {}).get("arguments")}
            for c in calls
            if isinstance(c, dict)
        ]
    return _canon(canon)


def chat_chain(scope: bytes, messages: list[Any]) -> list[bytes]:
    """digest[i] covers scope + messages[0..i]."""
    out = []
    h = scope
    for msg in messages:
        h = _h(h, canonical_message(msg))
        out.append(h)
    return out


def token_chain(scope: bytes, tokens: list[int]) -> list[tuple[int, bytes]]:
    """(length, digest) at every TOKEN_BLOCK boundary."""
    out = []
    h = scope
    buf = array("q", tokens).tobytes()
    step = TOKEN_BLOCK * 8
    for n in range(len(tokens) // TOKEN_BLOCK):
        h = _h(h, buf[n * step : (n + 1) * step])
        out.append(((n + 1) * TOKEN_BLOCK, h))
    return out


def token_digest(scope: bytes, tokens: list[int]) -> str:
    return _h(scope, array("q", tokens).tobytes()).hex()


@dataclass(frozen=True)
class Identity:
    """Where a request may find a stored D location, and what it stores after the turn."""

    lookup_keys: list[str]  # most specific first
    history: set[str]  # digests the stored entry's history must be one of (checked on hit)
    explicit: bool


@dataclass
class SessionEntry:
    params: dict[str, Any]
    expires_at: float  # router wall clock (epoch seconds), shared by replicas
    history: str  # digest of the history the KV covers
    length: int = 0  # token-id prompts: length the history digest covers
    decode: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(raw: str | bytes) -> SessionEntry:
        data = json.loads(raw)
        return SessionEntry(**data)


class StoreUnavailable(Exception):
    pass


class SessionStore(Protocol):
    async def put(self, key: str, entry: SessionEntry, ttl: float) -> None: ...

    async def take(self, keys: list[str]) -> tuple[str, SessionEntry] | None:
        """Atomically remove and return the first present entry among keys (entries are single-use)."""
        ...

    async def count(self) -> int: ...

    async def close(self) -> None: ...


class MemoryStore:
    """Per-process store; bounded (oldest entries go first) so a flood of conversations cannot grow it forever."""

    def __init__(self, max_entries: int = 200_000, clock: Callable[[], float] = time.time) -> None:
        self._data: dict[str, SessionEntry] = {}
        self._max = max_entries
        self._clock = clock

    async def put(self, key: str, entry: SessionEntry, ttl: float) -> None:
        self._data.pop(key, None)
        self._data[key] = entry
        self._purge_front()
        if len(self._data) > self._max:
            self._evict()

    def _purge_front(self, budget: int = 32) -> None:
        """Abandoned conversations never come back for their entry: drop expired ones from the old end, a few per put."""
        now = self._clock()
        for _ in range(budget):
            oldest = next(iter(self._data), None)
            if oldest is None or self._data[oldest].expires_at > now:
                return
            del self._data[oldest]

    def _evict(self) -> None:
        now = self._clock()
        for key in [k for k, e in self._data.items() if e.expires_at <= now]:
            del self._data[key]
        while len(self._data) > self._max:
            del self._data[next(iter(self._data))]

    async def take(self, keys: list[str]) -> tuple[str, SessionEntry] | None:
        for key in keys:
            entry = self._data.pop(key, None)
            if entry is not None:
                return key, entry
        return None

    async def count(self) -> int:
        now = self._clock()
        if len(self._data) > 10_000:
            return len(self._data)
        return sum(1 for e in self._data.values() if e.expires_at > now)

    async def close(self) -> None:
        self._data.clear()


class RedisStore:
    """Shared by router replicas. Any Redis failure raises StoreUnavailable; the caller serves without reuse."""

    PREFIX = "bpdkv:s:"

    def __init__(self, url: str, timeout: float = 0.25, **options: Any) -> None:
        import redis.asyncio as aioredis

        # options: password / ssl_ca_certs (bpdkv.router.security.redis_options)
        self._redis = aioredis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout, retry_on_timeout=False, **options)
        self._timeout = timeout

    async def _call(self, coro: Any) -> Any:
        import redis

        try:
            return await asyncio.wait_for(coro, self._timeout * 4)
        except (redis.RedisError, OSError, asyncio.TimeoutError) as exc:
            raise StoreUnavailable(type(exc).__name__) from None

    async def put(self, key: str, entry: SessionEntry, ttl: float) -> None:
        await self._call(self._redis.set(self.PREFIX + key, entry.to_json(), px=max(int(ttl * 1000), 1)))

    async def take(self, keys: list[str]) -> tuple[str, SessionEntry] | None:
        if not keys:
            return None
        values = await self._call(self._redis.mget([self.PREFIX + k for k in keys]))
        for key, value in zip(keys, values, strict=True):
            if value is None:
                continue
            raw = await self._call(self._redis.getdel(self.PREFIX + key))
            if raw is not None:  # None: another replica took it first
                return key, SessionEntry.from_json(raw)
        return None

    async def count(self) -> int:
        total = 0
        cursor = 0
        for _ in range(100):  # bounded scan; the gauge is approximate above 100k sessions
            cursor, batch = await self._call(self._redis.scan(cursor=cursor, match=self.PREFIX + "*", count=1000))
            total += len(batch)
            if cursor == 0:
                break
        return total

    async def close(self) -> None:
        try:
            await self._redis.aclose()
        except Exception:  # noqa: BLE001 - closing a broken connection must not fail shutdown
            pass


def make_store(state: str, clock: Callable[[], float] = time.time, redis_options: dict[str, Any] | None = None) -> SessionStore:
    if state == "memory":
        return MemoryStore(clock=clock)  # expiry must be judged on the router's own clock
    return RedisStore(state, **(redis_options or {}))
