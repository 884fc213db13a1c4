"""Tables (per turn, per history length), JSON, a PNG plot, and `compare` ratios."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bpdkv.bench.runner import RunResult


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _stats(values: list[float]) -> dict[str, float | None]:
    return {
        "n": len(values),
        "median": statistics.median(values) if values else None,
        "p90": _pct(values, 0.9),
        "mean": statistics.fmean(values) if values else None,
    }


def history_bucket(tokens: int, width: int = 2048) -> str:
    low = tokens // width * width
    return f"{low}-{low + width}"


def summarize(result: RunResult) -> dict[str, Any]:
    ok = [s for s in result.samples if not s.error and s.ttft is not None]
    by_turn: dict[int, list[float]] = {}
    by_hist: dict[str, list[float]] = {}
    for s in ok:
        by_turn.setdefault(s.turn, []).append(s.ttft or 0.0)
        by_hist.setdefault(history_bucket(s.history_tokens), []).append(s.ttft or 0.0)
    return {
        "label": result.label,
        "spec": result.spec.to_json(),
        "requests": len(result.samples),
        "errors": sum(1 for s in result.samples if s.error),
        "error_samples": sorted({s.error for s in result.samples if s.error})[:5],
        "wall_s": result.wall_s,
        "ttft": _stats([s.ttft or 0.0 for s in ok]),
        "ttft_turns_ge_2": _stats([s.ttft or 0.0 for s in ok if s.turn >= 1]),
        "itl": _stats([s.itl for s in ok if s.itl is not None]),
        "e2e": _stats([s.e2e for s in ok]),
        "ttft_by_turn": {str(t): _stats(v) for t, v in sorted(by_turn.items())},
        "ttft_by_history": {k: _stats(v) for k, v in sorted(by_hist.items(), key=lambda kv: int(kv[0].split("-")[0]))},
        "servers": result.servers,
        "samples": [asdict(s) for s in result.samples],
    }


def table(summary: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{1000 * v:8.1f}"

    lines = [
        f"{summary['label']}: {summary['requests']} requests, {summary['errors']} errors, {summary['wall_s']:.1f}s",
        "turn   n   TTFT p50 ms   TTFT p90 ms",
    ]
    for turn, s in summary["ttft_by_turn"].items():
        lines.append(f"{int(turn) + 1:>4} {s['n']:>3}   {ms(s['median'])}      {ms(s['p90'])}")
    lines.append("history        n   TTFT p50 ms   TTFT p90 ms")
    for bucket, s in summary["ttft_by_history"].items():
        lines.append(f"{bucket:>12} {s['n']:>3}   {ms(s['median'])}      {ms(s['p90'])}")
    for url, counters in summary["servers"].items():
        shown = ", ".join(f"{k}={v:g}" for k, v in counters.items() if v)
        lines.append(f"server {url}: {shown or 'no counter moved'}")
    return "\n".join(lines)


def plot(summaries: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_turn, by_hist) = plt.subplots(1, 2, figsize=(11, 4))
    for s in summaries:
        turns = [int(t) + 1 for t in s["ttft_by_turn"]]
        by_turn.plot(turns, [1000 * (v["median"] or 0) for v in s["ttft_by_turn"].values()], marker="o", label=s["label"])
        buckets = list(s["ttft_by_history"])
        by_hist.plot(range(len(buckets)), [1000 * (v["median"] or 0) for v in s["ttft_by_history"].values()], marker="o", label=s["label"])
        by_hist.set_xticks(range(len(buckets)), buckets, rotation=30, fontsize=7)
    by_turn.set(xlabel="turn", ylabel="TTFT median (ms)", title="TTFT by turn")
    by_hist.set(xlabel="history tokens", ylabel="TTFT median (ms)", title="TTFT by history length")
    by_turn.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Ratios b/a of median TTFT, overall, per turn and per history bucket (< 1: b is faster)."""

    def ratio(x: Any, y: Any) -> float | None:
        return None if not x or not y else y / x

    return {
        "a": a["label"],
        "b": b["label"],
        "ttft_median_ratio": ratio(a["ttft"]["median"], b["ttft"]["median"]),
        "ttft_mean_ratio": ratio(a["ttft"]["mean"], b["ttft"]["mean"]),
        "ttft_turns_ge_2_median_ratio": ratio(a["ttft_turns_ge_2"]["median"], b["ttft_turns_ge_2"]["median"]),
        "by_turn": {t: ratio(a["ttft_by_turn"].get(t, {}).get("median"), s["median"]) for t, s in b["ttft_by_turn"].items()},
        "by_history": {k: ratio(a["ttft_by_history"].get(k, {}).get("median"), s["median"]) for k, s in b["ttft_by_history"].items()},
    }


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]
