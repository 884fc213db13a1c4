"""Session 4's comparisons from the `bpdkv bench` JSON files it wrote, printed as JSON.

    python benchmarks/gpu/session4_compare.py benchmarks/results/gpu-h200x2/session4

(b)/(c): reuse on (10 min) vs off (4 min), TTFT at turns >= 2 over each whole run and over the time window both runs
covered (requests started in [0, the shorter run's length)), per 30-s window p99, D's waiting by reason.
(d): per pair of runs, TTFT at turns >= 2 and the per-stage means from P's and D's vLLM histograms (turns >= 2 only
for the pulls: turn 1 pulls nothing on P).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

P, D = "http://127.0.0.1:8100", "http://127.0.0.1:8200"


def stats(values: list[float]) -> dict[str, float | int]:
    ordered = sorted(values)
    n = len(ordered)
    if not n:
        return {"n": 0}

    def pct(q: float) -> float:
        return round(1000 * ordered[min(n - 1, int(q * n))], 1)

    return {
        "n": n,
        "mean": round(1000 * statistics.fmean(ordered), 1),
        "p50": round(1000 * statistics.median(ordered), 1),
        "p90": pct(0.9),
        "p99": pct(0.99),
    }


def run(folder: Path, name: str) -> dict[str, Any]:
    return json.loads((folder / f"{name}.json").read_text())["runs"][0]  # type: ignore[no-any-return]


def ttfts(summary: dict[str, Any], start: float = 0.0, end: float = float("inf")) -> list[float]:
    return [
        s["ttft"] for s in summary["samples"] if s["turn"] >= 1 and not s["error"] and s["ttft"] is not None and start <= s["started"] < end
    ]


def ratio(on: dict[str, Any], off: dict[str, Any]) -> dict[str, float | None]:
    def r(key: str) -> float | None:
        return round(off[key] / on[key], 2) if on.get(key) and off.get(key) else None

    return {
        "mean_off_over_on": r("mean"),
        "p50_off_over_on": r("p50"),
        "p99_on_over_off": round(on["p99"] / off["p99"], 2) if on.get("p99") else None,
    }


def sustained(folder: Path) -> dict[str, Any]:
    on, off = run(folder, "bc-on"), run(folder, "bc-off")
    common = min(on["wall_s"], off["wall_s"])
    whole = {"on": stats(ttfts(on)), "off": stats(ttfts(off))}
    window = {"on": stats(ttfts(on, 0, common)), "off": stats(ttfts(off, 0, common))}
    windows = []
    for start in range(0, int(common) - 29, 30):  # whole 30-s windows both runs covered
        a, b = stats(ttfts(on, start, start + 30)), stats(ttfts(off, start, start + 30))
        windows.append({"t": start, "on_p99": a.get("p99"), "off_p99": b.get("p99"), "on_n": a["n"], "off_n": b["n"]})
    return {
        "whole_runs": {
            **whole,
            "wall_s": {"on": round(on["wall_s"], 1), "off": round(off["wall_s"], 1)},
            **ratio(whole["on"], whole["off"]),
        },
        "same_window": {"until_s": round(common, 1), **window, **ratio(window["on"], window["off"])},
        "windows_30s": windows,
        "windows_on_p99_worse": sum(1 for w in windows if w["on_p99"] and w["off_p99"] and w["on_p99"] > w["off_p99"]),
        "d_waits": {"on": on["d_waits"], "off": off["d_waits"]},
        "d_kv_usage_max": {m: max(p["kv_usage"] for p in r["d_timeline"]) for m, r in (("on", on), ("off", off))},
        "d_held_share_max": {m: max(p["held_share"] for p in r["d_timeline"]) for m, r in (("on", on), ("off", off))},
        "p_tokens": {
            m: {k: r["servers"][P][k] for k in ("local_compute_tokens", "local_cache_hit_tokens", "external_tokens")}
            for m, r in (("on", on), ("off", off))
        },
        "d_releases": {
            m: {k: v for k, v in r["servers"][D].items() if k.startswith("hold_released") or k == "nixl_expired"}
            for m, r in (("on", on), ("off", off))
        },
    }


def stage_pair(folder: Path, change: str, base: str) -> dict[str, Any]:
    out = {}
    for name in (change, base):
        r = run(folder, name)
        spec = r["spec"]
        turns_ge_2 = spec["conversations"] * (spec["turns"] - 1)
        p, d = r["stages"][P], r["stages"][D]
        # P computed every turn-1 prompt in full; the rest of its computed tokens are the new tokens of turns >= 2.
        first = spec["system_tokens"] + spec["start_history_tokens"] + spec["new_tokens"]
        new_tokens = (r["servers"][P]["local_compute_tokens"] - spec["conversations"] * first) / turns_ge_2
        out[name] = {
            "ttft_turns_ge_2": stats(ttfts(r)),
            "p_pull_ms": p["pull_ms"],
            "p_pull_post_ms": p["pull_post_ms"],
            "p_pull_mb": p["pull_mb"],
            "p_pull_descriptors": p["pull_descriptors"],
            "p_new_tokens_per_turn": round(new_tokens, 1),
            "d_pull_ms": d["pull_ms"],
            "d_pull_post_ms": d["pull_post_ms"],
            "d_first_step_ms (mean ITL)": d["itl_ms"],
            "d_queue_ms": d["queue_ms"],
            "d_server_ttft_ms": d["server_ttft_ms"],
        }
    a, b = out[change]["ttft_turns_ge_2"], out[base]["ttft_turns_ge_2"]
    out["mean_base_over_change"] = round(b["mean"] / a["mean"], 3)
    return out


def main() -> None:
    folder = Path(sys.argv[1])
    print(
        json.dumps(
            {
                "b_c_sustained": sustained(folder),
                "d_cross_layer_blocks_vs_default": stage_pair(folder, "d-xlayer", "d-base"),
                "d_block256_vs_block128": stage_pair(folder, "d2-b256", "d2-b128"),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
