"""The post-deploy EFA check on log samples (no EFA hardware here: the line formats are NIXL's and libfabric's)."""

from __future__ import annotations

from bpdkv.deploy.efa import check_log

OK = """(EngineCore pid=1192) INFO 11-30 04:00:48 [base_worker.py:861] Detected attention backend(s) ['FLASH_ATTN']
(EngineCore pid=1192) 2026-11-30 04:00:48 NIXL INFO    _api.py:405 Backend LIBFABRIC was instantiated
(EngineCore pid=1192) libfabric:1234:1700000000::efa:core:efa_device_construct():85<info> provider efa ready on rdmap16s27"""


def test_libfabric_on_efa_passes() -> None:
    assert check_log(OK) is None


def test_ucx_instead_of_libfabric_is_reported() -> None:
    problem = check_log(OK.replace("LIBFABRIC", "UCX"))
    assert problem is not None and "did not instantiate LIBFABRIC" in problem and "UCX" in problem


def test_tcp_fallback_is_reported() -> None:
    log = OK + "\n(EngineCore pid=1192) NIXL WARN libfabric_backend.cpp:211 efa unavailable, falling back to provider tcp"
    problem = check_log(log)
    assert problem is not None and problem.startswith("libfabric fell back from EFA") and "tcp" in problem


def test_backend_failure_is_reported() -> None:
    problem = check_log("NIXL ERROR Failed to create LIBFABRIC backend: fi_getinfo returned -61")
    assert problem is not None and "failed" in problem
