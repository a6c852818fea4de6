"""Streaming reads of the curated corpus: Parquet shards with a string column `text` (and `id`).

Only one record batch per shard is in memory at a time, so corpora larger than RAM stream through.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import pyarrow.parquet as pq


def iter_doc_batches(shards: Iterable[str | Path], batch_docs: int = 1000
                     ) -> Iterator[tuple[list[str] | None, list[str]]]:
    """Yield `(ids, texts)` per record batch, in shard order then row order (deterministic).

    `ids` is None when a shard has no `id` column. Null texts are skipped (with their ids).
    """
    for shard in shards:
        pf = pq.ParquetFile(str(shard))
        names = set(pf.schema_arrow.names)
        if "text" not in names:
            raise ValueError(f"shard {shard} has no 'text' column (columns: {sorted(names)})")
        columns = ["id", "text"] if "id" in names else ["text"]
        for batch in pf.iter_batches(batch_size=batch_docs, columns=columns):
            texts = batch.column("text").to_pylist()
            ids = [str(i) if i is not None else None for i in batch.column("id").to_pylist()] \
                if "id" in columns else None
            if any(t is None for t in texts):
                keep = [k for k, t in enumerate(texts) if t is not None]
                texts = [texts[k] for k in keep]
                ids = [ids[k] for k in keep] if ids is not None else None
            if texts:
                yield ids, texts


def iter_doc_columns(shards: Iterable[str | Path], columns: Iterable[str], batch_docs: int = 1000
                     ) -> Iterator[dict[str, list]]:
    """Yield `{column: values}` per record batch, in shard order then row order (deterministic).

    `text` is required; any other requested column a shard lacks comes back as a list of None
    (e.g. `language` before curation's language id). Null texts are skipped with their row.
    """
    columns = list(dict.fromkeys(["text", *columns]))
    for shard in shards:
        pf = pq.ParquetFile(str(shard))
        names = set(pf.schema_arrow.names)
        if "text" not in names:
            raise ValueError(f"shard {shard} has no 'text' column (columns: {sorted(names)})")
        present = [c for c in columns if c in names]
        for batch in pf.iter_batches(batch_size=batch_docs, columns=present):
            texts = batch.column("text").to_pylist()
            keep = [k for k, t in enumerate(texts) if t is not None]
            if not keep:
                continue
            out = {}
            for c in columns:
                values = batch.column(c).to_pylist() if c in present else [None] * len(texts)
                out[c] = [values[k] for k in keep] if len(keep) < len(texts) else values
            yield out


def iter_text_batches(shards: Iterable[str | Path], batch_docs: int = 1000) -> Iterator[list[str]]:
    for _, texts in iter_doc_batches(shards, batch_docs):
        yield texts
