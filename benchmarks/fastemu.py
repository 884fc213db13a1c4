"""Benchmark-only emulated P and D (a test double): a minimal asyncio HTTP/1.1 server, cheap enough that a
2-core machine measures the router, not the emulator. D streams N tokens: the first after FIRST ms, then one
every INTERVAL ms, driven by one shared 1 ms ticker (so timing is exact to 1 ms for every stream). Speaks the P/D kv_transfer_params protocol subset a router uses.

Run: python benchmarks/fastemu.py --port-p 0 --port-d 0  (prints {"prefill": url, "decode": url} and serves)
Several processes can serve the same two ports (`--reuse-port`, fixed ports): the kernel spreads connections over
them, so the emulator is not the bottleneck of a many-core run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import time
import uuid

from bpdkv import contracts as c

P_PARAMS = {
    c.DO_REMOTE_PREFILL: True,
    c.DO_REMOTE_DECODE: False,
    c.REMOTE_BLOCK_IDS: [0, 1],
    c.REMOTE_ENGINE_ID: "p-emu",
    c.REMOTE_REQUEST_ID: "",
    c.REMOTE_HOST: "127.0.0.1",
    c.REMOTE_PORT: 1,
    "tp_size": 1,
    c.REMOTE_NUM_TOKENS: 32,
}


class Streams:
    def __init__(self, tokens: int, first: float, interval: float, tick: float) -> None:
        self.tokens, self.first, self.interval, self.tick = tokens, first, interval, tick
        self.active: list[list] = []  # [writer, start_time, sent, done_future, chat, params]
        # The emulator shares the cores with what it measures: a token's chunk is encoded once, not per stream.
        self.middle = {chat: self._chunk(chat, None, None) for chat in (False, True)}

    @staticmethod
    def _chunk(chat: bool, finish: str | None, params: dict | None) -> bytes:
        choice = (
            {"index": 0, "delta": {"content": "tok "}, "finish_reason": finish}
            if chat
            else {"index": 0, "text": "tok ", "finish_reason": finish}
        )
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [choice]}
        if params is not None:
            chunk[c.KV_TRANSFER_PARAMS] = params
        data = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        if finish:
            data += b"data: [DONE]\n\n"
        return b"%x\r\n%s\r\n" % (len(data), data)

    async def ticker(self) -> None:
        while True:
            await asyncio.sleep(self.tick)  # token times are quantised to the tick (1 ms by default)
            now = time.perf_counter()
            keep = []
            for s in self.active:
                writer, start, sent, done, chat, params = s
                due = 0 if now - start < self.first else 1 + int((now - start - self.first) / self.interval)
                due = min(due, self.tokens)
                out = []
                while sent < due:
                    last = sent == self.tokens - 1  # every token but the last is the same bytes
                    out.append(self._chunk(chat, "length", params) if last else self.middle[chat])
                    sent += 1
                s[2] = sent
                if writer.is_closing():
                    done.set_result(None)
                    continue
                if out:
                    writer.write(b"".join(out))
                if sent >= self.tokens:
                    writer.write(b"0\r\n\r\n")
                    done.set_result(None)
                else:
                    keep.append(s)
            self.active = keep


async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, role: str, streams: Streams) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            method, path, _ = lines[0].split(b" ", 2)
            length = 0
            for line in lines[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            body = await reader.readexactly(length) if length else b""
            if method == b"GET":
                payload = b'{"status":"ok"}' if path == b"/health" else b'{"object":"list","data":[{"id":"m","object":"model"}]}'
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
                continue
            req = json.loads(body)
            chat = path.endswith(b"chat/completions")
            params = req.get(c.KV_TRANSFER_PARAMS) or {}
            if role == "prefill":
                out = dict(P_PARAMS, remote_request_id=uuid.uuid4().hex)
                resp = {
                    "id": "p",
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "t"}, "finish_reason": "length"}],
                    c.KV_TRANSFER_PARAMS: out,
                }
                payload = json.dumps(resp).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(payload), payload))
                continue
            d_params = None
            if params.get(c.DO_REMOTE_PREFILL):
                d_params = {
                    c.DO_REMOTE_PREFILL: False,
                    c.DO_REMOTE_DECODE: True,
                    c.REMOTE_BLOCK_IDS: [0, 1, 2],
                    c.REMOTE_ENGINE_ID: "d-emu",
                    c.REMOTE_REQUEST_ID: uuid.uuid4().hex,
                    c.REMOTE_HOST: "127.0.0.1",
                    c.REMOTE_PORT: 2,
                    "tp_size": 1,
                    c.REMOTE_NUM_TOKENS: 95,
                    c.REMOTE_BLOCKS_EXPIRES_IN: 480,
                    "transfer_mode": "pull",
                }
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            done = asyncio.get_running_loop().create_future()
            streams.active.append([writer, time.perf_counter(), 0, done, chat, d_params])
            await done
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


async def main_async(args: argparse.Namespace) -> None:
    streams = Streams(args.tokens, args.first / 1000, args.interval / 1000, args.tick / 1000)
    ticker = asyncio.ensure_future(streams.ticker())
    reuse = args.reuse_port or None
    p = await asyncio.start_server(lambda r, w: handle(r, w, "prefill", streams), "127.0.0.1", args.port_p, backlog=4096, reuse_port=reuse)
    d = await asyncio.start_server(lambda r, w: handle(r, w, "decode", streams), "127.0.0.1", args.port_d, backlog=4096, reuse_port=reuse)
    urls = {"prefill": f"http://127.0.0.1:{p.sockets[0].getsockname()[1]}", "decode": f"http://127.0.0.1:{d.sockets[0].getsockname()[1]}"}
    print(json.dumps(urls), flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await asyncio.wait_for(stop.wait(), args.max_seconds)
    except asyncio.TimeoutError:
        pass
    ticker.cancel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port-p", type=int, default=0)
    ap.add_argument("--port-d", type=int, default=0)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--first", type=float, default=20.0, help="ms to first token")
    ap.add_argument("--interval", type=float, default=5.0, help="ms between tokens")
    ap.add_argument("--tick", type=float, default=1.0, help="ms resolution of token timing")
    ap.add_argument("--max-seconds", type=float, default=1800)
    ap.add_argument("--reuse-port", action="store_true", help="share fixed ports with other emulator processes (SO_REUSEPORT)")
    args = ap.parse_args()
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
