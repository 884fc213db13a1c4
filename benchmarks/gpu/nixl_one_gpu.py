"""Plain NIXL read between two processes on ONE GPU (no vLLM): how fast does UCX move GPU memory when the reader and
the target share the device (P and D on one H200, issue 21 item 6)?

  python3 nixl_one_gpu.py target DIR [--mib N]             # allocates N MiB on cuda:0, registers it, waits for DIR/done
  python3 nixl_one_gpu.py reader DIR --label L [--mib N]   # reads the target's buffer: many 256 KiB pieces, then 1 piece

The reader prints one JSON line per layout: bytes, pieces, seconds per read (best of 3 after a warm-up), GB/s, and the
backend NIXL chose. The piece size is one K (or V) block of a Qwen3-8B layer at block size 128: 128 tokens x 8 KV heads x
128 dims x 2 bytes = 256 KiB, so the piece layout is the shape of vLLM's pull. Both sides exchange metadata through files
in DIR (a bounded wait: 120 s). Run the target first; each env variation (UCX_TLS, ...) needs a fresh pair.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time

PIECE = 256 * 1024
WAIT = 120.0


def _nixl():  # the nixl meta package forwards to nixl_cu13; import whichever is there
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl_cu13 import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def _wait_for(path: str) -> None:
    end = time.monotonic() + WAIT
    while not os.path.exists(path):
        if time.monotonic() > end:
            sys.exit(f"no {path} after {WAIT:.0f} s")
        time.sleep(0.05)


def _pieces(base: int, nbytes: int, piece: int) -> list[tuple[int, int, int]]:
    return [(base + off, piece, 0) for off in range(0, nbytes - piece + 1, piece)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["target", "reader"])
    ap.add_argument("dir")
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--label", default="default")
    ap.add_argument("--device", default="cuda:0", help="cuda:0, or cpu for a smoke test of the script itself (DRAM)")
    args = ap.parse_args()
    import torch

    nixl_agent, nixl_agent_config = _nixl()
    nbytes = args.mib * 1024 * 1024
    buf = torch.ones(nbytes, dtype=torch.uint8, device=args.device)
    mem = "DRAM" if args.device == "cpu" else "VRAM"
    sync = torch.cuda.synchronize if mem == "VRAM" else (lambda: None)
    agent = nixl_agent(f"{args.role}-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
    agent.register_memory([(buf.data_ptr(), nbytes, 0, "")], mem_type=mem)
    meta_path = os.path.join(args.dir, "target.meta")
    if args.role == "target":
        layouts = {
            "pieces": agent.get_serialized_descs(agent.get_xfer_descs(_pieces(buf.data_ptr(), nbytes, PIECE), mem_type=mem)),
            "one": agent.get_serialized_descs(agent.get_xfer_descs([(buf.data_ptr(), nbytes, 0)], mem_type=mem)),
        }
        tmp = meta_path + ".tmp"
        with open(tmp, "wb") as f:
            pickle.dump({"agent": agent.get_agent_metadata(), "layouts": layouts}, f)
        os.replace(tmp, meta_path)
        _wait_for(os.path.join(args.dir, "done"))
        return
    _wait_for(meta_path)
    with open(meta_path, "rb") as f:
        remote = pickle.load(f)
    name = agent.add_remote_agent(remote["agent"])
    buf.zero_()
    sync()
    local = {
        "pieces": agent.get_xfer_descs(_pieces(buf.data_ptr(), nbytes, PIECE), mem_type=mem),
        "one": agent.get_xfer_descs([(buf.data_ptr(), nbytes, 0)], mem_type=mem),
    }
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")}
    try:
        for layout in ("pieces", "one"):
            remote_descs = agent.deserialize_descs(remote["layouts"][layout])
            times = []
            backend = "?"
            for attempt in range(4):
                handle = agent.initialize_xfer("READ", local[layout], remote_descs, name, b"")
                start = time.perf_counter()
                state = agent.transfer(handle)
                end = time.monotonic() + WAIT
                while state == "PROC" and time.monotonic() < end:
                    state = agent.check_xfer_state(handle)
                seconds = time.perf_counter() - start
                if state != "DONE":
                    print(json.dumps({"label": args.label, "layout": layout, "error": state, "ucx_env": env}), flush=True)
                    break
                try:
                    backend = agent.query_xfer_backend(handle)
                except Exception as exc:  # noqa: BLE001 - diagnostic only
                    backend = f"? ({exc})"
                agent.release_xfer_handle(handle)
                if attempt:  # the first read warms up (handle, registration cache, endpoint)
                    times.append(seconds)
                if attempt == 0:
                    sync()
                    ok = bool((buf[:: 1024 * 1024] == 1).all().item())
                    buf.zero_()
                    sync()
            if times:
                best = min(times)
                n = nbytes // PIECE if layout == "pieces" else 1
                print(
                    json.dumps(
                        {
                            "label": args.label,
                            "layout": layout,
                            "bytes": nbytes,
                            "pieces": n,
                            "seconds_best": round(best, 5),
                            "seconds_all": [round(t, 5) for t in times],
                            "GB_per_s": round(nbytes / best / 1e9, 2),
                            "data_ok": ok,
                            "backend": str(backend),
                            "ucx_env": env,
                        }
                    ),
                    flush=True,
                )
    finally:
        with open(os.path.join(args.dir, "done"), "w"):
            pass


if __name__ == "__main__":
    main()
