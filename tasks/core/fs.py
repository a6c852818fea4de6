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

Paths under run_root, local or on a store, share one access layer (the rest of this module): a
location is a local `Path` or, on a store, a URI string (`location` turns a command-line or config
value into one), and `join`, `name_of`, `parent_of`, `is_file`, `read_text`, `write_text`,
`read_bytes`, `write_bytes`, `remove`, `files`, `file_names`, `remove_stale_shards`, `sha256`, `tree_sha256`,
`remove_tree`,
`download`, `download_file` and `upload` take either (`link_or_copy`: local files only), so code that reads and writes run files (training's checkpoints, the
triggered flows, the dedup shuffles' spill files) is written once, as datatrove's DataFolder is one
fsspec wrapper for local and remote folders. On a store they use the
fsspec file system of `storage.options` with fresh listings: other ranks, nodes and machines write
under the same prefix, and fsspec would otherwise answer from its listing cache. Keys from a
listing become local paths only through `safe_join`.
"""
from __future__ import annotations

import glob
import hashlib
import io
import os
import re
import shutil
import threading
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

from tasks.config import ENV_REF
from tasks.core.hashing import sha256_file, sha256_tree, tree_digest
from tasks.core.io import atomic_write_bytes

_URL = re.compile(r"^([a-z][a-z0-9+.\-]*)://")
_CHUNK = 1 << 20
READ_CHUNK = _CHUNK
RANGED_READ = 8 * _CHUNK  # the block of a ranged read from a store: 8 MiB (s3fs's own default is 50 MiB)
_GLOB_CHARS = re.compile(r"[*?\[]")


class S3ExtraMissing(ImportError):
    pass


def protocol(uri: str) -> str:
    m = _URL.match(uri)
    return m.group(1) if m else "file"


def is_local(uri: str) -> bool:
    return protocol(uri) == "file"


def is_remote(uri: str | Path) -> bool:
    """A URI string of a protocol other than file:// (a Path is always local)."""
    return isinstance(uri, str) and protocol(uri) != "file"


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
        block = None if "default_block_size" in (storage_options or {}) else RANGED_READ
        return io.BufferedReader(_RawFile(fs.open(uri, "rb", block_size=block), seekable=True), _CHUNK)
    except PermissionError as e:
        raise _denied(uri, e) from e


def open_random(uri: str, storage_options: dict[str, Any] | None = None):
    """A seekable binary file (fsspec ranged reads for remote files)."""
    proto = protocol(uri)
    if proto == "file":
        return open(local_path(uri), "rb")
    # ranged reads of default_block_size when the options set it, else RANGED_READ (s3fs's own 50 MiB
    # read-ahead would fetch far past a Parquet row group)
    block = None if "default_block_size" in (storage_options or {}) else RANGED_READ
    try:
        return filesystem(proto, storage_options).open(uri, "rb", block_size=block)
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


# ---- one access layer for run files, local or on a store ---------------------------------------------


class PathEscape(ValueError):
    """A key or relative path from outside (an object-store listing, an index, an event) that would
    leave the folder it belongs under: refused, never written or read."""


def safe_join(root: str | Path, relative: str | PurePosixPath) -> Path:
    """`root / relative` for a store key or run-relative path that came from outside; PathEscape for
    one that is absolute, has a `..` part or a NUL, or whose place (symbolic links followed) is not
    under `root`. An object key may hold `../` (S3 stores it as given): used as a path unchecked, it
    writes outside the local folder before anything is verified."""
    rel = str(relative)
    if "\0" in rel:
        raise PathEscape(f"refused: {rel!r} holds a NUL byte")
    parts = PurePosixPath(rel).parts
    if rel.startswith(("/", "\\")) or PurePosixPath(rel).is_absolute() or ".." in parts:
        raise PathEscape(f"refused: {rel!r} is not a path inside {root} (absolute, or with a '..' part)")
    base = Path(root)
    joined = base.joinpath(*[p for p in parts if p != "."])
    if not joined.resolve().is_relative_to(base.resolve()):  # a symbolic link on the way leads out
        raise PathEscape(f"refused: {rel!r} leads outside {root} (through a symbolic link)")
    return joined


def location(value: str | Path) -> Path | str:
    """A path or URI as given: a remote URI stays a string (without a trailing /), anything else
    (a local path, a file:// URI) becomes a Path."""
    if isinstance(value, Path):
        return value
    return value.rstrip("/") if is_remote(value) else Path(local_path(value))


def normal_uri(uri: str) -> str:
    """`uri` when its path round-trips unchanged as a path (no empty, '.' or '..' part), else
    PathEscape. S3 keeps `r1//train/x` and `r1/./train/x` as keys of their own, while as paths they
    collapse onto `r1/train/x`: such a name of an attacker's objects would take the place (a report
    slot) of the run's own."""
    parts = uri.split("://", 1)[1].split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise PathEscape(f"refused: {uri!r} is not in normal form (an empty, '.' or '..' part): the store "
                         "keeps it as an object of its own, which as a path would take another's place")
    return uri


def canonical(value: str | Path) -> Path | str:
    """How records name a run file (a checkpoint in a report, a registry tag): an object of a store by
    its URI (in normal form, else PathEscape), a local file by its absolute path; two names of one
    file compare equal."""
    loc = location(value)
    return normal_uri(loc) if is_remote(loc) else loc.resolve()


def join(base: Path | str, *parts: str) -> Path | str:
    if is_remote(base):
        return "/".join([base.rstrip("/"), *parts])
    return Path(base).joinpath(*parts)


def listed_beside(index: Path | str, listed: str) -> Path | str:
    """Where a file that an index lists lies (a token index's split or its doc_starts): `listed` itself
    when it is a URI or an absolute path, else beside the index; on a store in normal form (PathEscape
    otherwise: `../` or `//` in a listed name would name another object)."""
    if is_remote(listed):
        return normal_uri(listed)
    if is_remote(index):
        return normal_uri(join(parent_of(index), listed))
    return Path(listed) if Path(listed).is_absolute() else Path(index).parent / listed


def name_of(loc: Path | str) -> str:
    return loc.rstrip("/").rsplit("/", 1)[-1] if is_remote(loc) else Path(loc).name


def parent_of(loc: Path | str) -> Path | str:
    return loc.rstrip("/").rsplit("/", 1)[0] if is_remote(loc) else Path(loc).parent


def store_fs(uri: str, options: dict | None):
    """The file system of `uri` with its listing cache dropped (other processes write there too)."""
    fs = filesystem(protocol(uri), options)
    fs.invalidate_cache()
    return fs


def is_file(loc: Path | str, options: dict | None = None) -> bool:
    return store_fs(loc, options).isfile(loc) if is_remote(loc) else Path(loc).is_file()


def read_text(loc: Path | str, options: dict | None = None) -> str:
    if is_remote(loc):
        return store_fs(loc, options).cat_file(loc).decode("utf-8")
    return Path(loc).read_text()


def write_text(loc: Path | str, text: str, options: dict | None = None) -> None:
    """On a store one PUT: a reader sees the old object or the whole new one, never a part."""
    if is_remote(loc):
        store_fs(loc, options).pipe_file(loc, text.encode("utf-8"))
    else:
        Path(loc).write_text(text)


def remove(loc: Path | str, options: dict | None = None) -> None:
    """Delete a file; one that is not there is fine."""
    if not is_remote(loc):
        Path(loc).unlink(missing_ok=True)
        return
    try:
        store_fs(loc, options).rm_file(loc)
    except FileNotFoundError:
        pass


def files(loc: Path | str, options: dict | None = None) -> dict[str, int]:
    """Every file under the directory `loc` (recursively): relative path -> size, in sha256_tree's
    order (by path parts). Empty when there is none."""
    if not is_remote(loc):
        root = Path(loc)
        found = sorted(p for p in root.rglob("*") if p.is_file())
        return {str(p.relative_to(root)): p.stat().st_size for p in found}
    prefix = loc.split("://", 1)[1].rstrip("/") + "/"
    try:
        found = store_fs(loc, options).find(loc, detail=True)
    except FileNotFoundError:
        return {}
    out = {k[len(prefix):]: int(info.get("size") or 0) for k, info in found.items()
           if k.startswith(prefix) and not k.endswith("/") and info.get("type", "file") == "file"}
    return dict(sorted(out.items(), key=lambda kv: PurePosixPath(kv[0]).parts))


def file_names(folder: Path | str, options: dict | None = None) -> list[str]:
    """The files directly in `folder` (sorted names; none when it is not there). One level only: a
    stage's folder also holds its `_parts`, which a recursive listing would walk."""
    if not is_remote(folder):
        try:
            return sorted(e.name for e in os.scandir(folder) if e.is_file())
        except FileNotFoundError:
            return []
    try:
        found = store_fs(folder, options).ls(folder, detail=True)
    except FileNotFoundError:
        return []
    return sorted(name_of(f["name"]) for f in found if f.get("type", "file") == "file")


def remove_stale_shards(folder: Path | str, keep, options: dict | None = None) -> list[str]:
    """Delete the `shard-*.parquet` files directly in `folder` whose names are not in `keep` (this
    run's shards): what a killed earlier run with more shards left beside them, which a manifest
    written next would not list. Call it once this run's shards are written, before its manifest.
    Returns the names removed."""
    keep = set(keep)
    stale = [n for n in file_names(folder, options) if n.startswith("shard-") and n.endswith(".parquet")
             and n not in keep]
    for n in stale:
        remove(join(folder, n), options)
    return stale


def link_or_copy(src: str | Path, dst: str | Path) -> None:
    """`dst` as the same file as `src`: a hard link (no bytes copied), a copy (with its metadata)
    where the file system has none or they are on different devices. `shutil.copytree`'s
    `copy_function` signature."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def sha256(loc: Path | str, options: dict | None = None) -> str:
    """A file's sha256; on a store streamed in ranged reads (nothing is kept)."""
    if not is_remote(loc):
        return sha256_file(loc)
    h = hashlib.sha256()
    with store_fs(loc, options).open(loc, "rb", block_size=RANGED_READ) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def copy_checked(loc: Path | str, out, expect: str | None, options: dict | None = None) -> None:
    """Append the file `loc` (local or on a store) to the open binary `out`, hashed on the same read;
    StorageError when `expect` is given and the bytes are not those it names. The caller writes `out`
    to a temporary file and renames it into place only after this returns: what is checked is what
    is used (a second, unchecked read could see an object replaced on the store meanwhile)."""
    h = hashlib.sha256()
    with open_random(str(loc), options) as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            out.write(chunk)
    if expect is not None and h.hexdigest() != expect:
        raise _changed(loc, h.hexdigest(), expect)


def read_checked(loc: Path | str, expect: str, options: dict | None = None) -> bytes:
    """The bytes of `loc` (local or one GET on a store), held to the sha256 `expect` (StorageError)."""
    data = read_bytes(loc, options)
    if (got := hashlib.sha256(data).hexdigest()) != expect:
        raise _changed(loc, got, expect)
    return data


def _changed(loc: Path | str, got: str, expect: str) -> "StorageError":
    return StorageError(f"{loc}: its bytes are not those its job reported (sha256 {got[:16]}..., recorded "
                        f"{expect[:16]}...): changed after the job wrote it; nothing is merged from it")


def tree_sha256(loc: Path | str, options: dict | None = None) -> str:
    """`tasks.core.hashing.sha256_tree` of a file or directory, local or on a store: a checkpoint
    on a store hashes to what its downloaded copy would, its objects streamed (nothing is kept)."""
    if not is_remote(loc):
        return sha256_tree(loc)
    found = files(loc, options)
    if not found and is_file(loc, options):
        return sha256(loc, options)
    return tree_digest((rel, sha256(join(loc, rel), options)) for rel in found)


def remove_tree(loc: Path | str, options: dict | None = None) -> None:
    """Delete the directory `loc` (on a store: every object under the prefix); none is fine."""
    if not is_remote(loc):
        shutil.rmtree(loc, ignore_errors=True)
        return
    keys = [join(loc, rel) for rel in files(loc, options)]
    if keys:
        store_fs(loc, options).rm(keys)


def read_bytes(loc: Path | str, options: dict | None = None) -> bytes:
    return store_fs(loc, options).cat_file(loc) if is_remote(loc) else Path(loc).read_bytes()


def write_bytes(loc: Path | str, data: bytes, options: dict | None = None) -> None:
    """A file whole or not at all: on a store one PUT (the object appears complete), locally a
    temporary file renamed into place (its directory made)."""
    if is_remote(loc):
        store_fs(loc, options).pipe_file(loc, data)
    else:
        atomic_write_bytes(loc, data, fsync=False)


def download(uri: str, dest: Path, options: dict | None = None) -> Path:
    """Every object under the prefix `uri` into the local directory `dest` (created), fetched
    concurrently; returns dest. A key that would leave `dest` (`../` in it) is refused (PathEscape)
    before anything is written."""
    dest.mkdir(parents=True, exist_ok=True)
    found = files(uri, options)
    targets = {rel: safe_join(dest, rel) for rel in found}
    for target in targets.values():
        target.parent.mkdir(parents=True, exist_ok=True)
    if targets:
        store_fs(uri, options).get([join(uri, rel) for rel in targets], [str(t) for t in targets.values()])
    return dest


def download_file(uri: str, dest: Path, options: dict | None = None) -> None:
    store_fs(uri, options).get_file(uri, str(dest))


def upload(local: Path, uri: str, options: dict | None = None) -> None:
    store_fs(uri, options).put_file(str(local), uri)


class StorageError(RuntimeError):
    """The object store cannot be used: names the URI, the setting and what to check (never a secret)."""


def check_store(root: str, options: dict | None, timeout: float = 20.0, setting: str = "run_root",
                options_setting: str = "storage.options") -> None:
    """Write and delete a probe object under the store URI `root`, within `timeout` seconds; a
    StorageError names `setting` (the URI's setting) and `options_setting` (its options') otherwise:
    a missing bucket or a refused key fails here, before anything is written, in seconds."""
    outcome: dict[str, BaseException | None] = {}
    root = root.rstrip("/")

    def probe() -> None:
        try:
            fs = filesystem(protocol(root), options)
            key = f"{root}/.crucible-probe-{uuid.uuid4().hex}"
            fs.pipe_file(key, b"probe")
            fs.rm_file(key)
            outcome["error"] = None
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome["error"] = e

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    t.join(timeout)
    where = f"{setting} {root}"
    if "error" not in outcome:
        raise StorageError(f"{where}: the object store did not answer within {timeout:.0f} s; check "
                           f"{options_setting}.endpoint_url")
    e = outcome["error"]
    if e is None:
        return
    bucket = root.split("://", 1)[1].split("/", 1)[0]
    if isinstance(e, FileNotFoundError):
        raise StorageError(f"{where}: the bucket {bucket!r} does not exist ({e}); create it or fix "
                           f"{setting}") from None
    if isinstance(e, PermissionError):
        raise StorageError(f"{where}: access denied ({e}); check the credentials ({options_setting} key/secret "
                           "as ${ENV_VAR} references, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_PROFILE)"
                           ) from None
    raise StorageError(f"{where}: the object store failed ({type(e).__name__}: {e}); check "
                       f"{options_setting}") from None
