"""One error hierarchy. Every user-facing problem becomes one line: ``file:line:col: path: message``."""

from __future__ import annotations

from dataclasses import dataclass, field


def one_line(text: str) -> str:
    """User values may hold newlines or control characters; a diagnostic must stay one line."""
    return "".join(ch if ch.isprintable() or ch == " " else repr(ch)[1:-1] for ch in text)


@dataclass(frozen=True)
class Diagnostic:
    """One problem found in user input, located as precisely as we can."""

    message: str
    path: str = ""  # document path, e.g. nodes[1].instances[0].gpus
    file: str | None = None
    line: int | None = None  # 1-based
    column: int | None = None  # 1-based
    severity: str = "error"  # "error" | "warning"

    def format(self) -> str:
        where = ""
        if self.file:
            where = self.file
            if self.line is not None:
                where += f":{self.line}"
                if self.column is not None:
                    where += f":{self.column}"
            where += ": "
        path = f"{self.path}: " if self.path else ""
        prefix = "warning: " if self.severity == "warning" else ""
        return one_line(f"{where}{prefix}{path}{self.message}")

    def to_json(self) -> dict[str, object]:
        return {
            "severity": self.severity,
            "file": self.file,
            "line": self.line,
            "column": self.column,
            "path": self.path,
            "message": self.message,
        }


class BpdkvError(Exception):
    """Base of every error bpdkv reports to a user (as one line each, exit 1)."""

    exit_code = 1

    def lines(self) -> list[str]:
        return [str(self)]


@dataclass
class InvalidTopology(BpdkvError):
    """The topology (or a profile it uses) failed to load, parse or validate."""

    errors: list[Diagnostic]
    warnings: list[Diagnostic] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__(self.errors[0].format() if self.errors else "invalid topology")

    def lines(self) -> list[str]:
        return [d.format() for d in self.errors]


class UsageError(BpdkvError):
    """Bad command-line usage that click itself cannot catch (e.g. an output folder that is a file)."""


class RenderError(BpdkvError):
    """A template failed to render; always a bug in bpdkv or a profile, reported with the template name."""
