"""Session 5's comparisons from the `bpdkv bench` JSON files it wrote, printed as JSON.

    python benchmarks/gpu/session5_compare.py benchmarks/results/gpu-h200x2/session5

(b)/(c): reuse on vs off, both 10 minutes on fresh servers (session4_compare's measures, the same code).
(a): P cache off, reuse on vs off on fresh servers, TTFT at turns >= 2, and P's pull stages on the reuse-on run.
(d): the per-stage floor of a turn >= 2 on the reuse-on run, from P's and D's counters (see turn2_floor: vLLM's
     histograms are per run, so turn 1's whole-prompt pulls on D have to be taken out by token accounting).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from session4_compare import D, P, run, stats, sustained, ttfts  # noqa: E402

from bpdkv.bench.runner import metric_value  # noqa: E402

BLOCK = 128  # session5.sh: --block-size of P and D
# P's prefill rate: its turn-1 aggregate (10 concurrent 8,150-token prompts in ~9.3 s) — an estimate for a turn's few
# hundred new tokens, which a step bound by reading the weights may make slower (see the README).
PREFILL_TOKENS_PER_S = 8700


def _d_log_blocks(folder: Path, name: str, block_descriptors: float) -> float | None:
    """Blocks per D pull in the last interval vLLM logged (late turns only): a check of the accounting."""
    log_file = folder / f"{name}.decode.log"
    if not log_file.exists():
        return None
    found = re.findall(r"Avg number of descriptors=([0-9.]+)", log_file.read_text())
    return round(float(found[-1]) / block_descriptors, 2) if found else None


def turn2_floor(folder: Path, name: str, block: int = BLOCK, fence_ms: float = 0.4) -> dict:
    """Floor of a turn >= 2 = P's pull + P's new tokens + fence + D's pull + D's first step, as that turn sees them.

    Why not the stage means: vLLM's histograms are per run, and D's mixes turn 1, where D pulls the whole prompt, with
    turns >= 2, where it pulls only P's new tokens; and vLLM times D's small pulls until the end of the engine step
    they ran in (~31 ms for ~74 MB), which is waiting, not transfer. Token accounting (the bench sends token ids, so
    prompt lengths are exact; P's cache is salted, so P computes every turn-1 token and pulls only on turns >= 2):
      N, P's new tokens per turn >= 2 = (P's local-compute tokens - the turn-1 prompts) / n
      X, P's pulled tokens per turn >= 2 = P's external tokens / n
      D's turn-1 hits (prefixes the conversations share) = D's hits - n * X (D keeps what it held for P)
      e, D's pulled tokens per turn >= 2 = (D's external tokens - (the turn-1 prompts - D's turn-1 hits)) / n
    Both pulls are priced at P's measured rate (posting + transfer per token), P's new tokens at PREFILL_TOKENS_PER_S.
    `python session5_compare.py FOLDER RUN BLOCK FENCE_MS` prints it for another run (session 4: d2-b128 128 0)."""
    on = run(folder, name)
    p_text = (folder / f"{name}.prefill-metrics.txt").read_text()
    d_text = (folder / f"{name}.decode-metrics.txt").read_text()
    n = sum(1 for s in on["samples"] if s["turn"] > 0)
    first_prompts = sum(s["history_tokens"] for s in on["samples"] if s["turn"] == 0)
    src = "vllm:prompt_tokens_by_source_total"
    x = metric_value(p_text, src, {"source": "external_kv_transfer"}) / n
    new = (metric_value(p_text, src, {"source": "local_compute"}) - first_prompts) / n
    d_first_hits = metric_value(d_text, src, {"source": "local_cache_hit"}) - n * x
    e = (metric_value(d_text, src, {"source": "external_kv_transfer"}) - (first_prompts - d_first_hits)) / n
    ps, ds = on["stages"][P], on["stages"][D]
    p_pull = ps["pull_ms"] + ps["pull_post_ms"]
    per_token = p_pull / x
    fence = fence_ms  # session 5's (a): P's mean wait for a pin answer (fence-check-on-end.txt); session 4 had no fence
    stages = {
        "p_pull_ms": p_pull,
        "p_new_tokens_ms": new / PREFILL_TOKENS_PER_S * 1000,
        "fence_ms": fence,
        "d_pull_ms": e * per_token,
        "d_first_step_ms": ds["itl_ms"],
    }
    floor = sum(stages.values())
    ttft = stats(ttfts(on))["mean"]
    return {
        "turns": n,
        "p_pull_tokens": round(x, 1),
        "p_new_tokens": round(new, 1),
        "d_pull_tokens": round(e, 1),
        "d_turn1_shared_hits": round(d_first_hits),
        "d_pull_blocks_per_vllm_log": _d_log_blocks(folder, name, ps["pull_descriptors"] / (x / block)),
        "d_pull_ms_by_vllm": ds["pull_ms"] + ds["pull_post_ms"],
        **{k: round(v, 1) for k, v in stages.items()},
        "floor_ms": round(floor, 1),
        "ttft_mean_ms": ttft,
        "ttft_over_floor": round(ttft / floor, 2),
    }


def main() -> None:
    folder = Path(sys.argv[1])
    if len(sys.argv) == 5:
        print(json.dumps(turn2_floor(folder, sys.argv[2], int(sys.argv[3]), float(sys.argv[4])), indent=2))
        return
    on, off = run(folder, "a-on"), run(folder, "a-off")
    a_on, a_off = stats(ttfts(on)), stats(ttfts(off))
    print(
        json.dumps(
            {
                "b_c_sustained": sustained(folder),
                "a_p_cache_off": {
                    "on": a_on,
                    "off": a_off,
                    "mean_off_over_on": round(a_off["mean"] / a_on["mean"], 2),
                    "p50_off_over_on": round(a_off["p50"] / a_on["p50"], 2),
                    "history_tokens": [min(s["history_tokens"] for s in on["samples"]), max(s["history_tokens"] for s in on["samples"])],
                    "p_stages_on": on["stages"][P],
                },
                "d_turn2_floor": turn2_floor(folder, "a-on"),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
