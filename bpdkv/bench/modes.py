"""`bpdkv bench`: the compared modes (reuse on/off × P cache on/off × paths auto/pull-only), each from the same state.

paths: `pull-only` sends every turn through P (X-Bpdkv-Paths: pull-only; the labels without a paths part), `auto`
lets the router continue short turns on D (decode_local; labels end in /paths-auto). Reuse off has one path only.

Same state = no mode finds its prompts already on P: each mode draws its own prompts (its seed is derived from the
mode, so two invocations on one fleet never repeat each other's prompts either), and P's cache hits during turn 1
are checked; a mode that hit more than the shared system prompt is flagged and the run fails unless allowed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bpdkv import contracts
from bpdkv.bench import report
from bpdkv.bench.runner import Servers, run_workload
from bpdkv.bench.sustained import SustainedSpec, run_sustained
from bpdkv.bench.workload import WorkloadSpec

MODES = (("on", "on"), ("on", "off"), ("off", "on"), ("off", "off"))  # (reuse, P cache); the index salts the seed


PATHS = ("pull-only", "auto")
AUTO_SEEDS = 1_000_000  # auto modes draw prompts of their own: never the pull-only modes' (P would find them cached)


@dataclass(frozen=True)
class Mode:
    reuse: str
    p_cache: str
    paths: str = "pull-only"

    @property
    def label(self) -> str:
        base = f"reuse-{self.reuse}/prefill-cache-{self.p_cache}"
        return base + "/paths-auto" if self.paths == "auto" else base

    def headers(self) -> dict[str, str]:
        out = {}
        if self.paths == "pull-only":
            out[contracts.PATHS_HEADER] = contracts.PATHS_PULL_ONLY
        if self.reuse == "off":
            out[contracts.REUSE_HEADER] = contracts.SWITCH_OFF
        if self.p_cache == "off":
            out[contracts.P_CACHE_HEADER] = contracts.SWITCH_OFF
        return out

    def seed(self, base: int) -> int:
        return base * len(MODES) + MODES.index((self.reuse, self.p_cache)) + (AUTO_SEEDS if self.paths == "auto" else 0)


def modes(reuse: str, p_cache: str, paths: str = "pull-only") -> list[Mode]:
    pick = {"both": ("on", "off"), "on": ("on",), "off": ("off",)}
    ways = PATHS if paths == "both" else (paths,)
    return [Mode(r, c, w) for r in pick[reuse] for c in pick[p_cache] for w in (ways if r == "on" else ("pull-only",))]


@dataclass
class BenchRun:
    url: str
    summaries: list[dict[str, Any]]

    @property
    def not_fresh(self) -> list[str]:
        return [s["label"] for s in self.summaries if s.get("fresh_start") and not s["fresh_start"]["fresh"]]

    @property
    def errors(self) -> int:
        return sum(s["errors"] for s in self.summaries)

    def exit_code(self, allow_warm: bool = False) -> int:
        """1 when a request failed, or a mode did not start fresh (P already held its prompts) unless allowed."""
        return 1 if self.errors or (self.not_fresh and not allow_warm) else 0

    def ratio_lines(self) -> list[str]:
        lines = []
        for p_cache in ("on", "off"):
            on = next((s for s in self.summaries if s["label"] == Mode("on", p_cache).label), None)
            off = next((s for s in self.summaries if s["label"] == Mode("off", p_cache).label), None)
            if on and off:
                r = report.compare(on, off)  # off / on: > 1 means reuse is faster

                def fmt(x: float | None) -> str:
                    return "-" if x is None else f"{x:.2f}x"

                lines.append(
                    f"prefill cache {p_cache}, turns >= 2, reuse off/on (same run): TTFT mean {fmt(r['ttft_turns_ge_2_mean_ratio'])}, "
                    f"median {fmt(r['ttft_turns_ge_2_median_ratio'])}, p99 {fmt(r['ttft_turns_ge_2_p99_ratio'])}"
                )
            auto = next((s for s in self.summaries if s["label"] == Mode("on", p_cache, "auto").label), None)
            if on and auto:
                p = report.compare_paths(auto, on)
                lines.append(
                    f"prefill cache {p_cache}, paths auto vs pull-only (same run): short-turn TTFT mean {p['short_ttft_mean_ratio']}, "
                    f"ITL p99 {p['itl_p99_ratio']}, turns/min {p['turns_per_minute_ratio']} (auto / pull-only)"
                )
        return lines

    def headline(self) -> dict[str, Any]:
        """Each mode's headline figures (seconds), and the same-run ratios of paths auto vs pull-only."""
        keys = ("requests", "errors", "wall_s", "ttft_turns_ge_2", "ttft_short_turns", "ttft_doc_turns", "itl_gaps", "turns_per_minute")
        out: dict[str, Any] = {"target": self.url, "modes": {s["label"]: {k: s.get(k) for k in keys} for s in self.summaries}}
        pairs = []
        for s in self.summaries:
            if s["label"].endswith("/paths-auto"):
                pull = next((x for x in self.summaries if x["label"] == s["label"].removesuffix("/paths-auto")), None)
                if pull is not None:
                    pairs.append(report.compare_paths(s, pull))
        out["paths_auto_vs_pull_only"] = pairs
        return out

    def write(self, out_file: Path | None, plot_file: Path | None) -> None:
        if out_file:
            out_file.write_text(json.dumps({"target": self.url, "runs": self.summaries}, indent=2) + "\n")
        if plot_file:
            if any(s.get("d_timeline") for s in self.summaries):
                report.plot_over_time(self.summaries, plot_file)
            else:
                report.plot(self.summaries, plot_file)


def run_modes(
    url: str,
    spec: WorkloadSpec,
    selected: list[Mode],
    servers: Servers,
    sustained: SustainedSpec | None = None,
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
) -> BenchRun:
    """Each mode in turn, with its own prompts; sustained: N conversations for the duration, else every turn once."""
    summaries = []
    for mode in selected:
        mode_spec = dataclasses.replace(spec, seed=mode.seed(spec.seed))
        advance = progress(mode.label, spec.conversations * spec.turns) if progress else None
        if sustained is not None:
            work = run_sustained(url, mode_spec, sustained, servers, mode.label, mode.headers(), progress=advance)
        else:
            work = run_workload(url, mode_spec, mode.label, mode.headers(), progress=advance, servers=servers)
        result = asyncio.run(work)
        summary = report.summarize(result)
        if sustained is not None:
            summary["sustained"] = sustained.to_json()
        summaries.append(summary)
    return BenchRun(url, summaries)
