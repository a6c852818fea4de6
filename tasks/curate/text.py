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

    def tokens(self, text: str) -> list[str]:
        """All tokens, whitespace tokens included (as the sentencizer sees them)."""
        return [t.text for t in self.tokenizer(text)]


_ENGLISH: _English | None = None


def _english() -> _English:
    global _ENGLISH
    if _ENGLISH is None or len(_ENGLISH.nlp.vocab) > _MAX_LEXEMES:
        _ENGLISH = _English()
    return _ENGLISH


@lru_cache(maxsize=4)
def _words(text: str) -> tuple[str, ...]:
    return tuple(w for w in (t.strip() for t in _english().tokens(text)) if w)


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
