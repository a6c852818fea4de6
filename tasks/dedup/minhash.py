"""MinHash LSH near-duplicate detection: numpy-vectorised signatures, interoperable with datasketch.

Shingles (FineWeb-style): the text is simplified (lower case, punctuation/symbols/control chars
→ space, diacritics stripped, digit runs → "0", whitespace collapsed), split on spaces and cut
into word n-grams (`curate.dedup.minhash.ngram`, 5 by default); a document shorter than n words
is one shingle. A document with no words gets no signature and is never a duplicate.

Signatures equal `datasketch.MinHash(num_perm=bands*rows, seed=seed, scheme=scheme)` after
`update_batch(shingles)`, with datasketch's default shingle hash `sha1_hash32` (the first 4 bytes
of SHA-1 of the UTF-8 shingle, little endian) — but computed without a Python call per shingle:

1. the simplified texts of a batch are one UTF-8 byte buffer; shingles are (start, length)
   byte ranges into it, found from the space positions (no shingle strings are built);
2. SHA-1 of every shingle of ≤ 55 bytes (one 64-byte block; nearly all of them) runs as
   uint32 numpy ops over all shingles at once (`sha1_hash32_many`); longer ones use hashlib;
3. the permutations are one (num_perm × n_shingles) array op — "affine32" (datasketch's default
   since 2.0.0): fmix32(h)·a + b mod 2^32; "legacy": (a·h + b) mod (2^61 − 1) & (2^32 − 1) —
   and `np.minimum.reduceat` takes each document's minimum.

Duplicate shingles in a document need no set: the minimum is unchanged by repeats.
Signatures load as `datasketch.LeanMinHash(seed=seed, hashvalues=sig, scheme=scheme)`.

Clustering (`minhash_clusters`): band keys = the bytes of each band's `rows` values; documents
sharing a key in any band are joined with a union-find, so clusters are connected components;
each cluster's root is its first document in corpus order (kept, the others are duplicates).
With 14 bands × 8 rows a pair with Jaccard s becomes a candidate with probability
1-(1-s^8)^14: ≈ 0.5 at s ≈ 0.68, ≈ 0.92 at s = 0.8, ≈ 0.05 at s = 0.5.
"""
from __future__ import annotations

import hashlib
import unicodedata
from itertools import chain
from typing import Iterable, Sequence

import numpy as np
import regex

_NON_WORD = regex.compile(r"[\p{P}\p{S}\p{C}]+")
_DIGITS = regex.compile(r"\d+")
_MARKS = regex.compile(r"\p{Mn}+")
_SCHEMES = ("affine32", "legacy")


def simplify(text: str) -> str:
    text = text.lower()
    if not text.isascii():  # no combining marks in ASCII text: skip the NFD pass
        text = unicodedata.normalize("NFD", text)
        text = _MARKS.sub("", text)
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


# ---------------------------------------------------------------------------------------------
# vectorised SHA-1 (single 64-byte block messages)

_H0 = (0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0)
_K = (0x5A827999, 0x6ED9EBA1, 0x8F1BBCDC, 0xCA62C1D6)
_MAX_ONE_BLOCK = 55  # message bytes that fit one block with the 0x80 pad byte and 8-byte length


def _tables() -> tuple[np.ndarray, np.ndarray]:
    """MASK[L] keeps the first L bytes of a block; PAD[L] adds the 0x80 byte and the bit length."""
    mask = np.zeros((_MAX_ONE_BLOCK + 1, 64), dtype=np.uint8)
    pad = np.zeros((_MAX_ONE_BLOCK + 1, 64), dtype=np.uint8)
    for n in range(_MAX_ONE_BLOCK + 1):
        mask[n, :n] = 0xFF
        pad[n, n] = 0x80
        pad[n, 62], pad[n, 63] = (n * 8) >> 8, (n * 8) & 0xFF
    return mask, pad


_MASK, _PAD = _tables()


def _rotl(x: np.ndarray, n: int) -> np.ndarray:
    r = x << np.uint32(n)
    r |= x >> np.uint32(32 - n)
    return r


def _sha1_h0_blocks(w: np.ndarray) -> np.ndarray:
    """`w`: (16, N) uint32 big-endian words of N padded one-block messages; returns the first
    digest word (h0) of each, as uint32. Every op writes into a preallocated buffer."""
    w = [np.array(w[i], dtype=np.uint32, copy=True) for i in range(16)]
    a, b, c, d, e = (np.full(w[0].shape, h, dtype=np.uint32) for h in _H0)
    t1, t2 = np.empty_like(a), np.empty_like(a)
    u1, u5, u27, u30, u2, u31 = (np.uint32(k) for k in (1, 5, 27, 30, 2, 31))
    for t in range(80):
        wt = w[t & 15]
        if t >= 16:  # w[t] = rotl1(w[t-3] ^ w[t-8] ^ w[t-14] ^ w[t-16]), in place
            np.bitwise_xor(w[(t - 3) & 15], w[(t - 8) & 15], out=t1)
            t1 ^= w[(t - 14) & 15]
            t1 ^= wt
            np.left_shift(t1, u1, out=wt)
            t1 >>= u31
            wt |= t1
        f = e  # e's buffer becomes the new a
        if t < 20:  # choose: d ^ (b & (c ^ d))
            np.bitwise_xor(c, d, out=t2)
            t2 &= b
            t2 ^= d
        elif t < 40 or t >= 60:  # parity
            np.bitwise_xor(b, c, out=t2)
            t2 ^= d
        else:  # majority: (b & c) | (d & (b | c))
            np.bitwise_or(b, c, out=t2)
            t2 &= d
            np.bitwise_and(b, c, out=t1)
            t2 |= t1
        f += t2
        np.left_shift(a, u5, out=t1)  # rotl5(a)
        f += t1
        np.right_shift(a, u27, out=t1)
        f += t1  # the two halves do not overlap, so + is |
        f += np.uint32(_K[t // 20])
        f += wt
        np.left_shift(b, u30, out=t1)  # b = rotl30(b), in place
        b >>= u2
        b |= t1
        e, d, c, b, a = d, c, b, a, f
    a += np.uint32(_H0[0])
    return a


def sha1_hash32_ranges(buf: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                       chunk: int = 4096) -> np.ndarray:
    """`datasketch.hashfunc.sha1_hash32` of each byte range `buf[s:s+l]` (uint8 buffer), as uint32."""
    n = len(starts)
    out = np.empty(n, dtype=np.uint32)
    if n == 0:
        return out
    starts = starts.astype(np.int64, copy=False)
    lengths = lengths.astype(np.int64, copy=False)
    short = lengths <= _MAX_ONE_BLOCK
    last = len(buf)
    padded = np.zeros(last + 64, dtype=np.uint8)
    padded[:last] = buf
    windows = np.lib.stride_tricks.sliding_window_view(padded, 64)  # windows[s] = bytes s..s+63
    idx_short = np.flatnonzero(short)
    for lo in range(0, len(idx_short), chunk):
        sel = idx_short[lo:lo + chunk]
        ln = lengths[sel]
        blk = windows[starts[sel]]  # (m, 64) uint8 copy
        blk &= _MASK[ln]
        blk |= _PAD[ln]
        words = blk.view(">u4").astype(np.uint32).T  # (16, m)
        h0 = _sha1_h0_blocks(words)
        out[sel] = h0.byteswap()  # digest[:4] read little endian
    raw = buf.tobytes() if (~short).any() else b""
    for i in np.flatnonzero(~short):
        s = int(starts[i])
        out[i] = int.from_bytes(hashlib.sha1(raw[s:s + int(lengths[i])]).digest()[:4], "little")
    return out


def sha1_hash32_many(items: Sequence[bytes]) -> np.ndarray:
    """`sha1_hash32` of each bytes object, vectorised."""
    lengths = np.array(list(map(len, items)), dtype=np.int64)
    starts = np.zeros(len(items), dtype=np.int64)
    if len(items):
        np.cumsum(lengths[:-1], out=starts[1:])
    buf = np.frombuffer(b"".join(items) + b"\0", dtype=np.uint8)
    return sha1_hash32_ranges(buf, starts, lengths)


# ---------------------------------------------------------------------------------------------
# shingle ranges and signatures

def _shingle_ranges(data: bytes, offset: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) of the word n-gram byte ranges of one simplified text (UTF-8 `data`,
    single spaces between words), shifted by `offset`."""
    if not data:
        return np.empty(0, np.int64), np.empty(0, np.int64)
    sp = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == 32)
    n_words = len(sp) + 1
    if n_words <= n:
        return np.array([offset], np.int64), np.array([len(data)], np.int64)
    word_start = np.empty(n_words, np.int64)
    word_start[0] = 0
    word_start[1:] = sp + 1
    word_end = np.empty(n_words, np.int64)
    word_end[:-1] = sp
    word_end[-1] = len(data)
    st = word_start[: n_words - n + 1]
    en = word_end[n - 1:]
    return st + offset, en - st


class MinHasher:
    """Signatures equal to datasketch `MinHash(num_perm=bands*rows, seed=seed, scheme=scheme)`
    fed the document's shingles with the default `sha1_hash32`."""

    def __init__(self, bands: int = 14, rows: int = 8, seed: int = 1, ngram: int = 5,
                 scheme: str = "affine32"):
        from datasketch import MinHash

        if scheme not in _SCHEMES:
            raise ValueError(f"scheme must be one of {_SCHEMES}, got {scheme!r}")
        self.bands, self.rows = bands, rows
        self.num_perm = bands * rows
        self.seed = seed
        self.ngram = ngram
        self.scheme = scheme
        a, b = MinHash(num_perm=self.num_perm, seed=seed, scheme=scheme).permutations
        if scheme == "legacy":
            self._a = np.asarray(a, dtype=np.uint64)[:, None]
            self._b = np.asarray(b, dtype=np.uint64)[:, None]
        else:
            self._a = np.asarray(a, dtype=np.uint32)[:, None]
            self._b = np.asarray(b, dtype=np.uint32)[:, None]

    @property
    def dtype(self):
        return np.uint64 if self.scheme == "legacy" else np.uint32

    def _permute_min(self, hv: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """hv: uint32 shingle hashes of several docs laid end to end; offsets: each doc's first
        index (every doc non-empty). Returns (n_docs, num_perm) minima."""
        if self.scheme == "legacy":
            phv = self._a * hv.astype(np.uint64)[None, :]
            phv += self._b
            phv %= np.uint64((1 << 61) - 1)
            phv &= np.uint64((1 << 32) - 1)
        else:
            h = hv.astype(np.uint32)
            h ^= h >> np.uint32(16)
            h *= np.uint32(0x85EBCA6B)
            h ^= h >> np.uint32(13)
            h *= np.uint32(0xC2B2AE35)
            h ^= h >> np.uint32(16)
            phv = self._a * h[None, :]
            phv += self._b
        return np.minimum.reduceat(phv, offsets, axis=1).T  # (num_perm, n) layout: fastest reduceat

    def signatures(self, texts: Iterable[str], max_shingles: int = 1 << 14) -> list[np.ndarray | None]:
        """Signatures of many texts (None for a text without words); vectorised over the batch."""
        out: list[np.ndarray | None] = []
        pending: list[tuple[int, bytes]] = []  # (position in out, simplified bytes)
        size = 0

        def flush() -> None:
            nonlocal pending, size
            if not pending:
                return
            buf_parts, st_parts, ln_parts, counts = [], [], [], []
            off = 0
            for _, data in pending:
                st, ln = _shingle_ranges(data, off, self.ngram)
                st_parts.append(st)
                ln_parts.append(ln)
                counts.append(len(st))
                buf_parts.append(data)
                off += len(data)
            buf = np.frombuffer(b"".join(buf_parts) + b"\0", dtype=np.uint8)
            hv = sha1_hash32_ranges(buf, np.concatenate(st_parts), np.concatenate(ln_parts))
            offsets = np.zeros(len(counts), dtype=np.int64)
            np.cumsum(counts[:-1], out=offsets[1:])
            sigs = self._permute_min(hv, offsets)
            for (pos, _), sig in zip(pending, sigs):
                out[pos] = sig.copy()
            pending, size = [], 0

        for text in texts:
            data = simplify(text).encode("utf-8")
            out.append(None)
            if not data:
                continue
            pending.append((len(out) - 1, data))
            size += data.count(b" ") + 1
            if size >= max_shingles:
                flush()
        flush()
        return out

    def signature(self, text: str) -> np.ndarray | None:
        return self.signatures([text])[0]

    def signatures_from_shingles(self, shingle_sets: Sequence[Iterable[bytes]],
                                 max_shingles: int = 1 << 14) -> list[np.ndarray | None]:
        """Signatures of given shingle collections (as `MinHash.bulk` takes them)."""
        lists = [s if isinstance(s, list) else list(s) for s in shingle_sets]
        out: list[np.ndarray | None] = [None] * len(lists)
        batch: list[int] = []
        size = 0

        def flush() -> None:
            if not batch:
                return
            hv = sha1_hash32_many(list(chain.from_iterable([lists[i] for i in batch])))
            counts = [len(lists[i]) for i in batch]
            offsets = np.zeros(len(batch), dtype=np.int64)
            np.cumsum(counts[:-1], out=offsets[1:])
            for i, sig in zip(batch, self._permute_min(hv, offsets)):
                out[i] = sig.copy()
            batch.clear()

        for i, s in enumerate(lists):
            if not s:
                continue
            batch.append(i)
            size += len(s)
            if size >= max_shingles:
                flush()
                size = 0
        flush()
        return out

    def lean(self, sig: np.ndarray):
        """The signature as a `datasketch.LeanMinHash`."""
        from datasketch import LeanMinHash

        return LeanMinHash(seed=self.seed, hashvalues=sig, scheme=self.scheme)


# ---------------------------------------------------------------------------------------------
# clustering

class UnionFind:
    """Union-find whose root is always the smallest index (the first document in corpus order)."""

    def __init__(self, n: int = 0):
        self.parent = list(range(n))

    def add(self) -> int:
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, i: int) -> int:
        parent = self.parent
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def union(self, i: int, j: int) -> bool:
        a, b = self.find(i), self.find(j)
        if a == b:
            return False
        if a < b:
            self.parent[b] = a
        else:
            self.parent[a] = b
        return True

    def roots(self) -> list[int]:
        return [self.find(i) for i in range(len(self.parent))]


def band_keys(sig: np.ndarray, bands: int, rows: int) -> list[bytes]:
    """One key per band: the band index and the bytes of its `rows` hash values."""
    raw = np.ascontiguousarray(sig[: bands * rows]).tobytes()
    w = rows * sig.dtype.itemsize
    return [bytes((b,)) + raw[b * w:(b + 1) * w] for b in range(bands)]


def candidate_pairs(signatures: Sequence[np.ndarray | None], bands: int = 14, rows: int = 8):
    """Yield (earlier, later) index pairs that share an LSH band key: each later document is
    paired with the first document seen under that key (enough for connected components)."""
    first: dict[bytes, int] = {}
    for i, sig in enumerate(signatures):
        if sig is None:
            continue
        seen = set()
        for key in band_keys(sig, bands, rows):
            j = first.setdefault(key, i)
            if j != i and j not in seen:
                seen.add(j)
                yield j, i


def minhash_clusters(signatures: list[np.ndarray | None], bands: int = 14, rows: int = 8,
                     seed: int = 1, scheme: str = "affine32", verify=None) -> list[int]:
    """For each document (in corpus order) the index of its cluster's first document; a
    document with `result[i] == i` is kept. `verify(i, j) -> bool`, if given, must accept a
    candidate pair before it is joined (e.g. an exact Jaccard check). `seed` and `scheme` are
    accepted for compatibility (band keys compare raw values, so mixing is the caller's care)."""
    uf = UnionFind(len(signatures))
    for j, i in candidate_pairs(signatures, bands, rows):
        if uf.find(i) == uf.find(j):
            continue
        if verify is None or verify(j, i):
            uf.union(i, j)
    return uf.roots()


def estimated_jaccard(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(a == b))


def jaccard(a: set, b: set) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)
