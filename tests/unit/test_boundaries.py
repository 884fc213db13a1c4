"""The import boundaries the design keeps (docs/design.md), read from the source with ast: every import counts,
including those inside functions (a lazy import crosses a boundary as much as a top-level one)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

PACKAGE = ROOT / "bpdkv"
# Vocabulary and helpers both sides may import: they import only the standard library and each other.
SHARED = {"bpdkv", "bpdkv.contracts", "bpdkv.errors", "bpdkv.resources", "bpdkv.sse", "bpdkv.turn_client", "bpdkv.prometheus_text"}
DEPLOY_SIDE = ("bpdkv.deploy", "bpdkv.topology", "bpdkv.render", "bpdkv.secret_refs", "bpdkv.cli", "bpdkv.init", "bpdkv.demo", "bpdkv.lab")
RUNTIMES = ("bpdkv.router", "bpdkv.vllm_plugin")
# What the vLLM plugin may import besides the standard library: it runs inside vLLM's processes.
PLUGIN_THIRD_PARTY = {"vllm", "torch"}
# The deploy facade's internals: the CLI and the demo go through bpdkv.deploy.fleet.
FACADE_INTERNALS = ("bpdkv.deploy.runner", "bpdkv.deploy.planner", "bpdkv.deploy.operations")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file; `from a import b` counts as a.b when a.b is a module."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (ROOT / Path(*sub.split(".")) / "__init__.py").is_file() or (ROOT / Path(*sub.split("."))).with_suffix(
                    ".py"
                ).is_file()
                found.append((node.lineno, sub if base.startswith("bpdkv") and is_module else base))
    return found


def graph() -> dict[str, list[tuple[str, int, str]]]:
    """module → [(file, line, imported module)]."""
    out: dict[str, list[tuple[str, int, str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        out[module_name(path)] = [(rel, line, target) for line, target in imports_of(path)]
    return out


def within(name: str, prefixes: tuple[str, ...] | set[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def crossings(edges: dict[str, list[tuple[str, int, str]]], sources: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        {
            f"{file}:{line}: {module} imports {target}"
            for module, imports in edges.items()
            if within(module, sources)
            for file, line, target in imports
            if within(target, forbidden) and not within(target, sources)
        }
    )


EDGES = graph()


def test_the_graph_reader_sees_lazy_and_relative_imports() -> None:
    """The checks below are only as good as the reader: a function-level import and a package-relative one count."""
    edges = EDGES["bpdkv.router.turn"] + EDGES["bpdkv.vllm_plugin"]
    targets = {target for _, _, target in edges}
    assert "bpdkv.turn_client" in targets and "bpdkv.contracts" in targets
    lazy = [t for _, _, t in EDGES["bpdkv.deploy.efa"]]
    assert "bpdkv.turn_client" in lazy  # imported inside probe_main


@pytest.mark.parametrize(
    ("sources", "forbidden"),
    [
        # Runtimes import nothing of the deploy side, nor the bench, nor each other.
        (("bpdkv.router",), (*DEPLOY_SIDE, "bpdkv.bench", "bpdkv.vllm_plugin")),
        (("bpdkv.vllm_plugin",), (*DEPLOY_SIDE, "bpdkv.bench", "bpdkv.router")),
        # The pure deploy steps import nothing of the runtimes: shared names live in the shared vocabulary.
        (("bpdkv.topology", "bpdkv.render", "bpdkv.secret_refs"), RUNTIMES),
        (("bpdkv.deploy",), RUNTIMES),
        # The CLI and the demo go through the deploy facade.
        (("bpdkv.cli", "bpdkv.demo"), FACADE_INTERNALS),
    ],
    ids=["router", "plugin", "topology-render-secrets", "deploy", "cli-facade"],
)
def test_no_boundary_is_crossed(sources: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    assert crossings(EDGES, sources, forbidden) == []


# What the command line may import of bpdkv: one facade per area. cli.py parses, calls one of these, prints through
# bpdkv.printing and exits with the code the result owns; anything deeper (connectors, planner, runner) is not its business.
CLI_FACADES = {
    "bpdkv",
    "bpdkv.errors",
    "bpdkv.printing",
    "bpdkv.workflows",
    "bpdkv.deploy.fleet",
    "bpdkv.topology.validate",
    "bpdkv.topology.report",
    "bpdkv.topology.schema",
    "bpdkv.topology.profiles",
    "bpdkv.demo",
    "bpdkv.lab.vllm_env",
    "bpdkv.bench.command",
    "bpdkv.bench.calibrate",
    "bpdkv.router.flags",
    "bpdkv.router.server",
    "bpdkv.logs",
    "bpdkv.tune",
}


def test_the_cli_imports_only_the_facades() -> None:
    bad = [
        f"{file}:{line}: imports {target}"
        for file, line, target in EDGES["bpdkv.cli"]
        if within(target, ("bpdkv",)) and target not in CLI_FACADES
    ]
    assert bad == []
    # SSH options, the planner's types, the connectors: through bpdkv.deploy.fleet only.
    assert not [
        t for _, _, t in EDGES["bpdkv.cli"] if within(t, ("bpdkv.deploy.connectors", "bpdkv.deploy.inventory", "bpdkv.deploy.bootstrap"))
    ]


def test_the_cli_stays_thin() -> None:
    """Workflows, URL resolution and printing live in the library (issue 32): cli.py is parsing and one call each."""
    assert len((PACKAGE / "cli.py").read_text(encoding="utf-8").splitlines()) <= 620


def test_nothing_in_the_product_imports_the_test_doubles() -> None:
    product = tuple(m for m in EDGES if not within(m, ("bpdkv.testing",)))
    assert crossings(EDGES, product, ("bpdkv.testing",)) == []


def test_the_shared_modules_import_only_the_standard_library_and_each_other() -> None:
    bad = [
        f"{file}:{line}: {module} imports {target}"
        for module in SHARED
        for file, line, target in EDGES.get(module, [])
        if target != "__future__" and target.split(".")[0] not in sys.stdlib_module_names and not within(target, SHARED)
    ]
    assert bad == []


def test_the_plugin_imports_only_vllm_the_standard_library_and_the_contracts() -> None:
    bad = [
        f"{file}:{line}: {module} imports {target}"
        for module, imports in EDGES.items()
        if within(module, ("bpdkv.vllm_plugin",))
        for file, line, target in imports
        if target != "__future__"
        and target.split(".")[0] not in sys.stdlib_module_names
        and target.split(".")[0] not in PLUGIN_THIRD_PARTY
        and not within(target, ("bpdkv.vllm_plugin",))
        and target not in ("bpdkv", "bpdkv.contracts")
    ]
    assert bad == []
