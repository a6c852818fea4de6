"""Turn the raw records of one file (or one range of its records) into documents.

`process_file_range` is the unit of work a Ray task runs; it is plain Python and can be called
directly. Per candidate record, in order:

1. reader error → quarantined with the reader's reason (see `readers`)
2. URL host in the source's `opt_out_domains` (the domain or any subdomain), or the URL matching
   one of its `opt_out_url_patterns` (regex search) → dropped "opt_out"
3. WARC responses: HTTP status not 2xx → dropped "http_status"; content type not HTML →
   dropped "non_html"; raw payload decoded (strict, see `extract.decode_html`: failures are
   quarantined) and extracted with `ingest.extractor` (trafilatura or resiliparse); nothing
   extracted → dropped "empty_extraction" (an exception inside the extractor → quarantined
   "extraction_error")
4. NFC + whitespace normalisation (`normalise`); empty text → dropped "empty_text"; text that
   cannot be UTF-8 encoded (lone surrogates from JSON escapes) → quarantined "invalid_unicode"
5. text over `ingest.max_doc_bytes` (UTF-8 bytes) → quarantined "oversized"

Records are indexed 0, 1, 2... in file order counting candidates only (not skipped record types);
a call handles indices `start <= i < stop` so the driver can cap a source at `max_docs` and split
a file between workers while the output order stays the file order.

A job (`part_dir` given) writes everything per document to files, never into its result: the kept
documents to part files of at most `ingest.shard_docs` rows (they become the output shards), the
quarantine entries to a JSONL part, and each kept document's id digest, row and UTF-8 size to
`ingest.id_partitions` files by id hash (`tasks.ingest.ids`), for the duplicate-id check.
"""
from __future__ import annotations

import re
import time
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

from tasks.config import IngestConfig, SourceConfig
from tasks.core.documents import AtomicJsonlWriter, ShardWriter, make_doc_id
from tasks.ingest.extract import HTML_MEDIA_TYPES, DecodeFailed, decode_html, extract_html, media_type
from tasks.ingest.ids import IdSpill
from tasks.ingest.normalise import normalise_text
from tasks.ingest.readers import RawRecord, Skipped, iter_records


def url_host(url: str | None) -> str | None:
    if not url:
        return None
    if "://" not in url:
        url = "//" + url
    try:
        host = urlsplit(url).hostname
    except ValueError:
        return None
    return host.rstrip(".").lower() if host else None


def is_opted_out(url: str | None, domains: list[str]) -> bool:
    host = url_host(url)
    if not host or not domains:
        return False
    for d in domains:
        d = d.strip().lower().lstrip("*").lstrip(".").rstrip(".")
        if d and (host == d or host.endswith("." + d)):
            return True
    return False


def matches_opt_out_pattern(url: str | None, patterns: list[str]) -> bool:
    return bool(url and patterns) and any(_compiled(p).search(url) for p in patterns)


_PATTERN_CACHE: dict[str, re.Pattern] = {}


def _compiled(pattern: str) -> re.Pattern:
    if pattern not in _PATTERN_CACHE:
        _PATTERN_CACHE[pattern] = re.compile(pattern)
    return _PATTERN_CACHE[pattern]


_SURROGATES = re.compile("[\ud800-\udfff]")


def _clean(value: str | None) -> str | None:
    """Metadata strings must be valid UTF-8 for Parquet: lone surrogates become U+FFFD."""
    if value is None:
        return None
    try:
        value.encode("utf-8")
        return value
    except UnicodeEncodeError:
        return _SURROGATES.sub("\ufffd", value)


def record_to_doc(rec: RawRecord, source: SourceConfig, ingest: IngestConfig, path: str
                  ) -> tuple[str, str | None, dict | None, str]:
    """Decide one candidate record: returns (outcome, reason, doc, detail) with outcome in
    "kept" | "dropped" | "quarantined"."""
    if rec.error:
        return "quarantined", rec.error, None, rec.detail
    if is_opted_out(rec.url, source.opt_out_domains) or \
            matches_opt_out_pattern(rec.url, source.opt_out_url_patterns):
        return "dropped", "opt_out", None, ""
    title, date = rec.title, rec.date
    if rec.kind == "html":
        if rec.http_status is not None and not 200 <= rec.http_status < 300:
            return "dropped", "http_status", None, str(rec.http_status)
        if media_type(rec.content_type) not in HTML_MEDIA_TYPES:
            return "dropped", "non_html", None, rec.content_type or ""
        try:
            html = decode_html(rec.payload or b"", rec.content_type)
        except DecodeFailed as e:
            return "quarantined", e.reason, None, e.detail
        try:
            text, page_title, page_date = extract_html(html, rec.url, ingest.favour_precision,
                                                       ingest.extract_metadata, ingest.extractor)
        except ImportError:  # a broken installation is not bad input: fail loudly, quarantine nothing
            raise
        except Exception as e:  # parser/extractor failures on hostile HTML: keep going
            return "quarantined", "extraction_error", None, f"{type(e).__name__}: {e}"[:300]
        if not text or not text.strip():
            return "dropped", "empty_extraction", None, ""
        title, date = title or page_title, date or page_date
    else:
        text = rec.text or ""
    text = normalise_text(text, nfc=ingest.normalise_nfc, whitespace=ingest.normalise_whitespace)
    if not text.strip():
        return "dropped", "empty_text", None, ""
    try:
        n_bytes = len(text.encode("utf-8"))
    except UnicodeEncodeError as e:  # lone surrogates, e.g. from a JSON "\ud800" escape
        return "quarantined", "invalid_unicode", None, str(e)[:300]
    if n_bytes > ingest.max_doc_bytes:
        return "quarantined", "oversized", None, f"{n_bytes} bytes > max_doc_bytes {ingest.max_doc_bytes}"
    doc = {
        "id": make_doc_id(source.name, _clean(rec.key) or f"{Path(path).name}:{rec.offset}"),
        "text": text,
        "url": _clean(rec.url),
        "title": _clean(title),
        "date": _clean(date or rec.crawl_date),
        "crawl_date": _clean(rec.crawl_date),
        "source": source.name,
        "licence": source.licence,
        "content_type": _clean(rec.content_type),
        "warc_record_id": _clean(rec.warc_record_id),
        "language": _clean(rec.language),
        "language_score": rec.language_score,
        "source_file": path,
        "source_offset": rec.offset,
    }
    return "kept", None, doc, ""


_ENTRY_EXTRAS = ("line", "byte_range", "bytes", "unread_range", "unread_bytes")


def process_file_range(source: SourceConfig, path: str, ingest: IngestConfig, start: int = 0,
                       stop: int | None = None, part_dir: str | None = None,
                       part_name: str = "part") -> dict:
    """Process candidate records `start <= i < stop` of one raw file.

    With `part_dir`, kept documents go to `<part_dir>/<part_name>-00000.parquet`, `-00001`, ... (at
    most `ingest.shard_docs` rows each: "shards"), quarantine entries to
    `<part_name>-quarantine.jsonl` ("quarantine_file") and the kept ids to `<part_name>-ids/`
    ("ids", see `tasks.ingest.ids`); "parts" lists every file (`JobStore` checks their sha256).
    Without it they are returned under "docs" and "quarantine". Returns counts besides,
    `consumed` (candidate records handled), `eof` (the file ended before `stop`) and
    `bytes_unread` (bytes of the file the reader skipped over damage, each span in its quarantine
    entry's `unread_range`).
    """
    t0 = time.perf_counter()
    res = {
        "source": source.name, "file": path, "start": start, "stop": stop,
        "docs_in": 0, "docs_out": 0, "bytes_in": 0, "bytes_out": 0,
        "dropped": Counter(), "quarantined": Counter(), "skipped": Counter(),
        "quarantine": [], "parts": [], "docs": [], "eof": True, "bytes_unread": 0,
    }
    writer = qwriter = ids = None
    if part_dir:
        writer = ShardWriter(part_dir, prefix=part_name, shard_docs=ingest.shard_docs)
        qwriter = AtomicJsonlWriter(Path(part_dir) / f"{part_name}-quarantine.jsonl")
        ids = IdSpill(Path(part_dir) / f"{part_name}-ids", ingest.id_partitions)
    idx = 0
    try:
        for rec in iter_records(path, source.format, ingest.max_record_bytes, source.storage_options,
                                ingest.max_compression_ratio):
            if stop is not None and idx >= stop:
                res["eof"] = False
                break
            if isinstance(rec, Skipped):
                if idx >= start:
                    res["skipped"][rec.rec_type] += 1
                continue
            i, idx = idx, idx + 1
            if i < start:
                continue
            res["docs_in"] += 1
            res["bytes_in"] += len(rec.payload) if rec.payload is not None else len((rec.text or "").encode("utf-8", "surrogatepass"))
            outcome, reason, doc, detail = record_to_doc(rec, source, ingest, path)
            if outcome == "kept":
                n_bytes = len(doc["text"].encode("utf-8"))
                res["docs_out"] += 1
                res["bytes_out"] += n_bytes
                if writer is not None:
                    writer.write(doc)
                    ids.add(doc["id"], n_bytes)
                else:
                    res["docs"].append(doc)
            elif outcome == "dropped":
                res["dropped"][reason] += 1
            else:
                res["quarantined"][reason] += 1
                entry = {"source": source.name, "file": path, "offset": rec.offset, "record_index": i,
                         "reason": reason, "detail": detail, "url": rec.url,
                         "warc_record_id": rec.warc_record_id}
                # the line, the record's byte range in the (decompressed) stream, the file bytes not read
                entry.update({k: rec.extra[k] for k in _ENTRY_EXTRAS if k in rec.extra})
                res["bytes_unread"] += rec.extra.get("unread_bytes", 0)
                if qwriter is not None:
                    qwriter.write(entry)
                else:
                    res["quarantine"].append(entry)
        if writer is not None:
            res["shards"] = [str(p) for p in writer.close()]
            res["quarantine_file"] = str(qwriter.close())
            res["ids"] = [str(p) for p in ids.close()]
            res["parts"] = res["shards"] + [res["quarantine_file"]] + res["ids"]
    except BaseException:
        for w in (writer, qwriter):
            if w is not None:
                w.abort()
        raise
    res["consumed"] = res["docs_in"]
    res["seconds"] = time.perf_counter() - t0
    for k in ("dropped", "quarantined", "skipped"):
        res[k] = dict(res[k])
    return res
