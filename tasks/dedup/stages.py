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
  rounds of `tasks.dedup.cluster` run as before; a survivors task receives the final star edges
  as object refs (never the driver) and applies the representative check over the clustered
  documents only.
- Index (continued pretraining): `MinHashIndex.add` over this run's kept documents in corpus order,
  in the driver (it holds the index's additions until `save`).

After each step a collect task per block sorts the step's drops by position and writes, per job,
`<step>/j-<job>.parquet` (what later steps read) and `<step>/j-<job>.jsonl` (dropped.jsonl's lines).
`filter_pass` then writes the curated shards (a task per output shard: the jobs' parts without the
dropped positions; shard k holds output rows [k·shard_docs, (k+1)·shard_docs), so the shards equal
a sequential write) and `dedup_report_task` the report, from the drop files.
"""
from __future__ import annotations

import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

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
    """One curate job's kept documents: meta file, part files, how many, the first one's position."""
    name: str
    meta: str
    docs: tuple[str, ...]
    kept: int
    offset: int


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
    """Where the dedup steps keep their files (under the stage's `_parts`)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def step(self, step: str) -> Path:
        return self.root / step

    def drops(self, step: str, job: str) -> Path:
        return self.root / step / f"j-{job}.parquet"

    def lines(self, step: str, job: str) -> Path:
        return self.root / step / f"j-{job}.jsonl"

    def pieces(self, step: str, block: int) -> Path:
        return self.root / step / f"b-{block:05d}"


def _dropped_before(files: Files, steps: Sequence[str], job: JobDocs) -> np.ndarray:
    """Positions of `job` that the earlier `steps` dropped (sorted)."""
    got = [pq.read_table(p, columns=["pos"]).column(0).to_numpy()
           for s in steps if (p := files.drops(s, job.name)).is_file()]
    return np.sort(np.concatenate(got)) if got else np.empty(0, np.int64)


def read_alive(files: Files, steps: Sequence[str], job: JobDocs, columns: list[str]) -> tuple[np.ndarray, pa.Table]:
    """(positions, meta columns) of the job's documents the earlier `steps` kept."""
    t = pq.read_table(job.meta, columns=columns)
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
        d = files.pieces(step, int(b))
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".{name}.tmp"
        pq.write_table(drops.filter(pa.array(block_of == b)), tmp, compression="zstd")
        tmp.replace(d / f"{name}.parquet")


def _collect(files: Files, step: str, block: int, jobs: Sequence[JobDocs], reason: str) -> dict[str, list[int]]:
    """The step's drops of one block, by position, per job: `<step>/j-<job>.parquet` and `.jsonl`.
    Returns {job name: [drops, bytes dropped]}."""
    from tasks.core.documents import AtomicJsonlWriter

    d = files.pieces(step, block)
    pieces = sorted(d.glob("*.parquet")) if d.is_dir() else []
    t = pa.concat_tables([pq.read_table(p) for p in pieces]) if pieces else DROP_SCHEMA.empty_table()
    t = t.take(pa.array(np.argsort(t.column("pos").to_numpy(), kind="stable")))
    pos = t.column("pos").to_numpy()
    out = {}
    for job in jobs:
        sel = (pos >= job.offset) & (pos < job.offset + job.kept)
        if not sel.any():
            continue
        part = t.filter(pa.array(sel))
        tmp = files.drops(step, job.name).with_name(f".j-{job.name}.tmp")
        pq.write_table(part, tmp, compression="zstd")
        tmp.replace(files.drops(step, job.name))
        with AtomicJsonlWriter(files.lines(step, job.name)) as w:
            for doc_id, dup_of in zip(part.column("id").to_pylist(), part.column("dup_of").to_pylist()):
                w.write({"id": doc_id, "step": reason, "reason": reason, "duplicate_of": dup_of})
        out[job.name] = [part.num_rows, int(part.column("nbytes").to_numpy().sum())]
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
        spill_partitioned(arrays, fmix64(arrays["k0"].copy()), partitions, files.step(step) / "_spill", block)
    return [n, nbytes]


def _resolve_keys(files: Files, step: str, partition: int, rule: str, jobs: list[JobDocs],
                  blocks: list[list[int]]) -> None:
    """Partition task: per key the survivor (`rule` "first": smallest position; "url": newest
    crawl, then most bytes, then first), the other documents dropped as its duplicates."""
    d = files.step(step) / "_spill" / f"p-{partition:05d}"
    parts = sorted(d.glob("s-*.parquet")) if d.is_dir() else []
    if not parts:
        return
    t = pq.read_table(parts)
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

        self.ray = ray
        self.jobs = jobs
        self.files = Files(work_dir)
        shutil.rmtree(self.files.root, ignore_errors=True)
        self.files.root.mkdir(parents=True)
        self.blocks = blocks_of(jobs, block_docs or BLOCK_DOCS)
        self.partitions = partitions
        self.done: list[str] = []  # steps run, in order
        self.steps: list[StepStats] = []
        self.dropped_per_job: Counter = Counter()
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
        n = b = 0
        for per_job in got:
            for name, (k, nb) in per_job.items():
                self.dropped_per_job[name] += k
                n, b = n + k, b + nb
        if n:
            st.dropped[step] = n
        st.docs_out, st.bytes_out = st.docs_in - n, st.bytes_in - b
        shutil.rmtree(self.files.step(step) / "_spill", ignore_errors=True)
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
        spill_dir = self.files.step("minhash_dedup") / "_spill"
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
        final_refs = spilled_components(spill_dir, partitions, verifier, stats) if n_valid >= 2 else []
        stats["seconds"] = round(time.perf_counter() - t1, 3)
        st = ray.get(self._task(_ray_survivors).remote(self.files, self.jobs, self.blocks, mh, verifier,
                                                       *final_refs))
        stats.update(st)
        return [a[:2] for a in alive], stats

    def index_step(self, mh_index, mh) -> StepStats:
        """Continued pretraining: this run's kept documents against the index of earlier runs."""
        t0, ids, sigs, pos, srcs, sizes = time.perf_counter(), [], [], [], [], []
        for job in self.jobs:
            p, t = read_alive(self.files, self.done, job, ["id", "sig", "source", "nbytes"])
            ids += t.column("id").to_pylist()
            srcs += t.column("source").to_pylist()
            sizes.append(t.column("nbytes").to_numpy())
            sigs += [None if s is None else np.frombuffer(s, dtype=_sig_dtype(mh)) for s in t.column("sig").to_pylist()]
            pos.append(p)
        pos_a = np.concatenate(pos) if pos else np.empty(0, np.int64)
        size_a = np.concatenate(sizes) if sizes else np.empty(0, np.int64)
        alive = [len(ids), int(size_a.sum())]
        earlier = mh_index.add(ids, sigs, within_batch=False)
        hit = [k for k, e in enumerate(earlier) if e is not None]
        drops = pa.table({"pos": pos_a[hit], "id": [ids[k] for k in hit], "dup_pos": np.full(len(hit), -1, np.int64),
                          "dup_of": [earlier[k] for k in hit], "source": [srcs[k] for k in hit],
                          "dup_source": [None] * len(hit), "nbytes": size_a[hit]}, schema=DROP_SCHEMA)
        _write_pieces(self.files, "minhash_index", drops, self.jobs, self.blocks, "index")
        return self._finish("minhash_index", t0, [alive])

    def dropped_lines(self) -> list[Path]:
        """dropped.jsonl's dedup lines: per step, per job, in corpus order."""
        return [p for s in self.done for j in self.jobs if (p := self.files.lines(s, j.name)).is_file()]

    def drop_files(self) -> list[str]:
        return [str(p) for s in self.done for j in self.jobs if (p := self.files.drops(s, j.name)).is_file()]


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
                          block)
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


def _ray_survivors(files: Files, jobs: list[JobDocs], blocks: list[list[int]], mh, verifier, *final: np.ndarray):
    """Ray task: the clusters' survivors from the final star edges (leaf, root) of the connected
    components, over the clustered documents only (their scores / signatures / texts read here)."""
    from tasks.dedup.cluster import choose_survivors, representative_survivors
    from tasks.dedup.verify import ParquetTexts, SignatureVerifier

    e = np.concatenate(final) if final else np.empty((0, 2), np.int64)
    leaves, roots = e[:, 0], e[:, 1]
    centers = np.unique(roots)
    nodes = np.concatenate([leaves, centers])
    order = np.argsort(nodes, kind="stable")
    nodes, comp_pos = nodes[order], np.concatenate([roots, centers])[order]
    stats = {"clustered_docs": int(len(nodes)), "duplicates": int(len(leaves))}
    if len(nodes) == 0:
        return stats
    comp = np.searchsorted(nodes, comp_pos)  # each node's component root, as an index into nodes
    metas = ParquetTexts([j.meta for j in jobs], [j.kept for j in jobs], column="id")
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
    _write_pieces(files, "minhash_dedup", _drops_table(nodes, ids, srcs, sizes, survivors), jobs, blocks, "ray")
    return stats


# ------------------------------------------------------------------ the curated shards

def _write_shard(out_dir: str, index: int, shard_docs: int, spans: list[tuple[list[str], int, int, int, list[str]]]) -> dict:
    """Output shard `index`: per span (job meta, its parts, its first position, the kept-after-dedup
    rows to skip, to take, its drop files) the documents in order, the dropped positions left out."""
    from tasks.core.documents import ShardWriter, iter_docs

    languages, sources = Counter(), Counter()
    nbytes = 0
    with ShardWriter(out_dir, prefix="shard", shard_docs=shard_docs, start_index=index) as w:
        for parts, offset, skip, take, drop_files in spans:
            gone = set()
            for f in drop_files:
                gone.update(pq.read_table(f, columns=["pos"]).column(0).to_pylist())
            pos, seen = offset - 1, 0
            for doc in iter_docs(parts):
                pos += 1
                if pos in gone:
                    continue
                seen += 1
                if seen <= skip:
                    continue
                if seen > skip + take:
                    break
                w.write(doc)
                languages[doc.get("language")] += 1
                sources[doc.get("source") or ""] += 1
                nbytes += len(doc["text"].encode("utf-8"))
    return {"paths": [str(p) for p in w.paths], "docs": w.docs_written, "bytes": nbytes,
            "languages": {str(k) if k is not None else "None": v for k, v in languages.items()},
            "sources": dict(sources)}


def filter_pass(stages: DedupStages, out_dir: Path, shard_docs: int) -> dict:
    """The curated shards (a Ray task per shard) and their counters."""
    ray = stages.ray
    spans_of: list[list] = []
    row = 0
    for job in stages.jobs:
        n = job.kept - stages.dropped_per_job[job.name]
        drops = [str(p) for s in stages.done if (p := stages.files.drops(s, job.name)).is_file()]
        done = 0
        while done < n:
            k = row // shard_docs
            take = min(n - done, (k + 1) * shard_docs - row)
            while len(spans_of) <= k:
                spans_of.append([])
            spans_of[k].append((list(job.docs), job.offset, done, take, drops))
            done, row = done + take, row + take
    task = ray.remote(num_cpus=1)(_write_shard)
    got = ray.get([task.remote(str(out_dir), k, shard_docs, spans) for k, spans in enumerate(spans_of)])
    out = {"shards": [p for g in got for p in g["paths"]], "docs": sum(g["docs"] for g in got),
           "bytes": sum(g["bytes"] for g in got), "languages": Counter(), "sources": Counter()}
    for g in got:
        out["languages"].update(g["languages"])
        out["sources"].update(g["sources"])
    return out


def dedup_report_task(drop_files: list[str], docs_by_source: dict[str, int], n_docs: int, jobs: list[JobDocs],
                      mh, ngram: int) -> dict:
    """Ray task: `tasks.dedup.report.report_from_drops` over the drop files, with the example
    pairs' signature and text Jaccard read from the meta and part files."""
    from tasks.dedup.report import add_text_jaccard, example_ids, report_from_drops
    from tasks.dedup.verify import ParquetTexts

    t = pa.concat_tables([pq.read_table(f) for f in drop_files]) if drop_files else DROP_SCHEMA.empty_table()
    steps = []
    for f in drop_files:
        steps += [Path(f).parent.name] * pq.ParquetFile(f).metadata.num_rows
    drops = list(zip(t.column("id").to_pylist(), steps, t.column("dup_of").to_pylist()))
    pos_of = {d: p for d, p in zip(t.column("id").to_pylist(), t.column("pos").to_pylist())}
    pos_of.update({d: p for d, p in zip(t.column("dup_of").to_pylist(), t.column("dup_pos").to_pylist())
                   if p is not None and p >= 0})
    report = report_from_drops(docs_by_source, n_docs, drops, t.column("source").to_pylist(), pos_of,
                               {d: s for d, s in zip(t.column("dup_of").to_pylist(), t.column("dup_source").to_pylist())
                                if s is not None})
    want = sorted(i for i in example_ids(report) if i in pos_of)
    if want:
        rows = np.array([pos_of[i] for i in want], dtype=np.int64)
        parts = [(p, n) for j in jobs for p, n in zip(j.docs, part_counts(j))]
        texts = dict(zip(want, ParquetTexts([p for p, _ in parts], [n for _, n in parts]).read(rows)))
        metas = ParquetTexts([j.meta for j in jobs], [j.kept for j in jobs], column="sig")
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
    return [pq.ParquetFile(p).metadata.num_rows for p in job.docs]


def concat_files(paths: Sequence[Path | str], out: Path) -> None:
    """`out` (atomically): the files' bytes in order, streamed."""
    tmp = out.with_name(f".{out.name}.tmp")
    with open(tmp, "wb") as w:
        for p in paths:
            with open(p, "rb") as r:
                shutil.copyfileobj(r, w, 1 << 20)
    tmp.replace(out)


def job_docs(results: list[dict]) -> list[JobDocs]:
    """The jobs' kept documents with their positions (results in corpus order)."""
    out, off = [], 0
    for r in results:
        out.append(JobDocs(r["name"], r["meta"], tuple(r["docs"]), r["kept"], off))
        off += r["kept"]
    return out

