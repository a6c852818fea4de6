"""Writes the bad-input corpus beside this file (run once; the files are committed). Deterministic.

    python tests/data/bad/make.py

Each file is one kind of damage the pipeline's readers must survive; tests/test_bad_inputs.py runs
them through ingest and the config loader. README.md lists what each holds."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

HERE = Path(__file__).resolve().parent


def good_lines(prefix: str, n: int = 3) -> list[bytes]:
    return [json.dumps({"id": f"{prefix}-{i}", "text": f"A good {prefix} document, number {i}, with a few words."}
                       ).encode() for i in range(n)]


def warc_record(uri: str, html: bytes, declared: int | None = None) -> bytes:
    """One gzip member holding a WARC response record; `declared`: a wrong Content-Length."""
    http = b"HTTP/1.1 200 OK\r\nContent-Type: text/html; charset=utf-8\r\n\r\n" + html
    length = len(http) if declared is None else declared
    head = (f"WARC/1.0\r\nWARC-Type: response\r\nWARC-Target-URI: {uri}\r\n"
            f"WARC-Date: 2024-01-01T00:00:00Z\r\nWARC-Record-ID: <urn:uuid:{hashlib.sha256(uri.encode()).hexdigest()[:8]}"
            "-0000-4000-8000-000000000000>\r\n"
            f"Content-Type: application/http; msgtype=response\r\nContent-Length: {length}\r\n\r\n").encode()
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as z:
        z.write(head + http + b"\r\n\r\n")
    return buf.getvalue()


def corrupt_member(data: bytes) -> bytes:
    """A gzip member of `data` whose first deflate block header says block type 3 (reserved: invalid)."""
    member = bytearray(gzip.compress(data, mtime=0))
    member[10] |= 0b110  # gzip.compress writes a 10-byte header (no name): byte 10 starts the deflate data
    return bytes(member)


def main() -> None:
    page = lambda i: (f"<html><head><title>Page {i}</title></head><body><article><h1>Page {i}</h1>"  # noqa: E731
                      + "".join(f"<p>This is paragraph {j} of page {i}, a plain sentence for extraction.</p>"
                                for j in range(8)) + "</article></body></html>").encode()
    (HERE / "good.jsonl").write_bytes(b"\n".join(good_lines("good")) + b"\n")
    full = gzip.compress(b"\n".join(good_lines("trunc", 40)) + b"\n", mtime=0)
    (HERE / "truncated.jsonl.gz").write_bytes(full[: len(full) * 2 // 3])
    (HERE / "not-json.jsonl").write_bytes(b"\n".join([good_lines("nj", 1)[0], b'{"id": "nj-x", "text": "cut',
                                                      b"plain words, not JSON", good_lines("nj2", 1)[0]]) + b"\n")
    (HERE / "invalid-utf8.jsonl").write_bytes(b"\n".join([b'{"id": "u-1", "text": "caf\xe9 latin-1, not UTF-8"}',
                                                          good_lines("u", 1)[0]]) + b"\n")
    (HERE / "oversized-record.jsonl").write_bytes(b"\n".join([json.dumps({"id": "big", "text": "word " * 40_000}).encode(),
                                                              good_lines("after-big", 1)[0]]) + b"\n")
    (HERE / "empty.jsonl").write_bytes(b"")
    bomb = b'{"id": "bomb", "text": "' + b"0" * (20 << 20) + b'"}\n'
    (HERE / "bomb.jsonl.gz").write_bytes(gzip.compress(bomb, compresslevel=9, mtime=0))
    # one oversized but highly compressible line (2 MB in ~2 kB) in front of 1,000 good records: the line is
    # quarantined and every record behind it read (gzip and zstd)
    hidden = lambda prefix: b"\n".join([json.dumps({"id": "big", "text": "x" * (2 << 20)}).encode(),  # noqa: E731
                                         *good_lines(prefix, 1000)]) + b"\n"
    (HERE / "big-first-line.jsonl.gz").write_bytes(gzip.compress(hidden("hidden"), compresslevel=9, mtime=0))
    import zstandard

    (HERE / "big-first-line.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(hidden("hidden-zst")))
    # a first gzip member whose deflate data is damaged (invalid block type), then three good members
    (HERE / "corrupt-first-member.jsonl.gz").write_bytes(
        corrupt_member(b"\n".join(good_lines("lost", 10)) + b"\n")
        + b"".join(gzip.compress(b"\n".join(good_lines(f"member{m}", 10)) + b"\n", mtime=0) for m in range(3)))
    pq.write_table(pa.table({"id": ["p-0", "p-1"], "body": ["no text column here", "nor here"]}),
                   HERE / "wrong-schema.parquet")
    (HERE / "wrong-content-length.warc.gz").write_bytes(
        warc_record("https://bad.test/0", page(0)) + warc_record("https://bad.test/1", page(1), declared=50_000)
        + warc_record("https://bad.test/2", page(2)))
    (HERE / "bad-config.yaml").write_text(
        "name: bad\n"
        "sources:\n"
        "  - {name: s3-data, uri: 's3://bucket/*.jsonl', format: jsonl, licence: CC0, provenance: test,\n"
        "     storage_options: {key: AKIAEXAMPLEKEY, secret: plain-text-secret}}\n"
        "tokenizer: {vocab_size: lots}\n"
        "train: {max_steps: -5, learning_rate: 0.1}\n"
        "surprise: true\n")


if __name__ == "__main__":
    main()
