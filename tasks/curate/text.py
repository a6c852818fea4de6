"""Word tokenisation, sentence splitting and punctuation for the heuristic filters.

The reference definitions (datatrove's Gopher/C4/FineWeb filters, as used to build FineWeb)
split English into words and sentences with spaCy: the rule-based tokenizer of `spacy.blank("en")`
(prefix/suffix/infix rules and exceptions: "don't" → "do", "n't"; "well-known" → "well", "-",
"known"; URLs stay whole) and its rule-based `sentencizer`. The counts the rules use (words,
stop words, n-grams, sentences per line) depend on those splits, so we use the same library
rather than an approximation: with a regex stand-in for NLTK's Treebank tokenizer, 2.5 % of real
web pages got a different keep/drop decision. spaCy's tokenizer needs no model download.

* `words(text)`: spaCy tokens without the whitespace tokens (datatrove's `split_into_words`).
  The tokenizer keeps its lexemes and its cache of whitespace-separated chunks across texts
  (a spaCy memory zone would disable that cache: 40 % slower here; datatrove opens one zone per
  call, which also rebuilds every lexeme each time, most of its cost); so the vocabulary does not
  grow without bound on a long run, a fresh tokenizer replaces it past `_MAX_LEXEMES` lexemes
  (same tokens: the cache only memoises). New lexemes skip the lexical attributes spaCy would
  compute (unused; same tokens). thinc, which spaCy imports, imports torch when installed (0.7 s
  of start-up, never used by the tokenizer): it is hidden from that import.
* `sentences(text)` / `count_sentences(text)`: the sentences spaCy's `sentencizer` makes (a
  sentence ends after a token in its punctuation list once a token follows that is neither
  punctuation nor in the list), reimplemented on the token list: the pipeline itself is not run.
* `is_symbol_word(w)`: every character is punctuation from datatrove's set: ASCII punctuation,
  control characters, Unicode sentence terminals and a few CJK/typographic marks.
* `TERMINAL_PUNCTUATION`: characters with the Unicode `Sentence_Terminal` property (plus three
  Khmer signs the reference lists), for FineWeb's line-punctuation rule.

Languages without spaces (zh, ja, th) would need a segmenter; the language filter runs first
and the default config keeps English only.
"""
from __future__ import annotations

import array
import re
import string
import sys
import unicodedata
from contextlib import contextmanager
from functools import lru_cache

import regex

_MAX_LEXEMES = 500_000  # ~125 MB of vocabulary and cache per process


def _sentence_terminals() -> frozenset[str]:
    sterm = regex.compile(r"\p{Sentence_Terminal}")
    # every code point in one string, matched in one call (a Python loop over them: 0.5 s of start-up)
    every = array.array("I", range(sys.maxunicode + 1)).tobytes().decode("utf-32-le", "surrogatepass")
    chars = set(sterm.findall(every))
    return frozenset(chars | {"\u17d6", "\u17d9", "\u17da"})


TERMINAL_PUNCTUATION = _sentence_terminals()
_SYMBOL_CHARS = frozenset(
    string.punctuation
    + "«´»–—’“”„…∶━►、。〈〉《》「」【】！％（），．１：；？～"
    + "".join(chr(c) for c in (*range(0, 9), *range(11, 32), *range(127, 160)))
) | TERMINAL_PUNCTUATION


@contextmanager
def _torch_hidden():
    """`import torch` fails inside (thinc then runs without it), unless torch is already loaded."""
    if "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # type: ignore[assignment]  # None in sys.modules: ImportError
    try:
        yield
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]


class _Straddle:
    """Which neighbouring chunks could form a special-case match across the space between them.

    spaCy's matcher looks for the special cases that contain affix characters, each as its
    pattern: the tokens it splits into without special cases. A straddling match needs the last
    matcher-stage token of one chunk and the first of the next to be consecutive in a pattern
    (`pairs`). The matcher-stage token at a chunk's end is its last word, or, where the matcher
    rewrote the end, the last pattern token of a special case the chunk ends with (`ends` lists
    both, kept to those that occur in a pair; likewise at the start). Such a match only matters
    where it overlaps a match inside one of the two chunks, which needs a special case in it."""

    def __init__(self, nlp, tok):
        from spacy.tokenizer import Tokenizer

        plain = Tokenizer(nlp.vocab, rules={}, prefix_search=tok.prefix_search, suffix_search=tok.suffix_search,
                          infix_finditer=tok.infix_finditer, token_match=tok.token_match, url_match=tok.url_match)
        self.patterns: dict[str, list[str]] = {}
        for special in tok.rules:
            if tok.find_prefix(special) or tok.find_infix(special) or tok.find_suffix(special) or " " in special:
                self.patterns[special] = [t.text for t in plain(special)]
        self.pairs = frozenset(p for pattern in self.patterns.values() for p in zip(pattern, pattern[1:]))
        self.lefts = frozenset(x for x, _ in self.pairs)
        self.rights = frozenset(y for _, y in self.pairs)
        self.specials = tuple(self.patterns)
        self._any_special = re.compile("|".join(re.escape(s) for s in sorted(self.specials, key=len, reverse=True)))

    def ends(self, chunk: str, words: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
        last, first = {words[-1]}, {words[0]}
        if chunk.endswith(self.specials):
            last.update(p[-1] for s, p in self.patterns.items() if chunk.endswith(s))
        if chunk.startswith(self.specials):
            first.update(p[0] for s, p in self.patterns.items() if chunk.startswith(s))
        return tuple(last & self.lefts), tuple(first & self.rights)

    def holds_special(self, chunk: str) -> bool:
        return self._any_special.search(chunk) is not None


class _English:
    """spaCy's English tokenizer (replaced by a fresh one past `_MAX_LEXEMES`, see `_english`)."""

    def __init__(self):
        with _torch_hidden():
            import spacy
        from spacy.pipeline import Sentencizer

        self.nlp = spacy.blank("en")
        # lexical attributes (shape, like_num, ...) are computed for every new lexeme and never
        # used here; tokenization does not depend on them
        self.nlp.vocab.lex_attr_getters = {}
        self.tokenizer = self.nlp.tokenizer
        self.sentence_punct = frozenset(Sentencizer.default_punct_chars)
        self.straddle = _Straddle(self.nlp, self.tokenizer)
        # new chunks go through spaCy together, joined by _SEP (`_chunk_entries`): a whitespace run
        # is a token of its own and no special case (hence no matcher pattern) holds it
        self.joins_chunks = not any(_SEP in rule for rule in self.tokenizer.rules)
        self.special_cases = frozenset(self.tokenizer.rules)

    def is_plain_word(self, chunk: str) -> bool:
        """Whether spaCy gives `chunk` back as its one token without looking: ASCII letters only
        and not a special case ("cannot", "gonna"). Every English prefix, suffix and infix rule
        consumes a character that is not a letter (punctuation, a symbol, a digit, "'s", "US$";
        the rules that mention letters only look behind or ahead at them), and a URL or token
        match keeps the chunk whole anyway."""
        return chunk.isascii() and chunk.isalpha() and chunk not in self.special_cases

    def tokens(self, text: str) -> list[str]:
        """All tokens, whitespace tokens included (as the sentencizer sees them)."""
        return [t.text for t in self.tokenizer(text)]


_ENGLISH: _English | None = None


def load_tokenizer() -> None:
    """Build spaCy's English tokenizer now (~0.5 s: spaCy's import and its rules), e.g. in a worker
    warming up before its first job, instead of at the first `words` call."""
    _english()


def tokenizer_loaded() -> bool:
    return _ENGLISH is not None


def _english() -> _English:
    global _ENGLISH
    if _ENGLISH is None or len(_ENGLISH.nlp.vocab) > _MAX_LEXEMES:
        _ENGLISH = _English()
    return _ENGLISH


# Words per whitespace-separated chunk, cached. spaCy tokenizes each maximal run of non-space
# characters (str.split's chunks: the same isspace test) on its own, then re-applies its special
# cases with a phrase matcher over the whole document. A match that straddles a space changes
# nothing itself (no rule has that text) but can hide an overlapping match inside a chunk ("' ''I"
# keeps "'", "'" where "''I" alone gives "''"). So a text's words are its chunks' words laid end
# to end, except where neighbouring chunks could form a straddling match (`_Straddle`): each run
# of such chunks that holds a special case is tokenized joined by spaces (the most straddling
# matches; fewer can hide no more) and, if that differs, the whole text goes through spaCy as
# before. A dict lookup per chunk replaces spaCy's Doc and a Token object per token (~75 % of
# Gopher repetition's time).
_CHUNK_WORDS: dict[str, tuple] = {}  # chunk -> (words, last / first matcher tokens)
_MAX_CHUNKS = 1_000_000  # ~330 B an entry of a short chunk: ~330 MB per process at most; cleared past it
_CACHED_CHUNK_CHARS = 64  # longer chunks (URLs, base64, minified code) rarely repeat: tokenized, not kept


_SEP = "\n\n"  # between the new chunks of a text tokenized in one call


def _chunk_entry(chunk: str, keep: bool = True) -> tuple:
    """`keep` False: not cached. Joined runs of chunks (`_runs_agree`) are cached like chunks (no
    chunk holds a space, so the keys never meet): a few dozen runs ("it 's", "I' ll") make ~1.3 of
    them per document of the corpus."""
    toks = tuple(t.text for t in _english().tokenizer(chunk) if not t.is_space)
    return _entry(chunk, toks, keep)


def _entry(chunk: str, toks: tuple[str, ...], keep: bool = True) -> tuple:
    entry = (toks, *_english().straddle.ends(chunk, toks))
    if keep and len(chunk) <= _CACHED_CHUNK_CHARS:
        if len(_CHUNK_WORDS) >= _MAX_CHUNKS:
            _CHUNK_WORDS.clear()
        _CHUNK_WORDS[chunk] = entry
    return entry


def _chunk_entries(chunks: list[str]) -> dict[str, tuple]:
    """`_chunk_entry` of each of `chunks` (distinct) from one tokenizer call over them joined by
    `_SEP` (spaCy's cost per call, a Doc, is ~30 % of a new chunk's): between two separators lie
    one chunk's tokens, as it alone gives them, since no special case can match across a separator."""
    eng = _english()
    plain = {chunk: _entry(chunk, (chunk,)) for chunk in chunks if eng.is_plain_word(chunk)}
    if plain:  # most new chunks of English text: no tokenizer call (~20 us each) needed
        chunks = [chunk for chunk in chunks if chunk not in plain]
        return {**plain, **_chunk_entries(chunks)} if chunks else plain
    if len(chunks) == 1 or not eng.joins_chunks:
        return {chunk: _chunk_entry(chunk) for chunk in chunks}
    per_chunk, toks = [], []
    for tok in eng.tokenizer(_SEP.join(chunks)):
        t = tok.text
        if t == _SEP:
            per_chunk.append(tuple(toks))
            toks = []
        else:
            toks.append(t)
    per_chunk.append(tuple(toks))
    if len(per_chunk) != len(chunks):  # a separator not a token of its own: one call per chunk
        return {chunk: _chunk_entry(chunk) for chunk in chunks}
    return {chunk: _entry(chunk, t) for chunk, t in zip(chunks, per_chunk)}


def _runs_agree(chunks: list[str], entries: list[tuple], joined: list[int]) -> bool:
    """Each run of chunks joined by a possible straddling match (`joined`: i where chunks i-1, i
    could be) that holds a special case, tokenized as one text, gives its chunks' words."""
    start = 0
    for k, i in enumerate(joined):
        if k + 1 < len(joined) and joined[k + 1] == i + 1:
            continue  # the run goes on
        first = joined[start] - 1
        start = k + 1
        run = entries[first:i + 1]
        if not any(map(_english().straddle.holds_special, chunks[first:i + 1])):
            continue
        text = " ".join(chunks[first:i + 1])
        if (_CHUNK_WORDS.get(text) or _chunk_entry(text))[0] != tuple(w for e in run for w in e[0]):
            return False
    return True


@lru_cache(maxsize=4)
def _words(text: str) -> tuple[str, ...]:
    get = _CHUNK_WORDS.get
    chunks = text.split()
    missed: list[str] = []
    miss = missed.append  # returns None: the chunk's entry is filled in below
    entries = [get(chunk) or miss(chunk) for chunk in chunks]
    if missed:
        new = _chunk_entries(list(dict.fromkeys(missed)))
        entries = [entry or new[chunk] for entry, chunk in zip(entries, chunks)]
    pairs = _english().straddle.pairs
    joined = [i for i in range(1, len(entries)) if entries[i - 1][1] and entries[i][2]
              and any((x, y) in pairs for x in entries[i - 1][1] for y in entries[i][2])]
    if joined and not _runs_agree(chunks, entries, joined):
        return tuple(w for w in (t.strip() for t in _english().tokens(text)) if w)
    return tuple(w for entry in entries for w in entry[0])


def words(text: str) -> list[str]:
    """Word tokens of `text` (the last few texts are cached: consecutive filters share them)."""
    return list(_words(text))


@lru_cache(maxsize=4096)
def _is_punct_token(tok: str) -> bool:
    """spaCy's `is_punct` lexical attribute: every character in a Unicode P* category."""
    return all(unicodedata.category(ch).startswith("P") for ch in tok)


def _sentence_starts(toks: list[str], punct: frozenset[str]) -> list[int]:
    if not toks:
        return []
    starts, seen_period = [0], False
    for i, tok in enumerate(toks):
        in_punct = tok in punct
        if seen_period and not in_punct and not _is_punct_token(tok):
            starts.append(i)
            seen_period = False
        elif in_punct:
            seen_period = True
    return starts


def sentences(text: str) -> list[str]:
    """The sentences spaCy's sentencizer makes of `text`, stripped, empty ones left out."""
    eng = _english()
    toks = eng.tokens(text)
    offsets, cursor = [], 0
    for tok in toks:  # tokens are substrings of the text, in order
        cursor = text.find(tok, cursor)
        offsets.append(cursor)
        cursor += len(tok)
    bounds = [offsets[i] for i in _sentence_starts(toks, eng.sentence_punct)] + [len(text)]
    return [p for p in (text[a:b].strip() for a, b in zip(bounds, bounds[1:])) if p]


def count_sentences(text: str) -> int:
    """Number of sentences spaCy's sentencizer makes of `text` (what C4's rule counts)."""
    eng = _english()
    return len(_sentence_starts(eng.tokens(text), eng.sentence_punct))


_SYMBOL_STR = "".join(sorted(_SYMBOL_CHARS))


def is_symbol_word(word: str) -> bool:
    return not word.strip(_SYMBOL_STR)  # every character is one of the symbols
