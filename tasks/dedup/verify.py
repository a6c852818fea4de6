"""Exact Jaccard verification of MinHash candidate pairs (`curate.dedup.minhash.verify`).

LSH makes a pair a candidate when one band of its signatures matches, which happens to pairs
well below the threshold too (≈ 5 % at Jaccard 0.5 with 14 × 8, ≈ 84 % with the default 28 × 4,
whose point is to miss almost none at 0.7). With verification (on by default) a candidate pair is
joined only if the exact Jaccard of the two documents' shingle sets (`shingles`, the same
simplified word n-grams the signatures hash; compared as sorted 64-bit hashes, `shingle_sets`)
is ≥ `verify_threshold`.

`JaccardVerifier.mask(pairs)` checks a whole (k, 2) array of document indices at once and
reads the texts it needs itself, so it is a small picklable object that runs where the pairs
are: in each per-partition Ray task of `tasks.dedup.cluster.cluster_ray`, not in the driver.
The texts come from a `TextSource`:

- `ListTexts`: texts held in memory (the `crucible dedup` CLI), as one Arrow string array —
  `cluster_ray` puts the verifier into the Ray object store once for all tasks;
- `ParquetTexts`: the `text` column of Parquet part files (the curate stage, whose driver holds
  no texts): document k is row k of the files laid end to end, and a task reads only the row
  groups holding the rows it needs, one file at a time. With an object-store run_root a task on
  another node reads the files' objects on the store directly (`stage_paths`).

`SignaturePrefilter` puts a text verifier behind its signature estimate: a candidate pair whose
signatures agree far below the threshold is rejected without reading texts (a pair at or above it is,
with probability < 1e-6), the rest checked exactly (`cluster.cluster_signatures` uses it).

`SignatureVerifier` checks pairs by their signatures alone (estimated Jaccard); the clustering
uses it, when there is no text verifier, to check each member against its cluster's kept
representative (`JaccardVerifier.with_threshold` when there is one).

Memory: shingling holds ~25x its texts' size (Python word lists), so a call reads and shingles
the documents it needs in sub-batches of about `batch_chars` characters of text (`SHINGLE_CHARS`,
4 M: ~100 MB at peak whatever the call's size); what it keeps for the call is the documents'
shingle hashes (~1.3x their text). Callers bound that with the pairs per call (`cluster._CHECK_CHUNK`,
`minhash.minhash_clusters`).

`index` maps the verifier's document numbers onto the source's rows (the clustering works on
the documents that survived exact dedup and have a signature); `reindexed(sub)` composes one
more such mapping.
"""
from __future__ import annotations

import copy
from contextlib import nullcontext
from typing import Callable, Sequence

import numpy as np

from tasks.core.fs import is_remote, open_random
from tasks.dedup.minhash import shingle_hashes, simplified_words


class ListTexts:
    """Texts in memory; document k is `texts[k]`."""

    def __init__(self, texts: Sequence[str]):
        import pyarrow as pa

        self.texts = pa.array(list(texts), type=pa.large_string())

    def __len__(self) -> int:
        return len(self.texts)

    def read(self, rows: np.ndarray) -> list[str]:
        return self.texts.take(np.asarray(rows, dtype=np.int64)).to_pylist()


class ParquetTexts:
    """The `text` column of Parquet files laid end to end; `counts[f]` rows in `files[f]`."""

    def __init__(self, files: Sequence[str], counts: Sequence[int], column: str = "text"):
        if len(files) != len(counts):
            raise ValueError("one row count per file")
        self.files = [str(f) for f in files]
        self.starts = np.concatenate([[0], np.cumsum(np.asarray(counts, dtype=np.int64))])
        self.column = column
        self.storage_options: dict | None = None  # fsspec's, for files given as a store's URIs

    def __len__(self) -> int:
        return int(self.starts[-1])

    def stage_paths(self, fn: Callable, storage_options: dict | None = None) -> "ParquetTexts":
        """A copy reading `fn(files)` (`tasks.core.storage.map_paths`; with `storage_options`, the
        files' objects on a store, read there directly by a Ray task on another node)."""
        out = copy.copy(self)
        out.files = [str(f) for f in fn(self.files)]
        if storage_options is not None:
            out.storage_options = storage_options
        return out

    def read(self, rows: np.ndarray) -> list[str]:
        import pyarrow.parquet as pq

        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= len(self)):
            raise IndexError(f"row out of range: the files hold {len(self)} rows")
        out: list[str | None] = [None] * len(rows)
        file_of = np.searchsorted(self.starts, rows, side="right") - 1
        for f in np.unique(file_of):
            sel = np.flatnonzero(file_of == f)
            local = rows[sel] - self.starts[f]
            remote = is_remote(self.files[f])  # a store's object: ranged reads
            with open_random(self.files[f], self.storage_options) if remote else nullcontext(self.files[f]) as src:
                pf = pq.ParquetFile(src)
                try:
                    meta = pf.metadata
                    if meta.num_rows != self.starts[f + 1] - self.starts[f]:
                        raise ValueError(f"{self.files[f]}: {meta.num_rows} rows, expected "
                                         f"{self.starts[f + 1] - self.starts[f]}")
                    rg_starts = np.cumsum([0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)])
                    rg_of = np.searchsorted(rg_starts, local, side="right") - 1
                    groups = np.unique(rg_of)
                    col = pf.read_row_groups(groups.tolist(), columns=[self.column]).column(0)
                finally:
                    pf.close()
            # row r of row group g sits at (rows of the groups read before g) + (r − start of g)
            before = np.cumsum([0] + [rg_starts[g + 1] - rg_starts[g] for g in groups[:-1]])
            pos = before[np.searchsorted(groups, rg_of)] + local - rg_starts[rg_of]
            for k, text in zip(sel, col.take(pos).to_pylist()):
                out[k] = text
        return out


TextSource = ListTexts | ParquetTexts


CACHE_BYTES = 64 << 20  # shingle hashes a verifier keeps between its calls (per process)
SHINGLE_CHARS = 4 << 20  # characters of text read and shingled at once (peak: ~25x that)
_ENTRY_BYTES = 200  # a cached array's own overhead (ndarray object, dict entry, int key): short texts add up
_GUESS_DOC_CHARS = 4096  # a document's size before any is read (sizes the first read only)


class _ShingleCache:
    """Shingle-hash arrays by source row, kept between calls until `budget` bytes are held (the
    arrays and `_ENTRY_BYTES` each; then none is added): a Ray partition's chunks share documents,
    and on the in-process path the representative check re-checks the clustering's documents in the
    same process. Shared by a verifier's copies (`reindexed`, `with_threshold`: the same rows);
    pickled empty, so a Ray task starts with none: on Ray the representative check's tasks read
    and shingle their documents again (the clustering's hashes stayed in the partition tasks)."""

    def __init__(self, budget: int | None = None):
        self.budget, self.held, self.sets = CACHE_BYTES if budget is None else budget, 0, {}

    def __getstate__(self) -> dict:
        return {"budget": self.budget, "held": 0, "sets": {}}

    def add(self, row: int, hashes: np.ndarray) -> None:
        size = hashes.nbytes + _ENTRY_BYTES
        if self.held + size <= self.budget:
            self.sets[row] = hashes
            self.held += size


class JaccardVerifier:
    """Accepts a candidate pair when the exact Jaccard of its documents' word `ngram` shingle
    sets is ≥ `threshold`. Document k is row `index[k]` of `texts` (row k without `index`)."""

    def __init__(self, texts: TextSource, threshold: float, ngram: int = 5, index: np.ndarray | None = None,
                 batch_chars: int | None = None):
        self.texts = texts
        self.threshold = float(threshold)
        self.ngram = int(ngram)
        self.index = None if index is None else np.asarray(index, dtype=np.int64)
        self.batch_chars = SHINGLE_CHARS if batch_chars is None else int(batch_chars)
        self.cache = _ShingleCache()

    def reindexed(self, sub: Sequence[int] | np.ndarray) -> "JaccardVerifier":
        """The verifier whose document k is this one's document `sub[k]`."""
        return _reindexed(self, sub)

    def stage_paths(self, fn: Callable, storage_options: dict | None = None) -> "JaccardVerifier":
        """A copy whose texts are read from `fn`'s paths (`ParquetTexts.stage_paths`)."""
        if not hasattr(self.texts, "stage_paths"):
            return self
        out = copy.copy(self)
        out.texts = self.texts.stage_paths(fn, storage_options)
        return out

    def similarities(self, pairs: np.ndarray) -> np.ndarray:
        """Exact shingle Jaccard of each pair (k, 2); each document's text read and shingled once."""
        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        if len(pairs) == 0:
            return np.empty(0, np.float64)
        docs, inv = np.unique(pairs, return_inverse=True)
        rows = (docs if self.index is None else self.index[docs]).tolist()
        cached = self.cache.sets
        read = self._read_sets([r for r in rows if r not in cached])
        sets = [read[r] if r in read else cached[r] for r in rows]
        for r, h in read.items():
            self.cache.add(r, h)
        return np.array([set_jaccard(sets[a], sets[b]) for a, b in inv.reshape(-1, 2)], dtype=np.float64)

    def _read_sets(self, rows: list[int]) -> dict[int, np.ndarray]:
        """The shingle hashes of source `rows`, read and shingled about `batch_chars` characters of
        text at a time (a read's row count follows the sizes read so far; a longer document alone)."""
        rows, out, start = sorted(rows), {}, 0  # in row order: a Parquet row group is read once
        take = max(1, self.batch_chars // _GUESS_DOC_CHARS)
        while start < len(rows):
            part = rows[start:start + take]
            texts = self.texts.read(np.array(part, np.int64))
            sizes = np.array([len(t) for t in texts], np.int64)
            for lo, hi in _slices_within(sizes, self.batch_chars):
                out.update(zip(part[lo:hi], shingle_sets(texts[lo:hi], self.ngram)))
            start += len(part)
            take = max(1, int(self.batch_chars * len(part) // max(1, int(sizes.sum()))))
        return out

    def with_threshold(self, threshold: float) -> "JaccardVerifier":
        """The same verifier accepting pairs from `threshold` on."""
        out = copy.copy(self)
        out.threshold = float(threshold)
        return out

    def mask(self, pairs: np.ndarray) -> np.ndarray:
        """Boolean mask over the (k, 2) `pairs`: True where the pair is a verified duplicate."""
        return self.similarities(pairs) >= self.threshold

    def __call__(self, j: int, i: int) -> bool:
        return bool(self.mask(np.array([[j, i]]))[0])


def shingle_sets(texts: Sequence[str], ngram: int) -> list[np.ndarray]:
    """Each text's `shingles` as the sorted distinct 64-bit hashes of its word n-grams (the fast
    shingle hash before its cut to 32 bits), vectorised: ~4x cheaper than sets of byte strings.
    Their Jaccard is the exact one unless two distinct shingles of a pair collide (p ~ 1e-13
    for two 3.6 KB documents)."""
    hv, offsets = shingle_hashes([simplified_words(t) for t in texts], ngram, full=True)
    return [np.unique(part) for part in np.split(hv, offsets[1:])]


def _slices_within(sizes: np.ndarray, cap: int) -> list[tuple[int, int]]:
    """Consecutive [lo, hi) slices of `sizes` each summing to at most `cap` (or one item)."""
    out, lo, total = [], 0, 0
    for k, size in enumerate(sizes.tolist()):
        if k > lo and total + size > cap:
            out.append((lo, k))
            lo, total = k, 0
        total += size
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out


def set_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard of two sorted distinct arrays (1.0 for two empty ones, as `minhash.jaccard`)."""
    if not len(a) and not len(b):
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


class SignatureVerifier:
    """Accepts a pair when the estimated Jaccard of its MinHash signatures (the share of equal
    values) is ≥ `threshold`. Holds the caller's signature list, not a copy; runs in the driver."""

    def __init__(self, sigs: Sequence[np.ndarray | None], threshold: float):
        self.sigs, self.threshold = sigs, float(threshold)

    def mask(self, pairs: np.ndarray) -> np.ndarray:
        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        if len(pairs) == 0:
            return np.zeros(0, bool)
        a = np.stack([self.sigs[i] for i in pairs[:, 0]])
        b = np.stack([self.sigs[i] for i in pairs[:, 1]])
        return (a == b).mean(axis=1) >= self.threshold


PREFILTER_TAIL = 1e-6  # largest chance that the prefilter rejects a pair at or above the threshold


def prefilter_min_matches(threshold: float, num_perm: int, tail: float = PREFILTER_TAIL) -> int:
    """Fewest equal values (of `num_perm`) a signature pair needs to be checked exactly: the largest
    m with P(Binomial(num_perm, threshold) < m) ≤ `tail`, summed exactly (rationals). The number of
    equal values of a pair at Jaccard J is Binomial(num_perm, J) (min-wise hashing), stochastically
    increasing in J, so a pair at J ≥ threshold is rejected with probability ≤ `tail`: with 112
    values at 0.7, m = 54 (share 0.482, ~4.6 SD below 0.7) and P(reject | J = 0.7) = 4.6e-7."""
    from fractions import Fraction
    from math import comb

    t, cdf = Fraction(threshold), Fraction(0)
    for m in range(num_perm + 1):
        p_m = comb(num_perm, m) * t ** m * (1 - t) ** (num_perm - m)
        if cdf + p_m > tail:
            return m
        cdf += p_m
    return num_perm + 1


class SignaturePrefilter:
    """A text verifier (`JaccardVerifier`) behind a signature-estimate prefilter: a candidate pair
    whose signatures share fewer than `prefilter_min_matches(threshold, num_perm)` values is rejected
    without reading its texts (a pair at Jaccard ≥ threshold is, with probability < `PREFILTER_TAIL`
    = 1e-6), the rest are checked exactly by `verifier.mask`. With 28 × 4 most pairs above Jaccard
    ~0.4 are candidates (84 % at 0.5), so this skips reading and shingling most of them. `sigs[k]`:
    document k's signature (indexed like the verifier's documents; a list, or one (n, num_perm)
    array, which travels to Ray tasks zero-copy). `rejected` / `checked` count the pairs (per process)."""

    def __init__(self, verifier, sigs, tail: float = PREFILTER_TAIL):
        self.verifier, self.sigs, self.tail = verifier, sigs, float(tail)
        first = next((s for s in sigs if s is not None), None)
        self.num_perm = 0 if first is None else len(first)
        self.min_matches = prefilter_min_matches(verifier.threshold, self.num_perm, self.tail) if self.num_perm else 0
        self.rejected = self.checked = 0

    @property
    def threshold(self) -> float:
        return self.verifier.threshold

    def stage_paths(self, fn: Callable, storage_options: dict | None = None) -> "SignaturePrefilter":
        out = copy.copy(self)
        out.verifier = self.verifier.stage_paths(fn, storage_options)
        return out

    def matches(self, pairs: np.ndarray) -> np.ndarray:
        """Equal signature values of each pair (k, 2)."""
        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        if isinstance(self.sigs, np.ndarray):
            return (self.sigs[pairs[:, 0]] == self.sigs[pairs[:, 1]]).sum(axis=1)
        a = np.stack([self.sigs[i] for i in pairs[:, 0]])
        b = np.stack([self.sigs[i] for i in pairs[:, 1]])
        return (a == b).sum(axis=1)

    def mask(self, pairs: np.ndarray) -> np.ndarray:
        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        out = np.zeros(len(pairs), bool)
        if len(pairs) == 0:
            return out
        near = self.matches(pairs) >= self.min_matches
        if near.any():
            out[near] = np.asarray(self.verifier.mask(pairs[near]), dtype=bool)
        self.checked += int(near.sum())
        self.rejected += int(len(pairs) - near.sum())
        return out


def prefiltered(verifier, sigs):
    """`verifier` behind a `SignaturePrefilter` when it is a text verifier (has a `threshold`: a
    plain callable's is unknown, so it stays as it is)."""
    if verifier is None or getattr(verifier, "threshold", None) is None or isinstance(verifier, SignaturePrefilter):
        return verifier
    return SignaturePrefilter(verifier, sigs)


class CallableVerifier:
    """A plain `verify(a, b) -> bool` as a batch verifier (`mask`), optionally on a subset of
    the documents (document k is the callable's `index[k]`). Picklable if the callable is."""

    def __init__(self, verify: Callable[[int, int], bool], index: np.ndarray | None = None):
        self.verify = verify
        self.index = None if index is None else np.asarray(index, dtype=np.int64)

    def reindexed(self, sub: Sequence[int] | np.ndarray) -> "CallableVerifier":
        return _reindexed(self, sub)

    def mask(self, pairs: np.ndarray) -> np.ndarray:
        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        if self.index is not None:
            pairs = self.index[pairs]
        return np.array([bool(self.verify(int(a), int(b))) for a, b in pairs], dtype=bool)


def _reindexed(verifier, sub):
    """A copy (same class) of `verifier` whose document k is its document `sub[k]`."""
    sub = np.asarray(sub, dtype=np.int64)
    out = copy.copy(verifier)
    out.index = sub if verifier.index is None else verifier.index[sub]
    return out


def batch_verifier(verify) -> JaccardVerifier | CallableVerifier | None:
    """`verify` as an object with `mask(pairs)` and `reindexed(sub)` (None stays None)."""
    if verify is None or hasattr(verify, "mask"):
        return verify
    if callable(verify):
        return CallableVerifier(verify)
    raise TypeError(f"verify must be callable or have a mask(pairs) method, got {type(verify).__name__}")
