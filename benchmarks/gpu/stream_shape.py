"""What a real D's stream carries (vLLM 0.33 on the H200): one P/D turn driven as the router drives it, D's SSE lines kept.

  python3 stream_shape.py http://127.0.0.1:8100 http://127.0.0.1:8200 MODEL OUT.json

Prints and writes: P's returned kv_transfer_params (keys), D's stream as chunks (how many; on which the key
kv_transfer_params is present, null, or a dict; its keys on the last), the first two and last three raw lines, and the
same for a plain streamed request to D (no P/D params). Uses bpdkv's own request builders (bpdkv.turn_client).
"""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request
from typing import Any

from bpdkv import contracts

try:  # bpdkv after the request builders moved out of the router; the staged wheel may predate it
    from bpdkv.turn_client import decode_body, params_of, post_json, prefill_body
except ImportError:
    from bpdkv.router.turn import decode_body, params_of, post_json, prefill_body  # type: ignore[no-redef]


def _sse(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, data=json.dumps(dict(body, stream=True)).encode(), headers={"content-type": "application/json"})
    lines: list[str] = []
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if line:
                lines.append(line)
    chunks = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            chunks.append(json.loads(line[6:]))
    where = []
    for i, chunk in enumerate(chunks):
        if contracts.KV_TRANSFER_PARAMS not in chunk:
            state = "absent"
        elif chunk[contracts.KV_TRANSFER_PARAMS] is None:
            state = "null"
        else:
            state = "dict"
        finish = (chunk.get("choices") or [{}])[0].get("finish_reason")
        where.append({"chunk": i, "kv_transfer_params": state, "finish_reason": finish, "has_usage": bool(chunk.get("usage"))})
    final = next((c[contracts.KV_TRANSFER_PARAMS] for c in reversed(chunks) if isinstance(c.get(contracts.KV_TRANSFER_PARAMS), dict)), None)
    return {
        "seconds": round(time.perf_counter() - start, 3),
        "chunks": len(chunks),
        "per_chunk": where,
        "final_params_keys": sorted(final) if final else None,
        "final_params": {k: (v if len(json.dumps(v)) < 120 else f"<{type(v).__name__} of {len(v)}>") for k, v in (final or {}).items()},
        "first_lines": [line[:400] for line in lines[:2]],
        "last_lines": [line[:600] for line in lines[-3:]],
    }


def main() -> None:
    p_url, d_url, model, out = sys.argv[1:5]
    rng = random.Random(7)
    prompt = [rng.randrange(1000, 100000) for _ in range(2000)]
    body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    result: dict[str, Any] = {}
    data, p_seconds = post_json(p_url + "/v1/completions", prefill_body(body, None), 120)
    p_params = params_of(data)
    result["p_params_keys"] = sorted(p_params) if p_params else None
    result["p_seconds"] = round(p_seconds, 3)
    result["d_stream_pd"] = _sse(d_url + "/v1/completions", decode_body(body, p_params))
    plain = dict(body, prompt=[rng.randrange(1000, 100000) for _ in range(300)])
    result["d_stream_plain"] = _sse(d_url + "/v1/completions", plain)
    text = json.dumps(result, indent=1)
    print(text)
    with open(out, "w") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
