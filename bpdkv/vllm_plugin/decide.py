"""P-side decision on D's kv_transfer_params: how much of D's KV may be pulled. Pure, standard library only."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from bpdkv import contracts
from bpdkv.vllm_plugin import digests

DIGESTS_KEY = contracts.BLOCK_DIGESTS
BLOCK_SIZE_KEY = contracts.BLOCK_SIZE
EXPIRES_AT_KEY = contracts.EXPIRES_AT  # D's wall clock (epoch s) when its blocks are freed
EXPIRES_IN_KEY = contracts.REMOTE_BLOCKS_EXPIRES_IN  # seconds left when D answered (clock-free, for the router)
# Upstream P declines reads within 5 s of expiry (HTTP 500 / hang); we stop well before that.
DEFAULT_EXPIRY_GUARD = 10.0
REMOTE_KEYS = contracts.REMOTE_LOCATION_KEYS


@dataclass(frozen=True)
class PullDecision:
    outcome: str  # verified | cut | mismatch | unverified_refused | unverified_allowed | expiring | none
    params: dict[str, Any]  # what to hand upstream
    verified_tokens: int = 0


def is_d_location(params: Any) -> bool:
    return isinstance(params, dict) and bool(params.get("do_remote_decode")) and bool(params.get("remote_block_ids"))


def strip_pull(params: dict[str, Any]) -> dict[str, Any]:
    """Keep P's own role (prefill for a remote decode) but drop where to pull from: P computes locally."""
    out = dict(params)
    for key in REMOTE_KEYS:
        out[key] = None
    out["remote_num_tokens"] = 0
    return out


def decide_pull(
    params: dict[str, Any],
    prompt_token_ids: list[int],
    local_block_size: int,
    unverified_reuse: str = "refuse",
    expiry_guard: float = DEFAULT_EXPIRY_GUARD,
    now: float | None = None,
) -> PullDecision:
    if not is_d_location(params):
        return PullDecision("none", params)
    now = time.time() if now is None else now
    expires_at = params.get(EXPIRES_AT_KEY)
    if isinstance(expires_at, (int, float)) and expires_at - now < expiry_guard:
        return PullDecision("expiring", strip_pull(params))
    text = params.get(DIGESTS_KEY)
    if not isinstance(text, str):
        if unverified_reuse == "allow":
            return PullDecision("unverified_allowed", params)
        return PullDecision("unverified_refused", strip_pull(params))
    block_size = int(params.get(BLOCK_SIZE_KEY) or 0)
    if block_size != local_block_size:
        # Digests are per block; different block sizes cannot be compared block by block: refuse.
        return PullDecision("mismatch", strip_pull(params))
    try:
        theirs = digests.decode(text)
    except ValueError:
        return PullDecision("unverified_refused", strip_pull(params))
    # Never claim the whole prompt: vLLM recomputes at least the last prompt token.
    usable = max(len(prompt_token_ids) - 1, 0)
    ours = digests.block_digests(prompt_token_ids, block_size, usable)
    k = digests.matching_blocks(ours, theirs)
    remote_num = int(params.get("remote_num_tokens") or 0)
    full_blocks_offered = min(len(theirs), remote_num // block_size)
    k = min(k, full_blocks_offered)
    if k == 0:
        return PullDecision("mismatch", strip_pull(params))
    out = dict(params)
    block_ids = params["remote_block_ids"]
    # remote_block_ids is per KV-cache group in new vLLM (list of lists), flat in older ones.
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        out["remote_block_ids"] = [list(group[:k]) for group in block_ids]
    else:
        out["remote_block_ids"] = list(block_ids[:k])
    out["remote_num_tokens"] = k * block_size
    outcome = "verified" if k * block_size >= min(remote_num, usable) - (min(remote_num, usable) % block_size) else "cut"
    return PullDecision(outcome, out, k * block_size)
