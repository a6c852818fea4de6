"""Deduplication: exact (hash of normalised text) and near-duplicate (MinHash LSH).

Both keep the first document in corpus order; `run_curate` applies exact then MinHash after
the filters, and `crucible dedup` (`tasks.dedup.cli`) runs both on a JSONL file. MinHash
signatures are numpy-vectorised and equal to datasketch's (`tasks.dedup.minhash`).
"""
from tasks.dedup.exact import ExactDeduper, exact_key
from tasks.dedup.minhash import (MinHasher, UnionFind, band_keys, candidate_pairs, minhash_clusters, shingles,
                                 simplify)

__all__ = ["ExactDeduper", "exact_key", "MinHasher", "UnionFind", "band_keys", "candidate_pairs",
           "minhash_clusters", "shingles", "simplify"]
