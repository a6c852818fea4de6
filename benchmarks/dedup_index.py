"""Incremental MinHash index at continued-pretraining scale: memory and time of a run that dedups
new documents against an index of millions, memory-mapped (tasks/dedup/index.py) against holding
the same index in memory as the previous format did. Prints the figures and writes
benchmarks/results/dedup_index.json.

    .venv/bin/python benchmarks/dedup_index.py [--runs 10 --docs-per-run 1000000 --probe 100000]

The index is built the way continued pretraining grows it: `--runs` runs, each opening the index,
adding `--docs-per-run` new documents (random 112-value signatures: distinct documents) and saving.
Then a probe run opens the full index and adds `--probe` documents, half of them near-duplicates
of indexed documents (one band in common), half new. Memory is the process's resident set (VmRSS,
peak VmHWM reset before each phase); "in memory" reads the same arrays and ids whole (with the
ids as a Python list and an id -> number dict, as a format-2 index was loaded) and runs the same
probe: an approximation of the previous format, not its code.
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _common import write_result  # noqa: E402

BANDS, ROWS = 14, 8
RESULT = REPO / "benchmarks" / "results" / "dedup_index.json"


def rss_mb() -> tuple[float, float]:
    """(current, peak since the last reset) resident set size in MB."""
    f = _status()
    return f["VmRSS"], f["VmHWM"]


def anon_file_mb() -> tuple[float, float]:
    """Resident anonymous memory (the process's own) and resident file pages (memory-mapped files:
    page cache the kernel can drop and re-read), in MB."""
    f = _status()
    return f["RssAnon"], f["RssFile"]


def _status() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM", "RssAnon", "RssFile")):
            key, value = line.split(":")
            fields[key] = round(int(value.split()[0]) / 1024, 1)
    return fields


def reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:  # some sandboxes refuse it: peaks are then since process start
        pass


def load_in_memory(d: Path):
    """The index read whole into memory, as a format-2 index was loaded (arrays, the ids as a
    Python list and an id -> number dict): the comparison for the memory-mapped open."""
    import json

    import pyarrow as pa

    from tasks.dedup.index import MinHashIndex

    meta = json.loads((d / "meta.json").read_text())
    gen = d / f"gen-{meta['generation']:06d}"
    idx = MinHashIndex(meta["bands"], meta["rows"], meta["seed"], meta["scheme"], meta["hash"])
    idx._keys, idx._docs = np.load(gen / "keys.npy"), np.load(gen / "docs.npy")
    idx._id_hashes, idx._id_docs = np.load(gen / "id_hashes.npy"), np.load(gen / "id_docs.npy")
    with pa.OSFile(str(gen / "ids.arrow")) as f:
        idx._ids = pa.ipc.open_file(f).read_all().column("id")
    ids = idx._ids.to_pylist()
    return idx, {doc_id: k for k, doc_id in enumerate(ids)}


def signatures(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 1 << 32, size=(n, BANDS * ROWS), dtype=np.uint64).astype(np.uint32)


def probe_batch(rng: np.random.Generator, indexed: int, n: int, seed_of_run) -> tuple[list[str], list[np.ndarray]]:
    """n/2 near-duplicates of indexed documents (first band kept, the rest changed) + n/2 new ones."""
    half = n // 2
    picks = rng.choice(indexed, size=half, replace=False)
    dups = []
    for doc in picks:  # regenerate the indexed document's signature from its run's seed
        run, row = divmod(int(doc), seed_of_run["per_run"])
        dups.append((run, row))
    out = []
    for run in sorted({r for r, _ in dups}):
        sigs = signatures(np.random.default_rng(run), seed_of_run["per_run"])
        out += [sigs[row].copy() for r, row in dups if r == run]
    for s in out:
        s[ROWS:] ^= np.uint32(0x5A5A5A5A)
    ids = [f"probe-dup-{i}" for i in range(len(out))] + [f"probe-new-{i}" for i in range(n - len(out))]
    return ids, out + list(signatures(rng, n - len(out)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--docs-per-run", type=int, default=1_000_000)
    ap.add_argument("--probe", type=int, default=100_000)
    ap.add_argument("--work-dir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=RESULT)
    a = ap.parse_args()
    from tasks.dedup.index import MinHashIndex

    work = Path(tempfile.mkdtemp(prefix="dedup-index-", dir=a.work_dir))
    d = work / "index"
    runs = []
    for run in range(a.runs):
        reset_peak()
        t0 = time.perf_counter()
        idx = MinHashIndex.open(d, BANDS, ROWS, 1, "affine32", "fast")
        sigs = signatures(np.random.default_rng(run), a.docs_per_run)
        t1 = time.perf_counter()
        dups = sum(x is not None for x in idx.add([f"r{run}-{i}" for i in range(a.docs_per_run)], list(sigs)))
        t2 = time.perf_counter()
        del sigs
        idx.save(d)
        t3 = time.perf_counter()
        runs.append({"run": run + 1, "indexed_before": run * a.docs_per_run, "added": a.docs_per_run - dups,
                     "add_s": round(t2 - t1, 2), "save_s": round(t3 - t2, 2), "total_s": round(t3 - t0, 2),
                     "peak_rss_mb": rss_mb()[1], "anon_mb_after_save": anon_file_mb()[0]})
        print(f"run {run + 1:3d}: index {run * a.docs_per_run:>11,} docs + {a.docs_per_run:,}: add {t2 - t1:6.1f} s, "
              f"save {t3 - t2:5.1f} s, peak RSS {runs[-1]['peak_rss_mb']:,.0f} MB", flush=True)
        del idx
    disk = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    total = a.runs * a.docs_per_run

    rng = np.random.default_rng(12345)
    probe_ids, probe_sigs = probe_batch(rng, total, a.probe, {"per_run": a.docs_per_run})
    results = {}
    for mode in ("memory_mapped", "in_memory"):
        reset_peak()
        before = rss_mb()[0]
        anon0, file0 = anon_file_mb()
        t0 = time.perf_counter()
        idx, id_numbers = (MinHashIndex.load(d), None) if mode == "memory_mapped" else load_in_memory(d)
        t1 = time.perf_counter()
        open_rss = rss_mb()[0] - before
        got = idx.add(probe_ids, probe_sigs)
        t2 = time.perf_counter()
        anon1, file1 = anon_file_mb()
        hits = sum(g is not None for g in got[: a.probe // 2])
        false_hits = sum(g is not None for g in got[a.probe // 2:])
        results[mode] = {"open_s": round(t1 - t0, 2), "rss_after_open_mb": round(open_rss, 1),
                         "probe_s": round(t2 - t1, 2), "probe_docs_per_s": round(a.probe / (t2 - t1)),
                         "peak_rss_mb": round(rss_mb()[1] - before, 1),
                         "anon_mb_after_probe": round(anon1 - anon0, 1), "file_mb_after_probe": round(file1 - file0, 1),
                         "near_duplicates_found": hits, "new_flagged": false_hits}
        print(f"{mode:14s}: open {t1 - t0:5.1f} s (+{open_rss:,.0f} MB), probe {a.probe:,} docs {t2 - t1:5.1f} s, "
              f"then +{anon1 - anon0:,.0f} MB own memory, +{file1 - file0:,.0f} MB mapped file pages; "
              f"{hits}/{a.probe // 2} near-duplicates found", flush=True)
        del idx, id_numbers
    out = {
        "benchmark": "dedup_index",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "shape": {"bands": BANDS, "rows": ROWS, "runs": a.runs, "docs_per_run": a.docs_per_run,
                  "indexed_docs": total, "probe_docs": a.probe},
        "index_bytes_on_disk": disk,
        "bytes_per_doc_on_disk": round(disk / total, 1),
        "runs": runs,
        "probe": results,
        "note": "probe figures are deltas over the process before opening. Resident memory counts the pages of "
                "the memory-mapped arrays a lookup touched (file_mb: page cache the kernel can drop and re-read); "
                "anon_mb is the process's own memory. Sorted lookups of 1.4 M keys touch most pages of a 10 M-document "
                "index; runs' peak_rss_mb includes the benchmark's own random signatures (1 M x 112)",
    }
    write_result(a.out, out)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
