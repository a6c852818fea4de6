"""Exact + MinHash dedup of an in-memory list of texts: the algorithm behind `crucible dedup`
(infra/cli/dedup.py) and benchmarks/dedup_quality.py.

1. exact: documents with the same normalised text (`exact_key`) join the first copy;
2. MinHash: signatures of the exact survivors (`MinHasher`, vectorised), LSH band keys, candidate
   pairs joined with a union-find (`cluster_signatures`, in process or on Ray; with
   `minhash.verify` a pair is joined only if its exact shingle Jaccard passes).
An exact copy follows its first copy into that one's MinHash cluster. The steps are those of
`run_curate` (`tasks.dedup.steps.DedupPass`).
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from tasks.config import DedupConfig, MinHashConfig
from tasks.core.steps import StepStats
from tasks.dedup.exact import exact_key
from tasks.dedup.minhash import MinHasher
from tasks.dedup.steps import DedupPass
from tasks.dedup.verify import JaccardVerifier, ListTexts


def dedup_texts(texts: list[str], cfg: DedupConfig, scores: list[float | None] | None = None,
                work_dir: str | Path | None = None, info: dict | None = None) -> tuple[list[int], list[StepStats]]:
    """Cluster roots (index of each document's survivor) and per-step stats. The survivor of an
    exact-duplicate group is its first document; of a MinHash cluster, the first document or
    (`minhash.survivor: quality`) the one with the highest score in `scores`. `info`, if given,
    receives the clustering stats, the signatures of the MinHash step and the step that dropped
    each removed document (all by document index)."""
    info = {} if info is None else info
    dropped_by = info.setdefault("dropped_by", {})  # document index → step name
    n = len(texts)
    dedup = DedupPass([len(t.encode("utf-8")) for t in texts], names=range(n))
    if cfg.exact:
        dedup.exact([exact_key(t) for t in texts])
    if cfg.minhash.enabled:
        _minhash_step(dedup, texts, cfg, scores, work_dir, info)
    survivor = list(range(n))  # the document each one was folded into
    for i, step, into in dedup.drops:
        survivor[i], dropped_by[i] = into, step
    # an exact copy follows its first copy into that one's MinHash cluster
    return [survivor[survivor[i]] for i in range(n)], dedup.steps


def minhasher(mh: MinHashConfig) -> MinHasher | None:
    """The hasher of a MinHash config (None when MinHash dedup is off): `dedup_texts`' and the
    curate workers' (`tasks.curate.run`)."""
    return MinHasher(mh.bands, mh.rows, mh.seed, mh.ngram, scheme=mh.scheme, hash=mh.hash) if mh.enabled else None


def _minhash_step(dedup: DedupPass, texts: list[str], cfg: DedupConfig, scores: list[float | None] | None,
                  work_dir: str | Path | None, info: dict) -> None:
    t0, mh, alive = time.perf_counter(), cfg.minhash, dedup.alive
    hasher = minhasher(mh)
    sigs = hasher.signatures([texts[i] for i in alive], max_shingles=mh.batch_shingles)
    # the texts go with the verifier (into the Ray object store once on the Ray path)
    verify = (JaccardVerifier(ListTexts([texts[i] for i in alive]), mh.verify_threshold, mh.ngram)
              if mh.verify else None)
    sub_scores = [scores[i] for i in alive] if scores is not None and mh.survivor == "quality" else None
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        info["clustering"] = dedup.minhash(sigs, mh, tmp, verify=verify, scores=sub_scores, started=t0)
    info["signatures"] = {alive[k]: s for k, s in enumerate(sigs)}
