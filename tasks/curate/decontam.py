"""Benchmark decontamination: drop documents that share a word n-gram (13 by default) with an
evaluation set.

Normalisation (both sides): lower case, every run of Unicode punctuation/symbols (P*, S*)
replaced by a space, split on whitespace. Replacing punctuation by a space (rather than
deleting it) makes WikiText's tokenised "well @-@ known" and "1 @,@ 000" equal web text's
"well-known" and "1,000", and "don 't" equal "don't".

Hashing: each word → 64-bit (blake2b, cached per process); an n-gram → 64-bit polynomial
rolling hash of its word hashes (uint64 arithmetic in numpy, one vectorised pass per document).
The index is a sorted uint64 array of every benchmark n-gram hash with parallel arrays of the
benchmark number and item index of its first occurrence; membership is, per document, one
gather from an 8 MB bit table of the hashes' top 26 bits (lets through every member and ~1.5 %
of the rest), then one `np.searchsorted` of those survivors only. It is built once in the driver (`build_index`) and shipped to the Ray workers
with `ray.put` (numpy arrays are zero-copy from the object store). A 64-bit collision between
a document n-gram and ~1M benchmark n-grams has probability ~1e-13 per n-gram.

Items: LAMBADA one per line (the passage incl. its target word); HellaSwag one per line, the
context followed by the gold ending; WikiText-2 one per article (split at " = Title = "
headings); "jsonl_text" any JSONL with a "text" field.

Decision: a document with at least one hit is dropped as "decontam:<benchmark>" (the benchmark
of its first hit in text order). `drain()` returns the hits: one per (document, benchmark,
item) with the first matching n-gram (normalised words) — the report lists them.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path

import numpy as np
import regex

from tasks.config import DecontamConfig, PipelineConfig
from tasks.core.steps import Filter
from tasks.core.text import CharTable

_PUNCT_CHAR = regex.compile(r"[\p{P}\p{S}]")
# each punctuation/symbol character → a space (the regex's own classes decide, so its Unicode
# version too): after split() the same words as replacing each run of them by one space
_PUNCT_TO_SPACE = CharTable(lambda ch: " " if _PUNCT_CHAR.fullmatch(ch) else ch)
_BASE = np.uint64(0x100000001B3)  # odd multiplier of the rolling hash
_WORD_CACHE: dict[str, int] = {}
_WORD_CACHE_MAX = 2_000_000


def normalise_words(text: str) -> list[str]:
    return text.lower().translate(_PUNCT_TO_SPACE).split()


def _word_hashes(words: list[str]) -> np.ndarray:
    cache = _WORD_CACHE
    if len(cache) > _WORD_CACHE_MAX:
        cache.clear()
    hs = list(map(cache.get, words))
    if None in hs:
        for i, h in enumerate(hs):
            if h is None:
                w = words[i]
                h = cache.get(w)
                if h is None:
                    h = cache[w] = int.from_bytes(hashlib.blake2b(w.encode("utf-8"), digest_size=8).digest(), "little")
                hs[i] = h
    return np.fromiter(hs, np.uint64, len(hs))  # ~2x faster than np.array on a list of ints


def ngram_hashes(words: list[str], n: int) -> np.ndarray:
    """64-bit hash of every n-gram of `words` (empty when there are fewer than n words)."""
    m = len(words) - n + 1
    if m <= 0:
        return np.empty(0, dtype=np.uint64)
    wh = _word_hashes(words)
    acc = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for k in range(n):
            acc = acc * _BASE + wh[k:k + m]
    return acc


_WIKI_TITLE = re.compile(r"^ = [^=].* = $")


def read_items(path: str | Path, fmt: str) -> list[str]:
    path = Path(path)
    if fmt in ("lambada", "jsonl_text"):
        with open(path, encoding="utf-8") as f:
            return [json.loads(line)["text"] for line in f if line.strip()]
    if fmt == "hellaswag":
        items = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    items.append(f"{r['ctx']} {r['endings'][int(r['label'])]}")
        return items
    if fmt == "wikitext":
        articles: list[list[str]] = []
        for line in path.read_text(encoding="utf-8").splitlines():
            if _WIKI_TITLE.match(line) or not articles:
                articles.append([])
            articles[-1].append(line)
        return ["\n".join(a) for a in articles if any(ln.strip() for ln in a)]
    raise ValueError(f"unknown benchmark format {fmt!r}")


class DecontamIndex:
    """Sorted n-gram hashes with (benchmark, item) of each; picklable (numpy arrays + names)."""

    def __init__(self, n: int, names: list[str], hashes: np.ndarray, bench: np.ndarray, items: np.ndarray,
                 stats: dict):
        _check_index_arrays(hashes, bench, items)
        self.n, self.names, self.hashes, self.bench, self.items, self.stats = n, names, hashes, bench, items, stats

    def __len__(self) -> int:
        return len(self.hashes)

    def fingerprint(self) -> str:
        h = hashlib.sha256(json.dumps([self.n, self.names]).encode())
        h.update(self.hashes.tobytes())
        return h.hexdigest()[:16]

    def lookup(self, grams: np.ndarray) -> np.ndarray:
        """Positions in the index of each gram, -1 where absent. Only the grams the bit table
        lets through (`maybe_present`: nearly none of a clean document's) are binary-searched."""
        out = np.full(len(grams), -1, dtype=np.int64)
        if not len(grams) or not len(self.hashes):
            return out
        maybe = self.maybe_present(grams)
        if len(maybe):
            out[maybe] = sorted_positions(self.hashes, grams[maybe])
        return out

    def maybe_present(self, grams: np.ndarray) -> np.ndarray:
        """Indices of the grams whose top `_TABLE_BITS` bits are those of some indexed n-gram (a
        superset of the present ones; at ~1M n-grams ~1.5 % of absent ones also pass): one
        gather from an 8 MB bit table instead of ~20 probes of a binary search per gram."""
        bits = self.__dict__.get("_bits")
        if bits is None:
            bits = self._bits = _bit_table(self.hashes)
        top = grams >> np.uint64(64 - _TABLE_BITS)
        return np.flatnonzero(bits[top >> np.uint64(3)] & _BIT[top & np.uint64(7)])

    def __getstate__(self) -> dict:
        """Pickled (to the workers) without the bit table: rebuilt there from the hashes."""
        return {k: v for k, v in self.__dict__.items() if k != "_bits"}

    def __setstate__(self, state: dict) -> None:
        """Unpickling skips __init__: the arrays are checked here too before any lookup trusts them."""
        _check_index_arrays(state["hashes"], state["bench"], state["items"])
        self.__dict__.update(state)


def sorted_positions(hashes: np.ndarray, grams: np.ndarray) -> np.ndarray:
    """Position of each gram in the strictly increasing `hashes` (see `require_sorted_hashes`),
    -1 where absent: one binary search per gram."""
    if not len(hashes):
        return np.full(len(grams), -1, dtype=np.int64)
    pos = np.minimum(np.searchsorted(hashes, grams), len(hashes) - 1)
    return np.where(hashes[pos] == grams, pos, -1)


def require_sorted_hashes(hashes: np.ndarray, what: str) -> None:
    """`sorted_positions`' binary search and the bit table's one-OR-per-run (`_bit_table`) need the
    hashes a strictly increasing 1-D uint64 array: unsorted ones would silently miss members (false
    negatives = missed contamination), so an index built or read any other way is refused."""
    if not isinstance(hashes, np.ndarray) or hashes.dtype != np.uint64 or hashes.ndim != 1:
        raise ValueError(f"{what}: hashes must be a 1-D uint64 array, got "
                         f"{getattr(hashes, 'dtype', type(hashes).__name__)}")
    bad = np.flatnonzero(hashes[1:] <= hashes[:-1])
    if len(bad):
        raise ValueError(f"{what}: hashes not strictly increasing ({len(bad)} places, first at "
                         f"{int(bad[0]) + 1})")


def _check_index_arrays(hashes: np.ndarray, bench: np.ndarray, items: np.ndarray) -> None:
    require_sorted_hashes(hashes, "decontam index (build it with build_index)")
    if len(bench) != len(hashes) or len(items) != len(hashes):
        raise ValueError(f"decontam index: {len(hashes)} hashes but {len(bench)} benchmark and {len(items)} "
                         "item entries")


_TABLE_BITS = 26  # 2^26 bits = 8 MB per process
_BIT = np.array([1 << b for b in range(8)], dtype=np.uint8)


def _bit_table(hashes: np.ndarray) -> np.ndarray:
    """Bit i set when some hash's top `_TABLE_BITS` bits are i. `hashes` is sorted (checked by
    `_check_index_arrays`), so their byte positions come in runs: one OR per run (`reduceat`)."""
    table = np.zeros(1 << (_TABLE_BITS - 3), dtype=np.uint8)
    if len(hashes):
        top = hashes >> np.uint64(64 - _TABLE_BITS)
        byte = top >> np.uint64(3)
        runs = np.flatnonzero(np.r_[True, byte[1:] != byte[:-1]])
        table[byte[runs]] = np.bitwise_or.reduceat(_BIT[top & np.uint64(7)], runs)
    return table


def build_index(cfg: DecontamConfig, data_root: PipelineConfig | str | Path) -> DecontamIndex:
    t0 = time.perf_counter()
    resolve = data_root.resolve_uri if isinstance(data_root, PipelineConfig) else \
        (lambda p: p if Path(p).is_absolute() else str(Path(data_root) / p))
    names, parts_h, parts_b, parts_i, per_bench = [], [], [], [], {}
    for bench in cfg.benchmarks:
        path = Path(resolve(bench.path))
        if not path.is_file():
            if cfg.on_missing == "skip":
                per_bench[bench.name] = {"path": str(path), "missing": True}
                continue
            raise FileNotFoundError(f"decontam benchmark {bench.name}: {path} not found "
                                    "(set curate.decontam.on_missing=skip to run without it)")
        b = len(names)
        names.append(bench.name)
        items = read_items(path, bench.format)
        # all items' words in one array; n-grams that straddle two items are masked out
        words: list[str] = []
        owner: list[int] = []
        for idx, text in enumerate(items):
            w = normalise_words(text)
            words += w
            owner += [idx] * len(w)
        g = ngram_hashes(words, cfg.n)
        own = np.asarray(owner, dtype=np.int32)
        keep = own[:len(g)] == own[cfg.n - 1:cfg.n - 1 + len(g)]
        g, own = g[keep], own[:len(keep)][keep]
        parts_h.append(g)
        parts_b.append(np.full(len(g), b, dtype=np.uint8))
        parts_i.append(own)
        per_bench[bench.name] = {"path": str(path), "items": len(items), "ngrams": int(len(g))}
    if parts_h:
        h, bb, ii = np.concatenate(parts_h), np.concatenate(parts_b), np.concatenate(parts_i)
        order = np.lexsort((ii, bb, h))  # by hash, then first benchmark/item
        h, bb, ii = h[order], bb[order], ii[order]
        first = np.ones(len(h), dtype=bool)
        first[1:] = h[1:] != h[:-1]
        h, bb, ii = h[first], bb[first], ii[first]
    else:
        h, bb, ii = (np.empty(0, np.uint64), np.empty(0, np.uint8), np.empty(0, np.int32))
    stats = {"n": cfg.n, "benchmarks": per_bench, "unique_ngrams": int(len(h)),
             "build_seconds": round(time.perf_counter() - t0, 3), "bytes": int(h.nbytes + bb.nbytes + ii.nbytes)}
    return DecontamIndex(cfg.n, names, h, bb, ii, stats)


class DecontamFilter(Filter):
    name = "decontam"

    def __init__(self, index: DecontamIndex):
        self.index = index
        self.hits: list[dict] = []

    def find(self, text: str) -> list[dict]:
        """One hit per (benchmark, item), in text order: benchmark, item, ngram."""
        words = normalise_words(text)
        grams = ngram_hashes(words, self.index.n)
        pos = self.index.lookup(grams)
        found = np.nonzero(pos >= 0)[0]
        hits, seen = [], set()
        for start in found:
            p = pos[start]
            key = (int(self.index.bench[p]), int(self.index.items[p]))
            if key in seen:
                continue
            seen.add(key)
            hits.append({"benchmark": self.index.names[key[0]], "item": key[1],
                         "ngram": " ".join(words[start:start + self.index.n])})
        return hits

    def decide(self, doc: dict) -> str | None:
        if not len(self.index):
            return None
        hits = self.find(doc["text"])
        if not hits:
            return None
        for h in hits:
            h["doc_id"] = doc.get("id")
            self.hits.append(h)
        return f"decontam:{hits[0]['benchmark']}"

    def drain(self) -> list[dict]:
        out, self.hits = self.hits, []
        return out
