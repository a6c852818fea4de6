"""Flat token files (nanoGPT / llm.c layout): little-endian uint16, or uint32 when ids exceed 65535.

`index.json` beside them describes both splits; its paths are relative to the index so a run
directory can be moved. `load_index` resolves them and `open_split` memory-maps one split.

Document boundaries: beside each `<split>.bin` a `<split>.doc_starts.npy` (int64, `np.load`-able,
memory-mappable) holds the token offset where each document starts, in file order; document i
spans [starts[i], starts[i + 1]) and ends with its EOS. The index names it under the split's
"doc_starts". `open_doc_starts` reads it (or, for an index written before the file existed,
derives the same offsets from the EOS positions).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

INDEX_FILE = "index.json"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    # ids run 0..vocab_size-1: uint16 holds them while the largest id is <= 65535
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def load_index(index_path: str | Path) -> dict:
    """Read index.json; each split's "path" comes back absolute."""
    index_path = Path(index_path).resolve()
    index = json.loads(index_path.read_text())
    for split in index["splits"].values():
        for key in ("path", "doc_starts"):
            if split.get(key):
                p = Path(split[key])
                split[key] = str(p if p.is_absolute() else index_path.parent / p)
    return index


def open_split(index_path: str | Path, split: str) -> np.memmap | np.ndarray:
    """Read-only memmap of one split's tokens (an empty array for an empty split)."""
    index = load_index(index_path)
    info = index["splits"][split]
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    if info["tokens"] == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(info["path"], dtype=dtype, mode="r", shape=(info["tokens"],))


def open_doc_starts(index_path: str | Path, split: str) -> np.ndarray:
    """int64 token offsets where each document of the split starts (the first is 0)."""
    index = load_index(index_path)
    info = index["splits"][split]
    if info["tokens"] == 0 or info.get("docs") == 0:
        return np.zeros(0, dtype=np.int64)
    if info.get("doc_starts"):
        starts = np.load(info["doc_starts"], mmap_mode="r")
        if starts.dtype != np.int64 or starts.ndim != 1 or (len(starts) and starts[0] != 0):
            raise ValueError(f"{info['doc_starts']}: expected a 1-D int64 array of document starts from 0")
        return starts
    # an index from before doc_starts files: every document ends with exactly one EOS id
    tokens = open_split(index_path, split)
    ends = np.flatnonzero(np.asarray(tokens) == index["eos_id"]) + 1
    return np.concatenate([[0], ends[ends < len(tokens)]]).astype(np.int64)
