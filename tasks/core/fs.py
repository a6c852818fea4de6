"""Source files by URI through fsspec: local paths and globs, file://, http(s)://, s3://.

* `expand_uri(uri)`: the files a source URI names, sorted. Local paths and `file://` URIs
  become absolute local paths (globs expanded); `s3://` globs are expanded by s3fs; an
  `http(s)://` URI names one file (a glob there is expanded from the server's directory
  listing, as fsspec's HTTP file system does).
* `open_source(uri)`: a buffered binary stream (`io.BufferedReader`, so `peek` works) that
  reads the file front to back in chunks: nothing loads a whole file. Local files and S3 objects
  are seekable (S3 through ranged GETs); HTTP is opened as a plain streaming GET, which works
  with any server (no Range support needed) and is therefore not seekable; readers that would
  seek (WARC resynchronisation after damage) fall back to sequential reading (see `readers`).
* `open_random(uri)`: a seekable file for formats that need random access (Parquet footers).
* `file_identity(uri)`: (uri, size, modification stamp) used in resume keys.

Each takes the source's `storage_options` (`SourceConfig.storage_options`), the keyword
arguments of its fsspec file system: for s3:// e.g. `endpoint_url` (MinIO, R2, a local moto),
`anon`, `key`/`secret`/`token`, `client_kwargs`, `default_block_size` (the size of the ranged
reads `open_source` makes; 8 MiB unless given). A value "${NAME}" is replaced by the environment
variable NAME here, where the file system is made (so in the Ray worker that reads the file), and
never stored. Without options s3fs uses botocore's usual chain: AWS_ACCESS_KEY_ID /
AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN, AWS_PROFILE, AWS_ENDPOINT_URL(_S3), instance roles.
A missing object or a bucket the credentials may not read raises FileNotFoundError /
PermissionError naming the URI (never a credential).

s3:// needs the optional extra `s3` (s3fs); without it `S3ExtraMissing` says so.
"""
from __future__ import annotations

import glob
import io
import os
import re
from pathlib import Path
from typing import Any

from tasks.config import ENV_REF

_URL = re.compile(r"^([a-z][a-z0-9+.\-]*)://")
_CHUNK = 1 << 20
_GLOB_CHARS = re.compile(r"[*?\[]")


class S3ExtraMissing(ImportError):
    pass


def protocol(uri: str) -> str:
    m = _URL.match(uri)
    return m.group(1) if m else "file"


def is_local(uri: str) -> bool:
    return protocol(uri) == "file"


def local_path(uri: str) -> str:
    """A local path for a plain path or a file:// URI."""
    return uri[len("file://"):] if uri.startswith("file://") else uri


def resolve_storage_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """`options` with every "${NAME}" value (nested dicts too) replaced by the environment variable NAME."""
    out: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if isinstance(value, dict):
            out[name] = resolve_storage_options(value)
        elif isinstance(value, str) and (m := ENV_REF.match(value)):
            if m.group(1) not in os.environ:
                raise ValueError(f"storage option {name!r} names the environment variable {m.group(1)}, "
                               "which is not set here")
            out[name] = os.environ[m.group(1)]
        else:
            out[name] = value
    return out


def filesystem(proto: str, storage_options: dict[str, Any] | None = None):
    """The fsspec file system for `proto` made with `storage_options` (env references resolved),
    with a clear error when its optional package is missing."""
    if proto == "s3":
        try:
            import s3fs  # noqa: F401
        except ImportError as e:
            raise S3ExtraMissing("s3:// sources need s3fs, the optional extra 's3': "
                                 "pip install 'crucible[s3]'") from e
    if proto in ("http", "https"):
        try:
            import aiohttp  # noqa: F401
        except ImportError as e:  # pragma: no cover - aiohttp is a pinned dependency
            raise ImportError("http(s):// sources need aiohttp (a pinned dependency of crucible)") from e
    import fsspec

    return fsspec.filesystem(proto, **resolve_storage_options(storage_options))


def _denied(uri: str, e: PermissionError) -> PermissionError:
    """A PermissionError that names the URI and where credentials come from (never their values)."""
    return PermissionError(f"access to {uri} denied ({e}): check the source's credentials (storage_options "
                           "key/secret/token from the environment, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/"
                           "AWS_PROFILE) and its endpoint_url")


def expand_uri(uri: str, storage_options: dict[str, Any] | None = None) -> list[str]:
    """Files named by `uri` (sorted; empty when nothing matches)."""
    proto = protocol(uri)
    if proto == "file":
        path = local_path(uri)
        return sorted(str(Path(p).resolve()) for p in glob.glob(path) if os.path.isfile(p))
    fs = filesystem(proto, storage_options)
    # fresh listings: fsspec caches them for the life of the (shared) file system instance, and a
    # stale one would give stale identities to the resume keys
    fs.invalidate_cache()
    try:
        if _GLOB_CHARS.search(uri.split("://", 1)[1]):
            found = fs.glob(uri)
            paths = [p for p in found if not fs.isdir(p)]
        else:
            paths = [uri] if fs.exists(uri) else []
    except PermissionError as e:
        raise _denied(uri, e) from e
    return sorted(_with_protocol(proto, p) for p in paths)


def _with_protocol(proto: str, path: str) -> str:
    return path if _URL.match(path) else f"{proto}://{path}"


class _RawFile(io.RawIOBase):
    """RawIOBase over an fsspec file so `io.BufferedReader` (peek, readline) can wrap it."""

    def __init__(self, f, seekable: bool):
        self._f = f
        self._seekable = seekable

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self._f.read(len(b))
        n = len(data)
        b[:n] = data
        return n

    def seekable(self) -> bool:
        return self._seekable

    def seek(self, pos: int, whence: int = 0) -> int:
        if not self._seekable:
            raise io.UnsupportedOperation("stream is not seekable")
        return self._f.seek(pos, whence)

    def tell(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        try:
            self._f.close()
        finally:
            super().close()


def open_source(uri: str, storage_options: dict[str, Any] | None = None) -> io.BufferedReader:
    """A buffered, streaming binary reader of `uri` (see the module docstring)."""
    proto = protocol(uri)
    if proto == "file":
        return open(local_path(uri), "rb", buffering=_CHUNK)
    fs = filesystem(proto, storage_options)
    try:
        if proto in ("http", "https"):
            return io.BufferedReader(_RawFile(fs.open(uri, "rb", block_size=0), seekable=False), _CHUNK)
        # ranged reads of default_block_size when the source sets it, else 8 MiB (s3fs's own default is 50 MiB)
        block = None if "default_block_size" in (storage_options or {}) else 8 * _CHUNK
        return io.BufferedReader(_RawFile(fs.open(uri, "rb", block_size=block), seekable=True), _CHUNK)
    except PermissionError as e:
        raise _denied(uri, e) from e


def open_random(uri: str, storage_options: dict[str, Any] | None = None):
    """A seekable binary file (fsspec ranged reads for remote files)."""
    proto = protocol(uri)
    if proto == "file":
        return open(local_path(uri), "rb")
    try:
        return filesystem(proto, storage_options).open(uri, "rb")
    except PermissionError as e:
        raise _denied(uri, e) from e


def file_identity(uri: str, storage_options: dict[str, Any] | None = None) -> list:
    """[uri, size, change stamp]: local mtime_ns; remote ETag / LastModified / mtime if known."""
    proto = protocol(uri)
    if proto == "file":
        st = os.stat(local_path(uri))
        return [uri, st.st_size, st.st_mtime_ns]
    try:
        info = filesystem(proto, storage_options).info(uri)
    except PermissionError as e:
        raise _denied(uri, e) from e
    stamp = next((str(info[k]) for k in ("ETag", "etag", "LastModified", "last_modified", "mtime") if info.get(k)),
                 None)
    return [uri, info.get("size"), stamp]
