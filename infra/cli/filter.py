"""`crucible filter INPUT.jsonl --out DECISIONS.jsonl [--config C] [--no-langid] [--workers N]`

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

`--workers N` (default: every core this process may use, at most one per `MIN_BYTES_PER_WORKER`
of input) splits the file into contiguous byte ranges at line boundaries, decided in N forked
processes; the output is written in input order and is the same whatever N. Fork, not spawn:
the children inherit the loaded fastText model and spaCy tokenizer (spawn would import and load
them again in every worker, about a second each).

Wiring: infra/cli/main.py adds the subcommand with `add_arguments(parser)` and calls `run(args)`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

MIN_BYTES_PER_WORKER = 256 * 1024  # default worker count: smaller shares cost more to fork than they save
MAX_CHUNK_BYTES = 64 * 1024 * 1024  # bounds the decisions a finished chunk holds while waiting its turn
CHUNKS_PER_WORKER = 4  # documents differ in cost: several chunks per worker keep the workers evenly busy


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("input", help="JSONL file of documents with 'id' and 'text'")
    parser.add_argument("--out", required=True, help="where to write the per-document decisions (JSONL)")
    parser.add_argument("--config", default=None, help="pipeline config YAML (its curate section is used); "
                                                       "default: built-in curate defaults")
    parser.add_argument("--no-langid", action="store_true", help="skip language identification")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. curate.gopher_quality.min_doc_words=20 (repeatable)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="worker processes (default: every usable core, at most one per "
                             f"{MIN_BYTES_PER_WORKER // 1024} KiB of input); the output is the same for any N")
    return parser


def _curate_config(args):
    from infra.settings import load_config
    from tasks.config import CurateConfig, apply_overrides

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


class _Decider:
    """The enabled filters (models loaded once, before any fork) and the per-line decision."""

    def __init__(self, cur):
        from tasks.curate.filters import build_filters
        from tasks.curate.text import words

        self.filters = build_filters(cur)
        self.stop_words = frozenset(cur.gopher_quality.stop_words)
        self.short_line_length = cur.fineweb.short_line_length
        words("")  # builds the spaCy tokenizer now, so forked workers share it

    def decide(self, raw: bytes, lineno: int) -> dict | None:
        """The decision line for input line `lineno` (1-based), None for a blank line."""
        if not raw.strip():
            return None
        try:
            doc = json.loads(raw.decode("utf-8"))  # a line that is not UTF-8 is bad input too
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                raise ValueError("not an object with a string 'text'")
        except ValueError:
            return {"id": None, "line": lineno, "keep": False, "reason": "bad_input", "scores": {}}
        doc.setdefault("id", f"line-{lineno}")
        scores = doc_scores(doc["text"], self.stop_words, self.short_line_length)
        reason = None
        for f in self.filters:
            before = doc["text"]
            reason = f.decide(doc)
            if f.name == "langid":
                scores["langid"] = {"label": doc.get("language"), "score": doc.get("language_score")}
            if f.name == "c4" and reason is None and doc["text"] != before:
                scores["c4_kept_chars"] = len(doc["text"])
            if reason is not None:
                break
        return {"id": doc["id"], "keep": reason is None, "reason": reason, "scores": scores}

    def decide_range(self, path: str, start: int, end: int, first_lineno: int) -> list[dict]:
        """Decisions for the lines in bytes [start, end) of `path` (which start at a line)."""
        with open(path, "rb") as fh:
            fh.seek(start)
            data = fh.read(end - start)
        lines = data.split(b"\n")  # newline only, as iterating the file splits (not bytes.splitlines)
        if data.endswith(b"\n"):
            lines.pop()
        decisions = (self.decide(raw, lineno) for lineno, raw in enumerate(lines, first_lineno))
        return [d for d in decisions if d is not None]


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def line_ranges(path: str | Path, n_chunks: int) -> list[tuple[int, int, int]]:
    """`path` cut into at most `n_chunks` contiguous (start, end, first_lineno) byte ranges of
    about equal size, each starting at a line."""
    size = os.path.getsize(path)
    bounds = [0]
    with open(path, "rb") as fh:
        for k in range(1, n_chunks):
            fh.seek(max(size * k // n_chunks, bounds[-1] + 1) - 1)
            fh.readline()  # to the start of the next line
            if fh.tell() >= size:
                break
            bounds.append(fh.tell())
        bounds.append(size)
        ranges, lineno = [], 1
        fh.seek(0)
        for start, end in zip(bounds, bounds[1:]):
            ranges.append((start, end, lineno))
            left = end - start
            while left:  # lines before the next range, counted in blocks
                block = fh.read(min(left, 1 << 20))
                lineno += block.count(b"\n")
                left -= len(block)
    return ranges


_DECIDER: _Decider | None = None  # what a forked worker inherits


def _decide_range(task: tuple) -> tuple[int, list[dict]]:
    return os.getpid(), _DECIDER.decide_range(*task)


def _decisions(decider: _Decider, path: str, workers: int):
    """(pid of the deciding process, decisions) range by range in input order, from `workers` processes."""
    global _DECIDER
    size = os.path.getsize(path)
    n_chunks = max(workers * CHUNKS_PER_WORKER if workers > 1 else 1, -(-size // MAX_CHUNK_BYTES))
    tasks = [(path, *r) for r in line_ranges(path, n_chunks)]
    if workers == 1 or len(tasks) == 1:
        yield from ((os.getpid(), decider.decide_range(*t)) for t in tasks)
        return
    import multiprocessing

    _DECIDER = decider
    try:
        with multiprocessing.get_context("fork").Pool(min(workers, len(tasks))) as pool:
            yield from pool.imap(_decide_range, tasks)
    finally:
        _DECIDER = None


def filter_file(input_path: str | Path, out_path: str | Path, cur, workers: int | None = None) -> dict:
    """Decide every line of `input_path` into `out_path`; `workers` None: `default_workers()`,
    at most one per `MIN_BYTES_PER_WORKER` of input. The summary's `worker_processes`: how many
    processes other than this one decided documents (0: all decided here)."""
    from tasks.core.documents import AtomicJsonlWriter

    if workers is None:
        workers = min(default_workers(), os.path.getsize(input_path) // MIN_BYTES_PER_WORKER)
    workers = max(1, workers)
    decider = _Decider(cur)
    counts: Counter = Counter()
    n = kept = 0
    deciders = set()
    with AtomicJsonlWriter(out_path) as out:
        for pid, decisions in _decisions(decider, str(input_path), workers):
            deciders.add(pid)
            for d in decisions:
                out.write(d)
                n += 1
                kept += d["keep"]
                counts[d["reason"] or "kept"] += 1
    return {"docs": n, "kept": kept, "reasons": dict(counts.most_common()), "out": str(out_path),
            "workers": workers, "worker_processes": len(deciders - {os.getpid()})}


def run(args: argparse.Namespace) -> int:
    summary = filter_file(args.input, args.out, _curate_config(args), args.workers)
    print(json.dumps(summary, indent=1), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="crucible filter", description=__doc__.split("\n")[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
