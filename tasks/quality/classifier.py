"""fastText quality classifier: reference text (positives) vs raw crawl text (negatives).

`train_classifier(cfg, data_root, out_dir)` samples up to `max_docs_per_class` documents per
class, normalises them (`ccnet_normalize`, one line each, first `max_chars` characters), holds
out `heldout_fraction` (stratified, seeded), trains `fasttext.train_supervised` with a small
`bucket` (the model stays a few MB; optionally quantised to .ftz) and reports held-out
precision/recall (at `threshold`, default 0.5) and ROC-AUC. It writes `quality.bin`
(+ `quality.ftz`) and `metrics.json`.

Scoring: `QualityScorer.score(texts)` gives P(reference) per document; `QualityClassifierFilter`
(a `Filter`) stores it in `doc["quality_score"]` and drops docs below the threshold with reason
"quality_classifier". Keeping a top fraction needs the whole corpus: `score_shards` scores first,
then `threshold_for_top_fraction` turns the fraction into a threshold.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from tasks.core.constants import REPO_ROOT
from tasks.config import QualityClassifierConfig
from tasks.core.steps import Filter
from tasks.quality.text import ccnet_normalize, sample_corpus

POS, NEG = "__label__hq", "__label__lq"


def ft_line(text: str, max_chars: int) -> str:
    return " ".join(ccnet_normalize(text[:max_chars]).split())


def roc_auc(labels: Sequence[int], scores: Sequence[float]) -> float:
    """Area under the ROC curve (Mann–Whitney U with average ranks for ties)."""
    y = np.asarray(labels, dtype=bool)
    s = np.asarray(scores, dtype=float)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s))
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average ranks over ties
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def binary_metrics(labels: Sequence[int], scores: Sequence[float], threshold: float) -> dict:
    y = np.asarray(labels, dtype=bool)
    pred = np.asarray(scores) >= threshold
    tp = int((pred & y).sum())
    fp = int((pred & ~y).sum())
    fn = int((~pred & y).sum())
    p = tp / (tp + fp) if tp + fp else 0.0
    r = tp / (tp + fn) if tp + fn else 0.0
    return {"precision": round(p, 4), "recall": round(r, 4), "f1": round(2 * p * r / (p + r) if p + r else 0.0, 4),
            "accuracy": round(float((pred == y).mean()), 4), "roc_auc": round(roc_auc(y, scores), 4),
            "n": int(len(y)), "positives": int(y.sum()), "threshold": threshold}


class QualityScorer:
    """A loaded fastText quality model; `score` gives P(reference) for each text."""

    def __init__(self, model_path: str | Path, max_chars: int = 5000):
        import fasttext

        self.model = fasttext.load_model(str(model_path))
        self.max_chars = max_chars

    def score(self, texts: Sequence[str]) -> np.ndarray:
        if not texts:
            return np.empty(0)
        labels, probs = self.model.predict([ft_line(t, self.max_chars) for t in texts], k=2)
        out = np.empty(len(texts))
        for i, (ls, ps) in enumerate(zip(labels, probs)):
            d = dict(zip(ls, ps))
            out[i] = float(d.get(POS, 1.0 - d.get(NEG, 1.0)))
        return np.clip(out, 0.0, 1.0)


def _fit(train_path: str, params: dict, out_path: str) -> float:
    """Train and save; on divergence ("Encountered NaN") retry with half the learning rate."""
    import fasttext

    lr = params["lr"]
    for attempt in range(4):
        try:
            model = fasttext.train_supervised(input=train_path, **{**params, "lr": lr})
            model.save_model(out_path)
            return lr
        except RuntimeError as e:
            if "NaN" not in str(e) or attempt == 3:
                raise
            lr /= 2
    raise AssertionError("unreachable")


def _fit_isolated(train_path: str, params: dict, out_path: Path) -> float:
    """`_fit` in a fresh interpreter: fastText training was seen to diverge (NaN at every
    learning rate) inside a long-lived process that had run other native code, never in a
    fresh one; the subprocess also keeps training's memory out of Ray workers and drivers."""
    code = ("import json,sys; from tasks.quality.classifier import _fit; "
            "print(json.dumps(_fit(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3])))")
    proc = subprocess.run([sys.executable, "-c", code, train_path, json.dumps(params), str(out_path)],
                          capture_output=True, text=True, cwd=str(REPO_ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"fastText training failed: {proc.stderr.strip()[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def train_classifier(cfg: QualityClassifierConfig, data_root: str | Path, out_dir: str | Path,
                     positives: list[str] | None = None, negatives: list[str] | None = None) -> dict:
    """Train on the configured corpora (or the given texts); returns the metrics dict."""
    import fasttext

    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    n = cfg.max_docs_per_class
    pos = positives if positives is not None else sample_corpus(cfg.positives, data_root, n, cfg.seed, cfg.passage_words)
    neg = negatives if negatives is not None else sample_corpus(cfg.negatives, data_root, n, cfg.seed + 1, cfg.passage_words)
    n_pos = n_neg = n
    if cfg.balance:
        n_pos = n_neg = min(n, len(pos), len(neg))
    rng = random.Random(cfg.seed)
    items = [(1, ft_line(t, cfg.max_chars)) for t in pos[:n_pos]] + [(0, ft_line(t, cfg.max_chars)) for t in neg[:n_neg]]
    items = [it for it in items if it[1]]
    train, held = [], []
    for label in (1, 0):  # stratified split
        group = [it for it in items if it[0] == label]
        rng.shuffle(group)
        k = max(1, int(len(group) * cfg.heldout_fraction))
        held += group[:k]
        train += group[k:]
    rng.shuffle(train)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False, dir=out_dir, encoding="utf-8") as f:
        for label, line in train:
            f.write(f"{POS if label else NEG} {line}\n")
        train_path = f.name
    try:
        bin_path = out_dir / "quality.bin"
        params = {"epoch": cfg.epoch, "lr": cfg.lr, "dim": cfg.dim, "wordNgrams": cfg.word_ngrams,
                  "minCount": cfg.min_count, "bucket": cfg.bucket, "thread": 1, "seed": cfg.seed, "verbose": 0}
        lr = _fit_isolated(train_path, params, bin_path)
        ftz_path = None
        if cfg.quantize:
            model = fasttext.load_model(str(bin_path))
            model.quantize(input=train_path, retrain=False, qnorm=True, cutoff=cfg.quantize_cutoff)
            ftz_path = out_dir / "quality.ftz"
            model.save_model(str(ftz_path))
    finally:
        os.unlink(train_path)
    scorer = QualityScorer(bin_path, cfg.max_chars)
    scores = scorer.score([line for _, line in held])
    metrics = {
        "model": str(bin_path), "model_bytes": bin_path.stat().st_size,
        "quantized": str(ftz_path) if ftz_path else None,
        "quantized_bytes": ftz_path.stat().st_size if ftz_path else None,
        "train_docs": len(train), "lr": lr, "heldout": binary_metrics([lab for lab, _ in held], scores, cfg.threshold or 0.5),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def threshold_for_top_fraction(scores: Sequence[float], fraction: float) -> float:
    """The score at or above which `fraction` of the documents lie."""
    s = np.sort(np.asarray(scores, dtype=float))[::-1]
    if len(s) == 0:
        return 0.0
    k = max(1, int(np.ceil(len(s) * fraction)))
    return float(s[k - 1])


class QualityClassifierFilter(Filter):
    """Scores each document (doc["quality_score"]); drops it below `threshold` (None: tag only)."""

    name = "quality_classifier"

    def __init__(self, model_path: str | Path, threshold: float | None = 0.5, max_chars: int = 5000):
        self.scorer = QualityScorer(model_path, max_chars)
        self.threshold = threshold

    def decide(self, doc: dict) -> str | None:
        score = float(self.scorer.score([doc["text"]])[0])
        doc["quality_score"] = score
        if self.threshold is not None and score < self.threshold:
            return "quality_classifier"
        return None
