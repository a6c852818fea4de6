"""Line dedup across the corpus, as CCNet does it (Wenzek et al. 2019, "CCNet", section 3.1):
lines repeated over many pages (site footers, navigation, cookie notices, translator credits)
are removed from every page that holds them.

1. Normalise each line (`normalise_line`, CCNet's normalisation for dedup): lower case, accents
   stripped (NFD, combining marks dropped), every digit made 0, punctuation, symbols and control
   characters dropped, whitespace collapsed; hash it to 64 bits (`line_hash`). A line that is
   blank, or whose normalised form is empty (a table rule "|---|", a lone "-" or "»"), carries
   no words: it is neither counted nor removed (blank lines are paragraph breaks). Short lines
   are treated like any other: a "Home" or "Next" repeated over many pages is what this removes.
2. Count, for every line hash, the distinct documents that hold it (`frequent_hashes`), where
   identical documents (same `exact_key`) count once, so exact copies of a page, which exact
   dedup removes later, do not turn its own text into boilerplate. The count runs over the
   whole input corpus before any filter, as CCNet counts before language id.
3. A line whose hash occurs in more than `dedup.lines.max_docs` documents is frequent: it is
   removed from every document (`LineDedupFilter`, the first step of the curate workers). A
   document that lost lines is checked again against the minimum-length rule (Gopher's
   `min_doc_words` real words, `filters.real_word_count`; without the Gopher filter: at least
   one word) and dropped as "line_dedup:too_short" when it fails.

Counting in process (`method="local"`) holds every (line, document) pair of the corpus. On Ray
(`"ray"`), as the MinHash clustering does (`tasks.dedup.cluster`): a task per group of input
row groups (at most 100,000 documents or 256 MiB of text) spills its (line hash, document key)
rows into `partitions` Parquet directories chosen by the hash (`cluster.spill_partitioned`; by
default about 4 M rows each, estimated from the documents and their text bytes), then a task per
partition counts its hashes and returns the frequent ones; no process holds more than one
row-group group or one partition. With an object-store run_root (`work_dir` in its working copy)
on a cluster of several nodes the tasks read the input shards and write and read the spill files
on the store directly (the spill files never enter the driver's working copy and are deleted from
the store at the end), as in `tasks.dedup.cluster`.
Both paths return the same sorted uint64 array of frequent hashes (8 bytes per frequent line:
what the driver holds and ships to the workers through the object store once).
"""
from __future__ import annotations

import hashlib
import math
import time
import unicodedata
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
import regex

from tasks.config import LineDedupConfig, RayConfig
from tasks.core.steps import Filter
from tasks.core.text import CharTable
from tasks.dedup.exact import exact_key

_DROPPED_CHAR = regex.compile(r"[\p{Mn}\p{P}\p{S}\p{Cc}\p{Cf}]")
_DIGIT = regex.compile(r"\d")
# digits → 0, the dropped classes deleted, in one translate pass (no character is both; the
# regexes' own classes decide each one)
_LINE_TABLE = CharTable(lambda ch: "0" if _DIGIT.fullmatch(ch) else None if _DROPPED_CHAR.fullmatch(ch) else ch)
_ROWS_PER_PARTITION = 4_000_000  # ≈ 64 MB of (hash, document) rows per partition task
_LINES_PER_DOC = 40  # guess of distinct lines per document, to size the partitions
_BYTES_PER_LINE = 64  # ...and of text bytes per line, so long documents (books) get partitions too
_SPILL_TASK_DOCS = 100_000  # input documents per spill task
_SPILL_TASK_BYTES = 256 << 20  # and at most about this much text (≈ 4 M lines held by one task)


def normalise_line(line: str) -> str:
    """CCNet's line normalisation for dedup (see the module docstring)."""
    s = " ".join(line.lower().split())  # a tab is a space, not a dropped control
    if not s.isascii():  # NFD leaves ASCII as it is
        s = unicodedata.normalize("NFD", s)
    return " ".join(s.translate(_LINE_TABLE).split())


def line_hash(line: str) -> int | None:
    """64-bit hash of the normalised line; None for a line with nothing left after normalising."""
    norm = normalise_line(line)
    if not norm:
        return None
    return int.from_bytes(hashlib.blake2b(norm.encode("utf-8"), digest_size=8).digest(), "little")


def doc_key(text: str) -> int:
    """The document's identity in the counts: identical (exact-dedup) texts count once."""
    return int.from_bytes(exact_key(text)[:8], "little")


def line_rows(texts: Iterable[str]) -> tuple[np.ndarray, np.ndarray]:
    """(line hash, document key) rows, one per distinct counted line of each document."""
    hashes: list[int] = []
    docs: list[int] = []
    for text in texts:
        distinct = {h for h in map(line_hash, text.split("\n")) if h is not None}
        hashes.extend(distinct)
        docs.extend([doc_key(text)] * len(distinct))
    return np.array(hashes, dtype=np.uint64), np.array(docs, dtype=np.uint64)


def frequent_hashes(hashes: np.ndarray, docs: np.ndarray, max_docs: int) -> tuple[np.ndarray, int]:
    """(sorted hashes held by more than `max_docs` distinct documents, number of distinct hashes)."""
    if len(hashes) == 0:
        return np.empty(0, np.uint64), 0
    order = np.lexsort((docs, hashes))
    h, d = hashes[order], docs[order]
    new_pair = np.r_[True, (h[1:] != h[:-1]) | (d[1:] != d[:-1])]
    values, counts = np.unique(h[new_pair], return_counts=True)
    return values[counts > max_docs], len(values)


def default_partitions(n_docs: int, text_bytes: int = 0) -> int:
    """Partitions for about `_ROWS_PER_PARTITION` rows each, the rows estimated from the documents
    and from their text bytes, whichever is larger."""
    rows = max(n_docs * _LINES_PER_DOC, text_bytes / _BYTES_PER_LINE)
    return int(min(1024, max(2, math.ceil(rows / _ROWS_PER_PARTITION))))


# ------------------------------------------------------------------ counting over the input shards

Chunk = list[tuple[str, list[int]]]  # (input shard, its row groups) read by one spill task


def _chunk_texts(chunk: Chunk, options: dict | None = None) -> Iterable[str]:
    """The texts of a chunk's row groups; a shard given as a store's URI is read there (ranged
    reads with the fsspec `options`)."""
    from contextlib import nullcontext

    from tasks.core.documents import iter_doc_batches
    from tasks.core.fs import is_remote, open_random

    for shard, row_groups in chunk:
        with open_random(shard, options) if is_remote(shard) else nullcontext(shard) as source:
            for batch in iter_doc_batches([source], batch_size=500, columns=["text"], row_groups=row_groups):
                yield from (d["text"] for d in batch)


def spill_chunk(chunk: Chunk, partitions: int, spill_dir: str, task_no: int, options: dict | None = None) -> int:
    """The (hash, document) rows of one chunk → `spill_dir/p-XXXXX/s-XXXXXX.parquet` (a local
    folder or a store's prefix, with the fsspec `options`); returns rows."""
    from tasks.dedup.cluster import spill_partitioned

    hashes, docs = line_rows(_chunk_texts(chunk, options))
    # partitioned by the line hash itself: blake2b output is uniform already
    spill_partitioned({"hash": hashes, "doc": docs}, hashes, partitions, spill_dir, task_no, options)
    return len(hashes)


def count_partition(part_dir: str, max_docs: int, options: dict | None = None) -> tuple[np.ndarray, int]:
    """`frequent_hashes` over one partition's spilled rows."""
    from tasks.dedup.cluster import read_spilled

    t = read_spilled(part_dir, options)
    if t is None:
        return np.empty(0, np.uint64), 0
    return frequent_hashes(t.column("hash").to_numpy(), t.column("doc").to_numpy(), max_docs)


@dataclass
class FrequentLines:
    """The frequent line hashes (sorted uint64) and how they were counted."""
    hashes: np.ndarray
    stats: dict = field(default_factory=dict)

    def fingerprint(self) -> str:
        return hashlib.sha256(np.ascontiguousarray(self.hashes).tobytes()).hexdigest()


def _chunks(shards: Sequence[str], task_docs: int = _SPILL_TASK_DOCS,
            task_bytes: int = _SPILL_TASK_BYTES) -> tuple[list[Chunk], int, int]:
    """Input row groups grouped into spill tasks of about `task_docs` documents or `task_bytes`
    bytes of text (from the Parquet footers), whichever comes first; total docs and text bytes."""
    import pyarrow.parquet as pq

    chunks: list[Chunk] = [[]]
    in_chunk = bytes_in_chunk = total = total_bytes = 0
    for s in shards:
        meta = pq.ParquetFile(s).metadata
        text_col = meta.schema.names.index("text")
        for rg in range(meta.num_row_groups):
            if in_chunk >= task_docs or bytes_in_chunk >= task_bytes:
                chunks.append([])
                in_chunk = bytes_in_chunk = 0
            chunks[-1].append((str(s), [rg]))
            n, nbytes = meta.row_group(rg).num_rows, meta.row_group(rg).column(text_col).total_uncompressed_size
            in_chunk += n
            bytes_in_chunk += nbytes
            total += n
            total_bytes += nbytes
    return [c for c in chunks if c], total, total_bytes


def counting_method(cfg: LineDedupConfig, n_docs: int) -> str:
    if cfg.counting != "auto":
        return cfg.counting
    return "ray" if n_docs >= cfg.ray_min_docs else "local"


def count_frequent_lines(shards: Sequence[str | Path], cfg: LineDedupConfig, work_dir: str | Path,
                         ray_cfg: RayConfig | None = None, method: str | None = None,
                         spill_task_docs: int = _SPILL_TASK_DOCS) -> FrequentLines:
    """The frequent lines of the documents in the Parquet `shards` (see the module docstring),
    in process or on Ray (`method`, default from `cfg.counting`; a spill task per
    `spill_task_docs` input documents at most); spill files live under `work_dir/_lines` (in the
    store for a remote run_root's working copy) and are removed at the end."""
    t0 = time.perf_counter()
    chunks, n_docs, text_bytes = _chunks([str(s) for s in shards], spill_task_docs)
    method = method or counting_method(cfg, n_docs)
    stats: dict = {"method": method, "docs": n_docs, "max_docs": cfg.max_docs}
    if method == "local":
        hashes, docs = line_rows(t for c in chunks for t in _chunk_texts(c))
        stats["line_rows"] = len(hashes)
        frequent, stats["distinct_lines"] = frequent_hashes(hashes, docs, cfg.max_docs)
    else:
        stats["spill_tasks"] = len(chunks)
        frequent = _count_on_ray(chunks, cfg.partitions or default_partitions(n_docs, text_bytes), cfg.max_docs,
                                 Path(work_dir) / "_lines", ray_cfg, stats)
    stats["frequent_lines"] = len(frequent)
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    return FrequentLines(frequent, stats)


def _count_on_ray(chunks: list[Chunk], partitions: int, max_docs: int, spill: Path, ray_cfg: RayConfig | None,
                  stats: dict) -> np.ndarray:
    import ray

    from tasks.core.executor import for_any_node, task_location
    from tasks.core.fs import join
    from tasks.core.ray_utils import init_ray
    from tasks.dedup.cluster import drop_spill

    init_ray(ray_cfg)
    stats["partitions"] = partitions
    # a remote run_root on several nodes: the shards and the spill files are read and written on the store
    spill_at, options = task_location(spill)
    drop_spill(spill_at, options)  # what a shuffle that died here left
    chunks, _ = for_any_node(chunks)
    try:
        spill_task = ray.remote(num_cpus=1)(spill_chunk)
        stats["line_rows"] = int(sum(ray.get([spill_task.remote(c, partitions, str(spill_at), k, options)
                                              for k, c in enumerate(chunks)])))
        count_task = ray.remote(num_cpus=1, num_returns=2)(count_partition)
        outs = [count_task.remote(str(join(spill_at, f"p-{p:05d}")), max_docs, options) for p in range(partitions)]
        parts = ray.get([o[0] for o in outs])
        stats["distinct_lines"] = int(sum(ray.get([o[1] for o in outs])))
    finally:
        drop_spill(spill_at, options)
    return np.sort(np.concatenate(parts)) if parts else np.empty(0, np.uint64)


# ------------------------------------------------------------------ removal (a curate filter step)

def _join_lines(lines: list[str]) -> str:
    """The kept lines, with at most one blank line in a row and none at either end (ingest's form)."""
    out: list[str] = []
    for line in lines:
        if line.strip() or (out and out[-1].strip()):
            out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return "\n".join(out)


class LineDedupFilter(Filter):
    """Removes the frequent lines from each document; a shortened document below the minimum
    length is dropped as "line_dedup:too_short". `drain()` returns the removals per source."""

    name = "line_dedup"

    def __init__(self, frequent: np.ndarray, min_words: int):
        self.frequent = np.asarray(frequent, dtype=np.uint64)
        self.min_words = max(1, min_words)
        self.by_source: dict[str, Counter] = {}

    def frequent_mask(self, lines: list[str]) -> list[bool]:
        """Per line: is its hash frequent."""
        hashes = [line_hash(line) if line.strip() else None for line in lines]
        counted = [k for k, h in enumerate(hashes) if h is not None]
        mask = [False] * len(lines)
        if not counted or not len(self.frequent):
            return mask
        arr = np.array([hashes[k] for k in counted], dtype=np.uint64)
        pos = np.minimum(np.searchsorted(self.frequent, arr), len(self.frequent) - 1)
        for k in np.flatnonzero(self.frequent[pos] == arr):
            mask[counted[k]] = True
        return mask

    def decide(self, doc: dict) -> str | None:
        from tasks.curate.filters import real_word_count

        lines = doc["text"].split("\n")
        mask = self.frequent_mask(lines)
        removed = [line for line, m in zip(lines, mask) if m]
        if not removed:
            return None
        c = self.by_source.setdefault(doc.get("source") or "", Counter())
        c["docs_shortened"] += 1
        c["lines_removed"] += len(removed)
        c["bytes_removed"] += sum(len(line.encode("utf-8")) + 1 for line in removed)  # with its newline
        text = _join_lines([line for line, m in zip(lines, mask) if not m])
        if real_word_count(text) < self.min_words:
            c["docs_too_short"] += 1
            return "line_dedup:too_short"
        doc["text"] = text
        return None

    def drain(self) -> dict:
        out = {s: dict(sorted(c.items())) for s, c in self.by_source.items()}
        self.by_source = {}
        return out


def line_dedup_summary(stats: dict, per_job: Sequence[dict]) -> dict:
    """The counting stats and the removals per source (summed over the jobs' `drain()`s)."""
    by_source: dict[str, Counter] = {}
    for part in per_job:
        for src, c in part.items():
            by_source.setdefault(src, Counter()).update(c)
    total: Counter = Counter()
    for c in by_source.values():
        total.update(c)
    keys = ("docs_shortened", "docs_too_short", "lines_removed", "bytes_removed")
    return {"counting": stats, **{k: total.get(k, 0) for k in keys},
            "by_source": {s: {k: c.get(k, 0) for k in keys} for s, c in sorted(by_source.items())}}
