#!/usr/bin/python3
"""A small real HTTP server standing in for vLLM (and the router) on test hosts: /health and /v1/models.

Started by the rendered launch script as `$VENV/bin/python -m vllm... --port N` or `$VENV/bin/bpdkv router --config F`.
FAKE_VERSION (env) is reported in /version; FAKE_HEALTH=fail makes /health answer 503 (a failed health gate).
"""

import json
import os
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
port = None
if "--port" in args:
    port = int(args[args.index("--port") + 1])
elif "--config" in args:
    text = open(args[args.index("--config") + 1]).read()
    port = int(re.search(r"^port: (\d+)", text, re.M).group(1))
if port is None:
    sys.exit("fake_vllm: no --port")


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path == "/health":
            code = 503 if os.environ.get("FAKE_HEALTH") == "fail" else 200
            body = b"{}"
        elif self.path == "/v1/models":
            code, body = 200, json.dumps({"object": "list", "data": [{"id": "fake"}]}).encode()
        elif self.path == "/version":
            code, body = 200, os.environ.get("FAKE_VERSION", "none").encode()
        else:
            code, body = 404, b"{}"
        self.send_response(code)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


print(f"fake_vllm listening on {port} args={args}", flush=True)
ThreadingHTTPServer(("0.0.0.0", port), Handler).serve_forever()
