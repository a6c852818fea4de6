"""Incremental MinHash index: persist LSH band keys, dedup new documents against them.

Continued pretraining adds documents to a corpus that is already deduplicated: the new ones must
be checked against everything kept before, without recomputing old signatures. The index holds
one 64-bit key per (document, band) — the band index mixed into `tasks.dedup.cluster.band_hashes`
of that band's rows — in a sorted uint64 array with a parallel array of document numbers, and the
document ids once each: 12 bytes per key (1.7 GB for 10 M documents × 14 bands, where a Python
dict of byte strings needs ~15 GB). A lookup is one `np.searchsorted` per batch of documents.

`add(ids, signatures)` checks each new document against the index (and against the new documents
before it) and returns, per document, the id of the earlier document it shares a band key with
(None: new, now indexed). Duplicates are not indexed (their survivor already is). A document
whose own id is already indexed is not its own duplicate (a re-run of the same corpus). Unverified:
a shared band key is the LSH candidate test (p ≈ 0.92 at Jaccard 0.8 with 14×8).

`save(dir)` writes `index.parquet` (key: uint64, doc: int32) and `ids.parquet` atomically, then
`meta.json`; `MinHashIndex.load(dir)` reads them back; a run with other LSH parameters or another
shingle hash ("fast" / "sha1": their signatures are not comparable) is refused.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.dedup.cluster import band_hashes
from tasks.dedup.minhash import fmix64

FORMAT = 2


def index_keys(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n, bands) uint64 index keys: each band's hash with its band number mixed in."""
    h = band_hashes(signatures, bands, rows)
    band_salt = fmix64(np.arange(1, bands + 1, dtype=np.uint64))
    return fmix64(h ^ band_salt[None, :])


class MinHashIndex:
    def __init__(self, bands: int = 14, rows: int = 8, seed: int = 1, scheme: str = "affine32",
                 hash: str = "fast"):
        self.bands, self.rows, self.seed, self.scheme, self.hash = bands, rows, seed, scheme, hash
        self.key_array = np.empty(0, dtype=np.uint64)  # sorted
        self.doc_array = np.empty(0, dtype=np.int32)  # document number of each key
        self.ids: list[str] = []
        self._number: dict[str, int] | None = None

    @property
    def docs(self) -> int:
        return len(self.ids)

    def meta(self) -> dict:
        return {"format": FORMAT, "bands": self.bands, "rows": self.rows, "seed": self.seed, "scheme": self.scheme,
                "hash": self.hash, "docs": self.docs, "keys": int(len(self.key_array))}

    def _lookup(self, keys: np.ndarray) -> np.ndarray:
        """Document number under each key, -1 where absent."""
        if not len(self.key_array):
            return np.full(keys.shape, -1, dtype=np.int64)
        pos = np.minimum(np.searchsorted(self.key_array, keys), len(self.key_array) - 1)
        return np.where(self.key_array[pos] == keys, self.doc_array[pos], -1)

    def add(self, ids: Sequence[str], signatures: Sequence[np.ndarray | None]) -> list[str | None]:
        if self._number is None:
            self._number = {d: k for k, d in enumerate(self.ids)}
        valid = [k for k, s in enumerate(signatures) if s is not None]
        out: list[str | None] = [None] * len(ids)
        if not valid:
            return out
        keys = index_keys(np.stack([signatures[k] for k in valid]), self.bands, self.rows)
        found = self._lookup(keys)
        batch: dict[int, int] = {}  # keys of this batch's new documents -> document number
        new_keys, new_docs = [], []
        for row, k in enumerate(valid):
            own = self._number.get(ids[k], -1)
            hit = next((int(d) for d in found[row] if d >= 0 and d != own), None)
            if hit is None:
                hit = next((batch[int(x)] for x in keys[row] if int(x) in batch and batch[int(x)] != own), None)
            if hit is not None:
                out[k] = self.ids[hit]
                continue
            if own >= 0:  # already indexed (same id): nothing new to add
                continue
            number = len(self.ids)
            self.ids.append(ids[k])
            self._number[ids[k]] = number
            for x in keys[row]:
                batch.setdefault(int(x), number)
            new_keys.append(keys[row])
            new_docs.append(np.full(self.bands, number, dtype=np.int32))
        if new_keys:
            all_keys = np.concatenate([self.key_array, *new_keys])
            all_docs = np.concatenate([self.doc_array, *new_docs])
            order = np.argsort(all_keys, kind="stable")  # equal keys: the earlier document first
            self.key_array, self.doc_array = all_keys[order], all_docs[order]
        return out

    def save(self, directory: str | Path) -> Path:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        tables = {"index.parquet": pa.table({"key": pa.array(self.key_array, pa.uint64()),
                                             "doc": pa.array(self.doc_array, pa.int32())}),
                  "ids.parquet": pa.table({"id": pa.array(self.ids, pa.string())})}
        for name, table in tables.items():
            tmp = d / f".{name}.tmp-{os.getpid()}"
            pq.write_table(table, tmp, compression="zstd")
            tmp.replace(d / name)
        tmp = d / f".meta.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(self.meta(), indent=2) + "\n")
        tmp.replace(d / "meta.json")
        return d

    @classmethod
    def load(cls, directory: str | Path, bands: int | None = None, rows: int | None = None,
             seed: int | None = None, scheme: str | None = None, hash: str | None = None) -> "MinHashIndex":
        d = Path(directory)
        meta = json.loads((d / "meta.json").read_text())
        if meta.get("format") != FORMAT:
            raise ValueError(f"index {d} has format {meta.get('format', 1)}, this version reads {FORMAT}: rebuild it")
        for name, want in (("bands", bands), ("rows", rows), ("seed", seed), ("scheme", scheme), ("hash", hash)):
            if want is not None and meta[name] != want:
                raise ValueError(f"index {d} has {name}={meta[name]!r}, this run wants {want!r}")
        idx = cls(meta["bands"], meta["rows"], meta["seed"], meta["scheme"], meta["hash"])
        t = pq.read_table(d / "index.parquet")
        idx.key_array = t["key"].to_numpy().astype(np.uint64)
        idx.doc_array = t["doc"].to_numpy().astype(np.int32)
        idx.ids = pq.read_table(d / "ids.parquet")["id"].to_pylist()
        if len(idx.ids) != meta["docs"] or len(idx.key_array) != meta["keys"]:
            raise ValueError(f"index {d} is incomplete: meta.json does not match its tables")
        return idx

    @classmethod
    def open(cls, directory: str | Path, bands: int, rows: int, seed: int, scheme: str, hash: str) -> "MinHashIndex":
        """The index in `directory`, or a new empty one with these parameters."""
        if (Path(directory) / "meta.json").is_file():
            return cls.load(directory, bands, rows, seed, scheme, hash)
        return cls(bands, rows, seed, scheme, hash)
