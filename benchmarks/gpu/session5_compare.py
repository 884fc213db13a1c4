"""Session 5's comparisons from the `bpdkv bench` JSON files it wrote, printed as JSON.

    python benchmarks/gpu/session5_compare.py benchmarks/results/gpu-h200x2/session5

(b)/(c): reuse on vs off, both 10 minutes on fresh servers (session4_compare's measures, the same code).
(a): P cache off, reuse on vs off on fresh servers, TTFT at turns >= 2, and P's pull stages on the reuse-on run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from session4_compare import P, run, stats, sustained, ttfts  # noqa: E402


def main() -> None:
    folder = Path(sys.argv[1])
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
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
