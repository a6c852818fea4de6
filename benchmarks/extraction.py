"""Extraction throughput (pages/s/core) and end-to-end curate throughput (docs/s).

1. Extraction: every HTML response of the WARC files in ../shared/data/web (the docs-crawl
   shards, the wget sample, whirlwind; ~7,000 pages) goes through the ingest stage's own record
   path (`tasks.ingest.process.process_file_range`: WARC reader, HTML decoding, trafilatura with
   the configured `favour_precision` and metadata, normalisation) in this one process, so the
   figure is per core. The extracted documents (plus the Common Crawl JSONL samples, already text)
   are cached as JSONL in the cache directory for `filters_vs_datatrove.py`.
2. End-to-end curate: `run_ingest` + `run_curate` of configs/tiny.yaml's sources on Ray
   (`ray.num_cpus` cores), docs/s of each stage and overall.

Writes benchmarks/results/extraction.json.

    python benchmarks/extraction.py [--cache DIR] [--skip-curate] [--max-files N]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from _common import data_root, write_result
from tasks.config import IngestConfig, SourceConfig

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "crucible-bench-web"


def web_sources() -> list[tuple[Path, str]]:
    web = data_root() / "web"
    warcs = sorted(web.glob("docs-crawl-*.warc.gz")) + [web / "wget-sample-0001.warc.gz", web / "whirlwind.warc.gz"]
    jsonl = [web / "cc-main-2019-30-sample.jsonl.gz", web / "cc-net-head-sample.jsonl.gz"]
    return [(p, "warc") for p in warcs if p.is_file()] + [(p, "jsonl") for p in jsonl if p.is_file()]


def _extract_file(path: Path, fmt: str) -> tuple[dict, list[dict]]:
    """One source file through the ingest record path; CPU and wall time of this process."""
    from tasks.ingest.process import process_file_range

    src = SourceConfig(name="web", uri=str(path), format=fmt, licence="bench", provenance="bench")
    c0, t0 = time.process_time(), time.perf_counter()
    res = process_file_range(src, str(path), IngestConfig())
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    docs = [{"id": d["id"], "text": d["text"], "source_file": path.name} for d in res["docs"]]
    info = {"file": path.name, "format": fmt, "records": res["docs_in"], "docs": res["docs_out"],
            "cpu_seconds": round(cpu, 3), "wall_seconds": round(wall, 3),
            "dropped": res["dropped"], "quarantined": res["quarantined"]}
    return info, docs


def extract_web(cache: Path, max_files: int | None = None, workers: int = 2, progress: bool = True) -> dict:
    """Run the ingest record path over the web samples (`workers` processes, one file each at a
    time); write `cache/web_docs.jsonl.gz` ({"id", "text", "source_file"}) and return the figures.
    Per-core throughput is pages per CPU-second of the extracting processes (robust on a
    shared machine), wall-clock figures are given too."""
    from concurrent.futures import ProcessPoolExecutor

    ingest = IngestConfig()
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / "web_docs.jsonl.gz"
    tmp = cache / ".web_docs.jsonl.gz.tmp"
    sources = web_sources()[:max_files] if max_files else web_sources()
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_extract_file, path, fmt) for path, fmt in sources]
        results = []
        for fut in futures:  # in source order, so the cache is deterministic
            info, docs = fut.result()
            results.append((info, docs))
            if progress:
                print(f"  extracted {info['file']}: {info['records']} records -> {info['docs']} docs, "
                      f"{info['cpu_seconds']} s CPU", file=sys.stderr)
    wall = time.perf_counter() - t0
    with gzip.open(tmp, "wt", encoding="utf-8") as fh:
        for _, docs in results:
            for d in docs:
                fh.write(json.dumps(d) + "\n")
    os.replace(tmp, out)
    html = [info for info, _ in results if info["format"] == "warc"]
    pages = sum(i["records"] for i in html)
    cpu = sum(i["cpu_seconds"] for i in html)
    return {
        "extractor": f"trafilatura favour_precision={ingest.favour_precision} extract_metadata={ingest.extract_metadata}",
        "html_pages": pages, "html_docs_extracted": sum(i["docs"] for i in html),
        "cpu_seconds": round(cpu, 3),
        "pages_per_s_per_core": round(pages / cpu, 1) if cpu else None,
        "workers": workers, "wall_seconds_all_files": round(wall, 2),
        "files": [info for info, _ in results], "docs_file": str(out),
    }


def load_web_docs(cache: Path = DEFAULT_CACHE) -> list[dict]:
    """The cached extracted web documents, extracting them first when the cache is empty."""
    path = cache / "web_docs.jsonl.gz"
    if not path.is_file():
        print(f"extracting the web samples once into {path} ...", file=sys.stderr)
        extract_web(cache)
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def curate_end_to_end(work: Path) -> dict:
    """`run_ingest` then `run_curate` of configs/tiny.yaml's sources, fresh output dirs."""
    import ray

    from tasks.config import load_config
    from tasks.curate import run_curate
    from tasks.ingest import run_ingest

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    cfg.curate.resume = False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    t0 = time.perf_counter()
    ing = run_ingest(cfg, work / "ingest")
    t1 = time.perf_counter()
    cur = run_curate(cfg, [Path(p) for p in ing["shards"]], work / "curate")
    t2 = time.perf_counter()
    ray.shutdown()
    return {
        "config": "configs/tiny.yaml", "workers": ing.get("workers"),
        "ingest": {"records_in": ing["docs_in"], "docs_out": ing["docs_out"], "seconds": round(t1 - t0, 2),
                   "docs_per_s": round(ing["docs_in"] / (t1 - t0), 1)},
        "curate": {"docs_in": cur["docs_in"], "docs_out": cur["docs_out"], "seconds": round(t2 - t1, 2),
                   "docs_per_s": round(cur["docs_in"] / (t2 - t1), 1),
                   "map_docs_per_s": (cur.get("timings") or {}).get("map_docs_per_s")},
        "end_to_end": {"records_in": ing["docs_in"], "docs_out": cur["docs_out"], "seconds": round(t2 - t0, 2),
                       "records_per_s": round(ing["docs_in"] / (t2 - t0), 1)},
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="where the extracted documents are cached")
    p.add_argument("--max-files", type=int, default=None, help="only the first N source files (quick look)")
    p.add_argument("--skip-curate", action="store_true")
    p.add_argument("--extraction-from", default=None,
                   help="reuse the extraction figures of an earlier results JSON (run only the curate part)")
    p.add_argument("--out", default=str(HERE / "results" / "extraction.json"))
    args = p.parse_args(argv)

    result: dict = {"cpu_count": os.cpu_count()}
    if args.extraction_from:
        result["extraction"] = ex = json.loads(Path(args.extraction_from).read_text())["extraction"]
    else:
        print("extraction (2 processes) ...", file=sys.stderr)
        result["extraction"] = ex = extract_web(Path(args.cache), args.max_files)
    print(f"extraction: {ex['html_pages']} HTML pages in {ex['cpu_seconds']} CPU-s = "
          f"{ex['pages_per_s_per_core']} pages/s/core ({ex['html_docs_extracted']} with text)")
    if not args.skip_curate:
        with tempfile.TemporaryDirectory(prefix="crucible-bench-curate-") as d:
            result["curate"] = cu = curate_end_to_end(Path(d))
        print(f"end-to-end (tiny sources, {cu['workers']} workers): ingest {cu['ingest']['docs_per_s']} records/s, "
              f"curate {cu['curate']['docs_per_s']} docs/s, overall {cu['end_to_end']['records_per_s']} records/s "
              f"({cu['end_to_end']['records_in']} records -> {cu['end_to_end']['docs_out']} curated docs)")
    write_result(args.out, result, indent=1)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
