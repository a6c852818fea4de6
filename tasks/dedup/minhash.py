"""MinHash LSH near-duplicate detection: numpy-vectorised signatures, interoperable with datasketch.

Shingles (FineWeb-style): the text is simplified (lower case, punctuation/symbols/control chars
→ space, diacritics stripped, digit runs → "0", whitespace collapsed), split on spaces and cut
into word n-grams (`curate.dedup.minhash.ngram`, 5 by default); a document shorter than n words
is one shingle. A document with no words gets no signature and is never a duplicate.

Signatures equal `datasketch.MinHash(num_perm=bands*rows, seed=seed, scheme=scheme,
hashfunc=H)` after `update_batch(shingles)` for the shingle hash H the hasher uses:

- `hash="fast"` (the pipeline's default, `curate.dedup.minhash.hash`): H = `fast_hash32` — each
  word's UTF-8 bytes hashed to 64 bits (`word_hash64`, 8-byte chunks, multiply/rotate, fmix64),
  the n word hashes of a shingle combined in order (rotate, xor, multiply, fmix64, high 32
  bits). Both steps run vectorised over all words/shingles of a batch, so a word is hashed once,
  not once per n-gram, and nothing calls Python per shingle. Its values differ from sha1's: a
  datasketch user gets equal signatures by passing `hashfunc=fast_hash32` (tested).
- `hash="sha1"`: H = datasketch's default `sha1_hash32` (the first 4 bytes of SHA-1 of the UTF-8
  shingle, little endian), computed without a Python call per shingle:

1. the simplified texts of a batch are one UTF-8 byte buffer; shingles are (start, length)
   byte ranges into it, found from the space positions (no shingle strings are built);
2. SHA-1 of every shingle of ≤ 55 bytes (one 64-byte block; nearly all of them) runs as
   uint32 numpy ops over all shingles at once (`sha1_hash32_many`); longer ones use hashlib;
3. (both paths) the permutations are one (num_perm × n_shingles) array op — "affine32" (datasketch's default
   since 2.0.0): fmix32(h)·a + b mod 2^32; "legacy": (a·h + b) mod (2^61 − 1) & (2^32 − 1) —
   and `np.minimum.reduceat` takes each document's minimum.

Duplicate shingles in a document need no set: the minimum is unchanged by repeats.
Signatures load as `datasketch.LeanMinHash(seed=seed, hashvalues=sig, scheme=scheme)`.

Clustering (`minhash_clusters`): band keys = the bytes of each band's `rows` values; documents
sharing a key in any band are joined with a union-find, so clusters are connected components;
each cluster's root is its first document in corpus order (kept, the others are duplicates).
With b bands × r rows a pair with Jaccard s becomes a candidate with probability 1-(1-s^r)^b:
FineWeb's 14 × 8 gives ≈ 0.5 at s ≈ 0.68, ≈ 0.92 at s = 0.8, ≈ 0.05 at s = 0.5; the default 28 × 4
(the same 112 values) ≈ 0.9995 at s = 0.7 and ≈ 0.84 at s = 0.5, its candidates checked by their
exact Jaccard (`tasks.dedup.verify`, `curate.dedup.minhash.verify`). The candidate rate matches
that formula at each pair's own Jaccard (no bias from the 32-bit shingle hash or the affine32
permutations: benchmarks/curate_vs_datatrove.py, `hash_draws`). This holds every band key in one
process; at corpus scale `tasks.dedup.cluster` gives the same clusters on Ray with bounded memory.

`shingle_hashes(..., full=True)` gives the 64-bit shingle hashes the verifier compares sets of.
"""
from __future__ import annotations

import hashlib
import re
import unicodedata
from itertools import chain
from typing import Iterable, Sequence

import numpy as np

from tasks.core.text import CharTable


def _simplify_char(ch: str) -> str | None:
    """Combining marks (Mn) deleted, punctuation, symbols and control/format chars (P*, S*, C*) →
    space, decimal digits (Nd) → 0."""
    cat = unicodedata.category(ch)
    return None if cat == "Mn" else " " if cat[0] in "PSC" else "0" if cat == "Nd" else ch


_TABLE = CharTable(_simplify_char)
_ZERO_RUNS = re.compile("00+")
_SCHEMES = ("affine32", "legacy")
SHINGLE_HASHES = ("fast", "sha1")


def simplified_words(text: str) -> list[str]:
    """The words of `simplify(text)`."""
    text = text.lower()
    if not text.isascii():  # no combining marks in ASCII text: skip the NFD pass
        text = unicodedata.normalize("NFD", text)
    text = text.translate(_TABLE)  # one pass instead of three regex substitutions
    if "00" in text:  # a run of digits is one 0
        text = _ZERO_RUNS.sub("0", text)
    return text.split()


def simplify(text: str) -> str:
    return " ".join(simplified_words(text))


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
# fast shingle hash: word hashes (each distinct word once) combined into n-gram hashes

_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd multipliers (golden ratio; xxHash's PRIME64_2)
_PRIME2 = 0xC2B2AE3D27D4EB4F
_WORD_SEED = 0x27D4EB2F165667C5  # versions the word hash (xxHash's PRIME64_3)
_FMIX1, _FMIX2 = 0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53  # MurmurHash3 fmix64 constants
_LOW_BYTES = np.array([(1 << (8 * r)) - 1 for r in range(9)], dtype=np.uint64)  # r low bytes kept


def _fmix64_int(h: int) -> int:
    h ^= h >> 33
    h = (h * _FMIX1) & _M64
    h ^= h >> 33
    h = (h * _FMIX2) & _M64
    return h ^ (h >> 33)


def word_hash64(word: bytes) -> int:
    """64-bit hash of one word's UTF-8 bytes: h = len·GOLDEN ^ seed; per 8-byte little-endian
    chunk c (zero padded): h = rotl31(h ^ c·PRIME2)·GOLDEN; then fmix64. Plain integer
    arithmetic: the same in every process and on every platform (no Python hash())."""
    h = ((len(word) * _GOLDEN) & _M64) ^ _WORD_SEED
    for j in range(0, len(word), 8):
        h ^= (int.from_bytes(word[j:j + 8], "little") * _PRIME2) & _M64
        h = ((((h << 31) | (h >> 33)) & _M64) * _GOLDEN) & _M64
    return _fmix64_int(h)


def _combine64(word_hashes: Sequence[int]) -> int:
    """acc = w0; acc = (rotl27(acc) ^ w_k) · GOLDEN for each next word; fmix64 (64 bits).
    Order-sensitive (the rotation and multiply), so reordered words give another hash."""
    acc = word_hashes[0]
    for w in word_hashes[1:]:
        acc = ((((acc << 27) | (acc >> 37)) & _M64) ^ w) * _GOLDEN & _M64
    return _fmix64_int(acc)


def _combine_int(word_hashes: Sequence[int]) -> int:
    """The shingle's 32-bit hash: the high 32 bits of `_combine64`."""
    return _combine64(word_hashes) >> 32


def fast_hash32(shingle: bytes) -> int:
    """The fast path's 32-bit hash of one shingle (UTF-8 words joined by single spaces), as a
    datasketch `hashfunc`: `MinHash(..., hashfunc=fast_hash32)` fed the same shingles gives the
    same hash values as `MinHasher(hash="fast")`. Unlike sha1_hash32 it is built from per-word
    hashes, so the vectorised path hashes each word once, not once per n-gram it is part of."""
    return _combine_int([word_hash64(w) for w in shingle.split(b" ")])


def fmix64(h: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer on a uint64 array, in place (returns it)."""
    h ^= h >> np.uint64(33)
    h *= np.uint64(_FMIX1)
    h ^= h >> np.uint64(33)
    h *= np.uint64(_FMIX2)
    h ^= h >> np.uint64(33)
    return h


def _word_hashes(buf: np.ndarray, starts: np.ndarray, lens: np.ndarray) -> np.ndarray:
    """`word_hash64` of each byte range buf[s:s+l] (buf: uint8, ≥ 8 bytes of padding at the end),
    vectorised: one pass per 8-byte chunk position, over the words that long."""
    g, p2 = np.uint64(_GOLDEN), np.uint64(_PRIME2)
    r31, r33 = np.uint64(31), np.uint64(33)
    h = lens.astype(np.uint64) * g
    h ^= np.uint64(_WORD_SEED)
    windows = np.lib.stride_tricks.sliding_window_view(buf, 8)
    chunks = (lens + 7) // 8
    for j in range(int(chunks.max()) if len(lens) else 0):
        idx = np.flatnonzero(chunks > j) if j else slice(None)
        c = windows[starts[idx] + 8 * j].view("<u8").ravel()  # fancy index: a fresh (k, 8) copy
        c &= _LOW_BYTES[np.minimum(lens[idx] - 8 * j, 8)]
        c *= p2
        x = h[idx] ^ c
        rot = x << r31
        x >>= r33
        x |= rot
        x *= g
        h[idx] = x
    return fmix64(h)


def _ngram_hashes(w: np.ndarray, starts: np.ndarray, n: int, full: bool = False) -> np.ndarray:
    """`_combine_int` of w[s:s+n] for every start s, vectorised (uint64 wraps like & _M64);
    `full`: all 64 bits of the mixed value (uint64), not its high 32."""
    acc = w[starts]
    r1, r2, g = np.uint64(27), np.uint64(37), np.uint64(_GOLDEN)
    for k in range(1, n):
        rot = acc << r1
        acc >>= r2
        acc |= rot
        acc ^= w[starts + k]
        acc *= g
    if full:
        return fmix64(acc)
    return (fmix64(acc) >> np.uint64(32)).astype(np.uint32)


def shingle_hashes(word_lists: Sequence[list[str]], n: int = 5, full: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The `fast_hash32` (or, `full`, 64-bit) hash of every word n-gram shingle of each word list
    (a list shorter than n words: one shingle, all of them; an empty one: none), vectorised over
    the lists: (hashes laid end to end, each list's first index), each word hashed once."""
    lens = np.array([len(ws) for ws in word_lists], dtype=np.int64)
    counts = np.where(lens == 0, 0, np.maximum(lens - n + 1, 1))
    offsets = np.zeros(len(lens), np.int64)
    np.cumsum(counts[:-1], out=offsets[1:])
    if not counts.sum():
        return np.empty(0, np.uint64 if full else np.uint32), offsets
    # all words, space separated, as one byte buffer (+ 8 bytes of padding)
    raw = " ".join(chain.from_iterable(word_lists)).encode("utf-8") + bytes(8)
    buf = np.frombuffer(raw, dtype=np.uint8)
    spaces = np.flatnonzero(buf[:-8] == 32)
    w_start = np.r_[0, spaces + 1]
    w_len = np.r_[spaces, len(raw) - 8] - w_start
    # + n zeros: the n-gram windows of a list shorter than n words run past the end
    w = np.concatenate([_word_hashes(buf, w_start, w_len), np.zeros(n, np.uint64)])
    word_off = np.zeros(len(lens), np.int64)
    np.cumsum(lens[:-1], out=word_off[1:])
    starts = np.arange(int(counts.sum()), dtype=np.int64) + np.repeat(word_off - offsets, counts)
    hv = _ngram_hashes(w, starts, n, full)
    combine = _combine64 if full else _combine_int
    for k in np.flatnonzero((lens < n) & (lens > 0)):
        hv[offsets[k]] = combine([int(x) for x in w[word_off[k]:word_off[k] + lens[k]]])
    return hv, offsets


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


def _permutations(num_perm: int, seed: int, scheme: str) -> tuple[np.ndarray, np.ndarray]:
    """datasketch 2.0's `MinHash(num_perm, seed, scheme).permutations`, drawn the same way from
    `RandomState(seed)` (`test_signatures_equal_datasketch` holds every signature to datasketch's):
    importing datasketch pulls in scipy and redis, ~0.5-1 CPU s and ~48 MB in the curate driver,
    which builds the hasher once for all its actors."""
    gen = np.random.RandomState(seed)
    if scheme == "legacy":  # (a * h + b) mod the Mersenne prime 2^61 - 1, a >= 1
        prime = np.uint64((1 << 61) - 1)
        pairs = [(gen.randint(1, prime, dtype=np.uint64), gen.randint(0, prime, dtype=np.uint64))
                 for _ in range(num_perm)]
        return tuple(np.array(pairs, dtype=np.uint64).T)
    # affine32: a * h + b mod 2^32 with an odd a (a bijection)
    a = gen.randint(0, 1 << 31, num_perm, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    return a, gen.randint(0, 1 << 32, num_perm, dtype=np.uint32)


class MinHasher:
    """Signatures equal to datasketch `MinHash(num_perm=bands*rows, seed=seed, scheme=scheme,
    hashfunc=self.hashfunc)` fed the document's shingles: `hash="sha1"` is datasketch's default
    `sha1_hash32`, `hash="fast"` is `fast_hash32` (word hashes combined; ≈ 3× cheaper than the vectorised SHA-1)."""

    def __init__(self, bands: int = 14, rows: int = 8, seed: int = 1, ngram: int = 5,
                 scheme: str = "affine32", hash: str = "fast"):
        if scheme not in _SCHEMES:
            raise ValueError(f"scheme must be one of {_SCHEMES}, got {scheme!r}")
        if hash not in SHINGLE_HASHES:
            raise ValueError(f"hash must be one of {SHINGLE_HASHES}, got {hash!r}")
        self.hash = hash
        self.bands, self.rows = bands, rows
        self.num_perm = bands * rows
        self.seed = seed
        self.ngram = ngram
        self.scheme = scheme
        a, b = _permutations(self.num_perm, seed, scheme)
        if scheme == "legacy":
            self._a = np.asarray(a, dtype=np.uint64)[:, None]
            self._b = np.asarray(b, dtype=np.uint64)[:, None]
        else:
            self._a = np.asarray(a, dtype=np.uint32)[:, None]
            self._b = np.asarray(b, dtype=np.uint32)[:, None]

    @property
    def hashfunc(self):
        """The shingle hash to give datasketch for equal values."""
        from datasketch.hashfunc import sha1_hash32

        return fast_hash32 if self.hash == "fast" else sha1_hash32

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
        if self.hash == "fast":
            return self.signatures_from_words(map(simplified_words, texts), max_shingles)
        return self._signatures_sha1(texts, max_shingles)

    def signatures_from_words(self, word_lists: Iterable[list[str]],
                              max_shingles: int = 1 << 14) -> list[np.ndarray | None]:
        """Fast path: signatures of simplified word lists (word n-gram shingles, `fast_hash32`)."""
        if self.hash != "fast":
            raise ValueError("signatures_from_words is the hash='fast' path")
        n = self.ngram
        out: list[np.ndarray | None] = []
        pending: list[tuple[int, list[str]]] = []
        size = 0

        def flush() -> None:
            nonlocal pending, size
            if not pending:
                return
            hv, offsets = shingle_hashes([ws for _, ws in pending], n)  # every list non-empty
            for (pos, _), sig in zip(pending, self._permute_min(hv, offsets)):
                out[pos] = sig.copy()
            pending, size = [], 0

        for words in word_lists:
            out.append(None)
            if not words:
                continue
            pending.append((len(out) - 1, words))
            size += len(words)
            if size >= max_shingles:
                flush()
        flush()
        return out

    def _signatures_sha1(self, texts: Iterable[str], max_shingles: int) -> list[np.ndarray | None]:
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
        """Signatures of given shingle collections (as `MinHash.bulk` takes them). With
        hash="fast" each shingle is split into its words (slower than `signatures_from_words`)."""
        lists = [s if isinstance(s, list) else list(s) for s in shingle_sets]
        out: list[np.ndarray | None] = [None] * len(lists)
        batch: list[int] = []
        size = 0

        def flush() -> None:
            if not batch:
                return
            flat = list(chain.from_iterable([lists[i] for i in batch]))
            if self.hash == "fast":
                hv = np.fromiter(map(fast_hash32, flat), dtype=np.uint32, count=len(flat))
            else:
                hv = sha1_hash32_many(flat)
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


# candidate pairs per batch verifier call: a call keeps its documents' shingle hashes (~1.3x their
# text: ~100 MB for 10k pairs of 3.6 KB documents) beside its bounded reading (tasks.dedup.verify)
VERIFY_CHUNK_PAIRS = 10_000


def minhash_clusters(signatures: list[np.ndarray | None], bands: int = 14, rows: int = 8,
                     seed: int = 1, scheme: str = "affine32", verify=None, stats: dict | None = None) -> list[int]:
    """For each document (in corpus order) the index of its cluster's first document; a
    document with `result[i] == i` is kept. `verify(i, j) -> bool`, if given, must accept a
    candidate pair before it is joined (e.g. an exact Jaccard check); a batch verifier (with
    `mask(pairs)`, `tasks.dedup.verify`) checks the candidate pairs `VERIFY_CHUNK_PAIRS` a call, and
    `stats` (if given) receives `candidate_pairs` and `verified_pairs`. `seed` and `scheme` are
    accepted for compatibility (band keys compare raw values, so mixing is the caller's care)."""
    uf = UnionFind(len(signatures))
    if verify is not None and hasattr(verify, "mask"):
        pairs = np.array(list(candidate_pairs(signatures, bands, rows)), dtype=np.int64).reshape(-1, 2)
        ok = np.concatenate([np.zeros(0, bool)] + [np.asarray(verify.mask(pairs[lo:lo + VERIFY_CHUNK_PAIRS]), dtype=bool)
                                                   for lo in range(0, len(pairs), VERIFY_CHUNK_PAIRS)])
        for j, i in pairs[ok].tolist():
            uf.union(i, j)
        if stats is not None:
            stats["candidate_pairs"], stats["verified_pairs"] = len(pairs), int(ok.sum())
        return uf.roots()
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
