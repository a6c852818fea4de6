"""CCNet-style KenLM perplexity: train on a reference corpus, score, bucket head/middle/tail.

Training (`train_kenlm`): the reference documents are normalised (`ccnet_normalize`) and
tokenised (`lm_tokens`), one line (paragraph) per line of text, piped to KenLM's `lmplz -o
<order>` (with `--discount_fallback`, so small corpora train too) and compiled with
`build_binary`. The binaries come from `cfg.bin_dir`, else
infra/.build/kenlm/bin (built by infra/build_kenlm.sh).

Scoring (as CCNet's `DocLM`): for every non-empty normalised line, log10 P(line) =
`model.score(line)` (with <s> and </s>) over len(tokens) + 1 predictions; a document's
perplexity is 10 ** (−Σ log10 P / Σ (tokens + 1)) over its lines.

Bucketing (as CCNet's `PerplexityBucket`): per source, perplexity below the 30th percentile is
"head", below the 60th "middle", else "tail" (`kenlm.head_percentile` / `tail_percentile`).
`KenLMFilter` tags doc["perplexity"] / doc["kenlm_bucket"] and drops buckets listed in
`kenlm.drop_buckets` (reason "kenlm_<bucket>") given per-source cut-offs.
"""
from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from tasks.core.constants import REPO_ROOT
from tasks.config import KenLMConfig
from tasks.core.steps import Filter
from tasks.quality.text import ccnet_normalize, lm_tokens, sample_corpus

BUCKETS = ("head", "middle", "tail")


def kenlm_bin_dir(cfg: KenLMConfig | None = None) -> Path:
    for cand in ((cfg.bin_dir if cfg else None), str(REPO_ROOT / "infra" / ".build" / "kenlm" / "bin")):
        if cand and (Path(cand) / "lmplz").exists():
            return Path(cand)
    raise FileNotFoundError("KenLM lmplz not found: set quality.kenlm.bin_dir, "
                            "or build it with infra/build_kenlm.sh")


def lm_lines(text: str) -> list[str]:
    """The normalised, tokenised lines of a document, as the LM sees them."""
    return [" ".join(toks) for toks in (lm_tokens(ln) for ln in ccnet_normalize(text).split("\n")) if toks]


def train_kenlm(cfg: KenLMConfig, data_root: str | Path, out_dir: str | Path,
                texts: Iterable[str] | None = None) -> dict:
    """Train `out_dir/kenlm.arpa` → `out_dir/kenlm.binary`; returns a summary dict."""
    t0 = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    bins = kenlm_bin_dir(cfg)
    docs = list(texts) if texts is not None else sample_corpus(cfg.reference, data_root, cfg.max_docs)
    arpa, binary = out_dir / "kenlm.arpa", out_dir / "kenlm.binary"
    cmd = [str(bins / "lmplz"), "-o", str(cfg.order), "-S", cfg.memory, "-T", str(out_dir),
           "--discount_fallback", "--arpa", str(arpa)]
    if cfg.prune:
        cmd += ["--prune", *map(str, cfg.prune)]
    n_lines = n_tokens = 0
    with open(out_dir / "lmplz.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=log, stderr=log)
        try:
            for doc in docs:
                for line in lm_lines(doc):
                    proc.stdin.write(line.encode("utf-8") + b"\n")
                    n_lines += 1
                    n_tokens += line.count(" ") + 1
        finally:
            proc.stdin.close()
            rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"lmplz failed ({rc}); see {out_dir / 'lmplz.log'}")
    subprocess.run([str(bins / "build_binary"), str(arpa), str(binary)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    arpa.unlink()
    summary = {"model": str(binary), "model_bytes": binary.stat().st_size, "order": cfg.order,
               "docs": len(docs), "lines": n_lines, "tokens": n_tokens,
               "seconds": round(time.perf_counter() - t0, 2)}
    (out_dir / "kenlm.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


class PerplexityScorer:
    """A loaded KenLM model (ARPA or binary)."""

    def __init__(self, model_path: str | Path):
        import kenlm

        self.model = kenlm.Model(str(model_path))

    def log10_and_length(self, text: str) -> tuple[float, int]:
        total, length = 0.0, 0
        for line in lm_lines(text):
            total += self.model.score(line, bos=True, eos=True)
            length += line.count(" ") + 2  # tokens + </s>
        return total, length

    def perplexity(self, text: str) -> float:
        """10 ** (−Σ log10 P / Σ tokens); inf for a document with no tokens."""
        total, length = self.log10_and_length(text)
        if length == 0:
            return float("inf")
        return round(10.0 ** (-total / length), 1)


def percentile_cutoffs(perplexities: Sequence[float], sources: Sequence[str] | None = None,
                       head: float = 30, tail: float = 60) -> dict[str, tuple[float, float]]:
    """Per source: (head cut-off, tail cut-off) = the `head`th and `tail`th percentiles."""
    pp = np.asarray(perplexities, dtype=float)
    src = np.asarray(sources if sources is not None else ["*"] * len(pp), dtype=object)
    out = {}
    for s in sorted(set(src.tolist())):
        vals = pp[(src == s) & np.isfinite(pp)]
        if len(vals):
            out[str(s)] = (float(np.percentile(vals, head)), float(np.percentile(vals, tail)))
    return out


def bucket_of(pp: float, cutoffs: tuple[float, float]) -> str:
    lo, hi = cutoffs
    if pp < lo:
        return "head"
    if pp < hi:
        return "middle"
    return "tail"


def bucketize(perplexities: Sequence[float], sources: Sequence[str] | None = None,
              head: float = 30, tail: float = 60) -> list[str]:
    """Bucket each perplexity against its own source's percentiles."""
    src = list(sources) if sources is not None else ["*"] * len(perplexities)
    cuts = percentile_cutoffs(perplexities, src, head, tail)
    return [bucket_of(p, cuts[s]) if s in cuts else "tail" for p, s in zip(perplexities, src)]


class KenLMFilter(Filter):
    """Tags doc["perplexity"] and, given per-source cut-offs, doc["kenlm_bucket"]; drops the
    buckets in `drop_buckets`. Without cut-offs it tags the perplexity only."""

    name = "kenlm"

    def __init__(self, model_path: str | Path, cutoffs: dict[str, tuple[float, float]] | None = None,
                 drop_buckets: Sequence[str] = ()):
        self.scorer = PerplexityScorer(model_path)
        self.cutoffs = cutoffs or {}
        self.drop = set(drop_buckets)

    def decide(self, doc: dict) -> str | None:
        pp = self.scorer.perplexity(doc["text"])
        doc["perplexity"] = pp
        cut = self.cutoffs.get(doc.get("source") or "*", self.cutoffs.get("*"))
        if cut is not None:
            b = bucket_of(pp, cut)
            doc["kenlm_bucket"] = b
            if b in self.drop:
                return f"kenlm_{b}"
        return None
