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


# Property tests in CI: the same examples every run (a failure is a bug found, reproducible, never a coin toss), and no
# per-example deadline or too-slow health check (the 2-core CI box is loaded: wall-clock is not the property). A developer
# hunting bugs runs `pytest --hypothesis-profile=explore` for fresh random examples.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")

# Suite-wide hooks: a stopped run ends what it started; the slow layers say what is running (tests/suite.py).
from tests.suite import (  # noqa: E402,F401
    pytest_configure,
    pytest_runtest_logreport,
    pytest_runtest_setup,
    pytest_sessionstart,
    pytest_unconfigure,
)
