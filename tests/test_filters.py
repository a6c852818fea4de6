"""Heuristic filters and language id: one crafted document per rule, plus a good document.

For every rule: the crafted document is dropped with exactly that reason, and with only that
rule switched off it is not dropped for that reason any more. Where the rule can be isolated
(all Gopher quality, C4 and FineWeb rules, some repetition rules) the document then passes the
whole filter.
"""
from __future__ import annotations

import pytest

from tasks.config import C4Config, CurateConfig, FineWebConfig, GopherQualityConfig, GopherRepetitionConfig, LangIdConfig
from tasks.core.steps import StepStats, run_filters
from tasks.curate.filters import (C4QualityFilter, FineWebQualityFilter, GopherQualityFilter, GopherRepetitionFilter,
                                  build_filters, duplicated_ngram_chars, top_ngram_chars)
from tasks.curate.langid import LangIdFilter, load_lid_model
from tasks.curate.text import count_sentences, is_symbol_word, sentences, words

GOOD_LINES = [
    "The Debian project was founded in 1993 by Ian Murdock, who wanted a distribution built in the open.",
    "Volunteers from many countries maintain thousands of packages and review each change with care.",
    "A stable release is published roughly every two years, and security updates follow it for a long time.",
    "Users can choose between several desktop environments, or install a minimal system for servers.",
    "The package manager resolves dependencies automatically and keeps track of every installed file.",
    "Documentation is written by the community and translated into more than twenty languages.",
    "Developers discuss technical decisions on public mailing lists that anyone is free to read.",
    "Many other distributions, including Ubuntu, are based on the work that Debian maintainers publish.",
    "The social contract describes the values of the project and its commitment to free software.",
    "Bug reports are tracked in a public database so that problems can be followed until they are fixed.",
    "New contributors often start by packaging a small program or by improving existing documentation.",
    "Installation media are available for several processor architectures, from small boards to large servers.",
]
GOOD = "\n".join(GOOD_LINES)


def doc(text: str) -> dict:
    return {"id": "d", "text": text}


def check_rule(make_filter, cfg, text: str, expected: str, off: dict, isolated: bool = True) -> None:
    assert make_filter(cfg).decide(doc(text)) == expected
    relaxed = make_filter(cfg.model_copy(update=off)).decide(doc(text))
    assert relaxed != expected
    if isolated:
        assert relaxed is None, relaxed


# ------------------------------------------------------------------ tokenisation

def test_words_follow_spacy_english_rules():
    """Words are spaCy's English tokens (as datatrove splits English): clitics and hyphens split,
    URLs, numbers and abbreviations whole, whitespace tokens dropped."""
    toks = words("Don't split https://example.org/a?b=1 or 3,000 items, e.g. well-known  ones (really)! The end.")
    assert toks == ["Do", "n't", "split", "https://example.org/a?b=1", "or", "3,000", "items", ",", "e.g.", "well",
                    "-", "known", "ones", "(", "really", ")", "!", "The", "end", "."]
    assert is_symbol_word("...") and is_symbol_word("—") and is_symbol_word("«") and not is_symbol_word("a.")
    assert not is_symbol_word("°")  # not in the reference's punctuation set


def _spacy_words(text: str) -> list[str]:
    """The reference: the whole text through spaCy's tokenizer, whitespace tokens dropped."""
    from tasks.curate.text import _english

    return [w for w in (t.text.strip() for t in _english().tokenizer(text)) if w]


def test_words_per_chunk_match_the_whole_text(monkeypatch):
    """`words` tokenizes each whitespace-separated chunk once and reuses it; where spaCy's
    special-case matcher could straddle a space and hide a match inside a chunk ("' ''I'" keeps
    "'", "'", while the chunk alone gives "''") it checks the run of chunks, and on a difference
    tokenizes the whole text: always spaCy's words of the whole text."""
    from tasks.curate import text as T

    whole = []
    monkeypatch.setattr(T._english(), "tokens", lambda t, f=T._english().tokens: whole.append(t) or f(t))
    plain = "Don't split e.g. well-known words , he said : it 's (really) fine ; Dr. Who ' s 10 a.m. "
    tricky = "Had not I reason to cry now , Carlo ? ' ''I' ll go this minute"
    assert _spacy_words(tricky).count("'") > T._chunk_entry("''I'")[0].count("'")  # context matters here
    whole.clear()
    T._words.cache_clear()
    for text in (plain * 3, tricky, plain + "\n" + tricky + "  " + plain):
        assert words(text) == _spacy_words(text), text
    assert whole[:2] == [tricky, plain + "\n" + tricky + "  " + plain]  # only the tricky texts went through whole
    assert T._CHUNK_WORDS["it"][0] == ("it",) and T._CHUNK_WORDS["well-known"][0] == ("well", "-", "known")
    # a long chunk (a URL, base64) is tokenized but not kept: the cache's memory is bounded per entry
    blob = "https://example.org/" + "aB3/" * 40 + "?q=1,2"
    assert words(f"see {blob} now") == _spacy_words(f"see {blob} now")
    assert blob not in T._CHUNK_WORDS and "see" in T._CHUNK_WORDS
    rng = __import__("random").Random(0)
    pieces = list(T._english().straddle.specials) + ["''I'", "word", "I", "Dr.", "'s", ":", "-", ")", "("]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) + rng.choice([" ", "", " ", "\n", "  "]) for _ in range(rng.randint(1, 10)))
        assert words(text) == _spacy_words(text), text


def test_new_chunks_of_a_text_go_through_spacy_in_one_call(monkeypatch):
    """The chunks of a text that are not cached yet are tokenized in one spaCy call (joined by a
    separator no special case holds), each with the words it gives alone."""
    from tasks.curate import text as T

    text = "Don't split e.g. well-known words, he said: it's (really) fine; 3,000 items at https://example.org/a?b=1"
    reference = _spacy_words(text)
    T._CHUNK_WORDS.clear()
    T._words.cache_clear()
    eng, calls = T._english(), []
    monkeypatch.setattr(eng, "tokenizer", lambda t, f=eng.tokenizer: calls.append(t) or f(t))
    assert words(text) == reference
    assert len(calls) == 1 and eng.joins_chunks
    monkeypatch.undo()
    for chunk in text.split():
        assert T._CHUNK_WORDS[chunk] == T._chunk_entry(chunk, keep=False), chunk


def test_runs_that_could_straddle_are_checked_once(monkeypatch):
    """A run of chunks a special case could straddle ("it 's") is tokenized once, then cached like a
    chunk: the next text holding it sends only its new chunks to spaCy."""
    from tasks.curate import text as T

    later = "and it 's late, (really)"
    reference = _spacy_words(later)
    T._CHUNK_WORDS.clear()
    T._words.cache_clear()
    assert words("so it 's fine") == _spacy_words("so it 's fine")
    assert "it 's" in T._CHUNK_WORDS
    eng, calls = T._english(), []
    monkeypatch.setattr(eng, "tokenizer", lambda t, f=eng.tokenizer: calls.append(t) or f(t))
    assert words(later) == reference
    assert calls == [T._SEP.join(["late,", "(really)"])]  # "and": a plain word, no tokenizer call


def test_plain_words_skip_spacy_with_its_tokens(monkeypatch):
    """A new chunk of ASCII letters that is no special case ("cannot", "Gonna" are) is its own one
    token without a tokenizer call (`_English.is_plain_word`); spaCy agrees on every such chunk."""
    import string

    from tasks.curate import text as T

    eng = T._english()
    letters = string.ascii_letters
    samples = [a + b for a in letters for b in letters] + ["Supercalifragilistic", "ABCdef"]
    samples += [v for rule in eng.special_cases for v in (rule, rule.lower(), rule.upper(), rule.capitalize())]
    for chunk in samples:
        if eng.is_plain_word(chunk):
            assert [t.text for t in eng.tokenizer(chunk)] == [chunk], chunk
    assert not eng.is_plain_word("cannot") and not eng.is_plain_word("Gonna") and not eng.is_plain_word("naïve")
    text = "plainly worded prose cannot hide, gonna say: Yes"
    reference = _spacy_words(text)
    T._CHUNK_WORDS.clear()
    T._words.cache_clear()
    calls = []
    monkeypatch.setattr(eng, "tokenizer", lambda t, f=eng.tokenizer: calls.append(t) or f(t))
    assert words(text) == reference
    assert calls == [T._SEP.join(["cannot", "hide,", "gonna", "say:"])]


def test_sentences_follow_the_sentencizer():
    """A sentence ends after . ! ? (and other sentence punctuation) once a non-punctuation token
    follows; abbreviations spaCy keeps whole (Dr., p.m., e.g.) do not end one."""
    s = sentences("Mr. Smith met Dr. Jones at 3.30 p.m. today. They talked, e.g. about Debian! Then left.")
    assert s == ["Mr. Smith met Dr. Jones at 3.30 p.m. today.", "They talked, e.g. about Debian!", "Then left."]
    # "..." is one token, not in the sentencizer's list: no boundary after it
    assert sentences('He said "stop." Then... nothing?! Ok') == ['He said "stop."', "Then... nothing?!", "Ok"]
    assert count_sentences("one two three") == 1 and count_sentences("") == 0


def test_good_document_passes_every_filter():
    filters = build_filters(CurateConfig())
    assert [f.name for f in filters] == ["langid", "gopher_repetition", "gopher_quality", "c4", "fineweb"]
    d = doc(GOOD)
    for f in filters:
        assert f.decide(d) is None, f.name
    assert d["language"] == "en" and d["language_score"] >= 0.65
    assert d["text"] == GOOD  # C4 keeps every line of a clean document


# ------------------------------------------------------------------ Gopher quality

GQ = GopherQualityConfig()


def test_gopher_quality_short_doc():
    check_rule(GopherQualityFilter, GQ, "The cat sat on the mat, and that was the end of the story.",
               "gopher_quality:gopher_short_doc", {"min_doc_words": 0})


def test_gopher_quality_long_doc():
    check_rule(GopherQualityFilter, GQ.model_copy(update={"max_doc_words": 100}), GOOD,
               "gopher_quality:gopher_long_doc", {"max_doc_words": 0})


def test_gopher_quality_below_avg_word_length():
    text = " ".join(["I am so to be at it on my way up to the big bus and go by car if we do."] * 5)
    check_rule(GopherQualityFilter, GQ, text, "gopher_quality:gopher_below_avg_threshold",
               {"min_avg_word_length": 0})


def test_gopher_quality_above_avg_word_length():
    long_words = ("internationalization telecommunications characterization responsibilities "
                  "misunderstandings institutionalization electroencephalography ").split()
    text = " ".join(long_words * 9) + " the and with."
    check_rule(GopherQualityFilter, GQ, text, "gopher_quality:gopher_above_avg_threshold",
               {"max_avg_word_length": 0})


def test_gopher_quality_too_many_hashes():
    tags = " ".join(f"#topic{i}" for i in range(30))
    check_rule(GopherQualityFilter, GQ, GOOD + "\n" + tags, "gopher_quality:gopher_too_many_hashes",
               {"max_symbol_word_ratio": 0})


def test_gopher_quality_too_many_ellipsis():
    # 24 words followed by "…" (each "…" is a token of its own: more than 10 % of the words)
    text = " ".join(f"{w}…" for w in GOOD.split()[:24]) + " " + " ".join(GOOD.split()[24:])
    check_rule(GopherQualityFilter, GQ, text, "gopher_quality:gopher_too_many_ellipsis",
               {"max_symbol_word_ratio": 0})


def test_gopher_quality_too_many_bullets():
    text = "\n".join("- " + line for line in GOOD_LINES)
    check_rule(GopherQualityFilter, GQ, text, "gopher_quality:gopher_too_many_bullets",
               {"max_bullet_lines_ratio": 0})


def test_gopher_quality_too_many_end_ellipsis():
    lines = [line[:-1] + "..." if i % 2 else line for i, line in enumerate(GOOD_LINES)]
    check_rule(GopherQualityFilter, GQ, "\n".join(lines), "gopher_quality:gopher_too_many_end_ellipsis",
               {"max_ellipsis_lines_ratio": 0})


def test_gopher_quality_below_alpha_threshold():
    numbers = " ".join(str(1000 + 7 * i) for i in range(60))
    check_rule(GopherQualityFilter, GQ, GOOD + "\n" + numbers, "gopher_quality:gopher_below_alpha_threshold",
               {"max_non_alpha_words_ratio": 0})


def test_gopher_quality_alpha_words_as_the_paper_counts_them():
    """datatrove counts punctuation marks as words without a letter, so heavily punctuated prose
    falls below 0.8; with alpha_words=whitespace (the Gopher paper's words) it passes, while a
    page of numbers is still dropped either way."""
    clause = "Grml, the live CD, has tools: to install, deploy, rescue (32-bit, 64-bit), and more; "
    prose = " ".join([clause] * 8)
    from tasks.curate.text import words

    tokens = words(prose)
    assert sum(any(c.isalpha() for c in w) for w in tokens) / len(tokens) < 0.8  # punctuation counted
    check_rule(GopherQualityFilter, GQ, prose, "gopher_quality:gopher_below_alpha_threshold",
               {"alpha_words": "whitespace"})
    numbers = " ".join(str(1000 + 7 * i) for i in range(60))
    ws = GQ.model_copy(update={"alpha_words": "whitespace"})
    assert GopherQualityFilter(ws).decide(doc(GOOD + "\n" + numbers)) == "gopher_quality:gopher_below_alpha_threshold"


def test_gopher_quality_stop_words():
    text = " ".join(["Bright orange kites float above green hills while children run laughing."] * 6)
    check_rule(GopherQualityFilter, GQ, text, "gopher_quality:gopher_enough_stop_words", {"min_stop_words": 0})


# ------------------------------------------------------------------ Gopher repetition

GR = GopherRepetitionConfig()


def test_repetition_helpers():
    toks = "a b a b a b c".split()
    assert top_ngram_chars(toks, 2) == len("a b") * 3
    # n-grams are concatenated: "ab" seen at 0, "ba" at 1, "ab" again at 2 → counted, jump to 4
    assert duplicated_ngram_chars(toks, 2) == 2 + 2
    assert top_ngram_chars(["x"], 2) == 0


def _top_ngram_reference(toks: list[str], n: int) -> int:
    from collections import Counter

    grams = [" ".join(toks[i:i + n]) for i in range(len(toks) - n + 1)]
    if not grams:
        return 0
    gram, count = Counter(grams).most_common(1)[0]
    return len(gram) * count


def _duplicated_ngram_reference(toks: list[str], n: int) -> int:
    grams = ["".join(toks[i:i + n]) for i in range(len(toks) - n + 1)]
    seen, chars, i = set(), 0, 0
    while i < len(grams):
        if grams[i] in seen:
            chars += len(grams[i])
            i += n
        else:
            seen.add(grams[i])
            i += 1
    return chars


@pytest.mark.parametrize("collide", [False, True])
def test_repetition_counts_by_hash_match_the_strings(monkeypatch, collide):
    """The n-gram rules count by hash but confirm with the strings: the same figures as counting
    the strings, on token lists whose concatenations coincide ("ab"+"c" = "a"+"bc"), and also
    when every n-gram hashes alike (a forced collision)."""
    import random

    from tasks.curate import filters as F

    if collide:
        real = F._Joined.grams
        monkeypatch.setattr(F._Joined, "grams", lambda self, n, spaced: (0 * real(self, n, spaced)[0],
                                                                          *real(self, n, spaced)[1:]))
    rng = random.Random(3)
    vocab = ["a", "b", "ab", "ba", "c", "bc", "abc", "é", "x"]
    for _ in range(1500):
        toks = [rng.choice(vocab[:rng.randint(1, len(vocab))]) for _ in range(rng.randint(0, 30))]
        for n in range(1, 8):
            assert top_ngram_chars(toks, n) == _top_ngram_reference(toks, n), (toks, n)
            assert duplicated_ngram_chars(toks, n) == _duplicated_ngram_reference(toks, n), (toks, n)


def test_repetition_counts_group_hashes_by_a_plain_sort(monkeypatch):
    """The n-gram rules group hashes with one plain sort (`_sorted_runs`, positions found back by
    lookup), never an argsort (stable: ~5x the cost) nor np.unique's extra passes."""
    import numpy as np

    def refused(*a, **k):
        raise AssertionError("np.unique / np.argsort called")
    monkeypatch.setattr(np, "unique", refused)
    monkeypatch.setattr(np, "argsort", refused)
    toks = "the cat sat on the mat and the cat sat on the hat".split()
    assert top_ngram_chars(toks, 2) == _top_ngram_reference(toks, 2) == len("the cat") * 2
    assert duplicated_ngram_chars(toks, 3) == _duplicated_ngram_reference(toks, 3) > 0
    assert duplicated_ngram_chars(toks[:7], 5) == 0


def _repetition_reference(text: str, cfg) -> str | None:
    """Gopher repetition's decision from the string definitions (datatrove's order and rules)."""
    import re

    from tasks.curate.filters import duplicates
    from tasks.curate.text import words

    if not text:
        return "gopher_repetition:empty"
    for parts, frac, char_frac, name in ((re.split(r"\n{2,}", text.strip()), cfg.dup_para_frac,
                                          cfg.dup_para_char_frac, "para"),
                                         (re.split(r"\n+", text), cfg.dup_line_frac, cfg.dup_line_char_frac, "line")):
        n_dup, dup_chars = duplicates(parts)
        if frac and n_dup / len(parts) > frac:
            return f"gopher_repetition:dup_{name}_frac"
        if char_frac and dup_chars / len(text) > char_frac:
            return f"gopher_repetition:dup_{name}_char_frac"
    toks = words(text)
    for n, frac in sorted(cfg.top_n_grams.items()):
        if frac and _top_ngram_reference(toks, n) / len(text) > frac:
            return f"gopher_repetition:top_{n}_gram"
    for n, frac in sorted(cfg.dup_n_grams.items()):
        if frac and _duplicated_ngram_reference(toks, n) / len(text) > frac:
            return f"gopher_repetition:duplicated_{n}_n_grams"
    return None


def test_repetition_values_and_decisions_match_the_strings_on_varied_texts():
    """On real prose, prose with repeated passages, short texts, unicode and punctuation-heavy
    texts, every n's figure and the filter's decision equal the string definitions'; the texts
    reach several different decisions, so a wrong figure would show."""
    import random

    from tasks.curate.text import words

    rng = random.Random(7)
    base = (GOOD + " Ça coûte 5 € — naïve façade, 東京 タワー. Don't stop! (Really?) 'Quoted' ... ok\n"
            + "Ελληνικά κείμενα; русский текст. emoji 🙂🙂 ok").split()
    texts, decisions = ["", "a", "a b", "é é é", "🙂 🙂 🙂 🙂", "x\n\nx"], set()
    for _ in range(160):
        toks = base[rng.randrange(len(base)):][:rng.randint(1, 400)]
        for _ in range(rng.randint(0, 3)):  # repeat a passage in place
            a = rng.randrange(len(toks))
            toks[a:a] = toks[a:a + rng.randint(1, 40)] * rng.randint(1, 4)
        seps = [rng.choice([" ", " ", " ", "\n", "\n\n"]) for _ in toks]
        texts.append("".join(t + s for t, s in zip(toks, seps)))
    gr = GopherRepetitionFilter(GR)
    for text in texts:
        toks = words(text)
        for n in range(1, 11):
            assert top_ngram_chars(toks, n) == _top_ngram_reference(toks, n), (text, n)
            assert duplicated_ngram_chars(toks, n) == _duplicated_ngram_reference(toks, n), (text, n)
        decision = gr.decide({"text": text})
        assert decision == _repetition_reference(text, GR), text
        decisions.add(decision)
    assert len(decisions) >= 4, decisions


def test_gopher_repetition_dup_para_frac():
    text = "\n\n".join([GOOD_LINES[0], "Yes.", GOOD_LINES[1], "Yes.", GOOD_LINES[2], "Yes."])
    check_rule(GopherRepetitionFilter, GR, text, "gopher_repetition:dup_para_frac", {"dup_para_frac": 0},
               isolated=False)


def test_gopher_repetition_dup_para_char_frac():
    # 2 repeated paragraphs out of 8 (under dup_para_frac 0.3) but a quarter of the characters
    text = "\n\n".join(GOOD_LINES[:6] + [GOOD_LINES[0], GOOD_LINES[1]])
    check_rule(GopherRepetitionFilter, GR, text, "gopher_repetition:dup_para_char_frac",
               {"dup_para_char_frac": 0}, isolated=False)


def test_gopher_repetition_dup_line_frac():
    lines = []
    for line in GOOD_LINES[:6]:
        lines += [line, "Yes."]
    check_rule(GopherRepetitionFilter, GR, "\n".join(lines), "gopher_repetition:dup_line_frac",
               {"dup_line_frac": 0}, isolated=True)


def test_gopher_repetition_dup_line_char_frac():
    text = "\n".join(GOOD_LINES[:8] + [GOOD_LINES[0], GOOD_LINES[1], GOOD_LINES[2]])
    check_rule(GopherRepetitionFilter, GR, text, "gopher_repetition:dup_line_char_frac",
               {"dup_line_char_frac": 0}, isolated=False)


BODY = [w.strip(".,").lower() for w in " ".join(GOOD_LINES).split()]


def repeated_prefix_text(prefix: str, fillers_per_unit: int, units: int = 40) -> str:
    """`units` chunks of the same short prefix followed by distinct filler words."""
    m = fillers_per_unit
    return " ".join(f"{prefix} " + " ".join(BODY[i * m:(i + 1) * m]) for i in range(units)) + "."


@pytest.mark.parametrize("n,prefix,fillers", [(2, "a b", 1), (3, "a b c", 2), (4, "a b c d", 4)])
def test_gopher_repetition_top_n_gram(n, prefix, fillers):
    text = repeated_prefix_text(prefix, fillers)
    others = {k: v for k, v in GR.top_n_grams.items() if k != n}
    check_rule(GopherRepetitionFilter, GR, text, f"gopher_repetition:top_{n}_gram", {"top_n_grams": others},
               isolated=False)


@pytest.mark.parametrize("n", [5, 6, 7, 8, 9, 10])
def test_gopher_repetition_duplicated_n_grams(n):
    # a repeated run of exactly n words (inside otherwise unique text) is the only repetition
    run = "alpha bravo charlie delta echo foxtrot golf hotel india juliet".split()[:n]
    body = [w.strip(".,").lower() for w in " ".join(GOOD_LINES).split()]
    pieces = []
    for i in range(0, 96, 8):
        pieces += body[i:i + 8] + run
    text = " ".join(pieces) + "."
    cfg = GR.model_copy(update={"top_n_grams": {}, "dup_n_grams": {n: GR.dup_n_grams[n]}})
    check_rule(GopherRepetitionFilter, cfg, text, f"gopher_repetition:duplicated_{n}_n_grams",
               {"dup_n_grams": {}}, isolated=True)


def test_gopher_repetition_good_document_passes():
    assert GopherRepetitionFilter(GR).decide(doc(GOOD)) is None


# ------------------------------------------------------------------ C4

C4 = C4Config()


def test_c4_lorem_ipsum():
    check_rule(C4QualityFilter, C4, GOOD + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit.",
               "c4:lorem_ipsum", {"filter_lorem_ipsum": False})


def test_c4_curly_bracket():
    check_rule(C4QualityFilter, C4, GOOD + "\nWrite the mapping as {key: value} in your configuration file.",
               "c4:curly_bracket", {"filter_curly_bracket": False})


def test_c4_too_few_sentences():
    check_rule(C4QualityFilter, C4, "\n".join(GOOD_LINES[:3]), "c4:too_few_sentences", {"min_num_sentences": -1})


def test_c4_rewrites_lines():
    extra = [
        "Please enable JavaScript to view the comments powered by a service.",
        "This site uses cookies to improve your experience on every page.",
        "Too short",
        "A line with a " + "x" * 1001 + " giant token in it.",
        "Wikipedia style citations are removed from lines[1] like this one[citation needed].",
    ]
    d = doc("\n".join(GOOD_LINES + extra))
    assert C4QualityFilter(C4).decide(d) is None
    kept = d["text"].split("\n")
    assert kept[:len(GOOD_LINES)] == GOOD_LINES
    assert kept[len(GOOD_LINES):] == ["Wikipedia style citations are removed from lines like this one."]
    # terminal punctuation rule (off in FineWeb's setting) drops lines without it
    d2 = doc(GOOD + "\nA heading without a final mark")
    assert C4QualityFilter(C4.model_copy(update={"filter_no_terminal_punct": True})).decide(d2) is None
    assert d2["text"] == GOOD
    d3 = doc(GOOD + "\nA heading without a final mark")
    assert C4QualityFilter(C4).decide(d3) is None and d3["text"].endswith("final mark")


# ------------------------------------------------------------------ FineWeb

FW = FineWebConfig()


def test_fineweb_line_punct_ratio():
    text = "\n".join(line.rstrip(".") for line in GOOD_LINES)
    check_rule(FineWebQualityFilter, FW, text, "fineweb:line_punct_ratio", {"line_punct_thr": -1.0})
    assert FineWebQualityFilter(FW.model_copy(update={"line_punct_exclude_zero": True})).decide(doc(text)) is None


def test_fineweb_short_line_ratio():
    short = [f"Short line number {w}." for w in "one two three four five six seven eight nine ten".split()]
    text = "\n".join(GOOD_LINES[:3] + short)
    check_rule(FineWebQualityFilter, FW, text, "fineweb:short_line_ratio", {"short_line_thr": 1.0})


def test_fineweb_char_dup_ratio():
    text = "\n".join(GOOD_LINES + [GOOD_LINES[3]])
    check_rule(FineWebQualityFilter, FW, text, "fineweb:char_dup_ratio", {"char_duplicates_ratio": 1.01})


def test_fineweb_list_ratio():
    # two long words per line: every line is long enough and punctuated, but there is a line
    # break for every 3 tokens (> new_line_ratio 0.3)
    pairs = ["Internationalization considerations.", "Telecommunications infrastructure.",
             "Electroencephalography measurements.", "Institutionalization processes.",
             "Characterization methodologies.", "Misunderstandings everywhere.",
             "Responsibilities distributed.", "Extraordinarily complicated.",
             "Photosynthesis explanations.", "Thermodynamics lectures.",
             "Counterrevolutionary pamphlets.", "Interdisciplinary collaborations."]
    text = "\n".join(pairs)
    check_rule(FineWebQualityFilter, FW, text, "fineweb:list_ratio", {"new_line_ratio": 10.0})


# ------------------------------------------------------------------ language id

@pytest.fixture(scope="module")
def lid():
    return load_lid_model()


def test_langid_labels_and_drops(lid):
    f = LangIdFilter(LangIdConfig(), model=lid)
    en = doc(GOOD)
    assert f.decide(en) is None and en["language"] == "en" and en["language_score"] > 0.9
    de = doc("Das Netzwerk wird bei der Erstinstallation automatisch konfiguriert. Wenn der Network Manager "
             "installiert wird, ist möglicherweise keine weitere Konfiguration erforderlich.")
    assert f.decide(de) == "langid:de" and de["language"] == "de"
    strict = LangIdFilter(LangIdConfig(languages={"en": 0.99999}), model=lid)
    weak = doc("ok ok so this is it then")
    assert strict.decide(weak) == "langid:low_score" and weak["language"] == "en"
    both = LangIdFilter(LangIdConfig(languages={"en": 0.65, "de": 0.65}), model=lid)
    assert both.decide(doc(de["text"])) is None


def test_run_filters_accounting(lid):
    docs = [doc(GOOD), doc("Kurzer deutscher Text über Debian und das Netzwerk."), doc("The cat sat on the mat and looked out of the window at the birds.")]
    # the short English doc passes language id; Gopher repetition (which runs first, as in FineWeb)
    # drops it: its top 4-gram, even seen once, is over 16% of its 66 characters
    for i, d in enumerate(docs):
        d["id"] = f"d{i}"
    stats: dict[str, StepStats] = {}
    sink: list = []
    kept = list(run_filters(docs, build_filters(CurateConfig(), langid_model=lid), stats, sink))
    assert [d["id"] for d in kept] == ["d0"]
    assert sink == [("d1", "langid", "langid:de"), ("d2", "gopher_repetition", "gopher_repetition:top_4_gram")]
    assert all(s.balanced() for s in stats.values())
