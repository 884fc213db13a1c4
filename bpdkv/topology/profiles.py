"""Model and hardware presets: YAML files under profiles/models and profiles/hardware."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from bpdkv.resources import profiles_dir
from bpdkv.topology.yaml_source import LoadedDocument, load_yaml_file

KINDS = ("models", "hardware")


@dataclass(frozen=True)
class ProfileRef:
    kind: str  # "models" | "hardware"
    name: str
    path: Path


def list_profiles(kind: str) -> list[ProfileRef]:
    folder = profiles_dir() / kind
    return [ProfileRef(kind, p.stem, p) for p in sorted(folder.glob("*.yaml"))]


def find_profile(kind: str, name: str) -> ProfileRef | None:
    for ref in list_profiles(kind):
        if ref.name == name:
            return ref
    return None


def suggest(name: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.5)
    if close:
        return f"did you mean '{close[0]}'?"
    return "choose one of: " + ", ".join(choices)


def load_profile(ref: ProfileRef) -> LoadedDocument:
    # Shown relative to the profiles folder so messages read the same from a wheel or a checkout.
    return load_yaml_file(ref.path, display=f"profiles/{ref.kind}/{ref.path.name}")
