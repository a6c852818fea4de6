"""MinHash LSH near-duplicate removal (datasketch).

Shingles: the text is simplified (lower case, punctuation and symbols removed, diacritics
stripped, digit runs → "0", whitespace collapsed), split on spaces and cut into word n-grams
(`curate.dedup.minhash.ngram`, 5 by default); a document shorter than n words is one shingle.
A document with no words gets no signature and is never a duplicate.

Signatures: datasketch `MinHash(num_perm=bands*rows, seed=seed)` (its default "affine32"
scheme); the permutations are built once per `MinHasher` and reused. Signatures can be computed
anywhere (e.g. in the Ray workers of `run_curate`) and shipped as uint32 arrays.

Clustering: `MinHashLSH(num_perm=bands*rows, params=(bands, rows))`; every pair of documents
that share an LSH bucket is joined (union-find), so clusters are connected components. In each
cluster the document that comes first in corpus order is kept; the others are dropped with
reason "minhash_dedup" and `duplicate_of` = the kept one. With 14 bands × 8 rows the
probability that a pair with Jaccard similarity s becomes a candidate is 1-(1-s^8)^14:
≈ 0.5 at s ≈ 0.68, ≈ 0.92 at s = 0.8, ≈ 0.05 at s = 0.5.
"""
from __future__ import annotations

import unicodedata

import numpy as np
import regex

_NON_WORD = regex.compile(r"[\p{P}\p{S}\p{C}]+")
_DIGITS = regex.compile(r"\d+")


def simplify(text: str) -> str:
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn")
    text = _NON_WORD.sub(" ", text)
    text = _DIGITS.sub("0", text)
    return " ".join(text.split())


def shingles(text: str, n: int = 5) -> set[bytes]:
    toks = simplify(text).split()
    if not toks:
        return set()
    if len(toks) < n:
        return {" ".join(toks).encode("utf-8")}
    return {" ".join(toks[i:i + n]).encode("utf-8") for i in range(len(toks) - n + 1)}


class MinHasher:
    def __init__(self, bands: int = 14, rows: int = 8, seed: int = 1, ngram: int = 5):
        from datasketch import MinHash

        self.num_perm = bands * rows
        self.seed = seed
        self.ngram = ngram
        self._template = MinHash(num_perm=self.num_perm, seed=seed)
        self.scheme = self._template.scheme

    def signature(self, text: str) -> np.ndarray | None:
        from datasketch import MinHash

        sh = shingles(text, self.ngram)
        if not sh:
            return None
        m = MinHash(num_perm=self.num_perm, seed=self.seed, permutations=self._template.permutations,
                    scheme=self.scheme)
        m.update_batch(list(sh))
        return m.hashvalues.copy()


def minhash_clusters(signatures: list[np.ndarray | None], bands: int = 14, rows: int = 8,
                     seed: int = 1, scheme: str = "affine32") -> list[int]:
    """For each document (in corpus order) the index of its cluster's first document; a
    document with `result[i] == i` is kept."""
    from datasketch import LeanMinHash, MinHashLSH

    parent = list(range(len(signatures)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    lsh = MinHashLSH(num_perm=bands * rows, params=(bands, rows))
    for i, sig in enumerate(signatures):
        if sig is None:
            continue
        m = LeanMinHash(seed=seed, hashvalues=sig, scheme=scheme)
        for j in lsh.query(m):
            a, b = find(i), find(j)
            if a != b:
                parent[max(a, b)] = min(a, b)
        lsh.insert(i, m, check_duplication=False)
    return [find(i) for i in range(len(signatures))]


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a == b))
