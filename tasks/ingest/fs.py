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

s3:// needs the optional extra `s3` (s3fs); without it `S3ExtraMissing` says so.
"""
from __future__ import annotations

import glob
import io
import os
import re
from pathlib import Path

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


def filesystem(proto: str):
    """The fsspec file system for `proto`, with a clear error when its optional package is missing."""
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

    return fsspec.filesystem(proto)


def expand_uri(uri: str) -> list[str]:
    """Files named by `uri` (sorted; empty when nothing matches)."""
    proto = protocol(uri)
    if proto == "file":
        path = local_path(uri)
        return sorted(str(Path(p).resolve()) for p in glob.glob(path) if os.path.isfile(p))
    fs = filesystem(proto)
    if _GLOB_CHARS.search(uri.split("://", 1)[1]):
        found = fs.glob(uri)
        paths = [p for p in found if not fs.isdir(p)]
    else:
        paths = [uri] if fs.exists(uri) else []
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


def open_source(uri: str) -> io.BufferedReader:
    """A buffered, streaming binary reader of `uri` (see the module docstring)."""
    proto = protocol(uri)
    if proto == "file":
        return open(local_path(uri), "rb", buffering=_CHUNK)
    fs = filesystem(proto)
    if proto in ("http", "https"):
        return io.BufferedReader(_RawFile(fs.open(uri, "rb", block_size=0), seekable=False), _CHUNK)
    return io.BufferedReader(_RawFile(fs.open(uri, "rb", block_size=8 * _CHUNK), seekable=True), _CHUNK)


def open_random(uri: str):
    """A seekable binary file (fsspec ranged reads for remote files)."""
    proto = protocol(uri)
    if proto == "file":
        return open(local_path(uri), "rb")
    return filesystem(proto).open(uri, "rb")


def file_identity(uri: str) -> list:
    """[uri, size, change stamp]: local mtime_ns; remote ETag / LastModified / mtime if known."""
    proto = protocol(uri)
    if proto == "file":
        st = os.stat(local_path(uri))
        return [uri, st.st_size, st.st_mtime_ns]
    info = filesystem(proto).info(uri)
    stamp = next((str(info[k]) for k in ("ETag", "etag", "LastModified", "last_modified", "mtime") if info.get(k)),
                 None)
    return [uri, info.get("size"), stamp]
