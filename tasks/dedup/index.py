"""Incremental MinHash index: persist LSH band keys, dedup new documents against them.

Continued pretraining adds documents to a corpus that is already deduplicated: the new ones must
be checked against everything kept before, without recomputing old signatures. The index holds
one 64-bit key per (document, band) — the band index mixed into `tasks.dedup.cluster.band_hashes`
of that band's rows — in a sorted uint64 array with a parallel int32 array of document numbers
(12 bytes a key: 1.7 GB on disk for 10 M documents × 14 bands), the document ids once each, and a
sorted 64-bit hash of each id (to recognise a document indexed before under the same id).

On disk the arrays are `.npy` files and the ids an uncompressed Arrow IPC file, all memory-mapped
when the index is opened: a lookup is one `np.searchsorted` per batch, which touches a few pages of
each array, so a run's memory grows with the documents it adds, not with the size of the index.
This run's additions stay in memory (sorted) until `save`, which merges them into the arrays in
fixed-size chunks (memory bounded by the chunk and the additions) and writes a new generation
directory (written under a temporary name, then renamed); `meta.json`, replaced atomically last,
names the current generation, so a crash mid-save leaves the previous index intact, and a save
refuses to overwrite a generation another writer saved after this index was opened.

`add(ids, signatures)` checks each new document against the index (and against the new documents
before it) and returns, per document, the id of the earlier document it shares a band key with
(None: new, now indexed). Duplicates are not indexed (their survivor already is). A document
whose own id is already indexed is not its own duplicate (a re-run of the same corpus). Unverified:
a shared band key is the LSH candidate test (p ≈ 0.92 at Jaccard 0.8 with 14×8).

`index_dir` may be an object-store URI (`s3://bucket/prefix`; its options: run_root's store when
the URI lies under it, else `storage.options`, `tasks.core.storage.store_for_uri`). The store is
read and written directly (`tasks.core.fs`): opening reads the store's `meta.json` and fetches the
generation it names into a local read-through copy under `storage.cache_dir`, since the arrays are
memory-mapped (a lookup is a few pages of each; as ranged GETs it would be one request per page),
and a generation already there at the store's sizes is not fetched again. A save checks the
generation against the store's `meta.json` (another machine may have saved since), writes the new
generation locally, uploads it and then `meta.json`, and deletes the older generations from the
store. An unusable store fails naming `curate.dedup.minhash.index_dir`.

A run with other LSH parameters or another shingle hash ("fast" / "sha1": their signatures are not
comparable) is refused. An index written by the previous format (2: Parquet tables, loaded whole)
is read and rewritten in this format by the next save.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.core.fs import download, download_file, files, is_file, store_fs
from tasks.core.io import atomic_write_bytes, atomic_write_text
from tasks.core.storage import RunStore, is_remote, store_for_uri
from tasks.dedup.cluster import band_hashes
from tasks.dedup.minhash import fmix64

FORMAT = 3
MERGE_CHUNK = 1 << 22  # index entries merged per step by save (~80 MB of working memory)
_ARRAYS = ("keys", "docs", "id_hashes", "id_docs")
SETTING = "curate.dedup.minhash.index_dir"
LOCK = ".save.lock"  # an object-store index's save lock (RunStore.exclusive), beside meta.json
LOCK_TIMEOUT_S = 600.0


def _on_store(directory: str | Path) -> tuple[RunStore, str] | None:
    """(store, key of the index under its root) for an object-store `directory`, else None."""
    return store_for_uri(str(directory), SETTING) if is_remote(str(directory)) else None


def _key(rel: str, name: str) -> str:
    return name if rel == "." else f"{rel}/{name}"


def check_index_store(cfg) -> None:
    """An object-store MinHash index's bucket, checked before a run writes anything (StorageError
    naming curate.dedup.minhash.index_dir): not first found when curate opens the index."""
    mh = cfg.curate.dedup.minhash
    if mh.enabled and mh.index_dir and is_remote(mh.index_dir):
        store_for_uri(mh.index_dir, SETTING, cfg.storage.check_timeout, cfg.storage)


def _fetch_meta(store: RunStore, rel: str) -> Path:
    """The store's `meta.json` of the index in its local copy (removed there when the store has
    none: a new index). Returns the local copy's folder."""
    local = store.local_root / rel
    local.mkdir(parents=True, exist_ok=True)
    uri = store.uri(_key(rel, "meta.json"))
    try:
        atomic_write_bytes(local / "meta.json", store_fs(uri, store.options).cat_file(uri), fsync=False)
    except FileNotFoundError:
        (local / "meta.json").unlink(missing_ok=True)
    return local


def _fetch(uri: str, dest: Path, options: dict) -> None:
    """`dest` made the store's `uri` (a generation folder, or a format-2 table file), downloaded
    unless every file is there already at the store's size (generations are never rewritten in
    place: a save that fails to upload removes its local generation)."""
    found = files(uri, options)
    if found:
        if all((dest / r).is_file() and (dest / r).stat().st_size == n for r, n in found.items()):
            return
        shutil.rmtree(dest, ignore_errors=True)
        download(uri, dest, options)
    elif is_file(uri, options) and not dest.is_file():
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        download_file(uri, tmp, options)
        os.replace(tmp, dest)


def local_index_dir(directory: str | Path) -> Path:
    """Where the index in `directory` is read: the path itself, or for an object-store URI the
    local copy of the store's current generation."""
    on_store = _on_store(directory)
    if on_store is None:
        return Path(directory)
    store, rel = on_store
    local = _fetch_meta(store, rel)
    if (local / "meta.json").is_file():
        meta = json.loads((local / "meta.json").read_text())
        names = [f"gen-{meta.get('generation', 0):06d}"] if meta.get("format") == FORMAT else \
            ["index.parquet", "ids.parquet"]
        for name in names:
            _fetch(store.uri(_key(rel, name)), local / name, store.options)
    return local


def _upload_generation(store: RunStore, rel: str, d: Path, gen: str) -> None:
    """The saved generation `d/gen` to the store, then `meta.json` (a reader follows meta.json, so
    it never names a generation not yet whole there), then the store's older generations deleted."""
    base = store.uri(rel)
    fs = store_fs(base, store.options)
    local = files(d / gen)
    fs.put([str(d / gen / r) for r in local], [f"{base}/{gen}/{r}" for r in local])
    fs.put_file(str(d / "meta.json"), f"{base}/meta.json")
    stale = [f"{base}/{k}" for k in files(base, store.options)
             if k.startswith(("gen-", ".gen-", "index.parquet", "ids.parquet")) and not k.startswith(gen + "/")]
    if stale:
        fs.rm(stale)


def index_keys(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n, bands) uint64 index keys: each band's hash with its band number mixed in."""
    h = band_hashes(signatures, bands, rows)
    band_salt = fmix64(np.arange(1, bands + 1, dtype=np.uint64))
    return fmix64(h ^ band_salt[None, :])


def id_hashes(ids: Sequence[str]) -> np.ndarray:
    """uint64 hash of each document id (BLAKE2b, 8 bytes)."""
    return np.array([int.from_bytes(hashlib.blake2b(i.encode("utf-8"), digest_size=8).digest(), "little")
                     for i in ids], dtype=np.uint64)


def sorted_lookup(keys: np.ndarray, values: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """values[k] of the first k with keys[k] == query (keys sorted), -1 where absent."""
    if not len(keys):
        return np.full(queries.shape, -1, dtype=np.int64)
    flat = queries.reshape(-1)
    order = np.argsort(flat)
    # sorted queries: each search starts where the last ended, and a memory-mapped index is read
    # front to back instead of at random
    pos = np.empty(len(flat), dtype=np.int64)
    pos[order] = np.minimum(np.searchsorted(keys, flat[order]), len(keys) - 1)
    return np.where(keys[pos] == flat, values[pos], -1).reshape(queries.shape)


def merge_sorted_into(base_keys: np.ndarray, base_vals: np.ndarray, new_keys: np.ndarray, new_vals: np.ndarray,
                      keys_path: Path, vals_path: Path, chunk: int = MERGE_CHUNK) -> None:
    """Write the merge of two sorted (key, value) arrays to two .npy files; on equal keys the base
    entries come first. The base may be memory-mapped: it is read `chunk` entries at a time."""
    n = len(base_keys) + len(new_keys)
    out_k = np.lib.format.open_memmap(keys_path, mode="w+", dtype=np.uint64, shape=(n,))
    out_v = np.lib.format.open_memmap(vals_path, mode="w+", dtype=base_vals.dtype, shape=(n,))
    # new entry j lands after the base entries <= its key and after the new entries before it
    pos = np.searchsorted(base_keys, new_keys, side="right")
    if len(new_keys):
        at = pos + np.arange(len(new_keys))
        out_k[at], out_v[at] = new_keys, new_vals
    for a in range(0, len(base_keys), chunk):
        b = min(a + chunk, len(base_keys))
        at = np.arange(a, b) + np.searchsorted(pos, np.arange(a, b), side="right")
        out_k[at], out_v[at] = base_keys[a:b], base_vals[a:b]
    out_k.flush()
    out_v.flush()
    del out_k, out_v


class MinHashIndex:
    def __init__(self, bands: int = 14, rows: int = 8, seed: int = 1, scheme: str = "affine32",
                 hash: str = "fast"):
        self.bands, self.rows, self.seed, self.scheme, self.hash = bands, rows, seed, scheme, hash
        self.generation = 0
        # what earlier runs saved: sorted, memory-mapped when loaded from format 3
        self._keys = np.empty(0, dtype=np.uint64)
        self._docs = np.empty(0, dtype=np.int32)
        self._id_hashes = np.empty(0, dtype=np.uint64)
        self._id_docs = np.empty(0, dtype=np.int32)
        self._ids: pa.ChunkedArray = pa.chunked_array([], pa.string())
        # this run's additions, sorted, in memory until save
        self._new_keys = np.empty(0, dtype=np.uint64)
        self._new_docs = np.empty(0, dtype=np.int32)
        self._new_ids: list[str] = []
        self._new_number: dict[str, int] = {}

    @property
    def docs(self) -> int:
        return len(self._ids) + len(self._new_ids)

    @property
    def keys(self) -> int:
        return len(self._keys) + len(self._new_keys)

    @property
    def key_array(self) -> np.ndarray:
        """Every key, sorted (materialised in memory: for inspection and tests, not for large indexes)."""
        return np.sort(np.concatenate([np.asarray(self._keys), self._new_keys]), kind="stable")

    @property
    def ids(self) -> list[str]:
        """Every indexed id in document-number order (materialised: for inspection and tests)."""
        return self._ids.to_pylist() + self._new_ids

    @property
    def memory_mapped(self) -> bool:
        return isinstance(self._keys, np.memmap)

    def meta(self) -> dict:
        return {"format": FORMAT, "bands": self.bands, "rows": self.rows, "seed": self.seed, "scheme": self.scheme,
                "hash": self.hash, "docs": self.docs, "keys": self.keys, "generation": self.generation}

    def _id_of(self, number: int) -> str:
        base = len(self._ids)
        return self._ids[number].as_py() if number < base else self._new_ids[number - base]

    def _own_numbers(self, ids: Sequence[str]) -> list[int]:
        """Document number of each id if it is indexed already, else -1."""
        found = sorted_lookup(self._id_hashes, self._id_docs, id_hashes(ids)) if len(self._id_hashes) else None
        out = []
        for k, doc_id in enumerate(ids):
            number = self._new_number.get(doc_id, -1)
            if number < 0 and found is not None and found[k] >= 0 and self._id_of(int(found[k])) == doc_id:
                number = int(found[k])  # (a 64-bit hash collision of two ids is checked against the id)
            out.append(number)
        return out

    def add(self, ids: Sequence[str], signatures: Sequence[np.ndarray | None],
            within_batch: bool = True, earlier_runs_only: bool = False) -> list[str | None]:
        """Per document the id of the indexed document it shares a band key with (None: new,
        added). `within_batch=False`: two documents of this batch are never each other's
        duplicates (the caller's clustering has decided between them). `earlier_runs_only`: nor
        a document this index added before (one run's documents added batch by batch, as if in
        one batch with `within_batch=False`)."""
        valid = [k for k, s in enumerate(signatures) if s is not None]
        out: list[str | None] = [None] * len(ids)
        if not valid:
            return out
        keys = index_keys(np.stack([signatures[k] for k in valid]), self.bands, self.rows)
        # earlier runs' documents first, then this run's (the earlier document wins a shared key)
        found = sorted_lookup(self._keys, self._docs, keys)
        if not earlier_runs_only:
            found = np.where(found >= 0, found, sorted_lookup(self._new_keys, self._new_docs, keys))
        own_numbers = self._own_numbers([ids[k] for k in valid])
        hit_rows = (found >= 0).any(axis=1)
        # keys two documents of this batch share: only those can make one a duplicate of the other
        _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
        shared = (counts[inverse.reshape(-1)] > 1).reshape(keys.shape) & within_batch
        shared_rows = shared.any(axis=1)
        batch: dict[int, int] = {}  # shared keys of this batch's new documents -> document number
        added_rows, numbers = [], []
        number = self.docs
        for row, k in enumerate(valid):
            own = own_numbers[row]
            if own < 0:  # the same id may have been added earlier in this batch
                own = self._new_number.get(ids[k], -1)
            if own >= 0:  # already indexed: kept by the run that indexed it (which may have kept
                continue  # two documents sharing a band key: the clustering's representative check)
            if not hit_rows[row] and not shared_rows[row]:  # the common case: new
                hit = None
            else:
                hit = next((int(d) for d in found[row] if d >= 0), None) if hit_rows[row] else None
                if hit is None and shared_rows[row]:
                    hit = next((batch[int(x)] for x in keys[row][shared[row]] if int(x) in batch), None)
            if hit is not None:
                out[k] = self._id_of(hit)
                continue
            self._new_ids.append(ids[k])
            self._new_number[ids[k]] = number
            if shared_rows[row]:
                for x in keys[row][shared[row]]:
                    batch.setdefault(int(x), number)
            added_rows.append(row)
            numbers.append(number)
            number += 1
        if added_rows:
            all_keys = np.concatenate([self._new_keys, keys[added_rows].reshape(-1)])
            all_docs = np.concatenate([self._new_docs, np.repeat(np.asarray(numbers, dtype=np.int32), self.bands)])
            order = np.argsort(all_keys, kind="stable")  # equal keys: the earlier document first
            self._new_keys, self._new_docs = all_keys[order], all_docs[order]
        return out

    def save(self, directory: str | Path) -> Path:
        """Write base + additions as a new generation, switch meta.json to it, drop older ones; for
        an object-store `directory`, in its local copy, then uploaded (meta.json last)."""
        on_store = _on_store(directory)
        if on_store is None:
            return self._save(Path(directory))
        store, rel = on_store
        # one save at a time on any machine: the generation check and the upload are one step
        with store.exclusive(_key(rel, LOCK), SETTING, timeout=LOCK_TIMEOUT_S):
            d = self._save(_fetch_meta(store, rel))  # checked against the store's generation
            gen = f"gen-{self.generation:06d}"
            try:
                _upload_generation(store, rel, d, gen)
            except BaseException:  # not the store's: a later open must fetch the store's instead
                shutil.rmtree(d / gen, ignore_errors=True)
                (d / "meta.json").unlink(missing_ok=True)
                raise
        return d

    def _save(self, d: Path) -> Path:
        d.mkdir(parents=True, exist_ok=True)
        on_disk = json.loads((d / "meta.json").read_text()).get("generation", 0) if (d / "meta.json").is_file() else 0
        if on_disk != self.generation:  # another writer saved since this index was opened
            raise RuntimeError(f"index {d} is at generation {on_disk}, this one was opened at {self.generation}: "
                               "reopen it and add again (one writer at a time)")
        generation = self.generation + 1
        gen = d / f"gen-{generation:06d}"
        tmp_gen = d / f".gen-{generation:06d}.tmp-{os.getpid()}"
        shutil.rmtree(tmp_gen, ignore_errors=True)
        tmp_gen.mkdir()
        final_gen, gen = gen, tmp_gen
        merge_sorted_into(self._keys, self._docs, self._new_keys, self._new_docs,
                          gen / "keys.npy", gen / "docs.npy")
        new_numbers = np.arange(len(self._ids), self.docs, dtype=np.int32)
        new_hashes = id_hashes(self._new_ids)
        order = np.argsort(new_hashes, kind="stable")
        merge_sorted_into(self._id_hashes, self._id_docs, new_hashes[order], new_numbers[order],
                          gen / "id_hashes.npy", gen / "id_docs.npy")
        schema = pa.schema([("id", pa.string())])
        with pa.OSFile(str(gen / "ids.arrow"), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for chunk in self._ids.chunks:
                for a in range(0, len(chunk), MERGE_CHUNK):
                    writer.write_batch(pa.record_batch([chunk.slice(a, MERGE_CHUNK)], schema=schema))
            if self._new_ids:
                writer.write_batch(pa.record_batch([pa.array(self._new_ids, pa.string())], schema=schema))
        for f in gen.iterdir():  # the data is on disk before meta.json points at it
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        shutil.rmtree(final_gen, ignore_errors=True)  # left by a save that died before its meta.json
        gen.rename(final_gen)
        self.generation = generation
        atomic_write_text(d / "meta.json", json.dumps(self.meta(), indent=2) + "\n")
        dir_fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dir_fd)  # the renames themselves are durable
        finally:
            os.close(dir_fd)
        for old in d.iterdir():  # earlier generations, crashed saves' leftovers, the format-2 tables
            if old != final_gen and old.is_dir() and (old.name.startswith(("gen-", ".gen-"))):
                shutil.rmtree(old, ignore_errors=True)
            elif old.name in ("index.parquet", "ids.parquet"):
                old.unlink()
        self._open_generation(final_gen)
        return d

    def _open_generation(self, gen: Path) -> None:
        arrays = {name: np.load(gen / f"{name}.npy", mmap_mode="r") for name in _ARRAYS}
        self._keys, self._docs = arrays["keys"], arrays["docs"]
        self._id_hashes, self._id_docs = arrays["id_hashes"], arrays["id_docs"]
        self._ids = pa.ipc.open_file(pa.memory_map(str(gen / "ids.arrow"))).read_all().column("id")
        self._new_keys = np.empty(0, dtype=np.uint64)
        self._new_docs = np.empty(0, dtype=np.int32)
        self._new_ids, self._new_number = [], {}

    def _load_format2(self, d: Path) -> None:
        t = pq.read_table(d / "index.parquet")
        self._keys = t["key"].to_numpy().astype(np.uint64)
        self._docs = t["doc"].to_numpy().astype(np.int32)
        self._ids = pq.read_table(d / "ids.parquet")["id"]
        hashes = id_hashes(self._ids.to_pylist())
        order = np.argsort(hashes, kind="stable")
        self._id_hashes, self._id_docs = hashes[order], order.astype(np.int32)

    @classmethod
    def load(cls, directory: str | Path, bands: int | None = None, rows: int | None = None,
             seed: int | None = None, scheme: str | None = None, hash: str | None = None) -> "MinHashIndex":
        d = local_index_dir(directory)
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("format") not in (2, FORMAT):
            raise ValueError(f"index {d} has format {meta.get('format', 1)}, this version reads 2 and {FORMAT}: "
                             "rebuild it")
        for name, want in (("bands", bands), ("rows", rows), ("seed", seed), ("scheme", scheme), ("hash", hash)):
            if want is not None and meta[name] != want:
                raise ValueError(f"index {d} has {name}={meta[name]!r}, this run wants {want!r}: {_fix(name, meta)}")
        idx = cls(meta["bands"], meta["rows"], meta["seed"], meta["scheme"], meta["hash"])
        if meta["format"] == 2:
            idx._load_format2(d)
        else:
            idx.generation = meta["generation"]
            idx._open_generation(d / f"gen-{idx.generation:06d}")
        if idx.docs != meta["docs"] or idx.keys != meta["keys"] or len(idx._id_hashes) != meta["docs"]:
            raise ValueError(f"index {d} is incomplete: meta.json does not match its arrays")
        return idx

    @classmethod
    def open(cls, directory: str | Path, bands: int, rows: int, seed: int, scheme: str, hash: str) -> "MinHashIndex":
        """The index in `directory` (a path or an object-store URI), or a new empty one with these
        parameters."""
        d = local_index_dir(directory)
        if (d / "meta.json").is_file():
            return cls.load(d, bands, rows, seed, scheme, hash)
        return cls(bands, rows, seed, scheme, hash)


def _fix(name: str, meta: dict) -> str:
    """The setting that makes a run read a saved index whose `name` differs (or: a new index_dir)."""
    key = "curate.dedup.minhash"
    if name in ("bands", "rows"):
        return (f"its keys band the signature {meta['bands']} x {meta['rows']}; set {key}.index_rows: "
                f"{meta['rows']} (the index's bands are bands x rows / index_rows of the signature's values, "
                f"{meta['bands'] * meta['rows']} when it was saved), or point {key}.index_dir at a new index")
    return f"set {key}.{name}: {meta[name]!r}, or point {key}.index_dir at a new index"
