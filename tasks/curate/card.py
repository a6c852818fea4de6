"""DATASET_CARD.md for a curated data set: sources and licences, each step with its thresholds
and drop rate, decontamination and PII figures, languages, sizes.

Written by `run_curate` next to the shards from its summary and the config only (no timings,
no absolute paths other than the benchmark files), so the same data gives the same card.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from tasks.config import PipelineConfig
from tasks.core.io import atomic_write_text

# step name -> config section (attribute path under cfg.curate) holding its thresholds
_STEP_SECTIONS = {
    "langid": "langid", "gopher_repetition": "gopher_repetition", "gopher_quality": "gopher_quality",
    "c4": "c4", "fineweb": "fineweb", "decontam": "decontam", "pii": "pii",
    "exact_dedup": None, "minhash_dedup": "dedup.minhash", "minhash_index": "dedup.minhash",
    "line_dedup": "dedup.lines", "url_dedup": "dedup.url",
}


def _section(cfg: PipelineConfig, path: str | None) -> dict:
    if path is None:
        return {"key": "sha1 of lower-cased, whitespace-collapsed text"}
    node = cfg.curate
    for part in path.split("."):
        node = getattr(node, part)
    d = node.model_dump(exclude={"enabled"})
    if path == "decontam":
        d["benchmarks"] = [f"{b['name']} ({b['path']})" for b in d["benchmarks"]]
    return d


def _fmt(v) -> str:
    s = json.dumps(v, ensure_ascii=False) if not isinstance(v, str) else v
    return s.replace("|", "\\|")


def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def render_dataset_card(cfg: PipelineConfig, summary: dict) -> str:
    out: list[str] = []
    w = out.append
    w(f"# Dataset card: {cfg.name} (curated)\n")
    w(f"{summary['docs_out']:,} documents ({_size(summary.get('bytes_out', 0))} of UTF-8 text) in "
      f"{len(summary['shards'])} Parquet shard(s), kept from {summary['docs_in']:,} ingested documents "
      f"({_pct(summary['docs_out'], summary['docs_in'])}).\n")

    w("## Sources\n")
    w("| source | licence | provenance | PII policy | mixture weight | retention | docs in | docs out |")
    w("|---|---|---|---|---:|---|---:|---:|")
    per_source = summary.get("sources", {})
    known = set()
    for s in cfg.sources:
        known.add(s.name)
        c = per_source.get(s.name, {})
        w(f"| {s.name} | {_fmt(s.licence)} | {_fmt(s.provenance)} | {s.pii_policy} | {s.mixture_weight:g} | "
          f"{_fmt(s.retention) if s.retention else 'not stated'} | {c.get('docs_in', 0):,} | {c.get('docs_out', 0):,} |")
    for name, c in per_source.items():
        if name not in known:
            w(f"| {name or '(none)'} | (not in registry) | | {cfg.curate.pii.default_policy} | | | "
              f"{c['docs_in']:,} | {c['docs_out']:,} |")
    w("\nMixture weights are applied when the token shards are built (train split only); the token shards' "
      "card (`tokens/DATASET_CARD.md`) gives each source's target and effective token share.\n")

    w("## Processing steps\n")
    w("Steps run in this order; each sees only what the previous one kept.\n")
    w("| step | docs in | docs out | dropped | drop rate | thresholds |")
    w("|---|---:|---:|---:|---:|---|")
    for st in summary["steps"]:
        n_drop = sum(st["dropped"].values())
        params = _section(cfg, _STEP_SECTIONS.get(st["name"])) if st["name"] in _STEP_SECTIONS else {}
        ptxt = "; ".join(f"{k}={_fmt(v)}" for k, v in params.items())
        w(f"| {st['name']} | {st['docs_in']:,} | {st['docs_out']:,} | {n_drop:,} | "
          f"{_pct(n_drop, st['docs_in'])} | {ptxt} |")
    w("")
    w("### Drop reasons\n")
    w("| reason | documents | share of input |")
    w("|---|---:|---:|")
    reasons = sorted(summary["dropped"].items(), key=lambda kv: (-kv[1], kv[0]))
    for reason, n in reasons[:25]:
        w(f"| {reason} | {n:,} | {_pct(n, summary['docs_in'])} |")
    if len(reasons) > 25:
        rest = sum(n for _, n in reasons[25:])
        w(f"| {len(reasons) - 25} other reasons (see the summary) | {rest:,} | {_pct(rest, summary['docs_in'])} |")
    w("")

    dc = summary.get("decontam")
    w("## Decontamination\n")
    if dc:
        w(f"Documents sharing any normalised {cfg.curate.decontam.n}-gram with an evaluation set were "
          f"dropped (index of {dc['index_ngrams']:,} distinct n-grams). Details: `{os.path.basename(dc['report'])}`.\n")
        w("| benchmark | documents dropped | benchmark items hit |")
        w("|---|---:|---:|")
        for b in cfg.curate.decontam.benchmarks:
            w(f"| {b.name} | {dc['docs_dropped'].get(b.name, 0):,} | {dc['items_hit'].get(b.name, 0):,} |")
    else:
        w("Disabled.")
    w("")

    pii = summary.get("pii") or {}
    w("## Personal information\n")
    if cfg.curate.pii.enabled:
        w("E-mail addresses, public IP addresses and phone numbers were replaced by `<EMAIL>`, "
          "`<IP_ADDRESS>` and `<PHONE>` in sources with policy `redact`.\n")
        w("| source | documents changed | replacements |")
        w("|---|---:|---|")
        for src, counts in pii.get("replacements", {}).items():
            w(f"| {src or '(none)'} | {pii.get('docs_changed', {}).get(src, 0):,} | "
              f"{', '.join(f'{k}: {v:,}' for k, v in counts.items())} |")
        if not pii.get("replacements"):
            w("| (none found) | 0 | |")
    else:
        w("Disabled: text may contain personal information.")
    w("")

    w("## Languages\n")
    w("| language | documents out | share |")
    w("|---|---:|---:|")
    for lang, n in summary.get("languages_out", {}).items():
        w(f"| {lang} | {n:,} | {_pct(n, summary['docs_out'])} |")
    seen = summary.get("languages", {})
    if seen:
        top = ", ".join(f"{k}: {v:,}" for k, v in list(seen.items())[:15])
        w(f"\nLanguage id over all {sum(seen.values()):,} documents it saw (top 15): {top}.")
    w("")

    w("## Files\n")
    for p in summary["shards"]:
        w(f"- `{Path(p).name}`")
    w("\nPer-shard sha256 and row counts: `manifest.json`. Why each missing document was dropped: "
      "`dropped.jsonl`.\n")
    return "\n".join(out)


def write_dataset_card(cfg: PipelineConfig, summary: dict, path: str | Path) -> Path:
    return atomic_write_text(path, render_dataset_card(cfg, summary))


def _share(x: float) -> str:
    return f"{100 * x:.1f}%"


def render_token_card(cfg: PipelineConfig, index: dict) -> str:
    """The token shards' card (the tokens stage writes it beside index.json): per source its licence,
    mixture weight, natural train tokens, target and effective token share and the documents the
    weighting dropped or repeated (index["mixture"], tasks/tokens/mixture.py), and the splits."""
    mixture, splits, registry = index["mixture"], index["splits"], {s.name: s for s in cfg.sources}
    out: list[str] = []
    w = out.append
    w(f"# Dataset card: {cfg.name} (token shards)\n")
    w(f"{splits['train']['tokens']:,} train tokens in {splits['train']['docs']:,} documents, "
      f"{splits['val']['tokens']:,} validation tokens in {splits['val']['docs']:,} documents ({index['dtype']}, "
      f"vocabulary {index['vocab_size']:,}, tokenizer sha256 {index['tokenizer_sha256'][:12]}).\n")
    w("## Mixture\n")
    w(f"Each source's mixture weight multiplies its train tokens, by including whole documents floor(w) times "
      f"and a seeded random subset once more (seed {mixture['seed']}); the target share is w·T / Σ w·T over "
      f"the sources' natural train tokens T. The validation split is not weighted. "
      + ("The train split was resampled." if mixture["applied"]
         else "Every document was written once: the natural corpus, nothing resampled.") + "\n")
    w("| source | licence | mixture weight | natural tokens | target share | effective share | tokens | "
      "docs kept | docs dropped | repeats |")
    w("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, v in sorted(mixture["by_source"].items()):
        licence = _fmt(registry[name].licence) if name in registry else "(not in registry)"
        w(f"| {name} | {licence} | {v['weight']:g} | {v['natural_tokens']:,} | {_share(v['target_share'])} | "
          f"{_share(v['share'])} | {v['tokens']:,} | {v['kept_docs']:,} | {v['dropped_docs']:,} | {v['repeats']:,} |")
    w(f"\nDocuments written zero times (reason `mixture_weight`): {sum(mixture['dropped'].values()):,}.\n")
    w("## Validation split (not weighted)\n")
    w("| source | tokens | docs |")
    w("|---|---:|---:|")
    for name, v in sorted(index["by_source"].items()):
        if v["val"]["docs"]:
            w(f"| {name} | {v['val']['tokens']:,} | {v['val']['docs']:,} |")
    return "\n".join(out) + "\n"
