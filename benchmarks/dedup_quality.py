"""Near-duplicate detection quality on a labelled set built from real text.

Base documents: linux-doc-rst.jsonl.gz docs and ~200-word Gutenberg passages (one file per
author, consecutive lines), each ≥ 120 words. Each base gets `--variants` edited copies whose
edit strength is drawn so their 5-gram Jaccard to the base spreads over ~0.3–0.98:
  delete   — remove k random words;
  insert   — insert k words taken from an unrelated document;
  reorder  — cut into ~40-word blocks and swap k block pairs;
  mixed    — a little of each.
The unrelated base documents are the negatives. The truth is measured, not assumed: the exact
5-gram Jaccard of every pair that shares at least one shingle (sparse intersection counts), so
real near-duplicates already in the corpus are labelled too.

Reported, for positives = pairs with true Jaccard ≥ `--threshold` (0.8):
  lsh_pairs       — a pair is predicted when the two share an LSH band key (14×8);
  verified_pairs  — ... and its exact shingle Jaccard ≥ threshold (minhash.verify);
  clusters        — a pair is predicted when `dedup_texts` puts both in one cluster
                    (connected components, so a chain can join a pair below threshold);
each with precision, recall, F1 and counts. Writes benchmarks/results/dedup_quality.json.

    python benchmarks/dedup_quality.py [--bases 300] [--variants 4] [--seed 0] [--hash fast|sha1]
"""
from __future__ import annotations

import argparse
import gzip
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from _common import add_int_options, data_root, write_result
from tasks.config import DedupConfig, MinHashConfig
from tasks.dedup.texts import dedup_texts
from tasks.dedup.minhash import MinHasher, band_keys, shingles

HERE = Path(__file__).resolve().parent


def base_documents(data: Path, n: int, rng: random.Random, min_words: int = 120) -> list[str]:
    with gzip.open(data / "text" / "linux-doc-rst.jsonl.gz", "rt", encoding="utf-8") as f:
        linux = [t for t in (json.loads(line)["text"] for line in f) if min_words <= len(t.split()) <= 3000]
    passages = []
    for path in sorted((data / "text" / "gutenberg").glob("*.txt")):
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
        cur: list[str] = []
        for ln in lines:
            cur.append(ln)
            if sum(len(x.split()) for x in cur) >= 200:
                passages.append("\n".join(cur))
                cur = []
    rng.shuffle(linux)
    rng.shuffle(passages)
    half = n // 2
    return linux[:half] + passages[: n - half]


def edit(text: str, kind: str, strength: float, donor: str, rng: random.Random) -> str:
    words = text.split()
    k = max(1, int(len(words) * strength))
    if kind in ("delete", "mixed"):
        kk = k if kind == "delete" else max(1, k // 3)
        drop = set(rng.sample(range(len(words)), min(kk, len(words) - 1)))
        words = [w for i, w in enumerate(words) if i not in drop]
    if kind in ("insert", "mixed"):
        kk = k if kind == "insert" else max(1, k // 3)
        dw = donor.split()
        for _ in range(kk):
            words.insert(rng.randrange(len(words) + 1), rng.choice(dw))
    if kind in ("reorder", "mixed"):
        blocks = [words[i:i + 40] for i in range(0, len(words), 40)]
        swaps = max(1, int(len(blocks) * strength * (4 if kind == "reorder" else 1)))
        for _ in range(swaps):
            if len(blocks) < 2:
                break
            a, b = rng.sample(range(len(blocks)), 2)
            blocks[a], blocks[b] = blocks[b], blocks[a]
        words = [w for blk in blocks for w in blk]
    return " ".join(words)


def build_set(data: Path, n_bases: int, n_variants: int, seed: int) -> tuple[list[str], list[int]]:
    rng = random.Random(seed)
    bases = base_documents(data, n_bases, rng)
    texts, group = [], []
    for g, base in enumerate(bases):
        texts.append(base)
        group.append(g)
        for _ in range(n_variants):
            kind = rng.choice(["delete", "insert", "reorder", "mixed"])
            strength = rng.choice([0.003, 0.006, 0.01, 0.015, 0.02, 0.03, 0.05, 0.08, 0.15])
            texts.append(edit(base, kind, strength, bases[(g + 1) % len(bases)], rng))
            group.append(g)
    order = list(range(len(texts)))
    rng.shuffle(order)  # corpus order must not give the base away
    return [texts[i] for i in order], [group[i] for i in order]


def true_jaccard_pairs(sets: list[set], min_j: float = 0.0) -> dict[tuple[int, int], float]:
    """Exact Jaccard of every pair sharing ≥ 1 shingle (sparse X·Xᵀ on shingle ids)."""
    from scipy import sparse

    vocab: dict[bytes, int] = {}
    rows, cols = [], []
    for i, s in enumerate(sets):
        for x in s:
            rows.append(i)
            cols.append(vocab.setdefault(x, len(vocab)))
    X = sparse.csr_matrix((np.ones(len(rows), np.int32), (rows, cols)), shape=(len(sets), len(vocab)))
    inter = sparse.triu(X @ X.T, k=1).tocoo()
    sizes = np.array([len(s) for s in sets])
    j = inter.data / (sizes[inter.row] + sizes[inter.col] - inter.data)
    keep = j >= min_j
    return {(int(a), int(b)): float(v) for a, b, v in zip(inter.row[keep], inter.col[keep], j[keep])}


def prf(pred: set, truth: set) -> dict:
    tp = len(pred & truth)
    p = tp / len(pred) if pred else 1.0
    r = tp / len(truth) if truth else 1.0
    return {"precision": round(p, 4), "recall": round(r, 4), "f1": round(2 * p * r / (p + r) if p + r else 0, 4),
            "predicted": len(pred), "true_positives": tp}


def main(argv=None) -> dict:
    data = data_root()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_int_options(ap, bases=300, variants=4)
    ap.add_argument("--threshold", type=float, default=0.8)
    add_int_options(ap, bands=14, rows=8, seed=0)
    ap.add_argument("--hash", choices=["fast", "sha1"], default="fast", help="shingle hash (minhash.hash)")
    ap.add_argument("--out", default=str(HERE / "results" / "dedup_quality.json"))
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    texts, groups = build_set(data, args.bases, args.variants, args.seed)
    sets = [shingles(t, 5) for t in texts]
    truth_j = true_jaccard_pairs(sets, min_j=0.3)
    truth = {p for p, j in truth_j.items() if j >= args.threshold}
    hist = np.histogram(list(truth_j.values()), bins=[0.3, 0.5, 0.7, 0.8, 0.9, 1.0001])[0].tolist()

    hasher = MinHasher(args.bands, args.rows, seed=1, ngram=5, hash=args.hash)
    t1 = time.perf_counter()
    sigs = hasher.signatures(texts)
    sig_s = time.perf_counter() - t1
    buckets: dict[bytes, list[int]] = defaultdict(list)
    for i, s in enumerate(sigs):
        if s is not None:
            for key in band_keys(s, args.bands, args.rows):
                buckets[key].append(i)
    lsh = {(a, b) for docs in buckets.values() for ai, a in enumerate(docs) for b in docs[ai + 1:]}

    def exact_j(p):
        if p in truth_j:
            return truth_j[p]
        a, b = sets[p[0]], sets[p[1]]
        return len(a & b) / len(a | b) if a or b else 1.0

    verified = {p for p in lsh if exact_j(p) >= args.threshold}

    def cluster_pairs(verify: bool) -> set:
        cfg = DedupConfig(exact=True, minhash=MinHashConfig(bands=args.bands, rows=args.rows, verify=verify,
                                                            verify_threshold=args.threshold, hash=args.hash))
        roots, _ = dedup_texts(texts, cfg)
        members: dict[int, list[int]] = defaultdict(list)
        for i, r in enumerate(roots):
            members[r].append(i)
        return {(a, b) for m in members.values() for ai, a in enumerate(m) for b in m[ai + 1:]}

    res = {
        "docs": len(texts), "bases": args.bases, "variants_per_base": args.variants,
        "threshold": args.threshold, "bands": args.bands, "rows": args.rows, "hash": args.hash,
        "positive_pairs": len(truth),
        "positive_pairs_outside_edit_groups": sum(1 for a, b in truth if groups[a] != groups[b]),
        "pairs_by_true_jaccard": dict(zip(["0.3-0.5", "0.5-0.7", "0.7-0.8", "0.8-0.9", "0.9-1.0"], hist)),
        "lsh_pairs": prf(lsh, truth),
        "verified_pairs": prf(verified, truth),
        "clusters_unverified": prf(cluster_pairs(False), truth),
        "clusters_verified": prf(cluster_pairs(True), truth),
        "signature_seconds": round(sig_s, 2),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    print(json.dumps(res, indent=2))
    write_result(args.out, res)
    return res


if __name__ == "__main__":
    main()
