"""Deduplication report: duplicate rate per source, cluster-size histogram, example pairs.

`dedup_report` takes the documents that entered deduplication (ids and sources, in corpus
order) and the dedup drops (id, step, duplicate_of); a cluster is a kept document with every
document that points to it, directly or through a chain (an exact copy of a document that was
later dropped as a near duplicate joins that document's survivor). Example pairs (kept,
duplicate) come from the largest clusters first, each with the Jaccard estimated from the
MinHash signatures and, when the texts are given, the exact shingle Jaccard.

`report_metrics` flattens it for MLflow, `report_tables` / `report_markdown` render it for
the curate stage's reports (`tasks.curate.stage.curation_reports`).
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Mapping, Sequence

import numpy as np


def size_bucket(size: int) -> str:
    """2, 3, 4, then powers of two: "5-8", "9-16", ..."""
    if size <= 4:
        return str(size)
    hi = 1 << (size - 1).bit_length()
    return f"{hi // 2 + 1}-{hi}"


def _bucket_key(label: str) -> int:
    return int(label.split("-")[0])


def dedup_report(ids: Sequence[str], sources: Sequence[str], drops: Sequence[tuple[str, str, str]],
                 signatures: Mapping[str, np.ndarray] | None = None, texts: Mapping[str, str] | None = None,
                 ngram: int = 5, max_examples: int = 10) -> dict:
    """`drops`: (id, step, duplicate_of) for every document dedup removed."""
    source_of = dict(zip(ids, sources))
    report = report_from_drops(Counter(s or "" for s in sources), len(ids), drops,
                               [source_of.get(d) for d, _, _ in drops], {d: i for i, d in enumerate(ids)},
                               source_of, max_examples)
    if signatures is not None:
        for ex in report["examples"]:
            if ex["kept"] in signatures and ex["duplicate"] in signatures:
                a, b = signatures[ex["kept"]], signatures[ex["duplicate"]]
                if a is not None and b is not None:
                    ex["jaccard_estimate"] = round(float(np.mean(a == b)), 4)
    if texts is not None:
        add_text_jaccard(report, texts, ngram)
    return report


def report_from_drops(docs_by_source: Mapping[str, int], n_docs: int, drops: Sequence[tuple[str, str, str]],
                      drop_sources: Sequence[str | None], pos_of: Mapping[str, int],
                      source_of: Mapping[str, str | None], max_examples: int = 10) -> dict:
    """The report from the drops alone (what curate's dedup files hold): `docs_by_source` of the
    `n_docs` documents that entered dedup, `drop_sources` aligned with `drops`, `pos_of` the
    corpus position of the dropped and the kept documents named in `drops` (for the examples'
    order), `source_of` the kept documents' sources. No signature or text Jaccard filled in."""
    parent = {d: dup_of for d, _, dup_of in drops}
    step_of = {d: step for d, step, _ in drops}
    src_of = dict(source_of)
    src_of.update({d: s for (d, _, _), s in zip(drops, drop_sources)})

    def survivor(doc_id: str) -> str:
        seen = 0
        while doc_id in parent and seen <= len(parent):
            doc_id, seen = parent[doc_id], seen + 1
        return doc_id

    members: dict[str, list[str]] = {}
    for d, _, _ in drops:
        members.setdefault(survivor(d), []).append(d)

    step_counts = Counter((src or "", step) for (_, step, _), src in zip(drops, drop_sources))
    sizes = Counter(size_bucket(len(m) + 1) for m in members.values())
    examples = []
    order = sorted(members, key=lambda k: (-len(members[k]), pos_of.get(k, n_docs)))
    for kept in order:
        if len(examples) >= max_examples:
            break
        dup = members[kept][0]
        examples.append({"kept": kept, "duplicate": dup, "step": step_of[dup], "cluster_size": len(members[kept]) + 1,
                         "source_kept": src_of.get(kept) or "", "source_duplicate": src_of.get(dup) or ""})
    return assemble_report(docs_by_source, n_docs, step_counts, len(drops), sizes, len(members),
                           max((len(m) + 1 for m in members.values()), default=1), examples)


def assemble_report(docs_by_source: Mapping[str, int], n_docs: int, step_counts: Mapping[tuple[str, str], int],
                    n_drops: int, sizes: Mapping[str, int], clusters: int, largest: int, examples: list[dict]) -> dict:
    """The report from its merged parts (what `report_from_drops` computes in one process and the
    curate stage's partitioned report tasks per partition): drops per (source, step), cluster
    sizes by `size_bucket` of the clusters with duplicates, their count and largest size, examples."""
    by_source: dict[str, Counter] = {}
    for src, n in docs_by_source.items():
        by_source.setdefault(src or "", Counter())["docs"] += n
    for (src, step), n in step_counts.items():
        by_source.setdefault(src or "", Counter())[step] += n
    per_source = {}
    for src, c in sorted(by_source.items()):
        dups = sum(v for k, v in c.items() if k != "docs")
        per_source[src] = {"docs": c["docs"], "duplicates": dups,
                           "url_duplicates": c.get("url_dedup", 0),
                           "exact_duplicates": c.get("exact_dedup", 0),
                           "near_duplicates": c.get("minhash_dedup", 0),
                           "index_duplicates": c.get("minhash_index", 0),
                           "duplicate_rate": round(dups / c["docs"], 4) if c["docs"] else 0.0}
    histogram = {"1": n_docs - n_drops - clusters}  # kept documents without copies
    histogram.update({k: sizes[k] for k in sorted(sizes, key=_bucket_key) if sizes[k]})
    return {"docs": n_docs, "duplicates": n_drops,
            "duplicate_rate": round(n_drops / n_docs, 4) if n_docs else 0.0,
            "clusters_with_duplicates": clusters, "largest_cluster": largest,
            "by_source": per_source, "cluster_sizes": histogram, "examples": examples}


def example_ids(report: dict) -> set[str]:
    return {e[k] for e in report["examples"] for k in ("kept", "duplicate")}


def add_text_jaccard(report: dict, texts: Mapping[str, str], ngram: int = 5) -> dict:
    """Fill each example's exact shingle Jaccard from the texts (where both are given)."""
    from tasks.dedup.minhash import jaccard, shingles

    for ex in report["examples"]:
        if ex["kept"] in texts and ex["duplicate"] in texts:
            a, b = shingles(texts[ex["kept"]], ngram), shingles(texts[ex["duplicate"]], ngram)
            ex["jaccard"] = round(jaccard(a, b), 4)
    return report


def _metric_name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_\-. /]", "_", s) or "_"


def report_metrics(report: dict) -> dict[str, float]:
    """Flat MLflow metrics: dedup.duplicate_rate, dedup.source.<src>.duplicate_rate, ..."""
    m = {"dedup.docs": report["docs"], "dedup.duplicates": report["duplicates"],
         "dedup.duplicate_rate": report["duplicate_rate"],
         "dedup.clusters_with_duplicates": report["clusters_with_duplicates"],
         "dedup.largest_cluster": report["largest_cluster"]}
    for src, s in report["by_source"].items():
        m[f"dedup.source.{_metric_name(src)}.duplicate_rate"] = s["duplicate_rate"]
    for bucket, n in report["cluster_sizes"].items():
        m[f"dedup.cluster_size.{bucket}"] = n
    return m


def report_tables(report: dict) -> dict[str, list[dict]]:
    return {
        "by_source": [{"source": s, **v} for s, v in report["by_source"].items()],
        "cluster_sizes": [{"cluster_size": k, "clusters": v} for k, v in report["cluster_sizes"].items()],
        "examples": [dict(e) for e in report["examples"]],
    }


def report_markdown(report: dict) -> str:
    lines = ["# Deduplication report", "",
             f"{report['duplicates']:,} of {report['docs']:,} documents removed as duplicates "
             f"({100 * report['duplicate_rate']:.2f} %) in {report['clusters_with_duplicates']:,} clusters; "
             f"the largest has {report['largest_cluster']:,} documents.", "",
             "## Duplicate rate per source", "", "| source | docs | URL | exact | near | rate |",
             "|---|---:|---:|---:|---:|---:|"]
    for s, v in report["by_source"].items():
        lines.append(f"| {s or '(none)'} | {v['docs']} | {v.get('url_duplicates', 0)} | {v['exact_duplicates']} "
                     f"| {v['near_duplicates']} | {100 * v['duplicate_rate']:.2f} % |")
    lines += ["", "## Cluster sizes", "", "| documents per cluster | clusters |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in report["cluster_sizes"].items()]
    lines += ["", "## Example pairs", "",
              "| kept | duplicate | step | cluster size | Jaccard (MinHash) | Jaccard (exact) |",
              "|---|---|---|---:|---:|---:|"]
    for e in report["examples"]:
        lines.append(f"| {e['kept']} | {e['duplicate']} | {e['step']} | {e['cluster_size']} "
                     f"| {e.get('jaccard_estimate', '–')} | {e.get('jaccard', '–')} |")
    return "\n".join(lines) + "\n"
