"""P's link seed, measured by `bpdkv apply` after its gates and written beside P (issue 45 item 3): P knows each link
before the first conversation instead of learning it from live traffic (probes and recomputes while it has no estimate).

The file (contracts.EXTRA_LINK_SEED_FILE; `bpdkv render` points each prefill instance at its own, under its state
directory) holds `{"version": 1, "measured_at": <unix seconds>, "prefill": <instance>, "pairs": {<decode instance>:
{...}}, "seed": {"prefill_tokens_per_s": x, "links": {<D host>: {"bytes_per_s": r, "overhead_s": a}}}}` — `seed` in the
shape of `bpdkv calibrate`'s. P reads it at start and again whenever it changes (checked at most once a second, on a
decision), and takes it as the prior of what it has not measured itself (cost.Book.apply_seed): its own measurements
always win. A seed older than `bpdkv_link_seed_max_age` (default a day) is ignored: the link may have changed since, and
P then probes as it did without one. Imports only the standard library.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("vllm.bpdkv_plugin")

MAX_AGE_KEY = "bpdkv_link_seed_max_age"
DEFAULT_MAX_AGE_S = 86_400.0
CHECK_INTERVAL_S = 1.0
VERSION = 1


@dataclass
class Loaded:
    seed: dict[str, Any]
    measured_at: float
    age_s: float


def parse(text: str, now_wall: float, max_age_s: float) -> Loaded | str:
    """The seed in a file's text, or why it is not used (one line)."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        return f"not JSON ({exc})"
    if not isinstance(doc, dict) or doc.get("version") != VERSION:
        return f"not a version-{VERSION} link seed"
    seed, measured = doc.get("seed"), doc.get("measured_at")
    if not isinstance(seed, dict) or not isinstance(measured, (int, float)) or isinstance(measured, bool):
        return "needs a seed mapping and measured_at (unix seconds)"
    age = now_wall - float(measured)
    if age > max_age_s:
        return f"measured {age / 3600:.1f} h ago, older than {MAX_AGE_KEY} ({max_age_s / 3600:.1f} h): P measures the links itself"
    return Loaded(seed, float(measured), max(age, 0.0))


class SeedFile:
    """Watches one seed file; `poll` returns a seed to apply when the file is new or changed (else None)."""

    def __init__(self, path: str, max_age_s: float = DEFAULT_MAX_AGE_S) -> None:
        self.path = path
        self.max_age_s = max_age_s
        self._checked = -float("inf")
        self._seen: tuple[float, int] | None = None

    def poll(self, now: float | None = None) -> Loaded | None:
        now = time.monotonic() if now is None else now
        if now - self._checked < CHECK_INTERVAL_S:
            return None
        self._checked = now
        try:
            st = os.stat(self.path)
        except OSError:
            return None  # not measured yet (a first deploy before its gates), or removed: nothing new
        stamp = (st.st_mtime, st.st_size)
        if stamp == self._seen:
            return None
        self._seen = stamp
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            log.warning("bpdkv link seed %s: unreadable (%s); P measures the links itself", self.path, exc)
            return None
        loaded = parse(text, time.time(), self.max_age_s)
        if isinstance(loaded, str):
            log.warning("bpdkv link seed %s: %s", self.path, loaded)
            return None
        return loaded
