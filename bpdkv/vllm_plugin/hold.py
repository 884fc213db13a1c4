"""D's hold budget: which finished requests' KV blocks D keeps for a later pull, and which it lets go. Pure, stdlib only.

With bidirectional reuse D keeps every finished turn's blocks until P pulls them or the TTL ends. Unbounded, that
fills D's KV cache with blocks nobody may pull, and live requests wait. The ledger bounds it:
- at most `budget_blocks` held at once; over it, the oldest holds go first (least likely to be pulled next);
- when live requests cannot get blocks (pressure), held blocks go, oldest first, before any live request waits;
- requests the router will not offer again (reuse off, consumed params, evicted sessions) are not held at all,
  or released as soon as the router says so.
Every release is counted by reason, and the released request ids are announced on D's next answers so the router
stops offering them (a pull of released blocks would read blocks that now belong to someone else).
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass

from bpdkv import contracts

# kv_connector_extra_config keys (rendered from the topology's decode instance)
HOLD_BUDGET_KEY = "bpdkv_hold_budget"  # share of D's KV cache blocks that finished requests may hold, (0, 1]
# Wire keys in kv_transfer_params (bpdkv/contracts.py says who sends each).
HOLD_KEY = contracts.HOLD
RELEASE_KEY = contracts.RELEASE_REQUEST_IDS
RELEASED_KEY = contracts.RELEASED_REQUEST_IDS
PULL_OUTCOME_KEY = contracts.PULL_OUTCOME

# Why the default budget is a half (benchmarks/results/gpu-h200x2/session3/README.md): D must keep room for its
# live decodes (their KV grows every step) and for the next turns' prefills it pulls from P; held blocks beyond a
# half only raise reuse hits for conversations idle long enough that P's own cache covers most of them.
DEFAULT_HOLD_BUDGET = 0.5
ANNOUNCE_MAX = 512  # released ids kept for announcement (a router that misses some falls back on the digest check)


class ReleaseReason(enum.Enum):
    PULLED = "pulled"  # P read the blocks (NIXL notification)
    BUDGET = "budget"  # more held than the budget allows: oldest released
    PRESSURE = "pressure"  # live requests needed blocks
    TTL = "ttl"  # decoder_kv_blocks_ttl ended without a pull
    NOT_OFFERED = "not_offered"  # the router said it will not offer them again


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

    @property
    def held_blocks(self) -> int:
        return sum(h.blocks for h in self._held.values())

    @property
    def held_tokens(self) -> int:
        return sum(h.tokens for h in self._held.values())

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def hold(self, hold: Hold) -> list[str]:
        """Record a finished request's blocks; returns the holds to release (oldest first) to stay within budget."""
        self._held[hold.request_id] = hold
        out = []
        while self._held and self.held_blocks > self.budget:
            oldest = next(iter(self._held))
            self._release(oldest, ReleaseReason.BUDGET)
            out.append(oldest)
        return out

    def relieve(self, blocks_needed: int) -> list[str]:
        """Live requests need `blocks_needed` more blocks than are free: release the oldest holds that cover it."""
        out: list[str] = []
        freed = 0
        while self._held and freed < blocks_needed:
            oldest = next(iter(self._held))
            freed += self._held[oldest].blocks
            self._release(oldest, ReleaseReason.PRESSURE)
            out.append(oldest)
        return out

    def release(self, request_id: str, reason: ReleaseReason) -> bool:
        if request_id not in self._held:
            return False
        self._release(request_id, reason)
        return True

    def _release(self, request_id: str, reason: ReleaseReason) -> None:
        del self._held[request_id]
        self._releasing[request_id] = reason
        self._announce.append(request_id)

    def not_held(self) -> None:
        """A request the router will not offer again finished: its blocks were freed at once."""
        self.releases[ReleaseReason.NOT_OFFERED] += 1

    def finished_sending(self, request_id: str, now: float) -> ReleaseReason | None:
        """The worker freed a request's blocks. Ours (asked) or its own (pulled, or TTL ended)."""
        reason = self._releasing.pop(request_id, None)
        if reason is None:
            hold = self._held.pop(request_id, None)
            if hold is None:
                return None  # not a D hold (e.g. P's blocks pulled by D)
            reason = ReleaseReason.TTL if now >= hold.expires_at else ReleaseReason.PULLED
        self.releases[reason] += 1
        return reason

    def take_announcements(self) -> list[str]:
        out = list(self._announce)
        self._announce.clear()
        return out
