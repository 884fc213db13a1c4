"""D's hold budget: which finished requests' KV blocks D keeps for a later pull, and which it lets go. Pure, stdlib only.

With bidirectional reuse D keeps every finished turn's blocks until P pulls them or the TTL ends. Unbounded, that
fills D's KV cache with blocks nobody may pull, and live requests wait. The ledger bounds it:
- at most `budget_blocks` held at once; over it, the oldest holds go first (least likely to be pulled next);
- when live requests cannot get blocks (pressure), held blocks go, oldest first, before any live request waits;
- requests the router will not offer again (reuse off, consumed params, evicted sessions) are not held at all,
  or released as soon as the router says so.
Every release is counted by reason, and the released request ids are announced on D's next answers so the router
stops offering them (a pull of released blocks would read blocks that now belong to someone else).

The fence (bpdkv/vllm_plugin/fence.py) makes that last point a guarantee rather than a hope: P pins a hold before it
reads. A pin is granted only for a hold that is still held (not released, not reported freed) and will not reach its
TTL within the lease; while pinned, no release path frees it (budget and pressure pick other holds, a release the
router asks for waits), so it leaves the ledger only when the worker reports it freed after P's read, or when the
lease ends unused. Announced releases and the pin are both decided here, under one lock, so no interleaving of a
release with a pin can grant a pin on blocks that are being freed.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass

from bpdkv import contracts

# kv_connector_extra_config key (rendered from the topology's decode instance) and its default: bpdkv/contracts.py
HOLD_BUDGET_KEY = contracts.EXTRA_HOLD_BUDGET
DEFAULT_HOLD_BUDGET = contracts.DEFAULT_HOLD_BUDGET
# Wire keys in kv_transfer_params (bpdkv/contracts.py says who sends each).
HOLD_KEY = contracts.HOLD
RELEASE_KEY = contracts.RELEASE_REQUEST_IDS
RELEASED_KEY = contracts.RELEASED_REQUEST_IDS
PULL_OUTCOME_KEY = contracts.PULL_OUTCOME

ANNOUNCE_MAX = 512  # released ids kept for announcement (a router that misses some falls back on the digest check)
# A pin is refused when the hold's TTL ends within the lease plus this: the worker frees TTL-expired blocks on its
# own clock (the same monotonic clock, stamped microseconds earlier), so a pin must end well before the TTL does.
TTL_SLACK = 1.0


class ReleaseReason(enum.Enum):
    PULLED = "pulled"  # P read the blocks (NIXL notification)
    BUDGET = "budget"  # more held than the budget allows: oldest released
    PRESSURE = "pressure"  # live requests needed blocks
    TTL = "ttl"  # decoder_kv_blocks_ttl ended without a pull
    NOT_OFFERED = "not_offered"  # the router said it will not offer them again
    DECLINED = "declined"  # P computed locally instead of pulling (its cost model) and let the hold go (fence release)


class PinRefusal(enum.Enum):
    GONE = "gone"  # not held (released, freed after a pull or the TTL, or never held here)
    EXPIRING = "expiring"  # the TTL ends within the lease
    PINNED = "pinned"  # another reader holds the pin (the params were handed out twice)


@dataclass(frozen=True)
class PinGrant:
    until: float  # monotonic seconds on D


@dataclass(frozen=True)
class Pin:
    token: str  # the reader's, so that a retransmitted ask gets the same answer
    until: float


@dataclass(frozen=True)
class Hold:
    request_id: str
    blocks: int
    tokens: int
    expires_at: float  # monotonic seconds


def budget_blocks(fraction: float, total_blocks: int) -> int:
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"{HOLD_BUDGET_KEY} must be a share of the KV cache between 0 and 1, got {fraction}")
    return int(fraction * total_blocks)


class HoldLedger:
    """The scheduler's view of D's held requests, in finish order (oldest first)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._held: OrderedDict[str, Hold] = OrderedDict()
        self._releasing: dict[str, ReleaseReason] = {}  # asked the worker to free; not yet reported back
        self.releases: dict[ReleaseReason, int] = dict.fromkeys(ReleaseReason, 0)
        self._announce: deque[str] = deque(maxlen=ANNOUNCE_MAX)
        self._pins: dict[str, Pin] = {}
        self._deferred: dict[str, ReleaseReason] = {}  # release asked while pinned: done when the pin ends unused
        self.pins_granted = 0
        self.pins_refused: dict[PinRefusal, int] = dict.fromkeys(PinRefusal, 0)
        self.deferred_releases = 0  # releases that waited for (or skipped) a pinned hold
        self.pins_lapsed = 0  # pins whose lease ended before the worker reported the hold freed
        self._due: list[str] = []  # releases that waited for a pin which has ended: for the worker, at the next tick
        # The fence answers pins from its own thread; every method below runs under this lock.
        self._lock = threading.RLock()

    @property
    def held_blocks(self) -> int:
        with self._lock:
            return sum(h.blocks for h in self._held.values())

    @property
    def held_tokens(self) -> int:
        with self._lock:
            return sum(h.tokens for h in self._held.values())

    def holds(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._held

    def pinned(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._pins

    def hold(self, hold: Hold) -> list[str]:
        """Record a finished request's blocks; returns the holds to release (oldest first) to stay within budget."""
        with self._lock:
            self._held[hold.request_id] = hold
            return self._enforce_budget()

    def _enforce_budget(self) -> list[str]:
        out: list[str] = []
        for rid in list(self._held):
            if self._held_blocks() <= self.budget:
                break
            if rid in self._pins:
                self.deferred_releases += 1  # a reader is on it: the next oldest goes instead
                continue
            self._release(rid, ReleaseReason.BUDGET)
            out.append(rid)
        return out

    def _held_blocks(self) -> int:
        return sum(h.blocks for h in self._held.values())

    def relieve(self, blocks_needed: int) -> list[str]:
        """Live requests need `blocks_needed` more blocks than are free: release the oldest holds that cover it."""
        with self._lock:
            out: list[str] = []
            freed = 0
            for rid in list(self._held):
                if freed >= blocks_needed:
                    break
                if rid in self._pins:
                    self.deferred_releases += 1
                    continue
                freed += self._held[rid].blocks
                self._release(rid, ReleaseReason.PRESSURE)
                out.append(rid)
            return out

    def release(self, request_id: str, reason: ReleaseReason) -> bool:
        """Release a hold now. True when the caller must tell the worker to free it now; a pinned hold is announced
        now but freed only if its pin ends unused (`tick` returns it then)."""
        with self._lock:
            if request_id not in self._held:
                return False
            if request_id in self._pins:
                if request_id not in self._deferred:
                    self._deferred[request_id] = reason
                    self.deferred_releases += 1
                    self._announce.append(request_id)
                return False
            self._release(request_id, reason)
            return True

    def release_soon(self, request_id: str, reason: ReleaseReason) -> bool:
        """`release` from another thread (the fence's): what the worker must free is handed out by the next `tick`.
        True when a hold was let go (or will be once its pin ends)."""
        with self._lock:
            if request_id not in self._held or request_id in self._deferred:
                return False
            if self.release(request_id, reason):
                self._due.append(request_id)
            return True

    def _release(self, request_id: str, reason: ReleaseReason) -> None:
        del self._held[request_id]
        self._deferred.pop(request_id, None)
        self._releasing[request_id] = reason
        self._announce.append(request_id)

    def pin(self, request_id: str, token: str, now: float, lease: float) -> PinGrant | PinRefusal:
        """A reader asks to read a hold. Granted only while the hold is held and its TTL outlasts the lease."""
        with self._lock:
            self._lapse_pins(now)
            pin = self._pins.get(request_id)
            if pin is not None:
                if pin.token == token:
                    return PinGrant(pin.until)  # a retransmitted ask: the same answer
                self.pins_refused[PinRefusal.PINNED] += 1
                return PinRefusal.PINNED
            hold = self._held.get(request_id)
            if hold is None or request_id in self._deferred:
                self.pins_refused[PinRefusal.GONE] += 1
                return PinRefusal.GONE
            if hold.expires_at - now <= lease + TTL_SLACK:
                self.pins_refused[PinRefusal.EXPIRING] += 1
                return PinRefusal.EXPIRING
            self._pins[request_id] = Pin(token, now + lease)
            self.pins_granted += 1
            return PinGrant(now + lease)

    def tick(self, now: float) -> list[str]:
        """Every scheduler step: end lapsed pins; returns the holds to free now (releases that waited for a pin, and
        what the budget needs once pins no longer protect them)."""
        with self._lock:
            self._lapse_pins(now)
            due, self._due = self._due, []
            return due + self._enforce_budget()

    def _lapse_pins(self, now: float) -> None:
        """End pins past their lease; a release that waited for one becomes due (handed out by the next tick, also
        when a pin ask in the fence thread noticed the lapse first)."""
        for rid, pin in list(self._pins.items()):
            if pin.until <= now:
                del self._pins[rid]
                self.pins_lapsed += 1
                reason = self._deferred.pop(rid, None)
                if reason is not None and rid in self._held:
                    del self._held[rid]
                    self._releasing[rid] = reason  # announced when it was asked
                    self._due.append(rid)

    def not_held(self) -> None:
        """A request the router will not offer again finished: its blocks were freed at once."""
        with self._lock:
            self.releases[ReleaseReason.NOT_OFFERED] += 1

    def finished_sending(self, request_id: str, now: float) -> ReleaseReason | None:
        """The worker freed a request's blocks. Ours (asked) or its own (pulled, or TTL ended)."""
        with self._lock:
            self._pins.pop(request_id, None)
            self._deferred.pop(request_id, None)
            reason = self._releasing.pop(request_id, None)
            if reason is None:
                hold = self._held.pop(request_id, None)
                if hold is None:
                    return None  # not a D hold (e.g. P's blocks pulled by D)
                reason = ReleaseReason.TTL if now >= hold.expires_at else ReleaseReason.PULLED
            self.releases[reason] += 1
            return reason

    def take_announcements(self) -> list[str]:
        with self._lock:
            out = list(self._announce)
            self._announce.clear()
            return out
