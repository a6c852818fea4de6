"""Duplicate document ids, found on the workers: the ingest driver holds nothing per document (issue 26).

A document id is the uuid5 of "<source>:<record key>" (`tasks.core.documents.make_doc_id`), so the
same record read twice (a file copied under two names, a crawl fetched twice) gives the same id; the
first occurrence in corpus order ((source, file, first record) of the job, then the row in the job)
is kept, the later ones are dropped as "duplicate_id". Three steps, each on the workers:

1. `IdSpill` (inside each ingest job, `process_file_range`): the job's kept documents' (row in the
   job, 128-bit id digest, UTF-8 size) into `ingest.id_partitions` Parquet files by a hash of the id
   (`tasks.dedup.cluster.spill_partitioned`, as curate's key dedup spills its keys):
   `<job>-ids/p-XXXXX/s-<chunk>.parquet` beside the job's part files (a chunk every `SPILL_DOCS`
   documents, so a worker's memory does not grow with the file it reads).
2. `resolve_partition` (a Ray task per partition): the partition's files of every job, read in the
   jobs' corpus order, sorted by (id, job, row); per id every row after the first is a drop, written
   per job (`<drops>/<job>/p-XXXXX.parquet`: the rows) and counted per part file of the job (drops,
   bytes). Its memory is ~60 bytes per document of the partition (measured), and a partition holds
   at most ~`ingest.id_partition_bytes` of source (`run.id_partitions`), whatever the corpus.
3. `write_shard` (a Ray task per output shard that is not one whole part): parts that lost rows,
   and runs of consecutive small parts (small files: at most `ingest.shard_docs` rows together),
   written as one shard without the dropped rows. A whole part alone is linked into place by the
   driver (no copy), so a corpus of big files is not rewritten at all.

Paths are the ones a task on any node reads (`tasks.core.executor.for_any_node` / `task_location`:
the store's URIs where the cluster's nodes do not share the driver's disk).
"""
from __future__ import annotations

import contextlib
import shutil
import tempfile
import uuid
from array import array
from pathlib import Path

import numpy as np
import pyarrow as pa

from tasks.core.documents import ShardWriter
from tasks.core.fs import is_remote, join, read_checked, upload


SPILL_DOCS = 1_000_000  # ids a job holds before it spills them (24 MB: a worker's bound, whatever the file)


class IdSpill:
    """The kept documents' ids of one ingest job, spilled by id hash every `SPILL_DOCS` documents and
    when the job ends (`p-XXXXX/s-<chunk>.parquet`). Holds 24 bytes per document until then (the
    digest and the size), not the ids' strings."""

    def __init__(self, folder: Path, partitions: int):
        self.folder, self.partitions = Path(folder), partitions
        shutil.rmtree(self.folder, ignore_errors=True)  # an earlier attempt's, maybe of other partitions
        self.digests = bytearray()
        self.sizes = array("q")
        self.rows = self.chunks = 0  # documents spilled so far, spill files per partition

    def add(self, doc_id: str, n_bytes: int) -> None:
        self.digests += uuid.UUID(doc_id).bytes
        self.sizes.append(n_bytes)
        if len(self.sizes) >= SPILL_DOCS:
            self._spill()

    def _spill(self) -> None:
        from tasks.dedup.cluster import spill_partitioned
        from tasks.dedup.minhash import fmix64

        n = len(self.sizes)
        if not n:
            return
        key = np.frombuffer(bytes(self.digests), dtype="<u8").reshape(n, 2)
        cols = {"row": np.arange(self.rows, self.rows + n, dtype=np.int64), "k0": key[:, 0].copy(),
                "k1": key[:, 1].copy(), "nbytes": np.frombuffer(self.sizes, dtype=np.int64).copy()}
        spill_partitioned(cols, fmix64(cols["k0"].copy()), self.partitions, self.folder, self.chunks)
        self.rows, self.chunks = self.rows + n, self.chunks + 1
        self.digests, self.sizes = bytearray(), array("q")

    def close(self) -> list[Path]:
        """Spill the rest; the partition files written (only the non-empty ones), sorted."""
        self._spill()
        return sorted(self.folder.glob("p-*/s-*.parquet"))


def _read(loc: str, options: dict | None, columns: list[str] | None = None, sha256: str | None = None) -> pa.Table:
    """A Parquet file; with `sha256` (a job's part, as its job reported it) held to it on this read
    (StorageError): the store's object may have been replaced since the job wrote it."""
    import io

    import pyarrow.parquet as pq

    from tasks.dedup.stages import read_table

    if sha256 is not None:
        return pq.read_table(io.BytesIO(read_checked(loc, sha256, options)), columns=columns)
    t = read_table(loc, options, columns)
    if t is None:
        raise FileNotFoundError(f"ingest: {loc} is not there")
    return t


def resolve_partition(jobs: list[tuple[str, list[str]]], partition: int, shard_docs: int, drops_root: str,
                      options: dict | None = None, expect: dict[str, str] | None = None) -> dict[str, list[list[int]]]:
    """Ray task: the later occurrences of each id among `jobs` ([(job name, its files of this
    partition)], in corpus order; a file `expect` names is held to that sha256, its job's). Writes each job's dropped rows to `<drops_root>/<job>/p-XXXXX.parquet`;
    returns {job: [[part index, drops, bytes], ...]} (part index: row // shard_docs)."""
    from tasks.dedup.stages import write_table

    if not jobs:
        return {}
    tables, owner = [], []
    for j, (_, paths) in enumerate(jobs):
        for path in paths:
            tables.append(_read(path, options, sha256=(expect or {}).get(path)))
            owner.append(np.full(tables[-1].num_rows, j, np.int32))
    job = np.concatenate(owner)
    t = pa.concat_tables(tables)
    del tables
    row, k0, k1, nbytes = (t.column(c).to_numpy() for c in ("row", "k0", "k1", "nbytes"))
    order = np.lexsort((row, job, k1, k0))
    k0s, k1s = k0[order], k1[order]
    later = np.r_[False, (k0s[1:] == k0s[:-1]) & (k1s[1:] == k1s[:-1])] if len(order) else np.zeros(0, bool)
    dup = order[later]
    dup = dup[np.lexsort((row[dup], job[dup]))]  # by job, then row
    out: dict[str, list[list[int]]] = {}
    bounds = np.flatnonzero(np.r_[True, job[dup][1:] != job[dup][:-1]]) if len(dup) else []
    for lo, hi in zip(bounds, list(bounds[1:]) + [len(dup)]):
        sel = dup[lo:hi]
        name = jobs[int(job[sel[0]])][0]
        write_table(join(drops_root, name, f"p-{partition:05d}.parquet"), pa.table({"row": row[sel]}), options)
        part = row[sel] // shard_docs
        out[name] = [[int(p), int((part == p).sum()), int(nbytes[sel][part == p].sum())] for p in np.unique(part)]
    return out


def write_shard(entries: list[tuple[str, int, list[str]]], index: int, shard_docs: int, out_dir: str,
                options: dict | None = None, out_options: dict | None = None,
                expect: dict[str, str] | None = None) -> str:
    """Ray task: `<out_dir>/shard-<index>.parquet` from `entries` ([(part file, its index in its job,
    the job's drop files: rows in the job, none when the part lost nothing)]) laid end to end, each
    without its dropped rows (a part `expect` names held to that sha256, its job's); 500-row groups
    as every shard. Holds at most `shard_docs` documents."""
    name = f"shard-{index:05d}.parquet"
    local = not is_remote(out_dir)
    dropped: dict[tuple[str, ...], np.ndarray] = {}  # a job's drop files, read once for its parts
    with (contextlib.nullcontext(out_dir) if local else tempfile.TemporaryDirectory(prefix="ingest-")) as folder:
        with ShardWriter(folder, prefix="shard", shard_docs=1 << 40, start_index=index) as w:
            for part, p, drop_files in entries:
                t = _read(part, options, sha256=(expect or {}).get(part))
                if drop_files:
                    if tuple(drop_files) not in dropped:
                        dropped = {tuple(drop_files): np.concatenate(
                            [_read(f, options, ["row"]).column("row").to_numpy() for f in drop_files])}
                    rows = np.arange(p * shard_docs, p * shard_docs + t.num_rows)
                    t = t.filter(pa.array(~np.isin(rows, dropped[tuple(drop_files)])))
                w.write_many(t.to_pylist())
        if not local:  # written here, then uploaded to the store's prefix (one object, whole or none)
            upload(Path(folder) / name, join(out_dir, name), out_options)
    return str(join(out_dir, name))
