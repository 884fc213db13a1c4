"""extra_args are read the way vLLM's own parser reads them (its option table is committed as data)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bpdkv.topology.vllm_args import TABLE, format_table, load_table, option_value, owned_arg_problems, turns_off

VLLM_PYTHON = Path("/opt/bpdkv-ci/vllm-venv/bin/python")


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (["-dp", "2"], "--data-parallel-size"),
        (["--data-parallel-size=2"], "--data-parallel-size"),
        (["--data_parallel_size", "2"], "--data-parallel-size"),
        (["-tp", "2"], "--tensor-parallel-size"),
        (["--tensor", "2"], "--tensor-parallel-size"),  # unique prefix: argparse allow_abbrev
        (["--tensor_parallel=2"], "--tensor-parallel-size"),
        (["-dpl", "2"], "--data-parallel-size-local"),
        (["--port", "9000"], "--port"),
        (["--kv-transfer-config.kv_role", "kv_both"], "--kv-transfer-config"),
        (["--kv_transfer_config.kv_connector_extra_config.x=1"], "--kv-transfer-config"),
        (["--max_model_len=100"], "--max-model-len"),
        (["--served-model", "x"], "--served-model-name"),
        (["-pp", "2"], "--pipeline-parallel-size"),
    ],
)
def test_owned_spellings_refused(args: list[str], option: str) -> None:
    problems = owned_arg_problems(["--enforce-eager", *args])
    assert len(problems) == 1 and problems[0].index == 1 and problems[0].severity == "error"
    assert option in problems[0].message or f"'{args[0]}'" in problems[0].message


@pytest.mark.parametrize(
    "args",
    [
        ["--enforce-eager"],
        ["-O3"],
        ["-O", "2"],
        ["--seed", "-1"],
        ["--enable-prefix-caching", "--no-enable-prefix-caching"],
        ["--gpu-memory-utilization", "0.8"],
        ["--trust-remote-code", "--enable-expert-parallel"],
        ["--compilation-config.cudagraph_mode", "NONE"],
    ],
)
def test_other_arguments_pass(args: list[str]) -> None:
    assert owned_arg_problems(args) == []


def test_ambiguous_prefix_and_stray_value_are_errors() -> None:
    ambiguous, stray = owned_arg_problems(["--po", "1", "--enforce-eager", "oops"])
    assert "ambiguous" in ambiguous.message and ambiguous.index == 0
    assert "stray value 'oops'" in stray.message and stray.index == 3


def test_config_file_refused_and_unknown_flag_warned() -> None:
    config, unknown = owned_arg_problems(["--config", "x.yaml", "--no-such-flag"])
    assert config.severity == "error" and "config file" in config.message
    assert unknown.severity == "warning" and "--no-such-flag" in unknown.message


def test_option_value_reads_any_spelling() -> None:
    assert option_value(["--gpu_memory_util=0.75"], "gpu_memory_utilization") == "0.75"
    assert option_value(["--enforce-eager"], "gpu_memory_utilization") is None


def test_table_names_its_source() -> None:
    table = load_table()
    assert table["vllm_version"] and "make_arg_parser" in table["source"] and table["allow_abbrev"] is True
    strings = {s for opt in table["options"] for s in opt["strings"]}
    assert {"-tp", "-dp", "-pp", "--kv-transfer-config", "--port"} <= strings


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM environment at /opt/bpdkv-ci/vllm-venv")
def test_table_matches_installed_vllm() -> None:
    """The committed table is what the installed vLLM's parser says (regenerate: python -m bpdkv.topology.vllm_args)."""
    out = subprocess.run(
        [str(VLLM_PYTHON), "-m", "bpdkv.topology.vllm_args"], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    installed = json.loads(out)
    if installed["vllm_version"] != load_table()["vllm_version"]:
        pytest.skip(f"installed vLLM {installed['vllm_version']} differs from the table's {load_table()['vllm_version']}")
    assert format_table(installed) == TABLE.read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("args", "off"),
    [
        (["--no-enable-prefix-caching"], True),
        (["--no-enable-prefix"], True),  # unique prefix of the off spelling
        (["--no-enable-prefix-caching", "--enable-prefix-caching"], False),  # the last one wins
        (["--enable-prefix-caching"], False),
        ([], False),
    ],
)
def test_turns_off_reads_the_off_spelling(args: list[str], off: bool) -> None:
    assert turns_off(args, "enable_prefix_caching") is off
