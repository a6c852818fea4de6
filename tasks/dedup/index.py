"""Incremental MinHash index: persist LSH band keys, dedup new documents against them.

`MinHashIndex(bands, rows, seed, scheme)` maps each band key (band index + that band's hash
values) to the id of the first document indexed under it. `add(ids, signatures)` checks each
new document against the index (and against the new documents before it) and returns, per
document, the id of the earlier document it shares a band with (None: new, now indexed).
Documents found to be duplicates are not indexed (their survivor already is).
Unverified: a shared band key is the LSH candidate test (p ≈ 0.92 at Jaccard 0.8 with 14×8).

`save(dir)` writes `index.parquet` (band:int16, key:binary, doc_id:string) and `meta.json`;
`MinHashIndex.load(dir)` reads them back; a run with other LSH parameters or another shingle
hash ("fast" / "sha1": their signatures are not comparable) is refused.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tasks.dedup.minhash import band_keys


class MinHashIndex:
    def __init__(self, bands: int = 14, rows: int = 8, seed: int = 1, scheme: str = "affine32",
                 hash: str = "fast"):
        self.bands, self.rows, self.seed, self.scheme, self.hash = bands, rows, seed, scheme, hash
        self.keys: dict[bytes, str] = {}
        self.docs = 0

    def meta(self) -> dict:
        return {"bands": self.bands, "rows": self.rows, "seed": self.seed, "scheme": self.scheme,
                "hash": self.hash, "docs": self.docs, "keys": len(self.keys)}

    def query(self, sig: np.ndarray) -> str | None:
        for key in band_keys(sig, self.bands, self.rows):
            hit = self.keys.get(key)
            if hit is not None:
                return hit
        return None

    def add(self, ids: Sequence[str], signatures: Sequence[np.ndarray | None]) -> list[str | None]:
        out: list[str | None] = []
        for doc_id, sig in zip(ids, signatures):
            if sig is None:
                out.append(None)
                continue
            keys = band_keys(sig, self.bands, self.rows)
            hit = next((self.keys[k] for k in keys if k in self.keys), None)
            out.append(hit)
            if hit is None:
                for k in keys:
                    self.keys[k] = doc_id
                self.docs += 1
        return out

    def save(self, directory: str | Path) -> Path:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        keys = list(self.keys)
        table = pa.table({"band": pa.array([k[0] for k in keys], pa.int16()),
                          "key": pa.array([k[1:] for k in keys], pa.binary()),
                          "doc_id": pa.array([self.keys[k] for k in keys], pa.string())})
        tmp = d / ".index.parquet.tmp"
        pq.write_table(table, tmp, compression="zstd")
        tmp.replace(d / "index.parquet")
        (d / "meta.json").write_text(json.dumps(self.meta(), indent=2) + "\n")
        return d

    @classmethod
    def load(cls, directory: str | Path, bands: int | None = None, rows: int | None = None,
             seed: int | None = None, scheme: str | None = None, hash: str | None = None) -> "MinHashIndex":
        d = Path(directory)
        meta = json.loads((d / "meta.json").read_text())
        meta.setdefault("hash", "sha1")  # indexes written before the fast shingle hash existed
        for name, want in (("bands", bands), ("rows", rows), ("seed", seed), ("scheme", scheme), ("hash", hash)):
            if want is not None and meta[name] != want:
                raise ValueError(f"index {d} has {name}={meta[name]!r}, this run wants {want!r}")
        idx = cls(meta["bands"], meta["rows"], meta["seed"], meta["scheme"], meta["hash"])
        t = pq.read_table(d / "index.parquet")
        for band, key, doc_id in zip(t["band"].to_pylist(), t["key"].to_pylist(), t["doc_id"].to_pylist()):
            idx.keys[bytes((band,)) + key] = doc_id
        idx.docs = meta["docs"]
        return idx
