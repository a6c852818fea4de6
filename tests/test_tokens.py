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


# ------------------------------------------------------------------ mixture weights

def _weighted_cfg(gutenberg: float, linux: float, **tokens):
    """tiny_cfg() with the test corpus's two sources in the registry, at these mixture weights."""
    from tasks.config import PipelineConfig

    raw = tiny_cfg().model_dump(mode="json")
    raw["sources"] = [
        {"name": "gutenberg", "uri": "text/gutenberg/carroll-alice.txt", "format": "text",
         "licence": "public domain", "provenance": "Project Gutenberg", "mixture_weight": gutenberg},
        {"name": "linux-doc", "uri": "text/linux-doc-rst.jsonl.gz", "format": "jsonl",
         "licence": "GPL-2.0", "provenance": "Linux 6.1 docs", "mixture_weight": linux}]
    raw["tokens"].update(tokens)
    return PipelineConfig.model_validate(raw)


def _written_docs(index: dict, split: str) -> tuple[list[str], list[bytes]]:
    """Each written document's source and token bytes, read back from the files."""
    from tasks.tokens.binfile import doc_source_names, open_doc_starts

    tokens = np.asarray(open_split(index["index_path"], split))
    starts = np.append(open_doc_starts(index["index_path"], split), len(tokens))
    return doc_source_names(index["index_path"], split), [tokens[a:b].tobytes() for a, b in zip(starts, starts[1:])]


def _shares(names: list[str], docs: list[bytes]) -> dict[str, float]:
    total = sum(len(d) for d in docs)
    return {s: sum(len(d) for n, d in zip(names, docs) if n == s) / total for s in sorted(set(names))}


def test_mixture_weights_give_the_target_token_shares(index, base, tmp_path):
    """gutenberg 2.0, linux-doc 0.5: read back from the written train split, each source's token
    share is w*T / sum(w*T) of the natural train tokens within 2 points (and far from the natural
    share); whole documents only (gutenberg's each twice, linux-doc's once or dropped, counts adding
    up); the val split is not weighted; same seed, same bytes; another seed, another draw."""
    from collections import Counter

    tok = Path(tokenizer_artifact(base)["path"])
    weights = {"gutenberg": 2.0, "linux-doc": 0.5}
    res = prepare_tokens(_weighted_cfg(*weights.values()), tok, corpus_shards(base), tmp_path / "w")
    natural_names, natural_docs = _written_docs(index, "train")
    names, docs = _written_docs(res, "train")
    natural, effective = _shares(natural_names, natural_docs), _shares(names, docs)
    weighted_total = sum(weights[s] * natural[s] for s in natural)
    mixture = res["mixture"]
    assert mixture["applied"] and set(mixture["by_source"]) == set(weights)
    for s, w in weights.items():
        target = w * natural[s] / weighted_total
        assert abs(effective[s] - target) <= 0.02, (s, effective[s], target)
        assert abs(natural[s] - target) > 0.05  # so natural shares would fail the check above
        v = mixture["by_source"][s]
        assert v["target_share"] == pytest.approx(target) and v["share"] == pytest.approx(effective[s])
        assert v["natural_docs"] == v["kept_docs"] + v["dropped_docs"] and v["docs"] == v["kept_docs"] + v["repeats"]
        assert res["by_source"][s]["train"] == {"tokens": v["tokens"], "docs": v["docs"]}
    # whole documents: every gutenberg document exactly twice, each linux-doc document at most once
    written, before = Counter(docs), Counter(natural_docs)
    gutenberg, linux = ({x for x, name in zip(natural_docs, natural_names) if name == s} for s in weights)
    assert all(written[d] == 2 * before[d] for d in gutenberg)
    assert all(written[d] <= before[d] for d in linux) and set(written) <= set(before)
    assert mixture["dropped"]["mixture_weight"] == mixture["by_source"]["linux-doc"]["dropped_docs"] > 0
    assert res["splits"]["train"]["docs"] == len(docs) == sum(v["docs"] for v in mixture["by_source"].values())
    assert Path(res["splits"]["val"]["path"]).read_bytes() == Path(index["splits"]["val"]["path"]).read_bytes()
    again = prepare_tokens(_weighted_cfg(*weights.values()), tok, corpus_shards(base), tmp_path / "again")
    other = prepare_tokens(_weighted_cfg(*weights.values(), mixture_seed=99), tok, corpus_shards(base), tmp_path / "o")
    for key in ("sha256", "doc_starts_sha256", "doc_sources_sha256"):
        assert again["splits"]["train"][key] == res["splits"]["train"][key]
    assert other["splits"]["train"]["sha256"] != res["splits"]["train"]["sha256"]
    assert other["splits"]["val"]["sha256"] == res["splits"]["val"]["sha256"]


def test_mixture_weights_of_one_write_the_unweighted_files(index, base, tmp_path):
    """Every weight exactly 1: nothing is resampled, the files are those of a build without weights
    byte for byte, and the effective shares are the natural ones; weight 0 drops a source."""
    tok = Path(tokenizer_artifact(base)["path"])
    res = prepare_tokens(_weighted_cfg(1.0, 1.0), tok, corpus_shards(base), tmp_path / "ones")
    assert not res["mixture"]["applied"] and res["mixture"]["dropped"] == {}
    for split in ("train", "val"):
        for key in ("sha256", "doc_starts_sha256", "doc_sources_sha256"):
            assert res["splits"][split][key] == index["splits"][split][key]
    for v in res["mixture"]["by_source"].values():
        assert v["share"] == pytest.approx(v["target_share"]) and v["repeats"] == v["dropped_docs"] == 0
    dropped = prepare_tokens(_weighted_cfg(0.0, 1.0), tok, corpus_shards(base), tmp_path / "zero")
    assert set(_written_docs(dropped, "train")[0]) == {"linux-doc"}
    assert dropped["mixture"]["dropped"] == {"mixture_weight": index["by_source"]["gutenberg"]["train"]["docs"]}
    g = dropped["mixture"]["by_source"]["gutenberg"]
    assert g["docs"] == g["tokens"] == g["share"] == 0 and g["dropped_docs"] == g["natural_docs"] > 0
    assert dropped["by_source"]["gutenberg"]["val"] == index["by_source"]["gutenberg"]["val"]  # val not weighted


def test_tokens_stage_records_the_mixture(base, tmp_path, monkeypatch):
    """The stage run as plain Python: effective and target shares as top-level numbers (its MLflow
    metrics), the weights as MLflow params, the token card's effective share column, and the
    crucible_mixture facet on the index and train split, valid against its schema."""
    import uuid

    from mlflow import MlflowClient
    from openlineage.client.event_v2 import RunState

    from tasks.core.layout import RunLayout
    from tasks.core.sections import stage_config
    from tasks.core.stage import StageContext, StageInputs
    from tasks.lineage import JobRef, LineageEmitter
    from tasks.lineage.validate import event_errors, read_events
    from tasks.registry import STAGES
    from tasks.tracking import Tracker

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").resolve().as_uri()
    tracker = Tracker(uri, "mix")
    run_id = tracker.start_run("tokens")
    ctx = StageContext(layout=RunLayout.for_run(tmp_path / "runs", "r"), run_name="r", tracking_uri=uri,
                       experiment="mix", mlflow_run_id=run_id)
    inputs = StageInputs(tokenizer=tokenizer_artifact(base)["path"], shards=[str(p) for p in corpus_shards(base)])
    result = STAGES["tokens"].run(stage_config(STAGES["tokens"], _weighted_cfg(2.0, 0.5)), inputs, ctx)
    data, mixture = result.data, result.data["mixture"]
    assert data["docs_in"] == data["docs_out"] + data["dropped"]["mixture_weight"]
    for s, v in mixture["by_source"].items():
        assert data[f"mixture.share.{s}"] == v["share"] and data[f"mixture.target_share.{s}"] == v["target_share"]
    params = MlflowClient(uri).get_run(run_id).data.params
    assert params["mixture.weight.gutenberg"] == "2.0" and params["mixture.weight.linux-doc"] == "0.5"
    card = Path(data["dataset_card"]).read_text()
    g = mixture["by_source"]["gutenberg"]
    assert "| target share | effective share |" in card
    assert f"| gutenberg | public domain | 2 | {g['natural_tokens']:,} | {100 * g['target_share']:.1f}% | " \
           f"{100 * g['share']:.1f}% |" in card
    log = tmp_path / "lineage.jsonl"
    LineageEmitter(log, "crucible", "https://github.com/crucible-ml/crucible").emit(
        RunState.COMPLETE, JobRef("prepare_tokens.encode_and_pack", str(uuid.uuid4())),
        outputs=result.outputs)
    event = read_events(log)[0]
    assert event_errors(event) == []
    with_facet = [o for o in event["outputs"] if "crucible_mixture" in o["facets"]]
    assert [Path(o["name"]).name for o in with_facet] == ["index.json", "train.bin"]
    assert with_facet[0]["facets"]["crucible_mixture"]["by_source"]["linux-doc"]["weight"] == 0.5
    bad = json.loads(json.dumps(event))
    del bad["outputs"][0]["facets"]["crucible_mixture"]["by_source"]["gutenberg"]["share"]
    assert any("crucible_mixture" in e for e in event_errors(bad))


def test_a_cycle_encodes_only_with_the_champions_tokenizer(base, tmp_path):
    """Attack: the champion's tokenizer file is swapped (a writer of its run folder or the store) for
    another one whose ids mean other text: a continued cycle's tokens stage gets the champion's signed
    tokenizer_sha256 and refuses bytes that do not have it, on the read it encodes with."""
    from lm_helpers import sample_tokenizer
    from tasks.core.hashing import sha256_file
    from tasks.core.layout import RunLayout
    from tasks.core.sections import stage_config
    from tasks.core.stage import StageContext, StageInputs
    from tasks.registry import STAGES

    genuine = tokenizer_artifact(base)["path"]
    signed = sha256_file(genuine)
    swapped = sample_tokenizer(tmp_path / "swapped-tokenizer.json")
    assert sha256_file(swapped) != signed
    shard = tmp_path / "docs.parquet"
    texts = [f"document {i} of the cycle" for i in range(20)]
    pq.write_table(pa.table({"id": [str(i) for i in range(20)], "text": texts}), shard)
    stage = STAGES["tokens"]
    cfg = stage_config(stage, tiny_cfg(tokens={"ray": False}))
    ctx = StageContext(layout=RunLayout.for_run(tmp_path / "runs", "r"), run_name="r", tracking_uri="", experiment="x")
    with pytest.raises(ValueError, match="not the champion's"):
        stage.run(cfg, StageInputs(tokenizer=str(swapped), shards=[str(shard)], tokenizer_sha256=signed), ctx)
    done = stage.run(cfg, StageInputs(tokenizer=str(genuine), shards=[str(shard)], tokenizer_sha256=signed), ctx)
    assert done.data["tokenizer_sha256"] == signed


def test_every_encoding_job_holds_its_tokenizer_to_the_bytes_the_driver_read(base, tmp_path, monkeypatch):
    """Attack: parts/tokenizer.json (the store's object that jobs on other nodes download) is swapped
    after the driver read and hashed it: each job loads it held to that hash, so nothing is encoded
    with ids the index's tokenizer_sha256 does not mean."""
    from lm_helpers import sample_tokenizer
    from tasks.tokens import prepare

    genuine = tokenizer_artifact(base)["path"]
    other = sample_tokenizer(tmp_path / "other-tokenizer.json")
    shard = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"id": [str(i) for i in range(20)], "text": [f"document {i}" for i in range(20)]}), shard)
    real_read = prepare.read_tokenizer

    def read_then_swapped(path, *a, **kw):  # the driver's read, then the job's copy replaced
        got = real_read(path, *a, **kw)
        Path(path).write_bytes(Path(other).read_bytes())
        return got

    monkeypatch.setattr(prepare, "read_tokenizer", read_then_swapped)
    with pytest.raises(ValueError, match="sha256"):
        prepare.prepare_tokens(tiny_cfg(tokens={"ray": False}), genuine, [shard], tmp_path / "tokens")
