"""Heuristic quality filters: Gopher quality, Gopher repetition, C4, FineWeb.

Each is a `tasks.core.steps.Filter` whose `decide(doc)` returns None (keep) or
"<filter name>:<rule>", with the rule names of the reference implementation (datatrove's
GopherQualityFilter, GopherRepetitionFilter, C4QualityFilter, FineWebQualityFilter as used to
build FineWeb), so counts compare with published FineWeb statistics. Thresholds come from the
matching config section and keep the reference's semantics for switching one rule off: Gopher
rules with a threshold of 0; C4 numeric rules with -1 (booleans for the others); FineWeb rules
with a threshold out of range (e.g. `line_punct_thr: -1`, `short_line_thr: 1`). `enabled:
false` switches a whole filter off (`build_filters` leaves it out).

The rules are re-implemented here from the reference definitions (datatrove 0.10), with the
same word tokeniser and sentence splitter (spaCy's English rules, see `tasks.curate.text`); they
are checked decision for decision against datatrove on ~7,000 real pages by
benchmarks/filters_vs_datatrove.py. FineWeb follows the current reference: non-blank lines,
strict comparisons (punctuated lines < 0.12, short lines > 0.67, duplicate-line chars > 0.01,
newlines per word > 0.3), a line is punctuated when it ends in a Unicode sentence terminal.
Ratios whose denominator would be zero (a document with no words) skip that rule; the
document is still caught by the first rule that applies (e.g. "gopher_short_doc").

Order (`FILTER_ORDER`, the one definition of the chain) follows the FineWeb pipeline: language
id, Gopher repetition, Gopher quality, C4 (which rewrites the text, dropping lines), FineWeb
quality; then decontamination and PII redaction.
"""
from __future__ import annotations

import re
from bisect import bisect_left
from collections import Counter

import numpy as np

from tasks.config import C4Config, CurateConfig, FineWebConfig, GopherQualityConfig, GopherRepetitionConfig
from tasks.core.steps import Filter
from tasks.curate.text import TERMINAL_PUNCTUATION, count_sentences, is_symbol_word, words


def duplicates(items: list[str]) -> tuple[int, int]:
    """(number of items equal to an earlier item, total characters of those repeats)."""
    seen: set[str] = set()
    n = chars = 0
    for item in items:
        if item in seen:
            n += 1
            chars += len(item)
        else:
            seen.add(item)
    return n, chars


class _Joined:
    """Tokens joined once, with and without spaces, and a polynomial hash of every prefix of both
    joined strings, so that the n-grams' hashes (and lengths) come as numpy vectors: the repetition
    rules count n-grams by hash, then confirm with the strings themselves whatever decides a
    result, so a hash collision can cost time but never change a count."""

    def __init__(self, toks: list[str]):
        self.n_toks = len(toks)
        self.cat = "".join(toks)
        self.cat_sp = " ".join(toks)
        lens = np.fromiter(map(len, toks), np.int64, len(toks))
        self.ends = np.cumsum(lens)  # end of token i in `cat`
        self.starts = self.ends - lens
        self._prefix: dict[bool, tuple[np.ndarray, ...]] = {}

    def grams(self, n: int, spaced: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hash, start, end) of each n-gram in the joined string (`spaced`: with spaces)."""
        k, m = n - 1, self.n_toks - n + 1  # m n-grams: tokens [i, i + k] for i < m
        st, en, h_st, h_en, inv_st = self._bounds(spaced)
        st, en, h_st, h_en, inv_st = st[:m], en[k:], h_st[:m], h_en[k:], inv_st[:m]
        with np.errstate(over="ignore"):  # arithmetic mod 2^64
            keys = (h_en - h_st) * inv_st + (en - st).astype(np.uint64) * _LENGTH_MIX
        return keys, st, en

    def _bounds(self, spaced: bool) -> tuple[np.ndarray, ...]:
        """Each token's (start, end) in the joined string, the prefix hashes there and B^-start:
        gathered once per document, so each n's hashes come from slices of them."""
        if spaced not in self._prefix:
            st, en = self.starts, self.ends
            if spaced:  # i spaces before token i
                st, en = st + np.arange(self.n_toks), en + np.arange(self.n_toks)
            h = _prefix_hashes(self.cat_sp if spaced else self.cat)
            self._prefix[spaced] = (st, en, h[st], h[en], _powers(len(h))[1][st])
        return self._prefix[spaced]


# Polynomial hashing mod 2^64 (numpy's wrapping uint64 arithmetic): an odd base has an inverse,
# so substring [a, b) hashes to (H[b] - H[a]) * B^-a, independent of where it sits
_BASE = np.uint64(0x9E3779B97F4A7C15)
_LENGTH_MIX = np.uint64(0xC2B2AE3D27D4EB4F)
_POWERS: tuple[np.ndarray, np.ndarray] = (np.ones(1, np.uint64), np.ones(1, np.uint64))
_POWERS_KEPT = 1 << 20  # tables up to this length are kept for the next documents (16 MB); longer, per call


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """B^j and B^-j for j < n (at least), grown by doubling."""
    global _POWERS
    if len(_POWERS[0]) >= n:
        return _POWERS
    size = max(n, 2 * len(_POWERS[0]), 4096)
    inv = np.uint64(pow(int(_BASE), -1, 1 << 64))
    with np.errstate(over="ignore"):
        tables = []
        for b in (_BASE, inv):
            pw = np.full(size, b, np.uint64)
            pw[0] = 1
            tables.append(np.cumprod(pw, dtype=np.uint64))
    powers = (tables[0], tables[1])
    if size <= _POWERS_KEPT:  # one assignment: another thread never sees tables of two lengths
        _POWERS = powers
    return powers


def _prefix_hashes(s: str) -> np.ndarray:
    codes = np.frombuffer(s.encode("utf-32-le", "surrogatepass"), np.uint32).astype(np.uint64)
    out = np.zeros(len(codes) + 1, np.uint64)
    with np.errstate(over="ignore"):
        np.cumsum(codes * _powers(len(codes) + 1)[0][:len(codes)], out=out[1:])
    return out


def top_ngram_chars(toks: list[str] | _Joined, n: int) -> int:
    """Characters covered by the most frequent n-gram (space-joined length × count); ties go to
    the n-gram seen first. 0 when there are fewer than n tokens."""
    j = toks if isinstance(toks, _Joined) else _Joined(toks)
    if j.n_toks < n:
        return 0
    keys, st, en = j.grams(n, spaced=True)
    runs, counts = _sorted_runs(keys)
    best = int(counts.max())
    if best == 1:  # no two hashes alike, so no two n-grams alike: the first one wins the tie
        return int(en[0] - st[0])
    top = runs[counts == best]  # the hashes of the top count, sorted
    hit = np.minimum(np.searchsorted(top, keys), len(top) - 1)
    at = int(np.argmax(top[hit] == keys))  # the first n-gram whose hash has the top count
    members = np.flatnonzero(keys == keys[at])
    cat = j.cat_sp
    gram = cat[st[at]:en[at]]
    if any(cat[a:b] != gram for a, b in zip(st[members].tolist(), en[members].tolist())):
        return _top_ngram_chars_exact(j, n)  # a hash collision: count the strings
    return len(gram) * best


def _sorted_runs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys, sorted; how often each occurs): from a plain sort of the keys, ~5x cheaper
    than the stable argsort that np.unique's index/counts need; positions come back by lookup."""
    k = np.sort(keys)
    bounds = np.concatenate(([0], np.flatnonzero(k[1:] != k[:-1]) + 1, [len(k)]))
    return k[bounds[:-1]], np.diff(bounds)


def _top_ngram_chars_exact(j: _Joined, n: int) -> int:
    cat, st, en, k = j.cat_sp, j.starts.tolist(), j.ends.tolist(), n - 1
    gram, count = Counter(cat[st[i] + i:en[i + k] + i + k] for i in range(j.n_toks - k)).most_common(1)[0]
    return len(gram) * count


def duplicated_ngram_chars(toks: list[str] | _Joined, n: int) -> int:
    """Characters in n-grams that repeat an earlier n-gram, scanning left to right and jumping
    past a repeat so overlapping repeats are not counted twice (n-gram = tokens concatenated).
    Only positions whose n-gram occurs more than once can matter, so the scan visits just those
    (found by hash: equal strings hash alike, and a position visited needlessly changes nothing)."""
    j = toks if isinstance(toks, _Joined) else _Joined(toks)
    if j.n_toks < n:
        return 0
    keys, st, en = j.grams(n, spaced=False)
    k = np.sort(keys)
    same = k[1:] == k[:-1]
    if not same.any():  # no two n-grams hash alike (most documents from n = 6 up)
        return 0
    twice = k[1:][same]  # each hash seen more than once (sorted, with repeats)
    hit = np.minimum(np.searchsorted(twice, keys), len(twice) - 1)
    candidates = np.flatnonzero(twice[hit] == keys).tolist()
    cat, st, en = j.cat, st.tolist(), en.tolist()
    seen: set[str] = set()
    chars = nxt = 0  # nxt: the first token index still to consider
    while True:
        ci = bisect_left(candidates, nxt)
        if ci >= len(candidates):
            return chars
        i = candidates[ci]
        gram = cat[st[i]:en[i]]
        if gram in seen:
            chars += len(gram)
            nxt = i + n
        else:
            seen.add(gram)
            nxt = i + 1


def real_word_count(text: str) -> int:
    """Gopher's document length: word tokens that are not symbol words (what `min_doc_words`
    bounds; also re-applied by line dedup, `tasks.dedup.lines`, to documents it shortened)."""
    return sum(1 for w in words(text) if not is_symbol_word(w))


# A word's kind, cached per word (a document repeats most of its words): set bits for "every
# character a symbol" and "has a letter"; _KNOWN is set on every entry so that none is falsy
_SYMBOL, _ALPHA, _KNOWN = 1, 2, 4
_WORD_KINDS: dict[str, int] = {}
_CACHED_WORD_CHARS = 64


def _word_kinds(toks: list[str]) -> list[int]:
    get = _WORD_KINDS.get
    return [get(w) or _word_kind(w) for w in toks]


def _word_kind(w: str) -> int:
    kind = (_KNOWN | (_SYMBOL if is_symbol_word(w) else 0)
            | (_ALPHA if any(ch.isalpha() for ch in w) else 0))
    if len(w) <= _CACHED_WORD_CHARS:  # long tokens (URLs, base64) rarely repeat and would fill memory
        if len(_WORD_KINDS) >= 1_000_000:  # bounded; the cache only memoises
            _WORD_KINDS.clear()
        _WORD_KINDS[w] = kind
    return kind


class GopherQualityFilter(Filter):
    name = "gopher_quality"

    def __init__(self, cfg: GopherQualityConfig):
        self.cfg = cfg
        self.stop_words = frozenset(cfg.stop_words)

    def decide(self, doc: dict) -> str | None:
        c, text = self.cfg, doc["text"]
        toks = words(text)
        n_words = len(toks)
        kinds = _word_kinds(toks)
        real = [w for w, k in zip(toks, kinds) if not k & _SYMBOL]
        n_real = len(real)
        if c.min_doc_words and n_real < c.min_doc_words:
            return "gopher_quality:gopher_short_doc"
        if c.max_doc_words and n_real > c.max_doc_words:
            return "gopher_quality:gopher_long_doc"
        if n_real:
            avg = sum(len(w) for w in real) / n_real
            if c.min_avg_word_length and avg < c.min_avg_word_length:
                return "gopher_quality:gopher_below_avg_threshold"
            if c.max_avg_word_length and avg > c.max_avg_word_length:
                return "gopher_quality:gopher_above_avg_threshold"
        if n_words and c.max_symbol_word_ratio:
            if text.count("#") / n_words > c.max_symbol_word_ratio:
                return "gopher_quality:gopher_too_many_hashes"
            if (text.count("...") + text.count("…")) / n_words > c.max_symbol_word_ratio:
                return "gopher_quality:gopher_too_many_ellipsis"
        lines = text.splitlines()
        if lines:
            if c.max_bullet_lines_ratio:
                bullets = sum(1 for ln in lines if ln.lstrip().startswith(("•", "-")))
                if bullets / len(lines) > c.max_bullet_lines_ratio:
                    return "gopher_quality:gopher_too_many_bullets"
            if c.max_ellipsis_lines_ratio:
                ends = sum(1 for ln in lines if ln.rstrip().endswith(("...", "…")))
                if ends / len(lines) > c.max_ellipsis_lines_ratio:
                    return "gopher_quality:gopher_too_many_end_ellipsis"
        counted = toks if c.alpha_words == "tokens" else text.split()
        if counted and c.max_non_alpha_words_ratio:
            kinds = kinds if counted is toks else _word_kinds(counted)
            alpha = sum(1 for k in kinds if k & _ALPHA)
            if alpha / len(counted) < c.max_non_alpha_words_ratio:
                return "gopher_quality:gopher_below_alpha_threshold"
        if c.min_stop_words and len(self.stop_words.intersection(toks)) < c.min_stop_words:  # distinct ones
            return "gopher_quality:gopher_enough_stop_words"
        return None


class GopherRepetitionFilter(Filter):
    name = "gopher_repetition"
    _PARAGRAPHS = re.compile(r"\n{2,}")
    _LINES = re.compile(r"\n+")

    def __init__(self, cfg: GopherRepetitionConfig):
        self.cfg = cfg

    def decide(self, doc: dict) -> str | None:
        c, text = self.cfg, doc["text"]
        if not text:
            return "gopher_repetition:empty"
        paragraphs = self._PARAGRAPHS.split(text.strip())
        n_dup, dup_chars = duplicates(paragraphs)
        if c.dup_para_frac and n_dup / len(paragraphs) > c.dup_para_frac:
            return "gopher_repetition:dup_para_frac"
        if c.dup_para_char_frac and dup_chars / len(text) > c.dup_para_char_frac:
            return "gopher_repetition:dup_para_char_frac"
        lines = self._LINES.split(text)
        n_dup, dup_chars = duplicates(lines)
        if c.dup_line_frac and n_dup / len(lines) > c.dup_line_frac:
            return "gopher_repetition:dup_line_frac"
        if c.dup_line_char_frac and dup_chars / len(text) > c.dup_line_char_frac:
            return "gopher_repetition:dup_line_char_frac"
        toks = _Joined(words(text))
        for n, frac in sorted(c.top_n_grams.items()):
            if frac and top_ngram_chars(toks, n) / len(text) > frac:
                return f"gopher_repetition:top_{n}_gram"
        for n, frac in sorted(c.dup_n_grams.items()):
            if frac and duplicated_ngram_chars(toks, n) / len(text) > frac:
                return f"gopher_repetition:duplicated_{n}_n_grams"
        return None


class C4QualityFilter(Filter):
    """C4 line and page rules (lines split on newlines, as in C4 and FineWeb). Lines failing a
    line rule are removed from `doc["text"]`; lorem ipsum or a curly bracket drops the page,
    as does having fewer than `min_num_sentences` sentences in the lines kept."""

    name = "c4"
    CITATION = re.compile(r"\[\d*]|\[edit]|\[citation needed]")
    END_PUNCT = (".", "?", "!", '"', "'")
    POLICY = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies",
              "use cookies")

    def __init__(self, cfg: C4Config):
        self.cfg = cfg

    def decide(self, doc: dict) -> str | None:
        c = self.cfg
        kept: list[str] = []
        for line in doc["text"].splitlines():
            line = line.strip()
            toks = line.split()
            if c.max_word_length >= 0 and max(map(len, toks), default=0) > c.max_word_length:
                continue
            if c.remove_citations:
                line = self.CITATION.sub("", line)
            if c.filter_no_terminal_punct and (not line.endswith(self.END_PUNCT) or line.endswith("...")):
                continue
            if len(toks) < c.min_words_per_line:
                continue
            low = line.lower()
            if c.filter_lorem_ipsum and "lorem ipsum" in low:
                return "c4:lorem_ipsum"
            if c.filter_javascript and "javascript" in low:
                continue
            if c.filter_curly_bracket and "{" in line:
                return "c4:curly_bracket"
            if c.filter_policy and any(p in low for p in self.POLICY):
                continue
            kept.append(line)
        if c.min_num_sentences > 0 and self._too_few_sentences(kept):
            return "c4:too_few_sentences"
        doc["text"] = "\n".join(kept).strip()
        return None

    def _too_few_sentences(self, kept: list[str]) -> bool:
        """Sentences (spaCy's sentencizer) in the kept lines < `min_num_sentences`, counting only
        as far as needed: every non-empty line has at least one sentence, so with enough such
        lines nothing is tokenised."""
        need = self.cfg.min_num_sentences
        if sum(1 for line in kept if line) >= need:
            return False
        n = 0
        for line in kept:
            n += count_sentences(line)
            if n >= need:
                return False
        return True


class FineWebQualityFilter(Filter):
    """FineWeb's own rules, over the non-blank lines (`\n`-split) of the document."""

    name = "fineweb"

    def __init__(self, cfg: FineWebConfig):
        self.cfg = cfg

    def decide(self, doc: dict) -> str | None:
        c, text = self.cfg, doc["text"]
        lines = [ln for ln in text.split("\n") if ln.strip()]
        if not lines:
            return "fineweb:empty"
        ratio = sum(1 for ln in lines if ln[-1] in TERMINAL_PUNCTUATION) / len(lines)
        if ratio < c.line_punct_thr and not (ratio == 0 and c.line_punct_exclude_zero):
            return "fineweb:line_punct_ratio"
        ratio = sum(1 for ln in lines if len(ln) <= c.short_line_length) / len(lines)
        if ratio > c.short_line_thr:
            return "fineweb:short_line_ratio"
        ratio = duplicates(lines)[1] / len(text.replace("\n", ""))
        if ratio > c.char_duplicates_ratio:
            return "fineweb:char_dup_ratio"
        # words >= whitespace-separated chunks (each yields at least one token): tokenise only
        # when that lower bound cannot settle the rule
        newlines = text.count("\n")
        if newlines > c.new_line_ratio * len(text.split()) and newlines / len(words(text)) > c.new_line_ratio:
            return "fineweb:list_ratio"
        return None


# The chain, by step name (each a `CurateConfig` section with `enabled`): FineWeb's order, then
# decontamination and PII redaction (why there: the docstring of `tasks.curate.run`).
FILTER_ORDER = ("langid", "gopher_repetition", "gopher_quality", "c4", "fineweb", "decontam", "pii")


def filter_names(cfg: CurateConfig) -> list[str]:
    """Names of the enabled filter steps in the order `build_filters` runs them."""
    return [name for name in FILTER_ORDER if getattr(cfg, name).enabled]


def build_filters(cfg: CurateConfig, langid_model=None, *, decontam_index=None,
                  pii_policies: dict[str, str] | None = None) -> list[Filter]:
    """The enabled filters in `FILTER_ORDER`. The language filter loads fastText's lid.176 model
    once (or uses `langid_model`). The decontamination step needs `decontam_index` (a
    `decontam.DecontamIndex`), the PII redaction step `pii_policies` ({source: redact|keep});
    without them those steps are left out."""
    def langid() -> Filter:
        from tasks.curate.langid import LangIdFilter

        return LangIdFilter(cfg.langid, model=langid_model)

    def decontam() -> Filter:
        from tasks.curate.decontam import DecontamFilter

        return DecontamFilter(decontam_index)

    def pii() -> Filter:
        from tasks.curate.pii import PiiRedactor

        return PiiRedactor(cfg.pii.kinds, pii_policies, cfg.pii.default_policy)

    makers = {"langid": langid, "gopher_repetition": lambda: GopherRepetitionFilter(cfg.gopher_repetition),
              "gopher_quality": lambda: GopherQualityFilter(cfg.gopher_quality),
              "c4": lambda: C4QualityFilter(cfg.c4), "fineweb": lambda: FineWebQualityFilter(cfg.fineweb)}
    if decontam_index is not None:
        makers["decontam"] = decontam
    if pii_policies is not None:
        makers["pii"] = pii
    return [makers[name]() for name in filter_names(cfg) if name in makers]
