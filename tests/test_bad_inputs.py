"""The committed bad-input corpus (tests/data/bad/, written by its make.py) through the pipeline's
readers and config loader: every damaged record is quarantined with its reason or the config is
refused with a clear error, the good records around the damage are all kept, and the counts add up."""
from __future__ import annotations

import gzip
import importlib.util
import json
from collections import Counter
from pathlib import Path

import pytest

from tasks.config import ConfigError, IngestConfig, PipelineConfig, RayConfig, load_config
from tasks.core.documents import iter_docs

BAD = Path(__file__).resolve().parent / "data" / "bad"
_spec = importlib.util.spec_from_file_location("bad_corpus_make", BAD / "make.py")
corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(corpus)  # the corpus's own writer: its good records and members

# per file, the quarantine reasons its records get, and the good documents that must survive it
EXPECTED = {
    "truncated.jsonl.gz": {"truncated": 1},
    "not-json.jsonl": {"bad_json": 2},
    "invalid-utf8.jsonl": {"invalid_utf8": 1},
    "oversized-record.jsonl": {"oversized_record": 1},
    "empty.jsonl": {"empty_file": 1},
    "bomb.jsonl.gz": {"decompression_bomb": 1},
    "wrong-schema.parquet": {"missing_text": 2},
    "wrong-content-length.warc.gz": {"truncated": 1},
    "big-first-line.jsonl.gz": {"oversized_record": 1},
    "big-first-line.jsonl.zst": {"oversized_record": 1},
    "corrupt-first-member.jsonl.gz": {"bad_gzip": 1},
}
GOOD = {"good.jsonl": 3, "not-json.jsonl": 2, "invalid-utf8.jsonl": 1, "oversized-record.jsonl": 1,
        "wrong-content-length.warc.gz": 2, "big-first-line.jsonl.gz": 1000, "big-first-line.jsonl.zst": 1000,
        "corrupt-first-member.jsonl.gz": 30}
BIG_LINE = len(json.dumps({"id": "big", "text": "x" * (2 << 20)}))  # make.py's oversized first line


def _source(name: str, glob: str, fmt: str) -> dict:
    return {"name": name, "uri": str(BAD / glob), "format": fmt, "licence": "test", "provenance": "tests/data/bad"}


@pytest.fixture(scope="module")
def ingested(ray_session, tmp_path_factory):
    from tasks.ingest import run_ingest

    cfg = PipelineConfig.model_validate({
        "name": "bad-inputs",
        "sources": [_source("bad-jsonl", "*.jsonl*", "jsonl"), _source("bad-parquet", "*.parquet", "parquet"),
                    _source("bad-warc", "*.warc.gz", "warc")],
        "ray": RayConfig(num_cpus=2).model_dump(), "ingest": IngestConfig(max_record_bytes=100_000).model_dump()})
    return run_ingest(cfg, tmp_path_factory.mktemp("bad") / "out")


def test_every_damaged_record_is_quarantined_with_its_reason(ingested):
    s = ingested
    q = [json.loads(line) for line in Path(s["quarantine_file"]).read_text().splitlines()]
    by_file: dict[str, Counter] = {}
    for e in q:
        by_file.setdefault(Path(e["file"]).name, Counter())[e["reason"]] += 1
    assert by_file == {name: Counter(reasons) for name, reasons in EXPECTED.items()}, by_file
    assert all(e["detail"] for e in q)  # each with what was wrong
    bomb = next(e for e in q if e["reason"] == "decompression_bomb")
    assert "max_compression_ratio" in bomb["detail"] and "not read" in bomb["detail"]
    # the counts add up: every record read is kept, dropped with a reason, or quarantined with one
    assert s["docs_in"] == s["docs_out"] + sum(s["dropped"].values()) + sum(s["quarantined"].values())


def test_the_good_records_around_the_damage_are_all_kept(ingested):
    docs = list(iter_docs(ingested["shards"]))
    kept = Counter(Path(d["source_file"]).name for d in docs)
    for name, n in GOOD.items():
        assert kept[name] == n, (name, kept)
    assert kept["truncated.jsonl.gz"] >= 1  # the complete lines before the cut
    assert {d["url"] for d in docs if d["source"] == "bad-warc"} == {"https://bad.test/0", "https://bad.test/2"}


def test_a_big_first_line_or_a_corrupt_member_hides_no_record(ingested):
    """An oversized, highly compressible first line is quarantined with its byte range and the 1,000
    records behind it are read; a corrupt first gzip member is quarantined with the file bytes it spans,
    reading resumes at the next member, and the summary says how many bytes of which file were not read."""
    s = ingested
    q = [json.loads(line) for line in Path(s["quarantine_file"]).read_text().splitlines()]
    kept = {d["id"] for d in iter_docs(s["shards"])}
    for name, prefix in (("big-first-line.jsonl.gz", "hidden"), ("big-first-line.jsonl.zst", "hidden-zst")):
        [big] = [e for e in q if Path(e["file"]).name == name]
        assert (big["reason"], big["line"], big["byte_range"], big["bytes"]) == \
               ("oversized_record", 1, [0, BIG_LINE], BIG_LINE), big
        assert big["offset"] == 0 and "max_record_bytes 100000" in big["detail"]
        docs = [d for d in iter_docs(s["shards"]) if Path(d["source_file"]).name == name]
        assert [d["text"] for d in docs] == [f"A good {prefix} document, number {i}, with a few words." for i in range(1000)]
    assert len(kept) == s["docs_out"]

    corrupt = BAD / "corrupt-first-member.jsonl.gz"
    first_member = len(corrupt.read_bytes()) - sum(len(gzip.compress(b"\n".join(corpus.good_lines(f"member{m}", 10)) + b"\n",
                                                                     mtime=0)) for m in range(3))
    [bad] = [e for e in q if Path(e["file"]) == corrupt]
    assert (bad["reason"], bad["unread_range"], bad["unread_bytes"]) == ("bad_gzip", [0, first_member], first_member)
    assert "invalid block type" in bad["detail"], bad
    assert {d["text"] for d in iter_docs(s["shards"]) if Path(d["source_file"]) == corrupt} == {
        f"A good member{m} document, number {i}, with a few words." for m in range(3) for i in range(10)}
    # the summary names every file with bytes that were not read, and how many
    bomb = BAD / "bomb.jsonl.gz"
    unread = s["sources"]["bad-jsonl"]["bytes_unread"]
    assert set(unread) == {str(corrupt), str(bomb)} and unread[str(corrupt)] == first_member
    assert 0 < unread[str(bomb)] < bomb.stat().st_size
    assert s["bytes_unread"] == sum(unread.values())


def test_a_config_with_unknown_keys_wrong_types_and_a_plain_credential_is_refused():
    with pytest.raises(ConfigError) as e:
        load_config(BAD / "bad-config.yaml")
    msg = str(e.value)
    for named in ("surprise", "vocab_size", "max_steps", "learning_rate", "storage_options"):
        assert named in msg, (named, msg)
    assert "plain-text-secret" not in msg and "AKIAEXAMPLEKEY" not in msg  # never echoes a secret
