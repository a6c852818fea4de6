"""Tokens stage: flat token files split by document."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lm_helpers import corpus_shards, tiny_cfg, tokenizer_artifact, tokens_artifact
from tasks.tokenizer import load_tokenizer
from tasks.tokens import dtype_for_vocab, is_val_doc, load_index, open_split, prepare_tokens


@pytest.fixture(scope="module")
def index(base) -> dict:
    return tokens_artifact(base)


def _docs(base) -> list[dict]:
    return [r for s in corpus_shards(base) for r in pq.read_table(s).to_pylist()]


def test_index_file_and_dtype(index):
    path = Path(index["index_path"])
    on_disk = json.loads(path.read_text())
    assert on_disk["dtype"] == "uint16" and index["dtype"] == "uint16"
    assert on_disk["vocab_size"] == 512
    assert on_disk["splits"]["train"]["path"] == "train.bin"  # relative: the run dir can move
    for split in ("train", "val"):
        info = index["splits"][split]
        assert Path(info["path"]).is_file()
        assert Path(info["path"]).stat().st_size == 2 * info["tokens"]  # 2 bytes per uint16 token
        assert info["docs"] > 0
    assert load_index(path)["splits"]["val"]["path"] == index["splits"]["val"]["path"]


def test_eos_count_equals_docs_and_memmap_readable(index, base):
    eos = index["eos_id"]
    total_docs = 0
    for split in ("train", "val"):
        arr = open_split(index["index_path"], split)
        assert isinstance(arr, np.memmap) and arr.dtype == np.dtype("<u2")
        assert len(arr) == index["splits"][split]["tokens"]
        assert int((arr == eos).sum()) == index["splits"][split]["docs"]
        assert arr[-1] == eos  # every document, the last included, ends with EOS
        assert int(arr.max()) < index["vocab_size"]
        # the plain nanoGPT reader sees the same thing
        raw = np.memmap(index["splits"][split]["path"], dtype=np.uint16, mode="r")
        assert np.array_equal(raw, arr)
        total_docs += index["splits"][split]["docs"]
    assert total_docs == len(_docs(base))


def test_split_by_document(index, base):
    """Decode each split back into documents: every corpus doc is in exactly one split, whole."""
    cfg = tiny_cfg()
    tok = load_tokenizer(tokenizer_artifact(base)["path"])
    docs = _docs(base)
    by_split = {}
    for split in ("train", "val"):
        arr = np.asarray(open_split(index["index_path"], split), dtype=np.int64)
        cuts = np.flatnonzero(arr == index["eos_id"])
        pieces = np.split(arr, cuts + 1)[:-1]
        by_split[split] = [tok.decode(p[:-1].tolist(), skip_special_tokens=False) for p in pieces]
    expected = {"train": [], "val": []}
    for d in docs:
        expected["val" if is_val_doc(d["id"], cfg.tokens.val_fraction, cfg.tokens.seed) else "train"].append(d["text"])
    assert by_split == expected  # same docs, same order, exact text
    assert not set(by_split["train"]) & set(by_split["val"])
    assert 0.02 < len(expected["val"]) / len(docs) < 0.25  # val_fraction 0.1


def test_split_is_stable_per_document(base, tmp_path):
    """A document's split depends only on (seed, id), not on shard order or neighbours."""
    cfg = tiny_cfg()
    docs = _docs(base)
    shards = corpus_shards(base)
    a = prepare_tokens(cfg, Path(tokenizer_artifact(base)["path"]), list(reversed(shards)), tmp_path / "a")
    assert a["splits"]["val"]["docs"] == tokens_artifact(base)["splits"]["val"]["docs"]
    assert a["splits"]["val"]["tokens"] == tokens_artifact(base)["splits"]["val"]["tokens"]
    n_val = sum(is_val_doc(d["id"], cfg.tokens.val_fraction, cfg.tokens.seed) for d in docs)
    assert a["splits"]["val"]["docs"] == n_val
    # another seed moves documents
    other = [is_val_doc(d["id"], cfg.tokens.val_fraction, 99) for d in docs]
    assert other != [is_val_doc(d["id"], cfg.tokens.val_fraction, cfg.tokens.seed) for d in docs]


def test_deterministic_files(base, tmp_path):
    again = prepare_tokens(tiny_cfg(), Path(tokenizer_artifact(base)["path"]), corpus_shards(base), tmp_path / "b")
    first = tokens_artifact(base)
    for split in ("train", "val"):
        assert again["splits"][split]["sha256"] == first["splits"][split]["sha256"]


def test_docs_without_id_and_literal_eos_text(base, tmp_path):
    """No `id` column: docs are keyed by text hash; a literal "<|endoftext|>" is not an EOS id."""
    texts = [f"document number {i} says <|endoftext|> in the middle" for i in range(40)]
    shard = tmp_path / "noid.parquet"
    pq.write_table(pa.table({"text": texts}), shard)
    res = prepare_tokens(tiny_cfg(), Path(tokenizer_artifact(base)["path"]), [shard], tmp_path / "t")
    n_eos = sum(int((open_split(res["index_path"], s) == res["eos_id"]).sum())
                for s in ("train", "val") if res["splits"][s]["tokens"])
    assert n_eos == 40


def test_dtype_for_vocab():
    assert dtype_for_vocab(4096) == np.dtype("<u2")
    assert dtype_for_vocab(65536) == np.dtype("<u2")  # ids 0..65535
    assert dtype_for_vocab(65537) == np.dtype("<u4")


def test_document_starts_beside_each_split(index):
    """<split>.doc_starts.npy: int64 offsets of every document, named in index.json, readable with
    plain numpy, and exactly the positions after each EOS (every document ends with one)."""
    from tasks.core.hashing import sha256_file
    from tasks.tokens import open_doc_starts

    on_disk = json.loads(Path(index["index_path"]).read_text())
    for split in ("train", "val"):
        info = index["splits"][split]
        assert on_disk["splits"][split]["doc_starts"] == f"{split}.doc_starts.npy"  # relative, like the .bin
        assert sha256_file(info["doc_starts"]) == info["doc_starts_sha256"]
        starts = np.load(info["doc_starts"])  # the plain reader
        assert starts.dtype == np.int64 and len(starts) == info["docs"]
        arr = np.asarray(open_split(index["index_path"], split))
        after_eos = np.flatnonzero(arr == index["eos_id"]) + 1
        assert starts[0] == 0 and np.array_equal(starts[1:], after_eos[:-1])
        assert np.all(np.diff(starts) > 1)  # a document holds at least one token and its EOS
        assert np.array_equal(open_doc_starts(index["index_path"], split), starts)


def test_document_sources_beside_each_split(index, base):
    """<split>.doc_sources.npy: each document's data source (the curated row's `source`) as an id
    into index["sources"]; by_source counts tokens and documents per source and split."""
    from collections import Counter

    from tasks.core.hashing import sha256_file
    from tasks.tokens.binfile import doc_source_names, open_doc_starts

    rows = _docs(base)
    assert index["sources"] == ["gutenberg", "linux-doc"]
    for split in ("train", "val"):
        info = index["splits"][split]
        assert sha256_file(info["doc_sources"]) == info["doc_sources_sha256"]
        names = doc_source_names(index["index_path"], split)
        starts = open_doc_starts(index["index_path"], split)
        lens = np.diff(np.append(starts, info["tokens"]))
        assert Counter(names) == {k: v[split]["docs"] for k, v in index["by_source"].items() if v[split]["docs"]}
        for source in index["sources"]:
            assert sum(int(n) for n, name in zip(lens, names) if name == source) == \
                index["by_source"][source][split]["tokens"]
        assert sum(v[split]["tokens"] for v in index["by_source"].values()) == info["tokens"]
    # every document's source is the one its row had
    for source in index["sources"]:
        assert sum(index["by_source"][source][s]["docs"] for s in ("train", "val")) == \
            sum(r["source"] == source for r in rows)


def test_document_starts_from_an_older_index(index, tmp_path):
    """An index written before doc_starts existed: the offsets are derived from the EOS ids."""
    import shutil

    from tasks.tokens import open_doc_starts

    old = json.loads(Path(index["index_path"]).read_text())
    for split in ("train", "val"):
        shutil.copy(index["splits"][split]["path"], tmp_path / f"{split}.bin")
        del old["splits"][split]["doc_starts"], old["splits"][split]["doc_starts_sha256"]
    (tmp_path / "index.json").write_text(json.dumps(old))
    for split in ("train", "val"):
        assert np.array_equal(open_doc_starts(tmp_path / "index.json", split),
                              np.load(index["splits"][split]["doc_starts"]))


def test_ray_parallel_encoding_writes_the_same_bytes(base, tmp_path):
    """Shards encoded as Ray tasks (one per shard) give the same files as encoding in-process."""
    import ray

    shards = corpus_shards(base)
    assert len(shards) > 1
    tok_path = Path(tokenizer_artifact(base)["path"])
    started = not ray.is_initialized()
    try:
        parallel = prepare_tokens(tiny_cfg(tokens={"val_fraction": 0.1, "seed": 7, "ray": True},
                                           ray={"num_cpus": 2}),
                                  tok_path, shards, tmp_path / "ray")
        assert ray.is_initialized()
        # the Ray path really ran: shards were encoded in Ray worker processes, not in this one
        assert parallel["shards_encoded_elsewhere"] == len(shards)
    finally:
        if started:
            ray.shutdown()
    serial = prepare_tokens(tiny_cfg(), tok_path, shards, tmp_path / "serial")
    assert serial["shards_encoded_elsewhere"] == 0
    for split in ("train", "val"):
        for key in ("path", "doc_starts"):
            assert Path(parallel["splits"][split][key]).read_bytes() == \
                Path(serial["splits"][split][key]).read_bytes()
        assert parallel["splits"][split]["docs"] == serial["splits"][split]["docs"]
    assert not (tmp_path / "ray" / "parts").exists()  # part files are cleaned up


def test_llmc_copy_reads_back_as_the_same_tokens(base, tmp_path):
    """tokens.llmc: each split also as llm.c's data file (magic 20240520, version 1 for uint16,
    token count, then the ids), equal to the flat file; a damaged header is refused."""
    from tasks.tokens.binfile import LLMC_MAGIC, read_llmc

    res = prepare_tokens(tiny_cfg(tokens={"llmc": True}), Path(tokenizer_artifact(base)["path"]),
                         [Path(p) for p in corpus_shards(base)], tmp_path / "t")
    for split in ("train", "val"):
        info = res["splits"][split]
        header = np.fromfile(info["llmc_path"], dtype="<i4", count=256)
        assert list(header[:3]) == [LLMC_MAGIC, 1, info["tokens"]] and not header[3:].any()
        assert np.array_equal(read_llmc(info["llmc_path"]), open_split(res["index_path"], split))
        assert load_index(res["index_path"])["splits"][split]["llmc_path"] == info["llmc_path"]
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\0" * 1024 + Path(res["splits"]["val"]["llmc_path"]).read_bytes()[1024:])
    with pytest.raises(ValueError, match="bad magic"):
        read_llmc(bad)


def test_vocabulary_over_65536_ids_is_written_as_uint32(tmp_path):
    """Ids above 65535 need uint32: the flat file holds 4 bytes per id, reads back exactly through
    the index and np.memmap, and the llm.c copy says version 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from tasks.tokens.binfile import read_llmc

    vocab = {"<|endoftext|>": 0, "[UNK]": 1, **{f"w{i}": i + 2 for i in range(70_000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok_path = tmp_path / "tokenizer.json"
    tok.save(str(tok_path))
    rng = np.random.default_rng(0)
    texts = [" ".join(f"w{i}" for i in rng.integers(60_000, 70_000, size=30)) for _ in range(50)]
    shard = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": [f"d{i}" for i in range(50)], "text": texts}), shard)
    res = prepare_tokens(tiny_cfg(tokens={"llmc": True}), tok_path, [shard], tmp_path / "t")
    assert res["dtype"] == "uint32" and res["vocab_size"] == 70_002
    expected = {t: [vocab[w] for w in t.split()] + [0] for t in texts}
    got = []
    for split in ("train", "val"):
        info = res["splits"][split]
        assert Path(info["path"]).stat().st_size == 4 * info["tokens"]
        arr = open_split(res["index_path"], split)
        assert arr.dtype == np.dtype("<u4") and int(arr.max()) > 65535
        assert np.array_equal(np.memmap(info["path"], dtype=np.uint32, mode="r"), arr)
        assert np.fromfile(info["llmc_path"], dtype="<i4", count=2)[1] == 2
        assert np.array_equal(read_llmc(info["llmc_path"]), arr)
        ids = arr.tolist()
        while ids:  # split the stream into documents at EOS
            end = ids.index(0) + 1
            got.append(ids[:end])
            ids = ids[end:]
    assert sorted(got) == sorted(expected.values())
