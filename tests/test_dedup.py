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
    # the hops have Jaccard ≈ 0.75 (candidates with p ≈ 0.7 each): a fixed hash and seed make
    # this one draw (the sha1 signatures at seed 7 connect all three)
    hasher = MinHasher(seed=7, hash="sha1")
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


# ---------------------------------------------------------------------------------------------
# clustering at scale (tasks.dedup.cluster) and the dedup report (tasks.dedup.report)

def _corpus_with_copies(texts: list[str], seed: int = 0) -> tuple[list[str], list[str]]:
    """Real documents with near copies (2 % of words edited) and chains of copies inserted at
    random places; returns (texts, sources)."""
    rng = random.Random(seed)
    corpus, sources = [], []
    for k, t in enumerate(texts):
        corpus.append(t)
        sources.append("web" if k % 2 else "books")
        for c in range(rng.choice([0, 0, 1, 2])):
            corpus.insert(rng.randrange(len(corpus) + 1), edit_words(t, 0.02, seed=seed * 100 + k * 10 + c))
            sources.insert(len(sources), "copies")
    corpus += ["...", "short text", "short text"]
    sources += ["web", "web", "books"]
    return corpus, sources


def test_local_components_match_union_find():
    from tasks.dedup.cluster import local_components
    from tasks.dedup.minhash import UnionFind

    rng = random.Random(3)
    n = 500
    edges = [(rng.randrange(n), rng.randrange(n)) for _ in range(400)]
    edges = [(a, b) for a, b in edges if a != b]
    uf = UnionFind(n)
    for a, b in edges:
        uf.union(a, b)
    import numpy as np

    nodes, roots = local_components(np.array([a for a, _ in edges]), np.array([b for _, b in edges]))
    want = uf.roots()
    assert {int(x) for x in nodes} == {x for e in edges for x in e}
    assert all(want[x] == r for x, r in zip(nodes.tolist(), roots.tolist()))


@needs_data
def test_ray_clustering_equals_in_process_clustering(real_texts, ray_session, tmp_path, capsys):
    from tasks.dedup.cluster import cluster_signatures

    corpus, _ = _corpus_with_copies(real_texts, seed=1)
    sigs = MinHasher(seed=1).signatures(corpus)
    local, _ = cluster_signatures(sigs, 14, 8, method="local")
    assert local == minhash_clusters(sigs, 14, 8)
    assert sum(r != i for i, r in enumerate(local)) >= 10  # the copies were found
    got, stats = cluster_signatures(sigs, 14, 8, method="ray", work_dir=tmp_path, partitions=5)
    assert got == local
    assert stats["partitions"] == 5 and stats["cc_rounds"] >= 1 and stats["candidate_pairs"] > 0
    assert not (tmp_path / "_lsh").exists()  # spill files removed
    err = capsys.readouterr().err
    assert "memory estimate" in err and "band keys" in err and "candidate pairs" in err
    # with a verification callback the same pairs are rejected on both paths
    shs = [shingles(t) for t in corpus]
    from tasks.dedup.minhash import jaccard

    def verify(i, j):
        return jaccard(shs[i], shs[j]) >= 0.9

    local_v, _ = cluster_signatures(sigs, 14, 8, method="local", verify=verify)
    ray_v, stats = cluster_signatures(sigs, 14, 8, method="ray", work_dir=tmp_path, partitions=2, verify=verify)
    assert ray_v == local_v and stats["verified_pairs"] < stats["candidate_pairs"]
    assert sum(r != i for i, r in enumerate(local_v)) < sum(r != i for i, r in enumerate(local))


def test_quality_survivor_is_highest_score_then_first_seen():
    import numpy as np

    from tasks.dedup.cluster import choose_survivors

    roots = np.array([0, 1, 0, 1, 0, 5, 5])
    scores = np.array([0.2, np.nan, 0.9, np.nan, 0.9, 0.1, np.nan])
    # cluster {0,2,4}: 2 and 4 tie at 0.9 → 2 (first seen); {1,3}: no scores → 1; {5,6}: 5
    assert choose_survivors(roots, scores).tolist() == [2, 1, 2, 1, 2, 5, 5]
    assert choose_survivors(roots).tolist() == roots.tolist()


def test_memory_estimate_counts_signatures_keys_and_pairs():
    from tasks.dedup.cluster import format_estimate, memory_estimate

    est = memory_estimate(10_000_000, 112, 14)
    assert est["signatures_bytes"] == 10_000_000 * 112 * 4
    assert est["band_keys_bytes"] == 10_000_000 * 14 * 13
    assert est["pairs_bytes_max"] == 10_000_000 * 14 * 8
    assert est["partitions"] == 35 and est["per_task_bytes"] < 2**30
    assert "10,000,000 docs" in format_estimate(est)


def test_dedup_report_rates_histogram_and_example_pairs(real_texts):
    from tasks.dedup.report import dedup_report, report_markdown, report_metrics, report_tables

    a, b, c = real_texts[0], real_texts[1], real_texts[2]
    near_a = edit_words(a, 0.02, seed=1)
    ids = ["a", "a-copy", "a-near", "a-near-copy", "b", "b-near", "c"]
    sources = ["web", "web", "books", "books", "books", "web", "web"]
    texts = dict(zip(ids, [a, a.upper(), near_a, near_a, b, edit_words(b, 0.02, seed=2), c]))
    drops = [("a-copy", "exact_dedup", "a"), ("a-near-copy", "exact_dedup", "a-near"),
             ("a-near", "minhash_dedup", "a"), ("b-near", "minhash_dedup", "b")]
    hasher = MinHasher(seed=1)
    sigs = dict(zip(ids, hasher.signatures([texts[i] for i in ids])))
    rep = dedup_report(ids, sources, drops, signatures=sigs, texts=texts)
    assert rep["docs"] == 7 and rep["duplicates"] == 4 and rep["duplicate_rate"] == round(4 / 7, 4)
    assert rep["by_source"]["web"] == {"docs": 4, "duplicates": 2, "exact_duplicates": 1, "near_duplicates": 1,
                                       "duplicate_rate": 0.5}
    assert rep["by_source"]["books"]["duplicates"] == 2 and rep["by_source"]["books"]["docs"] == 3
    # clusters: {a, a-copy, a-near, a-near-copy} (chain through the exact copy of a near copy), {b, b-near}; c alone
    assert rep["cluster_sizes"] == {"1": 1, "2": 1, "4": 1}
    assert rep["largest_cluster"] == 4 and rep["clusters_with_duplicates"] == 2
    first = rep["examples"][0]
    assert (first["kept"], first["cluster_size"]) == ("a", 4)
    ex_b = next(e for e in rep["examples"] if e["kept"] == "b")
    assert ex_b["duplicate"] == "b-near" and ex_b["step"] == "minhash_dedup"
    assert 0.7 < ex_b["jaccard"] < 0.95 and abs(ex_b["jaccard_estimate"] - ex_b["jaccard"]) < 0.15
    m = report_metrics(rep)
    assert m["dedup.duplicate_rate"] == rep["duplicate_rate"] and m["dedup.source.web.duplicate_rate"] == 0.5
    assert m["dedup.cluster_size.4"] == 1
    tables = report_tables(rep)
    assert {r["source"] for r in tables["by_source"]} == {"web", "books"}
    md = report_markdown(rep)
    assert "| web | 4 | 1 | 1 | 50.00 % |" in md and "| b | b-near | minhash_dedup | 2 |" in md


def test_large_star_small_star_rounds_reach_the_components():
    """The distributed union-find's steps, run in process over 3 partitions on random graphs
    (long chains need several rounds): the fixed point maps every node to its component's
    smallest node."""
    import numpy as np

    from tasks.dedup.cluster import _both_directions, large_star, small_star
    from tasks.dedup.minhash import UnionFind

    rng = np.random.default_rng(0)
    for trial in range(4):
        n, m = 3000, int(rng.integers(500, 3000))
        a, b = rng.integers(0, n, m), rng.integers(0, n, m)
        a, b = a[a != b], b[a != b]
        if trial == 0:  # a long shuffled chain
            perm = rng.permutation(n)
            a, b = perm[:-1], perm[1:]
        uf = UnionFind(n)
        for x, y in zip(a.tolist(), b.tolist()):
            uf.union(x, y)
        P, rounds = 3, 0
        inbox = [[e] for e in _both_directions(a, b, P)]
        while True:
            rounds += 1
            outs = [large_star(P, *inbox[p]) for p in range(P)]
            if all(o[0] for o in outs):
                break
            mid = [[o[2 + q] for o in outs] for q in range(P)]
            souts = [small_star(P, *mid[q]) for q in range(P)]
            inbox = [[s[p] for s in souts] for p in range(P)]
        got = {int(x): int(r) for o in outs for x, r in o[1]}
        roots = uf.roots()
        assert got == {i: r for i, r in enumerate(roots) if r != i}
        if trial == 0:
            assert rounds > 3
