"""Word tokenisation, sentence splitting and punctuation for the heuristic filters.

The reference definitions (datatrove's Gopher/C4/FineWeb filters, as used for FineWeb) count
words with NLTK's Treebank `word_tokenize` and sentences with NLTK's Punkt model. NLTK is not a
dependency here and Punkt needs a data download, so we use regex equivalents that need nothing:

* `words(text)`: Treebank-like, applied per sentence (as NLTK's `word_tokenize` does after
  Punkt): these are split off as tokens of their own: `;@#$%&?!*`, brackets `()[]{}<>`, double
  quotes and backticks, `«»“”„`, "--", "...", a comma or colon not followed by a digit
  ("3,000" and "10:30" stay whole), the period that ends a sentence, and the clitics "'s",
  "'m", "'d", "'ll", "'re", "'ve", "n't" and a word-final "'" ("don't" → "do", "n't"). Every
  other character stays inside its whitespace-delimited token, so "/etc/hosts", "a=b",
  "well-known", "e.g." and "3.14" are one token each, as with Treebank.
  Deviations from NLTK: double quotes are not rewritten to `` and '', "cannot"/"gonna" style
  splits are not done, and sentence boundaries come from `sentences` below instead of Punkt, so
  a few periods inside a line are split differently. These change word counts by well under
  1% on ordinary prose.
* `sentences(text)`: a sentence ends at ".", "!", "?" or "…" (optionally followed by closing
  quotes/brackets) followed by whitespace, unless the word before the period is a single
  letter, a run of single letters and periods ("p.m.", "U.S.") or a common abbreviation
  (etc., mr., dr., vs., ...). Punkt also learns
  abbreviations from data; ours is a fixed list.
* `is_symbol_word(w)`: every character is punctuation, a symbol or a control character (Unicode
  categories P*, S*, C*); datatrove uses a hand-written punctuation set, nearly the same.
  Languages without spaces (zh, ja, th) would need a segmenter; the language filter runs first
  and the default config keeps English only.
"""
from __future__ import annotations

import unicodedata
from functools import lru_cache

import regex

_SPLIT_ALWAYS = regex.compile(r"""([;@#$%&?!*()\[\]{}<>"`«»“”„]|--|\.\.\.)""")
_COMMA_COLON = regex.compile(r"([,:])(?!\d)")
_FINAL_PERIOD = regex.compile(r"(?<!\.)\.([\]\)}>\"'»”’]*)\s*$")
_CLITICS = regex.compile(r"(?i)(?<=[^'’\s])('s|'m|'d|'ll|'re|'ve|n't|’s|’m|’d|’ll|’re|’ve|n’t|'|’)(?=\s|$)")

_ABBREVIATIONS = frozenset(
    "e.g i.e etc mr mrs ms dr prof st vs cf al fig no nos vol pp ed eds jr sr inc ltd co corp approx "
    "dept est jan feb mar apr jun jul aug sep sept oct nov dec".split()
)
_SENT_END = regex.compile(r"(?:\.\.\.|[.!?…]+)[\"'”’)\]]*(?=\s+\S)")
_LAST_WORD = regex.compile(r"([\p{L}\p{N}.]+)$")
_INITIALS = regex.compile(r"^(?:\p{L}\.)+\p{L}$")  # "p.m", "u.s.a": letter-period runs


def _sentence_words(sent: str) -> list[str]:
    sent = _FINAL_PERIOD.sub(r" . \1", sent)
    sent = _SPLIT_ALWAYS.sub(r" \1 ", sent)
    sent = _COMMA_COLON.sub(r" \1 ", sent)
    sent = _CLITICS.sub(r" \1", sent)
    return sent.split()


@lru_cache(maxsize=4)
def _words(text: str) -> tuple[str, ...]:
    return tuple(w for sent in sentences(text) for w in _sentence_words(sent))


def words(text: str) -> list[str]:
    """Word tokens of `text` (the last few texts are cached: consecutive filters share them)."""
    return list(_words(text))


@lru_cache(maxsize=4096)
def _is_symbol_char(ch: str) -> bool:
    return unicodedata.category(ch)[0] in "PSC"


def is_symbol_word(word: str) -> bool:
    return all(_is_symbol_char(c) for c in word)


def sentences(text: str) -> list[str]:
    out: list[str] = []
    start = 0
    for m in _SENT_END.finditer(text):
        if text[m.start()] == ".":
            w = _LAST_WORD.search(text, start, m.start())
            if w:
                word = w.group(1).lower().rstrip(".")
                if len(word) == 1 and word.isalpha() or word in _ABBREVIATIONS or _INITIALS.match(word):
                    continue
        piece = text[start:m.end()].strip()
        if piece:
            out.append(piece)
        start = m.end()
    tail = text[start:].strip()
    if tail:
        out.append(tail)
    return out
