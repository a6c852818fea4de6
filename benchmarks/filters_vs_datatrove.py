"""Heuristic filter chain: Crucible vs datatrove on the same real documents, side by side.

Documents: the text that the ingest stage extracts from ../shared/data/web (docs-crawl WARC
shards, wget sample, whirlwind, plus the Common Crawl JSONL samples), extracted once by
`extraction.py` and cached (default: $TMPDIR/crucible-bench-web).

Chain, in FineWeb's order and with FineWeb's settings: Gopher repetition → Gopher quality → C4
(`filter_no_terminal_punct=False`) → FineWeb quality. Crucible runs `tasks.curate.filters`
built from the default `CurateConfig`; datatrove (the `bench` extra) runs its own filter classes
with every threshold taken from that same config. Both split English into words and sentences
with spaCy's rules (datatrove through `spacy.blank("en")` + sentencizer, Crucible through
`tasks.curate.text`). Each filter's `filter(doc)` is called directly (no
pipeline/stats overhead on datatrove's side), one process; docs/s/core is documents per CPU-second
of that process (robust on a shared, busy machine; wall time is reported too). Runs are
interleaved and the best of `--repeats` is kept.

Reports docs/s/core for both, the speed-up, and the keep/drop agreement (plus agreement on the
exact rule); disagreeing documents are written to the results for inspection.
Writes benchmarks/results/filters_vs_datatrove.json.

    python benchmarks/filters_vs_datatrove.py [--cache DIR] [--docs N] [--repeats 2]
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import write_result  # noqa: E402
from extraction import DEFAULT_CACHE, load_web_docs  # noqa: E402

from tasks.config import CurateConfig  # noqa: E402

HERE = Path(__file__).resolve().parent


def crucible_chain(cfg: CurateConfig):
    """The pipeline's own heuristic chain (FILTER_ORDER), less language ID, which datatrove's chain lacks."""
    from tasks.curate.filters import build_filters

    return build_filters(cfg.model_copy(update={"langid": cfg.langid.model_copy(update={"enabled": False})}))


def datatrove_chain(cfg: CurateConfig):
    from datatrove.pipeline.filters import (C4QualityFilter, FineWebQualityFilter, GopherQualityFilter,
                                            GopherRepetitionFilter)

    gr, gq, c4, fw = cfg.gopher_repetition, cfg.gopher_quality, cfg.c4, cfg.fineweb
    return [
        GopherRepetitionFilter(dup_line_frac=gr.dup_line_frac, dup_para_frac=gr.dup_para_frac,
                               dup_line_char_frac=gr.dup_line_char_frac, dup_para_char_frac=gr.dup_para_char_frac,
                               top_n_grams=tuple(sorted(gr.top_n_grams.items())),
                               dup_n_grams=tuple(sorted(gr.dup_n_grams.items()))),
        GopherQualityFilter(min_doc_words=gq.min_doc_words, max_doc_words=gq.max_doc_words,
                            min_avg_word_length=gq.min_avg_word_length, max_avg_word_length=gq.max_avg_word_length,
                            max_symbol_word_ratio=gq.max_symbol_word_ratio,
                            max_bullet_lines_ratio=gq.max_bullet_lines_ratio,
                            max_ellipsis_lines_ratio=gq.max_ellipsis_lines_ratio,
                            max_non_alpha_words_ratio=gq.max_non_alpha_words_ratio,
                            min_stop_words=gq.min_stop_words, stop_words=list(gq.stop_words)),
        C4QualityFilter(split_paragraph=True, remove_citations=c4.remove_citations,
                        filter_no_terminal_punct=c4.filter_no_terminal_punct, min_num_sentences=c4.min_num_sentences,
                        min_words_per_line=c4.min_words_per_line, max_word_length=c4.max_word_length,
                        filter_lorem_ipsum=c4.filter_lorem_ipsum, filter_javascript=c4.filter_javascript,
                        filter_curly_bracket=c4.filter_curly_bracket, filter_policy=c4.filter_policy),
        FineWebQualityFilter(line_punct_thr=fw.line_punct_thr, line_punct_exclude_zero=fw.line_punct_exclude_zero,
                             short_line_thr=fw.short_line_thr, short_line_length=fw.short_line_length,
                             char_duplicates_ratio=fw.char_duplicates_ratio, new_line_ratio=fw.new_line_ratio),
    ]


_DT_NAMES = ["gopher_repetition", "gopher_quality", "c4", "fineweb"]


def run_crucible(chain, texts: list[str]) -> list[str | None]:
    out = []
    for text in texts:
        doc = {"text": text}
        reason = None
        for f in chain:
            reason = f.decide(doc)
            if reason is not None:
                break
        out.append(reason)
    return out


def run_datatrove(chain, texts: list[str]) -> list[str | None]:
    from datatrove.data import Document

    out = []
    for i, text in enumerate(texts):
        doc = Document(text=text, id=str(i))
        reason = None
        for name, f in zip(_DT_NAMES, chain):
            res = f.filter(doc)
            if res is not True:
                rule = res[1] if isinstance(res, tuple) else "rejected"
                reason = f"{name}:{rule}"
                break
        out.append(reason)
    return out


def warm_up(dt_chain, texts: list[str]) -> None:
    """Load spaCy's English tokenizer (lazily built by datatrove) outside the timed runs."""
    run_datatrove(dt_chain, texts[:5])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default=str(DEFAULT_CACHE))
    p.add_argument("--docs", type=int, default=None, help="use only the first N documents")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--show", type=int, default=40, help="disagreeing documents kept in the results")
    p.add_argument("--out", default=str(HERE / "results" / "filters_vs_datatrove.json"))
    args = p.parse_args(argv)

    try:
        import datatrove  # noqa: F401
        import spacy  # noqa: F401
    except ImportError as e:
        sys.exit(f"this benchmark needs the 'bench' extra: .venv/bin/pip install -e '.[bench]' ({e})")
    from importlib.metadata import version

    docs = load_web_docs(Path(args.cache))
    if args.docs:
        docs = docs[:args.docs]
    texts = [d["text"] for d in docs]
    cfg = CurateConfig()
    ours, theirs = crucible_chain(cfg), datatrove_chain(cfg)
    warm_up(theirs, texts)

    best = {"crucible": float("inf"), "datatrove": float("inf")}  # CPU seconds of this process
    wall = dict(best)
    decisions: dict[str, list] = {}
    for r in range(args.repeats):
        for name, fn, chain in (("crucible", run_crucible, ours), ("datatrove", run_datatrove, theirs)):
            c0, t0 = time.process_time(), time.perf_counter()
            decisions[name] = fn(chain, texts)
            cpu, dt = time.process_time() - c0, time.perf_counter() - t0
            best[name] = min(best[name], cpu)
            wall[name] = min(wall[name], dt)
            print(f"  run {r + 1}: {name} {len(texts) / cpu:.1f} docs per CPU-second ({dt:.1f} s wall)",
                  file=sys.stderr)

    a, b = decisions["crucible"], decisions["datatrove"]
    n = len(texts)
    same_keep = sum((x is None) == (y is None) for x, y in zip(a, b))
    same_rule = sum(x == y for x, y in zip(a, b))
    disagree = [i for i in range(n) if (a[i] is None) != (b[i] is None)]
    rule_diff = Counter(f"{a[i] or 'keep'} | {b[i] or 'keep'}" for i in disagree)
    result = {
        "documents": n,
        "source_files": dict(Counter(d["source_file"] for d in docs)),
        "chain": "gopher_repetition -> gopher_quality -> c4 (filter_no_terminal_punct=False) -> fineweb",
        "datatrove_version": version("datatrove"), "spacy_version": version("spacy"),
        "timing": "CPU time of this single process (robust on a shared machine); wall time for reference",
        "crucible": {"cpu_seconds": round(best["crucible"], 3), "wall_seconds": round(wall["crucible"], 3),
                     "docs_per_s_per_core": round(n / best["crucible"], 1),
                     "kept": sum(x is None for x in a), "reasons": dict(Counter(x for x in a if x).most_common())},
        "datatrove": {"cpu_seconds": round(best["datatrove"], 3), "wall_seconds": round(wall["datatrove"], 3),
                      "docs_per_s_per_core": round(n / best["datatrove"], 1),
                      "kept": sum(x is None for x in b), "reasons": dict(Counter(x for x in b if x).most_common())},
        "speedup": round(best["datatrove"] / best["crucible"], 2),
        "keep_drop_agreement": round(same_keep / n, 5),
        "rule_agreement": round(same_rule / n, 5),
        "disagreements": len(disagree),
        "disagreement_pairs": dict(rule_diff.most_common()),
        "disagreeing_docs": [{"id": docs[i]["id"], "source_file": docs[i]["source_file"], "crucible": a[i],
                              "datatrove": b[i], "text_head": docs[i]["text"][:300]} for i in disagree[:args.show]],
        "targets": {"speedup_min": 2.0, "agreement_min": 0.995},
    }
    print(f"{n} documents: crucible {result['crucible']['docs_per_s_per_core']} docs/s/core, "
          f"datatrove {result['datatrove']['docs_per_s_per_core']} docs/s/core -> {result['speedup']}x; "
          f"keep/drop agreement {100 * result['keep_drop_agreement']:.2f} % "
          f"(same rule {100 * result['rule_agreement']:.2f} %), {len(disagree)} disagreements")
    write_result(args.out, result, indent=1, ensure_ascii=False)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
