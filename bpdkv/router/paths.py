"""The per-turn path, decided in one place from its inputs.

- `decode_local`: the turn goes straight to the D that holds the conversation; D computes the new tokens from its own
  prefix cache (the held history) and streams the answer — no P, no NIXL transfer. D is told (bpdkv_local_turn) to
  hold the result again, so the next turn can once more go either way.
- `prefill_pull`: P gets the turn with D's stored location and pulls the history from D (the bidirectional path).
- `prefill_full`: nothing stored for this history: P computes the whole prompt.

decode_local needs: a stored location for this history (the lookup found it: same tenant and scope, D not restarted,
its hold not released, not expiring), few new tokens (`paths.local_max_tokens`, 0 = off), that D available (healthy,
not ejected, not drained), its engine not queueing (waiting ≤ `local_max_waiting`) and its KV cache under
`local_max_kv_usage` (when its signals are fresh), and the local prefills already in flight on it plus this one within
`local_max_tokens` — so D's decoding streams wait at most about one such prefill per engine step (inter-token latency
is why P/D exists).

And the step-time budget, costed rather than counted: while D's engine runs other streams, the local prefills in
flight on it plus this one must add at most `local_max_step_cost` (5 %) of D's step to their next gap:
new tokens ≤ local_max_step_cost × D's step time × the prefill rate. D's step time is the median of its streams' recent
inter-token gaps (steps.py, from its `/metrics`); the prefill rate is P's own measured rate (the node plugin's gauge:
P and D of one fleet run the same model) — tokens/s on a whole prompt, so on a GPU, where a few tokens more in a
memory-bound decode step cost less than that, the bound is conservative. Each of D's steps grows by at most that share,
so its streams' ITL p99 does too. D streaming nothing: nothing to slow (the token cap alone). D streaming but either
measure missing: through P (`decode_step_unknown`). No fresh engine signal at all (`load_interval` 0): the token cap.

New tokens are estimated without tokenizing: token-id prompts exactly (the prompt's length past the stored history,
an upper bound since the history excludes D's own answer); chat turns from the UTF-8 bytes of the messages past the
stored history (with a dropped reasoning trace, from the assistant message on) divided by `chars_per_token`, plus
MESSAGE_OVERHEAD tokens per message (the template's role markers) and one KV block (the re-rendered tail of D's
answer D recomputes); text prompts from their length past the history, likewise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from typing import Any

from bpdkv import contracts
from bpdkv.router import sessions
from bpdkv.router.config import PathSettings
from bpdkv.router.sessions import Reuse
from bpdkv.router.upstreams import Upstream

MESSAGE_OVERHEAD = 8  # tokens per chat message for the template's markers (ChatML: <|im_start|>role\n … <|im_end|>\n)
DEFAULT_BLOCK = 16


class TurnPath(str, Enum):
    DECODE_LOCAL = "decode_local"
    PREFILL_PULL = "prefill_pull"
    PREFILL_FULL = "prefill_full"


class PathReason(str, Enum):
    """Why a turn took its path (metric label)."""

    FEW_NEW_TOKENS = "few_new_tokens"  # decode_local
    NOTHING_STORED = "nothing_stored"  # prefill_full: no usable location for this history
    LOCAL_OFF = "local_off"  # paths.local_max_tokens 0, or X-Bpdkv-Paths: pull-only
    SIZE_UNKNOWN = "size_unknown"
    TOO_MANY_NEW_TOKENS = "too_many_new_tokens"
    DECODE_UNAVAILABLE = "decode_unavailable"  # drained, unhealthy or ejected
    DECODE_QUEUEING = "decode_queueing"  # its engine has requests waiting
    DECODE_KV_FULL = "decode_kv_full"
    DECODE_PREFILL_BUDGET = "decode_prefill_budget"  # local prefills in flight there already use the budget
    DECODE_STEP_COST = "decode_step_cost"  # it would add more than local_max_step_cost of D's step to its streams
    DECODE_STEP_UNKNOWN = "decode_step_unknown"  # D streams, but its step time or the prefill rate is not measured yet
    LOCAL_FAILED = "local_failed"  # decode_local's D failed before its first byte: the turn went through P, computed


@dataclass(frozen=True)
class PathInputs:
    stored: bool  # the lookup found this history's location (and took it)
    new_tokens: int | None
    local_allowed: bool  # config and request (benchmark header) allow decode_local
    decode_available: bool
    decode_waiting: float | None  # None: no fresh engine signal
    decode_kv_usage: float | None
    decode_local_tokens: int  # new tokens of local prefills in flight on that D
    decode_streams: float | None = None  # requests running on D's engine (None: no fresh engine signal)
    decode_step_s: float | None = None  # D's step time: its median inter-token gap lately (None: not measured)
    prefill_rate: float | None = None  # tokens/s P measured for its own prefills (None: not measured)


@dataclass(frozen=True)
class PathDecision:
    path: TurnPath
    reason: PathReason
    new_tokens: int | None


def decide(inputs: PathInputs, settings: PathSettings) -> PathDecision:
    n = inputs.new_tokens

    def pull(reason: PathReason) -> PathDecision:
        return PathDecision(TurnPath.PREFILL_PULL, reason, n)

    if not inputs.stored:
        return PathDecision(TurnPath.PREFILL_FULL, PathReason.NOTHING_STORED, n)
    if not inputs.local_allowed or settings.local_max_tokens <= 0:
        return pull(PathReason.LOCAL_OFF)
    if n is None:
        return pull(PathReason.SIZE_UNKNOWN)
    if n > settings.local_max_tokens:
        return pull(PathReason.TOO_MANY_NEW_TOKENS)
    if not inputs.decode_available:
        return pull(PathReason.DECODE_UNAVAILABLE)
    if inputs.decode_waiting is not None and inputs.decode_waiting > settings.local_max_waiting:
        return pull(PathReason.DECODE_QUEUEING)
    if inputs.decode_kv_usage is not None and inputs.decode_kv_usage >= settings.local_max_kv_usage:
        return pull(PathReason.DECODE_KV_FULL)
    if inputs.decode_local_tokens and inputs.decode_local_tokens + n > settings.local_max_tokens:
        return pull(PathReason.DECODE_PREFILL_BUDGET)
    if settings.local_max_step_cost > 0 and inputs.decode_streams:
        budget = step_budget(inputs.decode_step_s, inputs.prefill_rate, settings.local_max_step_cost)
        if budget is None:
            return pull(PathReason.DECODE_STEP_UNKNOWN)
        if inputs.decode_local_tokens + n > budget:
            return pull(PathReason.DECODE_STEP_COST)
    return PathDecision(TurnPath.DECODE_LOCAL, PathReason.FEW_NEW_TOKENS, n)


def step_budget(step_s: float | None, rate: float | None, cost: float) -> int | None:
    """New tokens a busy D may prefill locally at once: what it computes in `cost` of one of its steps."""
    if step_s is None or rate is None or step_s <= 0 or rate <= 0:
        return None
    return math.floor(cost * step_s * rate)


def _message_tokens(messages: list[Any], chars_per_token: float) -> int:
    size = sum(len(sessions.canonical_message(m)) for m in messages)
    return math.ceil(size / chars_per_token) + MESSAGE_OVERHEAD * len(messages)


def estimate_new_tokens(
    ident: sessions.Identity, entry: sessions.SessionEntry, body: dict[str, Any], outcome: Reuse, chars_per_token: float
) -> int | None:
    """Tokens D must compute for this turn beyond the history it holds (see the module's docstring), or None."""
    if ident.tokens is not None:
        return max(len(ident.tokens) - entry.length, 1)
    if ident.text is not None:
        return math.ceil(max(len(ident.text.encode()) - entry.length, 1) / chars_per_token)
    if ident.route != sessions.CHAT:
        return None
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    # Where the stored history ends: one more digest pass over this request's messages, only for continued turns.
    chain = [h.hex() for h in sessions.chat_chain(ident.scope, messages)]
    try:
        covered = chain.index(entry.history)  # messages[0..covered] are D's history
    except ValueError:
        return None
    start = covered if outcome is Reuse.PARTIAL else covered + 1  # a dropped thought: D recomputes that answer too
    block = entry.params.get(contracts.BLOCK_SIZE)
    tail = block if type(block) is int and 0 < block <= 4096 else DEFAULT_BLOCK
    return _message_tokens(messages[start:], chars_per_token) + tail


def inputs_for(
    stored: bool, new_tokens: int | None, local_allowed: bool, holder: Upstream | None, now: float, prefill_rate: float | None = None
) -> PathInputs:
    engine = holder.fresh_load(now) if holder is not None else None
    return PathInputs(
        stored=stored,
        new_tokens=new_tokens,
        local_allowed=local_allowed,
        decode_available=holder is not None and holder.available(now),
        decode_waiting=engine.waiting if engine is not None else None,
        decode_kv_usage=engine.kv_usage if engine is not None else None,
        decode_local_tokens=holder.local_tokens if holder is not None else 0,
        decode_streams=engine.running if engine is not None else None,
        decode_step_s=holder.steps.median(now, holder.load_fresh_for) if holder is not None else None,
        prefill_rate=prefill_rate,
    )


def prefill_rate(members: list[Upstream], now: float) -> float | None:
    """The prefill rate P measured (the slowest P's, fresh signals only); None when no P has measured one yet."""
    rates = [load.prefill_rate for m in members if (load := m.fresh_load(now)) is not None and load.prefill_rate]
    return min(rates) if rates else None
