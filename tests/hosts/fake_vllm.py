#!/usr/bin/python3
"""A small real HTTP server standing in for vLLM (and the router) on test hosts: /health and /v1/models.

Started by the rendered launch script as `$VENV/bin/python -m vllm... --port N` or `$VENV/bin/bpdkv router --config F`.
FAKE_VERSION (env) is reported in /version and as the text of POST /v1/completions and /v1/chat/completions (a
whole answer, after FAKE_DELAY seconds); FAKE_HEALTH=fail makes /health answer 503 (a failed health gate).
As the router it also answers the admin API (GET /admin/upstreams, POST .../drain|undrain) for the names in its
config, and appends each admin call to /var/log/fake-router-admin.log so tests can check the order of drains and
restarts. FAKE_ADMIN=fail (router env) makes every admin call answer 500.
"""

import json
import os
import re
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
port = None
upstreams = {}
if "--port" in args:
    port = int(args[args.index("--port") + 1])
elif "--config" in args:
    text = open(args[args.index("--config") + 1]).read()
    port = int(re.search(r"^port: (\d+)", text, re.M).group(1))
    role = None
    for line in text.splitlines():
        if line in ("prefill:", "decode:"):
            role = line[:-1]
        elif role and line.startswith("- name: "):
            upstreams[line[len("- name: ") :]] = {
                "name": line[len("- name: ") :],
                "role": role,
                "url": "",
                "state": "serving",
                "in_flight": 0,
            }
        elif not line.startswith(" "):
            role = None
if port is None:
    sys.exit("fake_vllm: no --port")


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path == "/health":
            code = 503 if os.environ.get("FAKE_HEALTH") == "fail" else 200
            body = b"{}"
        elif self.path == "/v1/models":
            code, body = 200, json.dumps({"object": "list", "data": [{"id": "fake"}]}).encode()
        elif self.path == "/admin/upstreams" and upstreams:
            code, body = self.admin(200, {"upstreams": list(upstreams.values())})
        elif self.path == "/version":
            code, body = 200, os.environ.get("FAKE_VERSION", "none").encode()
        else:
            code, body = 404, b"{}"
        self.send_response(code)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        if self.path in ("/v1/completions", "/v1/chat/completions") and not upstreams:
            return self.complete()
        match = re.fullmatch(r"/admin/upstreams/([^/]+)/(drain|undrain)", self.path)
        if not match or not upstreams:
            code, body = 404, b"{}"
        elif match.group(1) not in upstreams:
            code, body = self.admin(404, {"error": "unknown upstream"})
        else:
            upstreams[match.group(1)]["state"] = "drained" if match.group(2) == "drain" else "serving"
            code, body = self.admin(200, upstreams[match.group(1)])
            with open("/var/log/fake-router-admin.log", "a") as fh:
                fh.write(f"{match.group(2)} {match.group(1)}\n")
        self.send_response(code)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def complete(self):
        """A whole (non-streamed) completion naming this instance's FAKE_VERSION: enough for the real router's P→D turn
        (P answers without kv_transfer_params, so D is asked without them). FAKE_DELAY (seconds) keeps requests in flight."""
        request = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        time.sleep(float(os.environ.get("FAKE_DELAY", "0")))
        text = os.environ.get("FAKE_VERSION", "none")
        if self.path == "/v1/chat/completions":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        else:
            choice = {"index": 0, "text": text, "finish_reason": "length"}
        body = json.dumps(
            {
                "id": "cmpl-fake",
                "object": "chat.completion" if "chat" in self.path else "text_completion",
                "model": request.get("model", "fake"),
                "choices": [choice],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        ).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def admin(self, code, data):
        if os.environ.get("FAKE_ADMIN") == "fail":
            return 500, b'{"error": "injected"}'
        return code, json.dumps(data).encode()

    def log_message(self, *a):
        pass


server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
if "--config" in args:  # a router config naming a TLS pair: serve HTTPS like the real router
    cert, key = (re.search(rf"^{k}: (\S+)", text, re.M) for k in ("tls_cert_file", "tls_key_file"))
    if cert and key:
        import ssl

        tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        tls.load_cert_chain(cert.group(1), key.group(1))
        server.socket = tls.wrap_socket(server.socket, server_side=True)
print(f"fake_vllm listening on {port} args={args}", flush=True)
server.serve_forever()
