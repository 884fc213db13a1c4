"""Everything the command line prints: one printer module, so cli.py only parses, calls the library and exits.

Errors and warnings go to stderr (red, yellow), results to stdout; secrets are masked in every error line.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import click


def red(line: str) -> None:
    from bpdkv.secret_refs import mask  # an error quoting a resolved secret never prints it

    click.secho(mask(line), fg="red", err=True)


def yellow(line: str) -> None:
    click.secho(line, fg="yellow", err=True)


def warnings(diagnostics: Any) -> None:
    for w in diagnostics:
        yellow(w.format())


def print_json(doc: Any) -> None:
    click.echo(json.dumps(doc, indent=2))


def print_validation(reports: Any, output: str) -> None:
    """`bpdkv validate`: text (one line per problem), json (one object per file) or GitHub workflow annotations."""
    from bpdkv.topology.report import github_annotation

    if output == "json":
        docs = [r.to_json() for r in reports]
        print_json(docs[0] if len(docs) == 1 else docs)
    elif output == "github":
        for r in reports:
            for d in r.errors + r.warnings:
                click.echo(github_annotation(d, r.file))
            click.echo(f"{r.file}: valid" if r.valid else f"{r.file}: {len(r.errors)} error(s)")
    else:
        for r in reports:
            warnings(r.warnings)
            for e in r.errors:
                red(e.format())
            if r.summary:
                s = r.summary
                click.echo(
                    f"{r.file}: valid — topology {s['name']}: {s['nodes']} node(s), "
                    f"{s['prefill']} prefill, {s['decode']} decode, {s['router']} router"
                )
            else:
                click.echo(f"{r.file}: {len(r.errors)} error(s)", err=True)


def print_profiles() -> None:
    from bpdkv.topology.profiles import KINDS, list_profiles, load_profile

    for kind in KINDS:
        click.secho("models:" if kind == "models" else "hardware:", bold=True)
        for ref in list_profiles(kind):
            data = load_profile(ref).data
            click.echo(f"  {ref.name:<24} {data.get('description', '') if isinstance(data, dict) else ''}")


def print_profile(ref: Any) -> None:
    """One profile with its comments; a model profile also with its capacity on every hardware preset."""
    from bpdkv.topology.capacity import ACTIVATION_HEADROOM_GIB, DEFAULT_GPU_MEMORY_UTILIZATION, profile_figures
    from bpdkv.topology.profiles import list_profiles, load_profile

    click.echo(f"# {ref.kind}/{ref.path.name}")
    click.echo(ref.path.read_text(encoding="utf-8"), nl=False)
    if ref.kind == "models":
        presets = [(h.name, load_profile(h).data) for h in list_profiles("hardware")]
        click.echo(
            f"# capacity (gpu_memory_utilization {DEFAULT_GPU_MEMORY_UTILIZATION}, "
            f"{ACTIVATION_HEADROOM_GIB:g} GiB activation headroom per GPU; KV tokens per engine):"
        )
        for line in profile_figures(load_profile(ref).data, presets):
            click.echo(f"#   {line}")


def print_inventory(topology: str, validated: Any, found: Any, output: str) -> None:
    if output == "json":
        print_json(found.to_json() if found else {"groups": {}, "nodes": []})
        return
    if found is None:
        click.echo(f"{topology}: no node_groups; the {len(validated.topology.nodes)} node(s) are written in the file")
        return
    rows = [("NAME", "GROUP", "INSTANCE", "TYPE/PRESET", "SSH HOST", "PRIVATE IP", "PUBLIC IP/DNS")]
    rows += [(n.name, n.group, n.instance_id, n.preset, n.host, n.private_ip, n.public_ip or n.dns_name or "-") for n in found.nodes]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:  # plain columns: greppable, never truncated in a pipe
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())


def roll_lines(roll: Any) -> list[str]:
    """The roll as the plan shows it: each step with what each generation serves while it runs and after it."""

    def serving(caps: dict[str, Any]) -> str:
        def name(g: str) -> str:
            return f"{roll.old_vllm} ({g[:8]})" if g == roll.old else f"{roll.new_vllm} ({g[:8]})"

        return ", ".join(f"{name(g)} {c.prefill} P + {c.decode} D" for g, c in caps.items())

    lines = [
        f"generation {roll.old} (vLLM {roll.old_vllm}) → {roll.new} (vLLM {roll.new_vllm}); the router re-reads its upstreams at each step, no restart"
    ]
    if roll.adopted:
        lines.append(
            f"{', '.join(roll.adopted)}: already run vLLM {roll.new_vllm} (their engines say so; a stopped roll had not "
            "recorded it): counted in the new generation, not restarted"
        )
    undrained = f"; undrain {', '.join(u.instance for u in roll.undrains)}" if roll.undrains else ""
    if roll.steps:
        lines.append(f"step 0 prepare: the router learns both generations (config {roll.prepare.digest}){undrained}")
    else:  # every node serves the new release already (a resumed roll): only the router and the records are left
        lines.append(f"step 0: the router serves every node in the new generation (config {roll.prepare.digest}){undrained}")
    for i, s in enumerate(roll.steps, 1):
        what = {
            "surge": "start the new generation on the spare node(s)",
            "split": "drain, upgrade, gate (health, /version via the router, a probe pull inside the new generation)",
            "retire": "drain and stop the spare node(s)",
        }[s.step.kind.value]
        lines.append(f"step {i} {s.step.kind.value} {', '.join(s.step.nodes)}: {what}")
        lines.append(f"    serving while it runs: {serving(s.step.during)}")
        lines.append(f"    serving after it:      {serving(s.step.after)}")
    lines += [f"warning: {w}" for w in roll.warnings]
    return lines


def print_roll(console: Any, roll: Any) -> None:
    from rich.markup import escape

    for line in roll_lines(roll):
        console.print(
            ("  " if not line.startswith("warning") else "  [yellow]") + escape(line) + ("[/]" if line.startswith("warning") else "")
        )


def plan_console() -> Any:
    """A console for plan lines: on a terminal they wrap at word boundaries of its width; in a pipe or a file they are
    never wrapped (rich would fold them at 80 columns, or at $COLUMNS, mid-phrase), so grep and diff see whole lines."""
    from rich.console import Console

    try:
        tty = sys.stdout.isatty()
    except (AttributeError, ValueError):  # replaced or closed stdout
        tty = False
    return Console(highlight=False, soft_wrap=not tty)


def print_plan(plan: Any, show_diff: bool = True) -> None:
    """The plan, host by host. A host's problems (unreachable, preflight) are not in it: they follow on stderr, one line
    each (print_plan_result, print_report), so a failed host is one line, not a line here and the same line again."""
    from rich.markup import escape

    from bpdkv.deploy.fleet import plan_summary

    console = plan_console()
    console.print(f"[bold]plan[/] for topology [bold]{plan.topology}[/] (generation {plan.generation})")
    if plan.compat_break and plan.roll is not None:
        console.print(f"[bold yellow]compatibility break[/]: {escape('; '.join(plan.compat_changes))} — rolled cohort by cohort")
        print_roll(console, plan.roll)
    elif plan.compat_break:
        console.print(
            f"[bold red]compatibility break[/]: {escape('; '.join(plan.compat_changes))} — all prefill and decode restart together"
        )
    if plan.downtime:
        console.print(f"[bold red]downtime[/]: {escape(plan.downtime)}; apply refuses unless --allow-downtime")
    colors = {"create": "green", "update": "yellow", "delete": "red", "none": "dim"}
    for h in plan.hosts:
        if h.skipped:
            console.print(f"[bold]{h.host}[/] ({h.address}): [dim]skipped (--limit)[/]")
            continue
        if not h.reachable:
            continue  # its one line is the problem line after the plan
        console.print(f"[bold]{h.host}[/] ({h.address})" + ("" if h.changed else " [dim]no changes[/]"))
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
    s = plan_summary(plan)
    console.print(
        f"[bold]{s['create']} to create, {s['update']} to update, {s['delete']} to delete; {s['restart']} unit(s) to (re)start, {s['stop']} to stop[/]"
    )


def print_plan_result(plan: Any, output: str, show_diff: bool, saved_to: Any) -> None:
    """`bpdkv plan`: the plan (text or json), where it was saved, then its problems one line each."""
    if output == "json":
        print_json(plan.to_json())
    else:
        print_plan(plan, show_diff=show_diff)
        if saved_to is not None:
            click.echo(f"saved plan to {saved_to}; apply it with: bpdkv apply {saved_to}")
    for problem in plan.problems:
        red(problem.line())


def host_progress(host: str, message: str) -> None:
    from rich.console import Console

    Console(highlight=False, stderr=False).print(f"[dim]{host}[/]: {message}")


def print_report(report: Any, title: str) -> None:
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
        red(line)
    for line in report.summary:  # last: what a roll did and what serves per generation
        click.echo(line)


def print_status(result: Any, topology: str, output: str) -> None:
    from rich.console import Console
    from rich.table import Table

    if output == "json":
        print_json(result.to_json())
        return
    table = Table(title=f"status of {topology}")
    for col in ("node", "instance", "role", "unit", "state", "health", "drift", "versions"):
        table.add_column(col)
    for r in result.rows:
        ok = "green" if r.healthy else "red"
        versions = " ".join(f"{k} {v}" for k, v in sorted(r.versions.items()))
        table.add_row(
            r.node, r.instance, r.role, r.unit, f"[{ok}]{r.state}[/]", f"[{ok}]{r.health}[/]", ", ".join(r.drift) or "-", versions or "-"
        )
    console = Console(highlight=False)
    console.print(table)
    for r in result.rows:  # each P's links as apply measured them (the seed its cost model starts from)
        for line in getattr(r, "links", []):
            console.print(f"{r.instance} {line}")


def calibration_progress(prefill_url: str, decode_url: str, sizes: list[int], repeat: int) -> Any:
    """Prints the header line; returns the per-size progress callback."""
    from rich.console import Console

    console = Console(highlight=False)
    console.print(f"calibrating P {prefill_url} vs pulls from D {decode_url}: N = {', '.join(map(str, sizes))}, {repeat} repeats")
    return lambda r: console.print(
        f"  N={r.tokens}: compute {r.compute_s * 1000:.1f} ms, pull {'-' if r.pull_s is None else f'{r.pull_s * 1000:.1f} ms'}"
    )


def print_calibration(cal: Any, threshold: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    from bpdkv.bench.calibrate import table

    console = Console(highlight=False)
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


@contextmanager
def bench_progress() -> Iterator[Callable[[bool], Callable[[str, int], Callable[[int], None]]]]:
    """A transient progress bar per mode; `progress(sustained)` gives run_modes its per-mode callback."""
    from rich.progress import Progress

    with Progress(transient=True) as bar:

        def for_run(sustained: bool) -> Callable[[str, int], Callable[[int], None]]:
            def progress(label: str, total: int) -> Callable[[int], None]:
                task = bar.add_task(label, total=None if sustained else total)
                return lambda n: bar.advance(task, n)

            return progress

        yield for_run


def print_bench(run: Any, as_json: bool) -> None:
    from bpdkv.bench import report

    if as_json:
        print_json(run.headline())
    else:
        for summary in run.summaries:
            click.echo(report.table(summary))
        for line in run.ratio_lines():
            click.echo(line)


def print_bench_freshness(run: Any, allow_warm: bool) -> None:
    if run.not_fresh:
        (click.echo if allow_warm else red)(f"not a fresh start (P already held their prompts): {', '.join(run.not_fresh)}")


def wrote_override(path: Any) -> None:
    click.echo(f"wrote {path}: merge it into the topology, then bpdkv plan / apply")
