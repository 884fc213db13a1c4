"""A real nginx (the Debian package) in front of a `bpdkv router` process, with its default `proxy_pass` settings —
HTTP/1.0 to the upstream (`proxy_http_version 1.0`), no keep-alive: streamed and non-streamed answers through it are
the router's own, every event intact (issue 42: a chunked 1.0 stream put chunk-size lines inside the events)."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bpdkv.lab.ports import free_port
from bpdkv.testing.vllm_emulator import EmulatorSettings, ServerGroup, VllmEmulator
from tests.router.test_router_http_versions import CHAT, RouterProcess, chat_body, events, start_router, stop_process

NGINX_CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 256; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://127.0.0.1:{router_port};
            # what the router answered nginx's HTTP/1.0 request with (nginx itself takes chunked from any upstream)
            add_header x-upstream-framing "te=$upstream_http_transfer_encoding connection=$upstream_http_connection" always;
        }}
    }}
}}
"""


def _nginx() -> str:
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(binary).exists():
        pytest.fail("nginx missing: apt-get install -y nginx (.ci/install-test-deps.sh installs it)")
    return binary


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, RouterProcess]]:
    """(nginx's URL, the router behind it); both ended by PID, the emulators stopped."""
    tmp = tmp_path_factory.mktemp("nginx")
    group = ServerGroup([VllmEmulator(EmulatorSettings(role="prefill")).app, VllmEmulator(EmulatorSettings(role="decode")).app])
    urls = group.start()
    try:
        router_proc, router = start_router(tmp, urls[0], urls[1])
        try:
            port = free_port()
            conf = tmp / "nginx.conf"
            conf.write_text(NGINX_CONF.format(tmp=tmp, port=port, router_port=router.port))
            # -e: the error log before the config is read (else the package's /var/log/nginx/error.log)
            nginx = subprocess.Popen(
                [_nginx(), "-p", str(tmp), "-e", str(tmp / "error.log"), "-c", str(conf)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.STDOUT,
            )
            try:
                url = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + 20
                while True:
                    try:
                        if httpx.get(url + "/health", timeout=1).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    assert time.monotonic() < deadline and nginx.poll() is None, (tmp / "error.log").read_text()
                    time.sleep(0.1)
                yield url, router
                assert nginx.poll() is None
            finally:
                if nginx.poll() is None:
                    nginx.send_signal(signal.SIGQUIT)  # graceful: finishes what it is sending, then exits
                try:
                    nginx.wait(10)
                except subprocess.TimeoutExpired:
                    nginx.kill()
                    nginx.wait(5)
            assert router_proc.poll() is None
            assert "Traceback" not in router.log.read_text()
        finally:
            stop_process(router_proc)
    finally:
        group.stop()


def _stream(url: str, max_tokens: int) -> tuple[httpx.Headers, bytes]:
    with httpx.stream("POST", url + CHAT, json=chat_body(stream=True, max_tokens=max_tokens), timeout=30) as resp:
        assert resp.status_code == 200, resp.read()
        return resp.headers, resp.read()


@pytest.mark.parametrize("max_tokens", [1, 8, 200])
def test_a_stream_through_nginx_is_the_routers_own(proxied: tuple[str, RouterProcess], max_tokens: int) -> None:
    url, router = proxied
    headers, through = _stream(url, max_tokens)
    assert headers["content-type"].startswith("text/event-stream")
    # The router answered nginx's HTTP/1.0 request close-delimited: no chunked coding, which 1.0 does not have.
    assert headers["x-upstream-framing"] == "te= connection=close"
    _, direct = _stream(router.url, max_tokens)
    # Every event whole (no chunk-size line inside one), and the same events as the router sends a client directly.
    assert events(through) == events(direct)
    assert len(events(through)) == max_tokens + 2


def test_a_non_streamed_answer_through_nginx_is_the_routers_own(proxied: tuple[str, RouterProcess]) -> None:
    url, router = proxied
    body = chat_body(stream=False, max_tokens=30)
    through = httpx.post(url + CHAT, json=body, timeout=30)
    direct = httpx.post(router.url + CHAT, json=body, timeout=30)
    assert through.status_code == direct.status_code == 200
    assert through.headers["content-length"] == str(len(through.content))
    assert through.headers["x-upstream-framing"] == "te= connection=close"
    one, other = json.loads(through.content), json.loads(direct.content)
    for answer in (one, other):
        answer.pop("id"), answer.pop("created")
    assert one == other and one["choices"][0]["message"]["content"]


def test_a_refusal_passes_through_nginx(proxied: tuple[str, RouterProcess]) -> None:
    """nginx always sends Host upstream; a body the router refuses comes back as the router's 400, not a 502."""
    url, _ = proxied
    resp = httpx.post(url + CHAT, content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["message"]
