"""Find the data folders (templates/, schemas/, profiles/) in a checkout or an installed wheel."""

from __future__ import annotations

from functools import cache
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


@cache
def data_dir(name: str) -> Path:
    """The wheel carries them under bpdkv/_data/; a source checkout has them at the top level."""
    for candidate in (_PACKAGE_DIR / "_data" / name, _PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"bpdkv data folder {name!r} not found (broken installation?)")


def templates_dir() -> Path:
    return data_dir("templates")


def schemas_dir() -> Path:
    return data_dir("schemas")


def profiles_dir() -> Path:
    return data_dir("profiles")
