"""Decontamination: normalisation, the n-gram index over the real LAMBADA / HellaSwag /
WikiText-2 files, drop decisions, and `run_curate` dropping an embedded LAMBADA passage with a
report naming the benchmark item."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tasks.config import (DATA_ROOT_ENV, DEFAULT_DATA_ROOT, CurateConfig, DecontamConfig, PipelineConfig,
                          RayConfig, SourceConfig)
from tasks.core.documents import iter_docs, write_docs
from tasks.curate.decontam import DecontamFilter, build_index, ngram_hashes, normalise_words, read_items
from text_helpers import assert_same_on_every_code_point

DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
EVAL = DATA / "eval"
pytestmark = pytest.mark.skipif(not (EVAL / "lambada_test.jsonl").exists(), reason=f"no eval data under {DATA}")

CLEAN = ("The Debian project publishes a new stable release roughly every two years. Each release is "
         "supported with security updates for about three years, and the long term support team extends "
         "that for two more years. Packages move from unstable to testing after a few days without bugs.")


@pytest.fixture(scope="module")
def index():
    return build_index(DecontamConfig(), str(DATA))


def test_normalisation_matches_tokenised_and_raw_text():
    wiki = "He was a well @-@ known actor , with 1 @,@ 000 fans who don 't care ."
    web = "He was a well-known actor, with 1,000 fans who don't care."
    assert normalise_words(wiki) == normalise_words(web)
    assert normalise_words("Hello, World!  x") == ["hello", "world", "x"]
    a = ngram_hashes("a b c d e".split(), 3)
    assert len(a) == 3 and a[0] == ngram_hashes("a b c".split(), 3)[0] and len(set(a.tolist())) == 3
    assert len(ngram_hashes("a b".split(), 3)) == 0


def test_index_over_real_benchmarks(index):
    st = index.stats["benchmarks"]
    assert st["lambada"]["items"] == 5153 and st["hellaswag"]["items"] == 10042 and st["wikitext"]["items"] == 62
    assert 500_000 < len(index) < 1_500_000
    assert list(index.hashes) == sorted(index.hashes)  # sorted for searchsorted


def test_normalisation_is_the_regex_one_on_every_code_point():
    """normalise_words' translate table gives the words of the regex substitution it replaces, on
    every code point from U+0020 to U+10FFFF (surrogates and unassigned ones included), one string
    per 64 Ki block."""
    import regex

    def reference(text: str) -> list[str]:
        return regex.sub(r"[\p{P}\p{S}]+", " ", text.lower()).split()

    mixed = " A\u00e9\u0301b\u2019c \u00a7d\u00a9 1,5%\u20ac x\u0660y"
    assert normalise_words(mixed) == reference(mixed) == ["a\u00e9\u0301b", "c", "d", "1", "5", "x\u0660y"]
    assert_same_on_every_code_point(normalise_words, reference)


def test_lookup_bit_table_passes_few_and_finds_every_indexed_ngram(index):
    """The bit table lets through every indexed n-gram and few others; lookup equals a plain
    binary search over the whole index."""
    import pickle

    import numpy as np

    rng = np.random.default_rng(0)
    present = index.hashes[rng.integers(0, len(index), 2000)]
    absent = rng.integers(0, 2**63, 20_000, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    grams = np.concatenate([present, absent])
    assert set(index.maybe_present(present).tolist()) == set(range(len(present)))
    assert len(index.maybe_present(absent)) < 0.05 * len(absent)  # the table does filter
    pos = np.minimum(np.searchsorted(index.hashes, grams), len(index) - 1)
    assert np.array_equal(index.lookup(grams), np.where(index.hashes[pos] == grams, pos, -1))
    assert "_bits" not in pickle.loads(pickle.dumps(index)).__dict__  # rebuilt by each worker


def test_unsorted_or_repeated_index_is_refused(index):
    """The bit table and the binary search assume strictly increasing hashes: an index whose hashes
    are out of order (which would miss members: false negatives) is refused when it is built and
    when it is unpickled, with a clear error."""
    import pickle

    import numpy as np

    from tasks.curate.decontam import DecontamIndex

    h, b, i = index.hashes[:1000], index.bench[:1000], index.items[:1000]
    shuffled = np.random.default_rng(0).permutation(len(h))
    for bad in (h[shuffled], np.r_[h[:10], h[9:999]]):  # out of order; one hash repeated
        with pytest.raises(ValueError, match="strictly increasing"):
            DecontamIndex(index.n, index.names, bad, b, i, {})
    with pytest.raises(ValueError, match="1-D uint64"):
        DecontamIndex(index.n, index.names, h.astype(np.int64), b, i, {})
    ok = DecontamIndex(index.n, index.names, h, b, i, {})
    assert np.array_equal(ok.lookup(h[shuffled]), shuffled)  # a sorted one finds every member
    ok.hashes = h[shuffled]  # tampered before shipping to a worker: refused on arrival
    with pytest.raises(ValueError, match="strictly increasing"):
        pickle.loads(pickle.dumps(ok))


def test_embedded_lambada_passage_dropped_clean_kept(index):
    f = DecontamFilter(index)
    passage = read_items(EVAL / "lambada_test.jsonl", "lambada")[1234]
    doc = {"id": "dirty", "text": CLEAN + "\n\n" + passage.upper().replace(".", " .")}
    assert f.decide(doc) == "decontam:lambada"
    assert f.decide({"id": "clean", "text": CLEAN}) is None
    hits = f.drain()
    assert [(h["benchmark"], h["item"], h["doc_id"]) for h in hits] == [("lambada", 1234, "dirty")]
    assert hits[0]["ngram"] in " ".join(normalise_words(passage))
    assert len(hits[0]["ngram"].split()) == 13


def test_hellaswag_and_wikitext_hits_and_short_overlap(index):
    f = DecontamFilter(index)
    hs = read_items(EVAL / "hellaswag_val.jsonl", "hellaswag")[77]
    assert f.decide({"id": "h", "text": "Intro sentence here. " + hs}) == "decontam:hellaswag"
    wiki_article = read_items(EVAL / "wikitext-2" / "test.txt", "wikitext")[5]
    words = wiki_article.split()
    assert f.decide({"id": "w", "text": " ".join(words[200:260])}) == "decontam:wikitext"
    # twelve words of a passage are not enough
    lam = normalise_words(read_items(EVAL / "lambada_test.jsonl", "lambada")[0])
    assert f.decide({"id": "s", "text": "zzqx " + " ".join(lam[:12]) + " zzqy"}) is None


def test_missing_benchmark(tmp_path):
    cfg = DecontamConfig(benchmarks=[{"name": "mine", "path": "nope.jsonl", "format": "jsonl_text"}])
    with pytest.raises(FileNotFoundError):
        build_index(cfg, str(tmp_path))
    idx = build_index(cfg.model_copy(update={"on_missing": "skip"}), str(tmp_path))
    assert len(idx) == 0 and idx.stats["benchmarks"]["mine"]["missing"]
    assert DecontamFilter(idx).decide({"id": "x", "text": CLEAN}) is None


def test_run_curate_drops_and_reports(tmp_path):
    import ray

    from tasks.core.ray_utils import init_ray
    from tasks.curate import run_curate

    passage = read_items(EVAL / "lambada_test.jsonl", "lambada")[42]
    docs = [{"id": f"d{i}", "text": f"Document {i}. " + CLEAN, "source": "web"} for i in range(3)]
    docs.append({"id": "dirty", "text": CLEAN + "\n" + passage, "source": "web"})
    in_shards = write_docs(docs, tmp_path / "in")
    off = {"enabled": False}
    cur = CurateConfig(langid=off, gopher_quality=off, gopher_repetition=off, c4=off, fineweb=off,
                       dedup={"exact": False, "minhash": off})
    cfg = PipelineConfig(name="t", data_root=str(DATA), ray=RayConfig(num_cpus=1), curate=cur,
                         sources=[SourceConfig(name="web", uri="x", format="jsonl", licence="t", provenance="t",
                                                       retention="30 days", mixture_weight=2)])
    init_ray(cfg.ray)
    try:
        s = run_curate(cfg, in_shards, tmp_path / "out")
    finally:
        ray.shutdown()
    assert s["dropped"] == {"decontam:lambada": 1} and s["docs_out"] == 3
    assert [d["id"] for d in iter_docs(s["shards"])] == ["d0", "d1", "d2"]
    assert s["decontam"]["docs_dropped"] == {"lambada": 1} and s["decontam"]["items_hit"] == {"lambada": 1}
    report = json.loads(Path(s["decontam"]["report"]).read_text())
    assert report["hits"][0]["benchmark"] == "lambada" and report["hits"][0]["item"] == 42
    assert report["hits"][0]["doc_id"] == "dirty" and len(report["hits"][0]["ngram"].split()) == 13
    assert report["items_hit"] == {"lambada": [42]}
    card = Path(s["dataset_card"]).read_text()
    assert "## Decontamination" in card and "| lambada | 1 | 1 |" in card
    assert "| web | t | t | redact | 2 | 30 days |" in card  # the registry entry, retention note included
