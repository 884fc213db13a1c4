"""JSON Schema validation with errors turned into located, one-line diagnostics."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from functools import cache
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError, relevance

from bpdkv.errors import Diagnostic
from bpdkv.resources import schemas_dir
from bpdkv.topology.yaml_source import PathKey, SourceMap, format_path


@cache
def load_schema(name: str) -> dict[str, Any]:
    with open(schemas_dir() / name, encoding="utf-8") as fh:
        return json.load(fh)  # type: ignore[no-any-return]


def _validator(definition: str | None) -> Draft202012Validator:
    schema = load_schema("topology.schema.json")
    if definition:
        schema = {"$ref": f"#/$defs/{definition}", "$defs": schema["$defs"]}
    return Draft202012Validator(schema)


def _describe(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if value is None:
        return "null"
    if isinstance(value, (dict, list)):
        return "a mapping" if isinstance(value, dict) else "a list"
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


_TYPE_WORDS = {
    "integer": "an integer",
    "string": "a string",
    "object": "a mapping",
    "array": "a list",
    "boolean": "true or false",
    "number": "a number",
    "null": "null",
}


def _message(error: ValidationError) -> tuple[PathKey, str]:
    path: PathKey = tuple(error.absolute_path)
    v = error.validator
    if v == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = [k for k in error.instance if k not in allowed] if isinstance(error.instance, dict) else []
        key = str(extra[0]) if extra else "?"
        close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
        hint = f"did you mean '{close[0]}'?" if close else "allowed: " + ", ".join(allowed)
        return path + (key,), f"unknown key '{key}'; {hint}"
    if v == "required":
        missing = str(error.message).split("'")[1] if "'" in error.message else str(error.validator_value)
        return path, f"missing required key '{missing}'"
    if v == "type":
        expected = error.validator_value
        words = " or ".join(_TYPE_WORDS.get(t, t) for t in ([expected] if isinstance(expected, str) else expected))
        return path, f"expected {words}, got {_describe(error.instance)}"
    if v == "enum":
        choices = [str(c) for c in error.validator_value]
        close = difflib.get_close_matches(str(error.instance), choices, n=1, cutoff=0.6)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return path, f"{_describe(error.instance)} is not allowed; use one of: {', '.join(choices)}{hint}"
    if v == "const":
        return path, f"must be '{error.validator_value}', got {_describe(error.instance)}"
    if v == "minimum":
        return path, f"must be >= {error.validator_value}, got {error.instance}"
    if v == "maximum":
        return path, f"must be <= {error.validator_value}, got {error.instance}"
    if v == "exclusiveMinimum":
        return path, f"must be > {error.validator_value}, got {error.instance}"
    if v == "minItems":
        return path, f"needs at least {error.validator_value} item(s)"
    if v == "minLength":
        return path, "must not be empty"
    if v == "pattern":
        what = {
            "^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$": "lowercase letters, digits and '-' (a DNS label, used in unit names)",
            "^/": "an absolute path",
            r"^(memory|rediss?(\+sentinel)?://.+)$": "'memory', a redis:// URL or a redis+sentinel:// URL",
            "^[A-Za-z_][A-Za-z0-9_]*$": "a shell variable name",
        }.get(str(error.validator_value), f"matching {error.validator_value}")
        return path, f"{_describe(error.instance)} is not valid; expected {what}"
    if v == "propertyNames":
        return path, f"{error.message}"
    return path, error.message


def _branch_words(branch: Any) -> str | None:
    """A short name for a oneOf/anyOf branch that is only a type, a const or an enum (None: anything richer)."""
    if not isinstance(branch, dict):
        return None
    if "const" in branch:
        return repr(branch["const"])
    if "enum" in branch:
        return " or ".join(repr(c) for c in branch["enum"])
    if set(branch) <= {"type", "minimum", "maximum", "description"} and "type" in branch:
        types = branch["type"]
        return _either([_TYPE_WORDS.get(t, t) for t in ([types] if isinstance(types, str) else types)])
    if set(branch) <= {"$ref", "description"} and branch.get("$ref") == "#/$defs/secretRef":
        return "a secret reference ({secret: {...}})"
    return None


def _either(words: list[str | None]) -> str:
    parts = [w for w in words if w]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def _only_required(branches: list[Any]) -> list[str] | None:
    """The keys of a oneOf whose branches each only require one key ("exactly one of"), else None."""
    keys = []
    for branch in branches:
        if not (isinstance(branch, dict) and set(branch) == {"required"} and len(branch["required"]) == 1):
            return None
        keys.append(str(branch["required"][0]))
    return keys


def _one_of(error: ValidationError) -> ValidationError | tuple[PathKey, str]:
    """One line for a failed oneOf/anyOf: a combined message when the branches are simple, else the error of the
    best-matching branch (jsonschema's relevance), never one line per branch."""
    path: PathKey = tuple(error.absolute_path)
    branches = error.validator_value if isinstance(error.validator_value, list) else []
    keys = _only_required(branches)
    if keys is not None and isinstance(error.instance, dict):
        present = [k for k in keys if k in error.instance]
        got = f" (got {' and '.join(present)})" if present else ""
        return path, f"needs exactly one of: {', '.join(keys)}{got}"
    if not error.context:
        return path, error.message  # e.g. "valid under each of" with no branch failing
    words = [_branch_words(b) for b in branches]
    wrong_kind = all(e.validator in ("type", "const", "enum") and not e.relative_path for e in error.context)
    if wrong_kind and all(words):
        return path, f"expected {_either(words)}, got {_describe(error.instance)}"
    # The best-matching branch: one the value's type fits (a wrong type or constant says least), then the deepest error (the
    # branch got furthest), then jsonschema's own relevance.
    return max(
        error.context,
        key=lambda e: (not (e.validator in ("type", "const") and not e.relative_path), len(e.relative_path), relevance(e)),
    )


def _leaves(error: ValidationError) -> list[tuple[ValidationError, PathKey, str]]:
    """(error, path, one-line message) for ``error``: a oneOf/anyOf gives one line, the best-matching branch's."""
    if error.validator in ("oneOf", "anyOf"):
        picked = _one_of(error)
        if isinstance(picked, tuple):
            return [(error, *picked)]
        return _leaves(picked)
    if error.context:
        return [leaf for sub in error.context for leaf in _leaves(sub)]
    return [(error, *_message(error))]


@dataclass(frozen=True)
class SchemaIssue:
    path: PathKey
    message: str
    unknown_key: bool  # the key is not in the schema: dropping it leaves the rest of its part valid


def issues(data: Any, definition: str | None = None) -> list[SchemaIssue]:
    """All schema problems of ``data``, unlocated."""
    out: list[SchemaIssue] = []
    seen: set[tuple[PathKey, str]] = set()
    errors = sorted(_validator(definition).iter_errors(data), key=lambda e: [str(p) for p in e.absolute_path])
    leaves = [leaf for top in errors for leaf in _leaves(top)]
    # A value of the wrong type is one line: other complaints about the same value (e.g. a oneOf of `required`
    # branches that an integer trivially satisfies) only repeat it.
    typed = {path for error, path, _ in leaves if error.validator == "type"}
    for error, path, message in leaves:
        if (path, message) in seen or (path in typed and error.validator in ("oneOf", "anyOf")):
            continue
        seen.add((path, message))
        out.append(SchemaIssue(path, message, error.validator == "additionalProperties"))
    return out


def validate(data: Any, source: SourceMap, definition: str | None = None) -> list[Diagnostic]:
    """All schema problems of ``data``, each located through ``source``."""
    out: list[Diagnostic] = []
    for issue in issues(data, definition):
        pos = source.locate(issue.path)
        out.append(
            Diagnostic(
                message=issue.message,
                path=format_path(issue.path),
                file=pos.file if pos else None,
                line=pos.line if pos else None,
                column=pos.column if pos else None,
            )
        )
    out.sort(key=lambda d: (d.file or "", d.line or 0, d.column or 0))
    return out


def editor_schema() -> dict[str, Any]:
    """The schema for a topology as written, before profiles are merged in (editors, pre-commit, `bpdkv schema`).

    bpdkv validates the merged document with topology.schema.json; a file that names a `profile:` may leave out
    `model:` or `model.id` and split model sizes between profile and file, so those requirements hold only without one.
    """
    doc = json.loads(json.dumps(load_schema("topology.schema.json")))
    doc["required"] = [key for key in doc["required"] if key != "model"]
    model = doc["$defs"]["model"]
    model.pop("required", None)
    model.pop("dependentRequired", None)
    doc["if"] = {"not": {"required": ["profile"]}}
    doc["then"] = {"required": ["model"], "properties": {"model": {"required": ["id"]}}}
    doc["description"] += " Editor form: as written, before the `profile:` preset is merged in."
    return doc
