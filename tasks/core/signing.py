"""HMAC signatures on the records the pipeline trusts (issue 24).

A record that decides something (a checkpoint manifest, an evaluation report, a gate record, the data
ledger, a registry tag, a lineage line, the stack's copy of a run's config) is signed with the stack's
signing key when it is written and verified when it is read; anything unsigned or forged is refused
(`SignatureError`, logged as such), never trusted. Only a process holding the key (the stack's own
processes, its worker's flow runs, the training job it starts) can write a record that verifies, so a
writer of the run directory, the object store or MLflow can at worst make a record be refused.

The key is a 0600 secret, like the stack's other tokens, found (in this order):

  1. $CRUCIBLE_SIGNING_KEY_FILE (the stack hands its processes this path, never the key),
  2. $CRUCIBLE_STATE_DIR/secrets/signing.key,
  3. ./.crucible/secrets/signing.key (the default stack.state_dir),

and generated on first use. Each signature binds a `purpose` (domain separation): a signed report can
never pass as a signed manifest, nor a tag's value as another tag's.

Standard library only (imported by `crucible status` and the services).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from pathlib import Path
from typing import Any, Mapping

SIGNING_KEY_FILE_ENV = "CRUCIBLE_SIGNING_KEY_FILE"
SIGNING_KEY_NAME = "signing.key"  # the file's name in <state_dir>/secrets/ (infra/stack.py secret_file)
SIGNATURE_FIELD = "signature"  # the field a signed JSON record carries its signature in
_PREFIX = "hmac-sha256:"

log = logging.getLogger("crucible.signing")

_cache: dict[str, bytes] = {}


class SignatureError(ValueError):
    """A record is unsigned, or its signature does not verify with the stack's key: it is refused."""


def key_path() -> Path:
    """Where this process's signing key lives (see the module docstring)."""
    explicit = os.environ.get(SIGNING_KEY_FILE_ENV)
    if explicit:
        return Path(explicit).expanduser().resolve()
    state = os.environ.get("CRUCIBLE_STATE_DIR") or ".crucible"
    return Path(state).expanduser().resolve() / "secrets" / SIGNING_KEY_NAME


def ensure_key_file(path: str | Path) -> Path:
    """Create the key file (mode 0600, in a 0700 folder) if it is missing or empty; its path."""
    path = Path(path)
    try:
        if path.read_text().strip():
            return path
    except OSError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # written whole under a private name, then linked into place: two processes creating the key at
    # once (the ranks of a torchrun job) agree on the first one's, and none ever reads it half-written
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)
    return path


def signing_key() -> bytes:
    path = key_path()
    key = _cache.get(str(path))
    if key is None:
        ensure_key_file(path)
        _check_private(path)
        key = path.read_text().strip().encode()
        if not key:
            raise SignatureError(f"the signing key {path} is empty")
        _cache[str(path)] = key
    return key


def _check_private(path: Path) -> None:
    """Refuse a key someone else could have written or read: it must belong to this user (or root,
    as a mounted Kubernetes Secret does) and be writable by its owner only, readable by no other user
    (a group may read it: a Secret mounted for a pod's fsGroup)."""
    st = path.stat()
    if st.st_uid not in (os.getuid(), 0) or st.st_mode & 0o026:
        _refuse(f"the signing key {path} is not private (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o}): "
                f"a key others can write or read signs nothing; make it this user's, mode 600")


def _mac(purpose: str, data: bytes, key: bytes | None = None) -> str:
    msg = purpose.encode() + b"\x00" + data
    return _PREFIX + hmac.new(key or signing_key(), msg, hashlib.sha256).hexdigest()


def sign_bytes(data: bytes, purpose: str) -> str:
    """The signature of `data` for `purpose` ("hmac-sha256:<hex>")."""
    return _mac(purpose, data)


def verify_bytes(data: bytes, signature: str | None, purpose: str, what: str = "record",
                 key: bytes | None = None) -> None:
    """Raise SignatureError (and log it) unless `signature` signs `data` for `purpose`. `key`: the
    signing_key() a caller checking many records resolved once (finding it costs more than the HMAC)."""
    if not signature:
        _refuse(f"{what} is unsigned")
    if not isinstance(signature, str) or not signature.isascii():  # compare_digest raises on non-ASCII
        _refuse(f"{what} has a signature that is not an ASCII string")
    if not hmac.compare_digest(signature, _mac(purpose, data, key)):
        _refuse(f"{what} has a signature that does not verify (forged, or altered after signing)")


def canonical(obj: Any) -> bytes:
    """The bytes a JSON value is signed as: sorted keys, no whitespace, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str).encode()


def sign_record(record: Mapping[str, Any], purpose: str) -> dict:
    """A copy of the JSON object `record` carrying its signature in the field "signature"."""
    body = {k: v for k, v in record.items() if k != SIGNATURE_FIELD}
    return {**body, SIGNATURE_FIELD: sign_bytes(canonical(body), purpose)}


def verify_record(record: Any, purpose: str, what: str = "record") -> dict:
    """The record without its signature, once the signature verifies; SignatureError otherwise."""
    if not isinstance(record, Mapping):
        _refuse(f"{what} is not a JSON object")
    body = {k: v for k, v in record.items() if k != SIGNATURE_FIELD}
    verify_bytes(canonical(body), record.get(SIGNATURE_FIELD), purpose, what)
    return body


def dumps_signed(record: Mapping[str, Any], purpose: str, indent: int | None = 2) -> str:
    """JSON text of the signed record (what a signed file holds)."""
    return json.dumps(sign_record(record, purpose), indent=indent, sort_keys=True) + "\n"


def loads_signed(text: str | bytes, purpose: str, what: str = "record") -> dict:
    """Parse and verify a signed JSON file's text; the record without its signature."""
    try:
        record = json.loads(text)
    except ValueError as e:
        _refuse(f"{what} is not JSON ({e})")
    return verify_record(record, purpose, what)


def read_signed(path: str | Path, purpose: str) -> dict:
    """Read and verify a signed JSON file."""
    return loads_signed(Path(path).read_bytes(), purpose, what=str(path))


def write_signed(path: str | Path, record: Mapping[str, Any], purpose: str) -> Path:
    """Write the signed record atomically."""
    from tasks.core.io import atomic_write_text

    return atomic_write_text(path, dumps_signed(record, purpose))


SIDECAR_SUFFIX = ".sig"  # a file whose bytes must stay as they are (a config a program parses) is signed beside it


def write_with_signature(path: str | Path, data: bytes, purpose: str) -> Path:
    """Write `data` to `path` and its signature to `<path>.sig` (both atomically; the signature last)."""
    from tasks.core.io import atomic_write_bytes, atomic_write_text

    atomic_write_bytes(path, data)
    atomic_write_text(f"{path}{SIDECAR_SUFFIX}", sign_bytes(data, purpose) + "\n")
    return Path(path)


def read_with_signature(path: str | Path, purpose: str) -> bytes:
    """The bytes of `path` once `<path>.sig` verifies them; SignatureError when it is missing or does not."""
    data = Path(path).read_bytes()
    try:
        signature = Path(f"{path}{SIDECAR_SUFFIX}").read_text().strip()
    except OSError:
        signature = None
    verify_bytes(data, signature, purpose, what=str(path))
    return data


def sign_value(name: str, value: str, purpose: str = "tag") -> str:
    """The signature of one named string (e.g. a registry tag: its name is bound too, so a signed value
    cannot be moved to another tag)."""
    return sign_bytes(canonical([name, value]), purpose)


def verify_value(name: str, value: str | None, signature: str | None, purpose: str = "tag") -> str:
    if value is None:
        _refuse(f"{purpose} {name!r} is missing")
    verify_bytes(canonical([name, value]), signature, purpose, what=f"{purpose} {name!r}")
    return value


def _refuse(message: str):
    log.warning("refused: %s", message)
    raise SignatureError(message)
