"""Flat token files (nanoGPT layout): little-endian uint16, or uint32 when ids exceed 65535; optionally
the same ids in llm.c's data-file format (`tokens.llmc`: a 256 x int32 header, then the ids).

`index.json` beside them describes both splits; its paths are relative to the index so a run
directory can be moved. `load_index` resolves them and `open_split` memory-maps one split.

Document boundaries: beside each `<split>.bin` a `<split>.doc_starts.npy` (int64, `np.load`-able,
memory-mappable) holds the token offset where each document starts, in file order; document i
spans [starts[i], starts[i + 1]) and ends with its EOS. The index names it under the split's
"doc_starts". `open_doc_starts` reads it (or, for an index written before the file existed,
derives the same offsets from the EOS positions).

Document sources: `<split>.doc_sources.npy` (uint16) holds each document's index into the
index's "sources" list (the curated row's `source`); "by_source" counts tokens and documents per
source and split. A continued cycle's mix reports its per-source token counts from them.

index.json carries the stack's signature (tasks/core/signing.py, purpose "token-index"): the sha256
of each file it lists is what evaluation, the yardstick and deploy's lineage tags hold those files
to, so `read_signed_index` refuses an index a writer of the run folder or the store rewrote.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np


# llm.c's data files: a header of 256 little-endian int32 (magic, version, token count, zeros), then
# the token ids; version 1 holds uint16 ids (GPT-2 vocabulary), version 2 uint32 ids (Llama 3).
LLMC_MAGIC = 20240520
LLMC_HEADER_INT32 = 256
LLMC_VERSIONS = {2: 1, 4: 2}  # bytes per token id -> header version


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    # ids run 0..vocab_size-1: uint16 holds them while the largest id is <= 65535
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


# the source name of documents whose shard row has none
UNKNOWN_SOURCE = "(unknown)"


TOKEN_INDEX_PURPOSE = "token-index"
# the files a split lists, each with the key of its recorded sha256
SPLIT_FILES = (("path", "sha256"), ("doc_starts", "doc_starts_sha256"), ("doc_sources", "doc_sources_sha256"))


def write_index(path: str | Path, index: dict) -> Path:
    """Write index.json, signed by the stack (only a process holding its key writes one that verifies)."""
    from tasks.core.signing import write_signed

    return write_signed(path, index, TOKEN_INDEX_PURPOSE)


class TokensChanged(ValueError):
    """A file a token index lists does not have the sha256 the (signed) index records: refused."""


def read_signed_index(loc: str | Path, storage_options: dict | None = None, sha256: str | None = None
                      ) -> tuple[dict, bytes]:
    """(the index, the bytes it was parsed from) of a local index.json or a store's object, read once;
    SignatureError when it is unsigned or its signature does not verify (or it is not JSON). With
    `sha256` (what a signed record holds for these bytes, e.g. a champion's tag, or a mix's pool_sha256
    under it) the bytes must hash to it instead: vouched for by that chain, an index written before
    the stack signed them is taken. Its paths stay as written (`tasks.core.fs.listed_beside` finds a
    listed file)."""
    import hashlib

    from tasks.core import fs
    from tasks.core.signing import SIGNATURE_FIELD, SignatureError, loads_signed

    raw = fs.read_bytes(loc, storage_options)
    if sha256 is None:
        return loads_signed(raw, TOKEN_INDEX_PURPOSE, what=f"token index {loc}"), raw
    if hashlib.sha256(raw).hexdigest() != sha256:
        raise SignatureError(f"token index {loc} does not hash to the vouched sha256 {sha256[:16]}...")
    try:
        index = json.loads(raw)
    except ValueError as e:
        raise SignatureError(f"token index {loc} is not JSON ({e})") from e
    return {k: v for k, v in index.items() if k != SIGNATURE_FIELD}, raw


def _listed(index: dict, index_loc: Path | str, split: str, key: str, sink, storage_options: dict | None
            ) -> Path | str:
    """Stream the file one split of a verified index lists under `key` into `sink` (a binary writer),
    read once, where it lives, and hold it to the sha256 the index records for it (TokensChanged
    otherwise); returns where it lies."""
    import hashlib

    from tasks.core import fs

    where = fs.listed_beside(index_loc, index["splits"][split][key])  # on a store in normal form: no `..`
    want = index["splits"][split].get(dict(SPLIT_FILES)[key])
    if not want:  # an index written before it recorded this file's hash: nothing to hold the file to
        raise TokensChanged(f"{where}: its token index {index_loc} records no sha256 for it ({key}; an index "
                            "written before they were recorded): re-run the tokens stage")
    digest = hashlib.sha256()
    with fs.open_source(str(where), storage_options) as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
            sink.write(chunk)
    if digest.hexdigest() != want:
        raise TokensChanged(f"{where} does not have the sha256 its token index {index_loc} records ({want[:16]}...)")
    return where


def listed_bytes(index: dict, index_loc: Path | str, split: str, key: str, storage_options: dict | None = None
                 ) -> bytes:
    """The bytes of a file one split of a verified index lists under `key` ("path", "doc_starts"), read
    once and held to the sha256 the index records (TokensChanged otherwise): what is checked is what is used."""
    import io

    buf = io.BytesIO()
    _listed(index, index_loc, split, key, buf, storage_options)
    return buf.getvalue()


def listed_copy(index: dict, index_loc: Path | str, split: str, key: str, dest: Path,
                storage_options: dict | None = None) -> Path | str:
    """`listed_bytes` for a file too large to hold in memory (a train split): copied to the local `dest`
    while it is hashed, on the same read; the caller uses `dest` (nobody else writes it), never the
    source again. Returns where the source lies."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest, "wb") as out:
        return _listed(index, index_loc, split, key, out, storage_options)


def load_index(index_path: str | Path) -> dict:
    """Read index.json; each split's "path" comes back absolute (a URI as it is: a continued cycle's mix
    names the held-out split of an object-store run where it lies)."""
    from tasks.core.fs import is_remote

    index_path = Path(index_path).resolve()
    index = json.loads(index_path.read_text())
    for split in index["splits"].values():
        for key in ("path", "doc_starts", "doc_sources", "llmc_path"):
            if split.get(key) and not is_remote(split[key]):
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


def doc_source_names(index_path: str | Path, split: str) -> list[str]:
    """The source name of each document of the split (UNKNOWN_SOURCE throughout for an index written
    before token indexes recorded sources)."""
    index = load_index(index_path)
    info = index["splits"][split]
    n = len(open_doc_starts(index_path, split))
    if not info.get("doc_sources") or "sources" not in index:
        return [UNKNOWN_SOURCE] * n
    ids = np.load(info["doc_sources"], mmap_mode="r")
    if ids.ndim != 1 or len(ids) != n:
        raise ValueError(f"{info['doc_sources']}: expected one source id per document ({n})")
    names = index["sources"]
    return [names[int(i)] for i in ids]


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


def write_llmc(flat_path: str | Path, dtype: np.dtype, out_path: str | Path) -> Path:
    """Copy a flat token file into llm.c's format (header + the same little-endian ids). llm.c's
    C/CUDA data loader reads version 1 (uint16 ids, vocabularies up to 65,536) and needs at least
    one token; version 2 (uint32) is the layout llm.c's Llama 3 data scripts write."""
    import shutil

    flat_path, out_path = Path(flat_path), Path(out_path)
    dtype = np.dtype(dtype)
    n = flat_path.stat().st_size // dtype.itemsize
    if n >= 1 << 31:
        raise ValueError(f"{flat_path}: {n} tokens do not fit llm.c's int32 token count")
    header = np.zeros(LLMC_HEADER_INT32, dtype="<i4")
    header[:3] = (LLMC_MAGIC, LLMC_VERSIONS[dtype.itemsize], n)
    with open(out_path, "wb") as out, open(flat_path, "rb") as f:
        out.write(header.tobytes())
        shutil.copyfileobj(f, out, 1 << 20)
    return out_path


def read_llmc(path: str | Path) -> np.memmap | np.ndarray:
    """The token ids of an llm.c data file, checked as llm.c's loader checks them (magic, version,
    token count against the file size)."""
    path = Path(path)
    header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INT32)
    if len(header) < LLMC_HEADER_INT32 or header[0] != LLMC_MAGIC:
        raise ValueError(f"{path}: not an llm.c data file (bad magic)")
    sizes = {v: b for b, v in LLMC_VERSIONS.items()}
    if int(header[1]) not in sizes:
        raise ValueError(f"{path}: unknown llm.c data version {int(header[1])}")
    itemsize, n = sizes[int(header[1])], int(header[2])
    offset = 4 * LLMC_HEADER_INT32
    if path.stat().st_size != offset + n * itemsize:
        raise ValueError(f"{path}: header says {n} tokens, the file holds {(path.stat().st_size - offset) / itemsize:g}")
    dtype = np.dtype(f"<u{itemsize}")
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(n,)) if n else np.zeros(0, dtype)
