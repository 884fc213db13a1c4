"""Does CUDA IPC work between two processes on ONE GPU here, and how fast does a copy out of the other process's memory go?

  python3 cuda_ipc_copy.py [--mib N]

The parent allocates N MiB on cuda:0 and hands it to a spawned child through torch.multiprocessing (CUDA IPC handles:
cudaIpcGetMemHandle / cudaIpcOpenMemHandle); the child checks the values and times a device-to-device copy of it into
its own buffer (best of 5). One JSON line. This is the ceiling a same-device cuda_ipc transport could reach.
"""

from __future__ import annotations

import argparse
import json
import time


def child(queue, done) -> None:  # type: ignore[no-untyped-def]
    import torch

    try:
        shared = queue.get(timeout=60)
        mine = torch.empty_like(shared)
        ok = bool((shared[:: 1024 * 1024] == 7).all().item())
        times = []
        for _ in range(6):
            torch.cuda.synchronize()
            start = time.perf_counter()
            mine.copy_(shared)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        best = min(times[1:])
        n = shared.numel()
        done.put({"ipc_open": True, "data_ok": ok, "bytes": n, "seconds_best": round(best, 6), "GB_per_s": round(n / best / 1e9, 1)})
    except Exception as exc:  # noqa: BLE001 - reported, not raised: the question is whether it works
        done.put({"ipc_open": False, "error": f"{type(exc).__name__}: {exc}"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=1024)
    args = ap.parse_args()
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    buf = torch.full((args.mib * 1024 * 1024,), 7, dtype=torch.uint8, device="cuda:0")
    proc = ctx.Process(target=child, args=(queue, done))
    proc.start()
    queue.put(buf)
    try:
        result = done.get(timeout=90)
    except Exception as exc:  # noqa: BLE001
        result = {"ipc_open": False, "error": f"no answer from the child: {exc}"}
    proc.join(timeout=10)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
