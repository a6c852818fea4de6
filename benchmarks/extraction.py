"""Extractor comparison (trafilatura vs resiliparse), extraction throughput, end-to-end curate.

1. Extractor comparison, on the docs-crawl WARCs (../shared/data/web/docs-crawl-*.warc.gz,
   6,984 pages): each file goes through the ingest stage's own record path
   (`tasks.ingest.process.process_file_range`: WARC reader, strict decoding, extraction,
   normalisation) once per extractor, in one process, so pages per CPU-second is pages/s per
   core, the record path included. Agreement is token-level F1: bags of word tokens
   (`word_tokens`: lower-cased runs of letters/digits, each CJK character one token), precision,
   recall and F1 averaged over pages (macro) and over all tokens (micro), between the two
   extractors and against each page's main content.
   Main content "where known": /work/shared/data holds no gold main-content text for these
   pages (its README lists none; text/linux-doc-rst.jsonl.gz holds the kernel pages' RST sources,
   but with markup, and directives such as kernel-doc and toctree expand into text the source
   lacks). So the reference is the page's main-content container as its generator marks it
   (`main_content_reference`): the one outermost `<main>`, `<article>` or `role="main"` element
   (Sphinx: the Python and kernel pages), or, for publican (DocBook) pages (the Debian
   handbook), the `<body>` less publican's chrome (`#banner`, `#title`, `ul.docnav`). A page
   without such a container has no reference and is not scored against one. A page an
   extractor drops scores 0 against the reference.
2. Extraction throughput of the configured (or `--extractor`) extractor over every HTML
   response of the web WARCs (docs crawl, wget sample, whirlwind), `--workers` processes; the
   extracted documents (plus the Common Crawl JSONL samples, already text) are cached as JSONL
   in the cache directory for `filters_vs_datatrove.py`.
3. End-to-end curate: `run_ingest` + `run_curate` of configs/tiny.yaml's sources on Ray
   (`ray.num_cpus` cores), docs/s of each stage and overall.

Writes benchmarks/results/extraction.json.

    python benchmarks/extraction.py [--max-files N] [--workers N] [--extractor NAME]
        [--skip-compare] [--skip-web] [--skip-curate] [--cache DIR]
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from _common import data_root, write_result
from tasks.config import IngestConfig, SourceConfig

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
DEFAULT_CACHE = Path(tempfile.gettempdir()) / "crucible-bench-web"
EXTRACTORS = ("trafilatura", "resiliparse")
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
# CJK text has no spaces between words: each of its characters is a token, other scripts give words
_WORD = re.compile(rf"[{_CJK}]|[^\W{_CJK}]+")
_XML_DECLARATION = re.compile(r"^\s*<\?xml[^>]*\?>")  # lxml refuses str input that declares an encoding
# elements that end a line when rendered: their text must not run into the next element's
_BLOCK_TAGS = ("p", "div", "li", "dt", "dd", "pre", "br", "tr", "td", "th", "table", "ul", "ol", "dl",
               "h1", "h2", "h3", "h4", "h5", "h6", "section", "blockquote", "figcaption", "caption")


def word_tokens(text: str | None) -> Counter:
    return Counter(_WORD.findall((text or "").lower()))


def token_overlap(predicted: Counter, reference: Counter) -> tuple[int, int, int]:
    """(shared tokens, predicted tokens, reference tokens) of two bags of tokens."""
    return sum((predicted & reference).values()), sum(predicted.values()), sum(reference.values())


def f1_summary(rows: list[tuple[int, int, int]]) -> dict:
    """Token precision/recall/F1 over `token_overlap` rows: averaged over pages, and micro
    (all tokens pooled). A page with no predicted tokens scores 0."""
    def prf(shared: int, n_pred: int, n_ref: int) -> tuple[float, float, float]:
        p = shared / n_pred if n_pred else 0.0
        r = shared / n_ref if n_ref else 0.0
        return p, r, (2 * p * r / (p + r) if p + r else 0.0)

    if not rows:
        return {"pages": 0}
    per_page = [prf(*row) for row in rows]
    micro = prf(*(sum(col) for col in zip(*rows)))
    return {"pages": len(rows),
            **{f"{k}_mean": round(sum(x[i] for x in per_page) / len(rows), 4)
               for i, k in enumerate(("precision", "recall", "f1"))},
            **{f"{k}_micro": round(micro[i], 4) for i, k in enumerate(("precision", "recall", "f1"))}}


def main_content_reference(html: str) -> tuple[str, str] | None:
    """(text, how) of the page's main content as its generator marks it: the one outermost
    `<main>`/`<article>`/`role="main"` element ("landmark"), or a publican page's body less the
    banner, title bar and navigation ("publican_body"); None when the page marks none."""
    import lxml.etree
    import lxml.html

    try:
        root = lxml.html.document_fromstring(_XML_DECLARATION.sub("", html, count=1))
    except (ValueError, lxml.etree.ParserError):
        return None
    for hidden in root.xpath("//script|//style|//noscript|//template"):
        hidden.drop_tree()
    marked = root.xpath("//main|//article|//*[@role='main']")
    outermost = [el for el in marked if not any(a in marked for a in el.iterancestors())]
    body = root.find("body")
    if len(outermost) == 1:
        container, how = outermost[0], "landmark"
    elif not marked and body is not None and \
            root.xpath("//meta[@name='generator'][starts-with(@content, 'publican')]"):
        for chrome in body.xpath("./*[@id='banner' or @id='title'] | ./ul[contains(@class, 'docnav')]"):
            chrome.drop_tree()
        container, how = body, "publican_body"
    else:
        return None
    for el in container.iter(*_BLOCK_TAGS):
        el.tail = "\n" + (el.tail or "")
    text = container.text_content()
    return (text, how) if text.strip() else None


def _page_set(url: str) -> str:
    return "handbook" if "debian-handbook" in url else "python" if "docs.python.org" in url else "kernel"


def _warm_up() -> None:
    """Import and first-call costs out of the timed runs."""
    from tasks.ingest.extract import extract_html

    for name in EXTRACTORS:
        extract_html("<html><head><title>t</title></head><body><p>warm up text</p></body></html>",
                     "https://warm.up/", extractor=name)


def _compare_file(path: Path) -> dict:
    """One docs-crawl WARC through the record path once per extractor (CPU time of each), then
    each page's extracted texts scored against each other and against its reference."""
    from tasks.ingest.extract import DecodeFailed, decode_html
    from tasks.ingest.process import process_file_range
    from tasks.ingest.readers import RawRecord, iter_records

    _warm_up()
    src = SourceConfig(name="docs-crawl", uri=str(path), format="warc", licence="bench", provenance="bench")
    runs, texts = {}, {}
    for name in EXTRACTORS:
        c0 = time.process_time()
        res = process_file_range(src, str(path), IngestConfig(extractor=name))
        runs[name] = {"records": res["docs_in"], "docs": res["docs_out"],
                      "cpu_seconds": time.process_time() - c0,
                      "dropped": res["dropped"], "quarantined": res["quarantined"]}
        texts[name] = {d["url"]: word_tokens(d["text"]) for d in res["docs"]}
    pages = []
    for rec in iter_records(str(path), "warc"):
        if not isinstance(rec, RawRecord) or rec.error or rec.kind != "html":
            continue
        try:
            ref = main_content_reference(decode_html(rec.payload or b"", rec.content_type))
        except DecodeFailed:
            ref = None
        got = {name: texts[name].get(rec.url) for name in EXTRACTORS}
        ref_tokens = word_tokens(ref[0]) if ref else None
        pages.append({
            "set": _page_set(rec.url or ""), "reference": ref[1] if ref else None,
            "pair": token_overlap(got["resiliparse"], got["trafilatura"]) if all(got.values()) else None,
            "vs_reference": {name: token_overlap(got[name] or Counter(), ref_tokens) for name in EXTRACTORS}
            if ref_tokens else None,
        })
    return {"file": path.name, "runs": runs, "pages": pages}


def compare_extractors(max_files: int | None = None, workers: int = 2, progress: bool = True) -> dict:
    """Both extractors on the docs-crawl WARCs: pages/s per core and token F1 (module docstring)."""
    files = sorted((data_root() / "web").glob("docs-crawl-*.warc.gz"))[:max_files]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        results = []
        for r in pool.map(_compare_file, files):
            results.append(r)
            if progress:
                print(f"  compared {r['file']}: " + ", ".join(
                    f"{n} {v['cpu_seconds']:.1f} CPU-s" for n, v in r["runs"].items()), file=sys.stderr)
    speed = {}
    for name in EXTRACTORS:
        runs = [r["runs"][name] for r in results]
        pages, cpu = sum(x["records"] for x in runs), sum(x["cpu_seconds"] for x in runs)
        speed[name] = {"pages": pages, "docs": sum(x["docs"] for x in runs), "cpu_seconds": round(cpu, 2),
                       "pages_per_s_per_core": round(pages / cpu, 1) if cpu else None,
                       "dropped": dict(sum((Counter(x["dropped"]) for x in runs), Counter())),
                       "quarantined": dict(sum((Counter(x["quarantined"]) for x in runs), Counter()))}
    pages = [p for r in results for p in r["pages"]]
    scored = [p for p in pages if p["vs_reference"]]
    vs_reference = {name: {"all": f1_summary([p["vs_reference"][name] for p in scored]),
                           **{s: f1_summary([p["vs_reference"][name] for p in scored if p["set"] == s])
                              for s in ("handbook", "python", "kernel")}}
                    for name in EXTRACTORS}
    return {
        "files": [r["file"] for r in results], "workers": workers, "speed": speed,
        "speedup_resiliparse_over_trafilatura": round(speed["resiliparse"]["pages_per_s_per_core"]
                                                      / speed["trafilatura"]["pages_per_s_per_core"], 1),
        # precision: share of resiliparse's tokens that trafilatura's text has too; recall the reverse
        "resiliparse_vs_trafilatura": f1_summary([p["pair"] for p in pages if p["pair"]]),
        "reference": {"gold_main_content_available": False,
                      "kind": "generator-marked main-content container (module docstring)",
                      "pages_with_reference": dict(Counter(p["reference"] or "none" for p in pages))},
        "vs_reference": vs_reference,
    }


def web_sources() -> list[tuple[Path, str]]:
    web = data_root() / "web"
    warcs = sorted(web.glob("docs-crawl-*.warc.gz")) + [web / "wget-sample-0001.warc.gz", web / "whirlwind.warc.gz"]
    jsonl = [web / "cc-main-2019-30-sample.jsonl.gz", web / "cc-net-head-sample.jsonl.gz"]
    return [(p, "warc") for p in warcs if p.is_file()] + [(p, "jsonl") for p in jsonl if p.is_file()]


def _extract_file(path: Path, fmt: str, ingest: IngestConfig) -> tuple[dict, list[dict]]:
    """One source file through the ingest record path; CPU and wall time of this process."""
    from tasks.ingest.process import process_file_range

    src = SourceConfig(name="web", uri=str(path), format=fmt, licence="bench", provenance="bench")
    c0, t0 = time.process_time(), time.perf_counter()
    res = process_file_range(src, str(path), ingest)
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    docs = [{"id": d["id"], "text": d["text"], "source_file": path.name} for d in res["docs"]]
    info = {"file": path.name, "format": fmt, "records": res["docs_in"], "docs": res["docs_out"],
            "cpu_seconds": round(cpu, 3), "wall_seconds": round(wall, 3),
            "dropped": res["dropped"], "quarantined": res["quarantined"]}
    return info, docs


def extract_web(cache: Path, max_files: int | None = None, workers: int = 2, progress: bool = True,
                extractor: str | None = None) -> dict:
    """Run the ingest record path over the web samples (`workers` processes, one file each at a
    time); write `cache/web_docs.jsonl.gz` ({"id", "text", "source_file"}) and return the figures.
    Per-core throughput is pages per CPU-second of the extracting processes (robust on a
    shared machine), wall-clock figures are given too."""
    ingest = IngestConfig(**({"extractor": extractor} if extractor else {}))
    cache.mkdir(parents=True, exist_ok=True)
    out = cache / "web_docs.jsonl.gz"
    tmp = cache / ".web_docs.jsonl.gz.tmp"
    sources = web_sources()[:max_files] if max_files else web_sources()
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(_extract_file, path, fmt, ingest) for path, fmt in sources]
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
        "extractor": f"{ingest.extractor} favour_precision={ingest.favour_precision} "
                     f"extract_metadata={ingest.extract_metadata}",
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


def curate_end_to_end(work: Path, extractor: str | None = None) -> dict:
    """`run_ingest` then `run_curate` of configs/tiny.yaml's sources, fresh output dirs."""
    import ray

    from infra.settings import load_config
    from tasks.curate import run_curate
    from tasks.ingest import run_ingest

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    cfg.curate.resume = False
    if extractor:
        cfg.ingest.extractor = extractor
    t0 = time.perf_counter()
    ing = run_ingest(cfg, work / "ingest")
    t1 = time.perf_counter()
    cur = run_curate(cfg, [Path(p) for p in ing["shards"]], work / "curate")
    t2 = time.perf_counter()
    ray.shutdown()
    return {
        "config": "configs/tiny.yaml", "extractor": cfg.ingest.extractor, "workers": ing.get("workers"),
        "ingest": {"records_in": ing["docs_in"], "docs_out": ing["docs_out"], "seconds": round(t1 - t0, 2),
                   "docs_per_s": round(ing["docs_in"] / (t1 - t0), 1)},
        "curate": {"docs_in": cur["docs_in"], "docs_out": cur["docs_out"], "seconds": round(t2 - t1, 2),
                   "docs_per_s": round(cur["docs_in"] / (t2 - t1), 1),
                   "map_docs_per_s": (cur.get("timings") or {}).get("map_docs_per_s")},
        "end_to_end": {"records_in": ing["docs_in"], "docs_out": cur["docs_out"], "seconds": round(t2 - t0, 2),
                       "records_per_s": round(ing["docs_in"] / (t2 - t0), 1)},
    }


def _print_comparison(cmp: dict) -> None:
    for name, v in cmp["speed"].items():
        print(f"{name}: {v['pages']} pages in {v['cpu_seconds']} CPU-s = {v['pages_per_s_per_core']} pages/s/core "
              f"({v['docs']} with text; dropped {v['dropped']}, quarantined {v['quarantined']})")
    pair = cmp["resiliparse_vs_trafilatura"]
    print(f"resiliparse vs trafilatura, token F1 over {pair['pages']} pages: mean {pair['f1_mean']}, "
          f"micro {pair['f1_micro']} (P {pair['precision_micro']}, R {pair['recall_micro']})")
    for name, by_set in cmp["vs_reference"].items():
        print(f"{name} vs main-content reference: " + "; ".join(
            f"{k} F1 mean {v['f1_mean']} micro {v['f1_micro']} (P {v['precision_micro']}, R {v['recall_micro']}, "
            f"{v['pages']} pages)" for k, v in by_set.items() if v["pages"]))


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cache", default=str(DEFAULT_CACHE), help="where the extracted documents are cached")
    p.add_argument("--max-files", type=int, default=None, help="only the first N source files (quick look)")
    p.add_argument("--workers", type=int, default=2, help="processes (each file is timed in one process)")
    p.add_argument("--extractor", choices=EXTRACTORS, default=None,
                   help="extractor of the web cache and the curate run (default: the config's)")
    p.add_argument("--skip-compare", action="store_true", help="no extractor comparison")
    p.add_argument("--skip-web", action="store_true", help="no web-cache extraction run")
    p.add_argument("--skip-curate", action="store_true")
    p.add_argument("--extraction-from", default=None,
                   help="reuse the extraction figures of an earlier results JSON (run only the curate part)")
    p.add_argument("--out", default=str(HERE / "results" / "extraction.json"))
    args = p.parse_args(argv)

    result: dict = {"cpu_count": os.cpu_count(), "max_files": args.max_files}
    if not args.skip_compare:
        print(f"extractor comparison ({args.workers} processes) ...", file=sys.stderr)
        result["comparison"] = cmp = compare_extractors(args.max_files, args.workers)
        _print_comparison(cmp)
    if args.extraction_from:
        result["extraction"] = ex = json.loads(Path(args.extraction_from).read_text())["extraction"]
    elif not args.skip_web:
        print(f"extraction ({args.workers} processes) ...", file=sys.stderr)
        result["extraction"] = ex = extract_web(Path(args.cache), args.max_files, args.workers,
                                                extractor=args.extractor)
    else:
        ex = None
    if ex:
        print(f"extraction ({ex['extractor']}): {ex['html_pages']} HTML pages in {ex['cpu_seconds']} CPU-s = "
              f"{ex['pages_per_s_per_core']} pages/s/core ({ex['html_docs_extracted']} with text)")
    if not args.skip_curate:
        with tempfile.TemporaryDirectory(prefix="crucible-bench-curate-") as d:
            result["curate"] = cu = curate_end_to_end(Path(d), args.extractor)
        print(f"end-to-end (tiny sources, {cu['extractor']}, {cu['workers']} workers): ingest "
              f"{cu['ingest']['docs_per_s']} records/s, curate {cu['curate']['docs_per_s']} docs/s, overall "
              f"{cu['end_to_end']['records_per_s']} records/s "
              f"({cu['end_to_end']['records_in']} records -> {cu['end_to_end']['docs_out']} curated docs)")
    write_result(args.out, result, indent=1)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
