"""MinHash signature throughput: Crucible's two shingle-hash paths vs datasketch's `MinHash.bulk`.

Same real documents (linux-doc-rst.jsonl.gz by default), same shingles (FineWeb-simplified
word 5-grams), seed 1, 128 permutations, one process (docs/s per core). Compared, side by side:

  datasketch  `MinHash.bulk` with its default hash (sha1_hash32), its fastest path, given the
              precomputed shingle sets (building them is not timed);
  sha1        `MinHasher(hash="sha1").signatures_from_shingles`: the same shingle sets, the same
              hash values as datasketch (vectorised SHA-1);
  fast        `MinHasher(hash="fast").signatures_from_words`: the same shingles, from the simplified
              word lists they are made of, hashed with `fast_hash32` (every word hashed once in
              numpy, word hashes combined into 5-gram hashes in numpy).
  end_to_end  from raw text (simplify + shingle + hash + permute) for all three.

Each figure is the best of `--repeats` runs, interleaved (fair on a shared, noisy machine), as
wall time and as this process's CPU time (what a core spends; less sensitive to other load).
Checks: the sha1 path's signatures equal datasketch's default; the fast path's equal
datasketch's `MinHash(hashfunc=fast_hash32)`. Writes benchmarks/results/minhash.json.

    python benchmarks/minhash.py [--docs 600] [--input PATH] [--repeats 5]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import time
from pathlib import Path

import numpy as np

from _common import data_root, write_result
from tasks.dedup.minhash import MinHasher, fast_hash32, shingles, simplified_words

HERE = Path(__file__).resolve().parent


def best_of(fns: dict, repeats: int) -> dict:
    """name → (best wall s, best CPU s, last output); runs interleaved."""
    wall = {k: float("inf") for k in fns}
    cpu = {k: float("inf") for k in fns}
    outs: dict = {}
    for _ in range(repeats):
        for k, fn in fns.items():
            w0, c0 = time.perf_counter(), time.process_time()
            outs[k] = fn()
            wall[k] = min(wall[k], time.perf_counter() - w0)
            cpu[k] = min(cpu[k], time.process_time() - c0)
    return {k: (wall[k], cpu[k], outs[k]) for k in fns}


def _same(ds, ours) -> bool:
    ours = [s for s in ours if s is not None]
    return len(ds) == len(ours) and all(np.array_equal(m.hashvalues, s) for m, s in zip(ds, ours))


def main(argv=None) -> dict:
    from datasketch import MinHash

    data = data_root()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--input", default=str(data / "text" / "linux-doc-rst.jsonl.gz"))
    p.add_argument("--docs", type=int, default=600)
    p.add_argument("--num-perm", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(HERE / "results" / "minhash.json"))
    args = p.parse_args(argv)

    opener = gzip.open if args.input.endswith(".gz") else open
    with opener(args.input, "rt", encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for _, line in zip(range(args.docs), f)]
    docs = [d for d in docs if simplified_words(d)]  # datasketch's bulk needs ≥ 1 shingle per doc
    perm = args.num_perm

    # num_perm permutations as num_perm bands of one row
    fast = MinHasher(bands=perm, rows=1, seed=1, ngram=5, hash="fast")
    sha1 = MinHasher(bands=perm, rows=1, seed=1, ngram=5, hash="sha1")
    words = [simplified_words(d) for d in docs]
    sh = [list(shingles(d)) for d in docs]
    n_sh = sum(len(s) for s in sh)
    load_start = os.getloadavg()[0]

    sig = best_of({
        "datasketch": lambda: MinHash.bulk(sh, num_perm=perm, seed=1),
        "sha1": lambda: sha1.signatures_from_shingles(sh),
        "fast": lambda: fast.signatures_from_words(words),
    }, args.repeats)
    e2e = best_of({
        "datasketch": lambda: MinHash.bulk([list(shingles(d)) for d in docs], num_perm=perm, seed=1),
        "sha1": lambda: sha1.signatures(docs),
        "fast": lambda: fast.signatures(docs),
    }, max(1, args.repeats // 2))

    ds_fast = MinHash.bulk(sh, num_perm=perm, seed=1, hashfunc=fast_hash32)  # equality check only
    checks = {
        "sha1_equals_datasketch_default": _same(sig["datasketch"][2], sig["sha1"][2])
        and _same(sig["datasketch"][2], e2e["sha1"][2]),
        "fast_equals_datasketch_with_fast_hash32": _same(ds_fast, sig["fast"][2]) and _same(ds_fast, e2e["fast"][2]),
    }

    def table(res: dict) -> dict:
        out = {}
        ds_wall, ds_cpu = res["datasketch"][:2]
        for name, (w, c, _) in res.items():
            out[name] = {"docs_per_s_wall": round(len(docs) / w, 1), "docs_per_s_cpu": round(len(docs) / c, 1),
                         "speedup_wall": round(ds_wall / w, 2), "speedup_cpu": round(ds_cpu / c, 2)}
        return out

    res = {
        "input": args.input, "docs": len(docs), "shingles": n_sh, "num_perm": perm,
        "signature": table(sig), "end_to_end": table(e2e), **checks,
        "numpy": np.__version__,
        "load_average_1m": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
    }
    print(json.dumps(res, indent=2))
    write_result(args.out, res)
    return res


if __name__ == "__main__":
    main()
