"""Tokenizer stage: byte-level BPE trained on a small real corpus."""
from __future__ import annotations

from pathlib import Path

import pytest

from lm_helpers import corpus_shards, tiny_cfg, tokenizer_artifact
from tasks.tokenizer import load_tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "lm"


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
    assert tok_result["roundtrip_docs"] == cfg.tokenizer.roundtrip_sample_docs
    # BPE with 512 entries must compress English below 1 byte/token by a wide margin
    assert 1.5 < tok_result["bytes_per_token"] < 6


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


def test_merges_learned_from_corpus(tok_result):
    tok = load_tokenizer(tok_result["path"])
    # frequent words of the corpus become few tokens; a random string does not
    assert len(tok.encode(" the", add_special_tokens=False).ids) == 1
    assert len(tok.encode("kernel", add_special_tokens=False).ids) <= 3
    assert len(tok.encode("qzxjv", add_special_tokens=False).ids) >= 3


def test_empty_shards_rejected(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "text": pa.array([], pa.string())}), path)
    with pytest.raises(ValueError, match="no documents"):
        train_tokenizer(tiny_cfg(), [path], tmp_path / "tok")
