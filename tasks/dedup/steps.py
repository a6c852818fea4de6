"""The dedup steps of a corpus, shared by `run_curate` and `dedup_texts`: (curate) URL, exact,
MinHash, and (curate) the MinHash index of earlier runs.

`DedupPass` holds documents 0..n-1 in corpus order. Each step decides, for every document still
alive, what earlier document it duplicates (None: kept) and is accounted by the one step loop
(`tasks.core.steps.decide_all`), so its `StepStats` match the filters'. A dropped document is
recorded as (document, step, duplicate) in `drops`, in step then corpus order; a duplicate is
named by `names[j]` (document ids in curate, indices in `dedup_texts`).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Hashable, Sequence

from tasks.config import MinHashConfig
from tasks.core.steps import StepStats, decide_all
from tasks.dedup.cluster import cluster_signatures, clustering_method
from tasks.dedup.exact import ExactDeduper
from tasks.dedup.urls import url_duplicates


class DedupPass:
    """Documents going through the dedup steps: which are alive, which were dropped and why."""

    def __init__(self, nbytes: Sequence[int], names: Sequence[Hashable]):
        self.nbytes, self.names = nbytes, names
        self.alive = list(range(len(nbytes)))
        self.drops: list[tuple[int, str, Hashable]] = []  # (document, step, what it duplicates)
        self.steps: list[StepStats] = []

    def apply(self, step: str, duplicate_of: Sequence[Hashable | None], started: float) -> StepStats:
        """Drop every alive document whose `duplicate_of` entry (aligned with `alive`) is set."""
        def drop(pair: tuple[int, Hashable], reason: str) -> None:
            self.drops.append((pair[0], step, pair[1]))

        st, kept = decide_all(step, list(zip(self.alive, duplicate_of)), lambda p: None if p[1] is None else step,
                              size=lambda p: self.nbytes[p[0]], on_drop=drop, started=started)
        self.alive = [i for i, _ in kept]
        self.steps.append(st)
        return st

    def url(self, url_keys: Sequence[bytes | None], crawl_times: Sequence[float | None]) -> StepStats:
        """URL dedup by `url_keys` (per document, `urls.url_key`; None: no URL, kept): per URL
        the newest crawl, else the longest text, else the first is kept (`urls.url_duplicates`)."""
        t0, alive = time.perf_counter(), self.alive
        keep = url_duplicates([url_keys[i] for i in alive], [crawl_times[i] for i in alive],
                              [self.nbytes[i] for i in alive])
        return self.apply("url_dedup", [None if k is None else self.names[alive[k]] for k in keep], t0)

    def exact(self, keys: Sequence[bytes]) -> StepStats:
        """Exact dedup by `keys` (per document, `exact_key`): the first copy is kept."""
        t0, first = time.perf_counter(), ExactDeduper()
        return self.apply("exact_dedup", [first.check(self.names[i], keys[i]) for i in self.alive], t0)

    def minhash(self, sigs: Sequence, mh: MinHashConfig, work_dir: str | Path | None, verify=None,
                scores: Sequence[float | None] | None = None, started: float | None = None) -> dict:
        """MinHash LSH clustering of the alive documents (`sigs`, `scores` per alive document; `verify`
        indexed like them); the survivor of each cluster is kept. Returns the clustering stats.
        `started`: when the step began (default: now), if computing `sigs` is part of it."""
        t0 = time.perf_counter() if started is None else started
        roots, stats = cluster_signatures(  # prints the memory estimate first
            sigs, mh.bands, mh.rows, method=clustering_method(mh, len(sigs)), work_dir=work_dir,
            partitions=mh.partitions, verify=verify, scores=scores,
            representative_threshold=mh.representative_threshold)
        self.apply("minhash_dedup", [None if r == k else self.names[self.alive[r]] for k, r in enumerate(roots)], t0)
        return stats
