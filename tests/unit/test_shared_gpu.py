"""The shared-GPU layout (issue 34 item 3): P and D on one device. Memory shares validated (one line per instance, at
its document path), --gpu-memory-utilization / --kv-cache-memory-bytes rendered, and UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y in
the environment of the engines that share a GPU (UCX 1.23 turns cuda_ipc get-zcopy off without NVLink: NIXL's READ
between two processes of one GPU then goes over TCP on loopback)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bpdkv.errors import InvalidTopology
from bpdkv.render import render_topology
from bpdkv.topology.validate import load_topology
from tests.conftest import ROOT

EXAMPLE = ROOT / "examples" / "h200-shared-qwen3-8b.yaml"


def write(tmp_path: Path, instances: list[dict], **node: object) -> Path:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["nodes"][0]["instances"] = instances + [{"role": "router", "port": 8000}]
    doc["nodes"][0].update(node)
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def lines(path: Path) -> list[str]:
    with pytest.raises(InvalidTopology) as info:
        load_topology(path)
    return info.value.lines()


def files(path: Path) -> dict[str, str]:
    return {a.path: a.content for a in render_topology(load_topology(path).topology)}


def test_the_example_renders_shares_and_the_ucx_setting() -> None:
    out = files(EXAMPLE)
    for name in ("prefill-0", "decode-0"):
        script = next(v for k, v in out.items() if k.endswith(f"/{name}.sh"))
        assert "--gpu-memory-utilization 0.45 \\" in script
        env = next(v for k, v in out.items() if k.endswith(f"/{name}.env"))
        assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in env.splitlines() and "CUDA_VISIBLE_DEVICES=0" in env.splitlines()
    router_env = next(v for k, v in out.items() if k.endswith("/router-0.env"))
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in router_env


def test_separate_gpus_render_neither() -> None:
    out = files(ROOT / "examples" / "h200x2-qwen3-8b.yaml")
    assert not any("UCX_CUDA_IPC_ENABLE_GET_ZCOPY" in v or "--gpu-memory-utilization" in v for v in out.values())


def test_kv_cache_size_and_an_explicit_env_value_win(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        [
            {"role": "prefill", "gpus": [0], "gpu_memory_share": 0.3, "kv_cache_memory_gib": 8, "port": 8100},
            {"role": "decode", "gpus": [0], "gpu_memory_share": 0.6, "port": 8200, "env": {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n"}},
        ],
    )
    out = files(path)
    p = next(v for k, v in out.items() if k.endswith("/prefill-0.sh"))
    assert "--gpu-memory-utilization 0.3 \\" in p and f"--kv-cache-memory-bytes {8 << 30} \\" in p
    d_env = next(v for k, v in out.items() if k.endswith("/decode-0.env"))
    assert "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n" in d_env.splitlines()  # the operator's own value


def test_shares_that_add_up_to_too_much_one_line_each(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        [
            {"role": "prefill", "gpus": [0], "gpu_memory_share": 0.5, "port": 8100},
            {"role": "decode", "gpus": [0], "gpu_memory_share": 0.5, "port": 8200},
        ],
    )
    got = [line for line in lines(path) if "gpu_memory_share" in line]
    assert len(got) == 2, got
    assert "nodes[0].instances[0].gpu_memory_share" in got[0] and "nodes[0].instances[1].gpu_memory_share" in got[1]
    assert all("prefill-0 0.5 + decode-0 0.5 = 1, more than 0.95" in line for line in got), got


def test_a_shared_gpu_needs_every_share_and_not_twice(tmp_path: Path) -> None:
    path = write(
        tmp_path, [{"role": "prefill", "gpus": [0], "port": 8100}, {"role": "decode", "gpus": [0], "gpu_memory_share": 0.4, "port": 8200}]
    )
    (line,) = [x for x in lines(path) if "also used" in x]
    assert "nodes[0].instances[1].gpus[0]" in line and "give both gpu_memory_share" in line
    path = write(
        tmp_path,
        [
            {"role": "prefill", "gpus": [0], "gpu_memory_share": 0.4, "port": 8100, "extra_args": ["--gpu-memory-utilization=0.4"]},
            {"role": "decode", "gpus": [0], "gpu_memory_share": 0.4, "port": 8200},
        ],
    )
    (line,) = lines(path)
    assert "nodes[0].instances[0].gpu_memory_share" in line and "--gpu-memory-utilization in extra_args both set it" in line
    for bad in (0, 1.2):
        path = write(
            tmp_path,
            [{"role": "prefill", "gpus": [0], "gpu_memory_share": bad, "port": 8100}, {"role": "decode", "gpus": [0], "port": 8200}],
        )
        assert any("nodes[0].instances[0].gpu_memory_share" in x for x in lines(path))


# ---- a simultaneous start (issue 41 item 5) -------------------------------------------------------------------------
def test_engines_on_one_gpu_start_one_after_the_other(tmp_path: Path) -> None:
    shared = files(write(tmp_path, [{"role": "prefill", "gpus": [0], "gpu_memory_share": 0.45, "port": 8100},
                                    {"role": "decode", "gpus": [0], "gpu_memory_share": 0.45, "port": 8200}]))  # fmt: skip
    assert "After=bpdkv-prefill-0.service" in shared["/etc/systemd/system/bpdkv-decode-0.service"]
    assert "http://127.0.0.1:8100/health" in shared["/opt/bpdkv/bin/decode-0.sh"]
    assert "After=bpdkv-" not in shared["/etc/systemd/system/bpdkv-prefill-0.service"]
    assert "/health" not in shared["/opt/bpdkv/bin/prefill-0.sh"]
    apart = files(write(tmp_path, [{"role": "prefill", "gpus": [0], "port": 8100}, {"role": "decode", "gpus": [1], "port": 8200}], gpus=2))
    assert "After=bpdkv-" not in apart["/etc/systemd/system/bpdkv-decode-0.service"]
    assert "/health" not in apart["/opt/bpdkv/bin/decode-0.sh"]


def test_the_later_engine_execs_only_once_the_earlier_one_serves(tmp_path: Path) -> None:
    """Both units started at the same moment (as systemd does at boot): the rendered launch script of the engine listed
    second runs, for real, and reaches its exec only after the first one answers /health."""
    import http.server
    import socket
    import subprocess
    import sys
    import threading
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rendered = files(write(tmp_path, [{"role": "prefill", "gpus": [0], "gpu_memory_share": 0.45, "port": port},
                                      {"role": "decode", "gpus": [0], "gpu_memory_share": 0.45, "port": 8200}]))  # fmt: skip
    script = rendered["/opt/bpdkv/bin/decode-0.sh"]
    env = tmp_path / "decode-0.env"
    env.write_text("")
    marker = tmp_path / "started"
    script = script.replace("/etc/bpdkv/decode-0.env", str(env)).replace("/opt/bpdkv/venv/bin/python", sys.executable)
    script = script[: script.index("exec ")] + f"exec touch {marker}\n"
    path = tmp_path / "decode-0.sh"
    path.write_text(script)
    proc = subprocess.Popen(["sh", str(path)])
    server = None
    try:
        time.sleep(4)  # P is not serving yet: D waits, whatever the machine's load
        assert proc.poll() is None and not marker.exists()

        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        server = http.server.HTTPServer(("127.0.0.1", port), Health)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        assert proc.wait(timeout=60) == 0 and marker.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
        if server is not None:
            server.shutdown()
