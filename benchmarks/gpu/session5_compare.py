"""Session 5's comparisons from the `bpdkv bench` JSON files it wrote, printed as JSON.

    python benchmarks/gpu/session5_compare.py benchmarks/results/gpu-h200x2/session5

(b)/(c): reuse on vs off, both 10 minutes on fresh servers (session4_compare's measures, the same code).
(a): P cache off, reuse on vs off on fresh servers, TTFT at turns >= 2, and P's pull stages on the reuse-on run.
(d): the per-stage floor of a turn >= 2 on the reuse-on run, from P's and D's counters (see turn2_floor: vLLM's
     histograms are per run, so turn 1's whole-prompt pulls on D have to be taken out by token accounting).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from session4_compare import D, P, run, stats, sustained, ttfts  # noqa: E402

from bpdkv.bench.runner import metric_value  # noqa: E402

BLOCK = 128  # session5.sh: --block-size of P and D
PREFILL_TOKENS_PER_S = 8700  # P's prefill rate at ~9k tokens of context (session 5's estimate; not measured per request)


def turn2_floor(folder: Path, name: str, block: int = BLOCK, fence_ms: float = 0.4) -> dict:
    """Floor of a turn >= 2 = P's pull + P's new tokens + fence + D's pull + D's first step, each as that turn sees it.

    Why not the stage means: D's pull histogram mixes turn 1, where D pulls the whole ~7k-token prompt, with turns >= 2,
    where D's prefix cache holds the history and it pulls at most the last block (session 5's README used the mean,
    44 ms, and so overstated the floor). Token accounting per turn >= 2 (n of them): P pulls X = P's external tokens / n
    (all of P's pulls are turns >= 2); D hits h = D's cached tokens / n; D pulls e in [0, BLOCK) of the same prompt, so
    P computes N = h + e - X new tokens. D's one-block pull is priced at P's measured seconds per pulled token.
    `python session5_compare.py FOLDER RUN BLOCK FENCE_MS` prints it for another run (session 4: d2-b128 128 0)."""
    on = run(folder, name)
    p_text = (folder / f"{name}.prefill-metrics.txt").read_text()
    d_text = (folder / f"{name}.decode-metrics.txt").read_text()
    n = sum(1 for s in on["samples"] if s["turn"] > 0)
    src = "vllm:prompt_tokens_by_source_total"
    x = metric_value(p_text, src, {"source": "external_kv_transfer"}) / n
    h = metric_value(d_text, src, {"source": "local_cache_hit"}) / n
    ps, ds = on["stages"][P], on["stages"][D]
    p_pull = ps["pull_ms"] + ps["pull_post_ms"]
    fence = fence_ms  # session 5's (a): P's mean wait for a pin answer (fence-check-on-end.txt); session 4 had no fence
    first_step = ds["itl_ms"]
    new = (h - x, h - x + block - 1)
    d_pull = (0.0, p_pull / x * block)
    low = p_pull + new[0] / PREFILL_TOKENS_PER_S * 1000 + fence + d_pull[0] + first_step
    high = p_pull + new[1] / PREFILL_TOKENS_PER_S * 1000 + fence + d_pull[1] + first_step
    ttft = stats(ttfts(on))["mean"]
    return {
        "turns": n,
        "p_pull_tokens": round(x, 1),
        "p_pull_ms": round(p_pull, 1),
        "p_new_tokens": [round(v) for v in new],
        "d_cached_tokens": round(h, 1),
        "d_pull_ms": [round(v, 1) for v in d_pull],
        "fence_ms": fence,
        "d_first_step_ms": round(first_step, 1),
        "floor_ms": [round(low, 1), round(high, 1)],
        "ttft_mean_ms": ttft,
        "ttft_over_floor": [round(ttft / high, 2), round(ttft / low, 2)],
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
