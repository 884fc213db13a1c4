"""The session store's reply path in isolation: bpdkv/router/resp.py's data_received with the pure-Python parser vs
hiredis.Reader, on one chat turn's replies (the TAKE_FIRST script's [index, entry, []], EXISTS's integer, SET's +OK),
each reply completing its command's future as in the router. Prints one JSON document: µs of CPU per turn, best of
`--repeat`, with replies arriving one turn per read and 16 turns per read (a busy pipelined connection).

    python benchmarks/resp_parse.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from bpdkv.router import resp


def turn_replies() -> bytes:
    entry = json.dumps(
        {
            "params": {"remote_block_ids": list(range(40)), "remote_engine_id": "d" * 36, "remote_host": "10.0.0.1", "tp_size": 1},
            "expires_at": 1.7e9,
            "history": "h" * 32,
            "decode": "decode-0",
        }
    ).encode()
    return b"*3\r\n:1\r\n$%d\r\n%s\r\n*0\r\n" % (len(entry), entry) + b":0\r\n" + b"+OK\r\n"


async def per_turn_us(protocol: type[resp._Protocol], batch: int, turns: int, repeat: int) -> float:
    loop = asyncio.get_running_loop()
    data = turn_replies() * batch
    best = float("inf")
    for _ in range(repeat):
        proto: Any = protocol(None, 10.0)  # type: ignore[arg-type]  # no owner: nothing fails here
        reads = turns // batch
        futures = [loop.create_future() for _ in range(reads * batch * 3)]
        proto.pending.extend((f, 0.0) for f in futures)
        start = time.process_time()
        for _ in range(reads):
            proto.data_received(data)
        best = min(best, time.process_time() - start)
        assert all(f.done() and not isinstance(f.result(), resp.RespError) for f in futures)
    return round(best / (reads * batch) * 1e6, 2)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"turn_reply_bytes": len(turn_replies())}
    parsers: list[tuple[str, type[resp._Protocol]]] = [("python", resp._Protocol)]
    if resp.hiredis is not None:
        parsers.append(("hiredis", resp._HiredisProtocol))
    for name, protocol in parsers:
        for batch in (1, 16):
            out[f"{name}_us_per_turn_{batch}_per_read"] = await per_turn_us(protocol, batch, args.turns, args.repeat)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=32000)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    out = asyncio.run(main_async(args))
    out["note"] = args.note
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
