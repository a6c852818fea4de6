"""MinHash clustering at scale: 1 M and 10 M documents' signatures on Ray, 2 CPUs, peak memory.

The signatures are synthetic (the figure is about clustering, not hashing): 112 values
(14 bands × 8 rows) per document from a counter-based hash, so any shard is generated where it
is needed — on the Ray worker that spills its band keys — and no process ever holds all of
them. A `--dup-fraction` of the documents (10 % by default) are near-duplicates of an earlier
document (within the previous 100 000): a copy of its original's signature with 0–20 % of the
values changed (estimated Jaccard 0.8–1.0), so clusters of several sizes form.

Measured: wall time per step (spill, pairs, connected components), and peak memory of the whole
process tree (this process, the Ray GCS/raylet and every Ray worker, sampled every 0.2 s from
/proc): summed RSS (counts shared pages, such as Ray's object store, once per process — an
upper bound) and summed PSS (shared pages split between the processes that map them).
The spill step includes generating the synthetic signatures in the spill tasks; that share is
estimated from one shard generated alone and reported apart.
Checks: the duplicates found against the generated ones, and with `--check N` the first N
documents clustered by the in-process path and by the Ray path give the same clusters.
Writes benchmarks/results/dedup_scale.json.

    python benchmarks/dedup_scale.py [--docs 1000000 10000000] [--check 100000]
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

import numpy as np

from _common import write_result
from tasks.dedup.minhash import fmix64

HERE = Path(__file__).resolve().parent
NUM_PERM, BANDS, ROWS = 112, 14, 8
WINDOW = 100_000


def _original(idx: np.ndarray, dup_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """For each doc: is it a near-duplicate, and the original (non-duplicate) doc it copies."""
    s = np.uint64(seed * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF)

    def is_dup(i):
        return ((fmix64(i ^ s) % np.uint64(1_000_000)) < np.uint64(int(dup_fraction * 1_000_000))) & (i > 0)

    dup = is_dup(idx)
    cur = idx.copy()
    todo = dup.copy()
    while todo.any():  # follow copies of copies back to an original
        i = cur[todo]
        back = fmix64(i ^ (s + np.uint64(1))) % np.minimum(i, np.uint64(WINDOW))
        cur[todo] = i - np.uint64(1) - back
        todo[todo] = is_dup(cur[todo])
    return dup, cur


def synthetic_signatures(start: int, count: int, dup_fraction: float = 0.1, seed: int = 0) -> np.ndarray:
    """Signatures of docs start..start+count-1: an original's values depend on its index only;
    which values of a duplicate change depends on the shard (start, count) too."""
    idx = np.arange(start, start + count, dtype=np.uint64)
    dup, orig = _original(idx, dup_fraction, seed)
    keys = orig[:, None] * np.uint64(NUM_PERM) + np.arange(NUM_PERM, dtype=np.uint64)[None, :]
    keys += np.uint64(seed << 40)
    out = fmix64(keys).astype(np.uint32)
    del keys
    # a duplicate has 0–20 % of its values replaced (fresh values from a per-shard generator)
    rng = np.random.default_rng([seed, start, count])
    change = np.where(dup, rng.random(count) * 0.2, 0.0)
    swap = rng.random((count, NUM_PERM), dtype=np.float32) < change[:, None].astype(np.float32)
    out[swap] = rng.integers(0, 2**32, int(swap.sum()), dtype=np.uint32)
    return out


def generated_duplicates(n: int, dup_fraction: float, seed: int = 0, chunk: int = 1_000_000) -> int:
    total = 0
    for lo in range(0, n, chunk):
        total += int(_original(np.arange(lo, min(n, lo + chunk), dtype=np.uint64), dup_fraction, seed)[0].sum())
    return total


class TreeMemory:
    """Peak summed RSS and PSS of this process and all its descendants, sampled from /proc."""

    def __init__(self, interval: float = 0.2):
        self.interval, self.peak_rss, self.peak_pss = interval, 0, 0
        self.max_procs = 0
        self.cpu_ticks: dict[int, int] = {}  # pid → last seen utime + stime
        self.cpu_start = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _tree(root: int) -> list[int]:
        children: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                children.setdefault(ppid, []).append(int(d))
        out, stack = [], [root]
        while stack:
            p = stack.pop()
            out.append(p)
            stack.extend(children.get(p, []))
        return out

    @staticmethod
    def _kb(path: str, field: str) -> int:
        try:
            with open(path) as f:
                for line in f:
                    if line.startswith(field):
                        return int(line.split()[1])
        except OSError:
            pass
        return 0

    @staticmethod
    def _ticks(pid: int) -> int | None:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, ValueError, IndexError):
            return None

    def cpu_seconds(self) -> float:
        """CPU time of the tree since __enter__ (processes seen by the sampler)."""
        return (sum(self.cpu_ticks.values()) - self.cpu_start) / os.sysconf("SC_CLK_TCK")

    def sample(self) -> tuple[int, int]:
        procs = self._tree(os.getpid())
        for p in procs:
            t = self._ticks(p)
            if t is not None:
                self.cpu_ticks[p] = t
        rss = sum(self._kb(f"/proc/{p}/status", "VmRSS:") for p in procs) * 1024
        pss = sum(self._kb(f"/proc/{p}/smaps_rollup", "Pss:") for p in procs) * 1024
        self.max_procs = max(self.max_procs, len(procs))
        return rss, pss

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, pss = self.sample()
            self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
            self._stop.wait(self.interval)

    def __enter__(self):
        self.peak_rss, self.peak_pss = self.sample()
        self.cpu_start = sum(self.cpu_ticks.values())
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._stop.clear()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sample()


def run_one(n: int, dup_fraction: float, shard_docs: int, work_dir: Path, partitions: int) -> dict:
    import ray

    from tasks.dedup.cluster import cluster_ray, format_estimate, memory_estimate

    est = memory_estimate(n, NUM_PERM, BANDS, 4, partitions or None, shard_docs)
    print(format_estimate(est), flush=True)
    shards = [(lo, partial(synthetic_signatures, lo, min(shard_docs, n - lo), dup_fraction))
              for lo in range(0, n, shard_docs)]
    t_gen = time.perf_counter()
    synthetic_signatures(0, min(shard_docs, n), dup_fraction)
    gen_shard_s = time.perf_counter() - t_gen  # generating is not clustering: reported apart
    t0 = time.perf_counter()
    with TreeMemory() as mem:
        res = cluster_ray(shards, n, BANDS, ROWS, work_dir, partitions=partitions)
    seconds = time.perf_counter() - t0
    true_dups = generated_duplicates(n, dup_fraction)
    gen_s = gen_shard_s * len(shards) / int(ray.cluster_resources().get("CPU", 1))
    row = {"docs": n, "seconds": round(seconds, 1), "docs_per_s": round(n / seconds),
           "cpu_seconds_tree": round(mem.cpu_seconds(), 1), "load_average_1m": round(os.getloadavg()[0], 2),
           "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "generate_signatures_s_estimate": round(gen_s, 1),
           "seconds_without_generation_estimate": round(seconds - gen_s, 1),
           "peak_rss_tree_mb": round(mem.peak_rss / 2**20), "peak_pss_tree_mb": round(mem.peak_pss / 2**20),
           "processes": mem.max_procs, "generated_duplicates": true_dups,
           "duplicates_found": res.stats["duplicates"],
           "clusters": int(len(np.unique(res.roots))), **{k: v for k, v in res.stats.items() if k != "docs"},
           "memory_estimate": est}
    print(json.dumps(row), flush=True)
    return row


def check_against_in_process(n: int, dup_fraction: float, work_dir: Path) -> dict:
    from tasks.dedup.cluster import cluster_ray
    from tasks.dedup.minhash import minhash_clusters

    sigs = synthetic_signatures(0, n, dup_fraction)
    local = np.asarray(minhash_clusters(list(sigs), BANDS, ROWS))
    res = cluster_ray([(lo, sigs[lo:lo + 25_000]) for lo in range(0, n, 25_000)], n, BANDS, ROWS, work_dir)
    same = bool(np.array_equal(local, res.roots_array(n)))
    return {"docs": n, "identical_clusters": same, "duplicates": int((local != np.arange(n)).sum())}


def main(argv=None) -> dict:
    import ray

    from tasks.core.ray_utils import start_local_ray

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--dup-fraction", type=float, default=0.1)
    p.add_argument("--shard-docs", type=int, default=100_000)
    p.add_argument("--partitions", type=int, default=0)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--object-store-mb", type=int, default=512)
    p.add_argument("--check", type=int, default=100_000, help="docs to compare with the in-process path (0: skip)")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--out", default=str(HERE / "results" / "dedup_scale.json"))
    p.add_argument("--merge", action="store_true",
                   help="keep the runs of other sizes already in --out (each run records its own load and time)")
    args = p.parse_args(argv)

    start_local_ray(args.cpus, include_dashboard=False, object_store_memory=args.object_store_mb * 2**20,
                    logging_level="WARNING")  # the pipeline's local Ray: loopback, token auth
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="dedup-scale-"))
    res: dict = {"cpus": args.cpus, "dup_fraction": args.dup_fraction, "num_perm": NUM_PERM,
                 "bands": BANDS, "rows": ROWS, "shard_docs": args.shard_docs, "runs": [],
                 "load_average_1m_start": round(os.getloadavg()[0], 2)}
    if args.merge and Path(args.out).is_file():
        old = json.loads(Path(args.out).read_text())
        res["runs"] = [r for r in old.get("runs", []) if r["docs"] not in args.docs]
        if "check" in old:
            res["check"] = old["check"]
    try:
        if args.check:
            res["check"] = check_against_in_process(args.check, args.dup_fraction, work)
            print(json.dumps(res["check"]), flush=True)
        for n in args.docs:
            res["runs"].append(run_one(n, args.dup_fraction, args.shard_docs, work, args.partitions))
            res["runs"].sort(key=lambda r: r["docs"])
            write_result(args.out, res)
    finally:
        ray.shutdown()
    res["load_average_1m_end"] = round(os.getloadavg()[0], 2)
    write_result(args.out, res)
    return res


if __name__ == "__main__":
    main()
