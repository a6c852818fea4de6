"""Streaming readers for raw source files: WARC, WET, JSONL(.gz), plain text and Parquet.

`iter_records(uri, fmt, max_record_bytes)` yields, in file order, either

* `RawRecord`: one candidate document (a WARC `response`, a WET `conversion`, a JSONL line,
  a text file, a Parquet row). When the reader could not make sense of the bytes the record
  carries `error` (a quarantine reason) and `detail`; it still counts as one record read.
* `Skipped`: a record of another type (warcinfo, request, metadata, resource...), counted
  but not a candidate.

Files are opened by URI (`tasks.core.fs.open_source`: local paths, file://, http(s)://,
s3://) as buffered streams. Nothing loads a whole file: WARC/WET go record by record through
warcio (gzip per record), JSONL (plain, gzip or zstd, detected from the first bytes; a
compressed file is inflated member by member, see `_Members`) line by line (a line longer than
`max_record_bytes` is skipped without being held, quarantined with its byte range, and reading
goes on with the next line), Parquet by batches (through a seekable fsspec file). A text file is one document and is read only up to
`max_record_bytes`. An HTTP stream cannot seek: a damaged WARC record there ends the file
(quarantined as "malformed_warc", detail saying the rest was not read) instead of resynchronising.

Bad input never raises out of a reader:

* empty file → "empty_file"
* WARC: a record warcio cannot parse (bad header, corrupt gzip member) → "malformed_warc",
  then the reader resynchronises on the next gzip member (or "WARC/1." line when the file is
  not gzipped) that parses, so one broken record does not lose the rest of the file (the bytes
  skipped are in the record's `extra`: `unread_range`, `unread_bytes`, as for JSONL below); a record
  shorter than its Content-Length (truncated file) → "truncated"; digest mismatch →
  "digest_mismatch"; undecodable Content-Encoding → "bad_content_encoding"; payload over
  `max_record_bytes` → "oversized_record"; a response without an HTTP header → "malformed_warc"
* JSONL: a line over `max_record_bytes` → "oversized_record" (`extra`: `byte_range`, `bytes`, of
  the decompressed stream); a file that ends inside a gzip member / zstd frame → "truncated";
  a member that does not decode, or bytes that start none → "bad_gzip"; more than
  `max_compression_ratio` bytes inflated per compressed byte (beyond an allowance of
  `max_compression_ratio * max_record_bytes`, so one oversized line is skipped, not judged a bomb)
  → "decompression_bomb". After "bad_gzip" and "decompression_bomb" reading resumes at the next
  member that decodes (or the rest of the file is the damage); the record's `extra` has the file
  bytes not read (`unread_range` [start, end), `unread_bytes`), which the run summary adds up per
  file. Invalid UTF-8 → "invalid_utf8"; unparsable line or not an object → "bad_json"; no string
  `text` → "missing_text"
* WET payloads and text files must be UTF-8 → "invalid_utf8"
"""
from __future__ import annotations

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
_GZIP_IN = 1 << 16  # compressed bytes fed to zlib per call (a failing call loses at most this much)
_ZSTD_IN = 256  # compressed bytes fed to zstd per call: at most 64 blocks of 128 KiB come out of it
_PROBE = 1 << 16  # compressed bytes (and output) decoded to accept a candidate member start


@dataclass
class _Gap:
    """Damage in a compressed file: its bytes [start, end) were not read (start == end: none were
    skipped, e.g. the file ends inside a member), with the quarantine reason and what happened."""

    reason: str
    detail: str
    start: int
    end: int


class _Members:
    """The decompressed bytes of a gzip (concatenated members) or zstd (concatenated frames) file read
    front to back from `raw`, in pieces of about a MiB, with `_Gap`s where it is damaged.

    Each member is inflated on its own with zlib/zstd, so the file offset where each starts and how far
    decoding got are known. A member that fails to decode, bytes that start no member and a member
    inflating past the ratio limit (a decompression bomb: more than `max_ratio` inflated bytes per
    compressed byte read, beyond an allowance of `max_ratio * max_record_bytes` so that one oversized
    record can be skipped) end in a gap: the bytes from where decoding stopped to the next member start
    that decodes (scanned for, then `_PROBE` bytes of it decoded) are not read, and reading resumes
    there; without one, the rest of the file is the gap. Memory stays bounded whatever the ratio:
    zlib's output is capped per call, and zstd is fed `_ZSTD_IN` bytes at a time."""

    def __init__(self, raw, kind: str, max_record_bytes: int, max_ratio: float):
        self.raw, self.kind, self.max_ratio = raw, kind, max_ratio
        self.allowance = max_ratio * max_record_bytes
        self.magic = _GZIP_MAGIC if kind == "gzip" else _ZSTD_MAGIC
        self.buf, self.base, self.eof = b"", 0, False  # unread input, its file offset, raw exhausted
        self.inflated = 0
        if kind == "zstd":
            import zstandard

            self._zstd, self._errors = zstandard.ZstdDecompressor(), (zstandard.ZstdError,)
        else:
            self._errors = (zlib.error,)

    def _fill(self, n: int) -> bool:
        """Read until `buf` holds `n` bytes or the file ends; whether it holds them."""
        while len(self.buf) < n and not self.eof:
            chunk = self.raw.read(_CHUNK)
            if chunk:
                self.buf += chunk
            else:
                self.eof = True
        return len(self.buf) >= n

    def _advance(self, n: int) -> None:
        self.buf, self.base = self.buf[n:], self.base + n

    def _decompressor(self):
        return zlib.decompressobj(31) if self.kind == "gzip" else self._zstd.decompressobj()

    def _starts_member(self) -> bool:
        head = self.buf[:4]
        if self.kind == "gzip":
            return head[:3] == _GZIP_MAGIC
        # a zstd frame, or a skippable frame (magic 0x184D2A5?, little-endian)
        return head == _ZSTD_MAGIC or (len(head) == 4 and head[1:] == b"\x2a\x4d\x18" and head[0] & 0xF0 == 0x50)

    def _step(self, d, data: bytes, limit: int = _CHUNK) -> tuple[bytes, int, bool]:
        """Decode from the start of `data` until about `limit` bytes came out, `data` is used up or the
        member ends: (output, input bytes used, member ended). Raises the codec's error."""
        out, n_out, used = [], 0, 0
        while True:
            if self.kind == "gzip":
                piece = data[used:used + _GZIP_IN]
                got = d.decompress(piece, limit - n_out)
                rest = d.unused_data if d.eof else d.unconsumed_tail
            else:
                piece = data[used:used + _ZSTD_IN]
                got = d.decompress(piece)
                rest = d.unused_data if d.eof else b""
            used += len(piece) - len(rest)
            out.append(got)
            n_out += len(got)
            if d.eof or n_out >= limit or used >= len(data):
                return b"".join(out), used, d.eof

    def chunks(self) -> Iterator[bytes | _Gap]:
        while self._fill(1):
            if self.kind == "gzip" and self.buf[0] == 0:  # zero padding after a member, as gzip allows
                self._advance(len(self.buf) - len(self.buf.lstrip(b"\0")))
                continue
            self._fill(4)
            if self._starts_member():
                yield from self._member()
            else:
                yield self._resync("bad_gzip", f"the bytes at {self.base} start no {self.kind} member", self.base)

    def _member(self) -> Iterator[bytes | _Gap]:
        start, d = self.base, self._decompressor()
        while True:
            self._fill(1)
            try:
                out, used, done = self._step(d, self.buf)
            except self._errors as e:
                # the next member starts after this one's start (a member that fails at once is skipped)
                yield self._resync("bad_gzip", f"the {self.kind} member at byte {start} does not decode "
                                               f"({type(e).__name__}: {str(e)[:200]})", max(self.base, start + 1))
                return
            self._advance(used)
            if out:
                self.inflated += len(out)
                yield out
            if done:
                return
            if self.inflated > self.max_ratio * self.base + self.allowance:
                ratio = self.inflated / max(1, self.base)
                yield self._resync("decompression_bomb", (
                    f"{self.inflated} bytes inflated from {self.base} ({ratio:.0f}x > max_compression_ratio "
                    f"{self.max_ratio:g}, beyond an allowance of {self.allowance:.0f} bytes)"), self.base)
                return
            if not out and not self.buf and self.eof:
                yield _Gap("truncated", f"the file ends inside the {self.kind} member that starts at byte {start}",
                           self.base, self.base)
                return

    def _decodes(self, i: int) -> bool:
        """Whether a member that starts at buf[i] decodes for its first `_PROBE` bytes."""
        self._fill(i + _PROBE)
        try:
            self._step(self._decompressor(), self.buf[i:i + _PROBE], _PROBE)
        except self._errors:
            return False
        return True

    def _resync(self, reason: str, detail: str, search_from: int) -> _Gap:
        """Skip to the first member start at or after file offset `search_from` that decodes: the gap
        from where decoding stopped (`base`) to there, or to the end of the file."""
        start, i = self.base, search_from - self.base
        while True:
            self._fill(i + len(self.magic))
            j = self.buf.find(self.magic, i)
            if j >= 0 and self._decodes(j):
                break
            if j >= 0:
                i = j + 1
            elif self.eof:
                j = len(self.buf)
                break
            else:  # drop what was searched, keeping the tail a magic number may straddle
                drop = max(0, len(self.buf) - len(self.magic) + 1)
                self._advance(drop)
                i = max(i - drop, 0)
        self._advance(j)
        end = self.base
        what = (f"reading resumed at the next {self.kind} member (byte {end})" if self.buf or not self.eof
                else "the rest of the file was not read")
        return _Gap(reason, f"{detail}; file bytes {start}-{end} ({end - start} bytes) not read; {what}",
                    start, end)


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
    held = None  # (record, start): damage held back until reading resumes, to carry the bytes skipped

    def release(end: int) -> RawRecord:
        rec, start = held
        if end > start:
            rec.detail += f"; file bytes {start}-{end} ({end - start} bytes) not read"
            rec.extra["unread_range"], rec.extra["unread_bytes"] = [start, end], end - start
        return rec

    while pos is not None and pos < size:
        fh.seek(pos)
        warc = _WarcPass(fh, want, max_record_bytes, start=pos)
        try:
            for out in warc:
                if held:  # reading resumed at `pos`: the damaged span ends there
                    yield release(pos)
                    held = None
                yield out
            probing = probing and warc.count == 0
            end, last, last_error = warc.end, warc.last, warc.last_error
            if end >= size and last_error != "truncated":
                break
            if end < size and not probing and last_error is None:
                held = (RawRecord(offset=end, error="truncated", detail=f"archive stream ends at byte {end} of {size}"),
                        end)
            # a cut-short member may be followed by intact ones: look for them
            resume = (last if last_error == "truncated" else max(end, last, pos)) + 1
        except Exception as e:  # warcio/zlib/parse errors: quarantine, then resynchronise
            fail = warc.failed_at
            if not (probing and warc.count == 0):
                if held:
                    yield release(fail)
                held = (RawRecord(offset=fail, error="malformed_warc", detail=f"{type(e).__name__}: {e}".strip()[:300]),
                        fail)
            resume = max(fail, pos) + 1
        probing = True
        pos = _scan_for(fh, resume, magic)
    if held:
        yield release(size if pos is None else min(pos, size))


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


class _Lines:
    """Splits a byte stream into lines in bounded memory: a line longer than `max_bytes` is not held,
    only its extent is counted. Offsets are of the (decompressed) stream."""

    def __init__(self, max_bytes: int):
        self.max = max_bytes
        self.offset = self.start = 0  # the next byte; where the current line starts
        self.parts: list[bytes] = []
        self.size, self.over, self.line_no = 0, False, 0

    def feed(self, chunk: bytes) -> Iterator[tuple[int, int, int, bytes | None]]:
        """The lines `chunk` completes: (line number, start, size without the newline, the line's bytes or
        None when it is over `max_bytes`)."""
        pos, n = 0, len(chunk)
        while pos < n:
            nl = chunk.find(b"\n", pos)
            end = n if nl < 0 else nl
            if not self.over:
                if self.size + end - pos > self.max:
                    self.over, self.parts = True, []
                else:
                    self.parts.append(chunk[pos:end])
            self.size += end - pos
            if nl < 0:
                self.offset += n - pos
                return
            self.offset += end - pos + 1
            pos = end + 1
            yield self._take()

    def finish(self) -> tuple[int, int, int, bytes | None] | None:
        """The last line when the stream does not end with a newline."""
        return self._take() if self.size or self.over else None

    def cut(self) -> tuple[int, int, int] | None:
        """Damage ended the stream inside a line: drop it; its (line number, start, size) or None."""
        lost = (self.line_no + 1, self.start, self.size) if self.size or self.over else None
        if lost:
            self.line_no += 1
        self.start, self.parts, self.size, self.over = self.offset, [], 0, False
        return lost

    def _take(self) -> tuple[int, int, int, bytes | None]:
        self.line_no += 1
        line = (self.line_no, self.start, self.size, None if self.over else b"".join(self.parts))
        self.start, self.parts, self.size, self.over = self.offset, [], 0, False
        return line


def _line_record(line_no: int, start: int, size: int, data: bytes | None, name: str, max_line_bytes: int
                 ) -> RawRecord | None:
    """The record of one JSONL line (None for a blank line)."""
    extra = {"line": line_no}
    if data is None:
        return RawRecord(offset=start, error="oversized_record",
                         detail=f"line {line_no}: {size} bytes > max_record_bytes {max_line_bytes} (bytes "
                                f"{start}-{start + size} of the stream); skipped, reading went on with the next line",
                         extra={**extra, "byte_range": [start, start + size], "bytes": size})
    if not data.strip():
        return None
    try:
        s = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return RawRecord(offset=start, error="invalid_utf8", detail=f"line {line_no}: {e}"[:300], extra=extra)
    try:
        obj = json.loads(s)
    except (ValueError, RecursionError) as e:
        return RawRecord(offset=start, error="bad_json", detail=f"line {line_no}: {e}"[:300], extra=extra)
    if not isinstance(obj, dict):
        return RawRecord(offset=start, error="bad_json", detail=f"line {line_no}: not an object", extra=extra)
    return _jsonl_record(obj, start, line_no, name)


def _gap_record(gap: _Gap, lines: _Lines) -> RawRecord:
    """The quarantine record of a damaged span: the file bytes not read, and the line it cut short."""
    detail, extra = gap.detail, {}
    lost = lines.cut()
    if lost:
        line_no, start, size = lost
        detail += f"; line {line_no} (stream bytes {start}-{start + size}, unfinished) went with it"
        extra["line"] = line_no
    if gap.end > gap.start:
        extra["unread_range"], extra["unread_bytes"] = [gap.start, gap.end], gap.end - gap.start
    return RawRecord(offset=lost[1] if lost else lines.offset, error=gap.reason, detail=detail, extra=extra)


def _iter_jsonl(raw: io.BufferedReader, name: str, max_line_bytes: int,
                max_ratio: float = 100.0) -> Iterator[RawRecord]:
    head = raw.peek(4)[:4]
    if head[:2] == b"\x1f\x8b":
        pieces = _Members(raw, "gzip", max_line_bytes, max_ratio).chunks()
    elif head == _ZSTD_MAGIC:
        pieces = _Members(raw, "zstd", max_line_bytes, max_ratio).chunks()
    else:
        pieces = iter(lambda: raw.read(_CHUNK), b"")
    lines, any_record = _Lines(max_line_bytes), False
    for piece in pieces:
        if isinstance(piece, _Gap):
            any_record = True
            yield _gap_record(piece, lines)
            continue
        for line in lines.feed(piece):
            if (rec := _line_record(*line, name, max_line_bytes)) is not None:
                any_record = True
                yield rec
    if (last := lines.finish()) is not None and (rec := _line_record(*last, name, max_line_bytes)) is not None:
        any_record = True
        yield rec
    if not any_record:
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
