"""Validate OpenLineage events against the official JSON schemas (Draft 2020-12).

The schemas are not shipped by openlineage-python; they live in ../shared/data/openlineage-spec/
(a copy of the spec's website folder), so `https://openlineage.io/spec/<path>` maps to
`<spec dir>/<path>`. Each event is checked against the event schema and each standard facet against
its own schema (named by the facet's `_schemaURL`). Crucible's custom facets (`crucible_*`) are
checked against their schemas in docs/lineage-facets/ (see docs/lineage-facets.md); a facet whose
`_schemaURL` points anywhere else is only checked by the event schema.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from jsonschema import Draft202012Validator
from referencing import Registry, Resource

try:
    import orjson
except ImportError:  # pragma: no cover - orjson comes with Prefect
    orjson = None

from tasks.config import DEFAULT_DATA_ROOT
from tasks.lineage.facets import CUSTOM_FACET_SCHEMA_BASE, FACET_SCHEMA_DIR

SPEC_URL = "https://openlineage.io/spec/"
EVENT_SCHEMA = SPEC_URL + "2-0-2/OpenLineage.json"
_DEFAULT_SPEC_DIR = str(DEFAULT_DATA_ROOT / "openlineage-spec")  # made once: the service validates every event


@lru_cache(maxsize=4)
def _documents(spec_dir: str, custom_dir: str) -> dict[str, dict]:
    """Every schema document (the spec's and Crucible's facets') by its URL, without fragment: what
    both validators resolve $refs in."""
    docs = {}
    for base, prefix in ((spec_dir, SPEC_URL), (custom_dir, CUSTOM_FACET_SCHEMA_BASE)):
        for p in sorted(Path(base).rglob("*.json")):
            doc = json.loads(p.read_text())
            docs[doc.get("$id", prefix + str(p.relative_to(base))).split("#")[0]] = doc
    return docs


@lru_cache(maxsize=4)
def _registry(spec_dir: str, custom_dir: str) -> Registry:
    return Registry().with_resources((url, Resource.from_contents(doc))
                                     for url, doc in _documents(spec_dir, custom_dir).items())


@lru_cache(maxsize=256)
def _validator(spec_dir: str, url: str, custom_dir: str = str(FACET_SCHEMA_DIR)) -> Draft202012Validator:
    registry = _registry(spec_dir, custom_dir)
    schema = registry.contents(url.split("#")[0])
    if "#" in url and url.split("#", 1)[1]:
        schema = {"$ref": url}
    return Draft202012Validator(schema, registry=registry, format_checker=Draft202012Validator.FORMAT_CHECKER)


def _facets(event: dict):
    """(name, facet) of every facet of the event; parts of the wrong type are left to the event
    schema to report (a malformed event is a 400, never a crash)."""
    def items(obj, key):
        group = obj.get(key) if isinstance(obj, dict) else None
        return group.items() if isinstance(group, dict) else ()

    for key in ("run", "job"):
        yield from items(event.get(key), "facets")
    for side in ("inputs", "outputs"):
        datasets = event.get(side)
        for ds in datasets if isinstance(datasets, list) else ():
            for group in ("facets", "inputFacets", "outputFacets"):
                yield from items(ds, group)


@lru_cache(maxsize=256)
def _fast_validator(spec_dir: str, url: str, custom_dir: str = str(FACET_SCHEMA_DIR)):
    """A compiled (Rust) validator of the same schema, formats checked too; None without jsonschema_rs."""
    try:
        import jsonschema_rs
    except ImportError:
        return None
    docs = _documents(spec_dir, custom_dir)
    return jsonschema_rs.Draft202012Validator({"$ref": url}, validate_formats=True,
                                              retriever=lambda uri: docs[uri.split("#")[0]])


def _fast_valid(event: dict, spec_dir: str) -> bool:
    """True when the event and every facet with a known schema pass the compiled validators; False
    means "check it the slow way" (which also words the errors)."""
    try:
        checks = [(EVENT_SCHEMA, event)]
        for name, facet in _facets(event):
            url = facet.get("_schemaURL", "") if isinstance(facet, dict) else ""
            if url.startswith(SPEC_URL) or url.startswith(CUSTOM_FACET_SCHEMA_BASE):
                checks.append((url, facet))
            elif name.startswith("crucible_"):
                return False
        validators = [(_fast_validator(spec_dir, url), url, doc) for url, doc in checks]
        if any(v is None for v, _, _ in validators):
            return False
        event_check, facet_checks = validators[0], validators[1:]
        return event_check[0].is_valid(event) and all(_facet_valid(v, spec_dir, url, doc)
                                                      for v, url, doc in facet_checks)
    except Exception:  # noqa: BLE001 - an unknown schema or reference: the slow path says what is wrong
        return False


# Facets that passed their schema, by (spec dir, schema URL, encoded facet): ~88% of a log's facets
# repeat one seen before (a job's documentation and code location in each of its events, a raw
# file's source in every run that reads it), and encoding one is ~10x cheaper than checking it.
# Same bytes, same value, same verdict (orjson writes NaN and infinities as null, so a facet with a
# null is never looked up nor kept); only passes are kept. Bounded: cleared when full.
_VALID_FACETS: set[tuple[str, str, bytes]] = set()
_VALID_FACETS_MAX = 4096
_VALID_FACET_BYTES_MAX = 16384  # bigger facets are checked each time (the cache stays <= 64 MB)


def _facet_valid(validator, spec_dir: str, url: str, facet) -> bool:
    try:
        key = (spec_dir, url, orjson.dumps(facet)) if orjson is not None else None
    except TypeError:  # a value orjson does not encode: checked, not cached
        key = None
    if key is not None and b"null" in key[2]:
        key = None
    if key is not None and key in _VALID_FACETS:
        return True
    if not validator.is_valid(facet):
        return False
    if key is not None and len(key[2]) <= _VALID_FACET_BYTES_MAX:
        if len(_VALID_FACETS) >= _VALID_FACETS_MAX:
            _VALID_FACETS.clear()
        _VALID_FACETS.add(key)
    return True


def event_errors(event: dict, spec_dir: str | Path | None = None) -> list[str]:
    """Schema errors for one event (empty list when valid). Checked first by compiled validators
    (jsonschema_rs: the lineage service validates every event it stores); an event they refuse is
    checked again by jsonschema, whose messages name the failing fields."""
    spec_dir = str(spec_dir) if spec_dir else _DEFAULT_SPEC_DIR
    if _fast_valid(event, spec_dir):
        return []
    errors = [f"event {e.json_path}: {e.message}" for e in _validator(spec_dir, EVENT_SCHEMA).iter_errors(event)]
    for name, facet in _facets(event):
        url = facet.get("_schemaURL", "") if isinstance(facet, dict) else ""
        if url.startswith(SPEC_URL) or url.startswith(CUSTOM_FACET_SCHEMA_BASE):
            try:
                validator = _validator(spec_dir, url)
            except Exception as e:  # noqa: BLE001 - an unknown schema is an error of the event
                errors.append(f"facet {name}: schema {url} not found ({type(e).__name__})")
                continue
            errors += [f"facet {name} {e.json_path}: {e.message}" for e in validator.iter_errors(facet)]
        elif name.startswith("crucible_"):
            errors.append(f"facet {name}: _schemaURL {url!r} is not a Crucible facet schema")
    return errors


def read_events(log_path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(log_path).read_text().splitlines() if line.strip()]
