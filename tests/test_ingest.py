"""Ingest: readers on the real files in shared/data, a corrupted fixture set built in tmp_path,
document fields and normalisation, and `run_ingest` on Ray (accounting, order, max_docs)."""
from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import unicodedata
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, IngestConfig, PipelineConfig, RayConfig, SourceConfig
from tasks.core.documents import DOC_SCHEMA, ShardWriter, count_docs, iter_doc_batches, iter_docs
from tasks.ingest import run_ingest
from tasks.ingest.normalise import normalise_text
from tasks.ingest.process import is_opted_out, process_file_range
from tasks.ingest.readers import RawRecord, Skipped, iter_records

DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
WEB = DATA / "web"
needs_data = pytest.mark.skipif(not (WEB / "docs-crawl-00000.warc.gz").exists(), reason=f"no data under {DATA}")


def src(name: str, uri: str, fmt: str, **kw) -> SourceConfig:
    return SourceConfig(name=name, uri=str(uri), format=fmt, licence=kw.pop("licence", "test-licence"),
                        provenance=kw.pop("provenance", "test"), **kw)


def split(items):
    recs = [r for r in items if isinstance(r, RawRecord)]
    skipped = Counter(r.rec_type for r in items if isinstance(r, Skipped))
    return recs, skipped


# ------------------------------------------------------------------ helpers for fixtures

def warc_response(url: str, body: bytes, content_type: str = "text/html; charset=utf-8", status: str = "200 OK",
                  record_id: str | None = None) -> bytes:
    """One gzip member holding one WARC response record (written by warcio)."""
    from warcio.statusandheaders import StatusAndHeaders
    from warcio.warcwriter import WARCWriter

    buf = io.BytesIO()
    w = WARCWriter(buf, gzip=True)
    http = StatusAndHeaders(status, [("Content-Type", content_type)], protocol="HTTP/1.1")
    headers = {"WARC-Record-ID": record_id} if record_id else None
    rec = w.create_warc_record(url, "response", payload=io.BytesIO(body), http_headers=http,
                               warc_headers_dict=headers)
    w.write_record(rec)
    return buf.getvalue()


def html_page(title: str, n: int = 6) -> bytes:
    paras = "".join(
        f"<p>{title} paragraph {i}: the quick brown fox jumps over the lazy dog while the documentation team "
        f"explains how packages are built, tested and released to users around the world.</p>"
        for i in range(n))
    return (f"<html><head><title>{title}</title></head><body><nav>Home | About</nav>"
            f"<article><h1>{title}</h1>{paras}</article><footer>Copyright</footer></body></html>").encode()


# ------------------------------------------------------------------ unit pieces

def test_normalise_text():
    raw = "Cafe\u0301\r\nline\t two\u00a0 spaces  \n\n\n\n  next\u2028para\x00 \ufeff"
    out = normalise_text(raw)
    assert out == "Café\nline two spaces\n\nnext\npara"
    assert unicodedata.is_normalized("NFC", out)
    assert normalise_text(raw, nfc=False, whitespace=False) == raw


def test_opt_out_matches_domain_and_subdomains():
    assert is_opted_out("https://www.example.com/a", ["example.com"])
    assert is_opted_out("example.com/path", ["example.com"])
    assert not is_opted_out("https://notexample.com/", ["example.com"])
    assert not is_opted_out(None, ["example.com"])


def test_opt_out_url_patterns_drop_records():
    from tasks.ingest.process import matches_opt_out_pattern, record_to_doc

    pats = [r"/private/", r"^https?://[^/]*\.example\.org/user/\d+"]
    assert matches_opt_out_pattern("https://a.com/private/x", pats)
    assert matches_opt_out_pattern("https://www.example.org/user/42/profile", pats)
    assert not matches_opt_out_pattern("https://www.example.org/users/", pats)
    assert not matches_opt_out_pattern(None, pats)
    source = src("s", "x", "jsonl", opt_out_url_patterns=pats)
    rec = RawRecord(offset=0, text="some text", url="https://a.com/private/page")
    assert record_to_doc(rec, source, IngestConfig(), "f.jsonl")[:2] == ("dropped", "opt_out")
    rec = RawRecord(offset=0, text="some text", url="https://a.com/public/page")
    assert record_to_doc(rec, source, IngestConfig(), "f.jsonl")[0] == "kept"


def test_shard_writer_sizes_and_atomicity(tmp_path):
    docs = [{"id": f"id{i}", "text": f"text {i}", "source": "s"} for i in range(25)]
    with ShardWriter(tmp_path, shard_docs=10, row_group_docs=4) as w:
        w.write_many(docs)
    assert [p.name for p in w.paths] == ["shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet"]
    assert [pq.ParquetFile(p).metadata.num_rows for p in w.paths] == [10, 10, 5]
    assert pq.read_schema(w.paths[0]).equals(DOC_SCHEMA)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp files left
    batches = list(iter_doc_batches(w.paths, batch_size=7))
    assert max(len(b) for b in batches) <= 7
    assert [d["id"] for d in iter_docs(w.paths)] == [d["id"] for d in docs]
    with pytest.raises(RuntimeError):
        with ShardWriter(tmp_path / "bad", shard_docs=10) as w2:
            w2.write_many(docs[:3])
            raise RuntimeError("boom")
    assert list((tmp_path / "bad").iterdir()) == []


def test_jsonl_zstd_multi_frame_and_truncation(tmp_path):
    import zstandard

    lines = [json.dumps({"id": f"z{i}", "text": f"row {i} " + hashlib.sha256(str(i).encode()).hexdigest() * 4})
             for i in range(6000)]
    frame_a = zstandard.ZstdCompressor().compress("\n".join(lines[:3000]).encode() + b"\n")
    frame_b = zstandard.ZstdCompressor().compress("\n".join(lines[3000:]).encode() + b"\n")
    (tmp_path / "ok.jsonl.zst").write_bytes(frame_a + frame_b)
    recs, _ = split(list(iter_records(tmp_path / "ok.jsonl.zst", "jsonl")))
    assert [r.key for r in recs] == [f"z{i}" for i in range(6000)] and not any(r.error for r in recs)
    (tmp_path / "cut.jsonl.zst").write_bytes(frame_a + frame_b[: len(frame_b) // 2])
    recs, _ = split(list(iter_records(tmp_path / "cut.jsonl.zst", "jsonl")))
    assert recs[-1].error == "truncated" and not any(r.error for r in recs[:-1])
    assert 3000 <= len(recs) - 1 < 6000 and [r.key for r in recs[:-1]] == [f"z{i}" for i in range(len(recs) - 1)]


@pytest.mark.parametrize("codec", ["gzip", "zstd"])
def test_damaged_members_are_skipped_to_the_next_with_their_bytes_counted(codec, tmp_path):
    """good, a decompression bomb, good, garbage, good, a member that does not decode, good: every good
    member's lines are read; each damaged span is one quarantine record with the file bytes it left unread."""
    import zstandard

    def member(data: bytes) -> bytes:
        return gzip.compress(data, mtime=0) if codec == "gzip" else zstandard.ZstdCompressor().compress(data)

    def lines(part: int) -> bytes:
        return b"".join(json.dumps({"id": f"{part}-{i}", "text": f"part {part} line {i}"}).encode() + b"\n"
                        for i in range(10))

    broken = bytearray(member(lines(9)))
    broken[10 if codec == "gzip" else 4] |= 0b110 if codec == "gzip" else 0x08  # invalid block type / frame flag
    parts = [member(lines(0)), member(json.dumps({"id": "bomb", "text": "x" * (20 << 20)}).encode() + b"\n"),
             member(lines(1)), b"not a member " * 20, member(lines(2)), bytes(broken), member(lines(3))]
    starts = [sum(len(p) for p in parts[:i]) for i in range(len(parts) + 1)]
    path = tmp_path / f"damaged.jsonl.{'gz' if codec == 'gzip' else 'zst'}"
    path.write_bytes(b"".join(parts))

    recs, _ = split(list(iter_records(path, "jsonl", max_record_bytes=10_000, max_compression_ratio=100)))
    assert [r.text for r in recs if not r.error] == [f"part {p} line {i}" for p in range(4) for i in range(10)]
    bomb, garbage, bad = [r for r in recs if r.error]
    assert bomb.error == "decompression_bomb" and "max_compression_ratio 100" in bomb.detail
    assert starts[1] < bomb.extra["unread_range"][0] < starts[2] == bomb.extra["unread_range"][1]
    assert (garbage.error, garbage.extra["unread_range"]) == ("bad_gzip", [starts[3], starts[4]])
    assert (bad.error, bad.extra["unread_range"], bad.extra["unread_bytes"]) == \
           ("bad_gzip", [starts[5], starts[6]], starts[6] - starts[5])
    assert all("not read; reading resumed at the next" in r.detail for r in (bomb, garbage, bad))


def test_text_and_parquet_sources(tmp_path):
    (tmp_path / "book.txt").write_text("Chapter one.\n\nIt was a dark night.", encoding="utf-8")
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9")
    recs, _ = split(list(iter_records(tmp_path / "book.txt", "text")))
    assert len(recs) == 1 and recs[0].text.startswith("Chapter one") and recs[0].key == "book.txt"
    assert [r.error for r in iter_records(tmp_path / "bad.txt", "text")] == ["invalid_utf8"]
    assert [r.error for r in iter_records(tmp_path / "book.txt", "text", max_record_bytes=10)] == ["oversized_record"]
    paths = ShardWriter(tmp_path / "pq", shard_docs=100)
    paths.write_many([{"id": "p0", "text": "first row", "url": "https://p.test/0"}, {"id": "p1", "text": "second row"}])
    shard = paths.close()[0]
    recs, _ = split(list(iter_records(shard, "parquet")))
    assert [(r.key, r.text, r.url, r.offset) for r in recs] == [("p0", "first row", "https://p.test/0", 0),
                                                                 ("p1", "second row", None, 1)]
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 not really parquet")
    assert [r.error for r in iter_records(tmp_path / "broken.parquet", "parquet")] == ["bad_parquet"]


# ------------------------------------------------------------------ readers on real files

@needs_data
def test_real_warc_record_types():
    recs, skipped = split(list(iter_records(WEB / "wget-sample-0001.warc.gz", "warc")))
    assert len(recs) == 15 and not any(r.error for r in recs)
    assert skipped == {"request": 15, "resource": 2, "warcinfo": 1, "metadata": 1}
    assert all(r.kind == "html" and r.payload and r.url.startswith("http") for r in recs)
    assert len({r.warc_record_id for r in recs}) == 15


@needs_data
def test_real_wet_conversion_record():
    recs, skipped = split(list(iter_records(WEB / "whirlwind.warc.wet.gz", "wet")))
    assert skipped == {"warcinfo": 1} and len(recs) == 1
    r = recs[0]
    assert r.error is None and r.kind == "text" and r.url == "https://an.wikipedia.org/wiki/Escopete"
    assert "Escopete" in r.text and r.content_type == "text/plain"


@needs_data
def test_real_jsonl_dolma_and_multimember_gzip():
    recs, _ = split(list(iter_records(WEB / "cc-main-2019-30-sample.jsonl.gz", "jsonl")))
    assert len(recs) == 697 and not any(r.error for r in recs)
    assert recs[0].url == "http://16thfleet.wikidot.com/chatter:anewhome"  # metadata.warc_url
    assert recs[0].crawl_date == "2019-07-17T12:15:59.000Z"
    assert len({r.key for r in recs}) == 697
    net, _ = split(list(iter_records(WEB / "cc-net-head-sample.jsonl.gz", "jsonl")))
    assert len(net) == 20  # both gzip members are read
    assert net[0].title and net[0].language == "en" and net[0].language_score == pytest.approx(0.95)


@needs_data
def test_docs_crawl_documents_fields_and_ranges():
    path = str(WEB / "docs-crawl-00000.warc.gz")
    source = src("docs-crawl", path, "warc", licence="GPL-2.0+ OR CC-BY-SA-3.0")
    whole = process_file_range(source, path, IngestConfig(), 0, 12)
    assert whole["docs_in"] == 12 and whole["eof"] is False and whole["skipped"] == {"warcinfo": 1}
    docs = whole["docs"]
    assert whole["docs_out"] == len(docs) >= 10
    for d in docs:
        assert set(d) == set(DOC_SCHEMA.names)
        assert d["source"] == "docs-crawl" and d["licence"] == "GPL-2.0+ OR CC-BY-SA-3.0"
        assert d["url"].startswith("https://") and d["title"] and d["warc_record_id"].startswith("<urn:uuid:")
        assert d["content_type"].startswith("text/html") and d["crawl_date"] and d["date"]
        assert d["text"] and "\r" not in d["text"] and "\n\n\n" not in d["text"] and "  " not in d["text"]
        assert unicodedata.is_normalized("NFC", d["text"])
        assert d["source_file"] == path and d["source_offset"] > 0
    # two ranges give the same documents in the same order, ids are stable
    a = process_file_range(source, path, IngestConfig(), 0, 5)
    b = process_file_range(source, path, IngestConfig(), 5, 12)
    assert [d["id"] for d in a["docs"] + b["docs"]] == [d["id"] for d in docs]
    assert a["skipped"] == {"warcinfo": 1} and b["skipped"] == {}


# ------------------------------------------------------------------ corrupted fixture set

@pytest.fixture(scope="module")
def corrupted(tmp_path_factory):
    """Bad inputs of every kind, with the quarantine/drop reasons each must produce."""
    root = tmp_path_factory.mktemp("corrupted")
    (root / "warc").mkdir()
    (root / "jsonl").mkdir()
    good = [warc_response(f"https://site.test/page{i}", html_page(f"Page {i}")) for i in range(4)]
    garbage = gzip.compress(b"NOT-A-WARC header line\r\n\r\nnonsense\r\n\r\n")
    bad_utf8 = warc_response("https://site.test/bad-utf8", html_page("Bad") + b"\xff\xfe\xfa broken bytes")
    image = warc_response("https://site.test/logo.png", b"\x89PNG\r\n\x1a\n" + b"\0" * 64, content_type="image/png")
    missing = warc_response("https://site.test/missing", html_page("Missing"), status="404 Not Found")
    opted = warc_response("https://blocked.example/secret", html_page("Secret"))
    empty_page = warc_response("https://site.test/empty", b"<html><body></body></html>")
    # a.warc.gz: good, malformed member, good, bad UTF-8, non-HTML, 404, opt-out, empty page, good
    (root / "warc" / "a.warc.gz").write_bytes(
        good[0] + garbage + good[1] + bad_utf8 + image + missing + opted + empty_page + good[2])
    # b.warc.gz: one good record, then a record cut in the middle (truncated gzip)
    (root / "warc" / "b.warc.gz").write_bytes(good[3] + good[0][: len(good[0]) // 2])
    (root / "warc" / "c.warc.gz").write_bytes(b"")  # empty file

    lines = [
        json.dumps({"id": "j1", "text": "First good line of text.", "url": "https://j.test/1"}).encode(),
        b'{"id": "j2", "text": "broken json',
        json.dumps({"id": "j3", "text": "Caf\u00e9 ok"}, ensure_ascii=False).encode()[:-2] + b"\xff\"}",
        json.dumps({"id": "j4", "text": "x" * 3000}).encode(),  # oversized with max_doc_bytes=2000
        json.dumps({"id": "j5", "no_text": True}).encode(),
        json.dumps({"id": "j6", "text": "   "}).encode(),
        json.dumps([1, 2, 3]).encode(),
        json.dumps({"id": "j8", "text": "Last good line.", "metadata": {"url": "blocked.example/x"}}).encode(),
        json.dumps({"id": "j9", "text": "Really the last good line.", "title": "bad \ud800 title"}).encode(),
        json.dumps({"id": "j10", "text": "lone surrogate \ud800 in the text"}).encode(),
        b'[[[[[[[[[[' * 20000 + b']' * 200000,  # deeper than the JSON parser goes
    ]
    (root / "jsonl" / "a.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    full = gzip.compress(b"\n".join(
        json.dumps({"id": f"t{i}", "text": " ".join(hashlib.sha256(f"{i}:{j}".encode()).hexdigest() for j in range(20))}
                   ).encode() for i in range(20)) + b"\n")
    (root / "jsonl" / "b.jsonl.gz").write_bytes(full[: len(full) * 2 // 3])  # truncated gzip
    (root / "jsonl" / "c.jsonl").write_bytes(b"")
    expected = {
        "quarantined": {"malformed_warc": 1, "invalid_utf8": 2, "truncated": 2, "empty_file": 2,
                        "bad_json": 3, "oversized": 1, "missing_text": 1, "invalid_unicode": 1},
        "dropped": {"non_html": 1, "http_status": 1, "opt_out": 2, "empty_extraction": 1, "empty_text": 1},
    }
    return root, expected


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from tasks.core.ray_utils import init_ray

    init_ray(RayConfig(num_cpus=2))
    yield
    ray.shutdown()


def test_corrupted_inputs_quarantined_with_reasons(corrupted, ray_session, tmp_path):
    root, expected = corrupted
    cfg = PipelineConfig(
        name="corrupted",
        sources=[src("bad-warc", root / "warc" / "*.warc.gz", "warc", opt_out_domains=["blocked.example"]),
                 src("bad-jsonl", root / "jsonl" / "*", "jsonl", opt_out_domains=["blocked.example"])],
        ray=RayConfig(num_cpus=2), ingest=IngestConfig(max_doc_bytes=2000, shard_docs=3),
    )
    s = run_ingest(cfg, tmp_path / "out")
    assert s["quarantined"] == expected["quarantined"]
    assert s["dropped"] == expected["dropped"]
    assert s["docs_in"] == s["docs_out"] + sum(s["dropped"].values()) + sum(s["quarantined"].values())
    # good records survive around the damage: the WARC pages before and after the malformed
    # member and before the cut, j1 and j9, and the complete lines of the truncated gzip
    docs = list(iter_docs(s["shards"]))
    urls = [d["url"] for d in docs if d["source"] == "bad-warc"]
    assert urls == ["https://site.test/page0", "https://site.test/page1", "https://site.test/page2",
                    "https://site.test/page3"]
    jsonl_keys = [d["text"][:10] for d in docs if d["source"] == "bad-jsonl"]
    assert jsonl_keys[:2] == ["First good", "Really the"]
    assert len(jsonl_keys) == s["sources"]["bad-jsonl"]["docs_out"] >= 3
    assert len(docs) == s["docs_out"] and all(pq.ParquetFile(p).metadata.num_rows <= 3 for p in s["shards"])
    # quarantine file: one line per quarantined record, with source, file and offset
    q = [json.loads(line) for line in Path(s["quarantine_file"]).read_text().splitlines()]
    assert Counter(e["reason"] for e in q) == Counter(expected["quarantined"])
    assert all(e["source"] in ("bad-warc", "bad-jsonl") and Path(e["file"]).is_absolute()
               and isinstance(e["offset"], int) for e in q)
    malformed = next(e for e in q if e["reason"] == "malformed_warc")
    assert malformed["file"].endswith("a.warc.gz") and malformed["offset"] > 0
    # the garbage member it resynchronised over is counted as bytes not read, in the summary too
    garbage = len(gzip.compress(b"NOT-A-WARC header line\r\n\r\nnonsense\r\n\r\n"))
    assert malformed["unread_range"] == [malformed["offset"], malformed["offset"] + garbage]
    cut = next(e for e in q if e["file"].endswith("b.warc.gz") and "unread_range" in e)  # the half member at its end
    assert cut["reason"] == "truncated" and cut["unread_range"][1] == (root / "warc" / "b.warc.gz").stat().st_size
    assert s["files_unread"] == {malformed["file"]: garbage, cut["file"]: cut["unread_bytes"]}
    assert s["bytes_unread"] == garbage + cut["unread_bytes"]
    bad_json = [e for e in q if e["reason"] == "bad_json"]
    assert sorted(e["line"] for e in bad_json) == [2, 7, 11]
    assert next(d for d in docs if d["text"].startswith("Really"))["title"] == "bad \ufffd title"
    assert s["sources"]["bad-warc"]["files"] == sorted(str(p) for p in (root / "warc").glob("*.warc.gz"))
    assert s["sources"]["bad-warc"]["licence"] == "test-licence"


def _refuse_document_reads(monkeypatch) -> None:
    """In this (the driver's) process, any read of Parquet rows raises; footers stay readable
    (the manifest's row counts). Ray workers are other processes: they read as usual."""
    import tasks.core.documents as documents

    def refuse(*args, **kwargs):
        raise AssertionError("the ingest driver read documents")

    for name in ("iter_docs", "iter_doc_batches"):
        monkeypatch.setattr(documents, name, refuse)
    monkeypatch.setattr(pq, "read_table", refuse)
    for name in ("iter_batches", "read", "read_row_group", "read_row_groups"):
        monkeypatch.setattr(pq.ParquetFile, name, refuse)


def test_duplicate_ids_across_jobs_dropped_on_the_workers(ray_session, tmp_path, monkeypatch):
    """Repeated record ids (the same source and key: the same document id) within a job, across the
    files of a source and across the record ranges of a capped file: exactly the later occurrences
    are dropped as "duplicate_id", counted per source; the same key in another source is another
    document. The driver reads no document (the resolution runs in Ray tasks per id partition), and
    the shards are the jobs' parts: linked, rewritten where they lost documents, left out where
    they lost all."""
    from tasks.core.documents import make_doc_id

    files = {"a/a0.jsonl": ["x0", "x1", "x2", "x3", "x4", "x5", "x2"],  # x2 again in the same job
             "a/a1.jsonl": ["x1", "x3", "y0", "y1", "x1"],  # earlier file's ids, x1 twice
             "b/b0.jsonl": ["x0", "x1", "z0", "z2", "z0", "z1", "z9"]}  # capped at 6: ranges [0,3) [3,6)
    for rel, keys in files.items():
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("".join(json.dumps({"id": k, "text": f"text of {k} in {rel}"}) + "\n"
                                            for k in keys))
    cfg = PipelineConfig(name="dup-ids", sources=[src("a", tmp_path / "a" / "*.jsonl", "jsonl"),
                                                  src("b", tmp_path / "b" / "*.jsonl", "jsonl", max_docs=6)],
                         ray=RayConfig(num_cpus=2), ingest=IngestConfig(shard_docs=2, id_partitions=3))
    import tasks.ingest.run as ingest_run

    merge, held = ingest_run._merge, []
    monkeypatch.setattr(ingest_run, "_merge", lambda plan, results, *a: held.append(results) or merge(plan, results, *a))
    _refuse_document_reads(monkeypatch)
    s = run_ingest(cfg, tmp_path / "out")
    monkeypatch.undo()
    # the driver kept per job only what the shards need, its counters were folded into its source's
    assert held and all(set(r) == {"docs_out", "consumed", "shards", "ids", "quarantine_file"} for r in held[0].values())
    want = [make_doc_id("a", k) for k in ("x0", "x1", "x2", "x3", "x4", "x5", "y0", "y1")] + \
        [make_doc_id("b", k) for k in ("x0", "x1", "z0", "z2", "z1")]
    assert [d["id"] for d in iter_docs(s["shards"])] == want
    assert s["sources"]["a"]["dropped"] == {"duplicate_id": 4} and s["sources"]["b"]["dropped"] == {"duplicate_id": 1}
    assert s["dropped"] == {"duplicate_id": 5} and s["docs_out"] == len(want)
    for st in (s, *s["sources"].values()):
        assert st["docs_in"] == st["docs_out"] + sum(st["dropped"].values()) + sum(st["quarantined"].values())
    # linked: a0's parts (x0 x1)(x2 x3)(x4 x5), a1's (y0 y1) (its (x1 x3) and (x1) are gone), b's
    # first range's (x0 x1); written: (z0) and (z2) (its part (z2 z0) without z0) packed; linked: (z1)
    assert [count_docs([p]) for p in s["shards"]] == [2, 2, 2, 2, 2, 2, 1] and s["shards_written"] == 1
    assert s["bytes_out"] == sum(len(d["text"].encode()) for d in iter_docs(s["shards"]))


def test_ids_spilled_in_chunks_resolve_across_chunks_and_jobs(tmp_path, monkeypatch):
    """A job spills its ids every SPILL_DOCS documents; the partition tasks order the chunks' rows
    as the job's, so the later occurrences are dropped across chunks and jobs, counted per part."""
    import pyarrow.parquet as pq

    from tasks.core.documents import make_doc_id
    from tasks.ingest import ids

    monkeypatch.setattr(ids, "SPILL_DOCS", 3)
    jobs = {"j1": ["a", "b", "a", "c", "d", "b", "e", "a"], "j2": ["c", "f"]}
    files = {}
    for name, keys in jobs.items():
        spill = ids.IdSpill(tmp_path / f"{name}-ids", 2)
        for k in keys:
            spill.add(make_doc_id("s", k), len(k) + 10)
        files[name] = spill.close()
    assert spill.chunks == 1 and len({p.name for p in files["j1"]}) == 3  # j1: chunks of 3, 3, 2
    got: dict[str, Counter] = {"j1": Counter(), "j2": Counter()}
    for k in range(2):
        per_job = [(name, [str(f) for f in fs if f.parent.name == f"p-{k:05d}"]) for name, fs in files.items()]
        for name, parts in ids.resolve_partition([j for j in per_job if j[1]], k, 4, str(tmp_path / "drops")).items():
            got[name].update({p: n for p, n, nbytes in parts})
    # j1 rows 2 (a), 5 (b), 7 (a): parts 0, 1, 1 of 4 rows; j2 row 0 (c, first in j1)
    assert got == {"j1": Counter({0: 1, 1: 2}), "j2": Counter({0: 1})}
    rows = sorted(r for f in (tmp_path / "drops" / "j1").iterdir() for r in pq.read_table(f).column("row").to_pylist())
    assert rows == [2, 5, 7]


def test_whole_parts_become_shards_by_a_hard_link_or_a_copy_where_links_fail(tmp_path, monkeypatch):
    """`tasks.core.fs.link_or_copy` (ingest's shards, training's verified checkpoint copies): the
    same file where hard links work, a copy with the same bytes where they fail (another device)."""
    from tasks.ingest.run import _link

    part = tmp_path / "part.parquet"
    part.write_bytes(b"rows")
    _link(part, tmp_path / "shard-00000.parquet")
    assert (tmp_path / "shard-00000.parquet").stat().st_ino == part.stat().st_ino

    def cross_device(src, dst):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    _link(part, tmp_path / "shard-00001.parquet")
    copy = tmp_path / "shard-00001.parquet"
    assert copy.read_bytes() == b"rows" and copy.stat().st_ino != part.stat().st_ino
    assert sorted(p.name for p in tmp_path.iterdir()) == ["part.parquet", "shard-00000.parquet", "shard-00001.parquet"]


def test_id_partitions_follow_the_source_bytes_so_a_task_stays_bounded(tmp_path):
    """`id_partitions: 0`: one id partition per `id_partition_bytes` of source files, so four times
    the corpus gives four times the partitions and the rows a duplicate-id task loads stay under
    id_partition_bytes / 200 (the assumed source bytes per document) whatever the corpus; an explicit
    count is kept, and more than a uint16 partition number is refused."""
    import pyarrow.parquet as pq
    from pydantic import ValidationError

    from tasks.ingest.run import MIN_DOC_SOURCE_BYTES, _Plan

    ingest = IngestConfig(id_partition_bytes=6000)
    rows_bound = ingest.id_partition_bytes // MIN_DOC_SOURCE_BYTES
    counts = []
    for n_files in (3, 12):
        folder = tmp_path / f"c{n_files}"
        folder.mkdir()
        for f in range(n_files):
            (folder / f"f{f:02d}.jsonl").write_text("".join(
                json.dumps({"id": f"{f}-{i}", "text": f"document {f}-{i} " + "word " * 120}) + "\n" for i in range(10)))
        cfg = PipelineConfig(name="parts", sources=[src("s", folder / "*.jsonl", "jsonl")], ingest=ingest)
        plan = _Plan.of(cfg)
        counts.append(plan.ingest.id_partitions)
        per_partition: Counter = Counter()
        for f, path in enumerate(plan.sources[0][1]):
            r = process_file_range(plan.sources[0][0], path, plan.ingest, part_dir=str(folder / "_parts"),
                                   part_name=f"j{f}")
            for ids_file in r["ids"]:
                per_partition[Path(ids_file).parent.name] += pq.read_metadata(ids_file).num_rows
        assert sum(per_partition.values()) == 10 * n_files
        assert max(per_partition.values()) <= rows_bound, (per_partition, rows_bound)
    source_bytes = [sum(p.stat().st_size for p in (tmp_path / f"c{n}").glob("*.jsonl")) for n in (3, 12)]
    assert counts == [-(-b // 6000) for b in source_bytes] and counts[1] >= 4 * counts[0] - 3 and counts[0] > 1
    cfg = PipelineConfig(name="parts", sources=[src("s", tmp_path / "c3" / "*.jsonl", "jsonl")],
                         ingest=IngestConfig(id_partitions=5, id_partition_bytes=6000))
    assert _Plan.of(cfg).ingest.id_partitions == 5
    capped = src("s", tmp_path / "c12" / "*.jsonl", "jsonl", max_docs=60)  # 60 x 200 B: 2 partitions, not one per 6000 B of its files
    cfg = PipelineConfig(name="parts", sources=[capped], ingest=IngestConfig(id_partition_bytes=6000))
    assert _Plan.of(cfg).ingest.id_partitions == 2
    with pytest.raises(ValidationError):
        IngestConfig(id_partitions=65536)


@needs_data
def test_run_ingest_real_sources_order_and_caps(ray_session, tmp_path):
    cfg = PipelineConfig(
        name="real",
        sources=[src("docs-crawl", "web/docs-crawl-0000[01].warc.gz", "warc", max_docs=30),
                 src("wget", "web/wget-sample-0001.warc.gz", "warc"),
                 src("cc-net", "web/cc-net-head-sample.jsonl.gz", "jsonl", max_docs=7)],
        data_root=str(DATA), ray=RayConfig(num_cpus=2), ingest=IngestConfig(shard_docs=20),
    )
    s = run_ingest(cfg, tmp_path / "out")
    json.dumps(s)  # JSON-serialisable
    assert s["docs_in"] == 30 + 15 + 7
    assert s["docs_in"] == s["docs_out"] + sum(s["dropped"].values()) + sum(s["quarantined"].values())
    assert s["sources"]["docs-crawl"]["docs_in"] == 30
    # cap reached in file 0 (paths are resolved, so a symlinked data root compares equal)
    assert s["sources"]["docs-crawl"]["files"] == [str((WEB / "docs-crawl-00000.warc.gz").resolve())]
    assert s["sources"]["wget"]["skipped_records"] == {"metadata": 1, "request": 15, "resource": 2, "warcinfo": 1}
    assert s["skipped_records"]["warcinfo"] == 2
    assert count_docs(s["shards"]) == s["docs_out"] and Path(s["shards"][0]).name == "shard-00000.parquet"
    assert not (tmp_path / "out" / "_parts").exists()
    docs = list(iter_docs(s["shards"]))
    # same documents, same order as a plain serial pass over the same records
    serial = []
    for source, n in ((cfg.sources[0], 30), (cfg.sources[1], None), (cfg.sources[2], 7)):
        path = str(WEB / "docs-crawl-00000.warc.gz") if source.name == "docs-crawl" else cfg.resolve_uri(source.uri)
        r = process_file_range(source, path, cfg.ingest, 0, n)
        serial += r["docs"]
    assert [d["id"] for d in docs] == [d["id"] for d in serial]
    assert len({d["id"] for d in docs}) == len(docs)
    assert [d["source"] for d in docs] == sorted((d["source"] for d in docs), key=["docs-crawl", "wget", "cc-net"].index)


# ------------------------------------------------------------------ sources by URI (fsspec)

@pytest.fixture(scope="module")
def web_server():
    """shared/data/web served over HTTP by Python's http.server on 127.0.0.1 (no Range support,
    so the reader must stream)."""
    import functools
    import http.server
    import threading

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(WEB)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _records(uri: str, fmt: str) -> list[tuple]:
    return [(type(r).__name__, r.offset, getattr(r, "key", None), getattr(r, "error", None),
             getattr(r, "payload", None), getattr(r, "text", None)) for r in iter_records(uri, fmt)]


@needs_data
def test_http_sources_stream_the_same_records(web_server):
    """WARC (gzip per record) and JSONL.gz over http:// give exactly the records of the local file,
    and whole documents come out the same (only source_file differs)."""
    for name, fmt in (("wget-sample-0001.warc.gz", "warc"), ("cc-net-head-sample.jsonl.gz", "jsonl"),
                      ("whirlwind.warc.wet.gz", "wet")):
        local = _records(str(WEB / name), fmt)
        assert local and _records(f"{web_server}/{name}", fmt) == local, name
    url = f"{web_server}/wget-sample-0001.warc.gz"
    remote = process_file_range(src("w", url, "warc"), url, IngestConfig())
    here = process_file_range(src("w", WEB / "wget-sample-0001.warc.gz", "warc"),
                              str(WEB / "wget-sample-0001.warc.gz"), IngestConfig())
    assert remote["docs_out"] == here["docs_out"] > 0 and remote["dropped"] == here["dropped"]
    strip = lambda docs: [{k: v for k, v in d.items() if k != "source_file"} for d in docs]  # noqa: E731
    assert strip(remote["docs"]) == strip(here["docs"])
    assert remote["docs"][0]["source_file"] == url


@needs_data
def test_http_truncated_warc_is_quarantined(web_server, tmp_path):
    """A WARC cut short, read over a non-seekable HTTP stream: the intact records come out, the
    cut is quarantined as truncated, nothing raises."""
    import functools
    import http.server
    import threading

    data = (WEB / "wget-sample-0001.warc.gz").read_bytes()
    (tmp_path / "cut.warc.gz").write_bytes(data[: len(data) * 2 // 3])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        recs, _ = split(list(iter_records(f"http://127.0.0.1:{server.server_address[1]}/cut.warc.gz", "warc")))
    finally:
        server.shutdown()
        server.server_close()
    local, _ = split(list(iter_records(str(tmp_path / "cut.warc.gz"), "warc")))
    good = [r for r in recs if not r.error]
    assert good and [r.key for r in good] == [r.key for r in local if not r.error]
    assert [r.error for r in recs if r.error] == ["truncated"]


@needs_data
def test_uri_expansion_globs_file_urls_and_http(web_server):
    from tasks.core.fs import expand_uri, file_identity
    from tasks.ingest.run import resolve_source_files

    expected = [(WEB / f"docs-crawl-0000{i}.warc.gz").resolve() for i in (0, 1, 2)]

    def resolved(paths: list[str]) -> list[Path]:  # the data dir may be reached through a symlink
        return [Path(p).resolve() for p in paths]

    assert resolved(expand_uri(str(WEB / "docs-crawl-0000[0-2].warc.gz"))) == expected
    assert resolved(expand_uri(f"file://{WEB}/docs-crawl-0000[0-2].warc.gz")) == expected
    assert expand_uri(f"{web_server}/whirlwind.warc.gz") == [f"{web_server}/whirlwind.warc.gz"]
    assert expand_uri(f"{web_server}/no-such-file.warc.gz") == []
    assert file_identity(f"{web_server}/whirlwind.warc.gz")[1] == (WEB / "whirlwind.warc.gz").stat().st_size
    cfg = PipelineConfig(name="t", data_root=str(DATA), sources=[src("a", "web/whirlwind.warc*.gz", "warc")])
    assert [Path(p).name for p in resolve_source_files(cfg, cfg.sources[0])] == [
        "whirlwind.warc.gz", "whirlwind.warc.wat.gz", "whirlwind.warc.wet.gz"]
    with pytest.raises(FileNotFoundError, match="no files match"):
        resolve_source_files(cfg, src("b", f"{web_server}/missing.jsonl.gz", "jsonl"))


# s3:// sources (and the error without the s3 extra): tests/test_ingest_s3.py, against a real S3 server


def test_console_progress_bar():
    from tasks.core.progress import ConsoleProgress, fan_out

    out, seen = io.StringIO(), []
    bar = fan_out(ConsoleProgress("ingest", stream=out, interval=0), lambda d, t, n: seen.append((d, t)))
    for i in range(1, 5):
        bar(i, 4, "ingest")
    lines = out.getvalue().splitlines()
    assert seen == [(1, 4), (2, 4), (3, 4), (4, 4)]
    assert lines[-1].startswith("ingest: [") and "4/4 (100%)" in lines[-1] and len(lines) == 4
