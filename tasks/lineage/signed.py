"""A run's lineage log as a record nobody else can write to (issue 24).

Each line is one OpenLineage event that carries the stack's signature in its `crucible_signature`
run facet (tasks/core/signing.py, purpose "lineage-line", over the event's canonical JSON without
that facet), so the line stays a valid event for the lineage service and Marquez. Every reader
(replay to the lineage service with its write token, the emitter's licence propagation, the
triggered flows' search for a checkpoint's training run) takes verified lines only: an unsigned,
forged or altered line is refused, logged and skipped.

The log is opened without following symbolic links, neither the file (O_NOFOLLOW) nor its folder
(opened O_NOFOLLOW and the file opened relative to it): a writer of the run directory who replaces
lineage.jsonl, or the run directory itself, with a link gets the append refused, never made to
another file.
"""
from __future__ import annotations

import errno
import hmac
import json
import logging
import os
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from tasks.core.fs import is_remote, read_bytes
from tasks.core.storage import stored
from tasks.core.signing import SignatureError, _mac, canonical, sign_bytes, signing_key, verify_bytes

try:
    import orjson
except ImportError:  # pragma: no cover - orjson comes with Prefect
    orjson = None

PURPOSE = "lineage-line"
SIGNATURE_FACET = "crucible_signature"

log = logging.getLogger("crucible.lineage")


class LogRefused(OSError):
    """The lineage log (or its folder) is a symbolic link: not opened."""


def _split(event: dict) -> tuple[dict, Any]:
    """(the event as it is signed: without the signature facet, and without a run.facets or a run
    left empty, the signature)."""
    run = event.get("run")
    if not isinstance(run, dict):
        return event, None
    run, body = dict(run), dict(event)
    facets, signature = run.pop("facets", None), None
    if isinstance(facets, dict):
        facets = dict(facets)
        facet = facets.pop(SIGNATURE_FACET, None)
        signature = facet.get("signature") if isinstance(facet, dict) else None
    if facets:
        run["facets"] = facets
    if run:
        body["run"] = run
    else:
        del body["run"]
    return body, signature


def event_signature(event: dict) -> str:
    return sign_bytes(canonical(_split(event)[0]), PURPOSE)


def sign_event(event: dict) -> dict:
    """A copy of the event (a JSON object) carrying its signature facet."""
    from tasks.lineage.facets import custom_schema_url

    body, _ = _split(event)
    run = dict(body.get("run") or {})
    run["facets"] = {**(run.get("facets") or {}), SIGNATURE_FACET: {
        "_producer": str(event.get("producer", "")), "_schemaURL": custom_schema_url("CrucibleSignatureRunFacet"),
        "signature": event_signature(body)}}
    return {**body, "run": run}


def sign_run_event(event) -> None:
    """Add the signature facet to an openlineage event object (what the transports then send and
    write), computed over the event exactly as it is serialized."""
    from openlineage.client.serde import Serde

    from tasks.lineage.facets import CrucibleSignatureRunFacet

    facets = dict(event.run.facets or {})
    facets.pop(SIGNATURE_FACET, None)
    event.run.facets = facets
    facet = CrucibleSignatureRunFacet(signature=event_signature(json.loads(Serde.to_json(event))))
    facet._producer = event.producer
    event.run.facets = {**facets, SIGNATURE_FACET: facet}


def verify_event(event: Any, what: str = "lineage line", key: bytes | None = None) -> dict:
    """The event, once its signature verifies; SignatureError (logged as refused) otherwise. `key`:
    the signing key, resolved once by a caller verifying a whole log."""
    if not isinstance(event, dict):
        log.warning("refused: %s is not a JSON object", what)
        raise SignatureError(f"{what} is not a JSON object")
    body, signature = _split(event)
    if _signs_sorted_orjson(body, signature, key):
        return event
    verify_bytes(canonical(body), signature, PURPOSE, what, key)
    return event


def _signs_sorted_orjson(body: dict, signature: Any, key: bytes | None) -> bool:
    """True when `signature` signs orjson's sorted, compact encoding of `body`: for a line of the
    stack's emitter these are canonical()'s bytes, made ~8x faster (a replay's main cost per line
    after parsing). Sound: bytes that verify were signed as canonical(x) for an x whose JSON is
    those bytes, i.e. x == body; when the encodings differ (floats written otherwise, say) the
    caller checks canonical() itself. orjson writes NaN and infinities as null (lossy): bytes with a
    null are left to canonical(), which writes them apart (the emitter writes no null)."""
    if orjson is None or key is None or not isinstance(signature, str) or not signature.isascii():
        return False
    try:
        data = orjson.dumps(body, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # a value orjson does not encode (e.g. an integer beyond 64 bits)
        return False
    return b"null" not in data and hmac.compare_digest(signature, _mac(PURPOSE, data, key))


def _loads(line: bytes) -> Any:
    """orjson when installed (a Prefect dependency; ~4x the standard parser on a lineage line), the
    standard library for what it refuses (NaN, lone surrogates). Not the same values either way:
    orjson parses an integer beyond 64 bits as a float, so such a line's canonical() bytes differ
    from what was signed and the line is refused."""
    if orjson is not None:
        try:
            return orjson.loads(line)
        except orjson.JSONDecodeError:
            pass
    return json.loads(line)


def verified_line(line: bytes, what: str, key: bytes | None = None) -> dict | None:
    """The event of one log line if it is signed; None (logged) if it is not JSON or not signed."""
    try:
        event = _loads(line)
    except ValueError:
        log.warning("refused: %s is not JSON", what)
        return None
    try:
        return verify_event(event, what, key)
    except SignatureError:  # logged by verify_event / verify_bytes
        return None
    except (TypeError, ValueError) as e:  # e.g. a lone surrogate escape: canonical() cannot encode it
        log.warning("refused: %s cannot be checked (%s)", what, type(e).__name__)
        return None


def _open(path: str | Path, flags: int) -> int:
    path = Path(path)
    try:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and path.parent.is_symlink():
            log.warning("refused: the folder of the lineage log %s is a symbolic link", path)
            raise LogRefused(e.errno, f"refused: the folder of the lineage log {path} is a symbolic link") from None
        raise
    try:
        return os.open(path.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder)
    except OSError as e:
        if e.errno == errno.ELOOP:
            log.warning("refused: the lineage log %s is a symbolic link", path)
            raise LogRefused(e.errno, f"refused: the lineage log {path} is a symbolic link") from None
        raise
    finally:
        os.close(folder)


def append_line(path: str | Path, line: str) -> None:
    """Append one line (one write, O_APPEND: lines of concurrent writers never interleave)."""
    data = line.encode("utf-8")
    fd = _open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def open_log(path: str | Path) -> BinaryIO:
    """The log, for reading (FileNotFoundError when there is none; LogRefused for a link)."""
    return os.fdopen(_open(path, os.O_RDONLY), "rb")


def signed_lines(path: str | Path, refused: list | None = None) -> Iterator[tuple[bytes, dict]]:
    """(line, event) of every signed line of the log, in order; each other line is logged as
    refused (and its number appended to `refused`). A last line without its newline is one still
    being written: skipped silently. A URI (an object-store run's log, as pushed) is read there."""
    try:  # found once per log, not per line (its path resolved each time cost more than the HMAC)
        key = signing_key()
    except SignatureError:  # a missing or unsafe key: each line is refused by verify_bytes, as before
        key = None
    if is_remote(path):
        import io

        opened = io.BytesIO(read_bytes(*stored(path)))
    else:
        opened = open_log(path)
    with opened as f:
        for n, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break
            line = line.strip()
            if not line:
                continue
            event = verified_line(line, f"{path}:{n}", key)
            if event is None:
                if refused is not None:
                    refused.append(n)
                continue
            yield line, event
