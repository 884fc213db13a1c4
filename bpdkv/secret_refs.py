"""Secret references in the topology, resolved at plan/apply time only, and kept out of everything but node files.

A topology value may be ``{secret: {env: NAME}}``, ``{secret: {file: PATH}}``,
``{secret: {aws_secretsmanager: ID, key: JSONKEY}}`` or ``{secret: {ssm: NAME}}``. The model holds a `SecretRef`
(a ``str`` whose text is a placeholder such as ``<secret:env:HF_TOKEN>``), so validate and a plain render never touch
a secret store. Plan and apply call `resolve_topology`, which swaps every reference for a `SecretValue` (a ``str``
holding the value, remembering its reference); the renderer marks files that carry one ``Artifact.secret`` (0600).

Once resolved, a value is registered for masking: `mask` replaces every registered value in a text, and a log-record
factory does the same for every log line of the process. Saved plans store only `secret_digest` of secret files.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

from bpdkv.errors import BpdkvError

SOURCES = ("env", "file", "aws_secretsmanager", "ssm")
REDACTED = "<redacted>"
DOCS = "docs/security.md"

# Names and values that look like credentials (validate warns when they are written in plain text).
SECRET_NAME = re.compile(r"(?i)(^|[_-])(tokens?|keys?|api_?key|passw(or)?d|pass|pwd|secrets?|credentials?|auth)($|[_-])")
# Names that match SECRET_NAME yet hold no secret: paths to files and the names of environment variables.
NOT_SECRET_NAME = re.compile(r"(?i)(_file|_path|_env|_dir)$|^(known_hosts|kv_cache_dtype)$")
TOKEN_PREFIX = re.compile(
    r"^(hf_[A-Za-z0-9]{20,}|sk-[A-Za-z0-9_-]{16,}|AKIA[0-9A-Z]{16}|ASIA[0-9A-Z]{16}|gh[pousr]_[A-Za-z0-9]{30,}"
    r"|github_pat_[A-Za-z0-9_]{30,}|xox[abpr]-[A-Za-z0-9-]{10,}|glpat-[A-Za-z0-9_-]{20})"
)
URL_PASSWORD = re.compile(r"^[a-z][a-z0-9+.-]*://[^/\s:@]*:([^/\s@]+)@")
# Too short to mask without mangling unrelated text; such values are refused at resolution.
MIN_SECRET_LENGTH = 4


class SecretError(BpdkvError):
    """A secret reference could not be resolved. The message names the reference, never a value.

    `problems`: one line per unresolvable reference when several failed in one run (each printed on its own line)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems) if problems else [message]

    def lines(self) -> list[str]:
        return list(self.problems)


class SecretRef(str):
    """A reference to a secret (the string itself is a placeholder, safe to print and render)."""

    source: str
    name: str
    key: str | None
    region: str | None
    where: str

    def __new__(cls, source: str, name: str, key: str | None = None, region: str | None = None, where: str = "") -> SecretRef:
        self = super().__new__(cls, f"<secret:{source}:{name}{'#' + key if key else ''}>")
        self.source, self.name, self.key, self.region, self.where = source, name, key, region, where
        return self

    def describe(self) -> str:
        return str.__str__(self)[len("<secret:") : -1]

    def __reduce__(self) -> tuple[Any, ...]:
        return (SecretRef, (self.source, self.name, self.key, self.region, self.where))


class SecretValue(str):
    """A resolved secret. Its text is the value; `ref` says where it came from (for redaction and messages)."""

    ref: SecretRef

    def __new__(cls, value: str, ref: SecretRef) -> SecretValue:
        self = super().__new__(cls, value)
        self.ref = ref
        return self

    def __repr__(self) -> str:  # a repr in a traceback or a debugger must not show the value
        return f"SecretValue({self.ref.describe()})"


def parse_ref(value: Any, where: str = "") -> SecretRef | None:
    """``{secret: {...}}`` (schema-valid) → SecretRef; anything else → None."""
    if not (isinstance(value, dict) and set(value) == {"secret"} and isinstance(value["secret"], dict)):
        return None
    spec = value["secret"]
    sources = [s for s in SOURCES if s in spec]
    if len(sources) != 1:
        raise SecretError(f"{where or 'secret'}: a secret reference names exactly one of {', '.join(SOURCES)}")
    source = sources[0]
    return SecretRef(source, str(spec[source]), spec.get("key"), spec.get("region"), where)


def is_ref(value: Any) -> bool:
    return isinstance(value, dict) and set(value) == {"secret"}


# ---- masking ---------------------------------------------------------------------------------------------------------
_masked: set[str] = set()
_mask_lock = threading.Lock()
_factory_installed = False


def register(value: str) -> None:
    """From now on `mask` (and every log record of this process) hides this value."""
    global _factory_installed
    with _mask_lock:
        _masked.add(str.__str__(value))
        if not _factory_installed:
            _factory_installed = True
            previous = logging.getLogRecordFactory()

            def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
                record = previous(*args, **kwargs)
                try:
                    message = record.getMessage()
                except Exception:  # noqa: BLE001 - a malformed call is logging's to report, at emit time
                    return record
                masked = mask(message)
                if masked != message:
                    record.msg, record.args = masked, None
                return record

            logging.setLogRecordFactory(factory)


def mask(text: str) -> str:
    """Replace every resolved secret value in text (longest first, so a value containing another goes whole)."""
    if not _masked:
        return text
    for value in sorted(_masked, key=len, reverse=True):
        if value in text:
            text = text.replace(value, REDACTED)
    return text


def secret_digest(content: str) -> str:
    """What a saved plan keeps of a secret file: drift and staleness still compare, the content stays out."""
    return "sha256:" + hashlib.sha256(content.encode()).hexdigest()


# ---- resolution ------------------------------------------------------------------------------------------------------
class Resolver:
    """Resolves references once each per run; AWS clients are made on first use (AWS_ENDPOINT_URL is honoured)."""

    def __init__(self, environ: dict[str, str] | None = None, base_dir: Path | None = None) -> None:
        self.environ = os.environ if environ is None else environ
        self.base_dir = base_dir  # relative `file:` paths are read from the topology's folder
        self._cache: dict[tuple[str, str, str | None, str | None], str] = {}
        self._clients: dict[tuple[str, str | None], Any] = {}

    def resolve(self, ref: SecretRef) -> SecretValue:
        ident = (ref.source, ref.name, ref.key, ref.region)
        if ident not in self._cache:
            value = getattr(self, f"_from_{ref.source}")(ref)
            if ref.key is not None and ref.source != "aws_secretsmanager":
                value = self._json_key(ref, value)
            if len(value) < MIN_SECRET_LENGTH:
                raise self._error(ref, f"the value is shorter than {MIN_SECRET_LENGTH} characters (empty or truncated?)")
            register(value)
            self._cache[ident] = value
        return SecretValue(self._cache[ident], ref)

    def _error(self, ref: SecretRef, what: str) -> SecretError:
        where = f"{ref.where}: " if ref.where else ""
        return SecretError(mask(f"{where}secret {ref.describe()}: {what}"))

    def _from_env(self, ref: SecretRef) -> str:
        value = self.environ.get(ref.name)
        if value is None:
            raise self._error(ref, f"environment variable {ref.name} is not set on this machine; export it before plan/apply")
        return value

    def _from_file(self, ref: SecretRef) -> str:
        path = Path(ref.name).expanduser()
        if not path.is_absolute() and self.base_dir is not None:
            path = self.base_dir / path
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise self._error(ref, f"cannot read {path}: {exc.strerror or type(exc).__name__}") from None
        except UnicodeDecodeError:
            raise self._error(ref, f"{path} is not UTF-8 text") from None
        return text[:-1] if text.endswith("\n") and not text.endswith("\n\n") else text

    def _client(self, service: str, region: str | None) -> Any:
        if (service, region) not in self._clients:
            import boto3

            self._clients[(service, region)] = boto3.session.Session().client(service, region_name=region)
        return self._clients[(service, region)]

    def _aws(self, ref: SecretRef, call: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return call()
        except ClientError as exc:
            error = exc.response.get("Error", {})
            raise self._error(ref, f"AWS {error.get('Code', 'error')}: {error.get('Message', '')}".rstrip(": ")) from None
        except BotoCoreError as exc:
            raise self._error(ref, f"AWS: {exc} (credentials, region or AWS_ENDPOINT_URL)") from None

    def _from_aws_secretsmanager(self, ref: SecretRef) -> str:
        client = self._client("secretsmanager", ref.region)
        answer = self._aws(ref, lambda: client.get_secret_value(SecretId=ref.name))
        if "SecretString" not in answer:
            raise self._error(ref, "the secret is binary; store it as a string")
        value: str = answer["SecretString"]
        return self._json_key(ref, value) if ref.key is not None else value

    def _from_ssm(self, ref: SecretRef) -> str:
        client = self._client("ssm", ref.region)
        answer = self._aws(ref, lambda: client.get_parameter(Name=ref.name, WithDecryption=True))
        return str(answer["Parameter"]["Value"])

    def _json_key(self, ref: SecretRef, value: str) -> str:
        try:
            data = json.loads(value)
        except ValueError:
            raise self._error(ref, f"key '{ref.key}' given but the secret is not a JSON object") from None
        if not isinstance(data, dict) or ref.key not in data:
            keys = ", ".join(sorted(map(str, data))) if isinstance(data, dict) else "none"
            raise self._error(ref, f"the JSON secret has no key '{ref.key}' (keys: {keys})")
        return str(data[ref.key])


T = TypeVar("T")


def _walk(value: Any, visit: Any) -> Any:
    """Rebuild dataclasses, tuples and dicts, applying visit to each SecretRef found inside."""
    if isinstance(value, SecretRef):
        return visit(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for f in dataclasses.fields(value):
            if not f.compare:  # Topology.raw: the document as written (references, never values)
                continue
            old = getattr(value, f.name)
            new = _walk(old, visit)
            if new is not old:
                changes[f.name] = new
        return dataclasses.replace(value, **changes) if changes else value
    if isinstance(value, tuple):
        items = tuple(_walk(v, visit) for v in value)
        return items if any(a is not b for a, b in zip(items, value, strict=True)) else value
    if isinstance(value, dict):
        mapped = {k: _walk(v, visit) for k, v in value.items()}
        return mapped if any(mapped[k] is not value[k] for k in value) else value
    return value


def find_refs(model: Any) -> list[SecretRef]:
    found: list[SecretRef] = []

    def visit(ref: SecretRef) -> SecretRef:
        found.append(ref)
        return ref

    _walk(model, visit)
    return found


def resolve_topology(model: T, resolver: Resolver | None = None) -> T:
    """The same model with every reference replaced by its value; all failures are reported at once."""
    resolver = resolver or Resolver()
    errors: list[str] = []

    def visit(ref: SecretRef) -> str:
        try:
            return resolver.resolve(ref)
        except SecretError as exc:
            if str(exc) not in errors:
                errors.append(str(exc))
            return ref

    resolved = _walk(model, visit)
    if errors:
        summary = errors[0] if len(errors) == 1 else f"{len(errors)} secret references could not be resolved"
        raise SecretError(summary, errors)
    return resolved  # type: ignore[no-any-return]


def carries_secret(*values: Any) -> bool:
    """True when any value (or a tuple/dict of them) is a resolved secret: the file holding it is written 0600."""
    found = False

    def visit_value(v: Any) -> None:
        nonlocal found
        if isinstance(v, SecretValue | SecretRef):
            found = True
        elif isinstance(v, tuple | list):
            for item in v:
                visit_value(item)
        elif isinstance(v, dict):
            for item in v.values():
                visit_value(item)

    for value in values:
        visit_value(value)
    return found


# ---- diffs of secret files ---------------------------------------------------------------------------------------------
def _redact_line(line: str, secret_keys: set[str], env_file: bool) -> str:
    body = line.rstrip("\n")
    newline = line[len(body) :]
    if not body.strip() or (env_file and body.lstrip().startswith("#")):
        return line
    key, sep, value = body.partition("=")
    if env_file and sep and re.fullmatch(r"\s*[A-Za-z_][A-Za-z0-9_]*", key):
        name = key.strip()
        plain = value.strip("'\"")
        if name in secret_keys or SECRET_NAME.search(name) or TOKEN_PREFIX.match(plain) or mask(value) != value:
            return f"{key}={REDACTED}{newline}"
        return line
    return REDACTED + newline  # a key file, a password file, a PEM block: nothing of it is shown


def secret_keys(text: str) -> set[str]:
    """KEY=value lines of text whose value is a resolved secret."""
    keys = set()
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and mask(value) != value:
            keys.add(key.strip())
    return keys


def secret_diff(old: str, new: str, fromfile: str, tofile: str, env_file: bool = False) -> str:
    """Unified diff of a secret file that shows which lines changed, never a value (either side's).

    Lines are compared raw, then each line shown is redacted. In an environment file (`env_file`), KEY=value keeps
    KEY when the value is a resolved secret, the name looks secret or the value looks like a token, and comments and
    plain settings stay readable: a rotated value shows as a changed KEY=<redacted> line. Any other secret file (a
    key, a password, a PEM block) shows no line at all: a base64 line ending in '=' or a password holding '=' would
    otherwise pass for KEY=value.
    """
    keys = secret_keys(new) | secret_keys(old)
    out = []
    for line in difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True), fromfile, tofile):
        if line.startswith(("---", "+++", "@@")):
            out.append(line)
        else:
            out.append(line[0] + _redact_line(line[1:], keys, env_file))
    return "".join(out)


# ---- validate: plain-text values that look secret --------------------------------------------------------------------
def plaintext_secret_findings(doc: Any, path: tuple[str | int, ...] = ()) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """(document path, message) for every plain-text value that looks like a credential. Never quotes the value."""
    if is_ref(doc):
        return
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield from plaintext_secret_findings(value, path + (key,))
        return
    if isinstance(doc, list):
        for index, value in enumerate(doc):
            yield from plaintext_secret_findings(value, path + (index,))
        return
    if not isinstance(doc, str) or not doc:
        return
    name = str(path[-1]) if path and isinstance(path[-1], str) else ""
    if URL_PASSWORD.match(doc):
        yield (
            path,
            (
                "a URL with a password written in plain text; drop the password from the URL and give it as a reference, "
                f"e.g. router.redis_password: {{secret: {{env: REDIS_PASSWORD}}}} ({DOCS})"
            ),
        )
        return
    looks_like_token = bool(TOKEN_PREFIX.match(doc))
    looks_like_path = doc.startswith(("/", "~", "./"))
    named_secret = bool(name) and bool(SECRET_NAME.search(name)) and not NOT_SECRET_NAME.search(name)
    trivial = doc.lower() in ("true", "false", "yes", "no", "on", "off", "0", "1", "none", "null")
    if looks_like_token or (named_secret and not looks_like_path and not trivial):
        label = name or "this value"
        example = re.sub(r"[^A-Za-z0-9_]", "_", name).upper() or "SECRET_NAME"
        why = "looks like a credential" if looks_like_token else "has a name that suggests a secret"
        yield (
            path,
            (
                f"{label} {why} and is written in plain text; reference it instead: "
                f"{{secret: {{env: {example}}}}} (or file:, aws_secretsmanager:, ssm:; {DOCS})"
            ),
        )


# ---- files on the router node ------------------------------------------------------------------------------------------
# One admin key per fleet, at one path on every router node: apply reads it there to call the admin API.
ADMIN_KEY_PATH = "/etc/bpdkv/router-admin.key"


@dataclasses.dataclass(frozen=True)
class NodeSecretFile:
    path: str
    mode: int
    content: str
    reloaded: bool = False  # the running router re-reads it when it changes (the TLS pair): an update needs no restart


def router_secret_files(router: Any, instance: str, config_dir: str) -> tuple[dict[str, str], list[NodeSecretFile]]:
    """Router config keys and the files that carry the router's secrets on its node.

    Inbound API keys are written as digests (`[tenant] sha256:<hex>`): the node never holds them in the clear.
    The admin key and the Redis password are written as they are (apply and redis-py need them). Unresolved
    references (a plain `render`) write their placeholders.
    """
    from bpdkv.contracts import hashed_key_line

    config: dict[str, str] = {}
    files: list[NodeSecretFile] = []
    if router.api_keys:
        path = f"{config_dir}/{instance}.api-keys"
        lines = [f"{t} {k}" if isinstance(k, SecretRef) else hashed_key_line(t, k) for t, k in router.api_keys]
        header = "# Managed by bpdkv: tenant and SHA-256 digest of each inbound API key\n"
        files.append(NodeSecretFile(path, 0o600, header + "\n".join(lines) + "\n"))
        config["api_keys_file"] = path
    if router.admin_key:
        files.append(NodeSecretFile(ADMIN_KEY_PATH, 0o600, f"{router.admin_key}\n"))
        config["admin_key_file"] = ADMIN_KEY_PATH
    if router.redis_password:
        path = f"{config_dir}/{instance}.redis-password"
        files.append(NodeSecretFile(path, 0o600, f"{router.redis_password}\n"))
        config["state_password_file"] = path
    if router.redis_ca_file:
        config["state_ca_file"] = router.redis_ca_file
    for field_name, suffix, mode in (("tls_cert", "crt", 0o644), ("tls_key", "key", 0o600)):
        value = getattr(router, field_name)
        if value is None:
            continue
        if isinstance(value, SecretRef | SecretValue):
            path = f"{config_dir}/{instance}.tls.{suffix}"
            files.append(NodeSecretFile(path, mode, value if value.endswith("\n") else value + "\n", reloaded=True))
            value = path
        config[f"{field_name}_file"] = value
    return config, files


def router_base(router: Any, address: str, port: int) -> str:
    """URL of a router as probed from its own node: HTTPS when it serves TLS (the probe does not verify: loopback)."""
    return f"{'https' if router.tls_cert else 'http'}://{address}:{port}"


def health_probe(role: str, router: Any, address: str, port: int) -> tuple[str, list[str]]:
    """Base URL and paths of an instance's health gate. A router that requires API keys answers /v1/models only to a
    tenant, and apply holds no tenant key, so its gate is /health alone."""
    if role != "router":
        return f"http://{address}:{port}", ["/health", "/v1/models"]
    keyed = bool(router.api_keys or router.api_keys_file)
    return router_base(router, address, port), ["/health"] if keyed else ["/health", "/v1/models"]
