"""Exact and MinHash near-duplicate detection."""
from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

import numpy as np
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


@needs_data
@pytest.mark.parametrize("verify", [True, False])
def test_chain_member_is_not_dropped_for_a_representative_it_does_not_match(real_texts, verify):
    """A~B and B~C but A !~ C: connected components put all three in A's cluster; C must be
    kept, not dropped as A's duplicate through B. Exact Jaccard A-B 0.81, B-C 0.83, A-C 0.68
    (estimated 0.80 / 0.82 / 0.66): verified pairs at 0.8 and, unverified, shared LSH band keys
    chain them; the representative check (default 0.7) separates C from A."""
    from tasks.config import DedupConfig, MinHashConfig
    from tasks.dedup.minhash import band_keys, jaccard
    from tasks.dedup.texts import dedup_texts

    a = real_texts[0]
    b = edit_words(a, 0.02, seed=0)
    c = edit_words(b, 0.02, seed=100)
    sh = [shingles(t) for t in (a, b, c)]
    assert jaccard(sh[0], sh[1]) >= 0.8 and jaccard(sh[1], sh[2]) >= 0.8 and jaccard(sh[0], sh[2]) < 0.7
    keys = [set(band_keys(s, 14, 8)) for s in MinHasher().signatures([a, b, c])]
    assert keys[0] & keys[1] and keys[1] & keys[2] and not keys[0] & keys[2]
    texts = [a, real_texts[1], b, real_texts[2], c]
    chained = minhash_clusters(MinHasher().signatures(texts))
    assert chained == [0, 1, 0, 3, 0]  # the components chain C to A
    cfg = DedupConfig(minhash=MinHashConfig(verify=verify, verify_threshold=0.8))
    assert cfg.minhash.representative_threshold == 0.7
    info: dict = {}
    roots, _ = dedup_texts(texts, cfg, info=info)
    assert roots == [0, 1, 0, 3, 4]  # B dropped for A, C kept
    check = info["clustering"]["representative_check"]
    assert check["failed_first_check"] == 1 and check["pairs_checked"] == 2


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
    # unverified: each partition's pairs counted there (a pair sharing bands in two partitions twice)
    assert stats["partitions"] == 5 and stats["cc_rounds"] >= 1 and stats["candidate_pairs_in_partitions"] > 0
    assert "candidate_pairs" not in stats  # the distinct pairs are not known on this path
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
    assert rep["by_source"]["web"] == {"docs": 4, "duplicates": 2, "url_duplicates": 0, "exact_duplicates": 1,
                                       "near_duplicates": 1, "index_duplicates": 0, "duplicate_rate": 0.5}
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
    assert "| web | 4 | 0 | 1 | 1 | 50.00 % |" in md and "| b | b-near | minhash_dedup | 2 |" in md


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


# ---------------------------------------------------------------------------------------------
# exact Jaccard verification of candidate pairs (tasks.dedup.verify), in the CLI and in run_curate

GUTENBERG = DATA / "text" / "gutenberg"


def _gutenberg_passages(n: int, words: int = 250) -> list[str]:
    """`n` passages of ≥ `words` words: consecutive non-empty lines, a few per book."""
    out = []
    for path in sorted(GUTENBERG.glob("*.txt")):
        lines = [ln.strip() for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
        cur: list[str] = []
        for ln in lines[200:]:  # past the front matter
            cur.append(ln)
            if sum(len(x.split()) for x in cur) >= words:
                out.append("\n".join(cur))
                cur = []
                if len(out) % 3 == 0:
                    break
        if len(out) >= n:
            return out[:n]
    return out


@pytest.fixture(scope="module")
def verify_corpus() -> dict:
    """Gutenberg passages, one base with a true near duplicate (1 % of words replaced, Jaccard
    ≈ 0.9) and a weaker copy (4 % replaced, Jaccard 0.55–0.8) that LSH still makes a
    candidate of the base (searched over edit seeds for a shared 14×8 band of the fast-hash
    signatures: two shared bands of the default 28×4 too)."""
    if not GUTENBERG.exists():
        pytest.skip(f"no data under {DATA}")
    from tasks.dedup.minhash import band_keys, jaccard

    passages = _gutenberg_passages(14)
    assert len(passages) == 14
    base = passages[0]
    hasher = MinHasher()
    base_sig, base_sh = hasher.signature(base), shingles(base)
    near = edit_words(base, 0.01, seed=11)
    assert jaccard(base_sh, shingles(near)) >= 0.85
    low = None
    for seed in range(100):
        cand = edit_words(base, 0.04, seed=seed)
        j = jaccard(base_sh, shingles(cand))
        if 0.55 <= j < 0.8 and set(band_keys(base_sig, 14, 8)) & set(band_keys(hasher.signature(cand), 14, 8)):
            low = cand
            break
    assert low is not None, "no LSH candidate below the threshold among the edits"
    texts = passages[1:6] + [base] + passages[6:10] + [near] + passages[10:] + [low]
    docs = [{"id": f"g{k:02d}", "text": t, "source": "gutenberg"} for k, t in enumerate(texts)]
    return {"docs": docs, "base": f"g{texts.index(base):02d}", "near": f"g{texts.index(near):02d}",
            "low": f"g{texts.index(low):02d}", "texts": texts}


def test_parquet_texts_reads_rows_across_files_and_row_groups(verify_corpus, tmp_path):
    from tasks.core.documents import ShardWriter
    from tasks.dedup.minhash import jaccard
    from tasks.dedup.verify import JaccardVerifier, ListTexts, ParquetTexts

    docs, texts = verify_corpus["docs"], verify_corpus["texts"]
    with ShardWriter(tmp_path, prefix="part", shard_docs=7, row_group_docs=3) as w:
        w.write_many(docs)
    assert len(w.paths) == 3 and len(docs) == 16
    src = ParquetTexts(w.paths, [7, 7, 2])
    rows = random.Random(0).sample(range(len(docs)), len(docs))
    assert src.read(rows) == [texts[r] for r in rows]
    with pytest.raises(IndexError):
        src.read([len(docs)])
    import numpy as np

    b, n, lo = (int(verify_corpus[k][1:]) for k in ("base", "near", "low"))
    pairs = np.array([[0, 1], [b, n], [b, lo], [n, lo]])
    want = [jaccard(shingles(texts[a]), shingles(texts[b])) for a, b in pairs]
    for v in (JaccardVerifier(src, 0.85), JaccardVerifier(ListTexts(texts), 0.85)):
        assert np.allclose(v.similarities(pairs), want)
        assert v.mask(pairs).tolist() == [x >= 0.85 for x in want] == [False, True, False, False]
    # reindexed: document k of the subset is row sub[k]
    sub = JaccardVerifier(src, 0.85).reindexed([lo, n, b])
    assert sub.mask(np.array([[2, 1], [2, 0]])).tolist() == [True, False]


def _verify_cfg(clustering: str, ray_min_docs: int = 200_000, verify: bool = True):
    from tasks.config import PipelineConfig, RayConfig, SourceConfig

    off = {"enabled": False}
    curate = {"langid": off, "gopher_quality": off, "gopher_repetition": off, "c4": off, "fineweb": off,
              "decontam": off, "pii": off, "resume": False,
              "dedup": {"minhash": {"verify": verify, "verify_threshold": 0.85, "clustering": clustering,
                                    "ray_min_docs": ray_min_docs, "partitions": 3}}}
    src = SourceConfig(name="gutenberg", uri="text/gutenberg/*", format="text", licence="public domain",
                       provenance="shared/data")
    return PipelineConfig.model_validate({"name": "verify-test", "sources": [src.model_dump()],
                                          "data_root": str(DATA), "ray": RayConfig(num_cpus=2).model_dump(),
                                          "curate": curate})


def _driver_refusing_verifier():
    """A JaccardVerifier that fails when it checks pairs in this (the driver's) process."""
    import os

    from tasks.dedup.verify import JaccardVerifier

    driver = os.getpid()

    class DriverRefusingVerifier(JaccardVerifier):
        def mask(self, pairs):
            if os.getpid() == driver:
                raise AssertionError("candidate pairs verified in the driver")
            return super().mask(pairs)

    return DriverRefusingVerifier


def test_curate_verifies_candidate_pairs_in_process_and_in_ray_tasks(verify_corpus, ray_session, tmp_path,
                                                                      monkeypatch):
    import tasks.curate.run as curate_run
    from tasks.core.documents import iter_docs, write_docs
    from tasks.curate import run_curate

    docs, base, near, low = (verify_corpus[k] for k in ("docs", "base", "near", "low"))
    shards = write_docs(docs, tmp_path / "in", shard_docs=5)  # base, near and low in different jobs' parts
    assert len(shards) == 4

    def run(cfg, name):
        s = run_curate(cfg, shards, tmp_path / name)
        assert s["docs_in"] == len(docs) == s["docs_out"] + sum(s["dropped"].values())
        drops = {d["id"]: d.get("duplicate_of") for d in map(json.loads, Path(s["dropped_file"]).read_text().splitlines())}
        return s, drops, [d["id"] for d in iter_docs(s["shards"])]

    # without verification (nor the representative check) the weak copy, an LSH candidate of the
    # base, joins its cluster
    plain = _verify_cfg("local", verify=False)
    plain.curate.dedup.minhash.representative_threshold = 0.0
    s0, drops0, _ = run(plain, "plain")
    assert drops0 == {near: base, low: base}
    assert "verified_pairs" not in s0["dedup"]["clustering"]

    s1, drops1, out1 = run(_verify_cfg("local"), "local")
    c1 = s1["dedup"]["clustering"]
    assert c1["method"] == "local"
    assert drops1 == {near: base}  # the true near duplicate merged, the candidate below 0.85 not
    assert low in out1 and base in out1 and near not in out1
    assert 1 <= c1["verified_pairs"] < c1["candidate_pairs"]

    # Ray clustering, chosen by ray_min_docs; a verifier that refuses to run in the driver
    monkeypatch.setattr(curate_run, "JaccardVerifier", _driver_refusing_verifier())
    s2, drops2, out2 = run(_verify_cfg("auto", ray_min_docs=2), "ray")
    c2 = s2["dedup"]["clustering"]
    assert c2["method"] == "ray" and c2["partitions"] == 3
    assert drops2 == drops1 and out2 == out1 and s2["dropped"] == s1["dropped"]
    assert 1 <= c2["verified_pairs"] < c2["candidate_pairs"]
    # the in-process clustering runs in a Ray task too (issue 26): the guarded verifier passes there
    s3, drops3, out3 = run(_verify_cfg("local"), "local-guarded")
    assert s3["dedup"]["clustering"]["method"] == "local" and drops3 == drops1 and out3 == out1
    # the guard works: the same verifier called in the driver fails
    from tasks.dedup.verify import ListTexts

    with pytest.raises(AssertionError, match="driver"):
        curate_run.JaccardVerifier(ListTexts(["a b c", "a b c"]), 0.5).mask(np.array([[0, 1]]))


@needs_data
def test_cli_text_verifier_runs_in_ray_tasks_and_matches_in_process(real_texts, ray_session, tmp_path):
    from tasks.dedup.cluster import cluster_signatures
    from tasks.dedup.minhash import jaccard
    from tasks.dedup.verify import ListTexts

    corpus, _ = _corpus_with_copies(real_texts, seed=2)
    sigs = MinHasher(seed=1).signatures(corpus)
    verifier = _driver_refusing_verifier()(ListTexts(corpus), 0.9)
    shs = [shingles(t) for t in corpus]
    local, ls = cluster_signatures(sigs, 14, 8, method="local", verify=lambda i, j: jaccard(shs[i], shs[j]) >= 0.9)
    got, stats = cluster_signatures(sigs, 14, 8, method="ray", work_dir=tmp_path, partitions=2, verify=verifier)
    assert got == local and 1 <= stats["verified_pairs"] < stats["candidate_pairs"]
    plain, _ = cluster_signatures(sigs, 14, 8, method="local")
    assert sum(r != i for i, r in enumerate(local)) < sum(r != i for i, r in enumerate(plain))


def test_curate_incremental_index_dedups_a_later_run_against_earlier_ones(verify_corpus, ray_session, tmp_path):
    """Continued pretraining: run 1 indexes what it keeps; run 2 drops its documents that are near
    duplicates of run 1's (reason minhash_index, duplicate_of the earlier id) without their
    signatures being recomputed; a re-run of run 1's corpus is not its own duplicate."""
    from tasks.core.documents import iter_docs, write_docs
    from tasks.curate import run_curate
    from tasks.dedup.index import MinHashIndex

    docs, base, near = (verify_corpus[k] for k in ("docs", "base", "near"))
    first = [d for d in docs if d["id"] != near]
    later = [{**d, "id": f"new-{d['id']}"} for d in docs if d["id"] == near] + \
            [{"id": "new-fresh", "text": verify_corpus["texts"][0][::-1], "source": "gutenberg"}]
    cfg = _verify_cfg("local", verify=False)
    cfg.curate.dedup.minhash.index_dir = str(tmp_path / "index")

    s1 = run_curate(cfg, write_docs(first, tmp_path / "in1"), tmp_path / "out1")
    assert "minhash_index" not in s1["dropped"]
    idx = MinHashIndex.load(tmp_path / "index", bands=14, rows=8)
    assert idx.docs == s1["docs_out"] and len(idx.key_array) == 14 * s1["docs_out"]

    s2 = run_curate(cfg, write_docs(later, tmp_path / "in2"), tmp_path / "out2")
    assert s2["docs_in"] == 2 == s2["docs_out"] + sum(s2["dropped"].values())
    assert s2["dropped"] == {"minhash_index": 1}
    drops = [json.loads(x) for x in Path(s2["dropped_file"]).read_text().splitlines()]
    assert drops == [{"id": f"new-{near}", "step": "minhash_index", "reason": "minhash_index", "duplicate_of": base}]
    assert [d["id"] for d in iter_docs(s2["shards"])] == ["new-fresh"]
    assert s2["dedup"]["by_source"]["gutenberg"]["index_duplicates"] == 1
    assert MinHashIndex.load(tmp_path / "index").docs == s1["docs_out"] + 1  # the fresh one was added

    s3 = run_curate(cfg, write_docs(first, tmp_path / "in3"), tmp_path / "out3")  # the same corpus again
    assert s3["docs_out"] == s1["docs_out"] and "minhash_index" not in s3["dropped"]


def test_partitioned_dedup_report_equals_the_in_process_report(ray_session, tmp_path):
    """The curate stage's report (Ray tasks over drop files, 3 partitions, chains followed in
    rounds) equals `report_from_drops` over the same drops: exact copies of documents that a
    later step drops join their survivor's cluster, index drops point outside the corpus."""
    from collections import Counter
    from types import SimpleNamespace

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.dedup.report import report_from_drops
    from tasks.dedup.stages import DROP_SCHEMA, META_SCHEMA, JobDocs, dedup_report_task, write_meta

    rng = random.Random(7)
    n, per_job = 240, 60
    ids = [f"d{i:04d}" for i in range(n)]
    srcs = [rng.choice(["web", "books", "code"]) for _ in range(n)]
    texts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "eps"]) for _ in range(30)) for _ in range(n)]
    jobs = []
    for j in range(n // per_job):
        lo = j * per_job
        part = tmp_path / f"part-{j}.parquet"
        pq.write_table(pa.table({"id": ids[lo:lo + per_job], "text": texts[lo:lo + per_job]}), part)
        meta = tmp_path / f"meta-{j}.parquet"
        write_meta(meta, {c: ([None] * per_job if c not in ("id", "source", "nbytes") else
                              ids[lo:lo + per_job] if c == "id" else srcs[lo:lo + per_job] if c == "source" else
                              [100] * per_job) for c in META_SCHEMA.names})
        jobs.append(JobDocs(f"{j:03d}", str(meta), (str(part),), per_job, lo))
    alive = set(range(n))
    drops, files = [], []
    for step in ("url_dedup", "exact_dedup", "minhash_dedup", "minhash_index"):
        gone, picked = {}, sorted(rng.sample(sorted(alive), 25))
        for p in picked:  # a step's survivors are documents it keeps
            if step == "minhash_index":
                gone[p] = (-1, f"old-{rng.randrange(5)}", None)  # earlier runs' documents
            else:
                q = rng.choice(sorted(alive - set(picked)))
                gone[p] = (q, ids[q], srcs[q])
        alive -= set(gone)
        for job in jobs:
            rows = [p for p in sorted(gone) if job.offset <= p < job.offset + job.kept]
            if not rows:
                continue
            f = tmp_path / "_dedup" / step / f"j-{job.name}.parquet"
            f.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.table({"pos": rows, "id": [ids[p] for p in rows], "dup_pos": [gone[p][0] for p in rows],
                                     "dup_of": [gone[p][1] for p in rows], "source": [srcs[p] for p in rows],
                                     "dup_source": [gone[p][2] for p in rows], "nbytes": [100] * len(rows)},
                                    schema=DROP_SCHEMA), f)
            files.append(str(f))
            drops += [(ids[p], step, gone[p][1], srcs[p]) for p in rows]
    by_source = dict(Counter(srcs))
    want = report_from_drops(by_source, n, [d[:3] for d in drops], [d[3] for d in drops],
                             dict(zip(ids, range(n))), dict(zip(ids, srcs)))
    assert want["largest_cluster"] > 3  # chains across steps are in the data
    got = dedup_report_task(files, by_source, n, jobs, SimpleNamespace(partitions=3, scheme="affine32"), 5)
    assert all("jaccard" in e for e in got["examples"] if not e["kept"].startswith("old-"))
    for e in got["examples"]:
        e.pop("jaccard", None)
    assert got == want


def test_filter_pass_shards_are_the_parts_minus_drops_written_as_tables(tmp_path, monkeypatch):
    """The filter pass's shard tasks (`_shard_rows`) write, shard by shard, the bytes a per-document
    write of the jobs' surviving documents gives (same rows, order, cuts, row groups, counters),
    through `ShardWriter.write_table` (no document becomes a dict: `write` is switched off), reading
    only the part row groups that hold a shard's rows."""
    from collections import Counter

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.core.documents import ShardWriter, iter_docs
    from tasks.dedup.stages import DROP_SCHEMA, Files, JobDocs, _kept_per_job, _shard_rows

    rng = random.Random(3)
    jobs, docs, n = [], [], 0
    for j, sizes in enumerate([[7, 5], [0], [13], [4, 9, 2]]):  # parts of 1-13 rows; a job with none
        paths = []
        for i, size in enumerate(sizes):
            rows = [{"id": f"d{n + r}", "text": f"text é {n + r} " * rng.randrange(1, 9), "source": rng.choice(["a", None]),
                     "language": rng.choice(["en", "fr", None]), "source_offset": n + r} for r in range(size)]
            with ShardWriter(tmp_path / "parts", prefix=f"{j}-{i}", shard_docs=1 << 40, row_group_docs=3) as w:
                w.write_many(rows)
            paths += [str(p) for p in w.paths]
            docs += rows
            n += size
        jobs.append(JobDocs(str(j), "-", tuple(paths), sum(sizes), n - sum(sizes)))
    files = Files(tmp_path / "_dedup")
    steps = ["exact_dedup", "minhash_dedup"]
    gone = sorted(rng.sample(range(n), 12))
    for s, step in enumerate(steps):  # each step drops half of them, per job
        for job in jobs:
            rows = [p for p in gone[s::2] if job.offset <= p < job.offset + job.kept]
            if rows:
                Path(files.drops(step, job.name)).parent.mkdir(parents=True, exist_ok=True)
                pq.write_table(pa.table({"pos": rows, "id": [f"d{p}" for p in rows], "dup_pos": [0] * len(rows),
                                         "dup_of": ["d0"] * len(rows), "source": ["a"] * len(rows),
                                         "dup_source": ["a"] * len(rows), "nbytes": [1] * len(rows)},
                                        schema=DROP_SCHEMA), files.drops(step, job.name))
    survivors = [d for p, d in enumerate(docs) if p not in set(gone)]
    want = []  # what a shard task wrote before: its documents one by one, a writer a shard
    for k in range(0, len(survivors), 4):
        with ShardWriter(tmp_path / "want", shard_docs=4, start_index=k // 4) as w:
            w.write_many(survivors[k:k + 4])
        want += w.paths
    kept_path = str(tmp_path / "kept.npy")
    assert _kept_per_job(files, steps, jobs, kept_path) == len(survivors) == n - 12

    def no_dicts(self, doc):
        raise AssertionError("a document written as a dict")

    reads = []
    read_row_group = pq.ParquetFile.read_row_group
    monkeypatch.setattr(ShardWriter, "write", no_dicts)
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, g, **kw: reads.append(g) or read_row_group(self, g, **kw))
    got = [_shard_rows(tmp_path / "out", k, 4, files, steps, jobs, kept_path) for k in range(len(want))]
    assert [g["names"] for g in got] == [[p.name] for p in want]
    for p in want:
        assert (tmp_path / "out" / p.name).read_bytes() == p.read_bytes()
    # a row group is read by the shards its surviving rows fall in: again only where a shard cut splits it
    assert len(reads) <= sum(pq.ParquetFile(p).num_row_groups for j in jobs for p in j.docs) + len(want) - 1
    assert sum(g["docs"] for g in got) == len(survivors)
    assert sum(g["bytes"] for g in got) == sum(len(d["text"].encode()) for d in survivors)
    langs, srcs = Counter(), Counter()
    for g in got:
        langs.update(g["languages"])
        srcs.update(g["sources"])
    assert langs == Counter(str(d["language"]) for d in survivors)
    assert srcs == Counter(d["source"] or "" for d in survivors)
    assert [d["id"] for d in iter_docs(sorted((tmp_path / "out").glob("shard-*.parquet")))] == [d["id"] for d in survivors]


def test_shard_writer_tables_and_documents_keep_their_order_shards_and_row_groups(tmp_path):
    """`ShardWriter.write_table` (the filter pass's write) mixed with `write`: rows in call order,
    shards of `shard_docs`, row groups of `row_group_docs` cut at the shard ends."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.core.documents import DOC_SCHEMA, ShardWriter, iter_docs

    docs = [{"id": f"d{i}", "text": f"t{i}"} for i in range(12)]
    table = lambda lo, hi: pa.Table.from_pylist(docs[lo:hi], schema=DOC_SCHEMA)  # noqa: E731
    with ShardWriter(tmp_path, shard_docs=5, row_group_docs=2) as w:
        w.write_table(table(0, 3))  # a row carried past the first row group
        w.write(docs[3])  # joins the carried row
        w.write(docs[4])  # ends the first shard
        w.write_table(table(5, 12))
    assert [d["id"] for d in iter_docs(w.paths)] == [d["id"] for d in docs]
    groups = [[pq.ParquetFile(p).metadata.row_group(g).num_rows for g in range(pq.ParquetFile(p).num_row_groups)]
              for p in w.paths]
    assert groups == [[2, 2, 1], [2, 2, 1], [2]]
    with pytest.raises(ValueError, match="null id or text"):
        ShardWriter(tmp_path / "bad").write_table(pa.table({n: pa.nulls(1, f.type) for n, f in
                                                            zip(DOC_SCHEMA.names, DOC_SCHEMA)}))
