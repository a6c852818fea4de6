"""Exact and MinHash near-duplicate detection."""
from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

import pytest

from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT
from tasks.dedup import ExactDeduper, MinHasher, exact_key, minhash_clusters, shingles, simplify
from tasks.dedup.minhash import estimated_jaccard

DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
CC_MAIN = DATA / "web" / "cc-main-2019-30-sample.jsonl.gz"
needs_data = pytest.mark.skipif(not CC_MAIN.exists(), reason=f"no data under {DATA}")


@pytest.fixture(scope="module")
def real_texts() -> list[str]:
    if not CC_MAIN.exists():
        pytest.skip(f"no data under {DATA}")
    with gzip.open(CC_MAIN, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    return [t for t in texts if len(t.split()) > 300][:40]


def edit_words(text: str, fraction: float, seed: int = 0) -> str:
    """Replace `fraction` of the words with new ones (a near-duplicate)."""
    rng = random.Random(seed)
    toks = text.split()
    for i in rng.sample(range(len(toks)), int(len(toks) * fraction)):
        toks[i] = f"zz{rng.randrange(10**6)}"
    return " ".join(toks)


def test_exact_key_normalises_case_and_whitespace():
    assert exact_key("Hello  World\n\nAgain") == exact_key("hello world again")
    assert exact_key("Hello World") != exact_key("Hello World!")
    ex = ExactDeduper()
    assert ex.check("a", exact_key("same text")) is None
    assert ex.check("b", exact_key("other text")) is None
    assert ex.check("c", exact_key("SAME   text")) == "a"
    assert ex.check("d", exact_key("same text")) == "a"


def test_shingles_are_word_ngrams_of_simplified_text():
    assert simplify("Héllo, World! 2024 is HERE.") == "hello world 0 is here"
    sh = shingles("one two three four five six seven", 5)
    assert sh == {b"one two three four five", b"two three four five six", b"three four five six seven"}
    assert shingles("just three words", 5) == {b"just three words"}
    assert shingles("!!! ...", 5) == set()


@needs_data
def test_near_duplicates_found_and_first_kept(real_texts):
    base = real_texts[:20]
    hasher = MinHasher(bands=14, rows=8, seed=1, ngram=5)
    near = edit_words(base[3], 0.02, seed=1)  # ~2% of words changed: 5-gram Jaccard ≈ 0.8
    far = edit_words(base[5], 0.5, seed=2)  # half the words changed: not a near duplicate
    corpus = base + [near, far]
    sigs = [hasher.signature(t) for t in corpus]
    assert estimated_jaccard(sigs[3], sigs[20]) > 0.7
    assert estimated_jaccard(sigs[5], sigs[21]) < 0.2
    roots = minhash_clusters(sigs, 14, 8, seed=1, scheme=hasher.scheme)
    assert roots[20] == 3  # the near copy points at the first occurrence
    assert roots[21] == 21  # the heavily edited copy is its own document
    # besides the synthetic copy, the sample has a real near-duplicate pair: two Bodleian ballad
    # search pages that differ only in their filter line
    assert roots[6] == 5
    assert corpus[5].startswith("Broadside Ballads Online") and corpus[6].startswith("Broadside Ballads Online")
    assert corpus[5] != corpus[6]
    assert [i for i, r in enumerate(roots) if r != i] == [6, 20]


def test_clusters_are_transitive_and_keep_earliest():
    rng = random.Random(5)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(6)) for _ in range(400)]
    a = " ".join(words)
    b = edit_words(a, 0.03, seed=3)
    c = edit_words(b, 0.03, seed=4)
    d = " ".join(reversed(words))  # same words, different 5-grams
    hasher = MinHasher(seed=7)
    roots = minhash_clusters([hasher.signature(t) for t in (c, d, a, b)], seed=7, scheme=hasher.scheme)
    # c (first in corpus order) keeps; a and b join its cluster; d is unrelated
    assert roots == [0, 1, 0, 0]


def test_documents_without_words_are_never_duplicates():
    hasher = MinHasher()
    sigs = [hasher.signature("..."), hasher.signature("!!!"), hasher.signature("real words here")]
    assert sigs[0] is None and sigs[1] is None
    assert minhash_clusters(sigs) == [0, 1, 2]


def test_signatures_are_deterministic_and_seeded():
    t = "the same text gives the same signature every time it is hashed with one seed"
    assert (MinHasher(seed=1).signature(t) == MinHasher(seed=1).signature(t)).all()
    assert not (MinHasher(seed=1).signature(t) == MinHasher(seed=2).signature(t)).all()
    assert MinHasher(bands=14, rows=8).signature(t).shape == (112,)
