"""Streaming readers for raw source files: WARC, WET, JSONL(.gz), plain text and Parquet.

`iter_records(uri, fmt, max_record_bytes)` yields, in file order, either

* `RawRecord`: one candidate document (a WARC `response`, a WET `conversion`, a JSONL line,
  a text file, a Parquet row). When the reader could not make sense of the bytes the record
  carries `error` (a quarantine reason) and `detail`; it still counts as one record read.
* `Skipped`: a record of another type (warcinfo, request, metadata, resource...), counted
  but not a candidate.

Files are opened by URI (`tasks.core.fs.open_source`: local paths, file://, http(s)://,
s3://) as buffered streams. Nothing loads a whole file: WARC/WET go record by record through
warcio (gzip per record), JSONL (plain, gzip or
zstd, detected from the first bytes) line by line
(lines longer than `max_record_bytes` are skipped in chunks and quarantined), Parquet by
batches (through a seekable fsspec file). A text file is one document and is read only up to
`max_record_bytes`. An HTTP stream cannot seek: a damaged WARC record there ends the file
(quarantined as "malformed_warc", detail saying the rest was not read) instead of resynchronising.

Bad input never raises out of a reader:

* empty file → "empty_file"
* WARC: a record warcio cannot parse (bad header, corrupt gzip member) → "malformed_warc",
  then the reader resynchronises on the next gzip member (or "WARC/1." line when the file is
  not gzipped) that parses, so one broken record does not lose the rest of the file; a record
  shorter than its Content-Length (truncated file) → "truncated"; digest mismatch →
  "digest_mismatch"; undecodable Content-Encoding → "bad_content_encoding"; payload over
  `max_record_bytes` → "oversized_record"; a response without an HTTP header → "malformed_warc"
* JSONL: truncated gzip → "truncated"; other gzip/zstd damage → "bad_gzip"; invalid UTF-8 →
  "invalid_utf8"; unparsable line or not an object → "bad_json"; no string `text` → "missing_text";
  a gzip/zstd file inflating more than `max_compression_ratio` times (once `max_record_bytes` are
  inflated) → "decompression_bomb", and the rest of the file is not read
* WET payloads and text files must be UTF-8 → "invalid_utf8"
"""
from __future__ import annotations

import gzip
import io
import json
import posixpath
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from warcio.archiveiterator import ArchiveIterator

from tasks.core.fs import open_random, open_source

_CHUNK = 1 << 20
_GZIP_MAGIC = b"\x1f\x8b\x08"
_WARC_MAGIC = b"WARC/1."


@dataclass
class RawRecord:
    offset: int
    kind: str = "text"  # "html": payload holds raw bytes to extract; "text": text is ready
    payload: bytes | None = None
    text: str | None = None
    key: str | None = None  # stable per-source key for the document id
    url: str | None = None
    title: str | None = None
    date: str | None = None
    crawl_date: str | None = None
    content_type: str | None = None
    warc_record_id: str | None = None
    language: str | None = None
    language_score: float | None = None
    http_status: int | None = None
    error: str | None = None  # quarantine reason
    detail: str = ""
    extra: dict = field(default_factory=dict)


@dataclass
class Skipped:
    offset: int
    rec_type: str


_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def _decompressed(fh: io.BufferedReader):
    """Binary stream of the decompressed bytes of `fh`: gzip (multi-member), zstd or plain,
    detected from the first bytes (peeked, so nothing is read twice)."""
    head = fh.peek(4)[:4]
    if head[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=fh, mode="rb")
    if head == _ZSTD_MAGIC:
        return io.BufferedReader(_ZstdRaw(fh), _CHUNK)
    return fh


class _ZstdRaw(io.RawIOBase):
    """Streaming zstd decompression over concatenated frames that raises EOFError when the file
    ends inside a frame (zstandard's own stream reader just stops)."""

    def __init__(self, fh):
        import zstandard

        self._zstd = zstandard.ZstdDecompressor()
        self._f = fh
        self._d = self._zstd.decompressobj()
        self._in_frame = False
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._buf:
            chunk = self._f.read(_CHUNK)
            if not chunk:
                if self._in_frame:
                    raise EOFError("zstd stream ends inside a frame")
                return 0
            out = []
            while chunk:
                out.append(self._d.decompress(chunk))
                self._in_frame = not self._d.eof
                chunk = self._d.unused_data if self._d.eof else b""
                if self._d.eof:
                    self._d = self._zstd.decompressobj()
            self._buf = b"".join(out)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        self._f.close()
        super().close()


def iter_records(uri: str | Path, fmt: str, max_record_bytes: int = 10_000_000,
                 storage_options: dict | None = None,
                 max_compression_ratio: float = 100.0) -> Iterator[RawRecord | Skipped]:
    """Records of the source file `uri` (a local path or any URI `fs.open_source` opens with the
    source's `storage_options`)."""
    uri = str(uri)
    if fmt not in ("warc", "wet", "jsonl", "text", "parquet"):
        raise ValueError(f"unknown source format {fmt!r}")
    if fmt == "parquet":
        yield from _iter_parquet(uri, storage_options)
        return
    with open_source(uri, storage_options) as fh:
        if not fh.peek(1)[:1]:
            yield RawRecord(offset=0, error="empty_file", detail="file has 0 bytes")
            return
        if fmt in ("warc", "wet"):
            yield from _iter_warc(fh, "response" if fmt == "warc" else "conversion", max_record_bytes)
        elif fmt == "jsonl":
            yield from _iter_jsonl(fh, posixpath.basename(uri), max_record_bytes, max_compression_ratio)
        else:
            yield from _iter_text(fh, posixpath.basename(uri), max_record_bytes)


# --------------------------------------------------------------------------- WARC / WET

def _scan_for(fh, start: int, magic: bytes) -> int | None:
    """Offset of the next `magic` at or after `start`, reading in chunks."""
    pos = start
    keep = len(magic) - 1
    tail = b""
    while True:
        fh.seek(pos)
        chunk = fh.read(_CHUNK)
        if not chunk:
            return None
        buf = tail + chunk
        i = buf.find(magic)
        if i >= 0:
            return pos - len(tail) + i
        tail = buf[-keep:] if keep else b""
        pos += len(chunk)


def _warc_record(rec, offset: int, want: str, max_record_bytes: int) -> RawRecord:
    h = rec.rec_headers
    out = RawRecord(
        offset=offset,
        url=h.get_header("WARC-Target-URI"),
        crawl_date=h.get_header("WARC-Date"),
        warc_record_id=h.get_header("WARC-Record-ID"),
    )
    out.key = out.warc_record_id or out.url or f"offset:{offset}"
    if want == "response":
        out.kind = "html"
        if rec.http_headers is None:
            out.error, out.detail = "malformed_warc", "response record without an HTTP header"
            return out
        out.content_type = rec.http_headers.get_header("Content-Type")
        try:
            out.http_status = int(rec.http_headers.get_statuscode())
        except (TypeError, ValueError):
            out.http_status = None
    else:
        out.kind = "text"
        out.content_type = h.get_header("Content-Type")
        out.extra["warc_language"] = h.get_header("WARC-Identified-Content-Language")
    try:
        data = rec.content_stream().read(max_record_bytes + 1)
    except (zlib.error, OSError, ValueError, EOFError) as e:
        out.error, out.detail = "bad_content_encoding", f"{type(e).__name__}: {e}"[:300]
        return out
    if len(data) > max_record_bytes:
        out.error, out.detail = "oversized_record", f"payload over {max_record_bytes} bytes"
        return out
    if rec.raw_stream.limit > 0:
        out.error = "truncated"
        out.detail = f"record ends {rec.raw_stream.limit} bytes before its Content-Length"
        return out
    if rec.digest_checker.passed is False:
        out.error, out.detail = "digest_mismatch", "; ".join(rec.digest_checker.problems)[:300]
        return out
    if want == "response":
        out.payload = data
    else:
        try:
            out.text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            out.error, out.detail = "invalid_utf8", str(e)[:300]
    return out


class _WarcPass:
    """One pass of warcio over a stream from `start`: the records of type `want` (others as
    `Skipped`), remembering what the damage handling needs after the pass ends or fails: the
    offset and error of the last record, and how many records were read."""

    def __init__(self, fh, want: str, max_record_bytes: int, start: int = 0):
        self.it = ArchiveIterator(fh, check_digests=True)
        self.want, self.max_record_bytes = want, max_record_bytes
        self.last, self.last_error, self.count = start, None, 0

    def __iter__(self) -> Iterator[RawRecord | Skipped]:
        for rec in self.it:
            self.last = self.it.offset
            self.count += 1
            if rec.rec_type != self.want:
                self.last_error = None
                yield Skipped(self.last, rec.rec_type or "unknown")
                continue
            out = _warc_record(rec, self.last, self.want, self.max_record_bytes)
            self.last_error = out.error
            yield out

    @property
    def end(self) -> int:
        return self.it.offset

    @property
    def failed_at(self) -> int:
        """Where an exception stopped the pass."""
        return max(getattr(self.it, "offset", self.last), self.last)


def _iter_warc(fh: io.BufferedReader, want: str, max_record_bytes: int) -> Iterator[RawRecord | Skipped]:
    # warcio stops quietly when a gzip member is cut short or fails to inflate part-way (it
    # reports on stderr and returns EOF), so a stream that ends before the end of the file is
    # an error too. After any error we resynchronise on the next gzip member / "WARC/1." that
    # parses ("probing": failures while probing are part of the same damaged span, not new
    # records; a pass that reads a record is no longer probing). A stream that cannot seek
    # (HTTP) is read once, front to back.
    magic = _GZIP_MAGIC if fh.peek(2)[:2] == b"\x1f\x8b" else _WARC_MAGIC
    if not fh.seekable():
        yield from _iter_warc_sequential(fh, want, max_record_bytes)
        return
    size = fh.seek(0, io.SEEK_END)
    fh.seek(0)
    pos, probing = 0, False
    while pos is not None and pos < size:
        fh.seek(pos)
        warc = _WarcPass(fh, want, max_record_bytes, start=pos)
        try:
            yield from warc
            probing = probing and warc.count == 0
            end, last, last_error = warc.end, warc.last, warc.last_error
            if end >= size and last_error != "truncated":
                return
            if end < size and not probing and last_error is None:
                yield RawRecord(offset=end, error="truncated",
                                detail=f"archive stream ends at byte {end} of {size}")
            # a cut-short member may be followed by intact ones: look for them
            resume = (last if last_error == "truncated" else max(end, last, pos)) + 1
        except Exception as e:  # warcio/zlib/parse errors: quarantine, then resynchronise
            fail = warc.failed_at
            if not (probing and warc.count == 0):
                yield RawRecord(offset=fail, error="malformed_warc",
                                detail=f"{type(e).__name__}: {e}".strip()[:300])
            resume = max(fail, pos) + 1
        probing = True
        pos = _scan_for(fh, resume, magic)


def _iter_warc_sequential(fh, want: str, max_record_bytes: int) -> Iterator[RawRecord | Skipped]:
    """One pass over a non-seekable stream: the first damage ends the file (quarantined with
    the reason and a note that the rest was not read, since nothing can be re-read)."""
    warc = _WarcPass(fh, want, max_record_bytes)
    try:
        for out in warc:
            yield out
            if warc.last_error == "truncated":
                return
    except Exception as e:  # noqa: BLE001 - quarantine, cannot resynchronise without seeking
        yield RawRecord(offset=warc.failed_at, error="malformed_warc",
                        detail=f"{type(e).__name__}: {e}; rest of the stream not read (not seekable)".strip()[:300])
        return
    try:
        rest = fh.read(1)
    except Exception:  # noqa: BLE001
        rest = b"?"
    if rest:
        yield RawRecord(offset=warc.end, error="truncated",
                        detail=f"archive stream ends at byte {warc.end} before the end of the source")


def _first_str(*values) -> str | None:
    for v in values:
        if isinstance(v, str) and v:
            return v
    return None


def _jsonl_record(obj: dict, offset: int, line_no: int, name: str) -> RawRecord:
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), dict) else {}
    out = RawRecord(offset=offset, kind="text")
    out.extra["line"] = line_no
    text = obj.get("text")
    if not isinstance(text, str):
        out.error, out.detail = "missing_text", f"line {line_no}: no string 'text' field"
        return out
    out.text = text
    out.url = _first_str(obj.get("url"), meta.get("warc_url"), meta.get("url"))
    out.title = _first_str(obj.get("title"), meta.get("title"))
    out.date = _first_str(obj.get("date"), meta.get("date"))
    out.crawl_date = _first_str(obj.get("crawl_date"), meta.get("warc_date"), meta.get("date_download"),
                                obj.get("created"))
    out.content_type = _first_str(obj.get("content_type"), meta.get("content_type"))
    rid = _first_str(obj.get("warc_record_id"), meta.get("warc_record_id"), meta.get("warc_filename"))
    out.warc_record_id = rid if rid and rid.startswith("<urn:") else None
    lang = _first_str(obj.get("language"), meta.get("language"))
    score = obj.get("language_score", meta.get("language_score"))
    if lang:
        out.language = lang
        out.language_score = float(score) if isinstance(score, (int, float)) else None
    rec_id = obj.get("id")
    rec_id = str(rec_id) if isinstance(rec_id, (str, int)) and str(rec_id) else None
    out.key = rec_id or out.url or f"{name}:{line_no}"
    return out


def _bomb(raw, inflated: int, min_inflated: int, max_ratio: float) -> str | None:
    """Why a compressed stream is a decompression bomb (None while it is not): more than
    `max_ratio` inflated bytes per compressed byte once `min_inflated` bytes are inflated."""
    if inflated <= min_inflated:
        return None
    try:
        compressed = max(1, raw.tell())
    except (OSError, ValueError):  # a stream that cannot tell: judged by the record caps only
        return None
    ratio = inflated / compressed
    return (f"{inflated} bytes inflated from {compressed} ({ratio:.0f}x > max_compression_ratio {max_ratio:g}); "
            "the rest of the file was not read") if ratio > max_ratio else None


def _iter_jsonl(raw: io.BufferedReader, name: str, max_line_bytes: int,
                max_ratio: float = 100.0) -> Iterator[RawRecord]:
    offset = line_no = n_lines = 0
    with _decompressed(raw) as fh:
        compressed = fh is not raw
        while True:
            try:
                line = fh.readline(max_line_bytes + 1)
                oversized = len(line) > max_line_bytes and not line.endswith(b"\n")
                skipped = 0
                while oversized and line and not line.endswith(b"\n"):
                    skipped += len(line)
                    if compressed and (bomb := _bomb(raw, offset + skipped, max_line_bytes, max_ratio)):
                        yield RawRecord(offset=offset, error="decompression_bomb", detail=bomb)
                        return
                    line = fh.readline(_CHUNK)
            except EOFError as e:
                yield RawRecord(offset=offset, error="truncated", detail=f"line {line_no + 1}: {e}"[:300])
                return
            except Exception as e:  # gzip.BadGzipFile, zlib.error, zstd errors, OSError
                yield RawRecord(offset=offset, error="bad_gzip", detail=f"line {line_no + 1}: {e}"[:300])
                return
            if not line and not oversized:
                break
            line_no += 1
            start = offset
            offset += len(line) + (skipped if oversized else 0)
            if compressed and (bomb := _bomb(raw, offset, max_line_bytes, max_ratio)):
                yield RawRecord(offset=start, error="decompression_bomb", detail=bomb, extra={"line": line_no})
                return
            if oversized:
                yield RawRecord(offset=start, error="oversized_record",
                                detail=f"line {line_no}: over {max_line_bytes} bytes", extra={"line": line_no})
                continue
            if not line.strip():
                continue
            n_lines += 1
            try:
                s = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield RawRecord(offset=start, error="invalid_utf8", detail=f"line {line_no}: {e}"[:300],
                                extra={"line": line_no})
                continue
            try:
                obj = json.loads(s)
            except (ValueError, RecursionError) as e:
                yield RawRecord(offset=start, error="bad_json", detail=f"line {line_no}: {e}"[:300],
                                extra={"line": line_no})
                continue
            if not isinstance(obj, dict):
                yield RawRecord(offset=start, error="bad_json", detail=f"line {line_no}: not an object",
                                extra={"line": line_no})
                continue
            yield _jsonl_record(obj, start, line_no, name)
    if n_lines == 0:
        yield RawRecord(offset=0, error="empty_file", detail="no non-blank lines")


# --------------------------------------------------------------------------- text / Parquet

def _iter_text(fh: io.BufferedReader, name: str, max_record_bytes: int) -> Iterator[RawRecord]:
    data = fh.read(max_record_bytes + 1)
    if len(data) > max_record_bytes:
        yield RawRecord(offset=0, error="oversized_record", detail=f"file over {max_record_bytes} bytes")
        return
    out = RawRecord(offset=0, kind="text", key=name)
    try:
        out.text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        out.error, out.detail = "invalid_utf8", str(e)[:300]
    yield out


def _iter_parquet(uri: str, storage_options: dict | None = None) -> Iterator[RawRecord]:
    import pyarrow.parquet as pq

    name = posixpath.basename(uri)
    row = 0
    # not reaching the file (missing, access denied, unset credential variable) raises, as for the
    # other formats: it says nothing about the file's content
    with open_random(uri, storage_options) as f:
        try:
            if f.seek(0, io.SEEK_END) == 0:
                yield RawRecord(offset=0, error="empty_file", detail="file has 0 bytes")
                return
            f.seek(0)
            pf = pq.ParquetFile(f)
            for batch in pf.iter_batches(batch_size=1000):
                for obj in batch.to_pylist():
                    rec = _jsonl_record(obj, row, row + 1, name)
                    rec.extra.pop("line", None)
                    rec.extra["row"] = row
                    if rec.key == f"{name}:{row + 1}":
                        rec.key = f"{name}:row{row}"
                    yield rec
                    row += 1
        except Exception as e:  # unreadable Parquet: quarantine the rest of the file
            yield RawRecord(offset=row, error="bad_parquet", detail=f"{type(e).__name__}: {e}"[:300])
