"""Reading Prometheus text exposition (vLLM's and the router's /metrics): the one reader, for the bench, calibrate,
the demo, the EFA probe and the tests. Standard library only, so the deploy side and the runtimes may both import it."""

from __future__ import annotations


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """Sum of the samples of one metric in Prometheus text whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{", 1)[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in (labels or {}).items()):
            try:
                total += float(value)
            except ValueError:
                pass
    return total
