"""Which vLLM server arguments an ``extra_args`` list really sets, spelled any way vLLM's parser accepts.

bpdkv renders some vLLM arguments itself (port, TP, DP, KV transfer config, ...); an extra argument that sets one of
them again would bypass the topology's checks (``-dp 2`` moves side-channel ports nobody checked). vLLM accepts many
spellings of one argument: short aliases (``-tp``), ``--x=y`` and ``--x y``, underscores for dashes, unique prefixes
(argparse ``allow_abbrev``), ``-O3`` and dotted JSON keys (``--kv-transfer-config.kv_role x``). Rather than guessing
them, the option table of vLLM's own server parser is committed as data (``vllm_args.json``, with the vLLM version it
came from; regenerate with ``python -m bpdkv.topology.vllm_args`` inside a vLLM environment) and the arguments are parsed
by argparse with that table, after the same rewriting vLLM's ``FlexibleArgumentParser.parse_args`` does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

TABLE = Path(__file__).with_name("vllm_args.json")

# vLLM argument (dest) -> the topology field that sets it. bpdkv renders these; extra_args must not set them again.
OWNED: dict[str, str] = {
    "model": "model.id / model.path",
    "model_tag": "model.id / model.path",
    "served_model_name": "model.served_name",
    "host": "node.data_plane_address (bpdkv binds 0.0.0.0)",
    "port": "port",
    "dtype": "model.dtype",
    "kv_cache_dtype": "kv_cache_dtype",
    "block_size": "block_size",
    "tensor_parallel_size": "tp",
    "data_parallel_size": "dp",
    "data_parallel_size_local": "dp",
    "data_parallel_rank": "dp",
    "data_parallel_start_rank": "dp",
    "max_model_len": "model.max_model_len",
    "tokenizer": "model.tokenizer",
    "kv_transfer_config": "kv_transfer",
    # vLLM's own flags would replace the NIXL connector with an offloading one; bpdkv renders the tier beside it.
    "kv_offloading_size": "kv_host_memory_gib",
    "kv_offloading_backend": "kv_host_memory_gib",
}
# Arguments bpdkv does not render but cannot allow either, with the reason.
REFUSED: dict[str, str] = {
    "pipeline_parallel_size": "bpdkv assigns tp*dp GPUs per instance; pipeline parallelism is not supported",
    "config": "a vLLM config file can set any argument unchecked; put its arguments in extra_args instead",
}


@dataclass(frozen=True)
class ArgUse:
    """One vLLM argument an extra_args list sets: ``index`` is the item that spells it."""

    index: int
    spelling: str
    dest: str
    option: str  # vLLM's canonical spelling, e.g. --tensor-parallel-size
    negated: bool = False  # the --no-… spelling of an on/off flag


@dataclass(frozen=True)
class ArgProblem:
    index: int
    message: str
    severity: str = "error"


@cache
def load_table() -> dict[str, Any]:
    with open(TABLE, encoding="utf-8") as fh:
        return json.load(fh)  # type: ignore[no-any-return]


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # type: ignore[override]
        raise _Refused(message)


class _Record(argparse.Action):
    def __call__(
        self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        seen = getattr(namespace, "_bpdkv_seen", [])
        negated = bool(option_string and option_string.startswith("--no-"))  # BooleanOptionalAction's off spelling
        seen.append((self.dest, self.option_strings[0] if self.option_strings else self.dest, values, negated))
        namespace._bpdkv_seen = seen
        setattr(namespace, self.dest, values)


@cache
def _parser() -> _Parser:
    table = load_table()
    parser = _Parser(add_help=False, allow_abbrev=bool(table["allow_abbrev"]), prog="vllm")
    for opt in table["options"]:
        nargs = opt["nargs"]
        kwargs: dict[str, Any] = {"dest": opt["dest"], "action": _Record, "default": argparse.SUPPRESS}
        kwargs["nargs"] = 0 if nargs == 0 else nargs
        if opt["strings"]:
            parser.add_argument(*opt["strings"], **kwargs)
        else:
            parser.add_argument(opt["dest"], action=_Record, nargs=nargs, default=argparse.SUPPRESS)
    return parser


_DASHES = re.compile(r"(?<=--)[^.]*")


def vllm_rewrite(args: list[str]) -> list[tuple[int, str]]:
    """vLLM's FlexibleArgumentParser rewriting, keeping the index of the item each result came from."""
    out: list[tuple[int, str]] = []
    skip: set[int] = set()
    for i, arg in enumerate(args):
        if i in skip:
            continue
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            key = _DASHES.sub(lambda m: m.group(0).replace("_", "-"), key, count=1)
            if "." in key:  # --json-arg.key value: vLLM folds it into --json-arg '{...}'
                out.append((i, key.split(".", 1)[0]))
                out.append((i, "{}"))
                if not eq:
                    skip.add(i + 1)
                continue
            out.append((i, key + eq + value))
        elif arg.startswith("-O") and arg != "-O":
            out += [(i, "--optimization-level"), (i, arg[3:] if arg[2:3] == "=" else arg[2:])]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            out.append((i, "--optimization-level"))
        else:
            out.append((i, arg))
    return out


def parse_extra_args(args: list[str]) -> tuple[list[ArgUse], list[ArgProblem]]:
    """Every vLLM argument ``args`` sets (as vLLM would parse them), and what vLLM itself would refuse."""
    rewritten = vllm_rewrite(args)
    origin = [i for i, _ in rewritten]
    tokens = [t for _, t in rewritten]
    problems: list[ArgProblem] = []
    uses: list[ArgUse] = []
    # Parse one option at a time so a refused spelling points at its own item and the rest are still read.
    start = 0
    while start < len(tokens):
        end = start + 1
        while end < len(tokens) and not (tokens[end].startswith("-") and origin[end] != origin[start] and _looks_optional(tokens[end])):
            end += 1
        chunk = tokens[start:end]
        index = origin[start]
        try:
            namespace, rest = _parser().parse_known_args(chunk)
        except _Refused as exc:
            problems.append(ArgProblem(index, f"'{args[index]}': vLLM {load_table()['vllm_version']} would refuse it ({exc})"))
            start = end
            continue
        for dest, option, value, negated in getattr(namespace, "_bpdkv_seen", []):
            if option == dest and isinstance(value, str):  # a positional: point at the stray value itself
                at = max((origin[j] for j in range(start, end) if tokens[j] == value), default=index)
                uses.append(ArgUse(at, args[at], dest, option))
            else:
                uses.append(ArgUse(index, args[index], dest, option, negated))
        for token in rest:
            if token.startswith("-"):
                problems.append(
                    ArgProblem(index, f"'{token}' is not an argument of vLLM {load_table()['vllm_version']}'s server", "warning")
                )
        start = end
    return uses, problems


def _looks_optional(token: str) -> bool:
    # argparse treats "-5" or "-1.5" as a value when no option looks like a negative number.
    return not re.fullmatch(r"-\d+(\.\d*)?", token)


def owned_arg_problems(args: list[str]) -> list[ArgProblem]:
    """One problem per extra argument that sets something bpdkv owns or refuses, plus vLLM's own refusals."""
    uses, problems = parse_extra_args(args)
    for use in uses:
        if use.dest == "model_tag":
            problems.append(ArgProblem(use.index, f"stray value '{use.spelling}': vLLM reads it as the model to serve, which bpdkv sets"))
            continue
        shown = f"'{use.spelling}'" if use.spelling == use.option else f"'{use.spelling}' (vLLM reads it as {use.option})"
        if use.dest in OWNED:
            problems.append(ArgProblem(use.index, f"{shown} is set by bpdkv; use the topology field '{OWNED[use.dest]}' instead"))
        elif use.dest in REFUSED:
            problems.append(ArgProblem(use.index, f"{shown} is not allowed: {REFUSED[use.dest]}"))
    return sorted(problems, key=lambda p: p.index)


def option_value(args: list[str], dest: str) -> str | None:
    """The last value ``args`` gives vLLM's ``dest`` (e.g. gpu_memory_utilization), however it is spelled."""
    rewritten = [t for _, t in vllm_rewrite(args)]
    try:
        namespace, _ = _parser().parse_known_args(rewritten)
    except _Refused:
        return None
    value = getattr(namespace, dest, None)
    if isinstance(value, list):
        value = value[-1] if value else None
    return None if value is None else str(value)


def dump_vllm_table() -> dict[str, Any]:
    """Read the option table from the installed vLLM's server parser (run inside a vLLM environment)."""
    import vllm
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    options = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        nargs = action.nargs
        if nargs is None:
            nargs = 1 if action.option_strings else "?"
        options.append({"strings": list(action.option_strings), "dest": action.dest, "nargs": nargs})
    return {
        "vllm_version": vllm.__version__,
        "source": "vllm.entrypoints.launchers.cli_args.make_arg_parser(FlexibleArgumentParser()) — the `vllm serve` parser",
        "allow_abbrev": parser.allow_abbrev,
        "options": options,
    }


def format_table(table: dict[str, Any]) -> str:
    """One option per line, so a regeneration reads as a diff of options."""
    head = {k: v for k, v in table.items() if k != "options"}
    lines = [json.dumps(head, ensure_ascii=False)[:-1] + ', "options": [']
    lines += [f"  {json.dumps(opt)}," for opt in table["options"]]
    lines[-1] = lines[-1].rstrip(",")
    return "\n".join(lines) + "\n]}\n"


def turns_off(args: list[str], dest: str) -> bool:
    """Whether ``args`` switch vLLM's on/off flag ``dest`` off (e.g. --no-enable-prefix-caching, or a prefix of it)."""
    uses, _ = parse_extra_args(args)
    last = [use for use in uses if use.dest == dest]
    return bool(last) and last[-1].negated


if __name__ == "__main__":
    sys.stdout.write(format_table(dump_vllm_table()))
