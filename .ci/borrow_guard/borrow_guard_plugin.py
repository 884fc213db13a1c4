"""pytest plugin (`-p borrow_guard_plugin`, with sitecustomize.py beside it on PYTHONPATH): a test during which any
process imported from a base interpreter's site-packages fails, with the modules and the processes named; borrowing
outside any test (collection, session fixtures' teardown) fails the session at its end."""

from __future__ import annotations

import os
from collections.abc import Generator
from typing import Any

import pytest

LOG = os.environ.get("BPDKV_BORROW_LOG", "")
_offset = 0
_outside: list[str] = []


def _new_lines() -> list[str]:
    global _offset
    if not LOG:
        return []
    try:
        with open(LOG, "rb") as f:
            f.seek(_offset)
            data = f.read()
    except FileNotFoundError:
        return []
    _offset += len(data)
    return [line for line in data.decode(errors="replace").splitlines() if line]


def _describe(lines: list[str]) -> str:
    out = ["processes imported from the base interpreter's site-packages (install it into the environment the test builds):"]
    for line in lines[:40]:
        pid, executable, module, origin, argv = (line.split("\t") + [""] * 5)[:5]
        out.append(f"  {module} from {origin}  (pid {pid}, {executable}: {argv[:160]})")
    if len(lines) > 40:
        out.append(f"  … and {len(lines) - 40} more")
    return "\n".join(out)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    _outside.extend(_new_lines())  # whatever happened between tests
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    lines = _new_lines()
    if lines and report.outcome != "failed":
        report.outcome = "failed"
        report.longrepr = _describe(lines)
    elif lines:
        report.sections.append(("borrowed from the base interpreter", _describe(lines)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _outside.extend(_new_lines())
    if _outside:
        print("\n" + _describe(_outside))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
