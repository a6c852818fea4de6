"""Per-core rates of the curation stages no other benchmark measures, for `crucible plan --curate`.

Documents: the web pages `extraction.py` extracts through the ingest record path and caches
(docs-crawl WARCs, wget sample, whirlwind, Common Crawl JSONL samples; default $TMPDIR/crucible-bench-web),
`--docs` of them evenly spaced over the cache, written once as a Parquet shard (the stages' input form).
Settings: configs/tiny.yaml (the demo's and the ablation's), so the rates match the keep fractions
the plan takes from `ablation.py`. Each stage runs its own code path in this one process:

* exact_key: `tasks.dedup.exact.exact_key` over every text (best of 3).
* line dedup: `count_frequent_lines(method="local")` over the shard (the curate stage's in-process
  count, Parquet reading included), then `LineDedupFilter` (the first curate filter step) over
  every document through `run_filters`; the stage's rate covers both. Applying includes spaCy word
  counting of every shortened document (the minimum-length check), which the Gopher filters
  after it reuse from the word cache: the stage's rate alone counts that work twice (an upper bound).
* quality scoring: a fastText classifier (`train_classifier`) and a KenLM model (`train_kenlm`)
  trained on real data with the config's settings (reference corpus vs crawl sample; training
  timed apart), then `QualityWorker.score_batch` (what each scoring actor runs) in
  `quality.batch_docs` batches with both models, plus `decide` (cut-offs, keep flags); the
  classifier alone is timed too.
* tokenization: `train_tokenizer` (the tokenizer stage, without its reference tokenizer) on a
  sample, timed apart; then `encode_shard` (the tokens stage's per-shard encode + pack into
  uint16 .bin parts) over the whole shard.

Per core = this process's CPU seconds (`time.process_time`, all its threads: the HF tokenizer's
thread pool included; robust on a shared machine); wall seconds are given too. KenLM training runs
`lmplz` as a subprocess: its training time is wall clock. Writes benchmarks/results/stage_rates.json.

    python benchmarks/stage_rates.py [--docs 4000] [--cache DIR] [--tokenizer-docs 1500]
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
from pathlib import Path

from _common import add_int_options, write_result
from extraction import DEFAULT_CACHE, load_web_docs
from minhash import best_of
from infra.settings import load_config
from tasks.config import PipelineConfig
from tasks.core.documents import write_docs

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CONFIG = REPO / "configs" / "tiny.yaml"


def rate(docs: int, text_bytes: int, cpu: float, wall: float, tokens: int | None = None) -> dict:
    """Throughput per CPU-second (per core) and per wall-second."""
    out = {"docs": docs, "bytes": text_bytes, "cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
           "docs_per_s_cpu": round(docs / cpu, 1), "bytes_per_s_cpu": round(text_bytes / cpu),
           "docs_per_s_wall": round(docs / wall, 1)}
    if tokens is not None:
        out.update(tokens=tokens, tokens_per_s_cpu=round(tokens / cpu), bytes_per_token=round(text_bytes / tokens, 3))
    return out


def timed(fn):
    """(fn's result, CPU seconds, wall seconds) of one call."""
    wall, cpu, out = best_of({"run": fn}, 1)["run"]
    return out, cpu, wall


def sample_docs(cache: Path, n: int) -> list[dict]:
    """`n` cached documents evenly spaced over the cache (every source file represented)."""
    docs = load_web_docs(cache)
    step = max(1, len(docs) // n)
    return [{"id": d["id"], "text": d["text"], "source": d["source_file"], "source_file": d["source_file"]}
            for d in docs[::step][:n]]


def bench_exact(texts: list[str], text_bytes: int) -> dict:
    from tasks.dedup.exact import exact_key

    wall, cpu, _ = best_of({"keys": lambda: [exact_key(t) for t in texts]}, 3)["keys"]
    return rate(len(texts), text_bytes, cpu, wall)


def bench_line_dedup(cfg: PipelineConfig, shard: Path, docs: list[dict], text_bytes: int, work: Path) -> dict:
    from tasks.core.steps import StepStats, run_filters
    from tasks.dedup.lines import LineDedupFilter, count_frequent_lines

    # decide() imports the filters and loads spaCy's tokenizer on first use; a curate worker has them loaded
    importlib.import_module("tasks.curate.filters").real_word_count("warm up")
    lcfg, gq = cfg.curate.dedup.lines, cfg.curate.gopher_quality
    frequent, c_cpu, c_wall = timed(lambda: count_frequent_lines([shard], lcfg, work, method="local"))
    line_filter = LineDedupFilter(frequent.hashes, gq.min_doc_words if gq.enabled else 0)
    stats: dict[str, StepStats] = {}
    copies = [dict(d) for d in docs]  # the filter rewrites doc["text"]
    kept, a_cpu, a_wall = timed(lambda: list(run_filters(copies, [line_filter], stats)))
    st = stats["line_dedup"]
    assert st.balanced() and st.docs_in == len(docs)
    removed = line_filter.drain()
    return {"max_docs": lcfg.max_docs, "frequent_lines": len(frequent.hashes),
            "distinct_lines": frequent.stats["distinct_lines"], "line_rows": frequent.stats["line_rows"],
            "docs_out": len(kept), "dropped": dict(st.dropped),
            "lines_removed": sum(c["lines_removed"] for c in removed.values()),
            "docs_shortened": sum(c["docs_shortened"] for c in removed.values()),
            "count": rate(len(docs), text_bytes, c_cpu, c_wall),
            "apply": rate(len(docs), text_bytes, a_cpu, a_wall),
            "stage": rate(len(docs), text_bytes, c_cpu + a_cpu, c_wall + a_wall)}


def _score_all(worker, docs: list[dict], batch: int) -> list[dict]:
    return [r for k in range(0, len(docs), batch) for r in worker.score_batch(docs[k:k + batch])]


def bench_quality(cfg: PipelineConfig, docs: list[dict], text_bytes: int, work: Path) -> dict:
    from tasks.quality.classifier import train_classifier
    from tasks.quality.kenlm_lm import train_kenlm
    from tasks.quality.score import QualityWorker, decide

    q = cfg.quality
    clf, clf_cpu, clf_wall = timed(lambda: train_classifier(q.classifier, cfg.data_root, work / "classifier"))
    lm, _, lm_wall = timed(lambda: train_kenlm(q.kenlm, cfg.data_root, work / "kenlm"))
    both = QualityWorker(q, clf["model"], lm["model"])
    only_clf = QualityWorker(q, clf["model"], None)

    def score_and_decide() -> tuple[list[dict], dict]:
        records = _score_all(both, docs, q.batch_docs)
        return records, decide(records, q)

    (records, decided), s_cpu, s_wall = timed(score_and_decide)
    _, c_cpu, c_wall = timed(lambda: _score_all(only_clf, docs, q.batch_docs))
    assert len(records) == len(docs) and decided["docs_in"] == len(docs)
    return {
        "training": {"classifier": {"train_docs": clf["train_docs"], "heldout_roc_auc": clf["heldout"]["roc_auc"],
                                    "model_bytes": clf["model_bytes"], "cpu_s": round(clf_cpu, 2),
                                    "wall_s": round(clf_wall, 2)},
                     "kenlm": {"order": lm["order"], "docs": lm["docs"], "tokens": lm["tokens"],
                               "model_bytes": lm["model_bytes"], "wall_s": round(lm_wall, 2)}},
        "score": rate(len(docs), text_bytes, s_cpu, s_wall),  # both models + decide: the stage
        "classifier_only": rate(len(docs), text_bytes, c_cpu, c_wall),
        "docs_out": decided["docs_out"],
        "settings": {"classifier_keep_top_fraction": q.classifier.keep_top_fraction, "kenlm_order": q.kenlm.order,
                     "kenlm_drop_buckets": q.kenlm.drop_buckets, "batch_docs": q.batch_docs},
    }


def bench_tokens(cfg: PipelineConfig, shard: Path, train_shard: Path, work: Path) -> dict:
    from tasks.tokenizer.bpe import train_tokenizer
    from tasks.tokens.prepare import encode_shard

    tok, t_cpu, t_wall = timed(lambda: train_tokenizer(cfg, [train_shard], work / "tokenizer"))
    t = cfg.tokens
    out, e_cpu, e_wall = timed(lambda: encode_shard(tok["path"], str(shard), cfg.tokenizer.eos_token, t.batch_docs,
                                                    t.val_fraction, t.seed, str(work / "part-00000")))
    stats = out["stats"]
    docs = sum(s["docs"] for s in stats.values())
    text_bytes = sum(s["bytes"] for s in stats.values())
    tokens = sum(s["tokens"] for s in stats.values())  # one EOS per document included
    return {"training": {"vocab_size": tok["vocab_size"], "docs": tok["docs"], "bytes": tok["bytes"],
                         "heldout_bytes_per_token": tok["bytes_per_token"],
                         "cpu_s": round(t_cpu, 2), "wall_s": round(t_wall, 2)},
            "encode": rate(docs, text_bytes, e_cpu, e_wall, tokens),
            "threads": {"cpus_visible": os.cpu_count(), "TOKENIZERS_PARALLELISM": os.environ.get("TOKENIZERS_PARALLELISM")}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="extraction.py's cache of extracted pages")
    ap.add_argument("--out", default=str(HERE / "results" / "stage_rates.json"))
    add_int_options(ap, docs=4000, tokenizer_docs=1500)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="stage-rates-") as tmp:
        work = Path(tmp)
        cfg = load_config(CONFIG, [f"run_root={work / 'runs'}", "tokenizer.reference=false"])
        docs = sample_docs(Path(args.cache), args.docs)
        texts = [d["text"] for d in docs]
        text_bytes = sum(len(t.encode("utf-8")) for t in texts)
        [shard] = write_docs(docs, work / "docs", shard_docs=len(docs))
        [train_shard] = write_docs(docs[::max(1, len(docs) // args.tokenizer_docs)][:args.tokenizer_docs],
                                   work / "tokenizer-docs", shard_docs=len(docs))
        print(f"{len(docs)} docs, {text_bytes / 1e6:.1f} MB of text", file=sys.stderr)
        result = {"docs": len(docs), "text_bytes": text_bytes, "config": str(CONFIG.relative_to(REPO)),
                  "sources": sorted({d["source_file"] for d in docs})}
        result["exact_key"] = bench_exact(texts, text_bytes)
        result["line_dedup"] = bench_line_dedup(cfg, shard, docs, text_bytes, work / "lines")
        result["quality"] = bench_quality(cfg, docs, text_bytes, work / "quality")
        result["tokenization"] = bench_tokens(cfg, shard, train_shard, work / "tokens")
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result["note"] = ("per core = CPU seconds of this one process (all its threads); provisional figures "
                      "from a shared 2-core machine")
    write_result(args.out, result)
    print_summary(result)
    return result


def print_summary(r: dict) -> None:
    rows = [("exact_key", r["exact_key"]), ("line dedup (count+apply)", r["line_dedup"]["stage"]),
            ("  count", r["line_dedup"]["count"]), ("  apply", r["line_dedup"]["apply"]),
            ("quality (fastText+KenLM)", r["quality"]["score"]), ("  fastText only", r["quality"]["classifier_only"]),
            ("tokenization (encode+pack)", r["tokenization"]["encode"])]
    print(f"{'stage':<28}{'docs/s/core':>12}{'MB/s/core':>11}{'docs/s wall':>13}")
    for name, x in rows:
        print(f"{name:<28}{x['docs_per_s_cpu']:>12,.1f}{x['bytes_per_s_cpu'] / 1e6:>11.2f}{x['docs_per_s_wall']:>13,.1f}")
    enc = r["tokenization"]["encode"]
    print(f"tokens/s/core {enc['tokens_per_s_cpu']:,} ({enc['bytes_per_token']} bytes/token); "
          f"training: fastText {r['quality']['training']['classifier']['wall_s']} s, "
          f"KenLM {r['quality']['training']['kenlm']['wall_s']} s, "
          f"tokenizer {r['tokenization']['training']['wall_s']} s; total {r['seconds']} s")


if __name__ == "__main__":
    main()
