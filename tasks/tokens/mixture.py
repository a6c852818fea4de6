"""Mixture weights: each source's `mixture_weight` applied to the train split by up- or
down-sampling whole documents.

What a weight means. It multiplies the source's train tokens: a source with T_s natural train
tokens and weight w_s contributes w_s * T_s tokens, so its target share of the train split is
w_s * T_s / sum_r(w_r * T_r): the natural share scaled by the weight, renormalised. Every document
of the source is included floor(w_s) times; for the fractional part, further documents of the
source, in a seeded random order, are included once more until the source's tokens come closest
to w_s * T_s. A source therefore misses its target by at most half of one document, and its
effective token share is its target share up to that. w_s = 0 drops the source. A document
included zero times is dropped for the reason `mixture_weight`; per source, natural documents =
kept + dropped, and documents in the split = kept + repeats.

Order. When anything is resampled, the train split is every included document (each copy once)
in a seeded random order, so the copies of a repeated document are spread over the split rather
than adjacent. Deterministic for (tokens.mixture_seed, the input shards in order); the number of
encoding workers does not matter (parts are concatenated in shard order first). When every
document is included exactly once (every weight 1, or only sources of weight 1 present) nothing
is rewritten: the files are those of an unweighted build, byte for byte.

Validation is not weighted: the val split stays the natural held-out text of every source, so
validation loss remains comparable between runs with different mixtures (a mixture ablation is
scored on the same text), and it measures the corpus, not the sampling.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.core.hashing import sha256_text

DROP_REASON = "mixture_weight"


@dataclass
class MixturePlan:
    """How often each natural train document is included and in which order they are written."""
    copies: np.ndarray  # int64, one per natural document
    order: np.ndarray  # natural document indices in output order (one entry per copy)
    by_source: dict  # source -> counts, weight, target and effective share (see plan_mixture)

    @property
    def applied(self) -> bool:
        return bool((self.copies != 1).any())


def _source_rng(seed: int, source: str) -> np.random.Generator:
    # per source, so one source's draw does not depend on the others' weights
    return np.random.default_rng([seed, int(sha256_text(source)[:15], 16)])


def _fractional_pick(order: np.ndarray, lens: np.ndarray, target: float) -> np.ndarray:
    """The prefix of `order` whose tokens come closest to `target` (ties: the shorter prefix)."""
    prefix = np.concatenate(([0], np.cumsum(lens[order])))
    m = int(np.searchsorted(prefix, target))  # the shortest prefix reaching the target
    if m == len(prefix) or (m > 0 and target - prefix[m - 1] <= prefix[m] - target):
        m -= 1
    return order[:m]


def plan_mixture(lens: np.ndarray, source_ids: np.ndarray, source_names: list[str], weights: dict[str, float],
                 seed: int) -> MixturePlan:
    """The copies of each document (token lengths `lens`, source ids into `source_names`) under
    `weights` (source -> mixture_weight; 1 for a source not named). by_source[source]: weight,
    natural_docs, natural_tokens, target_tokens, target_share, docs (copies written), tokens,
    share, kept_docs, dropped_docs, repeats."""
    lens = np.asarray(lens, dtype=np.int64)
    source_ids = np.asarray(source_ids)
    copies = np.ones(len(lens), dtype=np.int64)
    members = {name: np.flatnonzero(source_ids == i) for i, name in enumerate(source_names)}
    for name, docs in members.items():
        w = float(weights.get(name, 1.0))
        if w == 1.0 or not docs.size:
            continue
        copies[docs] = int(w)
        if w > int(w):
            extra = _fractional_pick(_source_rng(seed, name).permutation(docs), lens, (w - int(w)) * lens[docs].sum())
            copies[extra] += 1
    target_total = sum(float(weights.get(n, 1.0)) * int(lens[d].sum()) for n, d in members.items())
    if len(lens) and not copies.any():
        raise ValueError("every source of the train split has mixture_weight 0: nothing would be left to train on")
    out_tokens = int((copies * lens).sum())
    by_source = {}
    for name, docs in members.items():
        if not docs.size:
            continue
        w, natural = float(weights.get(name, 1.0)), int(lens[docs].sum())
        tokens = int((copies[docs] * lens[docs]).sum())
        kept = int((copies[docs] > 0).sum())
        by_source[name] = {
            "weight": w, "natural_docs": int(docs.size), "natural_tokens": natural, "target_tokens": round(w * natural),
            "target_share": w * natural / target_total if target_total else 0.0,
            "docs": int(copies[docs].sum()), "tokens": tokens, "share": tokens / out_tokens if out_tokens else 0.0,
            "kept_docs": kept, "dropped_docs": int(docs.size) - kept, "repeats": int(copies[docs].sum()) - kept}
    order = np.arange(len(lens))
    if (copies != 1).any():
        order = np.random.default_rng([seed, len(lens)]).permutation(np.repeat(order, copies))
    return MixturePlan(copies, order, by_source)


def write_weighted_split(plan: MixturePlan, bin_path: Path, starts_path: Path, sources_path: Path,
                         starts: np.ndarray, source_ids: np.ndarray, dtype: np.dtype) -> None:
    """Rewrite one split's token file, document starts and document sources in the plan's order
    (the token file through a temporary file and a rename)."""
    starts = np.asarray(starts, dtype=np.int64)
    n_tokens = Path(bin_path).stat().st_size // dtype.itemsize
    ends = np.append(starts[1:], n_tokens)
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_tokens,)) if n_tokens else np.zeros(0, dtype)
    tmp = Path(f"{bin_path}.weighted.tmp")
    with open(tmp, "wb") as out:
        buffered, pending = 0, []
        for i in plan.order:
            pending.append(tokens[starts[i]:ends[i]])
            buffered += int(ends[i] - starts[i])
            if buffered >= 1 << 22:  # write about 4M tokens at a time
                np.concatenate(pending).tofile(out)
                buffered, pending = 0, []
        if pending:
            np.concatenate(pending).tofile(out)
    del tokens
    os.replace(tmp, bin_path)
    lens = (ends - starts)[plan.order]
    np.save(starts_path, np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64) if lens.size
            else np.zeros(0, dtype=np.int64))
    np.save(sources_path, np.asarray(source_ids, dtype=np.uint16)[plan.order])
