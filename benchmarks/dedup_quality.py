"""Near-duplicate quality of what `crucible dedup` writes, scored against an independent truth.

Corpora:
  synthetic — base documents (linux-doc-rst.jsonl.gz docs and ~200-word Gutenberg passages, each
              ≥ 120 words), each with `--variants` edited copies whose 5-gram Jaccard to the base
              spreads over ~0.3–0.98 (delete k words / insert k words from an unrelated document /
              swap ~40-word blocks / a little of each), shuffled; the unrelated bases are negatives;
  real      — web/cc-main-2019-30-sample.jsonl.gz and text/linux-doc-rst.jsonl.gz as they are
              (their own near duplicates: kernel docs sharing most of their text, repeated pages),
              less the documents without a word.
Each corpus is written as JSONL and deduplicated by the `crucible dedup` command itself
(`infra.cli.dedup.main`: exact, then MinHash LSH with the shipped banding, 28×4 (`--bands`,
`--rows`), the pipeline's clustering and its representative check at the default
`minhash.representative_threshold`), with `minhash.verify` on (the default, at `--threshold`:
the shipped `verify_threshold`, 0.7) and off. Scored
from its output file only: clusters (the `cluster` column) and dropped documents (`keep: false`).

Truth, computed independently of the pipeline: the benchmark's own word 5-gram shingling
(`truth_shingles`: lower case, diacritics and punctuation/symbols removed, digit runs → 0) and
the exact Jaccard of ALL pairs (a sparse shingle-incidence product gives every pair sharing a
shingle; the others have Jaccard 0).

Reported per corpus and mode:
  pairs            — precision / recall / F1 of the pairs implied by the output clusters (two
                     documents in one cluster) against the pairs with true Jaccard ≥ `--threshold`;
  drops_justified  — share of dropped documents that have a KEPT document with true Jaccard
                     ≥ 0.5 (target ≥ 0.99); also the share whose own survivor is that close;
targets: recall ≥ 0.95 and drops justified ≥ 0.99 in both modes on both corpora (recall only
where the corpus has positive pairs); `within_target` checks all of them. For reference, both
modes are also scored without the representative check (`*_components_only`: plain connected
components, no target). No metric compares the pipeline's verifier with itself. Writes benchmarks/results/dedup_quality.json.

    python benchmarks/dedup_quality.py [--bases 300] [--variants 4] [--seed 0] [--bands 28 --rows 4] [--threshold 0.7]
        [--hash fast|sha1] [--no-real]
"""
from __future__ import annotations

import argparse
import contextlib
import gzip
import io
import json
import random
import re
import tempfile
import time
import unicodedata
from collections import defaultdict
from pathlib import Path

import numpy as np

from _common import add_int_options, data_root, write_result
from tasks.config import MinHashConfig

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


TARGETS = {"recall": 0.95, "drops_justified": 0.99}
JUSTIFY_JACCARD = 0.5  # a drop is justified by a kept document at least this similar


def real_corpus(data: Path) -> list[str]:
    """The two files' documents that have a word (the CC sample holds empty texts: no shingles,
    no Jaccard; curate's filters drop them before dedup)."""
    texts = []
    for name in ("web/cc-main-2019-30-sample.jsonl.gz", "text/linux-doc-rst.jsonl.gz"):
        with gzip.open(data / name, "rt", encoding="utf-8") as f:
            texts += [t for t in (json.loads(line)["text"] for line in f) if truth_shingles(t)]
    return texts


_NON_WORD = re.compile(r"[\W_]+")
_DIGITS = re.compile(r"\d+")


def truth_shingles(text: str, n: int = 5) -> set[str]:
    """Word n-grams of the text lower-cased, diacritics stripped, punctuation and symbols made
    spaces, digit runs made 0 (written here, not taken from the pipeline); fewer than n words:
    one shingle."""
    text = "".join(ch for ch in unicodedata.normalize("NFD", text.lower()) if not unicodedata.combining(ch))
    words = _DIGITS.sub("0", _NON_WORD.sub(" ", text)).split()
    if len(words) < n:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i:i + n]) for i in range(len(words) - n + 1)}


def all_pairs_jaccard(sets: list[set], min_j: float) -> dict[tuple[int, int], float]:
    """Exact Jaccard ≥ `min_j` of all pairs: the pairs sharing ≥ 1 shingle come from a sparse
    X·Xᵀ on shingle ids (the rest share none: Jaccard 0)."""
    from scipy import sparse

    vocab: dict[str, int] = {}
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


# (name, minhash settings): the pipeline's two modes (targets apply), then the same without the
# representative check (plain connected components, for reference: what chaining costs)
MODES = [("unverified", {"verify": False}), ("verified", {"verify": True}),
         ("unverified_components_only", {"verify": False, "representative_threshold": 0.0}),
         ("verified_components_only", {"verify": True, "representative_threshold": 0.0})]


def run_crucible_dedup(texts: list[str], work: Path, mode: str, settings: dict, args) -> tuple[list[dict], dict]:
    """`crucible dedup` on the texts (ids d0, d1, ...): its output rows and printed summary."""
    from infra.cli.dedup import main as crucible_dedup

    src, out, cfg = work / "docs.jsonl", work / f"dedup-{mode}.jsonl", work / f"dedup-{mode}.yaml"
    with open(src, "w", encoding="utf-8") as f:
        for k, t in enumerate(texts):
            f.write(json.dumps({"id": f"d{k}", "text": t}) + "\n")
    cfg.write_text(json.dumps({"minhash": {"bands": args.bands, "rows": args.rows, "hash": args.hash,
                                           "verify_threshold": args.threshold, **settings}}))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        crucible_dedup([str(src), "--out", str(out), "--config", str(cfg)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    if [r["id"] for r in rows] != [f"d{k}" for k in range(len(texts))]:
        raise RuntimeError("crucible dedup did not write one row per document in input order")
    return rows, json.loads(printed.getvalue())


def prf(pred: set, truth: set) -> dict:
    tp = len(pred & truth)
    p = tp / len(pred) if pred else None
    r = tp / len(truth) if truth else None
    return {"precision": None if p is None else round(p, 4), "recall": None if r is None else round(r, 4),
            "f1": round(2 * p * r / (p + r), 4) if p and r else None,
            "predicted": len(pred), "positives": len(truth), "true_positives": tp}


def score(rows: list[dict], truth_j: dict[tuple[int, int], float], threshold: float) -> dict:
    """Pair precision/recall of the output clusters, and how well each drop is justified."""
    index = {r["id"]: k for k, r in enumerate(rows)}
    members: dict[str, list[int]] = defaultdict(list)
    for k, r in enumerate(rows):
        members[r["cluster"]].append(k)
    pred = {(a, b) for m in members.values() for ai, a in enumerate(m) for b in m[ai + 1:]}
    truth = {p for p, j in truth_j.items() if j >= threshold}
    kept = np.array([bool(r["keep"]) for r in rows])
    best_kept = np.zeros(len(rows))  # per document: the highest Jaccard to a kept other document
    for (a, b), j in truth_j.items():
        if kept[b]:
            best_kept[a] = max(best_kept[a], j)
        if kept[a]:
            best_kept[b] = max(best_kept[b], j)
    dropped = np.flatnonzero(~kept)

    def to_survivor(k: int) -> float:
        s = index[rows[k]["cluster"]]
        return truth_j.get((min(k, s), max(k, s)), 0.0)

    survivor_j = np.array([to_survivor(k) for k in dropped])
    unjustified = [int(k) for k in dropped if best_kept[k] < JUSTIFY_JACCARD]
    return {
        "pairs": prf(pred, truth),
        "dropped": int(len(dropped)),
        "drops_justified": round(1 - len(unjustified) / len(dropped), 4) if len(dropped) else None,
        "drops_within_0.5_of_own_survivor": round(float((survivor_j >= JUSTIFY_JACCARD).mean()), 4)
        if len(dropped) else None,
        f"drops_within_{threshold}_of_own_survivor": round(float((survivor_j >= threshold).mean()), 4)
        if len(dropped) else None,
        "unjustified_examples": [{"id": rows[k]["id"], "cluster": rows[k]["cluster"],
                                  "best_kept_jaccard": round(float(best_kept[k]), 3)} for k in unjustified[:5]],
    }


def evaluate(name: str, texts: list[str], args, work: Path) -> dict:
    """Truth for one corpus, then `crucible dedup` in each of `MODES`, scored."""
    t0 = time.perf_counter()
    truth_j = all_pairs_jaccard([truth_shingles(t) for t in texts], min_j=0.3)
    hist = np.histogram(list(truth_j.values()), bins=[0.3, 0.5, 0.7, 0.8, 0.9, 1.0001])[0].tolist()
    out = {"docs": len(texts), "truth_seconds": round(time.perf_counter() - t0, 2),
           "pairs_by_true_jaccard": dict(zip(["0.3-0.5", "0.5-0.7", "0.7-0.8", "0.8-0.9", "0.9-1.0"], hist))}
    for mode, settings in MODES:
        t1 = time.perf_counter()
        rows, summary = run_crucible_dedup(texts, work, mode, settings, args)
        res = score(rows, truth_j, args.threshold)
        res["crucible_dedup_seconds"] = round(time.perf_counter() - t1, 2)
        res["docs_out"] = summary["docs_out"]
        out[mode] = res
        print(f"{name} {mode}: {json.dumps({k: res[k] for k in ('pairs', 'dropped', 'drops_justified')})}")
    return out


def targets_met(results: dict) -> dict:
    """Every target in every scored run (recall only where the corpus has positive pairs)."""
    met = {}
    for corpus in ("synthetic", "real"):
        for mode in ("unverified", "verified"):
            r = results.get(corpus, {}).get(mode)
            if r is None:
                continue
            if r["pairs"]["recall"] is not None:
                met[f"{corpus}.{mode}.recall"] = r["pairs"]["recall"] >= TARGETS["recall"]
            if r["drops_justified"] is not None:
                met[f"{corpus}.{mode}.drops_justified"] = r["drops_justified"] >= TARGETS["drops_justified"]
    return met


def main(argv=None) -> dict:
    data = data_root()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_int_options(ap, bases=300, variants=4)
    shipped = MinHashConfig()  # measure what a user gets: the default banding and verify threshold
    ap.add_argument("--threshold", type=float, default=shipped.verify_threshold,
                    help="minhash.verify_threshold and the truth's Jaccard for a duplicate pair")
    add_int_options(ap, bands=shipped.bands, rows=shipped.rows, seed=0)
    ap.add_argument("--hash", choices=["fast", "sha1"], default="fast", help="shingle hash (minhash.hash)")
    ap.add_argument("--no-real", action="store_true", help="skip the real corpus")
    ap.add_argument("--out", default=str(HERE / "results" / "dedup_quality.json"))
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    texts, _ = build_set(data, args.bases, args.variants, args.seed)
    res: dict = {"threshold": args.threshold, "justify_jaccard": JUSTIFY_JACCARD, "bands": args.bands,
                 "rows": args.rows, "hash": args.hash,
                 "representative_threshold": shipped.representative_threshold, "targets": TARGETS}
    with tempfile.TemporaryDirectory() as tmp:
        res["synthetic"] = {"bases": args.bases, "variants_per_base": args.variants,
                            **evaluate("synthetic", texts, args, Path(tmp))}
        if not args.no_real:
            res["real"] = evaluate("real", real_corpus(data), args, Path(tmp))
    res["targets_met"] = targets_met(res)
    res["within_target"] = bool(res["targets_met"]) and all(res["targets_met"].values())
    res["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(res, indent=2))
    write_result(args.out, res)
    return res


if __name__ == "__main__":
    main()
