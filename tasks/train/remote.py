"""Training's token files on an object store: the node cache that `tokens_index` as an fsspec URI
(s3://bucket/prefix/run/tokens/index.json) is read through. Every other file of training (the
checkpoints, logs and records under `out_dir`) is read and written directly through the one access
layer of run files, `tasks.core.fs` (DCP writes its shards there through its fsspec writer).

Why a cache here and nowhere else: training reads random windows of the token files every step,
and each window from the store is a ranged GET (`benchmarks/results/token_cache.json`: measured
per-batch read times from the store vs the cached file); a node caches each file once for all its
ranks and runs.

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
from pathlib import Path

import numpy as np

from tasks.core.fs import RANGED_READ, READ_CHUNK, file_identity, filesystem, is_remote, join, name_of, parent_of, \
    protocol, safe_join
from tasks.core.hashing import sha256_text
from tasks.core.storage import CacheBound, default_cache_dir, prune_cache, touch
from tasks.tokens.binfile import SPLIT_FILES  # the files of a token split training reads, with their sha256 keys


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
        with filesystem(protocol(src), options).open(src, "rb", block_size=RANGED_READ) as f, open(tmp, "wb") as out:
            while chunk := f.read(READ_CHUNK):
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

