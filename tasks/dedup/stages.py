"""Curate's dedup as stages that pass files (issue 26): the driver schedules Ray tasks and merges
counters; every per-document list lives in files under the stage's `_parts/_dedup` folder.

Input: per curate job (`JobDocs`) a meta file (`META_SCHEMA`: per kept document, in part order,
its id, exact key, UTF-8 size, source, quality score, URL key, crawl time, MinHash signature) and
its kept documents' part files. A document's position is its row in the jobs' parts laid end to
end (corpus order), which is what every survivor rule compares. Jobs are grouped into blocks of
consecutive jobs (`block_docs` documents at most): one task per block reads them.

Steps, in order (each sees the documents the earlier ones kept: a block task reads the earlier
steps' per-job drop files):

- URL and exact dedup (`key_step`): block tasks write (position, 128-bit key, id, ...) rows into
  `partitions` Parquet partitions by key hash (`cluster.spill_partitioned`); a task per partition
  sorts its rows by key and keeps per key the first document (exact) or the newest crawl, then
  the longest text, then the first (URL: `urls.url_duplicates`' rule), writing its drops per
  block.
- MinHash (`minhash_step`): with `clustering: local` one Ray task runs the in-process clustering
  (`cluster.cluster_signatures`) on the signatures it reads from the meta files; on Ray, block
  tasks spill band keys (document = position) and the partitioned pairs / connected-components
  rounds of `tasks.dedup.cluster` run as before; the final star edges (object refs, never in the
  driver) are split by their component root's partition, and a survivors task per partition
  applies the representative check over its whole components (~1/partitions of the clustered
  documents: the MinHash partition count bounds it, not the corpus).
- Index (continued pretraining): a Ray actor opens the `MinHashIndex`, reads the jobs' meta files
  and adds this run's kept documents job by job in corpus order (each against the earlier runs'
  index only), writing the hits as drops; it holds the additions until the driver's `save`.

After each step a collect task per block sorts the step's drops by position and writes, per job,
`<step>/j-<job>.parquet` (what later steps read) and `<step>/j-<job>.jsonl` (dropped.jsonl's lines).
`filter_pass` then writes the curated shards (a task per output shard: the jobs' parts without the
dropped positions; shard k holds output rows [k·shard_docs, (k+1)·shard_docs), so the shards equal
a sequential write) and `dedup_report_task` the report, from the drop files.

Where the tasks read and write: with a remote run_root and a Ray of several nodes, a node other
than the driver's does not see the driver's working copy, so every file above (drops, pieces,
spill partitions, kept counts, the report's partitions) lives under the store prefix of
`_parts/_dedup` and the jobs' meta and part files are read on the store (`Files`, `JobDocs.options`;
`tasks.core.executor.task_location` / `for_any_node`, as the shuffles of `tasks.dedup.cluster`), and
each filter-pass task uploads its curated shard to the stage's store prefix itself (the driver then
pulls the shards into its working copy, recorded as the store's, for the stages after it); on a
local run_root or a Ray of this node alone they stay on the local disk.

The driver keeps per job only a `JobTable` row (name, kept documents, part files: ~40 B).
"""
from __future__ import annotations

import copy
import io
import json
import shutil
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tasks.core.fs import (file_names, files as listing, is_remote, join, location, name_of, open_random, parent_of,
                           read_bytes, remove, remove_stale_shards, remove_tree, upload, write_bytes)
from tasks.core.steps import StepStats

META_SCHEMA = pa.schema([("id", pa.string()), ("key", pa.binary()), ("nbytes", pa.int64()), ("source", pa.string()),
                         ("score", pa.float64()), ("url_key", pa.binary()), ("crawl_time", pa.float64()),
                         ("sig", pa.binary())])
DROP_SCHEMA = pa.schema([("pos", pa.int64()), ("id", pa.string()), ("dup_pos", pa.int64()), ("dup_of", pa.string()),
                         ("source", pa.string()), ("dup_source", pa.string()), ("nbytes", pa.int64())])
BLOCK_DOCS = 200_000  # documents one block task reads (its memory: their dedup columns)
KEY_PARTITION_ROWS = 2_000_000  # rows per URL / exact key partition when `partitions` is 0


def write_meta(path: Path, rows: dict[str, list]) -> None:
    """The per-document dedup columns of one job (`META_SCHEMA`), atomically."""
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.table(rows, schema=META_SCHEMA), tmp, compression="zstd")
    tmp.replace(path)


@dataclass(frozen=True)
class JobDocs:
    """One curate job's kept documents: meta file, part files, how many, the first one's position;
    `options`: fsspec's, where meta and parts are a store's URIs (`stage_paths`)."""
    name: str
    meta: str
    docs: tuple[str, ...]
    kept: int
    offset: int
    options: dict | None = field(default=None, compare=False)

    def stage_paths(self, fn, options: dict | None = None) -> "JobDocs":
        """A copy naming `fn`'s paths (`tasks.core.storage.map_paths`), read with `options`."""
        return replace(self, meta=str(fn(self.meta)), docs=tuple(str(d) for d in fn(list(self.docs))),
                       options=self.options if options is None else options)


class JobTable(Sequence[JobDocs]):
    """The curate jobs' kept documents as columns, what the driver keeps of each job (~40 B: its
    name, kept count and number of part files, and the running position) instead of a `JobDocs`
    (~1 KB of path strings). The files follow curate's naming under `root`: `<name>-meta.parquet`,
    `<name>-00000.parquet`, ...; `table[k]` is job k's `JobDocs`, made on demand."""

    def __init__(self, root: Path | str, names: Sequence[str], kept: Sequence[int], parts: Sequence[int],
                 options: dict | None = None):
        self.root = location(root)
        self.names = np.asarray(names, dtype=str)  # fixed width: no object per name
        self.kept_counts = np.asarray(kept, dtype=np.int64)
        self.parts = np.asarray(parts, dtype=np.int32)
        self.offsets = np.cumsum(self.kept_counts) - self.kept_counts
        self.options = options

    def _file(self, name: str) -> str:
        # a plain string: no pathlib parse for each of the many jobs (root has no trailing "/")
        return f"{self.root}/{name}"

    def meta_path(self, name: str) -> str:
        return self._file(f"{name}-meta.parquet")

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, k) -> JobDocs:
        name = str(self.names[k])  # an out-of-range k raises IndexError here
        docs = tuple(self._file(f"{name}-{i:05d}.parquet") for i in range(int(self.parts[k])))
        return JobDocs(name, self.meta_path(name), docs, int(self.kept_counts[k]), int(self.offsets[k]), self.options)

    def __iter__(self) -> Iterator[JobDocs]:
        return (self[k] for k in range(len(self)))

    def stage_paths(self, fn, options: dict | None = None) -> "JobTable":
        """A copy whose root is where `fn` maps the files (`map_paths`; called on one job's meta path,
        so a caller that pushes the folders of the paths it sees pushes `root`)."""
        probe = self.meta_path(str(self.names[0])) if len(self) else self._file("-")
        out = copy.copy(self)
        out.root = parent_of(location(str(fn(probe))))
        out.options = self.options if options is None else options
        return out


def read_table(loc: Path | str, options: dict | None = None, columns: list[str] | None = None) -> pa.Table | None:
    """A Parquet file (a local path, or a store's object in one GET); None when it is not there."""
    if not is_remote(loc):
        return pq.read_table(loc, columns=columns) if Path(loc).is_file() else None
    try:
        return pq.read_table(io.BytesIO(read_bytes(loc, options)), columns=columns)
    except FileNotFoundError:
        return None


def write_table(loc: Path | str, table: pa.Table, options: dict | None = None) -> None:
    """`table` as Parquet, whole or not at all (a rename locally, one PUT on a store)."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    write_bytes(loc, buf.getvalue(), options)


def num_rows(loc: Path | str, options: dict | None = None) -> int:
    """Rows of a Parquet file from its footer (ranged reads on a store)."""
    if not is_remote(loc) and options is None:  # a job's part left on the store by another node: read there
        from tasks.core.storage import read_location

        loc, options = read_location(loc)
    if not is_remote(loc):
        return pq.ParquetFile(loc).metadata.num_rows
    with open_random(str(loc), options) as f:
        return pq.ParquetFile(f).metadata.num_rows


@contextmanager
def _parquet_file(loc: str, options: dict | None = None) -> Iterator[pq.ParquetFile]:
    """A Parquet file open for reading its row groups (a store's object by ranged reads)."""
    if not is_remote(loc):
        with pq.ParquetFile(loc) as pf:
            yield pf
        return
    with open_random(loc, options) as f, pq.ParquetFile(f) as pf:
        yield pf


def iter_alive_rows(job: JobDocs, gone: np.ndarray, skip: int, take: int) -> Iterator[pa.Table]:
    """The job's documents not at the sorted positions `gone`, alive rows [skip, skip + take) in
    part order, as one table per part row group holding some of them (`take` of its rows): a row
    group wholly before or after them is not read, no row becomes a Python object."""
    pos, seen = job.offset, 0  # position of the row group's first row; alive rows before it
    for loc in job.docs:
        with _parquet_file(loc, job.options) as pf:
            for g in range(pf.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                lo, hi = np.searchsorted(gone, [pos, pos + n])
                alive = np.ones(n, dtype=bool)
                alive[gone[lo:hi] - pos] = False
                idx = np.flatnonzero(alive)
                rows = idx[max(0, skip - seen):max(0, skip + take - seen)]
                seen, pos = seen + len(idx), pos + n
                if len(rows):
                    yield pf.read_row_group(g).take(pa.array(rows))
                if seen >= skip + take:
                    return


def blocks_of(jobs: Sequence[JobDocs], block_docs: int) -> list[list[int]]:
    """Consecutive job indices, ≤ `block_docs` documents a block (a bigger job is a block alone)."""
    out: list[list[int]] = [[]]
    n = 0
    for k, j in enumerate(jobs):
        if out[-1] and n + j.kept > block_docs:
            out.append([])
            n = 0
        out[-1].append(k)
        n += j.kept
    return [b for b in out if b]


class Files:
    """Where the dedup steps keep their files (under the stage's `_parts`): a local folder, or a
    store's prefix written and read with the fsspec `options` (`task_location`)."""

    def __init__(self, root: Path | str, options: dict | None = None):
        self.root = location(root)
        self.options = options

    def step(self, step: str) -> Path | str:
        return join(self.root, step)

    def drops(self, step: str, job: str) -> Path | str:
        return join(self.root, step, f"j-{job}.parquet")

    def lines(self, step: str, job: str) -> Path | str:
        return join(self.root, step, f"j-{job}.jsonl")

    def pieces(self, step: str, block: int) -> Path | str:
        return join(self.root, step, f"b-{block:05d}")

    def spill(self, step: str) -> Path | str:
        return join(self.root, step, "_spill")

    def names(self, folder: Path | str) -> list[str]:
        """The files directly in `folder` (sorted names; none when it is not there): one level, as a
        step's folder also holds its block pieces."""
        return file_names(folder, self.options)


def _dropped_before(files: Files, steps: Sequence[str], job: JobDocs) -> np.ndarray:
    """Positions of `job` that the earlier `steps` dropped (sorted)."""
    got = [t.column(0).to_numpy() for s in steps
           if (t := read_table(files.drops(s, job.name), files.options, ["pos"])) is not None]
    return np.sort(np.concatenate(got)) if got else np.empty(0, np.int64)


def read_alive(files: Files, steps: Sequence[str], job: JobDocs, columns: list[str]) -> tuple[np.ndarray, pa.Table]:
    """(positions, meta columns) of the job's documents the earlier `steps` kept."""
    t = read_table(job.meta, job.options, columns)
    if t is None:
        raise FileNotFoundError(f"job {job.name}: its meta file {job.meta} is not there")
    if t.num_rows != job.kept:
        raise RuntimeError(f"job {job.name}: {t.num_rows} rows in {job.meta}, {job.kept} kept")
    pos = np.arange(job.offset, job.offset + job.kept, dtype=np.int64)
    gone = _dropped_before(files, steps, job)
    if len(gone):
        keep = ~np.isin(pos, gone)
        pos, t = pos[keep], t.filter(pa.array(keep))
    return pos, t


def _write_pieces(files: Files, step: str, drops: pa.Table, jobs: Sequence[JobDocs], blocks: list[list[int]],
                  name: str) -> None:
    """A resolver's drops (DROP_SCHEMA), split by block: `<step>/b-<block>/<name>.parquet`."""
    if drops.num_rows == 0:
        return
    pos = drops.column("pos").to_numpy()
    bounds = np.array([jobs[b[0]].offset for b in blocks] + [jobs[blocks[-1][-1]].offset + jobs[blocks[-1][-1]].kept])
    block_of = np.searchsorted(bounds, pos, side="right") - 1
    for b in np.unique(block_of):
        write_table(join(files.pieces(step, int(b)), f"{name}.parquet"), drops.filter(pa.array(block_of == b)),
                    files.options)


def _collect(files: Files, step: str, block: int, jobs: Sequence[JobDocs], reason: str) -> dict[str, list[int]]:
    """The step's drops of one block, by position, per job: `<step>/j-<job>.parquet` and `.jsonl`.
    Returns [drops, bytes dropped] of the block (the driver sums a counter per block, not per job)."""
    d = files.pieces(step, block)
    pieces = [read_table(join(d, n), files.options) for n in files.names(d) if n.endswith(".parquet")]
    t = pa.concat_tables(pieces) if pieces else DROP_SCHEMA.empty_table()
    t = t.take(pa.array(np.argsort(t.column("pos").to_numpy(), kind="stable")))
    pos = t.column("pos").to_numpy()
    out = [0, 0]
    for job in jobs:
        sel = (pos >= job.offset) & (pos < job.offset + job.kept)
        if not sel.any():
            continue
        part = t.filter(pa.array(sel))
        write_table(files.drops(step, job.name), part, files.options)
        # AtomicJsonlWriter's lines, whole file in one write (a job's drops of one step)
        text = "".join(json.dumps({"id": doc_id, "step": reason, "reason": reason, "duplicate_of": dup_of},
                                  ensure_ascii=False, sort_keys=True) + "\n"
                       for doc_id, dup_of in zip(part.column("id").to_pylist(), part.column("dup_of").to_pylist()))
        write_bytes(files.lines(step, job.name), text.encode("utf-8"), files.options)
        out[0] += part.num_rows
        out[1] += int(part.column("nbytes").to_numpy().sum())
    return out


# ------------------------------------------------------------------ URL and exact dedup

def _key_u64(col: pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """The first 16 bytes of each binary key as two uint64 (keys are ≥ 16-byte digests)."""
    raw = b"".join(v[:16] for v in col.to_pylist())
    a = np.frombuffer(raw, dtype="<u8").reshape(-1, 2) if raw else np.empty((0, 2), np.uint64)
    return a[:, 0].copy(), a[:, 1].copy()


def _spill_keys(files: Files, step: str, prior: list[str], jobs: list[JobDocs], column: str, partitions: int,
                block: int) -> list[int]:
    """Block task: the alive documents' (pos, key, id, source, nbytes[, crawl time]) into the step's
    partitions. Returns [alive documents, their bytes]."""
    from tasks.dedup.cluster import spill_partitioned
    from tasks.dedup.minhash import fmix64

    n = nbytes = 0
    cols: dict[str, list] = {k: [] for k in ("pos", "k0", "k1", "id", "source", "nbytes", "t")}
    for job in jobs:
        pos, t = read_alive(files, prior, job, ["id", column, "source", "nbytes", "crawl_time"])
        size = t.column("nbytes").to_numpy()
        n, nbytes = n + len(pos), nbytes + int(size.sum())
        has = t.column(column).is_valid().to_numpy(zero_copy_only=False)
        if not has.any():
            continue
        sel = pa.array(has)
        k0, k1 = _key_u64(t.column(column).filter(sel))
        cols["pos"].append(pos[has])
        cols["k0"].append(k0)
        cols["k1"].append(k1)
        cols["id"] += t.column("id").filter(sel).to_pylist()
        cols["source"] += t.column("source").filter(sel).to_pylist()
        cols["nbytes"].append(size[has])
        cols["t"].append(t.column("crawl_time").filter(sel).to_numpy(zero_copy_only=False))
    if cols["pos"]:
        arrays = {k: (np.concatenate(v) if k not in ("id", "source") else np.array(v, dtype=object))
                  for k, v in cols.items()}
        spill_partitioned(arrays, fmix64(arrays["k0"].copy()), partitions, files.spill(step), block, files.options)
    return [n, nbytes]


def _resolve_keys(files: Files, step: str, partition: int, rule: str, jobs: list[JobDocs],
                  blocks: list[list[int]]) -> None:
    """Partition task: per key the survivor (`rule` "first": smallest position; "url": newest
    crawl, then most bytes, then first), the other documents dropped as its duplicates."""
    from tasks.dedup.cluster import read_spilled

    t = read_spilled(join(files.spill(step), f"p-{partition:05d}"), files.options)
    if t is None:
        return
    pos, k0, k1 = (t.column(c).to_numpy() for c in ("pos", "k0", "k1"))
    if rule == "url":
        tm = t.column("t").to_numpy(zero_copy_only=False).astype(np.float64)
        has = ~np.isnan(tm)
        order = np.lexsort((pos, -t.column("nbytes").to_numpy(), -np.where(has, tm, 0.0), ~has, k1, k0))
    else:
        order = np.lexsort((pos, k1, k0))
    k0s, k1s = k0[order], k1[order]
    first = np.r_[True, (k0s[1:] != k0s[:-1]) | (k1s[1:] != k1s[:-1])] if len(order) else np.zeros(0, bool)
    best = order[np.flatnonzero(first)[np.cumsum(first) - 1]]  # each row's survivor
    dup = np.flatnonzero(~first)
    rows, surv = order[dup], best[dup]
    ids, srcs = t.column("id"), t.column("source")
    drops = pa.table({"pos": pos[rows], "id": ids.take(pa.array(rows)), "dup_pos": pos[surv],
                      "dup_of": ids.take(pa.array(surv)), "source": srcs.take(pa.array(rows)),
                      "dup_source": srcs.take(pa.array(surv)), "nbytes": t.column("nbytes").to_numpy()[rows]},
                     schema=DROP_SCHEMA)
    _write_pieces(files, step, drops, jobs, blocks, f"r-{partition:05d}")


# ------------------------------------------------------------------ the steps on Ray

class DedupStages:
    """Runs the dedup steps over `jobs` on Ray tasks; holds per-step counters only."""

    def __init__(self, jobs: list[JobDocs], work_dir: Path, partitions: int = 0, block_docs: int | None = None):
        import ray

        from tasks.core.executor import for_any_node, task_location

        self.ray = ray
        self.local = Path(work_dir)  # the driver's own folder (dropped lines fetched from a store)
        shutil.rmtree(self.local, ignore_errors=True)  # first: the jobs' folder is pushed next, recursively
        # where tasks on any node read the jobs' files and keep the steps' (the store, when the
        # cluster's nodes do not share this working copy)
        self.jobs, _ = for_any_node(jobs)
        self.files = Files(*task_location(work_dir))
        remove_tree(self.files.root, self.files.options)  # what a killed run left
        self.local.mkdir(parents=True)
        self.blocks = blocks_of(jobs, block_docs or BLOCK_DOCS)
        self.partitions = partitions
        self.done: list[str] = []  # steps run, in order
        self.steps: list[StepStats] = []
        # how the work was split: block tasks, and partitions per partitioned step (the summary's dedup.stages)
        self.layout: dict = {"blocks": len(self.blocks), "partitions": {}}
        self._task = ray.remote(num_cpus=1)

    def _block_jobs(self, b: int) -> list[JobDocs]:
        return [self.jobs[k] for k in self.blocks[b]]

    def _finish(self, step: str, t0: float, alive: Sequence[Sequence[int]]) -> StepStats:
        """Collect the step's drops per job; its StepStats from the counters."""
        ray = self.ray
        collect = self._task(_collect)
        got = ray.get([collect.remote(self.files, step, b, self._block_jobs(b), step) for b in range(len(self.blocks))])
        st = StepStats(step)
        st.docs_in = sum(a[0] for a in alive)
        st.bytes_in = sum(a[1] for a in alive)
        n, b = sum(g[0] for g in got), sum(g[1] for g in got)
        if n:
            st.dropped[step] = n
        st.docs_out, st.bytes_out = st.docs_in - n, st.bytes_in - b
        remove_tree(self.files.spill(step), self.files.options)
        st.seconds = time.perf_counter() - t0
        self.done.append(step)
        self.steps.append(st)
        return st

    def key_step(self, step: str, column: str, rule: str) -> StepStats:
        """URL ("url_key", rule "url") or exact ("key", rule "first") dedup."""
        ray, t0 = self.ray, time.perf_counter()
        n = sum(j.kept for j in self.jobs)
        parts = self.partitions or max(1, -(-n // KEY_PARTITION_ROWS))
        self.layout["partitions"][step] = parts
        spill = self._task(_spill_keys)
        alive = ray.get([spill.remote(self.files, step, list(self.done), self._block_jobs(b), column, parts, b)
                         for b in range(len(self.blocks))])
        resolve = self._task(_resolve_keys)
        ray.get([resolve.remote(self.files, step, p, rule, self.jobs, self.blocks) for p in range(parts)])
        return self._finish(step, t0, alive)

    def minhash_step(self, mh, verifier, method: str) -> dict:
        """MinHash clustering of the alive documents (see the module docstring); its stats."""
        ray, t0 = self.ray, time.perf_counter()
        step = "minhash_dedup"
        if verifier is not None:  # a text verifier's part files (the jobs', pushed at the start), where tasks read them
            from tasks.core.executor import task_location
            from tasks.core.storage import map_paths

            verifier = map_paths(verifier, lambda p: task_location(p)[0], self.files.options)
        if method == "local":
            alive, stats = ray.get(self._task(_minhash_local).remote(
                self.files, list(self.done), self.jobs, self.blocks, mh, verifier))
            alive = [alive]
        else:
            alive, stats = self._minhash_ray(mh, verifier)
        self._finish(step, t0, alive)
        return stats

    def _minhash_ray(self, mh, verifier) -> tuple[list, dict]:
        from tasks.dedup.cluster import default_partitions, memory_estimate, format_estimate, spilled_components

        ray = self.ray
        spill_dir = self.files.spill("minhash_dedup")
        n_total = sum(j.kept for j in self.jobs)
        if n_total >= 1 << 32:
            raise ValueError("spilled rows hold the document position in a uint32")
        partitions = max(2, mh.partitions or default_partitions(n_total, mh.bands))  # ≥ 2: tuple returns stay lists
        self.layout["partitions"]["minhash_dedup"] = partitions
        spill = self._task(_spill_bands)
        alive = ray.get([spill.remote(self.files, list(self.done), self._block_jobs(b), mh.bands, mh.rows, partitions,
                                      str(spill_dir), b, _sig_dtype(mh)) for b in range(len(self.blocks))])
        n_valid = sum(a[2] for a in alive)
        est = memory_estimate(n_valid, mh.bands * mh.rows, mh.bands, _sig_dtype(mh).itemsize, partitions)
        print(format_estimate(est, "ray"), flush=True)
        stats: dict = {"method": "ray", "memory_estimate": est, "partitions": partitions, "docs": n_valid}
        t1 = time.perf_counter()
        final_refs = (spilled_components(spill_dir, partitions, verifier, stats, self.files.options)
                      if n_valid >= 2 else [])
        stats["seconds"] = round(time.perf_counter() - t1, 3)
        # survivors per partition of the component roots: a component's edges all name its root, so
        # each task holds whole components, ~1/partitions of the clustered documents (not the corpus')
        split = ray.remote(num_cpus=1, num_returns=partitions)(_split_by_root)
        by_root = [split.remote(partitions, e) for e in final_refs]
        survive = self._task(_ray_survivors)
        got = ray.get([survive.remote(self.files, self.jobs, self.blocks, mh, verifier, p, *[s[p] for s in by_root])
                       for p in range(partitions)])
        stats.update(_merge_survivor_stats(got))
        return [a[:2] for a in alive], stats

    def index_step(self, mh, storage=None) -> "IndexHandle":
        """Continued pretraining: this run's kept documents against the index of earlier runs, in a
        Ray actor that opens the index, reads the jobs' meta files itself and keeps the additions
        until `IndexHandle.save` (the driver passes file names only)."""
        from tasks.core.storage import is_remote

        ray, t0 = self.ray, time.perf_counter()
        opts = {}
        if not is_remote(str(mh.index_dir)):  # a local index_dir is a path on the driver's machine
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                         soft=False)
        # no CPU held while it waits for `save` (the filter pass and the report need both)
        actor = ray.remote(_IndexWriter).options(**opts).remote()
        # the index's own (unverified) banding of the signatures: `MinHashConfig.index_rows`
        ray.get(actor.open.remote(mh.index_dir, *mh.index_banding(), mh.seed, mh.scheme, mh.hash, storage))
        alive = ray.get(actor.add_jobs.remote(self.files, list(self.done), self.jobs, self.blocks, _sig_dtype(mh)))
        self._finish("minhash_index", t0, [alive])
        return IndexHandle(actor)

    def _written(self, kind: str) -> list[Path | str]:
        """The steps' per-job files of `kind` ("parquet" drops, "jsonl" lines) there are: per step,
        per job, in corpus order (one listing per step)."""
        out = []
        for s in self.done:
            there = set(self.files.names(self.files.step(s)))
            out += [join(self.files.step(s), n) for j in self.jobs if (n := f"j-{j.name}.{kind}") in there]
        return out

    def dropped_lines(self) -> list[Path]:
        """dropped.jsonl's dedup lines: per step, per job, in corpus order; from a store, fetched
        into one local file (the driver writes dropped.jsonl)."""
        found = self._written("jsonl")
        if not is_remote(self.files.root):
            return found
        out = self.local / "dropped-lines.jsonl"
        with open(out, "wb") as w:
            for loc in found:
                w.write(read_bytes(loc, self.files.options))
        return [out]

    def drop_files(self) -> list[str]:
        """The steps' drop files (read by `dedup_report_task` with the jobs' options)."""
        return [str(p) for p in self._written("parquet")]


class _IndexWriter:
    """Ray actor: the run's `MinHashIndex` (opened here: an object-store index's store from
    `storage`, as `check_index_store` resolves it), its additions held until `save`."""

    def open(self, index_dir: str, bands: int, rows: int, seed: int, scheme: str, hash: str, storage) -> None:
        from tasks.core.storage import is_remote, store_for_uri
        from tasks.dedup.index import SETTING, MinHashIndex

        if storage is not None and is_remote(str(index_dir)):  # this process's store for the URI (its options)
            store_for_uri(str(index_dir), SETTING, storage.check_timeout, storage)
        self.index = MinHashIndex.open(index_dir, bands, rows, seed, scheme, hash)

    def add_jobs(self, files: Files, prior: list[str], jobs: list[JobDocs], blocks: list[list[int]],
                 dtype: np.dtype) -> list[int]:
        """Each job's alive documents against the earlier runs' index (never against each other:
        the clustering decided between them), in corpus order; the hits written as drop pieces.
        Returns [alive documents, their bytes]."""
        n = nbytes = 0
        for job in jobs:
            pos, t = read_alive(files, prior, job, ["id", "sig", "source", "nbytes"])
            size = t.column("nbytes").to_numpy()
            n, nbytes = n + len(pos), nbytes + int(size.sum())
            ids = t.column("id").to_pylist()
            sigs = [None if s is None else np.frombuffer(s, dtype=dtype) for s in t.column("sig").to_pylist()]
            earlier = self.index.add(ids, sigs, within_batch=False, earlier_runs_only=True)
            hit = [k for k, e in enumerate(earlier) if e is not None]
            if hit:
                srcs = t.column("source").take(pa.array(hit))
                drops = pa.table({"pos": pos[hit], "id": [ids[k] for k in hit],
                                  "dup_pos": np.full(len(hit), -1, np.int64), "dup_of": [earlier[k] for k in hit],
                                  "source": srcs, "dup_source": pa.nulls(len(hit), pa.string()),
                                  "nbytes": size[hit]}, schema=DROP_SCHEMA)
                _write_pieces(files, "minhash_index", drops, jobs, blocks, f"index-{job.name}")
        return [n, nbytes]

    def save(self, index_dir: str) -> str:
        return str(self.index.save(index_dir))


class IndexHandle:
    """The driver's handle on the run's index actor: `save` once the run's output is complete."""

    def __init__(self, actor):
        self.actor = actor

    def save(self, index_dir: str) -> str:
        import ray

        try:
            return ray.get(self.actor.save.remote(index_dir))
        finally:
            ray.kill(self.actor)


def _sig_dtype(mh) -> np.dtype:
    return np.dtype(np.uint64 if mh.scheme == "legacy" else np.uint32)


def _spill_bands(files: Files, prior: list[str], jobs: list[JobDocs], bands: int, rows: int, partitions: int,
                 spill_dir: str, block: int, dtype: np.dtype) -> list[int]:
    """Block task: band keys (document = position) of the alive documents with a signature.
    Returns [alive documents, their bytes, documents with a signature]."""
    from tasks.dedup.cluster import band_hashes, spill_partitioned

    n = nbytes = valid = 0
    docs, sigs = [], []
    for job in jobs:
        pos, t = read_alive(files, prior, job, ["sig", "nbytes"])
        n, nbytes = n + len(pos), nbytes + int(t.column("nbytes").to_numpy().sum())
        col = t.column("sig")
        has = col.is_valid().to_numpy(zero_copy_only=False)
        for p, s in zip(pos[has], col.filter(pa.array(has)).to_pylist()):
            docs.append(p)
            sigs.append(s)
    if docs:
        arr = np.frombuffer(b"".join(sigs), dtype=dtype).reshape(len(sigs), -1)
        keys = band_hashes(arr, bands, rows).ravel()
        valid = len(docs)
        spill_partitioned({"band": np.tile(np.arange(bands, dtype=np.uint8), valid), "key": keys,
                           "doc": np.repeat(np.asarray(docs, dtype=np.uint32), bands)}, keys, partitions, spill_dir,
                          block, files.options)
    return [n, nbytes, valid]


def _alive_sigs(files: Files, prior: list[str], jobs: list[JobDocs], mh, want_scores: bool):
    """(positions, ids, sources, signatures or None, scores) of every alive document, corpus order."""
    dtype = _sig_dtype(mh)
    pos, ids, srcs, sigs, scores, sizes = [], [], [], [], [], []
    for job in jobs:
        p, t = read_alive(files, prior, job, ["id", "source", "sig", "score", "nbytes"])
        pos.append(p)
        sizes.append(t.column("nbytes").to_numpy())
        ids += t.column("id").to_pylist()
        srcs += t.column("source").to_pylist()
        sigs += [None if s is None else np.frombuffer(s, dtype=dtype) for s in t.column("sig").to_pylist()]
        if want_scores:
            scores += t.column("score").to_pylist()
    cat = (lambda a: np.concatenate(a) if a else np.empty(0, np.int64))
    return cat(pos), ids, srcs, sigs, (scores if want_scores else None), cat(sizes)


def _drops_table(pos, ids, srcs, sizes, survivors) -> pa.Table:
    """Drops (DROP_SCHEMA) of the documents whose survivor (index into the same lists) is another."""
    survivors = np.asarray(survivors, dtype=np.int64)
    k = np.flatnonzero(survivors != np.arange(len(survivors)))
    s = survivors[k]
    return pa.table({"pos": pos[k], "id": [ids[i] for i in k], "dup_pos": pos[s], "dup_of": [ids[i] for i in s],
                     "source": [srcs[i] for i in k], "dup_source": [srcs[i] for i in s], "nbytes": sizes[k]},
                    schema=DROP_SCHEMA)


def _minhash_local(files: Files, prior: list[str], jobs: list[JobDocs], blocks: list[list[int]], mh, verifier):
    """One Ray task: the in-process clustering (`clustering: local`) of the alive documents."""
    from tasks.dedup.cluster import cluster_signatures

    pos, ids, srcs, sigs, scores, sizes = _alive_sigs(files, prior, jobs, mh, mh.survivor == "quality")
    verify = verifier.reindexed(pos) if verifier is not None else None  # alive k → row pos[k] of the parts
    survivors, stats = cluster_signatures(sigs, mh.bands, mh.rows, method="local", verify=verify, scores=scores,
                                          representative_threshold=mh.representative_threshold)
    _write_pieces(files, "minhash_dedup", _drops_table(pos, ids, srcs, sizes, survivors), jobs, blocks, "local")
    return [len(pos), int(sizes.sum())], stats


def _split_by_root(partitions: int, edges: np.ndarray) -> list[np.ndarray]:
    """Final star edges (leaf, root) of one partition, split by the root's partition."""
    from tasks.dedup.cluster import _split_by_partition

    return _split_by_partition(edges[:, 1], edges[:, 0], partitions)  # (root, leaf) rows: swapped back by the reader


def _merge_survivor_stats(got: list[dict]) -> dict:
    """The survivors tasks' stats as one: counts summed, rounds the most any partition needed
    (the components' rounds are independent, so this is the rounds of one task over them all)."""
    out = {"clustered_docs": sum(g["clustered_docs"] for g in got), "duplicates": sum(g["duplicates"] for g in got)}
    checks = [g["representative_check"] for g in got if "representative_check" in g]
    if checks:
        out["representative_check"] = {k: (max if k == "rounds" else sum)(c[k] for c in checks) for k in checks[0]}
    return out


def _ray_survivors(files: Files, jobs: list[JobDocs], blocks: list[list[int]], mh, verifier, part: int,
                   *final: np.ndarray):
    """Ray task: the survivors of the clusters whose root falls in partition `part`, from their
    final star edges (root, leaf), over those clustered documents only (their scores / signatures /
    texts read here)."""
    from tasks.dedup.cluster import choose_survivors, representative_survivors
    from tasks.dedup.verify import ParquetTexts, SignatureVerifier

    e = np.concatenate(final) if final else np.empty((0, 2), np.int64)
    leaves, roots = e[:, 1], e[:, 0]
    centers = np.unique(roots)
    nodes = np.concatenate([leaves, centers])
    order = np.argsort(nodes, kind="stable")
    nodes, comp_pos = nodes[order], np.concatenate([roots, centers])[order]
    stats = {"clustered_docs": int(len(nodes)), "duplicates": int(len(leaves))}
    if len(nodes) == 0:
        return stats
    comp = np.searchsorted(nodes, comp_pos)  # each node's component root, as an index into nodes
    metas = ParquetTexts([j.meta for j in jobs], [j.kept for j in jobs], column="id")
    metas.storage_options = files.options
    ids = metas.read(nodes)
    metas.column = "source"
    srcs = metas.read(nodes)
    sc = None
    if mh.survivor == "quality":
        metas.column = "score"
        sc = np.array([np.nan if x is None else float(x) for x in metas.read(nodes)], dtype=np.float64)
    if mh.representative_threshold is None:
        survivors = choose_survivors(comp, sc)
    else:
        if hasattr(verifier, "with_threshold"):
            check = verifier.with_threshold(mh.representative_threshold).reindexed(nodes)
        else:
            metas.column = "sig"
            dtype = _sig_dtype(mh)
            check = SignatureVerifier([None if s is None else np.frombuffer(s, dtype=dtype) for s in metas.read(nodes)],
                                      mh.representative_threshold)
        survivors, stats["representative_check"] = representative_survivors(comp, sc, check, on_ray=False)
    metas.column = "nbytes"
    sizes = np.asarray(metas.read(nodes), dtype=np.int64)
    _write_pieces(files, "minhash_dedup", _drops_table(nodes, ids, srcs, sizes, survivors), jobs, blocks,
                  f"ray-{part:05d}")
    return stats


# ------------------------------------------------------------------ the curated shards

def _kept_per_job(files: Files, steps: list[str], jobs: list[JobDocs], path: str) -> int:
    """Ray task: each job's documents left after the dedup steps (kept minus the rows of its drop
    files, from their footers) into `path` (.npy, one int64 a job). Returns the total."""
    there = {s: set(files.names(files.step(s))) for s in steps}
    n = np.array([j.kept - sum(num_rows(files.drops(s, j.name), files.options) for s in steps
                               if f"j-{j.name}.parquet" in there[s]) for j in jobs], dtype=np.int64)
    buf = io.BytesIO()
    np.save(buf, n)
    write_bytes(location(path), buf.getvalue(), files.options)
    return int(n.sum())


def _write_shard(out_dir: str, index: int, shard_docs: int, files: Files, steps: list[str], jobs: list[JobDocs],
                 kept_path: str, out_options: dict | None = None) -> dict:
    """Output shard `index`: output rows [index·shard_docs, (index+1)·shard_docs) of the jobs' parts
    laid end to end without the dropped positions, found from the kept counts per job. `out_dir` on
    a store (`task_location`): written in a temp folder of this node, uploaded, the folder removed.
    Returns the shard's file names and counters."""
    import tempfile

    where = location(out_dir)
    if not is_remote(where):
        return _shard_rows(where, index, shard_docs, files, steps, jobs, kept_path)
    with tempfile.TemporaryDirectory(prefix="crucible-shard-") as tmp:
        got = _shard_rows(Path(tmp), index, shard_docs, files, steps, jobs, kept_path)
        for name in got["names"]:  # a multipart upload streamed from the file: one object, whole or none
            upload(Path(tmp) / name, join(where, name), out_options)
    return got


def _shard_rows(out_dir: Path, index: int, shard_docs: int, files: Files, steps: list[str], jobs: list[JobDocs],
                kept_path: str) -> dict:
    """`_write_shard`'s rows into the local folder `out_dir`: the jobs' part row groups minus the
    dropped rows, written as tables (`ShardWriter.write_table`), counted with Arrow kernels."""
    from tasks.core.documents import ShardWriter

    kept = np.load(io.BytesIO(read_bytes(location(kept_path), files.options)))
    ends = np.cumsum(kept)
    lo, hi = index * shard_docs, min((index + 1) * shard_docs, int(ends[-1]))
    languages, sources = Counter(), Counter()
    nbytes = 0
    with ShardWriter(out_dir, prefix="shard", shard_docs=shard_docs, start_index=index) as w:
        for k in range(int(np.searchsorted(ends, lo, side="right")), len(jobs)):
            start = int(ends[k] - kept[k])
            if start >= hi:
                break
            skip, take = max(0, lo - start), min(int(ends[k]), hi) - max(lo, start)
            if take <= 0:
                continue
            job = jobs[k]
            for t in iter_alive_rows(job, _dropped_before(files, steps, job), skip, take):
                w.write_table(t)
                _count_values(languages, t.column("language"))
                _count_values(sources, pc.fill_null(t.column("source"), ""))
                nbytes += pc.sum(pc.binary_length(t.column("text"))).as_py() or 0
    return {"names": [p.name for p in w.paths], "docs": w.docs_written, "bytes": nbytes,
            "languages": {str(k) if k is not None else "None": v for k, v in languages.items()},
            "sources": dict(sources)}


def _count_values(counter: Counter, column: pa.ChunkedArray) -> None:
    """`counter` += the column's value counts (null as None), in order of first appearance."""
    counts = pc.value_counts(column)
    counter.update(dict(zip(counts.field("values").to_pylist(), counts.field("counts").to_pylist())))


def filter_pass(stages: DedupStages, out_dir: Path, shard_docs: int) -> dict:
    """The curated shards (a Ray task per shard: each finds its rows from the kept counts per job,
    which a Ray task writes to a file) and their counters. Where the tasks' nodes do not share the
    driver's working copy (`task_location`), each task writes its shard to the store itself; the
    driver then removes the store's shards of an earlier run that this one did not write and pulls
    the new ones into its working copy (recorded as the store's: a push neither uploads them again
    nor deletes them; the manifest hashes what the store holds), as it does a job's files."""
    from tasks.core.executor import task_location
    from tasks.core.resume import MANIFEST
    from tasks.core.storage import store_of_path

    ray = stages.ray
    out_dir = Path(out_dir).resolve()
    out_loc, out_options = task_location(out_dir)
    if is_remote(out_loc):  # the store's manifest first: it no longer describes the shards there
        remove(join(out_loc, MANIFEST), out_options)
    jobs = ray.put(stages.jobs)  # once into the object store, not once per shard task
    kept_path = str(join(stages.files.root, "kept_per_job.npy"))
    total = ray.get(ray.remote(num_cpus=1)(_kept_per_job).remote(stages.files, list(stages.done), jobs, kept_path))
    task = ray.remote(num_cpus=1)(_write_shard)
    got = ray.get([task.remote(str(out_loc), k, shard_docs, stages.files, list(stages.done), jobs, kept_path,
                               out_options) for k in range(-(-total // shard_docs))])
    names = [n for g in got for n in g["names"]]
    if is_remote(out_loc):
        remove_stale_shards(out_loc, names, out_options)
        store = store_of_path(out_dir)
        store.pull("", keys=[store.rel(out_dir / n) for n in names])
    out = {"shards": [str(out_dir / n) for n in names], "docs": sum(g["docs"] for g in got),
           "bytes": sum(g["bytes"] for g in got), "languages": Counter(), "sources": Counter()}
    for g in got:
        out["languages"].update(g["languages"])
        out["sources"].update(g["sources"])
    return out


REPORT_FILES_PER_TASK = 64  # drop files one report task reads first (each ≤ one job's drops of one step)
_ORDER_SHIFT = 40  # a drop's order: step index << 40 | position (drops.jsonl's order: step, then corpus)


def _spill_table(t: pa.Table, key_col: str, partitions: int, spill_dir: Path | str, task_no: int,
                 options: dict | None = None) -> None:
    """`t`'s rows into `spill_dir/p-XXXXX/` by the hash of their id column `key_col`."""
    from tasks.dedup.cluster import spill_partitioned
    from tasks.dedup.index import id_hashes

    if t.num_rows:
        spill_partitioned({c: t.column(c).to_numpy(zero_copy_only=False) for c in t.column_names},
                          id_hashes(t.column(key_col).to_pylist()), partitions, spill_dir, task_no, options)


def _read_partition(d: Path | str, schema: pa.Schema, options: dict | None = None) -> pa.Table:
    """A partition's spill files, each cast to `schema` first (a column all None reads as null)."""
    names = [n for n in listing(d, options) if "/" not in n and n.startswith("s-") and n.endswith(".parquet")]
    parts = [read_table(join(d, n), options).cast(schema) for n in names]
    return pa.concat_tables(parts) if parts else schema.empty_table()


_CHAIN = pa.schema([("id", pa.string()), ("source", pa.string()), ("order", pa.int64()), ("pos", pa.int64()),
                    ("target", pa.string()), ("tpos", pa.int64()), ("tsrc", pa.string())])
_LINK = pa.schema([("m_id", pa.string()), ("m_dup_of", pa.string()), ("m_dup_pos", pa.int64()),
                   ("m_dup_src", pa.string())])


def _report_rows(drop_files: list[str], step_index: dict[str, int], partitions: int, root: str,
                 task_no: int, options: dict | None = None) -> Counter:
    """Report task, first pass: the drops of these files as chain rows (partitioned by the id they
    point to) and as links id → duplicate_of (partitioned by id). Returns drops per (source, step)."""
    counts: Counter = Counter()
    chains, links = [], []
    for f in drop_files:
        step = name_of(parent_of(f))
        t = read_table(location(f), options)
        srcs = t.column("source").to_pylist()
        counts.update((s or "", step) for s in srcs)
        order = (np.int64(step_index[step]) << np.int64(_ORDER_SHIFT)) + t.column("pos").to_numpy()
        chains.append(pa.table([t.column("id"), t.column("source"), pa.array(order), t.column("pos"), t.column("dup_of"),
                                t.column("dup_pos"), t.column("dup_source")], schema=_CHAIN))
        links.append(pa.table([t.column("id"), t.column("dup_of"), t.column("dup_pos"), t.column("dup_source")],
                              schema=_LINK))
    if chains:
        _spill_table(pa.concat_tables(chains), "target", partitions, join(location(root), "chain-0"), task_no, options)
        _spill_table(pa.concat_tables(links), "m_id", partitions, join(location(root), "links"), task_no, options)
    return counts


def _report_hop(root: str, partition: int, rnd: int, partitions: int, options: dict | None = None) -> int:
    """Report task, one round per partition: each chain row whose target was itself dropped points
    on to that one's duplicate_of (a copy of a document later dropped as a near duplicate joins its
    survivor's cluster); rows re-partitioned by their new target. Returns how many moved on."""
    import pyarrow.compute as pc

    name = f"p-{partition:05d}"
    chain = _read_partition(join(location(root), f"chain-{rnd}", name), _CHAIN, options)
    if chain.num_rows == 0:
        return 0
    links = _read_partition(join(location(root), "links", name), _LINK, options)
    j = chain.join(links, keys="target", right_keys="m_id", join_type="left outer")
    hit = j.column("m_dup_of").is_valid()
    out = pa.table([j.column("id"), j.column("source"), j.column("order"), j.column("pos"),
                    pc.if_else(hit, j.column("m_dup_of"), j.column("target")),
                    pc.if_else(hit, j.column("m_dup_pos"), j.column("tpos")),
                    pc.if_else(hit, j.column("m_dup_src"), j.column("tsrc"))], schema=_CHAIN)
    _spill_table(out, "target", partitions, join(location(root), f"chain-{rnd + 1}"), partition, options)
    return int(pc.sum(hit.cast(pa.int64())).as_py() or 0)


def _report_clusters(root: str, partition: int, rnd: int, n_docs: int, steps: list[str], max_examples: int,
                     options: dict | None = None) -> dict:
    """Report task, last pass per partition (rows grouped by final survivor): cluster sizes, their
    count and largest, and the partition's best example candidates (largest clusters first, then
    the survivor's position, then the first drop's order: the in-process report's order)."""
    from tasks.dedup.report import size_bucket

    t = _read_partition(join(location(root), f"chain-{rnd}", f"p-{partition:05d}"), _CHAIN, options)
    if t.num_rows == 0:
        return {"sizes": Counter(), "clusters": 0, "largest": 1, "examples": []}
    g = t.group_by("target").aggregate([("order", "min"), ("order", "count")])
    counts = g.column("order_count").to_numpy()
    sizes = Counter(size_bucket(int(c) + 1) for c in counts)
    firsts = t.join(g.select(["target", "order_min"]), keys=["target", "order"], right_keys=["target", "order_min"],
                    join_type="inner")
    firsts = firsts.join(g.select(["target", "order_count"]), keys="target")
    tpos = firsts.column("tpos").to_numpy(zero_copy_only=False)
    kept_pos = np.where(tpos >= 0, tpos, n_docs)
    order = firsts.column("order").to_numpy()
    best = np.lexsort((order, kept_pos, -firsts.column("order_count").to_numpy()))[:max_examples]
    ex = []
    for k in best:
        r = {c: firsts.column(c)[int(k)].as_py() for c in ("target", "id", "source", "tsrc", "order_count", "pos")}
        ex.append({"key": (-r["order_count"], int(kept_pos[k]), int(order[k])), "kept_pos": int(tpos[k]),
                   "dup_pos": r["pos"],
                   "example": {"kept": r["target"], "duplicate": r["id"], "step": steps[int(order[k]) >> _ORDER_SHIFT],
                               "cluster_size": r["order_count"] + 1, "source_kept": r["tsrc"] or "",
                               "source_duplicate": r["source"] or ""}})
    return {"sizes": sizes, "clusters": len(counts), "largest": int(counts.max()) + 1, "examples": ex}


def dedup_report_task(drop_files: list[str], docs_by_source: dict[str, int], n_docs: int, jobs: list[JobDocs],
                      mh, ngram: int, max_examples: int = 10) -> dict:
    """Ray task: the dedup report (`tasks.dedup.report`) from the drop files, partitioned so no
    task holds more than ~`KEY_PARTITION_ROWS` drops (or 1/`partitions` of them): Ray tasks turn the
    drops into chain rows, follow each to its final survivor in rounds (one per dedup step at most)
    and count clusters per partition of the survivor; this task merges their counters and best
    examples, then reads the examples' signatures and texts for their Jaccard."""
    import ray

    from tasks.dedup.report import add_text_jaccard, assemble_report

    options = jobs[0].options if jobs else None  # the drop files lie beside the jobs' (one store)
    steps = list(dict.fromkeys(name_of(parent_of(f)) for f in drop_files))
    n_drops = sum(num_rows(location(f), options) for f in drop_files)
    if n_drops == 0:
        return assemble_report(docs_by_source, n_docs, {}, 0, {}, 0, 1, [])
    partitions = mh.partitions or max(1, -(-n_drops // KEY_PARTITION_ROWS))
    root = join(parent_of(parent_of(location(drop_files[0]))), "_report")
    remove_tree(root, options)
    task = ray.remote(num_cpus=1)
    index = {s: k for k, s in enumerate(steps)}
    step_counts: Counter = Counter()
    for c in ray.get([task(_report_rows).remote(drop_files[i:i + REPORT_FILES_PER_TASK], index, partitions,
                                                str(root), i // REPORT_FILES_PER_TASK, options)
                      for i in range(0, len(drop_files), REPORT_FILES_PER_TASK)]):
        step_counts.update(c)
    rnd = 0  # a chain is at most one link per step: a round more means a cycle, left as it is
    while True:
        moved = sum(ray.get([task(_report_hop).remote(str(root), p, rnd, partitions, options)
                             for p in range(partitions)]))
        rnd += 1
        if not moved or rnd > len(steps):
            break  # chain-<rnd>: the rows partitioned by their final survivor
    got = ray.get([task(_report_clusters).remote(str(root), p, rnd, n_docs, steps, max_examples, options)
                   for p in range(partitions)])
    remove_tree(root, options)
    sizes: Counter = Counter()
    for g in got:
        sizes.update(g["sizes"])
    cands = sorted((e for g in got for e in g["examples"]), key=lambda e: e["key"])[:max_examples]
    report = assemble_report(docs_by_source, n_docs, step_counts, n_drops, sizes, sum(g["clusters"] for g in got),
                             max(g["largest"] for g in got), [e["example"] for e in cands])
    pos_of = {}
    for e in cands:
        pos_of[e["example"]["duplicate"]] = e["dup_pos"]
        if e["kept_pos"] >= 0:
            pos_of[e["example"]["kept"]] = e["kept_pos"]
    want = sorted(pos_of)
    if want:
        from tasks.dedup.verify import ParquetTexts

        rows = np.array([pos_of[i] for i in want], dtype=np.int64)
        parts = [(p, n) for j in jobs for p, n in zip(j.docs, part_counts(j))]
        texts = ParquetTexts([p for p, _ in parts], [n for _, n in parts])
        metas = ParquetTexts([j.meta for j in jobs], [j.kept for j in jobs], column="sig")
        texts.storage_options = metas.storage_options = options
        texts = dict(zip(want, texts.read(rows)))
        dtype = _sig_dtype(mh)
        sigs = {i: (None if s is None else np.frombuffer(s, dtype=dtype)) for i, s in zip(want, metas.read(rows))}
        for ex in report["examples"]:
            a, b = sigs.get(ex["kept"]), sigs.get(ex["duplicate"])
            if a is not None and b is not None:
                ex["jaccard_estimate"] = round(float(np.mean(a == b)), 4)
        add_text_jaccard(report, texts, ngram)
    return report


def part_counts(job: JobDocs) -> list[int]:
    if len(job.docs) == 1:
        return [job.kept]
    return [num_rows(p, job.options) for p in job.docs]


def concat_files(paths: Iterable[Path | str], out: Path, expect: dict[str, str] | None = None) -> None:
    """`out` (atomically): the files' bytes in order, streamed; a store run's file that a job on
    another node left on the store is read there (`read_location`). With `expect` ({path: sha256}
    its jobs reported), every file is held to its sha256 on the read that copies it (StorageError
    before `out` is replaced; a file it does not name is refused)."""
    from tasks.core.fs import StorageError, copy_checked
    from tasks.core.storage import read_location

    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with open(tmp, "wb") as w:
            for p in paths:
                if expect is not None and str(p) not in expect:
                    raise StorageError(f"{p}: no sha256 recorded for it; it is not merged")
                at, options = read_location(p)
                copy_checked(at, w, None if expect is None else expect[str(p)], options)
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
