"""Flat token files (nanoGPT / llm.c layout): little-endian uint16, or uint32 when ids exceed 65535.

`index.json` beside them describes both splits; its paths are relative to the index so a run
directory can be moved. `load_index` resolves them and `open_split` memory-maps one split.
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
        p = Path(split["path"])
        split["path"] = str(p if p.is_absolute() else index_path.parent / p)
    return index


def open_split(index_path: str | Path, split: str) -> np.memmap | np.ndarray:
    """Read-only memmap of one split's tokens (an empty array for an empty split)."""
    index = load_index(index_path)
    info = index["splits"][split]
    dtype = np.dtype(index["dtype"]).newbyteorder("<")
    if info["tokens"] == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(info["path"], dtype=dtype, mode="r", shape=(info["tokens"],))
