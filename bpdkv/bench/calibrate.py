"""`bpdkv calibrate`: on the live fleet, how long P takes to compute N prompt tokens vs pulling them from D.

For each N: (1) P computes a prompt of L = N + tail tokens from scratch (fresh cache_salt); (2) D is seeded with the
first N tokens through the normal P→D protocol, then P gets the same-length prompt extending D's sequence with D's
kv_transfer_params and a fresh cache_salt, so it pulls N tokens from D and computes only the tail. Both are timed at
the client (median of repeats), and P's NIXL counters give the pure transfer time and bytes. The break-even N is the
recommended `kv_recompute_threshold`; a block size that makes pulls descriptor-bound is flagged.
"""

from __future__ import annotations

import random
import statistics
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from bpdkv import contracts
from bpdkv.errors import BpdkvError
from bpdkv.prometheus_text import metric_value
from bpdkv.turn_client import TurnClient, TurnError, post_json, prefill_body
from bpdkv.vllm_plugin import cost

TAIL_TOKENS = 8  # new tokens after D's sequence, computed by P in both measurements
# gpu.md: on H200 block 16 made pulls descriptor-bound (reuse useless); 128 moved 57-59 GB/s.
DESCRIPTOR_BOUND_BELOW = 64


class CalibrationError(BpdkvError):
    pass


@dataclass
class SizeResult:
    tokens: int  # N: tokens P was meant to pull from D
    prompt_tokens: int  # L: prompt length of both requests
    compute_s: float  # median client time for P to compute L tokens (max_tokens=1)
    pull_s: float | None  # median client time for P to pull N and compute the tail; None: never pulled
    pulled_tokens: float  # median tokens P reported as external_kv_transfer
    xfer_s: float  # median NIXL transfer time (P's metrics)
    xfer_bytes: float
    samples_compute: list[float] = field(default_factory=list)
    samples_pull: list[float] = field(default_factory=list)

    @property
    def speedup(self) -> float | None:
        return self.compute_s / self.pull_s if self.pull_s else None


@dataclass
class Calibration:
    prefill: str
    decode: str
    model: str
    block_size: int | None
    current_threshold: int | None
    sizes: list[SizeResult]
    recommended_threshold: int | None
    descriptor_bound: str | None  # why the block size is flagged, or None
    notes: list[str]
    # P's cost model seed (kv_transfer.pull_cost_seed; the plugin's bpdkv_cost_seed): P's prefill rate and this link's
    # per-pull overhead and byte rate, so P decides well from its first offer (bpdkv/vllm_plugin/cost.py). None: too
    # few pulls to fit.
    cost_seed: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        for row, size in zip(out["sizes"], self.sizes, strict=True):
            row["speedup"] = size.speedup
        return out


def _post(url: str, body: dict[str, Any], timeout: float) -> tuple[dict[str, Any], float]:
    try:
        return post_json(url, body, timeout)
    except TurnError as exc:
        raise CalibrationError(str(exc)) from None


def _p_counters(prefill: str) -> tuple[float, float, float]:
    try:
        with urllib.request.urlopen(prefill.rstrip("/") + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except (urllib.error.URLError, OSError) as exc:
        raise CalibrationError(f"{prefill}/metrics: {exc}") from None
    return (
        metric_value(text, "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}),
        metric_value(text, "vllm:nixl_xfer_time_seconds_sum"),
        metric_value(text, "vllm:nixl_bytes_transferred_sum"),
    )


def _completion(model: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True, **extra}


def measure_size(prefill: str, decode: str, model: str, n: int, repeat: int, rng: random.Random, timeout: float) -> SizeResult:
    route = "/v1/completions"
    compute, pull, pulled, xfer, nbytes = [], [], [], [], []
    pd = TurnClient(prefill, decode, timeout)
    length = n
    for _ in range(repeat):
        # D's sequence: n prompt tokens + the one token D generates (whose KV D has not computed: D holds n tokens).
        # P's next prompt extends that sequence by the tail.
        seed = [rng.randrange(100, 1000) for _ in range(n)]
        try:
            p_params, _ = pd.prefill(route, _completion(model, seed), None, {"cache_salt": uuid.uuid4().hex})
            reply, d_data = pd.decode(route, _completion(model, seed, return_token_ids=True), p_params)
        except TurnError as exc:
            raise CalibrationError(str(exc)) from None
        d_params = reply.params
        generated = list(d_data["choices"][0].get("token_ids") or [])
        if not d_params or not d_params.get("remote_block_ids"):
            raise CalibrationError(f"{decode}: D returned no block locations (bidirectional_kv_xfer off, or D is not a kv_consumer)")
        if len(generated) != 1:
            raise CalibrationError(f"{decode}: D did not return its token ids (return_token_ids unsupported by this vLLM?)")
        tail = [rng.randrange(100, 1000) for _ in range(TAIL_TOKENS)]
        prompt = seed + generated + tail
        length = len(prompt)
        fresh = [rng.randrange(100, 1000) for _ in range(length)]
        _, seconds = _post(prefill + route, _completion(model, fresh, cache_salt=uuid.uuid4().hex), timeout)
        compute.append(seconds)
        before = _p_counters(prefill)
        # Pull whatever P's cost model would predict (it may know the link is slow): calibrate measures the pull.
        asked = dict(d_params, **{contracts.PULL_ALWAYS: True})
        _, seconds = _post(prefill + route, prefill_body(_completion(model, prompt), asked, uuid.uuid4().hex), timeout)
        after = _p_counters(prefill)
        got = after[0] - before[0]
        pulled.append(got)
        if got > 0:
            pull.append(seconds)
            xfer.append(after[1] - before[1])
            nbytes.append(after[2] - before[2])
    return SizeResult(
        tokens=n,
        prompt_tokens=length,
        compute_s=statistics.median(compute),
        pull_s=statistics.median(pull) if pull else None,
        pulled_tokens=statistics.median(pulled),
        xfer_s=statistics.median(xfer) if xfer else 0.0,
        xfer_bytes=statistics.median(nbytes) if nbytes else 0.0,
        samples_compute=compute,
        samples_pull=pull,
    )


def break_even(sizes: list[SizeResult], block_size: int | None) -> int | None:
    """Smallest N from which every measured pull beats recomputing (linear interpolation of the crossing),
    rounded up to whole blocks. None: pulls never won."""
    rows = sorted(sizes, key=lambda r: r.tokens)
    wins = [r.pull_s is not None and r.pull_s < r.compute_s for r in rows]
    if not any(wins):
        return None
    first = len(rows) - 1
    while first > 0 and wins[first - 1]:
        first -= 1
    if not wins[first]:
        return None
    if first == 0:
        n = float(rows[0].tokens)
    else:
        lo, hi = rows[first - 1], rows[first]
        gap_lo = (lo.pull_s if lo.pull_s is not None else lo.compute_s * 2) - lo.compute_s  # > 0: pull slower
        gap_hi = (hi.pull_s or 0.0) - hi.compute_s  # < 0: pull faster
        frac = gap_lo / (gap_lo - gap_hi) if gap_lo != gap_hi else 1.0
        n = lo.tokens + frac * (hi.tokens - lo.tokens)
    block = block_size or 1
    return int(-(-int(n + 0.999) // block) * block)


def cost_seed(sizes: list[SizeResult], decode: str) -> dict[str, Any] | None:
    """The seed of P's cost model from the measured sizes. P's prefill rate: the slope of compute time against prompt
    length (the fixed cost of a request is paid on both paths). A pull of N: what the pull request took beyond computing
    its tail — pull_s - compute_s + N × slope — fitted against the bytes NIXL moved: per-pull overhead and byte rate.
    Keyed by D's host (its NIXL side channel, where P reads from) and "*" (any other D, until P has measured it).
    The rate is never above what NIXL itself measured (its transfer times fitted against the bytes: seconds per byte
    past its per-transfer cost): on a fast link the pulls cost about what computing their tail does, the fitted slope
    is noise near zero and its inverse no rate at all."""
    compute = cost.fit_line([(float(r.prompt_tokens), r.compute_s) for r in sizes])
    if compute is None or compute.slope <= 0:
        return None
    seed: dict[str, Any] = {"prefill_tokens_per_s": round(1.0 / compute.slope, 1)}
    pulls = [(r.xfer_bytes, r.pull_s - r.compute_s + r.tokens * compute.slope) for r in sizes if r.pull_s is not None and r.xfer_bytes > 0]
    link = cost.fit_line([(b, max(t, 0.0)) for b, t in pulls])
    if link is not None and link.slope > 0:
        nixl = cost.fit_line([(r.xfer_bytes, r.xfer_s) for r in sizes if r.pull_s is not None and r.xfer_bytes > 0 and r.xfer_s > 0])
        slope = link.slope if nixl is None else max(link.slope, nixl.slope)
        values = {"bytes_per_s": round(1.0 / slope), "overhead_s": round(link.intercept, 6)}
        host = urllib.parse.urlsplit(decode).hostname or "*"
        seed["links"] = {host: values, "*": values}
    return seed


def descriptor_flag(sizes: list[SizeResult], block_size: int | None, gpu: bool) -> str | None:
    if not block_size or block_size >= DESCRIPTOR_BOUND_BELOW:
        return None
    pulled = [r for r in sizes if r.pull_s is not None and r.xfer_s > 0 and r.pulled_tokens > 0]
    per_block = ""
    if pulled:
        biggest = max(pulled, key=lambda r: r.tokens)
        blocks = biggest.pulled_tokens / block_size
        gbps = biggest.xfer_bytes / biggest.xfer_s / 1e9 if biggest.xfer_s else 0.0
        per_block = f"; measured {biggest.xfer_s / blocks * 1e6:.0f} µs per block, {gbps:.2f} GB/s at {biggest.tokens} tokens"
    if not gpu and not pulled:
        return None
    return (
        f"block_size {block_size} < {DESCRIPTOR_BOUND_BELOW}: NIXL moves one descriptor per block and layer, so small blocks make "
        f"pulls descriptor-bound (on H200, block 16 made reuse useless; 128 is the GPU default){per_block}"
    )


@dataclass(frozen=True)
class Targets:
    """Which P and D to measure, with what: from a topology's first prefill/decode instance and/or explicit values."""

    prefill: str
    decode: str
    model: str
    sizes: list[int]
    block_size: int | None
    threshold: int | None
    gpu: bool


def targets(
    topology: Any,
    source: str | None,
    prefill_url: str | None,
    decode_url: str | None,
    model: str | None,
    sizes: str | None,
    block_size: int | None,
) -> Targets:
    """`topology` is a validated Topology (or None); explicit values win over it. Bad input: one UsageError line."""
    from bpdkv.errors import UsageError

    block = threshold = max_len = None
    gpu = True
    if topology is not None:
        if not topology.instances("prefill") or not topology.instances("decode"):
            raise UsageError(f"{source}: needs a prefill and a decode instance")
        pn, pi = topology.instances("prefill")[0]
        dn, di = topology.instances("decode")[0]
        prefill_url = prefill_url or f"http://{pn.host}:{pi.port}"
        decode_url = decode_url or f"http://{dn.host}:{di.port}"
        model = model or topology.model.served_name
        block, threshold, max_len = pi.block_size, topology.kv_transfer.kv_recompute_threshold, topology.model.max_model_len
        gpu = pn.accelerator == "gpu"
    block = block_size or block
    if not prefill_url or not decode_url or not model:
        raise UsageError("give a TOPOLOGY, or --prefill URL --decode URL --model NAME")
    if sizes:
        try:
            ns = sorted({int(x) for x in sizes.split(",") if x.strip()})
        except ValueError:
            raise UsageError(f"--sizes {sizes!r}: comma-separated whole numbers, e.g. 128,256,512") from None
        if not ns or ns[0] < 2:
            raise UsageError(f"--sizes {sizes!r}: every size must be at least 2")
    else:
        limit = (max_len or 8192) - TAIL_TOKENS - 2
        ns = [b * (block or 16) for b in (1, 2, 4, 8, 16, 32, 64) if b * (block or 16) <= limit]
    return Targets(prefill_url, decode_url, model, ns, block, threshold, gpu)


def calibrate(
    prefill: str,
    decode: str,
    model: str,
    sizes: list[int],
    repeat: int = 3,
    seed: int = 0,
    block_size: int | None = None,
    current_threshold: int | None = None,
    gpu: bool = True,
    timeout: float = 600.0,
    progress: Any = None,
) -> Calibration:
    rng = random.Random(seed)
    notes = []
    # One warm-up round trip: the first P→D exchange pays the NIXL handshake, which is not part of a pull.
    measure_size(prefill, decode, model, max(min(sizes), 2), 1, rng, timeout)
    results = []
    for n in sorted(sizes):
        result = measure_size(prefill, decode, model, n, repeat, rng, timeout)
        results.append(result)
        if progress:
            progress(result)
        if result.pull_s is None:
            skipped = f"N={n}: P never pulled"
            if current_threshold is not None and n < current_threshold:
                skipped += f" (below the running kv_recompute_threshold {current_threshold}: P skips such pulls)"
            notes.append(skipped)
    recommended = break_even(results, block_size)
    if recommended is None:
        notes.append("pulls never beat recomputing at the measured sizes: reuse does not pay on this fleet as configured")
    return Calibration(
        prefill,
        decode,
        model,
        block_size,
        current_threshold,
        results,
        recommended,
        descriptor_flag(results, block_size, gpu),
        notes,
        cost_seed(results, decode),
    )


def override_yaml(cal: Calibration, source: str) -> str:
    """The recommendation as a topology fragment the user merges (top-level keys of the topology file)."""
    lines = [
        f"# bpdkv calibrate, {time.strftime('%Y-%m-%d %H:%M')} against {source} (P {cal.prefill}, D {cal.decode}).",
        "# Merge these keys into the topology (or a model profile), then `bpdkv plan` / `bpdkv apply`.",
    ]
    if cal.recommended_threshold is not None:
        row = min((r for r in cal.sizes if r.tokens >= cal.recommended_threshold), key=lambda r: r.tokens, default=None)
        why = (
            f"P computes {row.prompt_tokens} tokens in {row.compute_s * 1000:.1f} ms, pulls {row.tokens} + computes the rest in {(row.pull_s or 0) * 1000:.1f} ms"
            if row
            else ""
        )
        lines += ["kv_transfer:", f"  kv_recompute_threshold: {cal.recommended_threshold}  # break-even; {why}"]
    else:
        lines += ["# no kv_recompute_threshold: pulls never beat recomputing at the measured sizes"]
    if cal.cost_seed is not None:
        if cal.recommended_threshold is None:
            lines += ["kv_transfer:"]
        lines += [
            "  # P's cost model starts from these (P's prefill rate; per D host: per-pull overhead, byte rate), then measures",
            "  pull_cost_seed:",
            f"    prefill_tokens_per_s: {cal.cost_seed['prefill_tokens_per_s']}",
        ]
        if cal.cost_seed.get("links"):
            lines += ["    links:"]
            for host, values in cal.cost_seed["links"].items():
                lines += [f'      "{host}": {{bytes_per_s: {values["bytes_per_s"]}, overhead_s: {values["overhead_s"]}}}']
    if cal.descriptor_bound:
        lines += ["model:", f"  block_size: 128  # {cal.descriptor_bound.split(':')[0]}: small blocks make pulls descriptor-bound"]
    return "\n".join(lines) + "\n"


def table(cal: Calibration) -> list[list[str]]:
    rows = []
    for r in cal.sizes:
        rows.append(
            [
                str(r.tokens),
                str(r.prompt_tokens),
                f"{r.compute_s * 1000:.1f}",
                f"{r.pull_s * 1000:.1f}" if r.pull_s is not None else "not pulled",
                f"{r.pulled_tokens:.0f}",
                f"{r.xfer_s * 1000:.2f}",
                f"{r.xfer_bytes / r.xfer_s / 1e9:.2f}" if r.xfer_s else "-",
                f"{r.speedup:.2f}×" if r.speedup else "-",
            ]
        )
    return rows
