"""Training's files on an object store: `out_dir` and `tokens_index` as fsspec URIs
(s3://bucket/prefix/run/train, s3://bucket/prefix/run/tokens/index.json).

A location is a local `Path` (as before) or, on a store, a URI string (`location` turns a command-line
or config value into one). `join`, `name_of`, `parent_of`, `is_file`, `read_text`, `write_text`,
`remove`, `files` and `sha256` take either, so the checkpoint code is written once. On a store they
use the fsspec file system of `storage.options` (tasks.core.fs.filesystem: "${ENV}" credentials are
resolved where it is made, so in each torchrun worker), with fresh listings: other ranks and nodes
write under the same prefix, and fsspec would otherwise answer from its listing cache.

Node-local files, under storage.cache_dir (default ~/.cache/crucible/store) in node/:

* tokens/: the token files of a remote index (`stage_tokens`), named by the sha256 the index
  records and checked against it (and against the size the split's token count implies) before they
  are renamed into place. A file already there is not downloaded again: each node downloads each file
  once, whatever its number of ranks and runs (the launcher stages before torchrun starts, so the
  ranks find them cached); concurrent stagers only race to an atomic rename. An index without
  sha256s (written before they were recorded) is cached by the objects' size and ETag instead.
* train/<hash of out_dir>/: a remote run's working files on this node: the worker config and the
  torchrun log the launcher streams (copied to out_dir when torchrun exits), and rank 0's
  train_log.jsonl / spikes.jsonl (copied to out_dir after each published checkpoint and at the end,
  and brought back from it on resume).
"""
from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path, PurePosixPath

import numpy as np

from tasks.core.fs import file_identity, filesystem, local_path, protocol
from tasks.core.hashing import sha256_file, sha256_text
from tasks.core.storage import CacheBound, default_cache_dir, is_remote, prune_cache, safe_join, touch

_CHUNK = 1 << 20
_BLOCK = 8 * _CHUNK  # ranged reads of 8 MiB (s3fs's own default is 50 MiB)
# the files of a token split that training reads, and the index key of each one's sha256
SPLIT_FILES = (("path", "sha256"), ("doc_starts", "doc_starts_sha256"), ("doc_sources", "doc_sources_sha256"))


def location(value: str | Path) -> Path | str:
    """A path or URI as given: a remote URI stays a string (without a trailing /), anything else
    (a local path, a file:// URI) becomes a Path."""
    if isinstance(value, Path):
        return value
    return value.rstrip("/") if is_remote(value) else Path(local_path(value))


def join(base: Path | str, *parts: str) -> Path | str:
    if is_remote(base):
        return "/".join([base.rstrip("/"), *parts])
    return Path(base).joinpath(*parts)


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


def _key(uri: str) -> str:
    return uri.split("://", 1)[1].rstrip("/")


def files(loc: Path | str, options: dict | None = None) -> dict[str, int]:
    """Every file under the directory `loc` (recursively): relative path -> size, in sha256_tree's
    order (by path parts). Empty when there is none."""
    if not is_remote(loc):
        root = Path(loc)
        found = sorted(p for p in root.rglob("*") if p.is_file())
        return {str(p.relative_to(root)): p.stat().st_size for p in found}
    prefix = _key(loc) + "/"
    try:
        found = store_fs(loc, options).find(loc, detail=True)
    except FileNotFoundError:
        return {}
    out = {k[len(prefix):]: int(info.get("size") or 0) for k, info in found.items()
           if k.startswith(prefix) and not k.endswith("/") and info.get("type", "file") == "file"}
    return dict(sorted(out.items(), key=lambda kv: PurePosixPath(kv[0]).parts))


def sha256(loc: Path | str, options: dict | None = None) -> str:
    """A file's sha256; on a store streamed in ranged reads (nothing is kept)."""
    if not is_remote(loc):
        return sha256_file(loc)
    h = hashlib.sha256()
    with store_fs(loc, options).open(loc, "rb", block_size=_BLOCK) as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def remove_tree(uri: str, options: dict | None = None) -> None:
    """Delete every object under the prefix `uri`."""
    keys = [join(uri, rel) for rel in files(uri, options)]
    if keys:
        store_fs(uri, options).rm(keys)


def download(uri: str, dest: Path, options: dict | None = None) -> Path:
    """Every object under the prefix `uri` into the local directory `dest` (created); returns dest.
    A key that would leave `dest` (`../` in it) is refused (PathEscape) before anything is written."""
    dest.mkdir(parents=True, exist_ok=True)
    fs = store_fs(uri, options)
    found = files(uri, options)
    targets = {rel: safe_join(dest, rel) for rel in found}
    for rel, target in targets.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(join(uri, rel), str(target))
    return dest


def download_file(uri: str, dest: Path, options: dict | None = None) -> None:
    store_fs(uri, options).get_file(uri, str(dest))


def upload(local: Path, uri: str, options: dict | None = None) -> None:
    store_fs(uri, options).put_file(str(local), uri)


# ---------------------------------------------------------------- node-local files

def cache_root(storage) -> Path:
    """This node's cache (StorageConfig.cache_dir, default ~/.cache/crucible/store)."""
    return Path(storage.cache_dir).expanduser().resolve() if storage.cache_dir else default_cache_dir()


def run_work_dir(storage, out_dir: str) -> Path:
    """Where this node keeps a remote run's working files (config, torchrun log, rank 0's logs)."""
    return cache_root(storage) / "node" / "train" / sha256_text(out_dir.rstrip("/"))[:16]


def stage_tokens(index_uri: str, storage) -> tuple[Path, int]:
    """The token index at `index_uri` (on a store) as a node-local index.json whose files are in this
    node's cache (see the module docstring). Returns (local index, number of files downloaded).
    Raises ValueError naming the object when a downloaded file's sha256 or size is not the index's."""
    raw = filesystem(protocol(index_uri), storage.options).cat_file(index_uri)
    index = json.loads(raw)
    cache = cache_root(storage) / "node" / "tokens"
    cache.mkdir(parents=True, exist_ok=True)
    itemsize = np.dtype(index["dtype"]).itemsize
    downloaded, staged = 0, []
    for split in index["splits"].values():
        for key in ("llmc_path", "llmc_sha256"):  # llm.c's copies of the ids: training never reads them
            split.pop(key, None)
        for key, sha_key in SPLIT_FILES:
            if not split.get(key):
                continue
            src = split[key] if is_remote(split[key]) else join(parent_of(index_uri), split[key])
            size = split["tokens"] * itemsize if key == "path" else None
            local, fetched = _cached_file(src, split.get(sha_key), size, cache, storage.options)
            split[key] = str(local)
            staged.append(local)
            downloaded += fetched
    prune_cache(cache, CacheBound.of(storage), keep=staged)  # earlier runs' token files, least recently used first
    local_index = cache / f"index-{hashlib.sha256(raw).hexdigest()[:32]}.json"
    tmp = cache / f".tmp-{uuid.uuid4().hex}-{local_index.name}"
    tmp.write_text(json.dumps(index, indent=2) + "\n")
    os.replace(tmp, local_index)
    return local_index, downloaded


def _cached_file(src: str, sha: str | None, size: int | None, cache: Path, options: dict | None
                 ) -> tuple[Path, int]:
    """`src` in `cache`, named by its recorded sha256 (else by its size and ETag); (path, 1 if downloaded)."""
    if sha:  # the index's value is a name here: one with a '/' or '..' would lead out of the cache
        dest = safe_join(cache, f"{sha}-{name_of(src)}")
    else:
        identity = file_identity(src, options)
        dest = safe_join(cache, f"id-{sha256_text(json.dumps(identity))[:32]}-{name_of(src)}")
        size = identity[1] if size is None else size
    if dest.is_file() and (size is None or dest.stat().st_size == size):
        touch(dest)
        return dest, 0  # only checked files are ever renamed into place
    tmp = cache / f".tmp-{uuid.uuid4().hex}-{dest.name}"
    h, n = hashlib.sha256(), 0
    try:
        with filesystem(protocol(src), options).open(src, "rb", block_size=_BLOCK) as f, open(tmp, "wb") as out:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                out.write(chunk)
                n += len(chunk)
        if size is not None and n != size:
            raise ValueError(f"{src} holds {n} bytes, not the {size} its token index implies")
        if sha and h.hexdigest() != sha:
            raise ValueError(f"{src} does not have the sha256 its token index records ({sha[:16]}...)")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest, 1

