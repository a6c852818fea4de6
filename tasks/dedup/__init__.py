"""Deduplication: exact (hash of normalised text) and near-duplicate (MinHash LSH).

Exact copies keep the first document in corpus order; MinHash clusters keep the first document
or the highest quality score. `run_curate` applies exact then MinHash after the filters, and
`crucible dedup` (`infra.cli.dedup`) runs both on a JSONL file. MinHash signatures are
numpy-vectorised and equal to datasketch's given the same shingle hash (`tasks.dedup.minhash`:
the fast default `fast_hash32` or datasketch's `sha1_hash32`); clustering runs in process or on
Ray with bounded memory (`tasks.dedup.cluster`), optionally joining only candidate pairs whose exact
shingle Jaccard passes (`tasks.dedup.verify`), and dropping a member only if it is close enough
to its cluster's kept document (`minhash.representative_threshold`: no chaining);
`tasks.dedup.report` summarises the duplicates.
"""
from tasks.dedup.cluster import cluster_signatures
from tasks.dedup.exact import ExactDeduper, exact_key
from tasks.dedup.minhash import (MinHasher, UnionFind, band_keys, candidate_pairs, fast_hash32, minhash_clusters,
                                 shingles, simplify)
from tasks.dedup.report import dedup_report
from tasks.dedup.verify import JaccardVerifier, ListTexts, ParquetTexts

__all__ = ["ExactDeduper", "exact_key", "MinHasher", "UnionFind", "band_keys", "candidate_pairs",
           "cluster_signatures", "dedup_report", "fast_hash32", "minhash_clusters", "shingles", "simplify",
           "JaccardVerifier", "ListTexts", "ParquetTexts"]
