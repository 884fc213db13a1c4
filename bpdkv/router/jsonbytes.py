"""JSON on the router's hot path (client bodies, P and D requests, whole answers): orjson where it accepts the input,
the standard library where it refuses (integers beyond 64 bits, lone surrogates, nesting past its limit), so what
the router accepts — and how it words a rejection — stays the standard library's."""

from __future__ import annotations

import json
from typing import Any

import orjson


def loads(data: bytes) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)  # the standard library's verdict (and its RecursionError for depth)


def dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
