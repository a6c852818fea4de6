"""Tokenizer stage: byte-level BPE trained on a small real corpus, and its validation report
(held-out compression per source/language, round trip of every held-out document, code / maths /
non-Latin-script probes from shared data, side by side with HF's stock ByteLevelBPETokenizer)."""
from __future__ import annotations

import json
import unicodedata
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import normalizers, pre_tokenizers

from lm_helpers import corpus_rows, corpus_shards, tiny_cfg, tokenizer_artifact
from tasks.tokenizer import TokenizerValidationError, load_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def tok_result(base) -> dict:
    return tokenizer_artifact(base)


def test_result_fields(tok_result):
    cfg = tiny_cfg()
    assert Path(tok_result["path"]).is_file()
    assert Path(tok_result["path"]).name == "tokenizer.json"
    assert tok_result["vocab_size"] == cfg.tokenizer.vocab_size
    assert tok_result["docs"] > 200
    assert tok_result["bytes"] > 100_000
    assert tok_result["roundtrip_ok"] is True
    # every held-out document is checked, and held-out + trained documents are all of them
    assert tok_result["roundtrip_docs"] == tok_result["validation_docs"] > 0
    assert tok_result["docs"] + tok_result["validation_docs"] == tok_result["docs_total"]
    # BPE with 512 entries compresses held-out English well above 1 byte/token
    assert 1.5 < tok_result["bytes_per_token"] < 6
    assert Path(tok_result["report_path"]).is_file() and Path(tok_result["report_markdown_path"]).is_file()


def test_special_tokens_present(tok_result):
    cfg = tiny_cfg()
    tok = load_tokenizer(tok_result["path"])
    ids = {t: tok.token_to_id(t) for t in (cfg.tokenizer.bos_token, cfg.tokenizer.eos_token, cfg.tokenizer.pad_token)}
    assert None not in ids.values()
    assert len(set(ids.values())) == 3
    assert tok_result["eos_id"] == ids[cfg.tokenizer.eos_token]
    # a literal special-token string inside a document is ordinary text, never the EOS id
    enc = tok.encode("end <|endoftext|> here", add_special_tokens=False)
    assert tok_result["eos_id"] not in enc.ids
    assert tok.decode(enc.ids, skip_special_tokens=False) == "end <|endoftext|> here"


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "  leading spaces and trailing  \n\n\ttabs\t",
    "naïve café — “quoted” ½ ∑ x² ≤ 10",
    "日本語のテキストと中文文本",
    "emoji 🎉🚀 and combining é (e\u0301) and zero-width\u200bjoiner",
    "Привет, мир! Ελληνικά. עברית",
    "\x00\x01 control \x7f bytes",
    "",
    " ",
])
def test_exact_roundtrip(tok_result, text):
    tok = load_tokenizer(tok_result["path"])
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_roundtrip_on_corpus_docs(tok_result, base):
    import pyarrow.parquet as pq

    tok = load_tokenizer(tok_result["path"])
    texts = [t for s in corpus_shards(base) for t in pq.read_table(s, columns=["text"]).column("text").to_pylist()]
    assert any(any(ord(c) > 127 for c in t) for t in texts), "corpus should include non-ASCII docs"
    for text, enc in zip(texts, tok.encode_batch(texts, add_special_tokens=False)):
        assert tok.decode(enc.ids, skip_special_tokens=False) == text


def test_deterministic(tok_result, base, tmp_path):
    again = train_tokenizer(tiny_cfg(), corpus_shards(base), tmp_path / "again")
    assert Path(again["path"]).read_bytes() == Path(tok_result["path"]).read_bytes()
    assert again["sha256"] == tok_result["sha256"]
    # the reference tokenizer and the whole report are reproducible too (apart from where they live)
    assert Path(again["reference_path"]).read_bytes() == Path(tok_result["reference_path"]).read_bytes()

    def report(result):
        r = json.loads(Path(result["report_path"]).read_text())
        r["tokenizer"].pop("path"), r["reference"].pop("path")
        return r

    assert report(again) == report(tok_result)


def test_merges_learned_from_corpus(tok_result):
    tok = load_tokenizer(tok_result["path"])
    # frequent words of the corpus become few tokens; a random string does not
    assert len(tok.encode(" the", add_special_tokens=False).ids) == 1
    assert len(tok.encode("kernel", add_special_tokens=False).ids) <= 3
    assert len(tok.encode("qzxjv", add_special_tokens=False).ids) >= 3


def test_empty_shards_rejected(tmp_path):
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "text": pa.array([], pa.string())}), path)
    with pytest.raises(ValueError, match="no documents"):
        train_tokenizer(tiny_cfg(), [path], tmp_path / "tok")


# ------------------------------------------------------------------ validation report on real data

def _labelled_shards(out_dir: Path, transform=lambda t: t) -> list[Path]:
    """The test corpus (kernel docs + a Gutenberg book) with the `language` fastText lid.176 gives
    each document, as curation would, in 3 Parquet shards."""
    from tasks.curate.langid import predict_language

    rows = [{**r, "text": transform(r["text"]), "language": predict_language(r["text"])[0]} for r in corpus_rows()]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for k in range(3):
        paths.append(out_dir / f"shard-{k:05d}.parquet")
        pq.write_table(pa.Table.from_pylist(rows[k::3]), paths[-1])
    return paths


REPORT_TOKENIZER = {"vocab_size": 512, "validation_fraction": 0.2, "split_digits": True}


@pytest.fixture(scope="module")
def report_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tok_report")
    shards = _labelled_shards(out / "corpus")
    result = train_tokenizer(tiny_cfg(tokenizer=REPORT_TOKENIZER), shards, out / "tok")
    return {"result": result, "report": json.loads(Path(result["report_path"]).read_text()), "shards": shards}


def test_report_slices_add_up(report_run):
    from tasks.tokenizer.bpe import doc_key, split_of

    report, result = report_run["report"], report_run["result"]
    cfg = tiny_cfg(tokenizer=REPORT_TOKENIZER)
    docs = [r for s in report_run["shards"] for r in pq.read_table(s).to_pylist()]
    held_out = [d for d in docs if split_of(doc_key(d["id"], d["text"]), cfg.tokenizer) == "validation"]
    val = report["validation"]
    assert val["docs"] == len(held_out) == result["validation_docs"] > 30
    assert report["training"]["docs"] + val["docs"] == report["training"]["docs_total"] == len(docs)
    slices = val["slices"]
    assert slices["all"]["docs"] == len(held_out)
    assert slices["all"]["bytes"] == sum(len(d["text"].encode()) for d in held_out)
    for kind in ("source", "language"):
        parts = {k: v for k, v in slices.items() if k.startswith(kind + ":")}
        assert sum(v["docs"] for v in parts.values()) == len(held_out)
        assert sum(v["bytes"] for v in parts.values()) == slices["all"]["bytes"]
    assert {"source:linux-doc", "source:gutenberg", "language:en"} <= set(slices)
    for name in ("crucible", "reference"):
        assert sum(slices[k][name]["tokens"] for k in slices if k.startswith("source:")) == slices["all"][name]["tokens"]
        assert 1.5 < slices["all"][name]["bytes_per_token"] < 6
    assert val["roundtrip_ok"] and val["roundtrip_failures"] == [] and val["reference_roundtrip_failures"] == []


def test_report_probes_on_shared_data(report_run):
    probes = report_run["report"]["probes"]
    assert set(probes) == {"english_prose", "code", "math", "cyrillic", "greek", "arabic", "han", "japanese", "hangul"}
    assert all(p["available"] for p in probes.values()), {k: p.get("reason") for k, p in probes.items()}
    for name in ("crucible", "reference"):
        # ASCII text has no byte-fallback tokens; scripts a 512-token English vocabulary never merged do
        for cat in ("english_prose", "code", "math"):
            assert probes[cat][name]["byte_fallback_fraction"] == 0
        for cat in ("cyrillic", "greek", "arabic", "han", "japanese", "hangul"):
            assert probes[cat][name]["byte_fallback_fraction"] > 0.3
            assert probes[cat][name]["tokens_per_char"] > probes["english_prose"][name]["tokens_per_char"]
        # a CJK character is 3 UTF-8 bytes: with no merges covering it, more than 1 token per character
        assert probes["han"][name]["tokens_per_char"] > 1
    assert probes["english_prose"]["non_ascii_char_fraction"] == 0
    assert probes["han"]["non_ascii_char_fraction"] > 0.3
    # the probes come from files the training corpus does not hold (handbook shard, other book)
    assert probes["arabic"]["lines_seen_in_training"] == 0
    assert probes["english_prose"]["lines_seen_in_training"] == 0


def test_split_digits_against_reference(report_run):
    tok = load_tokenizer(report_run["result"]["path"])
    ref = load_tokenizer(report_run["result"]["reference_path"])
    assert len(tok.encode("2024", add_special_tokens=False).ids) == 4  # one digit per token
    # the stock reference has no digit split: its merges differ from ours
    assert report_run["report"]["tokenizer"]["sha256"] != report_run["report"]["reference"]["sha256"]
    multi_digit = {name: [t for t in t_.get_vocab() if sum(c in "0123456789" for c in t) >= 2]
                   for name, t_ in (("crucible", tok), ("reference", ref))}
    assert multi_digit["crucible"] == [] and multi_digit["reference"], multi_digit
    assert ref.decode(ref.encode("x = 2024;", add_special_tokens=False).ids) == "x = 2024;"


def test_report_markdown_and_metrics(report_run):
    from tasks.tokenizer.report import compression_rows, report_metrics

    md = Path(report_run["result"]["report_markdown_path"]).read_text()
    val = report_run["report"]["validation"]
    assert f"round trip on all {val['docs']:,} held-out documents: **exact on every one**" in md
    assert "| source:gutenberg |" in md and "| han |" in md and "reference bytes/token" in md
    metrics = report_metrics(report_run["report"])
    assert metrics["val.roundtrip_failures"] == 0
    assert metrics["val.all.crucible.bytes_per_token"] == val["slices"]["all"]["crucible"]["bytes_per_token"]
    assert 0 < metrics["probe.japanese.reference.byte_fallback_fraction"] <= 1
    rows = compression_rows(report_run["report"])
    assert rows[0]["slice"] == "all" and {"crucible_bytes_per_token", "reference_bytes_per_token"} <= set(rows[0])


def test_byte_fallback_definition(tok_result):
    from tasks.tokenizer.report import BYTE_OF_CHAR, Tally, fallback_table

    # the inverse map covers exactly the byte-level alphabet, one character per byte
    assert set(BYTE_OF_CHAR) == set(pre_tokenizers.ByteLevel.alphabet())
    assert sorted(BYTE_OF_CHAR.values()) == list(range(256))
    tok = load_tokenizer(tok_result["path"])
    table = fallback_table(tok)
    for text, expected in [("hello world", 0.0), ("देवनागरी", 1.0)]:  # Devanagari: absent from the corpus
        ids = tok.encode(text, add_special_tokens=False).ids
        tally = Tally()
        tally.add(text, ids, table)
        assert tally.summary()["byte_fallback_fraction"] == expected, (text, [tok.id_to_token(i) for i in ids])


def test_roundtrip_failure_lists_document_ids(tmp_path):
    """NFD text through an NFC-normalising tokenizer cannot round-trip: the stage fails and names
    exactly the held-out documents whose text NFC changes."""
    from tasks.tokenizer.bpe import doc_key, split_of

    cfg = tiny_cfg(tokenizer={"vocab_size": 400, "validation_fraction": 0.5, "normalizer": "nfc", "reference": False})
    shards = _labelled_shards(tmp_path / "corpus", transform=lambda t: unicodedata.normalize("NFD", t))
    docs = [r for s in shards for r in pq.read_table(s).to_pylist()]
    expected = sorted(d["id"] for d in docs if split_of(doc_key(d["id"], d["text"]), cfg.tokenizer) == "validation"
                      and unicodedata.normalize("NFC", d["text"]) != d["text"])
    assert expected, "the held-out half should hold a document with accents"
    with pytest.raises(TokenizerValidationError) as e:
        train_tokenizer(cfg, shards, tmp_path / "tok")
    for doc_id in expected[:50]:
        assert doc_id in str(e.value)
    report = json.loads((tmp_path / "tok" / "tokenizer_report.json").read_text())
    assert sorted(report["validation"]["roundtrip_failures"]) == expected
    assert "FAILED on" in (tmp_path / "tok" / "tokenizer_report.md").read_text()


def test_validate_held_out_catches_a_lossy_tokenizer(tok_result, base):
    """The check itself: a lowercasing tokenizer fails on every held-out document with a capital."""
    from tasks.tokenizer.bpe import doc_key, split_of, validate_held_out
    from tasks.tokenizer.report import Measured

    cfg = tiny_cfg()
    tok = load_tokenizer(tok_result["path"])
    tok.normalizer = normalizers.Lowercase()
    shards = corpus_shards(base)
    out = validate_held_out(shards, cfg.tokenizer, [Measured("lossy", tok)])
    docs = [r for s in shards for r in pq.read_table(s).to_pylist()]
    expected = sorted(d["id"] for d in docs if split_of(doc_key(d["id"], d["text"]), cfg.tokenizer) == "validation"
                      and d["text"] != d["text"].lower())
    assert expected and sorted(out["roundtrip_failures"]) == expected and out["roundtrip_ok"] is False


def test_sample_fraction_trains_on_fewer_documents(base, tmp_path):
    cfg = tiny_cfg(tokenizer={"vocab_size": 400, "sample_fraction": 0.5, "reference": False})
    result = train_tokenizer(cfg, corpus_shards(base), tmp_path / "tok")
    report = json.loads(Path(result["report_path"]).read_text())["training"]
    assert 0.35 * report["docs_total"] < result["docs"] < 0.65 * report["docs_total"]
    assert result["docs"] + result["validation_docs"] + report["docs_unused"] == report["docs_total"]


@pytest.mark.e2e
def test_report_published_to_prefect_and_mlflow(report_run, tmp_path, monkeypatch):
    """The tokenizer stage's reports, published by the flows' stage wrapper: Prefect markdown + table
    artifacts, MLflow metrics."""
    from types import SimpleNamespace

    import httpx

    from mlflow import MlflowClient
    from prefect import flow
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from flows.artifacts import publish_reports
    from tasks.tokenizer.stage import publish_report
    from tasks.tracking import Tracker

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    ctx = SimpleNamespace(tracking_uri=(tmp_path / "mlruns").resolve().as_uri(), experiment="tok-report")
    ctx.mlflow_run_id = run_id = Tracker(ctx.tracking_uri, ctx.experiment).start_run("tokenizer")
    out_dir = Path(report_run["result"]["report_path"]).parent

    @flow
    def publish():
        publish_reports(publish_report(ctx, out_dir))

    with prefect_test_harness(server_startup_timeout=180):  # a real temporary Prefect server
        publish()
        api = PREFECT_API_URL.value().rstrip("/")
        body = {"artifacts": {"key": {"any_": ["tokenizer-report", "tokenizer-compression"]}}, "limit": 10,
                "sort": "CREATED_DESC"}
        found = {a["key"]: a for a in httpx.post(f"{api}/artifacts/filter", json=body, timeout=60).json()}
    assert found["tokenizer-report"]["type"] == "markdown"
    assert "# Tokenizer validation report" in found["tokenizer-report"]["data"]
    assert found["tokenizer-compression"]["type"] == "table"
    metrics = MlflowClient(ctx.tracking_uri).get_run(run_id).data.metrics
    val = report_run["report"]["validation"]["slices"]["all"]
    assert metrics["val.all.crucible.bytes_per_token"] == val["crucible"]["bytes_per_token"]
    assert metrics["val.all.reference.bytes_per_token"] == val["reference"]["bytes_per_token"]
    assert "probe.han.crucible.byte_fallback_fraction" in metrics
