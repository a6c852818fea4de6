"""Model-based quality: fastText reference-vs-crawl classifier and CCNet-style KenLM perplexity."""
from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest

from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, KenLMConfig, QualityClassifierConfig, QualityConfig
from tasks.core.steps import StepStats, run_filters
from tasks.quality.classifier import (QualityClassifierFilter, roc_auc, threshold_for_top_fraction,
                                      train_classifier)
from tasks.quality.kenlm_lm import KenLMFilter, PerplexityScorer, bucketize, kenlm_bin_dir, percentile_cutoffs, train_kenlm
from tasks.quality.score import score_docs
from tasks.quality.text import ccnet_normalize, lm_tokens, sample_corpus

DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
REFERENCE = ["text/gutenberg/*.txt", "text/linux-doc-rst.jsonl.gz"]
CRAWL = ["web/cc-main-2019-30-sample.jsonl.gz"]
needs_data = pytest.mark.skipif(not (DATA / "web" / "cc-main-2019-30-sample.jsonl.gz").exists(),
                                reason=f"no data under {DATA}")


def _has_kenlm() -> bool:
    try:
        kenlm_bin_dir()
        return True
    except FileNotFoundError:
        return False


needs_kenlm = pytest.mark.skipif(not _has_kenlm(), reason="KenLM binaries not built (infra/build_kenlm.sh)")


def test_ccnet_normalize_and_tokens():
    assert ccnet_normalize("Héllo  “World” 2024 —\tok\n\n\u200bLine 7") == 'hello "world" 0000 - ok\nline 0'
    assert lm_tokens("it's 0.0, ok") == ["it", "'", "s", "0", ".", "0", ",", "ok"]


def test_roc_auc_and_top_fraction():
    assert roc_auc([1, 1, 0, 0], [0.9, 0.8, 0.1, 0.2]) == 1.0
    assert roc_auc([1, 0], [0.5, 0.5]) == 0.5
    assert roc_auc([0, 1, 0, 1], [0.9, 0.8, 0.1, 0.2]) == 0.5
    assert threshold_for_top_fraction([0.1, 0.9, 0.5, 0.7], 0.5) == 0.7


def test_percentile_buckets_are_per_source():
    pp = list(range(1, 11)) + [x * 100 for x in range(1, 11)]
    src = ["a"] * 10 + ["b"] * 10
    b = bucketize(pp, src, 30, 60)
    # each source gets 3 head / 3 middle / 4 tail of its own documents
    for s in ("a", "b"):
        mine = [x for x, y in zip(b, src) if y == s]
        assert (mine.count("head"), mine.count("middle"), mine.count("tail")) == (3, 3, 4)
    cuts = percentile_cutoffs(pp, src, 30, 60)
    assert cuts["a"][0] == pytest.approx(np.percentile(range(1, 11), 30))
    assert cuts["b"][1] == pytest.approx(np.percentile([x * 100 for x in range(1, 11)], 60))


@pytest.fixture(scope="module")
def corpora():
    if not (DATA / "web" / "cc-main-2019-30-sample.jsonl.gz").exists():
        pytest.skip(f"no data under {DATA}")
    ref = sample_corpus(REFERENCE, DATA, 700, seed=0)
    crawl = sample_corpus(CRAWL, DATA, 700, seed=1)
    return ref, crawl


@needs_data
def test_classifier_separates_reference_from_crawl(corpora, tmp_path):
    ref, crawl = corpora
    cfg = QualityClassifierConfig(max_docs_per_class=350, max_chars=2000, epoch=5, bucket=50_000)
    m = train_classifier(cfg, DATA, tmp_path, positives=ref[:350], negatives=crawl[:350])
    assert m["heldout"]["roc_auc"] > 0.8
    assert m["heldout"]["n"] == 140 and m["heldout"]["positives"] == 70
    assert m["model_bytes"] < 10_000_000
    # unseen documents of both kinds, through the Filter interface with uniform stats
    docs = [{"id": f"r{i}", "text": t} for i, t in enumerate(ref[400:460])] + \
           [{"id": f"c{i}", "text": t} for i, t in enumerate(crawl[400:460])]
    stats: dict[str, StepStats] = {}
    kept = list(run_filters(docs, [QualityClassifierFilter(m["model"], threshold=0.5, max_chars=2000)], stats))
    st = stats["quality_classifier"]
    assert st.balanced() and st.docs_in == 120
    assert roc_auc([d["id"][0] == "r" for d in docs], [d["quality_score"] for d in docs]) > 0.8
    assert sum(d["id"][0] == "r" for d in kept) > sum(d["id"][0] == "c" for d in kept)
    # keep-top-fraction through the batch scorer
    qcfg = QualityConfig(classifier=QualityClassifierConfig(max_chars=2000, keep_top_fraction=0.25))
    records, summary = score_docs(docs, qcfg, model_path=m["model"])
    assert summary["docs_out"] == 30 and summary["steps"][0]["dropped"] == {"quality_classifier": 90}


@needs_data
@needs_kenlm
def test_kenlm_perplexity_lower_in_domain_than_shuffled(corpora, tmp_path):
    ref, crawl = corpora
    cfg = KenLMConfig(order=3, memory="64M")
    s = train_kenlm(cfg, DATA, tmp_path, texts=ref[:300])
    assert Path(s["model"]).exists() and s["tokens"] > 10_000
    scorer = PerplexityScorer(s["model"])
    rng = random.Random(0)
    held = [t for t in ref[600:700] if len(t.split()) > 50][:30]

    def shuffled(t):
        w = t.split()
        rng.shuffle(w)
        return " ".join(w)

    in_dom = [scorer.perplexity(t) for t in held]
    shuf = [scorer.perplexity(shuffled(t)) for t in held]
    assert sum(a < b for a, b in zip(in_dom, shuf)) >= 0.9 * len(held)
    assert np.median(shuf) > 2 * np.median(in_dom)
    assert scorer.perplexity("") == float("inf")
    # tag + drop the tail with per-source cut-offs, uniform stats
    docs = [{"id": str(i), "text": t, "source": "ref"} for i, t in enumerate(held)]
    cuts = percentile_cutoffs(in_dom, ["ref"] * len(in_dom), 30, 60)
    stats: dict[str, StepStats] = {}
    kept = list(run_filters(docs, [KenLMFilter(s["model"], cuts, drop_buckets=["tail"])], stats))
    assert stats["kenlm"].balanced() and stats["kenlm"].dropped["kenlm_tail"] == len(held) - len(kept)
    assert {d["kenlm_bucket"] for d in kept} <= {"head", "middle"}
    records, summary = score_docs(docs, QualityConfig(kenlm=KenLMConfig(drop_buckets=["tail"])), kenlm_path=s["model"])
    assert [r["kenlm_bucket"] for r in records].count("head") == 9  # 30% of 30
    assert summary["docs_out"] == sum(r["kenlm_bucket"] != "tail" for r in records)


# ------------------------------------------------------------------ the pipeline stage (run_quality)

@pytest.fixture(scope="module")
def stage_cfg(tmp_path_factory):
    from tasks.config import PipelineConfig, RayConfig, SourceConfig

    root = tmp_path_factory.mktemp("quality-stage")
    return PipelineConfig(
        name="quality-test", data_root=str(DATA), run_root=str(root / "runs"), ray=RayConfig(num_cpus=2),
        sources=[SourceConfig(name="x", uri="web/*", format="jsonl", licence="test", provenance="shared/data")],
        quality=QualityConfig(
            model_dir=str(root / "models"), batch_docs=40,
            classifier=QualityClassifierConfig(enabled=True, positives=["text/gutenberg/*.txt"], negatives=CRAWL,
                                               max_docs_per_class=300, max_chars=2000, bucket=50_000),
            kenlm=KenLMConfig(enabled=True, reference=["text/gutenberg/*.txt"], max_docs=300, order=3,
                              memory="64M", drop_buckets=["tail"])))


@pytest.fixture(scope="module")
def stage_input(corpora, tmp_path_factory):
    from tasks.core.documents import write_docs

    ref, crawl = corpora
    docs = [{"id": f"ref-{i}", "text": t, "source": "reference"} for i, t in enumerate(ref[:60])] + \
           [{"id": f"web-{i}", "text": t, "source": "crawl"} for i, t in enumerate(crawl[:60])]
    random.Random(3).shuffle(docs)
    return docs, write_docs(docs, tmp_path_factory.mktemp("quality-in"), shard_docs=50)  # 3 shards


@needs_data
@needs_kenlm
def test_quality_stage_accounts_for_every_document_and_reuses_models(stage_cfg, stage_input, ray_session, tmp_path):
    import json

    import pyarrow.parquet as pq

    from tasks.core.documents import iter_docs
    from tasks.quality.run import classifier_key, run_quality

    docs, shards = stage_input
    s = run_quality(stage_cfg, shards, tmp_path / "q1")
    n = len(docs)
    assert s["docs_in"] == n and s["docs_out"] + sum(s["dropped"].values()) == n
    assert set(s["dropped"]) == {"quality_classifier", "kenlm_tail"}
    assert [st["name"] for st in s["steps"]] == ["quality_classifier", "kenlm"]
    assert all(st["docs_in"] == st["docs_out"] + sum(st["dropped"].values()) for st in s["steps"])
    # the output is the kept documents, in input order; dropped.jsonl and scores.parquet explain the rest
    kept = [d["id"] for d in iter_docs(s["shards"])]
    assert len(kept) == s["docs_out"] and kept == [d["id"] for d in docs if d["id"] in set(kept)]
    lines = [json.loads(x) for x in Path(s["dropped_file"]).read_text().splitlines()]
    assert len(lines) == n - len(kept) and not {x["id"] for x in lines} & set(kept)
    scores = pq.read_table(s["scores_file"]).to_pylist()
    assert len(scores) == n and {r["id"] for r in scores if r["keep"]} == set(kept)
    assert all(r["kenlm_bucket"] in ("head", "middle", "tail") and r["perplexity"] > 0 for r in scores)
    # the reference text outscores the crawl
    assert sum(k.startswith("ref-") for k in kept) > 2 * sum(k.startswith("web-") for k in kept)
    models = s["models"]
    assert not models["classifier"]["reused"] and not models["kenlm"]["reused"]
    assert models["classifier"]["heldout"]["roc_auc"] > 0.8 and s["metrics"]["classifier_heldout_roc_auc"] > 0.8
    # the "reference" source holds Gutenberg passages, the models' own reference: flagged; the crawl is not
    overlap = s["reference_overlap"]
    assert overlap["reference"] == ["text/gutenberg/*.txt"]
    ref_src, crawl_src = overlap["sources"]["reference"], overlap["sources"]["crawl"]
    assert ref_src["checked"] == crawl_src["checked"] == 60
    assert ref_src["fraction"] > 0.2 and crawl_src["overlapping"] == 0
    assert len(overlap["warnings"]) == 1 and "'reference'" in overlap["warnings"][0]
    assert s["metrics"]["reference_overlap_max_fraction"] == ref_src["fraction"]

    # same training inputs and config: both models reused (scoring settings are not part of the key)
    cfg2 = stage_cfg.model_copy(deep=True)
    cfg2.quality.classifier.threshold, cfg2.quality.classifier.keep_top_fraction = None, 0.5
    cfg2.quality.kenlm.drop_buckets = []  # tag only
    s2 = run_quality(cfg2, shards, tmp_path / "q2")
    assert s2["models"]["classifier"]["reused"] and s2["models"]["kenlm"]["reused"]
    assert s2["models"]["classifier"]["sha256"] == models["classifier"]["sha256"]
    # the top half (ties at the cut-off stay); nothing dropped by KenLM in tag mode
    assert n // 2 <= s2["docs_out"] < n and s2["dropped"] == {"quality_classifier": n - s2["docs_out"]}
    assert sum(s2["buckets"].values()) == n
    # another training config is another model
    cfg3 = stage_cfg.model_copy(deep=True)
    cfg3.quality.classifier.epoch += 1
    assert classifier_key(cfg3)[0] != classifier_key(stage_cfg)[0] == models["classifier"]["key"]


def test_quality_stage_disabled_passes_shards_through(tmp_path):
    from tasks.config import PipelineConfig, SourceConfig
    from tasks.core.documents import write_docs
    from tasks.quality.run import run_quality

    cfg = PipelineConfig(name="q", sources=[SourceConfig(name="x", uri="x", format="jsonl", licence="l",
                                                         provenance="p")])
    shards = write_docs([{"id": str(i), "text": "t"} for i in range(5)], tmp_path / "in")
    s = run_quality(cfg, shards, tmp_path / "out")
    assert not s["enabled"] and s["docs_out"] == s["docs_in"] == 5 and s["shards"] == [str(p.resolve()) for p in shards]
