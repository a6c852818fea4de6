"""`crucible dedup INPUT.jsonl --out RESULT.jsonl [--config C]`: exact + MinHash dedup of JSONL.

Input: one {"id", "text", ...} object per line (.jsonl or .jsonl.gz). Output: one line per input
line, in input order: {"id", "cluster", "keep"} (a line that is not such an object: {"id": null,
"line", "cluster": null, "keep": false, "reason": "bad_input: ..."}) — `cluster` is the id of the cluster's
survivor (the first document of the cluster in input order, or with `minhash.survivor: quality`
the one with the highest `quality_field` value), `keep` is true for survivors only.

Steps (config `curate.dedup`, or a bare dedup section — see `load_dedup_config`), run by
`tasks.dedup.texts.dedup_texts`:
1. exact: documents with the same normalised text (`exact_key`) join the first copy;
2. MinHash: signatures of the exact survivors (`MinHasher`, vectorised), LSH band keys,
   candidate pairs joined with a union-find (connected components); with `minhash.verify` a
   pair is joined only if its exact shingle Jaccard is ≥ `minhash.verify_threshold`
   (`tasks.dedup.verify`; on the Ray path checked in the per-partition Ray tasks). A
   candidate pair is (the first document filed under a band key, a later document sharing
   that key), so a document can join a cluster only through a verified pair. A member is
   dropped only if its Jaccard to the cluster's kept document reaches
   `minhash.representative_threshold` (exact with verify, else estimated from the signatures);
   the others are re-clustered around their own best member (`tasks.dedup.cluster`), so a chain
   A~B~C does not drop C for A. Clustering runs
   in process or, from `minhash.ray_min_docs` documents (`minhash.clustering`), on Ray with
   bounded memory (`tasks.dedup.cluster`); both give the same clusters.
A summary (StepStats of both steps, clusters, the dedup report of `tasks.dedup.report`,
seconds) is printed as JSON on stdout.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path
from typing import Iterator

import yaml

from tasks.config import DedupConfig
from tasks.core.documents import AtomicJsonlWriter
from tasks.dedup.report import dedup_report
from tasks.dedup.texts import dedup_texts


def load_dedup_config(path: str | Path | None) -> DedupConfig:
    """A pipeline config (uses `curate.dedup`), a file with a top-level `dedup:` section, or a
    bare dedup section ({exact, minhash}). None: the defaults."""
    if path is None:
        return DedupConfig()
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if "sources" in raw:
        from infra.settings import load_config

        return load_config(path).curate.dedup
    if "curate" in raw:
        raw = raw["curate"]
    if "dedup" in raw:
        raw = raw["dedup"]
    return DedupConfig.model_validate(raw or {})


def read_jsonl(path: str | Path) -> Iterator[tuple[int, dict | None, str | None]]:
    """(line number, document, None) per good line; (line number, None, reason) per line that is
    not a JSON object with a string `text` (it is reported, not deduplicated); blank lines skipped."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line.decode("utf-8"))
            except ValueError as e:  # UnicodeDecodeError is one
                yield n, None, f"bad_input: not JSON ({e})"[:200]
                continue
            if not isinstance(doc, dict) or not isinstance(doc.get("text"), str):
                yield n, None, "bad_input: not an object with a string 'text'"
                continue
            doc.setdefault("id", str(n))
            yield n, doc, None


def dedup_jsonl(in_path: str | Path, out_path: str | Path, cfg: DedupConfig) -> dict:
    t0 = time.perf_counter()
    rows = list(read_jsonl(in_path))
    docs = [d for _, d, _ in rows if d is not None]
    ids = [str(d["id"]) for d in docs]
    texts = [d["text"] for d in docs]
    field = cfg.minhash.quality_field
    scores = [d.get(field) if isinstance(d.get(field), (int, float)) else None for d in docs]
    info: dict = {}
    roots, steps = dedup_texts(texts, cfg, scores=scores, work_dir=Path(out_path).resolve().parent, info=info)
    with AtomicJsonlWriter(out_path) as w:  # one line per input line, in input order
        i = 0
        for n, doc, reason in rows:
            if doc is None:
                w.write({"id": None, "line": n, "cluster": None, "keep": False, "reason": reason})
                continue
            r = roots[i]
            w.write({"id": ids[i], "cluster": ids[r], "keep": r == i})
            i += 1
    kept = sum(1 for i, r in enumerate(roots) if r == i)
    drops = [(ids[i], info["dropped_by"][i], ids[r]) for i, r in enumerate(roots) if r != i]
    sigs = {ids[k]: s for k, s in info.get("signatures", {}).items()}
    report = dedup_report(ids, [str(d.get("source") or "") for d in docs], drops, signatures=sigs,
                          texts=dict(zip(ids, texts)), ngram=cfg.minhash.ngram)
    return {
        "input": str(in_path), "output": str(out_path), "docs_in": len(docs), "docs_out": kept,
        "bad_input": len(rows) - len(docs),
        "clusters_with_duplicates": len({r for i, r in enumerate(roots) if r != i}),
        "steps": [s.to_dict() for s in steps], "clustering": info.get("clustering", {}).get("method"),
        "report": report, "seconds": round(time.perf_counter() - t0, 3),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("input", help="JSONL (.jsonl or .jsonl.gz) of {\"id\", \"text\"} documents")
    parser.add_argument("--out", required=True, help="result JSONL: {\"id\", \"cluster\", \"keep\"} per doc")
    parser.add_argument("--config", default=None,
                        help="pipeline config (curate.dedup) or a dedup section; default: built-in")


def run(args: argparse.Namespace) -> int:
    summary = dedup_jsonl(args.input, args.out, load_dedup_config(args.config))
    print(json.dumps(summary, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="crucible dedup", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
