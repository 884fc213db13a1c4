"""The router's generation rules (what a generation is: bpdkv/generations.py).

- P and D pair only within one generation, and a stored D location is offered only to a P of its D's generation.
- A generation serves while it has an available P and an available D (healthy, not ejected, not drained, its engines
  confirmed as of that generation).
- A new conversation (nothing stored) goes to the newest generation that serves.
- A conversation whose D is in an older generation continues there while that generation serves; once it does not,
  its next turn is computed on the newest serving generation (its stored location is not offered): never an error.
- A turn whose generation loses its last P before the turn reaches one, or its last D before D's first byte (drained,
  ejected, failed while P computed), is rescued: computed again from its prompt on the newest other generation that
  serves (P then D; no stored location offered, nor P's answer of the first generation): never a 5xx while a
  generation serves. Only where no other generation serves does the turn end as every P (or D) failing does.
- The upstream lists and the generations may change while the router runs (router/reload.py): a member moved to
  another url or generation is a restarted one (never offered a location stored before, nor one stored under another
  generation: reuse.py), and a rank follows the generation's place in the new list.

Each turn's generation is held in a context variable for the turn's task (`enter`), which the pools read when they pick
P and D (upstreams.Pool.candidates): every pick of one turn, retries included, stays in its generation.

`bpdkv_router_generation_serving` follows the members' state: set at every turn, after every health-check pass and at
every scrape, so it is current without traffic.
"""

from __future__ import annotations

import enum
import logging
import weakref
from collections.abc import Iterable
from contextvars import ContextVar
from typing import Any, Protocol

from prometheus_client import Counter, Gauge

log = logging.getLogger("bpdkv.router")
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
    RESCUED = "rescued"  # its generation lost its last P or D during the turn: computed again on this one


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


def serving_counts(prefill: Iterable[Member], decode: Iterable[Member], ids: Iterable[str], now: float) -> dict[str, dict[str, int]]:
    """Available P and D members per generation (every id in `ids`, with 0 where none is)."""
    out = {g: {"prefill": 0, "decode": 0} for g in ids}
    for role, members in (("prefill", prefill), ("decode", decode)):
        for m in members:
            if m.available(now):
                out.setdefault(m.generation, {"prefill": 0, "decode": 0})[role] += 1
    return out


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
            "moved (its D's generation no longer serves: computed on the newest), rescued (its first generation lost "
            "its last P or D during the turn: computed again on this one, counted under both)",
            ["generation", "kind"],
            registry=registry,
        )
        self.serving = Gauge(
            "bpdkv_router_generation_serving",
            "1 while the generation has an available P and D (healthy, not ejected, not drained, of its generation); "
            "updated at each turn, health-check pass and scrape; with several workers, 1 if any live worker sees it so",
            ["generation"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.published: set[str] = set()  # generations with a serving series (one gone from the config is removed)


_METRICS: weakref.WeakKeyDictionary[Any, GenerationMetrics] = weakref.WeakKeyDictionary()


def metrics_of(router_metrics: Any) -> GenerationMetrics:
    got = _METRICS.get(router_metrics)
    if got is None:
        got = _METRICS[router_metrics] = GenerationMetrics(router_metrics.registry)
    return got


def publish(prefill: Any, decode: Any, router_metrics: Any, now: float | None = None) -> None:
    """The serving gauge of every generation from the members' state now (nothing where no generations are listed)."""
    now = prefill.clock() if now is None else now
    rank = ranks(list(prefill.members) + list(decode.members))
    if not (len(rank) > 1 or any(rank)):
        return
    m = metrics_of(router_metrics)
    serves = serving(prefill.members, decode.members, now)
    for g in rank:
        m.serving.labels(g).set(1 if g in serves else 0)
    for g in m.published - set(rank):
        m.serving.remove(g)
    m.published = set(rank)


def stranded(members: Iterable[Member], now: float) -> bool:
    """This turn's generation has no available member in `members` (one role's pool)."""
    generation = scope()
    return generation is not None and not any(m.generation == generation and m.available(now) for m in members)


def rescuable(prefill: Any, decode: Any, now: float | None = None) -> bool:
    """Another generation than this turn's serves (where a turn that lost its own can be finished)."""
    generation = scope()
    now = prefill.clock() if now is None else now
    return generation is not None and bool(serving(prefill.members, decode.members, now) - {generation})


def rescue(prefill: Any, decode: Any, router_metrics: Any, now: float | None = None) -> str | None:
    """This turn's generation lost its last P or D during the turn: enter the newest other generation that serves,
    counted as rescued there (None, scope unchanged: none serves)."""
    lost = scope()
    now = prefill.clock() if now is None else now
    if lost is None:
        return None
    serves = serving(prefill.members, decode.members, now) - {lost}
    if not serves:
        return None
    chosen = newest(ranks(list(prefill.members) + list(decode.members)), serves, set())
    assert chosen is not None
    metrics_of(router_metrics).turns.labels(chosen, TurnKind.RESCUED.value).inc()
    log.info("a turn of generation %s lost its last P or D before its answer started: computed again on %s", lost, chosen)
    enter(chosen)
    return chosen


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
        metrics_of(router_metrics).turns.labels(chosen or "", kind.value).inc()
        publish(prefill, decode, router_metrics, now)
    enter(chosen)
    if kind is not TurnKind.CONTINUED:
        return None, None
    return d_params, d_holder
