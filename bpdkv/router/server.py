"""Run the router (the `bpdkv router` command): one uvicorn process, or a supervisor with N worker processes.

Workers each bind the port with SO_REUSEPORT (the kernel spreads connections over them) and share sessions through
Redis. Without an external Redis, render points `state` at a redis-server the supervisor starts itself from
`local_redis_conf` (the distribution's package, installed by apply), before the workers and stopped after them: one
systemd unit, one lifecycle. A worker that dies takes the supervisor down with a non-zero exit, so systemd restarts
the whole router instead of it serving on fewer cores unnoticed. The supervisor also owns the workers' shared
metrics directory (see metrics.py): created before them, removed after them.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import uvicorn

from bpdkv.router.config import RouterConfig, RouterConfigError, config_from_dict, config_problems, config_to_dict
from bpdkv.router.metrics import MULTIPROC_DIR_ENV
from bpdkv.router.workers import usable_cores

log = logging.getLogger("bpdkv.router")
WORKER_CONFIG_ENV = "BPDKV_ROUTER_WORKER_CONFIG"
STOP_GRACE = 35.0  # uvicorn's graceful shutdown (30 s) plus a margin
GC_YOUNG_THRESHOLD = 2_000
HUP_IGNORED = (
    "SIGHUP ignored: the router re-reads its upstreams and generations from its config file by itself (other settings need a restart)"
)


def _ignore_hup() -> None:
    """A stray SIGHUP (systemd `reload`, a closed terminal, a signal to the process group) would end the process by
    default: every stream in flight cut, drained upstreams forgotten. The router re-reads nothing; it says so."""

    def hup(*_: Any) -> None:
        log.warning(HUP_IGNORED)

    signal.signal(signal.SIGHUP, hup)


def _logging(log_level: str) -> None:
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve(config: RouterConfig, log_level: str = "info") -> None:
    _logging(log_level)
    problems = config_problems(config)
    if problems:
        raise RouterConfigError("; ".join(problems))
    workers = config.worker_count()
    if workers == 1 and (config.workers == "auto" or not config.local_redis_conf):
        if config.local_redis_conf:
            # `workers: auto` came to one process on this node: its own redis-server would only cost every turn
            # its round trips (measured: a quarter of the throughput at 256 streams on 2 cores); sessions stay in memory.
            log.info(
                "router: one process (workers: %s on %d cores): sessions in memory, no local redis-server", config.workers, usable_cores()
            )
            config = dataclasses.replace(config, state="memory", local_redis_conf=None)
        serve_one(config, log_level)
        return
    sys.exit(supervise(config, workers, log_level))


def _reuse_port_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.set_inheritable(True)
    return sock


def serve_one(config: RouterConfig, log_level: str, reuse_port: bool = False) -> None:
    from bpdkv.router.app import Router
    from bpdkv.router.intake import http_protocol
    from bpdkv.router.security import ReloadingTLS, uvicorn_tls

    # A router process allocates a few hundred short-lived containers per request: with Python's default threshold
    # (700) the young generation is collected about once a request and the older ones every few hundred. But a young
    # collection's pause grows with the threshold (it walks every young object still alive, in-flight requests'
    # included): measured at 64 streams, 10000 paused the loop 4-9 ms every ~2 s, and the requests waiting on P or
    # D's first byte then were most of the TTFT p99; 2000 paused ~1 ms. (Those collections mostly walked one reference
    # cycle per request, since broken in DisconnectWatch.stop: now a young collection runs about every 1.5 s at 64
    # streams and pauses under 1.5 ms.)
    gc.set_threshold(GC_YOUNG_THRESHOLD, 20, 20)
    _ignore_hup()
    router = Router(config)
    app: Any = router.app
    if reuse_port:  # a worker: admin drains and requests in flight are shared with the other workers
        sync = _worker_sync(config, router)
        if sync is not None:
            app = WorkerApp(router.app, sync)
    uv_config = uvicorn.Config(
        app,
        host=config.listen,
        port=config.port,
        log_level=log_level,
        access_log=False,  # request lines can carry session ids; metrics cover traffic
        timeout_graceful_shutdown=30,
        backlog=4096,
        # Named, not "auto": the relay writes D's bytes to httptools-protocol transports (relay._direct_cycle), and
        # uvloop runs the loop; a missing one is an install error, not a silent slow path.
        loop="uvloop",
        # httptools' protocol with a header-read timeout (slow clients get 408 and are closed) and a head size limit (431):
        # router/intake.py.
        http=http_protocol(config.client_timeouts.header, config.max_header_bytes),
    )
    if config.tls_cert_file and config.tls_key_file:
        uvicorn_tls(uv_config, ReloadingTLS(config.tls_cert_file, config.tls_key_file))
    server = uvicorn.Server(uv_config)
    if reuse_port:
        server.run(sockets=[_reuse_port_socket(config.listen, config.port)])
    else:
        server.run()


def _worker_sync(config: RouterConfig, router: Any) -> Any:
    from bpdkv.router.resp import RespClient
    from bpdkv.router.security import redis_options
    from bpdkv.router.workers import WorkerSync

    if not config.state.startswith(("redis://", "rediss://", "redis+sentinel://", "rediss+sentinel://", "unix://")):
        return None
    redis = RespClient(config.state, 1.0, **redis_options(config.state_password_file, config.state_ca_file))
    return WorkerSync.from_env(redis, [router.prefill, router.decode], router._session, config.health.check_timeout)


class WorkerApp:
    """One worker's ASGI app: the router's, with its admin calls made across all workers (bpdkv.router.workers).

    The router handles each admin call as it would alone (auth, names, the local change, the undrain's health
    check); on its 200 the change is shared and the answer rebuilt from every live worker's view. Every other
    request goes straight to the router."""

    ADMIN = "/admin/upstreams"

    def __init__(self, app: Any, sync: Any) -> None:
        self.app, self.sync = app, sync

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, self._lifespan_send(send))
            return
        if scope["type"] != "http" or not scope.get("path", "").startswith(self.ADMIN):
            await self.app(scope, receive, send)
            return
        captured: dict[str, Any] = {"status": 0, "headers": [], "body": b""}

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                captured["status"], captured["headers"] = message["status"], message.get("headers", [])
            elif message["type"] == "http.response.body":
                captured["body"] += message.get("body", b"")

        await self.app(scope, receive, capture)
        status, body = captured["status"], captured["body"]
        if status == 200:
            status, body = await self._shared(scope, body)
        headers = [(k, v) for k, v in captured["headers"] if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _shared(self, scope: dict[str, Any], body: bytes) -> tuple[int, bytes]:
        from bpdkv.router.workers import SharedStateUnavailable

        members = self.sync.members()
        try:
            if scope["method"] == "POST":
                name = scope["path"][len(self.ADMIN) + 1 :].rsplit("/", 1)[0]
                member = next(m for m in members if m.name == name)
                await self.sync.changed(member)
                (view,) = await self.sync.describe([member])
                return 200, json.dumps(view).encode()
            # The worker's own answer (its loaded config's digest included), upstreams summed over every worker.
            return 200, json.dumps(dict(json.loads(body), upstreams=await self.sync.describe(members))).encode()
        except SharedStateUnavailable as exc:
            err = {"error": {"message": str(exc), "type": "router_error", "code": 503}}
            return 503, json.dumps(err).encode()

    def _lifespan_send(self, send: Any) -> Any:
        async def wrapped(message: dict[str, Any]) -> None:
            if message["type"] == "lifespan.startup.complete":
                self.sync.start()
            elif message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                await self.sync.stop()
            await send(message)

        return wrapped


def _start_local_redis(conf: str) -> subprocess.Popen[bytes]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(binary).exists():
        raise RouterConfigError(f"local_redis_conf {conf}: redis-server is not installed (apt-get install redis-server)")
    proc = subprocess.Popen([binary, conf], start_new_session=False)
    port = _conf_port(conf)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RouterConfigError(f"local redis-server ({conf}) exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.terminate()
    raise RouterConfigError(f"local redis-server ({conf}) not listening on 127.0.0.1:{port} after 20 s")


def _conf_port(conf: str) -> int:
    try:
        for line in Path(conf).read_text(encoding="utf-8").splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "port":
                return int(parts[1])
    except (OSError, ValueError) as exc:
        raise RouterConfigError(f"local_redis_conf {conf}: {exc}") from None
    return 6379


def supervise(config: RouterConfig, workers: int, log_level: str) -> int:
    """Start [redis-server,] N workers; return when one of them ends (its code) or on SIGTERM/SIGINT (0)."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # inherited through exec: no window before a worker logs its own
    redis_proc = _start_local_redis(config.local_redis_conf) if config.local_redis_conf else None
    from bpdkv.router.workers import RUN_ENV, WORKERS_ENV

    env = dict(os.environ, **{WORKER_CONFIG_ENV: json.dumps(config_to_dict(config))})
    env[RUN_ENV], env[WORKERS_ENV] = uuid.uuid4().hex, str(workers)  # the workers' shared admin state (workers.py)
    # One metrics directory per run (never a previous run's counters), shared by the workers so that /metrics on
    # any of them aggregates all; one worker keeps plain in-memory metrics.
    metrics_dir = tempfile.mkdtemp(prefix="bpdkv-router-metrics-") if workers > 1 else None
    if metrics_dir is not None:
        env[MULTIPROC_DIR_ENV] = metrics_dir
    else:
        env.pop(MULTIPROC_DIR_ENV, None)
    argv = [sys.executable, "-m", "bpdkv.router.server", log_level]
    children = [subprocess.Popen(argv, env=env) for _ in range(workers)]
    log.info("router supervisor: %d workers on %s:%d (pids %s)", workers, config.listen, config.port, [c.pid for c in children])
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    _ignore_hup()
    code = 0
    try:
        while not stopping:
            ended = [c for c in children if c.poll() is not None]
            if ended:
                _forget_worker_gauges(metrics_dir, ended)
                code = ended[0].returncode or 1
                log.error("router worker %d exited with %s; stopping the router", ended[0].pid, ended[0].returncode)
                break
            if redis_proc is not None and redis_proc.poll() is not None:
                code = 1
                log.error("local redis-server exited with %s; stopping the router", redis_proc.returncode)
                break
            time.sleep(0.2)
    finally:
        for child in children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(5)
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)
        if redis_proc is not None and redis_proc.poll() is None:
            redis_proc.terminate()
            try:
                redis_proc.wait(10)
            except subprocess.TimeoutExpired:
                redis_proc.kill()
                redis_proc.wait(5)
    return code


def _forget_worker_gauges(metrics_dir: str | None, ended: list[subprocess.Popen[bytes]]) -> None:
    """Drop the live gauges (in flight, outstanding, health) of exited workers, so scrapes during the
    shutdown that follows count only workers still serving."""
    if metrics_dir is None:
        return
    from prometheus_client.multiprocess import mark_process_dead

    for child in ended:
        mark_process_dead(child.pid, metrics_dir)


def worker_main(argv: list[str]) -> None:
    """One worker process (started by supervise, never by hand)."""
    log_level = argv[0] if argv else "info"
    _logging(log_level)
    raw = os.environ.get(WORKER_CONFIG_ENV)
    if not raw:
        sys.exit("bpdkv.router.server: started without a worker config; run `bpdkv router` instead")
    config = config_from_dict(json.loads(raw), "worker config", validate=False)
    serve_one(config, log_level, reuse_port=True)


if __name__ == "__main__":
    worker_main(sys.argv[1:])
