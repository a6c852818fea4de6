"""Deduplication: exact (hash of normalised text) and near-duplicate (MinHash LSH).

Both keep the first document in corpus order; `run_curate` applies exact then MinHash after
the filters. See `tasks.dedup.exact` and `tasks.dedup.minhash`.
"""
from tasks.dedup.exact import ExactDeduper, exact_key
from tasks.dedup.minhash import MinHasher, minhash_clusters, shingles, simplify

__all__ = ["ExactDeduper", "exact_key", "MinHasher", "minhash_clusters", "shingles", "simplify"]
