"""Does the quality reference overlap the corpus it judges?

A reference-vs-crawl classifier (and a KenLM model trained on the reference) scores a document by
how much it resembles the reference. If one crawled source *contains* reference text (the docs
crawl serves the same kernel documentation that the reference corpus holds), the models favour
that source for its content, not its quality, and the "curated" mix drifts towards it. This check
finds that: the reference's word 13-grams (normalised as decontamination normalises) form a
sorted hash index, and a document overlaps when at least `min_fraction` of its 13-grams are in
it. Up to `max_docs_per_source` documents per source are checked (first seen), during the
stage's own pass over its input. The index is cached beside the quality models, keyed by the
reference files' content hashes.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from tasks.config import PipelineConfig
from tasks.curate.decontam import ngram_hashes, normalise_words, require_sorted_hashes, sorted_positions
from tasks.quality.text import iter_corpus

NGRAM = 13


def reference_patterns(cfg: PipelineConfig) -> list[str]:
    """The reference corpus of the enabled quality models (classifier positives, KenLM reference)."""
    q, pats = cfg.quality, []
    if q.classifier.enabled:
        pats += q.classifier.positives
    if q.kenlm.enabled:
        pats += [p for p in q.kenlm.reference if p not in pats]
    return pats


def reference_index(patterns: list[str], data_root, files: list[dict], cache_dir: Path) -> np.ndarray:
    """Sorted unique 13-gram hashes of the reference files (cached by their content hashes)."""
    key = hashlib.sha256(json.dumps(sorted(f["sha256"] for f in files)).encode()).hexdigest()[:16]
    cached = Path(cache_dir) / f"reference-13grams-{key}.npy"
    if cached.is_file():
        index = np.load(cached)
        require_sorted_hashes(index, f"quality reference index {cached} (delete it to rebuild)")
        return index
    parts = [ngram_hashes(normalise_words(text), NGRAM) for _, text in iter_corpus(patterns, data_root, 10_000)]
    index = np.unique(np.concatenate(parts)) if parts else np.empty(0, dtype=np.uint64)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(".tmp.npy")
    np.save(tmp, index)
    tmp.replace(cached)
    return index


def overlap_fraction(text: str, index: np.ndarray) -> float:
    """Share of the document's 13-grams found in the reference index (0 for short documents)."""
    grams = ngram_hashes(normalise_words(text), NGRAM)
    if not len(grams) or not len(index):
        return 0.0
    return float((sorted_positions(index, grams) >= 0).mean())


class OverlapCounter:
    """Per source: documents checked and those overlapping the reference (≥ min_fraction of their
    13-grams), the first `max_docs_per_source` of each source; fed one document at a time by the
    stage's own pass over its input, so the check adds no read of the corpus."""

    def __init__(self, index: np.ndarray, min_fraction: float = 0.2, max_docs_per_source: int = 2000):
        self.index, self.min_fraction, self.max_docs = index, min_fraction, max_docs_per_source
        self.sources: dict[str, dict] = {}

    def add(self, source: str | None, text: str) -> None:
        s = self.sources.setdefault(source or "?", {"checked": 0, "overlapping": 0})
        if s["checked"] < self.max_docs:
            s["checked"] += 1
            s["overlapping"] += overlap_fraction(text, self.index) >= self.min_fraction

    def result(self, patterns: list[str], warn_fraction: float = 0.05) -> dict:
        """{"sources": per-source overlap, "warnings": [...]}: a warning names every source of which
        more than `warn_fraction` of the checked documents overlap the reference."""
        sources = {}
        for name, s in sorted(self.sources.items()):
            sources[name] = {**s, "fraction": round(s["overlapping"] / s["checked"], 4) if s["checked"] else 0.0}
        warnings = [f"quality reference overlaps source {name!r}: {s['overlapping']} of {s['checked']} documents "
                    f"share ≥ {100 * self.min_fraction:.0f} % of their 13-grams with {patterns}; the quality models "
                    "will favour it for its content, not its quality (use a reference that no crawled source "
                    "contains)" for name, s in sources.items() if s["fraction"] > warn_fraction]
        return {"reference": patterns, "ngram": NGRAM, "sources": sources, "warnings": warnings}


def overlap_counter(cfg: PipelineConfig, files: list[dict], cache_dir: Path) -> OverlapCounter | None:
    """A counter against the enabled quality models' reference (None when there is none)."""
    patterns = reference_patterns(cfg)
    return OverlapCounter(reference_index(patterns, cfg.data_root, files, cache_dir)) if patterns else None
