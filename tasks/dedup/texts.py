"""Exact + MinHash dedup of an in-memory list of texts: the algorithm behind `crucible dedup`
(infra/cli/dedup.py) and benchmarks/dedup_quality.py.

1. exact: documents with the same normalised text (`exact_key`) join the first copy;
2. MinHash: signatures of the exact survivors (`MinHasher`, vectorised), LSH band keys, candidate
   pairs joined with a union-find (`cluster_signatures`, in process or on Ray; with
   `minhash.verify` a pair is joined only if its exact shingle Jaccard passes).
An exact copy follows its first copy into that one's MinHash cluster.
"""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

from tasks.config import DedupConfig, MinHashConfig
from tasks.core.steps import StepStats
from tasks.dedup.cluster import cluster_signatures, clustering_method
from tasks.dedup.exact import exact_key
from tasks.dedup.minhash import MinHasher
from tasks.dedup.verify import JaccardVerifier, ListTexts


class _Folds:
    """Which document each document was folded into, with the step that folded it."""

    def __init__(self, texts: list[str], dropped_by: dict[int, str]):
        self.survivor = list(range(len(texts)))
        self.nbytes = [len(t.encode("utf-8")) for t in texts]
        self.dropped_by = dropped_by

    def account(self, st: StepStats, i: int, into: int) -> None:
        """Count document i in step `st`: kept if `into == i`, else dropped into document `into`."""
        st.docs_in += 1
        st.bytes_in += self.nbytes[i]
        if into == i:
            st.docs_out += 1
            st.bytes_out += self.nbytes[i]
        else:
            self.survivor[i] = into
            self.dropped_by[i] = st.name
            st.dropped[st.name] += 1


def dedup_texts(texts: list[str], cfg: DedupConfig, scores: list[float | None] | None = None,
                work_dir: str | Path | None = None, info: dict | None = None) -> tuple[list[int], list[StepStats]]:
    """Cluster roots (index of each document's survivor) and per-step stats. The survivor of an
    exact-duplicate group is its first document; of a MinHash cluster, the first document or
    (`minhash.survivor: quality`) the one with the highest score in `scores`. `info`, if given,
    receives the clustering stats, the signatures of the MinHash step and the step that dropped
    each removed document (all by document index)."""
    info = {} if info is None else info
    folds = _Folds(texts, info.setdefault("dropped_by", {}))  # document index → step name
    steps: list[StepStats] = []
    alive = list(range(len(texts)))
    if cfg.exact:
        steps.append(_exact_step(texts, alive, folds))
        alive = [i for i in alive if folds.survivor[i] == i]
    if cfg.minhash.enabled:
        steps.append(_minhash_step(texts, alive, cfg.minhash, scores, work_dir, info, folds))
    survivor = folds.survivor
    # an exact copy follows its first copy into that one's MinHash cluster
    return [survivor[survivor[i]] for i in range(len(texts))], steps


def _exact_step(texts: list[str], alive: list[int], folds: _Folds) -> StepStats:
    st, t0, first = StepStats("exact_dedup"), time.perf_counter(), {}
    for i in alive:
        folds.account(st, i, first.setdefault(exact_key(texts[i]), i))
    st.seconds = time.perf_counter() - t0
    return st


def _minhash_step(texts: list[str], alive: list[int], mh: MinHashConfig, scores: list[float | None] | None,
                  work_dir: str | Path | None, info: dict, folds: _Folds) -> StepStats:
    st, t0 = StepStats("minhash_dedup"), time.perf_counter()
    hasher = MinHasher(mh.bands, mh.rows, mh.seed, mh.ngram, scheme=mh.scheme, hash=mh.hash)
    sigs = hasher.signatures([texts[i] for i in alive], max_shingles=mh.batch_shingles)
    # the texts go with the verifier (into the Ray object store once on the Ray path)
    verify = (JaccardVerifier(ListTexts([texts[i] for i in alive]), mh.verify_threshold, mh.ngram)
              if mh.verify else None)
    sub_scores = [scores[i] for i in alive] if scores is not None and mh.survivor == "quality" else None
    with tempfile.TemporaryDirectory(dir=work_dir) as tmp:
        roots, cstats = cluster_signatures(sigs, mh.bands, mh.rows, method=clustering_method(mh, len(alive)),
                                           work_dir=tmp, partitions=mh.partitions,
                                           verify=verify, scores=sub_scores)
    info["clustering"] = cstats
    info["signatures"] = {alive[k]: s for k, s in enumerate(sigs)}
    for k, r in enumerate(roots):
        folds.account(st, alive[k], alive[r])
    st.seconds = time.perf_counter() - t0
    return st
