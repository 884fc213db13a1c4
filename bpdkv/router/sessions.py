"""Session identity (which stored D location belongs to this request) and the session stores.

Identity, automatic by default: a chained digest over the chat history exactly as the client sent it (no
normalisation: two prompts the model sees differently never share a digest), so the digest of "messages of turn k +
assistant reply k" equals the digest of the first messages of turn k+1 — clients need no change. Everything is scoped
by tenant, model and whatever changes the prompt's tokens (tools, chat_template_kwargs, cache_salt), so sessions can
never cross tenants or templates.

An explicit session id (header or body field) is bound to its history too: a stored entry is only taken by a request
whose history extends the entry's, and stored only where no live entry of that id is (`put(..., only_if_absent)`), so
naming another conversation's id neither consumes nor overwrites its entry.

Reasoning traces (`reasoning_content`) are not part of the identity: most chat templates drop them from past turns,
and clients often do. D's KV then holds the trace the next prompt lacks; P's connector cuts the pull where the tokens
differ, and the router counts such a turn as `partial`, not `hit`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from array import array
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any, Protocol

from bpdkv import contracts
from bpdkv.contracts import MissCause

log = logging.getLogger("bpdkv.router")

TOKEN_BLOCK = 64  # token-id prompts are matched at 64-token boundaries
MAX_CANDIDATES = 512
MAX_CHAT_CANDIDATES = 8  # most recent assistant turns looked up
CHAT = "/v1/chat/completions"
REASONING_FIELDS = ("reasoning_content", "reasoning")


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


def _tool_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    fn = call.get("function")
    fn = fn if isinstance(fn, dict) else {}
    # Streaming clients keep the delta's "index"; the model never sees it.
    return {"id": call.get("id"), "type": call.get("type") or "function", "name": fn.get("name"), "arguments": fn.get("arguments")}


def canonical_message(msg: Any) -> bytes:
    """What the model sees of one message, exactly (content is not stripped or merged). Reasoning is left out."""
    if not isinstance(msg, dict):
        return _canon(msg)
    role, content = msg.get("role"), msg.get("content")
    if type(role) is str and type(content) is str and not (msg.get("name") or msg.get("tool_call_id") or msg.get("tool_calls")):
        # The common message, without building and sorting a dict (the router digests every message per request).
        return b"m\x00" + role.encode() + b"\x00" + content.encode()
    canon: dict[str, Any] = {"role": role, "content": "" if content is None else content}
    if msg.get("name"):
        canon["name"] = msg["name"]
    if msg.get("tool_call_id"):
        canon["tool_call_id"] = msg["tool_call_id"]
    calls = msg.get("tool_calls")
    if isinstance(calls, list) and calls:
        canon["tool_calls"] = [_tool_call(c) for c in calls]
    if type(canon["content"]) is str and type(role) is str and set(canon) == {"role", "content"}:
        return b"m\x00" + role.encode() + b"\x00" + canon["content"].encode()  # null content is empty content
    return _canon(canon)


def has_reasoning(msg: Any) -> bool:
    return isinstance(msg, dict) and any(isinstance(msg.get(k), str) and msg.get(k) for k in REASONING_FIELDS)


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


def text_digest(scope: bytes, text: str) -> str:
    return _h(scope, b"text", text.encode()).hex()


def _explicit_key(scope: bytes, session_id: str) -> str:
    return "x:" + _h(scope, b"session", session_id.encode()).hex()


def _tagged(kind: str, conversation: str, digest: str) -> str:
    """A stored key of an automatic identity: `{...}` is its Redis Cluster hash tag, the same for every candidate key
    of one lookup (the conversation's first two messages, or a token prompt's first block), so MGET stays in one slot."""
    return f"{kind}:{{{conversation[:16]}}}{digest}"


def _int_tokens(prompt: Any) -> list[int] | None:
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


class Reuse(str, Enum):
    """Reuse outcome of one request (metric label)."""

    HIT = "hit"  # D's KV covers the whole history before the new messages
    PARTIAL = "partial"  # D's KV covers a prefix only (the client dropped the reasoning trace D's KV holds)
    MISS = "miss"  # nothing stored for this history
    MISMATCH = "mismatch"  # an entry under this session id belongs to another history: left alone
    EXPIRED = "expired"  # D has freed (or is about to free) the blocks
    REFUSED = "refused"  # the D holding the blocks restarted, is unhealthy or gone: not offered to P
    SKIPPED = "skipped"  # not eligible (n > 1, reuse off, text prompt without session id)
    UNAVAILABLE = "unavailable"  # the session store (Redis) failed


class Verdict(str, Enum):
    TAKE = "take"
    LEAVE = "leave"  # not this request's: keep it for its owner
    DROP = "drop"  # dead: delete it


@dataclass
class SessionEntry:
    params: dict[str, Any]
    expires_at: float  # router wall clock (epoch seconds), shared by replicas
    history: str  # digest of the history the KV covers
    length: int = 0  # token-id and text prompts: length the history digest covers
    decode: str = ""  # upstream name of the D holding the blocks
    stored_at: float = 0.0  # router wall clock
    reasoning: bool = False  # D's reply carried a reasoning trace (its KV holds it)
    generation: str = ""  # D's generation when it stored them (a reloaded config may move D to another one)

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(raw: str | bytes) -> SessionEntry:
        data = json.loads(raw)
        return SessionEntry(**data)


@dataclass(frozen=True)
class Identity:
    """Where a request may find a stored D location, how to judge an entry found there, and where to store the next."""

    scope: bytes
    route: str
    lookup_keys: tuple[str, ...]  # most specific first
    session_id: str | None  # explicit id (header or field)
    affinity: bytes | None  # P selection: a conversation keeps its P's prefix cache
    prefixes: frozenset[str] = frozenset()  # chat: digests of every prefix of this request's history
    with_reasoning: frozenset[str] = frozenset()  # chat: prefixes ending in an assistant turn that kept its reasoning
    tokens: tuple[int, ...] | None = None  # token-id prompt
    text: str | None = None  # text prompt (explicit ids only)
    tip: bytes = b""  # chat: digest of the whole history of this request (the next turn's chain continues from it)
    shard: str = ""  # chat: hash tag of the conversation (its first two messages; "" = one message so far)

    def covers(self, entry: SessionEntry) -> bool:
        """The stored KV is a prefix of this request's prompt (the history matches)."""
        if self.route == CHAT:
            return entry.history in self.prefixes
        if self.tokens is not None:
            return 0 < entry.length <= len(self.tokens) and token_digest(self.scope, list(self.tokens[: entry.length])) == entry.history
        if self.text is not None:
            return 0 < entry.length <= len(self.text) and text_digest(self.scope, self.text[: entry.length]) == entry.history
        return False

    def accepted_histories(self) -> frozenset[str] | None:
        """The histories covers() accepts, when they can be listed (chat: the request's prefixes), else None. A shared
        store takes an entry of one of them in one round trip (RedisStore.take): keep this equal to covers()."""
        return self.prefixes if self.route == CHAT else None

    def outcome_of(self, entry: SessionEntry) -> Reuse:
        if self.route == CHAT and entry.reasoning and entry.history not in self.with_reasoning:
            return Reuse.PARTIAL
        return Reuse.HIT


# What P's connector reports it did with the offered blocks (`bpdkv_pull_outcome`, bpdkv/vllm_plugin) → the reuse
# this request really got. The router's lookup only predicts; a hold D released, an expiring lease, blocks that did
# not match at all show only in P's answer.
# "cut" is not among them: P cuts at the end of most turns too (the re-rendered assistant message differs from D's
# sampled tail in the last block), so a cut alone cannot tell a dropped thought from an ordinary hit; what P read
# (`bpdkv_pulled_tokens`) decides instead.
_PULL_SETTLES: dict[str, Reuse] = {
    "mismatch": Reuse.MISMATCH,
    "expiring": Reuse.EXPIRED,
    "pin_lapsed": Reuse.EXPIRED,
    "released": Reuse.REFUSED,
    "pin_busy": Reuse.REFUSED,
    "pin_unanswered": Reuse.REFUSED,
    "unfenced_refused": Reuse.REFUSED,
    "unverified_refused": Reuse.REFUSED,
}
# Outcomes after which P may have read D's blocks; with any other, nothing of D's was read.
_MAY_HAVE_READ = frozenset({"verified", "cut", "unverified_allowed"})
# The same outcomes as causes of a miss (bpdkv_router_reuse_misses). A lapsed pin is the read's lease running out, not
# D's TTL: it is not counted `expired` (which `bpdkv tune` reads as "the TTL is too short").
_PULL_CAUSES: dict[str, MissCause] = {
    "mismatch": MissCause.MISMATCH,
    "expiring": MissCause.EXPIRING,
    "pin_lapsed": MissCause.REFUSED_PIN,
    "released": MissCause.RELEASED,
    "pin_busy": MissCause.REFUSED_PIN,
    "pin_unanswered": MissCause.REFUSED_PIN,
    "unfenced_refused": MissCause.REFUSED_PIN,
    "unverified_refused": MissCause.REFUSED_PIN,
}
assert set(_PULL_CAUSES) == set(_PULL_SETTLES)


def settle_cause(pull_outcome: object, fell_back: bool, pulled_tokens: object = None) -> MissCause | None:
    """Why a turn that offered P a stored D location did not reuse it, from P's answer; None when it did (or P says
    nothing that tells). Kept in step with settle(): a cause exactly where settle() turns a hit into something else."""
    if fell_back:
        return MissCause.PULL_FAILED
    if isinstance(pull_outcome, str) and pull_outcome in _PULL_CAUSES:
        return _PULL_CAUSES[pull_outcome]
    if type(pulled_tokens) is int:
        return None if pulled_tokens > 0 else MissCause.COMPUTED
    if isinstance(pull_outcome, str) and pull_outcome not in _MAY_HAVE_READ:
        return MissCause.COMPUTED
    return None


def settle(predicted: Reuse, pull_outcome: object, fell_back: bool, pulled_tokens: object = None) -> Reuse:
    """The reuse outcome once P has answered: P failed with D's params (and ran without them) → refused; otherwise
    what P's connector did with the blocks decides; a P that says nothing (no bpdkv plugin) leaves the prediction.

    A turn stays `hit` (or `partial`) only if P read D's blocks: P's count of tokens read (`bpdkv_pulled_tokens`) of 0
    — its own prefix cache covered them, or the pull was under the recompute threshold — is a `miss`, whatever the
    outcome (a cut that read nothing included). A P that reports an outcome but no count (a plugin before the count)
    keeps the prediction for `verified` and `cut`."""
    if predicted not in (Reuse.HIT, Reuse.PARTIAL):
        return predicted
    if fell_back:
        return Reuse.REFUSED
    if isinstance(pull_outcome, str) and pull_outcome in _PULL_SETTLES:
        return _PULL_SETTLES[pull_outcome]
    if type(pulled_tokens) is int:
        return predicted if pulled_tokens > 0 else Reuse.MISS
    if isinstance(pull_outcome, str) and pull_outcome not in _MAY_HAVE_READ:
        return Reuse.MISS  # e.g. "none": P saw no D location at all
    return predicted


def identify(route: str, tenant: str, body: dict[str, Any], session_id: str | None, mode: str, surface: str = "") -> Identity | None:
    """The request's identity, or None when it is not eligible for reuse (n > 1, no usable history).

    surface: the client API a chat-shaped conversation came in on, when not Chat Completions (`/v1/messages`,
    `/v1/responses`: their adapters hand the turn over as a chat body). It is part of the scope, so one conversation
    sent over two APIs never shares an identity (their answers are rendered, and sent back, differently)."""
    if (body.get("n") or 1) != 1:
        return None
    scope = scope_digest(tenant, surface or route, body)
    explicit = session_id if (mode != "auto" or session_id) else None
    if route == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        chain = chat_chain(scope, messages)
        affinity = chain[min(1, len(chain) - 1)]
        reasoning = frozenset(chain[i].hex() for i, m in enumerate(messages) if has_reasoning(m))
        prefixes = frozenset(h.hex() for h in chain[:-1])
        if explicit:
            return Identity(
                scope, route, (_explicit_key(scope, explicit),), explicit, _h(scope, explicit.encode()), prefixes, reasoning, tip=chain[-1]
            )
        if mode != "auto":
            return None
        keys: list[str] = []
        for i in range(len(messages) - 2, -1, -1):
            if isinstance(messages[i], dict) and messages[i].get("role") == "assistant":
                keys.append(_tagged("c", chain[1].hex(), chain[i].hex()))
                if len(keys) >= MAX_CHAT_CANDIDATES:
                    break
        shard = chain[1].hex() if len(chain) > 1 else ""
        return Identity(scope, route, tuple(keys), None, affinity, prefixes, reasoning, tip=chain[-1], shard=shard)
    prompt = body.get("prompt")
    tokens = _int_tokens(prompt)
    if explicit:
        text = prompt if isinstance(prompt, str) else None
        if tokens is None and text is None:
            return None
        return Identity(
            scope,
            route,
            (_explicit_key(scope, explicit),),
            explicit,
            _h(scope, explicit.encode()),
            tokens=tuple(tokens or ()) or None,
            text=text,
        )
    if tokens is None or mode != "auto":
        return None
    chain_t = token_chain(scope, tokens)
    affinity_t = chain_t[0][1] if chain_t else None
    keys = [_tagged("t", chain_t[0][1].hex(), h.hex()) for _, h in reversed(chain_t)][:MAX_CANDIDATES]
    return Identity(scope, route, tuple(keys), None, affinity_t, tokens=tuple(tokens))


def to_store(
    ident: Identity, body: dict[str, Any], reply: dict[str, Any] | None, params: dict[str, Any], decode: str, now: float
) -> tuple[str, SessionEntry, bool] | None:
    """(key, entry, only_if_absent) for D's location after this turn, or None when nothing can find it again."""
    entry = SessionEntry(params=params, expires_at=0.0, history="", decode=decode, stored_at=now)
    if ident.route == CHAT:
        if reply is None:
            return None
        visible = {k: v for k, v in reply.items() if k not in REASONING_FIELDS}
        entry.reasoning = has_reasoning(reply)
        entry.history = _h(ident.tip, canonical_message(visible)).hex()
        # The history's first two messages: the request's, or its only message and this reply.
        shard = ident.shard or entry.history
        key = _explicit_key(ident.scope, ident.session_id) if ident.session_id else _tagged("c", shard, entry.history)
        return key, entry, ident.session_id is not None
    text = (reply or {}).get("content") if isinstance((reply or {}).get("content"), str) else ""
    if ident.tokens is not None:
        entry.history = token_digest(ident.scope, list(ident.tokens))
        entry.length = len(ident.tokens)
        if ident.session_id:
            return _explicit_key(ident.scope, ident.session_id), entry, True
        chain = token_chain(ident.scope, list(ident.tokens))
        return (_tagged("t", chain[0][1].hex(), chain[-1][1].hex()), entry, False) if chain else None
    if ident.text is not None and ident.session_id:
        # The next prompt of a text conversation starts with this prompt and D's answer.
        entry.history = text_digest(ident.scope, ident.text + str(text))
        entry.length = len(ident.text) + len(str(text))
        return _explicit_key(ident.scope, ident.session_id), entry, True
    return None


class StoreUnavailable(Exception):
    pass


class SessionStore(Protocol):
    async def put(self, key: str, entry: SessionEntry, ttl: float, only_if_absent: bool = False) -> bool:
        """Store; with only_if_absent, a live entry under key stays and False is returned."""
        ...

    async def take(
        self, keys: list[str], judge: Callable[[SessionEntry], Verdict], accepts: frozenset[str] | None = None
    ) -> tuple[SessionEntry | None, list[Verdict]]:
        """The first entry among keys that judge() takes, removed atomically (entries are single-use). Entries judged
        DROP are deleted, LEAVE ones stay untouched. Also returns the verdicts given, for the outcome metric.
        accepts: when given, exactly the histories judge() does not LEAVE for (a chat request's prefixes): a shared
        store may then take in one round trip."""
        ...

    async def mark_released(self, keys: list[str], ttl: float) -> None:
        """D let these held blocks go (its hold budget): an entry pointing at them must never reach P."""
        ...

    async def is_released(self, key: str) -> bool: ...

    async def turn_end(self, keys: list[str]) -> tuple[float, float] | None:
        """(ended_at, expires_at) of the latest turn stored under one of keys within TURN_END_HORIZON_S, whether or
        not its entry is still there: put() records it beside the entry and keeps it after the entry is gone."""
        ...

    async def count(self) -> int: ...

    async def put_record(self, key: str, value: bytes, ttl: float) -> None:
        """A record kept for ttl seconds and read any number of times (a stored Responses API response, which
        `previous_response_id` continues from): unlike a session entry it is not single-use."""
        ...

    async def get_record(self, key: str) -> bytes | None: ...

    async def delete_record(self, key: str) -> bool:
        """Whether a record was there (and now is not)."""
        ...

    async def get_chain(self, prefix: str, first: str, ttl: float) -> tuple[list[bytes], bool]:
        """The records of a chain, newest first: prefix + first, then prefix + its `parent` (a JSON record's string
        field), and so on, each kept ttl seconds more (a chain lives as long as it is continued); at most
        MAX_CHAIN_RECORDS. (records, complete): complete is False when a record of the chain is missing (expired,
        evicted) or the chain is longer than that."""
        ...

    async def close(self) -> None: ...


MAX_CHAIN_RECORDS = 10_000  # records of one previous_response_id chain the store walks
RECORD_BYTES_MAX = 256 * 1024 * 1024  # MemoryStore: records beyond this many bytes go, least recently written first


def _parent(value: bytes) -> str | None:
    try:
        parent = json.loads(value).get("parent")
    except (ValueError, AttributeError):
        return None
    return parent if isinstance(parent, str) else None


class MemoryStore:
    """Per-process store; bounded (oldest entries go first) so a flood of conversations cannot grow it forever."""

    def __init__(self, max_entries: int = 200_000, clock: Callable[[], float] = time.time) -> None:
        self._data: dict[str, SessionEntry] = {}
        self._released: dict[str, float] = {}  # key -> until (router clock)
        self._ends: dict[str, tuple[float, float]] = {}  # key -> (ended_at, expires_at) of its latest turn
        self._records: dict[str, tuple[float, bytes]] = {}  # key -> (expires_at, value), least recently written first
        self._record_bytes = 0
        self._max = max_entries
        self._clock = clock

    async def put_record(self, key: str, value: bytes, ttl: float) -> None:
        now = self._clock()
        self._drop_record(key)
        self._records[key] = (now + ttl, value)
        self._record_bytes += len(value)
        while self._records and (
            len(self._records) > self._max or self._record_bytes > RECORD_BYTES_MAX or next(iter(self._records.values()))[0] <= now
        ):
            self._drop_record(next(iter(self._records)))

    def _drop_record(self, key: str) -> None:
        gone = self._records.pop(key, None)
        if gone is not None:
            self._record_bytes -= len(gone[1])

    async def get_record(self, key: str) -> bytes | None:
        found = self._records.get(key)
        return found[1] if found is not None and found[0] > self._clock() else None

    async def delete_record(self, key: str) -> bool:
        live = await self.get_record(key) is not None
        self._drop_record(key)
        return live

    async def get_chain(self, prefix: str, first: str, ttl: float) -> tuple[list[bytes], bool]:
        out: list[bytes] = []
        record_id: str | None = first
        now = self._clock()
        while record_id is not None and len(out) < MAX_CHAIN_RECORDS:
            key = prefix + record_id
            found = self._records.get(key)
            if found is None or found[0] <= now:
                return out, False
            self._records[key] = (max(found[0], now + ttl), found[1])  # continued: kept longer (its place stays)
            out.append(found[1])
            record_id = _parent(found[1])
        return out, record_id is None

    async def mark_released(self, keys: list[str], ttl: float) -> None:
        now = self._clock()
        for key in keys:
            self._released.pop(key, None)
            self._released[key] = now + ttl
        while self._released and (len(self._released) > self._max or next(iter(self._released.values())) <= now):
            del self._released[next(iter(self._released))]

    async def is_released(self, key: str) -> bool:
        return self._released.get(key, 0.0) > self._clock()

    async def put(self, key: str, entry: SessionEntry, ttl: float, only_if_absent: bool = False) -> bool:
        if only_if_absent:
            live = self._data.get(key)
            if live is not None and live.expires_at > self._clock():
                return False
        self._data.pop(key, None)
        self._data[key] = entry
        self._note_end(key, entry)
        self._purge_front()
        if len(self._data) > self._max:
            self._evict()
        return True

    def _note_end(self, key: str, entry: SessionEntry) -> None:
        self._ends.pop(key, None)
        self._ends[key] = (entry.stored_at, entry.expires_at)
        horizon = self._clock() - contracts.TURN_END_HORIZON_S
        while self._ends and (len(self._ends) > self._max or next(iter(self._ends.values()))[0] <= horizon):
            del self._ends[next(iter(self._ends))]

    async def turn_end(self, keys: list[str]) -> tuple[float, float] | None:
        horizon = self._clock() - contracts.TURN_END_HORIZON_S
        found = [end for end in (self._ends.get(k) for k in keys) if end is not None and end[0] > horizon]
        return max(found, default=None)

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

    async def take(
        self, keys: list[str], judge: Callable[[SessionEntry], Verdict], accepts: frozenset[str] | None = None
    ) -> tuple[SessionEntry | None, list[Verdict]]:
        verdicts: list[Verdict] = []
        for key in keys:
            entry = self._data.get(key)
            if entry is None:
                continue
            verdict = judge(entry)
            verdicts.append(verdict)
            if verdict is Verdict.LEAVE:
                continue
            del self._data[key]
            if verdict is Verdict.TAKE:
                return entry, verdicts
        return None, verdicts

    async def count(self) -> int:
        now = self._clock()
        if len(self._data) > 10_000:
            return len(self._data)
        return sum(1 for e in self._data.values() if e.expires_at > now)

    async def close(self) -> None:
        self._data.clear()
        self._records.clear()
        self._record_bytes = 0


# Compare-and-delete: the take of one worker never removes an entry another worker stored in between.
DELETE_IF_EQUAL = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) else return 0 end"
# One round trip for a chat lookup: the first candidate whose history the request extends, read and deleted
# atomically; the candidates of other histories (left alone) come back too, for the judge and the outcome metric.
# A value is "<history>\n<entry JSON>" (an entry without the header: left for the router to judge).
TAKE_FIRST = """
local accepted = {}
for i = 1, #ARGV do accepted[ARGV[i]] = true end
local left = {}
for i, key in ipairs(KEYS) do
  local v = redis.call('GET', key)
  if v then
    local nl = string.find(v, '\\n', 1, true)
    if nl and accepted[string.sub(v, 1, nl - 1)] then
      redis.call('DEL', key)
      return {i, v, left}
    end
    left[#left + 1] = i
    left[#left + 1] = v
  end
end
return {0, false, left}
"""


# A previous_response_id chain in one round trip: each record read and kept longer, then its parent's (KEYS[1] is the
# chain's key prefix, which carries the tenant's hash tag: every key of one chain is in one slot).
CHAIN = """
local out = {}
local id = ARGV[1]
local ttl = tonumber(ARGV[2])
for i = 1, tonumber(ARGV[3]) do
  local key = KEYS[1] .. id
  local v = redis.call('GET', key)
  if not v then return {0, out} end
  if redis.call('PTTL', key) < ttl then redis.call('PEXPIRE', key, ttl) end
  out[#out + 1] = v
  local ok, record = pcall(cjson.decode, v)
  if not ok or type(record) ~= 'table' or type(record['parent']) ~= 'string' then return {1, out} end
  id = record['parent']
end
return {0, out}
"""

_ENTRY_FIELDS = tuple(f.name for f in fields(SessionEntry))


def _encode(entry: SessionEntry) -> bytes:
    """The stored value: its history, then the entry as JSON through orjson (measured: SessionEntry.to_json, built on
    dataclasses.asdict's deep copy, took 74 µs an entry; this 1-2 µs)."""
    from bpdkv.router import jsonbytes

    return entry.history.encode() + b"\n" + jsonbytes.dumps({name: getattr(entry, name) for name in _ENTRY_FIELDS})


def _entry_of(value: bytes) -> SessionEntry | None:
    from bpdkv.router import jsonbytes

    try:
        data = jsonbytes.loads(value if value[:1] == b"{" else value.split(b"\n", 1)[1])
        return SessionEntry(**data) if isinstance(data, dict) else None
    except (ValueError, TypeError, IndexError, RecursionError):
        return None


class RedisStore:
    """Shared by router workers and replicas. Any Redis failure raises StoreUnavailable; the caller serves without
    reuse. Through bpdkv.router.resp (one pipelined connection per process, not redis-py's pool: see there why).

    Commands per chat turn: the take (one script: the first candidate of this history, read and deleted), EXISTS of
    its released mark, SET of the next turn's entry with its end mark (one round trip; a miss reads the marks: MGET);
    other prompts MGET, judge, then compare-and-delete. Every
    command touches one key or keys of one hash slot (a lookup's candidates share their conversation's hash tag,
    sessions.identify), so a Redis Cluster can shard them."""

    PREFIX = "bpdkv:s:"
    RELEASED = "bpdkv:r:"
    ENDS = "bpdkv:e:"  # key -> "ended_at expires_at" of its latest turn, kept TURN_END_HORIZON_S (the gap metric)
    RECORDS = "bpdkv:rec:"  # key -> a record (put_record): read by any worker or replica, and after a restart

    def __init__(self, url: str, timeout: float = 0.25, **options: Any) -> None:
        from bpdkv.router.resp import RespClient

        # options: password / ssl_ca_certs / ssl_check_hostname (bpdkv.router.security.redis_options)
        self._redis = RespClient(url, timeout, **options)

    @property
    def commands(self) -> int:
        """Commands sent so far (the benchmark counts them per turn)."""
        return self._redis.commands

    async def _call(self, coro: Any) -> Any:
        from bpdkv.router.resp import RespConnectionError, RespError

        try:
            return await coro
        except (RespError, RespConnectionError, OSError, asyncio.TimeoutError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None

    async def put(self, key: str, entry: SessionEntry, ttl: float, only_if_absent: bool = False) -> bool:
        px = max(int(ttl * 1000), 1)
        value = _encode(entry)
        args: tuple[Any, ...] = ("SET", self.PREFIX + key, value, "PX", px)
        end: tuple[Any, ...] = (
            "SET",
            self.ENDS + key,
            f"{entry.stored_at!r} {entry.expires_at!r}".encode(),
            "PX",
            int(contracts.TURN_END_HORIZON_S * 1000),
        )
        if only_if_absent:
            done = await self._call(self._redis.execute(*args, "NX"))
            if done is not None:
                await self._call(self._redis.execute(*end))
            return done is not None
        answers = await self._call(self._redis.pipeline([args, end]))  # one round trip: the entry and its turn's end
        from bpdkv.router.resp import RespError

        failed = next((a for a in answers if isinstance(a, RespError)), None)
        if failed is not None:
            raise StoreUnavailable(f"RespError: {failed}")
        return True

    async def turn_end(self, keys: list[str]) -> tuple[float, float] | None:
        if not keys:
            return None
        values = await self._call(self._redis.execute("MGET", *[self.ENDS + k for k in keys]))
        found: list[tuple[float, float]] = []
        for value in values or ():
            try:
                ended, expires = (float(x) for x in bytes(value).split())
            except (TypeError, ValueError):
                continue  # absent (None) or not ours
            found.append((ended, expires))
        return max(found, default=None)

    async def take(
        self, keys: list[str], judge: Callable[[SessionEntry], Verdict], accepts: frozenset[str] | None = None
    ) -> tuple[SessionEntry | None, list[Verdict]]:
        verdicts: list[Verdict] = []
        if not keys:
            return None, verdicts
        if accepts is not None:
            return await self._take_accepted(keys, judge, accepts)
        if len(keys) == 1:
            values = [await self._call(self._redis.execute("GET", self.PREFIX + keys[0]))]
        else:
            values = await self._call(self._redis.execute("MGET", *[self.PREFIX + k for k in keys]))
        for key, value in zip(keys, values, strict=True):
            if value is None:
                continue
            entry, verdict = await self._judge_unclaimed(key, value, judge)
            verdicts.append(verdict)
            if entry is not None:
                return entry, verdicts
        return None, verdicts

    async def _judge_unclaimed(
        self, key: str, value: bytes, judge: Callable[[SessionEntry], Verdict]
    ) -> tuple[SessionEntry | None, Verdict]:
        """An entry read, still in Redis: judged, and deleted if not LEFT — only the value judged (if another worker
        replaced it meanwhile, that one is not ours to take). (the entry if taken, the verdict)"""
        entry = _entry_of(value)
        verdict = Verdict.DROP if entry is None else judge(entry)
        if verdict is Verdict.LEAVE:
            return None, verdict
        deleted = await self._call(self._redis.script(DELETE_IF_EQUAL, [self.PREFIX + key], [value]))
        return (entry if verdict is Verdict.TAKE and deleted else None), verdict

    async def _take_accepted(
        self, keys: list[str], judge: Callable[[SessionEntry], Verdict], accepts: frozenset[str]
    ) -> tuple[SessionEntry | None, list[Verdict]]:
        verdicts: list[Verdict] = []
        rest = list(keys)
        while rest:
            index, value, left = await self._call(self._redis.script(TAKE_FIRST, [self.PREFIX + k for k in rest], sorted(accepts)))
            for i in range(0, len(left), 2):  # candidates of other histories: the judge leaves them (and counts them)
                entry, verdict = await self._judge_unclaimed(rest[left[i] - 1], left[i + 1], judge)
                verdicts.append(verdict)
                if entry is not None:
                    return entry, verdicts
            if not index:
                return None, verdicts
            entry = _entry_of(value)
            verdict = Verdict.DROP if entry is None else judge(entry)
            verdicts.append(verdict)
            if verdict is Verdict.TAKE and entry is not None:
                return entry, verdicts
            if verdict is Verdict.LEAVE and entry is not None:  # accepts said otherwise: put it back as it was
                ttl = entry.expires_at - time.time()
                if ttl > 0:
                    await self._call(self._redis.execute("SET", self.PREFIX + rest[index - 1], value, "PX", int(ttl * 1000) + 1, "NX"))
            rest = rest[index:]  # DROP: deleted already; look further
        return None, verdicts

    async def mark_released(self, keys: list[str], ttl: float) -> None:
        if not keys:
            return
        px = max(int(ttl * 1000), 1)
        answers = await self._call(self._redis.pipeline([("SET", self.RELEASED + key, b"1", "PX", px) for key in keys]))
        from bpdkv.router.resp import RespError

        failed = next((a for a in answers if isinstance(a, RespError)), None)
        if failed is not None:
            raise StoreUnavailable(f"RespError: {failed}")

    async def is_released(self, key: str) -> bool:
        return bool(await self._call(self._redis.execute("EXISTS", self.RELEASED + key)))

    async def put_record(self, key: str, value: bytes, ttl: float) -> None:
        await self._call(self._redis.execute("SET", self.RECORDS + key, value, "PX", max(int(ttl * 1000), 1)))

    async def get_record(self, key: str) -> bytes | None:
        value = await self._call(self._redis.execute("GET", self.RECORDS + key))
        return None if value is None else bytes(value)

    async def delete_record(self, key: str) -> bool:
        return bool(await self._call(self._redis.execute("DEL", self.RECORDS + key)))

    async def get_chain(self, prefix: str, first: str, ttl: float) -> tuple[list[bytes], bool]:
        complete, values = await self._call(
            self._redis.script(CHAIN, [self.RECORDS + prefix], [first, max(int(ttl * 1000), 1), MAX_CHAIN_RECORDS])
        )
        return [bytes(v) for v in values or ()], bool(complete)

    async def count(self) -> int:
        total = 0
        cursor = b"0"
        for _ in range(100):  # bounded scan; the gauge is approximate above 100k sessions
            cursor, batch = await self._call(self._redis.execute("SCAN", cursor, "MATCH", self.PREFIX + "*", "COUNT", 1000))
            total += len(batch)
            if cursor == b"0":
                break
        return total

    async def close(self) -> None:
        try:
            await self._redis.close()
        except Exception:  # noqa: BLE001 - closing a broken connection must not fail shutdown
            pass


def make_store(state: str, clock: Callable[[], float] = time.time, redis_options: dict[str, Any] | None = None) -> SessionStore:
    if state == "memory":
        return MemoryStore(clock=clock)  # expiry must be judged on the router's own clock
    return RedisStore(state, **(redis_options or {}))
