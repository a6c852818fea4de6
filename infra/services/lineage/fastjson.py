"""JSON encoding for the service: orjson when it is installed (it comes with Prefect), else the
standard library. Values orjson refuses (e.g. integers beyond 64 bits) fall back to `json`."""
from __future__ import annotations

import json
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a Prefect dependency
    orjson = None


class _Fragment:
    """Stands in for orjson.Fragment without orjson."""

    def __init__(self, contents: bytes | str):
        self.contents = contents


# Already-encoded JSON placed in a document as is (dumps_bytes copies the bytes, encodes nothing).
Fragment = orjson.Fragment if orjson is not None else _Fragment


def _decode_fragment(obj: Any) -> Any:
    if isinstance(obj, Fragment):
        return json.loads(obj.contents)
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def dumps_bytes(obj: Any) -> bytes:
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except TypeError:
            pass
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=_decode_fragment).encode()


def dumps(obj: Any) -> str:
    return dumps_bytes(obj).decode()


def loads(data: str | bytes) -> Any:
    if orjson is not None:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            if isinstance(data, (bytes, bytearray)):
                data = data.decode("utf-8")  # raises UnicodeDecodeError for bad bytes
    return json.loads(data)
