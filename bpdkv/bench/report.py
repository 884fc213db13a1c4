"""Tables (per turn, per history length), JSON, a PNG plot, and `compare` ratios."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bpdkv.bench.runner import DECISION_KEY, RunResult


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
        "p99": _pct(values, 0.99),
        "mean": statistics.fmean(values) if values else None,
    }


def over_time(samples: list[Any], window_s: float) -> list[dict[str, Any]]:
    """TTFT per window of request start times (sustained mode)."""
    windows: dict[int, list[float]] = {}
    for s in samples:
        windows.setdefault(int(s.started // window_s), []).append(s.ttft or 0.0)
    return [{"t": (w + 0.5) * window_s, **_stats(v)} for w, v in sorted(windows.items())]


def history_bucket(tokens: int, width: int = 2048) -> str:
    low = tokens // width * width
    return f"{low}-{low + width}"


def stages(counters: dict[str, float]) -> dict[str, float | None]:
    """One server's mean time per request and per pull over the run, from vLLM's histogram sums (ms; None: not seen)."""

    def mean_ms(total: str, count: str) -> float | None:
        return 1000 * counters[total] / counters[count] if counters.get(count) else None

    return {
        "requests": counters.get("queue_count", 0.0),
        "queue_ms": mean_ms("queue_seconds_sum", "queue_count"),
        "prefill_ms": mean_ms("prefill_seconds_sum", "prefill_count"),
        "server_ttft_ms": mean_ms("server_ttft_seconds_sum", "server_ttft_count"),
        "itl_ms": mean_ms("itl_seconds_sum", "itl_count"),
        "pulls": counters.get("nixl_xfer_count", 0.0),
        "pull_ms": mean_ms("nixl_xfer_seconds_sum", "nixl_xfer_count"),
        "pull_post_ms": mean_ms("nixl_post_seconds_sum", "nixl_xfer_count"),
        "pull_mb": counters["nixl_bytes_sum"] / counters["nixl_xfer_count"] / 1e6 if counters.get("nixl_xfer_count") else None,
        "pull_descriptors": counters["nixl_descriptors_sum"] / counters["nixl_xfer_count"] if counters.get("nixl_xfer_count") else None,
    }


def waits(timeline: list[dict[str, float]]) -> dict[str, Any]:
    """D's waiting requests by reason over the run: capacity (no blocks/slot yet) vs deferred (KV still arriving)."""
    if not timeline or "waiting_capacity" not in timeline[0]:
        return {"by_reason": False}
    capacity = [p for p in timeline if p.get("waiting_capacity", 0.0) > 0]
    return {
        "by_reason": True,
        "capacity_max": max(p.get("waiting_capacity", 0.0) for p in timeline),
        "deferred_max": max(p.get("waiting_deferred", 0.0) for p in timeline),
        "capacity_samples": len(capacity),
        # A capacity wait while held blocks take part of D's cache and the cache is nearly full: what the hold budget's
        # pressure release must prevent.
        "capacity_with_held_near_full": sum(1 for p in capacity if p["held_blocks"] > 0 and p["kv_usage"] >= 0.9),
        "capacity_points": [{k: p[k] for k in ("t", "kv_usage", "held_share", "waiting_capacity")} for p in capacity[:20]],
    }


def decisions(servers: dict[str, dict[str, float]], later_turns: int) -> dict[str, Any]:
    """P's pull decisions over the run (every server's "decision:outcome/reason" deltas): counts, per turn >= 2, and the
    share of offers recomputed because of the link."""
    counts: dict[str, float] = {}
    for counters in servers.values():
        for key, value in counters.items():
            if key.startswith(DECISION_KEY) and value:
                name = key[len(DECISION_KEY) :]
                counts[name] = counts.get(name, 0.0) + value
    offers = sum(counts.values())
    slower = sum(v for k, v in counts.items() if k == "recomputed/link_slower")
    return {
        "counts": dict(sorted(counts.items())),
        "offers": offers,
        "per_turn": {k: v / later_turns for k, v in sorted(counts.items())} if later_turns else {},
        "recomputed_link_slower_share": slower / offers if offers else None,
    }


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
        # Every inter-token gap of every stream: its p99 is what D's concurrent streams suffered (local prefills included).
        "itl_gaps": _stats(result.gaps),
        # Agentic shape: tool-result turns (50-500 tokens) and document turns apart; turns completed per minute.
        "ttft_short_turns": _stats([s.ttft or 0.0 for s in ok if s.turn >= 1 and s.kind in ("tool", "turn")]),
        "ttft_doc_turns": _stats([s.ttft or 0.0 for s in ok if s.kind == "doc"]),
        "turns_per_minute": 60.0 * len(ok) / result.wall_s if result.wall_s else None,
        "e2e": _stats([s.e2e for s in ok]),
        "ttft_by_turn": {str(t): _stats(v) for t, v in sorted(by_turn.items())},
        "ttft_by_history": {k: _stats(v) for k, v in sorted(by_hist.items(), key=lambda kv: int(kv[0].split("-")[0]))},
        "servers": result.servers,
        "decisions": decisions(result.servers, sum(1 for s in ok if s.turn >= 1)),
        "fresh_start": asdict(result.fresh) if result.fresh else None,
        "ttft_over_time": over_time(ok, max(result.wall_s / 20, 10.0)) if result.timeline else [],
        "d_timeline": result.timeline,
        "d_waiting_max": max((p["waiting"] for p in result.timeline), default=None),
        "d_waits": waits(result.timeline),
        "stages": {url: stages(c) for url, c in result.servers.items()},
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
    short, itl = summary.get("ttft_short_turns") or {}, summary.get("itl_gaps") or {}
    if short.get("n"):
        lines.append(f"short turns (tool results) n {short['n']}: TTFT mean {ms(short['mean'])} ms, p99 {ms(short['p99'])} ms")
    if itl.get("n"):
        lines.append(f"inter-token gaps n {itl['n']}: p50 {ms(itl['median'])} ms, p99 {ms(itl['p99'])} ms")
    dec = summary.get("decisions") or {}
    if dec.get("offers"):
        shown = ", ".join(f"{k} {v:g}" for k, v in dec["counts"].items())
        share = dec.get("recomputed_link_slower_share")
        lines.append(f"P decisions ({dec['offers']:g} offers): {shown}; recomputed for the link {share:.0%}")
    fresh = summary.get("fresh_start")
    if fresh:
        verdict = "fresh" if fresh["fresh"] else "NOT FRESH: P already held this mode's prompts"
        lines.append(f"turn 1: P cache hits {fresh['hit_tokens']:g} tokens (a fresh P: <= {fresh['allowed_tokens']:g}) -> {verdict}")
    if summary.get("ttft_over_time"):
        lines.append("time s    n   TTFT p50 ms   TTFT p99 ms")
        for w in summary["ttft_over_time"]:
            lines.append(f"{w['t']:>6.0f} {w['n']:>4}   {ms(w['median'])}      {ms(w['p99'])}")
    if summary.get("d_timeline"):
        tl = summary["d_timeline"]
        lines.append(
            f"D: KV usage max {max(p['kv_usage'] for p in tl):.0%} (held max {max(p['held_share'] for p in tl):.0%}), "
            f"waiting max {summary['d_waiting_max']:g}, samples {len(tl)}"
        )
        w = summary.get("d_waits") or {}
        if w.get("by_reason"):
            lines.append(
                f"D waiting by reason: capacity max {w['capacity_max']:g} ({w['capacity_samples']} samples, "
                f"{w['capacity_with_held_near_full']} with held blocks and KV >= 90%), deferred (KV arriving) max {w['deferred_max']:g}"
            )
        else:
            lines.append("D waiting by reason: not exported by this server (waiting counts both reasons)")
    for url, counters in summary["servers"].items():
        shown = ", ".join(f"{k}={v:g}" for k, v in counters.items() if v)
        lines.append(f"server {url}: {shown or 'no counter moved'}")
        st = (summary.get("stages") or {}).get(url) or {}
        if st.get("requests"):
            shown = ", ".join(f"{k} {v:.1f}" for k, v in st.items() if v is not None and k != "requests")
            lines.append(f"  per request ({st['requests']:g}): {shown}")
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


def plot_over_time(summaries: list[dict[str, Any]], path: Path) -> None:
    """Sustained mode: TTFT p50/p99, D's KV usage (live/held) and D's waiting count over time, per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ttft, kv, waiting) = plt.subplots(1, 3, figsize=(15, 4))
    for s in summaries:
        w = s["ttft_over_time"]
        line = ttft.plot([x["t"] for x in w], [1000 * (x["median"] or 0) for x in w], marker="o", label=f"{s['label']} p50")[0]
        ttft.plot([x["t"] for x in w], [1000 * (x["p99"] or 0) for x in w], ls="--", color=line.get_color(), label=f"{s['label']} p99")
        tl = s["d_timeline"]
        kv.plot([p["t"] for p in tl], [100 * p["live_share"] for p in tl], color=line.get_color(), label=f"{s['label']} live")
        kv.plot([p["t"] for p in tl], [100 * p["held_share"] for p in tl], ls=":", color=line.get_color(), label=f"{s['label']} held")
        waiting.plot([p["t"] for p in tl], [p["waiting"] for p in tl], color=line.get_color(), label=s["label"])
    ttft.set(xlabel="time (s)", ylabel="TTFT (ms)", title="TTFT p50 / p99 over time")
    kv.set(xlabel="time (s)", ylabel="% of D's KV cache", title="D KV usage: live / held")
    waiting.set(xlabel="time (s)", ylabel="requests", title="D waiting requests")
    for ax in (ttft, kv, waiting):
        ax.legend(fontsize=7)
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
        "ttft_turns_ge_2_mean_ratio": ratio(a["ttft_turns_ge_2"]["mean"], b["ttft_turns_ge_2"]["mean"]),
        "ttft_turns_ge_2_p99_ratio": ratio(a["ttft_turns_ge_2"].get("p99"), b["ttft_turns_ge_2"].get("p99")),
        "by_turn": {t: ratio(a["ttft_by_turn"].get(t, {}).get("median"), s["median"]) for t, s in b["ttft_by_turn"].items()},
        "by_history": {k: ratio(a["ttft_by_history"].get(k, {}).get("median"), s["median"]) for k, s in b["ttft_by_history"].items()},
    }


def compare_paths(auto: dict[str, Any], pull: dict[str, Any]) -> dict[str, Any]:
    """auto / pull-only ratios of one run (issue 22's targets: short-turn TTFT mean <= 0.5, ITL p99 <= 1.15,
    turns per minute >= 1)."""

    def ratio(x: Any, y: Any) -> float | None:
        return None if not x or not y else round(x / y, 3)

    return {
        "a": auto["label"],
        "b": pull["label"],
        "short_ttft_mean_ratio": ratio(auto["ttft_short_turns"]["mean"], pull["ttft_short_turns"]["mean"]),
        "itl_p99_ratio": ratio(auto["itl_gaps"]["p99"], pull["itl_gaps"]["p99"]),
        "turns_per_minute_ratio": ratio(auto["turns_per_minute"], pull["turns_per_minute"]),
    }


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())  # type: ignore[no-any-return]
