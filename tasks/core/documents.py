"""The document schema shared by ingest, curate and dedup, and sharded Parquet I/O for it.

A document is a flat dict; on disk it is a row of `DOC_SCHEMA` in a Parquet shard:

=================  ========  ==============================================================
field              type      meaning
=================  ========  ==============================================================
id                 string    stable id: uuid5 of "<source>:<key>", key = WARC-Record-ID for
                             WARC/WET records, else the record's own id, else its URL, else
                             "<file name>:<line/row>" (see `make_doc_id`). Never null.
text               string    the document text (extracted, NFC and whitespace normalised
                             by ingest; C4 may later drop lines). Never null.
url                string    WARC-Target-URI or the record's url field
title              string    page title (trafilatura metadata or <title>), if known
date               string    publication date found in the page (ISO 8601), else the crawl
                             date; null if neither is known
crawl_date         string    WARC-Date or the record's crawl timestamp, as given
source             string    source name from the config's source registry
licence            string    licence of that source (from the registry)
content_type       string    HTTP/WARC content type of the raw record, if known
warc_record_id     string    WARC-Record-ID of the record the text came from, if any
language           string    ISO 639 code: set by curate's language id (fastText lid.176),
                             or passed through from the source's metadata at ingest
language_score     float64   confidence of `language`
source_file        string    absolute path of the raw file the record was read from
source_offset      int64     byte offset of the record in that file (compressed offset for
                             WARC/WET; offset in the decompressed stream for JSONL; row for
                             Parquet sources)
=================  ========  ==============================================================

Writing is atomic per shard: rows go to a hidden temp file in the target directory, renamed
into place with `os.replace` when the shard is complete, so a reader never sees half a shard.
Reading streams record batches (`iter_doc_batches`); nothing here loads a whole data set.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Iterable, Iterator, Self

import pyarrow as pa
import pyarrow.parquet as pq

_OPTIONAL_STRING_FIELDS = ("url", "title", "date", "crawl_date", "source", "licence", "content_type",
                           "warc_record_id", "language")
DOC_SCHEMA = pa.schema(
    [pa.field("id", pa.string(), nullable=False), pa.field("text", pa.string(), nullable=False)]
    + [pa.field(name, pa.string()) for name in _OPTIONAL_STRING_FIELDS]
    + [pa.field("language_score", pa.float64()), pa.field("source_file", pa.string()),
       pa.field("source_offset", pa.int64())])

_ID_NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "https://github.com/crucible-ml/crucible/doc")


def make_doc_id(source: str, key: str) -> str:
    """Stable document id: the same source and record key always give the same id."""
    return str(uuid.uuid5(_ID_NAMESPACE, f"{source}:{key}"))


def _tmp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


class _CommitOnSuccess:
    """Context manager of a writer that publishes its output with `close()`: a `with` block that
    ends normally closes it; one that raises calls `abort()`, so no partial output is left."""

    def close(self):  # pragma: no cover - interface
        raise NotImplementedError

    def abort(self) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


class ShardWriter(_CommitOnSuccess):
    """Write documents to `<out_dir>/<prefix>-00000.parquet`, `-00001`, ... of at most
    `shard_docs` rows each, buffering `row_group_docs` rows per Parquet row group.

    Use as a context manager (or call `close()`); `paths` lists the finished shards. On an
    exception inside the `with` block the unfinished temp file is removed.
    """

    def __init__(self, out_dir: str | Path, prefix: str = "shard", shard_docs: int = 2000,
                 row_group_docs: int = 500, schema: pa.Schema = DOC_SCHEMA, start_index: int = 0):
        if shard_docs <= 0 or row_group_docs <= 0:
            raise ValueError("shard_docs and row_group_docs must be positive")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix = prefix
        self.shard_docs = shard_docs
        self.row_group_docs = min(row_group_docs, shard_docs)
        self.schema = schema
        self.paths: list[Path] = []
        self.docs_written = 0
        self._index = start_index
        self._buffer: list[dict] = []
        self._carry: pa.Table | None = None  # `write_table`'s rows short of a row group
        self._writer: pq.ParquetWriter | None = None
        self._tmp: Path | None = None
        self._final: Path | None = None
        self._in_shard = 0

    def _open(self) -> None:
        self._final = self.out_dir / f"{self.prefix}-{self._index:05d}.parquet"
        self._tmp = _tmp_path(self._final)
        self._writer = pq.ParquetWriter(self._tmp, self.schema, compression="zstd")
        self._index += 1
        self._in_shard = 0

    def _flush(self) -> None:
        if self._buffer:
            table = pa.Table.from_pylist(self._buffer, schema=self.schema)
            self._buffer = []
            self._write_group(table)
        elif self._carry is not None:
            table, self._carry = self._carry, None
            self._write_group(table.combine_chunks())

    def _write_group(self, table: pa.Table) -> None:
        """`table` as one row group of the open shard (opened first if none is)."""
        if self._writer is None:
            self._open()
        self._writer.write_table(table)
        self._in_shard += table.num_rows
        self.docs_written += table.num_rows
        if self._in_shard >= self.shard_docs:
            self._finish_shard()

    def _finish_shard(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        os.replace(self._tmp, self._final)
        self.paths.append(self._final.resolve())
        self._writer = self._tmp = self._final = None

    def write(self, doc: dict) -> None:
        if not isinstance(doc.get("id"), str) or not isinstance(doc.get("text"), str):
            raise ValueError(f"document needs string id and text: {str(doc)[:200]}")
        if self._carry is not None:  # after `write_table`'s rows, in their row group
            self.write_table(pa.Table.from_pylist([doc], schema=self.schema))
            return
        self._buffer.append(doc)
        if len(self._buffer) >= self.row_group_docs or self._in_shard + len(self._buffer) >= self.shard_docs:
            self._flush()

    def write_many(self, docs: Iterable[dict]) -> None:
        for doc in docs:
            self.write(doc)

    def _room(self) -> int:
        """Rows the next row group takes: a full one, or what fills the open shard."""
        return min(self.row_group_docs, self.shard_docs - (self._in_shard if self._writer is not None else 0))

    def write_table(self, table: pa.Table) -> None:
        """`table`'s rows (its `schema` columns) after those written so far, in row groups of
        `row_group_docs` and shards of `shard_docs`, without a dict per row (the curated shards of
        `tasks.dedup.stages.filter_pass`: a part's row groups minus the dropped rows)."""
        missing = [n for n in self.schema.names if n not in table.column_names]
        if missing:
            raise ValueError(f"table lacks the columns {missing} of the shard schema")
        if table.column("id").null_count or table.column("text").null_count:
            raise ValueError("document needs string id and text: a row has a null id or text")
        table = pa.Table.from_arrays([table.column(n) for n in self.schema.names], schema=self.schema)
        pending = [t for t in (self._carry, table) if t is not None]
        if self._buffer:
            pending.insert(0, pa.Table.from_pylist(self._buffer, schema=self.schema))
            self._buffer = []
        table, self._carry = pa.concat_tables(pending), None
        while table.num_rows >= (room := self._room()):
            # one chunk a column, as `from_pylist` gives: the writer's dictionary-encoding
            # fallback (and so the file's bytes) depends on how a row group's values are chunked
            self._write_group(table.slice(0, room).combine_chunks())
            table = table.slice(room)
        self._carry = table if table.num_rows else None

    def close(self) -> list[Path]:
        self._flush()
        self._finish_shard()
        return self.paths

    def abort(self) -> None:
        self._buffer, self._carry = [], None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._tmp is not None and self._tmp.exists():
            self._tmp.unlink()


def write_docs(docs: Iterable[dict], out_dir: str | Path, shard_docs: int = 2000,
               prefix: str = "shard") -> list[Path]:
    """Write documents as sharded Parquet; returns the shard paths in order."""
    with ShardWriter(out_dir, prefix=prefix, shard_docs=shard_docs) as w:
        w.write_many(docs)
    return w.paths


def iter_doc_batches(paths: Iterable[str | Path], batch_size: int = 1000, columns: list[str] | None = None,
                     row_groups: list[int] | None = None) -> Iterator[list[dict]]:
    """Yield lists of at most `batch_size` documents, shard by shard, in row order (only the
    given `row_groups` of each shard, when set: a job of the curate and quality stages)."""
    for path in paths:
        pf = pq.ParquetFile(path)
        try:
            for batch in pf.iter_batches(batch_size=batch_size, columns=columns, row_groups=row_groups):
                yield batch.to_pylist()
        finally:
            pf.close()


def iter_docs(paths: Iterable[str | Path], batch_size: int = 1000,
              columns: list[str] | None = None) -> Iterator[dict]:
    for batch in iter_doc_batches(paths, batch_size=batch_size, columns=columns):
        yield from batch


def count_docs(paths: Iterable[str | Path]) -> int:
    """Row count from the Parquet footers (no data read)."""
    return sum(pq.ParquetFile(p).metadata.num_rows for p in paths)


class AtomicJsonlWriter(_CommitOnSuccess):
    """Append JSON lines to a temp file; `close()` renames it to `path` (always creates it)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = _tmp_path(self.path)
        self._fh = open(self._tmp, "w", encoding="utf-8")
        self.lines = 0

    def write(self, obj: dict) -> None:
        self._fh.write(json.dumps(obj, ensure_ascii=False, sort_keys=True) + "\n")
        self.lines += 1

    def close(self) -> Path:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
            os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        if self._tmp.exists():
            self._tmp.unlink()
