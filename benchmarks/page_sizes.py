"""Bytes per page of the real web data in shared/data/web, by input format, for `crucible plan --curate`
(which turns a corpus size into a page count with these figures); writes benchmarks/results/page_sizes.json.

    .venv/bin/python benchmarks/page_sizes.py

* warc.gz: compressed WARC bytes per HTTP response record (the whole file, request, metadata and
  warcinfo records included), over the docs-crawl shards (constructed from Debian's HTML docs) and the
  Common Crawl / wget WARC samples.
* wet: gzip-compressed extracted text bytes per document: the Common Crawl text samples (dolma JSONL.gz
  of CC-MAIN-2019-30 and cc_net) and the Common Crawl WET sample.
* text: uncompressed UTF-8 text bytes per document over the same text samples.
"""
from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from fastwarc.warc import ArchiveIterator, WarcRecordType

from _common import data_root, write_result

HERE = Path(__file__).resolve().parent
WARC_FILES = ["docs-crawl-0000*.warc.gz", "wget-sample-0001.warc.gz", "whirlwind.warc.gz"]
JSONL_TEXT_FILES = ["cc-main-2019-30-sample.jsonl.gz", "cc-net-head-sample.jsonl.gz"]
WET_FILES = ["whirlwind.warc.wet.gz"]


def _count_records(path: Path, record_type) -> tuple[int, int]:
    """(records of `record_type`, their payload bytes) in a (gzipped) WARC file."""
    records = payload = 0
    with open(path, "rb") as f:
        for rec in ArchiveIterator(f, record_types=record_type, parse_http=False):
            records += 1
            payload += len(rec.reader.read())
    return records, payload


def warc_sizes(web: Path) -> dict:
    by_file = {}
    for pattern in WARC_FILES:
        for path in sorted(web.glob(pattern)):
            pages, _ = _count_records(path, WarcRecordType.response)
            by_file[path.name] = {"pages": pages, "bytes": path.stat().st_size}
    return _pooled(by_file, "pages")


def text_sizes(web: Path) -> tuple[dict, dict]:
    """(gzip-compressed, uncompressed) text bytes per document over the CC text samples."""
    compressed, raw = {}, {}
    for name in JSONL_TEXT_FILES:
        path = web / name
        with gzip.open(path, "rt", encoding="utf-8") as f:
            texts = [json.loads(line)["text"] for line in f if line.strip()]
        compressed[name] = {"docs": len(texts), "bytes": path.stat().st_size}
        raw[name] = {"docs": len(texts), "bytes": sum(len(t.encode("utf-8")) for t in texts)}
    for name in WET_FILES:
        path = web / name
        docs, payload = _count_records(path, WarcRecordType.conversion)
        compressed[name] = {"docs": docs, "bytes": path.stat().st_size}
        raw[name] = {"docs": docs, "bytes": payload}
    return _pooled(compressed, "docs"), _pooled(raw, "docs")


def _pooled(by_file: dict, unit: str) -> dict:
    count = sum(v[unit] for v in by_file.values())
    size = sum(v["bytes"] for v in by_file.values())
    return {unit: count, "bytes": size, "bytes_per_page": round(size / count, 1), "by_file": by_file}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--web", type=Path, default=data_root() / "web")
    ap.add_argument("--out", default=str(HERE / "results" / "page_sizes.json"))
    args = ap.parse_args()
    wet, text = text_sizes(args.web)
    result = {"benchmark": "page_sizes", "source": str(args.web),
              "formats": {"warc.gz": warc_sizes(args.web), "wet": wet, "text": text},
              "note": "docs-crawl pages are documentation HTML (constructed WARCs, see shared/data/README.md) "
                      "and dominate the warc.gz figure; the Common Crawl WARC samples hold 16 pages"}
    for fmt, figures in result["formats"].items():
        unit = "pages" if "pages" in figures else "docs"
        print(f"{fmt:8} {figures[unit]:>6} {unit}  {figures['bytes']:>11,} bytes  "
              f"{figures['bytes_per_page']:>9,.1f} bytes per page")
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
