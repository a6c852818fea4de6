"""MinHash LSH clustering at corpus scale: band keys spilled to Parquet partitions, candidate
pairs per partition, connected components by a distributed union-find on Ray.

The in-process path (`minhash.minhash_clusters`: one dict of band keys, one union-find) holds
every band key of the corpus in one Python process — ~3 KB per document with the default 28 bands, so it
stops at a few million documents. This path keeps memory bounded by the partition size:

1. spill (a Ray task per signature shard): each document's band keys — a 64-bit hash of the
   band's `rows` values (`band_hashes`) — are written as rows (band:uint8, key:uint64,
   doc:uint32) into `partitions` Parquet directories, chosen by the key's hash, so all rows of
   one (band, key) land in the same partition;
2. pairs (a Ray task per partition): rows sorted by (key, band, doc); every document of a
   (band, key) group is paired with the group's first (smallest) document — the candidate pairs
   of the in-process path — and the partition's pairs are reduced to a forest (each node → the
   smallest node of its local component, `local_components`), which keeps connectivity;
3. components (Ray tasks per partition and round): the alternating large-star / small-star
   algorithm (Kiveris et al., "Connected Components in MapReduce and Beyond", SoCC 2014) on the
   edge lists, sharded by node hash; each round every task sends each partition its edges, no
   process holds the whole graph. At the fixed point every component is a star around its
   smallest document (checked per partition: no node has both smaller and larger neighbours,
   none has two smaller ones);
4. survivors (`representative_survivors`, with a `representative_threshold`; without one,
   `choose_survivors`): a cluster's representative is its best member — the smallest document
   (first seen), or the highest quality score with ties to the first seen — and a member is
   dropped as its duplicate only if its Jaccard to it reaches the threshold: exact with a text
   verifier (`JaccardVerifier.with_threshold`), else estimated from the signatures
   (`verify.SignatureVerifier`). Connected components chain (A~B, B~C joins A and C though
   A !~ C); a member failing the check is not dropped for the chain's sake: the members that
   failed form the cluster's next round, around their own best member, until none is left
   (after `REPRESENTATIVE_ROUNDS` the rest are kept). Deterministic: it depends only on the
   components, the scores and the corpus order.

The result equals the in-process path's: the same candidate pairs (up to a 64-bit band-key
collision, probability ≈ n²/2⁶⁵ per band: ~3·10⁻⁶ at 10 M documents) and the same components.
With a verifier (`tasks.dedup.verify`: an object whose `mask(pairs)` checks a batch of pairs,
e.g. the exact shingle Jaccard, reading the texts itself) step 2 routes each partition's pairs
by the partition of their first document, and a Ray task per partition checks the distinct
pairs it receives (in chunks, each pair once, though a near-duplicate pair matches several
bands whose keys lie in different partitions) before the reduction to a forest — the verifier
is put into the object store once and never runs in the driver (as the in-process path joins
only verified pairs, its components are those of the verified pairs too; the pairs checked are
the in-process path's). `cluster_signatures` puts a text verifier behind its signature prefilter
(`verify.SignaturePrefilter`: pairs far below the threshold rejected unread) on both paths; on Ray
the signatures travel with the verifier. (The curate stage's Ray path, `stages._minhash_ray`,
calls `spilled_components` with the bare verifier: its spill rows carry no signatures.)
With an object-store run_root (`work_dir` in its working copy) on a cluster of several nodes the
spill files of step 1 are written to the store by the tasks that make them and each step-2 task
reads its partition from there (`tasks.core.executor.task_location`), so the tasks of the two
steps may run on different machines; the driver's working copy never holds them, and their
prefix is deleted from the store when step 2 is done. A text verifier reads its part files on
the store the same way (pushed by the driver first, `for_any_node`).
`memory_estimate` gives the bytes of each part; `cluster_signatures` prints it before running.
"""
from __future__ import annotations

import io
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from tasks.core.fs import files, is_remote, join, location, read_bytes, remove_tree, write_bytes
from tasks.dedup.minhash import VERIFY_CHUNK_PAIRS, fmix64

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ROW_BYTES = 1 + 8 + 4  # band, key, doc per spilled row
_PARTITION_TARGET_ROWS = 4_000_000  # ≈ 52 MB of spilled rows per partition; ~4× that to sort


def band_hashes(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n, bands) uint64: a 64-bit hash of each band's `rows` signature values."""
    n = len(sigs)
    v = np.asarray(sigs[:, : bands * rows]).reshape(n, bands, rows)
    acc = v[:, :, 0].astype(np.uint64)
    r1, r2 = np.uint64(27), np.uint64(37)
    for r in range(1, rows):
        rot = acc << r1
        acc >>= r2
        acc |= rot
        acc ^= v[:, :, r].astype(np.uint64)
        acc *= _GOLDEN
    return fmix64(acc)


def _partition_of(x: np.ndarray, partitions: int) -> np.ndarray:
    """Partition of uint64 keys (already well mixed); uint16, so a stable argsort is a radix sort."""
    return (x % np.uint64(partitions)).astype(np.uint16)


def _node_partition(nodes: np.ndarray, partitions: int) -> np.ndarray:
    return _partition_of(fmix64(nodes.astype(np.uint64)), partitions)


# ------------------------------------------------------------------ memory estimate

def default_partitions(n_docs: int, bands: int) -> int:
    return int(min(1024, max(4, math.ceil(n_docs * bands / _PARTITION_TARGET_ROWS))))


def memory_estimate(n_docs: int, num_perm: int, bands: int, itemsize: int = 4,
                    partitions: int | None = None, shard_docs: int = 250_000) -> dict:
    """Bytes of the clustering's parts: all signatures (if one process held them), all band keys
    (spilled to disk, not in memory), candidate pairs (upper bound: one pair per document and
    band), and what one process holds at a time (a signature shard with its keys, or one
    partition sorted)."""
    partitions = partitions or default_partitions(n_docs, bands)
    sig = n_docs * num_perm * itemsize
    keys = n_docs * bands * _ROW_BYTES
    pairs = n_docs * bands * 8
    shard = min(n_docs, shard_docs) * (num_perm * itemsize + bands * (_ROW_BYTES + 16))
    part = math.ceil(keys / partitions) * 6  # table, sort order, sorted copies, group ids (measured ≈ 6×)
    return {"docs": n_docs, "signatures_bytes": sig, "band_keys_bytes": keys,
            "pairs_bytes_max": pairs, "partitions": partitions,
            "per_task_bytes": max(shard, part), "in_process_path_bytes": sig + n_docs * bands * 120}


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1024:
            return f"{n:,.0f} {unit}"
        n /= 1024
    return f"{n:,.1f} GB"


def format_estimate(est: dict, method: str = "ray") -> str:
    head = (f"MinHash clustering ({method}) memory estimate for {est['docs']:,} docs: signatures "
            f"{_size(est['signatures_bytes'])}, band keys {_size(est['band_keys_bytes'])}, candidate pairs ≤ "
            f"{_size(est['pairs_bytes_max'])}; ")
    if method == "local":
        return head + f"in this process ≈ {_size(est['in_process_path_bytes'])}"
    return head + (f"band keys spilled to {est['partitions']} Parquet partitions, per Ray task ≈ "
                   f"{_size(est['per_task_bytes'])} (in one process it would be "
                   f"≈ {_size(est['in_process_path_bytes'])})")


# ------------------------------------------------------------------ connected components (numpy)

def local_components(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Connected components of the edges (a[k], b[k]): (nodes, roots) for every node on an
    edge, root = the smallest node of its component. Vectorised hook-and-compress."""
    if len(a) == 0:
        e = np.empty(0, np.int64)
        return e, e
    nodes, inv = np.unique(np.concatenate([a, b]).astype(np.int64), return_inverse=True)
    ea, eb = inv[: len(a)], inv[len(a):]
    label = np.arange(len(nodes))
    while True:
        la, lb = label[ea], label[eb]
        diff = la != lb
        if not diff.any():
            break
        la, lb = la[diff], lb[diff]
        lo, hi = np.minimum(la, lb), np.maximum(la, lb)
        np.minimum.at(label, hi, lo)  # hook the larger root under the smaller
        while True:  # compress: every node points at its root
            nxt = label[label]
            if np.array_equal(nxt, label):
                break
            label = nxt
    return nodes, nodes[label]


def _unique_edges(u: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    packed = np.unique((u.astype(np.uint64) << np.uint64(32)) | v.astype(np.uint64))
    return (packed >> np.uint64(32)).astype(np.int64), (packed & np.uint64(0xFFFFFFFF)).astype(np.int64)


def _split_by_partition(src: np.ndarray, dst: np.ndarray, partitions: int) -> list[np.ndarray]:
    """Directed edges (src → dst) as one (k, 2) array per partition of src."""
    part = _node_partition(src, partitions)
    order = np.argsort(part, kind="stable")
    bounds = np.searchsorted(part[order], np.arange(partitions + 1, dtype=np.int64))
    e = np.stack([src[order], dst[order]], axis=1)
    return [e[bounds[p]:bounds[p + 1]] for p in range(partitions)]


def _both_directions(a: np.ndarray, b: np.ndarray, partitions: int) -> list[np.ndarray]:
    return _split_by_partition(np.concatenate([a, b]), np.concatenate([b, a]), partitions)


def _concat(parts: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    e = np.concatenate([p for p in parts if len(p)]) if any(len(p) for p in parts) else np.empty((0, 2), np.int64)
    return _unique_edges(e[:, 0], e[:, 1]) if len(e) else (e[:, 0], e[:, 1])


def large_star(partitions: int, *parts: np.ndarray):
    """Input: directed edges u → v for the nodes u of this partition (both directions of every
    undirected edge are present somewhere). Returns (is_star_forest_here, final (node, root)
    edges if so, then one array per partition: (v, m(u)) for each neighbour v > u, where m(u)
    is the smallest of u and its neighbours — sent to partition(v) for the small-star step)."""
    u, v = _concat(parts)  # sorted by u
    if len(u) == 0:
        return (True, np.empty((0, 2), np.int64), *[np.empty((0, 2), np.int64)] * partitions)
    starts = np.flatnonzero(np.r_[True, u[1:] != u[:-1]])
    counts = np.diff(np.r_[starts, len(u)])
    first_u = u[starts]
    m = np.minimum(np.minimum.reduceat(v, starts), first_u)
    smaller = np.add.reduceat((v < u).astype(np.int64), starts)
    larger = counts - smaller
    star = bool(((smaller == 0) | ((smaller == 1) & (larger == 0))).all())
    leaves = (smaller == 1) & (larger == 0)
    final = np.stack([first_u[leaves], m[leaves]], axis=1)
    mu = np.repeat(m, counts)
    keep = v > u
    out = _split_by_partition(v[keep], mu[keep], partitions)
    return (star, final, *out)


def small_star(partitions: int, *parts: np.ndarray):
    """Input: edges u → w with w < u for the nodes u of this partition. For each u with m = the
    smallest w, emits the undirected edges (u, m) and (w, m) for w ≠ m, both directions, one
    array per partition of the source node (the next large-star's input)."""
    u, w = _concat(parts)
    if len(u) == 0:
        return tuple([np.empty((0, 2), np.int64)] * partitions)
    starts = np.flatnonzero(np.r_[True, u[1:] != u[:-1]])
    counts = np.diff(np.r_[starts, len(u)])
    m = np.repeat(np.minimum.reduceat(w, starts), counts)
    others = w != m
    a = np.concatenate([u[starts], w[others]])
    b = np.concatenate([np.minimum.reduceat(w, starts), m[others]])
    return tuple(_both_directions(a, b, partitions))


# ------------------------------------------------------------------ spill and pairs

def _load(source, options: dict | None = None) -> np.ndarray:
    if callable(source):
        return source()
    if is_remote(source):  # a .npy object on the store (`task_location`)
        return np.load(io.BytesIO(read_bytes(source, options)))
    if isinstance(source, (str, Path)):
        return np.load(source, mmap_mode="r")
    return source


def spill_shard(source, doc_offset: int, bands: int, rows: int, partitions: int, spill_dir: str,
                shard_no: int, options: dict | None = None) -> int:
    """Band keys of one signature shard → `spill_dir/p-XXXXX/s-XXXXXX.parquet` (a local folder or
    a prefix on a store, written with the fsspec `options`); returns rows."""
    sigs = _load(source, options)
    n = len(sigs)
    if n == 0:
        return 0
    keys = band_hashes(sigs, bands, rows).ravel()
    doc = np.repeat(np.arange(doc_offset, doc_offset + n, dtype=np.uint32), bands)
    band = np.tile(np.arange(bands, dtype=np.uint8), n)
    spill_partitioned({"band": band, "key": keys, "doc": doc}, keys, partitions, spill_dir, shard_no, options)
    return n * bands


def spill_partitioned(columns: dict[str, np.ndarray], keys: np.ndarray, partitions: int, spill_dir: str | Path,
                      task_no: int, options: dict | None = None) -> None:
    """Rows (`columns`, equal lengths) → `spill_dir/p-XXXXX/s-<task_no>.parquet`, each row in the
    partition of its uint64 key (`_partition_of`); each file whole or not at all (`fs.write_bytes`:
    a rename, or one PUT where `spill_dir` is a store's prefix)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    part = _partition_of(keys, partitions)
    order = np.argsort(part, kind="stable")
    bounds = np.searchsorted(part[order], np.arange(partitions + 1, dtype=np.int64))
    columns = {name: col[order] for name, col in columns.items()}
    for p in range(partitions):
        lo, hi = bounds[p], bounds[p + 1]
        if lo == hi:
            continue
        buf = io.BytesIO()
        pq.write_table(pa.table({name: col[lo:hi] for name, col in columns.items()}), buf, compression="none")
        write_bytes(join(location(spill_dir), f"p-{p:05d}", f"s-{task_no:06d}.parquet"), buf.getvalue(), options)


def read_spilled(part_dir: str | Path, options: dict | None = None):
    """One partition's spill files (`s-*.parquet` under a local folder or a store's prefix) as
    one table, in file order; None when there are none."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    loc = location(part_dir)
    names = sorted(n for n in files(loc, options) if "/" not in n and n.startswith("s-") and n.endswith(".parquet"))
    if not names:
        return None
    if not is_remote(loc):
        return pq.read_table([str(join(loc, n)) for n in names])
    return pa.concat_tables([pq.read_table(io.BytesIO(read_bytes(join(loc, n), options))) for n in names])


def partition_pairs(part_dir: str, options: dict | None = None) -> np.ndarray:
    """Candidate pairs (first document of a (band, key) group, another member) of one partition,
    as a (k, 2) int64 array, unique."""
    t = read_spilled(part_dir, options)
    if t is None:
        return np.empty((0, 2), np.int64)
    key = t.column("key").to_numpy()
    band = t.column("band").to_numpy()
    doc = t.column("doc").to_numpy()
    del t
    order = np.lexsort((doc, band, key))
    key, band, doc = key[order], band[order], doc[order]
    del order
    new = np.empty(len(key), dtype=bool)
    new[0] = True
    np.not_equal(key[1:], key[:-1], out=new[1:])
    new[1:] |= band[1:] != band[:-1]
    del key, band
    first = doc[np.flatnonzero(new)][np.cumsum(new) - 1]
    dup = ~new
    a, b = _unique_edges(first[dup], doc[dup])
    return np.stack([a, b], axis=1)


def _pairs_to_forest(pairs: np.ndarray, partitions: int) -> list[np.ndarray]:
    """A partition's pairs reduced to its local components' stars, both directions, per partition."""
    nodes, roots = local_components(pairs[:, 0], pairs[:, 1])
    keep = nodes != roots
    return _both_directions(nodes[keep], roots[keep], partitions)


def _forest_task(part_dir: str, partitions: int, options: dict | None = None):
    pairs = partition_pairs(part_dir, options)
    return (len(pairs), *_pairs_to_forest(pairs, partitions))


def _routed_pairs_task(part_dir: str, partitions: int, options: dict | None = None):
    """Step 2a with verification: the partition's candidate pairs (first, other), one array per
    partition of the first document, so that each pair is checked once (a near-duplicate pair
    shares several bands, whose keys fall in different partitions: ~8 of 28 at Jaccard 0.74)."""
    pairs = partition_pairs(part_dir, options)
    return (len(pairs), *_split_by_partition(pairs[:, 0], pairs[:, 1], partitions))


def _verified_forest_task(partitions: int, verifier, *routed: np.ndarray):
    """Step 2b: the distinct candidate pairs routed here, checked by `verifier.mask` in this Ray
    task, reduced to the forest of the verified ones."""
    a, b = _concat(routed)
    pairs = np.stack([a, b], axis=1)
    # in chunks: a call holds its pairs' texts and shingle hashes, so the chunk bounds the task's
    # memory, not the partition's pairs
    ok = _pair_checker(verifier, on_ray=False)(pairs) if len(pairs) else np.zeros(0, bool)
    return (len(pairs), int(ok.sum()), *_pairs_to_forest(pairs[ok], partitions))


def drop_spill(spill: Path | str, options: dict | None = None) -> None:
    """Remove the spill files: the local folder, or the prefix on the store."""
    remove_tree(location(spill), options)


# ------------------------------------------------------------------ driver

@dataclass
class ClusterResult:
    """Documents in clusters of two or more: `nodes[k]` belongs to the cluster whose smallest
    document is `roots[k]` (roots included, mapped to themselves)."""
    nodes: np.ndarray
    roots: np.ndarray
    stats: dict = field(default_factory=dict)

    def roots_array(self, n_docs: int) -> np.ndarray:
        out = np.arange(n_docs, dtype=np.int64)
        out[self.nodes] = self.roots
        return out


def cluster_ray(shards: Sequence[tuple[int, object]], n_docs: int, bands: int, rows: int, work_dir: str | Path,
                partitions: int = 0, verify=None,
                log: Callable[[str], None] | None = None, max_rounds: int = 200) -> ClusterResult:
    """Cluster the signatures given as `shards`: (first doc index, signatures (n, num_perm)
    ndarray, .npy path, or a picklable callable returning one). Ray must be initialised (or is
    started locally). Spill files live under `work_dir/_lsh` and are removed at the end; when
    `work_dir` is in the working copy of a remote run_root and the cluster has other nodes, they
    are written to and read from the store directly, under the same key, and every task reads its
    inputs there too (`tasks.core.executor.task_location`, `for_any_node`). `verify`: a picklable batch verifier (`mask(pairs)`) or
    `verify(a, b) -> bool` callable, run in the per-partition Ray tasks."""
    import ray

    from tasks.core.executor import for_any_node, task_location
    from tasks.core.ray_utils import init_ray
    from tasks.dedup.verify import batch_verifier

    verifier = batch_verifier(verify)

    if bands > 256 or n_docs >= 1 << 32 or partitions >= 1 << 16:
        raise ValueError("spilled rows hold the band in a uint8, the document in a uint32; partitions < 65536")
    init_ray()
    partitions = max(2, partitions or default_partitions(n_docs, bands))  # ≥ 2: tuple returns stay lists
    spill, options = task_location(Path(work_dir) / "_lsh")
    drop_spill(spill, options)  # what a shuffle that died here left
    stats: dict = {"partitions": partitions, "docs": n_docs}
    t0 = time.perf_counter()
    # the signature files and a text verifier's part files, where tasks on any node read them
    (sources, verifier), _ = for_any_node(([src for _, src in shards], verifier))
    try:
        spill_task = ray.remote(num_cpus=1)(spill_shard)
        refs = [spill_task.remote(src if not isinstance(src, np.ndarray) else ray.put(src), off, bands, rows,
                                  partitions, str(spill), k, options)
                for k, ((off, _), src) in enumerate(zip(shards, sources))]
        stats["band_key_rows"] = int(sum(ray.get(refs)))
        t1 = time.perf_counter()
        stats["spill_s"] = round(t1 - t0, 3)
        final = ray.get(spilled_components(spill, partitions, verifier, stats, options, max_rounds, t1))
    finally:
        drop_spill(spill, options)
    e = np.concatenate(final) if final else np.empty((0, 2), np.int64)
    leaves, roots = e[:, 0], e[:, 1]
    centers = np.unique(roots)
    nodes = np.concatenate([leaves, centers])
    order = np.argsort(nodes, kind="stable")
    stats["clustered_docs"] = int(len(nodes))
    stats["duplicates"] = int(len(leaves))
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    if log:
        log(f"MinHash clustering on Ray: {stats}")
    return ClusterResult(nodes[order], np.concatenate([roots, centers])[order], stats)


def spilled_components(spill: Path | str, partitions: int, verifier, stats: dict, options: dict | None = None,
                       max_rounds: int = 200, started: float | None = None) -> list:
    """Steps 2-3 on spilled band keys (`spill/p-XXXXX/*.parquet`, a local folder or a store's prefix
    read with the fsspec `options`): candidate pairs per partition (verified there), then the
    large-star / small-star rounds. Returns the object refs of each partition's final (leaf, root)
    edges: the caller gets them, or hands them to a task, without the driver holding them. Fills
    `stats` (candidate / verified pairs, rounds, seconds)."""
    import ray

    t1 = time.perf_counter() if started is None else started
    part_dirs = [str(join(location(spill), f"p-{p:05d}")) for p in range(partitions)]
    if verifier is None:
        task = ray.remote(num_cpus=1, num_returns=partitions + 1)(_forest_task)
        outs = [task.remote(d, partitions, options) for d in part_dirs]
        # a pair sharing several bands is found in several partitions: counted once in each (the
        # distinct pairs are known only where they are routed, with verification)
        stats["candidate_pairs_in_partitions"] = int(sum(ray.get([o[0] for o in outs])))
        forest = [o[1:] for o in outs]
    else:  # pairs routed by their first document, each distinct pair verified once; the verifier shipped once
        route = ray.remote(num_cpus=1, num_returns=partitions + 1)(_routed_pairs_task)
        routed = [route.remote(d, partitions, options) for d in part_dirs]
        verifier_ref = ray.put(verifier)
        task = ray.remote(num_cpus=1, num_returns=partitions + 2)(_verified_forest_task)
        outs = [task.remote(partitions, verifier_ref, *[r[1 + p] for r in routed]) for p in range(partitions)]
        stats["candidate_pairs_in_partitions"] = int(sum(ray.get([r[0] for r in routed])))
        stats["candidate_pairs"] = int(sum(ray.get([o[0] for o in outs])))
        stats["verified_pairs"] = int(sum(ray.get([o[1] for o in outs])))
        forest = [o[2:] for o in outs]
    t2 = time.perf_counter()
    stats["pairs_s"] = round(t2 - t1, 3)
    drop_spill(spill, options)

    ls = ray.remote(num_cpus=1, num_returns=partitions + 2)(large_star)
    ss = ray.remote(num_cpus=1, num_returns=partitions)(small_star)
    inbox = [[f[p] for f in forest] for p in range(partitions)]  # edges for partition p
    rounds = 0
    while True:
        rounds += 1
        outs = [ls.remote(partitions, *inbox[p]) for p in range(partitions)]
        if all(ray.get([o[0] for o in outs])):
            final = [o[1] for o in outs]
            break
        if rounds > max_rounds:
            raise RuntimeError(f"connected components did not converge in {max_rounds} rounds")
        mid = [[o[2 + q] for o in outs] for q in range(partitions)]
        souts = [ss.remote(partitions, *mid[q]) for q in range(partitions)]
        souts = [s if partitions > 1 else [s] for s in souts]
        inbox = [[s[p] for s in souts] for p in range(partitions)]
    stats["cc_rounds"] = rounds
    stats["cc_s"] = round(time.perf_counter() - t2, 3)
    return final


def choose_survivors(roots: np.ndarray, scores: np.ndarray | None = None) -> np.ndarray:
    """Per document the survivor of its cluster (`roots[i]`: the cluster's smallest document).
    With `scores` the survivor is the member with the highest score (NaN = no score, lowest),
    ties to the smallest index; without, the smallest document itself."""
    roots = np.asarray(roots, dtype=np.int64)
    if scores is None:
        return roots
    s = np.asarray(scores, dtype=np.float64)
    s = np.where(np.isnan(s), -np.inf, s)
    idx = np.arange(len(roots))
    order = np.lexsort((idx, -s, roots))  # per cluster: best score first, then first seen
    first_of_cluster = np.r_[True, roots[order][1:] != roots[order][:-1]]
    best = np.empty(len(roots), dtype=np.int64)
    best_per_group = order[first_of_cluster]
    best[roots[best_per_group]] = best_per_group
    return best[roots]


REPRESENTATIVE_ROUNDS = 16  # a cluster still unresolved after this many is a chain of unrelated documents: kept
_CHECK_CHUNK = VERIFY_CHUNK_PAIRS  # pairs checked per verifier call (bounds the shingle hashes it holds)


def _pair_checker(verifier, on_ray: bool) -> Callable[[np.ndarray], np.ndarray]:
    """`check(pairs) -> mask` in chunks, in this process or (`on_ray`) in Ray tasks sharing one
    copy of the verifier (a text verifier then reads its texts there, never in the driver)."""
    def chunks(pairs: np.ndarray) -> list[np.ndarray]:
        return [pairs[lo:lo + _CHECK_CHUNK] for lo in range(0, len(pairs), _CHECK_CHUNK)]

    if not on_ray:
        return lambda pairs: np.concatenate([np.asarray(verifier.mask(c), bool) for c in chunks(pairs)])
    import ray

    from tasks.core.executor import for_any_node

    verifier, _ = for_any_node(verifier)  # texts in a store's working copy: read on the store by other nodes
    ref, task = ray.put(verifier), ray.remote(num_cpus=1)(_mask_task)
    return lambda pairs: np.concatenate(ray.get([task.remote(ref, c) for c in chunks(pairs)]))


def _mask_task(verifier, pairs: np.ndarray) -> np.ndarray:
    return np.asarray(verifier.mask(pairs), dtype=bool)


def representative_survivors(components: np.ndarray, scores: np.ndarray | None, verifier, on_ray: bool = False,
                             max_rounds: int = REPRESENTATIVE_ROUNDS) -> tuple[np.ndarray, dict]:
    """Per document the survivor it is dropped for (itself: kept), given `components[i]` (the
    smallest document of its connected component). Each round, in every component the best
    pending member (`choose_survivors`' order) is kept as representative and every other pending
    member is checked against it with `verifier.mask`; those that pass are its duplicates, those
    that fail are the next round's pending members. Returns (survivors, stats)."""
    components = np.asarray(components, dtype=np.int64)
    n = len(components)
    idx = np.arange(n, dtype=np.int64)
    rank = np.empty(n, dtype=np.int64)
    rank[np.lexsort((idx, -np.where(np.isnan(scores), -np.inf, scores))) if scores is not None else idx] = idx
    survivors = idx.copy()
    pending = np.flatnonzero(np.bincount(components, minlength=n)[components] > 1)
    stats = {"rounds": 0, "pairs_checked": 0, "failed_first_check": 0, "kept_unresolved": 0}
    check = _pair_checker(verifier, on_ray) if len(pending) else None
    while len(pending):
        pending = pending[np.lexsort((rank[pending], components[pending]))]
        first = np.r_[True, components[pending][1:] != components[pending][:-1]]
        reps = pending[first][np.cumsum(first) - 1]
        others, reps = pending[~first], reps[~first]
        if len(others) == 0:
            break
        if stats["rounds"] == max_rounds:
            stats["kept_unresolved"] = int(len(others))
            break
        ok = check(np.stack([np.minimum(others, reps), np.maximum(others, reps)], axis=1))
        survivors[others[ok]] = reps[ok]
        stats["rounds"] += 1
        stats["pairs_checked"] += int(len(others))
        if stats["rounds"] == 1:
            stats["failed_first_check"] = int((~ok).sum())
        pending = others[~ok]
    return survivors, stats


def clustering_method(mh, n_docs: int) -> str:
    """"local" or "ray" for `minhash.clustering` ("auto": ray from `ray_min_docs` documents)."""
    if mh.clustering != "auto":
        return mh.clustering
    return "ray" if n_docs >= mh.ray_min_docs else "local"


def cluster_signatures(sigs: Sequence[np.ndarray | None], bands: int, rows: int, *, method: str = "local",
                       work_dir: str | Path | None = None, partitions: int = 0, verify=None,
                       scores: Sequence[float | None] | None = None, shard_docs: int = 100_000,
                       representative_threshold: float | None = None,
                       log: Callable[[str], None] | None = None) -> tuple[list[int], dict]:
    """Survivor index per document (`result[i] == i`: kept), by the in-process path
    (`method="local"`) or on Ray (`"ray"`); a document without a signature is its own cluster.
    `verify`: a batch verifier (`tasks.dedup.verify.JaccardVerifier`, indexed like `sigs`; on
    Ray it runs in the per-partition tasks) or a picklable `verify(a, b) -> bool`; the stats then
    count `candidate_pairs` (distinct) and `verified_pairs` (for a plain callable on the in-process
    path, which checks pairs lazily, neither); on Ray `candidate_pairs_in_partitions` counts a pair
    once in each partition that finds it (without a verifier, the only count). With `representative_threshold` a document is dropped only
    if its Jaccard to its survivor reaches it (exact with a text verifier, else estimated;
    `representative_survivors`, stats `representative_check`); without, for its component.
    Logs the memory estimate first. Returns (survivors, stats)."""
    from tasks.dedup.minhash import minhash_clusters
    from tasks.dedup.verify import SignatureVerifier, batch_verifier, prefiltered

    log = log or (lambda msg: print(msg, file=sys.stderr))
    valid = np.array([i for i, s in enumerate(sigs) if s is not None], dtype=np.int64)
    n = len(sigs)
    num_perm = len(sigs[valid[0]]) if len(valid) else bands * rows
    itemsize = sigs[valid[0]].dtype.itemsize if len(valid) else 4
    est = memory_estimate(len(valid), num_perm, bands, itemsize, partitions or None, shard_docs)
    log(format_estimate(est, method))
    stats: dict = {"method": method, "memory_estimate": est}
    verifier = batch_verifier(verify)
    if method == "local" or len(valid) < 2:
        pair_verify = prefiltered(verify, sigs)  # a text verifier skips the pairs far below its threshold
        roots = np.asarray(minhash_clusters(list(sigs), bands, rows, verify=pair_verify, stats=stats), dtype=np.int64)
        if pair_verify is not verify:
            stats["prefiltered_pairs"] = pair_verify.rejected
    else:
        if work_dir is None:
            raise ValueError("the Ray clustering needs a work_dir for its spill files")
        shards = []
        for lo in range(0, len(valid), shard_docs):
            shards.append((lo, np.stack([sigs[i] for i in valid[lo:lo + shard_docs]])))
        sub_verify = verifier.reindexed(valid) if verifier is not None else None  # sub index → caller's
        # the prefilter's signatures go with the verifier (once into the object store; smaller than its texts)
        sub_verify = prefiltered(sub_verify, np.concatenate([s for _, s in shards]))
        res = cluster_ray(shards, len(valid), bands, rows, work_dir, partitions, sub_verify, log)
        stats.update(res.stats)
        sub_roots = res.roots_array(len(valid))
        roots = np.arange(n, dtype=np.int64)
        roots[valid] = valid[sub_roots]
    sc = None if scores is None else np.array([np.nan if x is None else float(x) for x in scores], dtype=np.float64)
    if representative_threshold is None:
        return choose_survivors(roots, sc).tolist(), stats
    if hasattr(verifier, "with_threshold"):  # exact Jaccard, in Ray tasks on the Ray path
        check, on_ray = verifier.with_threshold(representative_threshold), method == "ray"
    else:
        check, on_ray = SignatureVerifier(sigs, representative_threshold), False
    survivors, stats["representative_check"] = representative_survivors(roots, sc, check, on_ray)
    return survivors.tolist(), stats
