"""The router's generation rules (what a generation is: bpdkv/generations.py).

- P and D pair only within one generation, and a stored D location is offered only to a P of its D's generation.
- A generation serves while it has an available P and an available D (healthy, not ejected, not drained, its engines
  confirmed as of that generation).
- A new conversation (nothing stored) goes to the newest generation that serves.
- A conversation whose D is in an older generation continues there while that generation serves; once it does not,
  its next turn is computed on the newest serving generation (its stored location is not offered): never an error.

Each turn's generation is held in a context variable for the turn's task (`enter`), which the pools read when they pick
P and D (upstreams.Pool.candidates): every pick of one turn, retries included, stays in its generation.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any, Protocol

from prometheus_client import Counter, Gauge

_SCOPE: ContextVar[str | None] = ContextVar("bpdkv_generation", default=None)


class Member(Protocol):
    generation: str
    generation_rank: int
    drained: bool
    name: str

    def available(self, now: float) -> bool: ...

    @property
    def identity_ok(self) -> bool: ...


class TurnKind(str, enum.Enum):
    NEW = "new"  # no stored location: the newest serving generation
    CONTINUED = "continued"  # offered its stored location, in the D's generation
    MOVED = "moved"  # its stored D's generation does not serve: computed on the newest serving one


def scope() -> str | None:
    """This turn's generation (None: outside a turn, every member)."""
    return _SCOPE.get()


def enter(generation: str | None) -> None:
    _SCOPE.set(generation)


def ranks(members: Iterable[Member]) -> dict[str, int]:
    out: dict[str, int] = {}
    for m in members:
        out[m.generation] = max(out.get(m.generation, m.generation_rank), m.generation_rank)
    return out


def serving(prefill: Iterable[Member], decode: Iterable[Member], now: float) -> set[str]:
    """Generations with an available P and an available D."""
    p = {m.generation for m in prefill if m.available(now)}
    return p & {m.generation for m in decode if m.available(now)}


def present(prefill: Iterable[Member], decode: Iterable[Member]) -> set[str]:
    """Generations with a P and a D that may be tried at all (not drained, engine not of another generation)."""
    p = {m.generation for m in prefill if not m.drained and m.identity_ok}
    return p & {m.generation for m in decode if not m.drained and m.identity_ok}


def newest(rank: dict[str, int], serves: set[str], fallback: set[str]) -> str | None:
    """The newest generation that serves; if none does, the newest that may be tried (health catching up)."""
    for pool in (serves, fallback):
        if pool:
            return max(pool, key=lambda g: (rank.get(g, 0), g))
    return max(rank, key=lambda g: (rank[g], g)) if rank else None


def for_turn(holder_generation: str | None, rank: dict[str, int], serves: set[str], fallback: set[str]) -> tuple[str | None, TurnKind]:
    """A turn's generation and kind; `holder_generation`: the generation of the D holding its stored location."""
    if holder_generation is not None and holder_generation in serves:
        return holder_generation, TurnKind.CONTINUED
    chosen = newest(rank, serves, fallback)
    return chosen, (TurnKind.NEW if holder_generation is None else TurnKind.MOVED)


# ---- metrics (per generation), on the router's own registry ------------------------------------------------------
class GenerationMetrics:
    def __init__(self, registry: Any) -> None:
        self.turns = Counter(
            "bpdkv_router_generation_turns",
            "Turns through P by generation and kind: new (no stored location), continued (on its D's generation), "
            "moved (its D's generation no longer serves: computed on the newest)",
            ["generation", "kind"],
            registry=registry,
        )
        self.serving = Gauge(
            "bpdkv_router_generation_serving",
            "1 while the generation has an available P and D (as this router worker last saw at a turn)",
            ["generation"],
            registry=registry,
            multiprocess_mode="livemax",
        )


_METRICS: weakref.WeakKeyDictionary[Any, GenerationMetrics] = weakref.WeakKeyDictionary()


def metrics_of(router_metrics: Any) -> GenerationMetrics:
    got = _METRICS.get(router_metrics)
    if got is None:
        got = _METRICS[router_metrics] = GenerationMetrics(router_metrics.registry)
    return got


def settle_turn(
    prefill: Any, decode: Any, d_params: dict[str, Any] | None, d_holder: str | None, router_metrics: Any, now: float | None = None
) -> tuple[dict[str, Any] | None, str | None]:
    """Enter this turn's generation; the stored location stays offered only if its D's generation is the turn's."""
    now = prefill.clock() if now is None else now
    members = list(prefill.members) + list(decode.members)
    rank = ranks(members)
    serves = serving(prefill.members, decode.members, now)
    holder = decode.member(d_holder) if d_params is not None and d_holder else None
    held_in = holder.generation if holder is not None else (None if d_params is None else "")
    chosen, kind = for_turn(held_in, rank, serves, present(prefill.members, decode.members))
    if len(rank) > 1 or any(rank):  # a config with generations (one unnamed generation: nothing to count)
        m = metrics_of(router_metrics)
        m.turns.labels(chosen or "", kind.value).inc()
        for g in rank:
            m.serving.labels(g).set(1 if g in serves else 0)
    enter(chosen)
    if kind is not TurnKind.CONTINUED:
        return None, None
    return d_params, d_holder
