"""Chained per-block token digests: equality at block i implies equality of every token up to its end.

Standard library only: the same code runs on D (producing), on P (checking) and in unit tests without vLLM.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 8  # per block; a false match needs a 64-bit collision on the same chain


def block_digests(token_ids: Sequence[int], block_size: int, num_tokens: int | None = None) -> list[bytes]:
    """Digest of every *full* block of token_ids[:num_tokens]; digest i covers tokens [0, (i+1)*block_size)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
    buf = array("q", token_ids[: n - n % block_size]).tobytes()
    step = block_size * 8
    out = []
    prev = block_size.to_bytes(4, "little")
    for i in range(n // block_size):
        prev = hashlib.blake2b(prev + buf[i * step : (i + 1) * step], digest_size=DIGEST_BYTES).digest()
        out.append(prev)
    return out


def encode(digests: list[bytes]) -> str:
    return b"".join(digests).hex()


def decode(text: str) -> list[bytes]:
    raw = bytes.fromhex(text)
    if len(raw) % DIGEST_BYTES:
        raise ValueError("digest string length is not a multiple of the digest size")
    return [raw[i : i + DIGEST_BYTES] for i in range(0, len(raw), DIGEST_BYTES)]


def matching_blocks(ours: list[bytes], theirs: list[bytes]) -> int:
    """Length of the common block prefix. Chained digests make the first difference final."""
    n = 0
    for a, b in zip(ours, theirs, strict=False):
        if a != b:
            break
        n += 1
    return n
