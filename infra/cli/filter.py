"""`crucible filter INPUT.jsonl --out DECISIONS.jsonl [--config C] [--no-langid]`

Runs language id and the heuristic filter chain (the curate config's enabled filters, in
curate order; no decontamination, PII or dedup) on JSONL documents `{"id", "text", ...}` and
writes one line per input document, in input order:

    {"id", "keep": bool, "reason": "<filter>:<rule>" | null, "scores": {...}}

`scores` holds cheap per-document figures the rules look at: `langid` {label, score} (when
language id runs), `words`, `mean_word_length`, `lines`, `non_alpha_word_ratio`, `stop_words`,
`line_punct_ratio` (lines ending in . ' " ! ?), `short_line_ratio`, `bullet_lines_ratio`,
`ellipsis_lines_ratio`, and `c4_kept_chars` (text left after C4's line removal, when the
document reached C4). A line that is not a JSON object with a string "text" is reported with
keep false and reason "bad_input". Exit status 0; a summary is printed to stderr.

Wiring: infra/cli/main.py adds the subcommand with `add_arguments(parser)` and calls `run(args)`.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("input", help="JSONL file of documents with 'id' and 'text'")
    parser.add_argument("--out", required=True, help="where to write the per-document decisions (JSONL)")
    parser.add_argument("--config", default=None, help="pipeline config YAML (its curate section is used); "
                                                       "default: built-in curate defaults")
    parser.add_argument("--no-langid", action="store_true", help="skip language identification")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. curate.gopher_quality.min_doc_words=20 (repeatable)")
    return parser


def _curate_config(args):
    from tasks.config import CurateConfig, apply_overrides, load_config

    if args.config:
        cur = load_config(args.config, list(args.overrides or [])).curate
    else:
        raw = apply_overrides({"curate": {}}, list(args.overrides or []))
        bad = [k for k in raw if k != "curate"]
        if bad:
            raise SystemExit(f"without --config only curate.* overrides apply (got {bad})")
        cur = CurateConfig.model_validate(raw["curate"])
    if args.no_langid:
        cur = cur.model_copy(update={"langid": cur.langid.model_copy(update={"enabled": False})})
    return cur


def doc_scores(text: str, stop_words: frozenset[str], short_line_length: int) -> dict:
    from tasks.curate.text import is_symbol_word, words

    toks = words(text)
    real = [w for w in toks if not is_symbol_word(w)]
    lines = text.split("\n")
    n_lines = len(lines)
    return {
        "words": len(real),
        "mean_word_length": round(sum(map(len, real)) / len(real), 3) if real else 0.0,
        "lines": n_lines,
        "non_alpha_word_ratio": round(1 - sum(1 for w in toks if any(c.isalpha() for c in w)) / len(toks), 4)
        if toks else 0.0,
        "stop_words": sum(1 for w in toks if w in stop_words),
        "line_punct_ratio": round(sum(1 for ln in lines if ln.endswith((".", "'", '"', "!", "?"))) / n_lines, 4),
        "short_line_ratio": round(sum(1 for ln in lines if len(ln) <= short_line_length) / n_lines, 4),
        "bullet_lines_ratio": round(sum(1 for ln in lines if ln.lstrip().startswith(("•", "-"))) / n_lines, 4),
        "ellipsis_lines_ratio": round(sum(1 for ln in lines if ln.rstrip().endswith(("...", "…"))) / n_lines, 4),
    }


def filter_file(input_path: str | Path, out_path: str | Path, cur) -> dict:
    from tasks.core.documents import AtomicJsonlWriter
    from tasks.curate.filters import build_filters

    filters = build_filters(cur)
    stop_words = frozenset(cur.gopher_quality.stop_words)
    counts: Counter = Counter()
    n = kept = 0
    with open(input_path, "rb") as fin, AtomicJsonlWriter(out_path) as out:
        for lineno, raw in enumerate(fin, 1):
            if not raw.strip():
                continue
            n += 1
            try:
                doc = json.loads(raw.decode("utf-8"))  # a line that is not UTF-8 is bad input too
                if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                    raise ValueError("not an object with a string 'text'")
            except ValueError:
                counts["bad_input"] += 1
                out.write({"id": None, "line": lineno, "keep": False, "reason": "bad_input", "scores": {}})
                continue
            doc.setdefault("id", f"line-{lineno}")
            scores = doc_scores(doc["text"], stop_words, cur.fineweb.short_line_length)
            reason = None
            for f in filters:
                before = doc["text"]
                reason = f.decide(doc)
                if f.name == "langid":
                    scores["langid"] = {"label": doc.get("language"), "score": doc.get("language_score")}
                if f.name == "c4" and reason is None and doc["text"] != before:
                    scores["c4_kept_chars"] = len(doc["text"])
                if reason is not None:
                    break
            counts[reason or "kept"] += 1
            kept += reason is None
            out.write({"id": doc["id"], "keep": reason is None, "reason": reason, "scores": scores})
    return {"docs": n, "kept": kept, "reasons": dict(counts.most_common()), "out": str(out_path)}


def run(args: argparse.Namespace) -> int:
    summary = filter_file(args.input, args.out, _curate_config(args))
    print(json.dumps(summary, indent=1), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="crucible filter", description=__doc__.split("\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
