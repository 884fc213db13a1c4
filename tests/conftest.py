from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--regen", action="store_true", help="Rewrite golden files from current output, then review the diff.")


@pytest.fixture
def regen(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--regen"))


# Suite-wide hooks: a stopped run ends what it started; the slow layers say what is running (tests/suite.py).
from tests.suite import (  # noqa: E402,F401
    pytest_configure,
    pytest_runtest_logreport,
    pytest_runtest_setup,
    pytest_sessionstart,
    pytest_unconfigure,
)
