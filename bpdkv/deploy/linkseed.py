"""The links, measured at deploy (issue 45 item 3): after its gates, `bpdkv apply` runs this on each prefill node — P
pulls from every D of its generation with real NIXL reads (bpdkv calibrate's measurement: P computing N tokens vs
pulling N from D, at a few realistic sizes) — and writes the result beside P, where P's plugin reads it as the prior of
its cost model (bpdkv/vllm_plugin/seedfile.py). P's first conversations are then decided by the measured link, not by
probes while P learns it.

On the node: `python -m bpdkv.deploy.linkseed PREFILL_NAME PREFILL_URL OUT MODEL SIZES TIMEOUT D_NAME=D_URL...`, one
JSON line out: per pair the rate, overhead and P's prefill rate, or the pair's error. The file is written (temp +
rename) when at least one pair was measured; exit 1 when none was.

Planning side (pure): `seed_path`, `probe_sizes` and `command` build what the plan's LinkSeed operation runs;
`parse_output` reads its line back for apply's report and `status`.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import urllib.parse
from typing import Any

from bpdkv import contracts

VERSION = 1  # bpdkv/vllm_plugin/seedfile.py reads this version
REPEAT = 2  # per size: the median of two (a third costs time and rarely moves the fit)
TIMEOUT_S = 300.0


def seed_path(instance: str) -> str:
    """Where a prefill instance's seed lives (its state directory); rendered into its kv_connector_extra_config."""
    return f"{contracts.LINK_SEED_DIR}/{instance}/{contracts.LINK_SEED_NAME}"


def probe_sizes(block_size: int, threshold: int, max_model_len: int) -> list[int]:
    """Three pull sizes P will meet: above the recompute threshold, whole blocks, within the model's length. Two are
    enough for a rate and an overhead; the third checks them."""
    limit = max(max_model_len - 64, 2 * block_size)
    base = max(block_size, -(-max(threshold, 1) // block_size) * block_size)
    sizes = [n for n in (base * 2, base * 8, base * 32) if n <= limit]
    while len(sizes) < 2:  # a short model: the largest whole-block sizes that fit
        n = (limit // block_size - len(sizes)) * block_size
        if n < block_size or n in sizes:
            break
        sizes.insert(0, n)
    return sorted(set(sizes))


def command(
    python: str, prefill: str, prefill_url: str, decodes: list[tuple[str, str]], model: str, sizes: list[int], timeout: float
) -> str:
    args = [
        python,
        "-m",
        "bpdkv.deploy.linkseed",
        prefill,
        prefill_url,
        seed_path(prefill),
        model,
        ",".join(map(str, sizes)),
        f"{timeout:g}",
    ]
    args += [f"{name}={url}" for name, url in decodes]
    return " ".join(shlex.quote(a) for a in args)


def parse_output(stdout: str) -> dict[str, Any] | str:
    """The run's JSON line, or what went wrong (one line)."""
    try:
        data = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return f"the link measurement printed no result: {stdout.strip()[-200:] or 'nothing'}"
    return data if isinstance(data, dict) else "the link measurement printed no object"


def measure(prefill: str, prefill_url: str, decodes: list[tuple[str, str]], model: str, sizes: list[int], timeout: float) -> dict[str, Any]:
    """Measure every pair; the seed document (`seed` merges the pairs: each D's host keyed, P's rate their median)."""
    from bpdkv.bench.calibrate import calibrate

    pairs: dict[str, dict[str, Any]] = {}
    links: dict[str, dict[str, float]] = {}
    rates: list[float] = []
    for name, url in decodes:
        started = time.monotonic()
        try:
            cal = calibrate(prefill_url, url, model, sizes, repeat=REPEAT, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - one pair's failure is that pair's result; the others still count
            pairs[name] = {"url": url, "error": f"{type(exc).__name__}: {exc}"[:300]}
            continue
        seed = cal.cost_seed or {}
        host = urllib.parse.urlsplit(url).hostname or "*"
        link = (seed.get("links") or {}).get(host)
        entry: dict[str, Any] = {"url": url, "seconds": round(time.monotonic() - started, 1)}
        if seed.get("prefill_tokens_per_s"):
            rates.append(float(seed["prefill_tokens_per_s"]))
            entry["prefill_tokens_per_s"] = seed["prefill_tokens_per_s"]
        if link:
            links[host] = link
            entry.update(link)
        else:
            entry["error"] = "; ".join(cal.notes) or "P never pulled: no rate measured"
        pairs[name] = entry
    seed_doc: dict[str, Any] = {"links": links}
    if rates:
        seed_doc["prefill_tokens_per_s"] = round(statistics.median(rates), 1)
    return {"version": VERSION, "measured_at": time.time(), "prefill": prefill, "sizes": sizes, "pairs": pairs, "seed": seed_doc}


def write(path: str, doc: dict[str, Any]) -> None:
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".link-seed.", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def main(argv: list[str]) -> int:
    prefill, prefill_url, out, model, sizes_arg, timeout_arg, *pairs = argv
    decodes = [tuple(p.split("=", 1)) for p in pairs]
    doc = measure(prefill, prefill_url, [(n, u) for n, u in decodes], model, [int(s) for s in sizes_arg.split(",")], float(timeout_arg))
    measured = [n for n, e in doc["pairs"].items() if "bytes_per_s" in e]
    if measured:
        write(out, doc)
    print(json.dumps({"written": bool(measured), "path": out, **doc}))
    return 0 if measured else 1


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


def report_lines(prefill: str, decodes: tuple[str, ...], result: dict[str, Any] | str) -> list[str]:
    """Apply's lines for one P's measurement: per pair the rate and overhead measured, or why there is none."""
    fallback = "P learns it from live pulls"
    if isinstance(result, str):
        return [f"link {prefill}→{d}: not measured ({result}); {fallback}" for d in decodes]
    raw_pairs, raw_seed = result.get("pairs"), result.get("seed")
    pairs: dict[str, Any] = raw_pairs if isinstance(raw_pairs, dict) else {}
    rate = raw_seed.get("prefill_tokens_per_s") if isinstance(raw_seed, dict) else None
    lines = []
    for d in decodes:
        found = pairs.get(d)
        entry: dict[str, Any] = found if isinstance(found, dict) else {}
        if "bytes_per_s" in entry:
            lines.append(
                f"link {prefill}→{d}: {float(entry['bytes_per_s']) / 1e6:,.1f} MB/s + {float(entry.get('overhead_s', 0)) * 1e3:.1f} ms "
                f"per pull{f', P computes {float(rate):,.0f} tokens/s' if rate else ''} (seed written for {prefill})"
            )
        else:
            why = entry.get("error") or "no result for this pair"
            lines.append(f"link {prefill}→{d}: not measured ({why}); {fallback}")
    return lines


def status_lines(text: str, now_wall: float) -> list[str]:
    """`bpdkv status`: a prefill's seed file (as `cat` printed it) as one line per pair — rate, overhead, age — or why
    there is none."""
    if not text.strip():
        return ["links: not measured (no seed yet: apply measures them after its gates)"]
    try:
        doc = json.loads(text)
    except ValueError:
        return ["links: the seed file is not JSON (apply rewrites it)"]
    if not isinstance(doc, dict) or not isinstance(doc.get("pairs"), dict):
        return ["links: the seed file names no pairs (apply rewrites it)"]
    measured = doc.get("measured_at")
    age = (
        _age(now_wall - float(measured)) if isinstance(measured, (int, float)) and not isinstance(measured, bool) else "at an unknown time"
    )
    lines = []
    for name, entry in sorted(doc["pairs"].items()):
        if isinstance(entry, dict) and "bytes_per_s" in entry:
            lines.append(
                f"→{name}: {float(entry['bytes_per_s']) / 1e6:,.1f} MB/s + {float(entry.get('overhead_s', 0)) * 1e3:.1f} ms per pull, "
                f"measured {age}"
            )
        else:
            why = entry.get("error") if isinstance(entry, dict) else None
            lines.append(f"→{name}: not measured ({why or 'no result'}), {age}")
    return lines


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{max(seconds, 0):.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h ago"
    return f"{seconds / 86400:.0f} days ago"
