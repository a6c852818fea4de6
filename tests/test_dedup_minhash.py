"""Vectorised MinHash: equal to datasketch, loadable as LeanMinHash; `crucible dedup` CLI."""
from __future__ import annotations

import argparse
import gzip
import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
from datasketch import LeanMinHash, MinHash, MinHashLSH
from datasketch.hashfunc import sha1_hash32

from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT
from tasks.dedup.cli import add_arguments, load_dedup_config, run
from tasks.dedup.minhash import MinHasher, UnionFind, sha1_hash32_many, shingles

DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
LINUX = DATA / "text" / "linux-doc-rst.jsonl.gz"


@pytest.fixture(scope="module")
def real_docs() -> list[str]:
    if not LINUX.exists():
        pytest.skip(f"no data under {DATA}")
    with gzip.open(LINUX, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for _, line in zip(range(60), f)]


def test_vectorised_sha1_hash32_matches_datasketch():
    rng = random.Random(0)
    items = [b"", b"a", "héllo wörld ünïcode".encode(), b"x" * 55, b"y" * 56, b"z" * 200]
    items += [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 90))) for _ in range(300)]
    assert sha1_hash32_many(items).tolist() == [sha1_hash32(x) for x in items]


@pytest.mark.parametrize("scheme", ["affine32", "legacy"])
def test_signatures_equal_datasketch(real_docs, scheme):
    texts = real_docs + ["", "!!!", "three words only", "naïve café " * 40, "w" * 80 + " long token doc here"]
    hasher = MinHasher(bands=14, rows=8, seed=3, ngram=5, scheme=scheme)
    sigs = hasher.signatures(texts, max_shingles=2000)  # several vectorised batches
    for text, sig in zip(texts, sigs):
        sh = shingles(text, 5)
        if not sh:
            assert sig is None
            continue
        m = MinHash(num_perm=112, seed=3, scheme=scheme)
        m.update_batch(list(sh))
        assert np.array_equal(m.hashvalues, sig)
    # from the same shingle sets, as MinHash.bulk takes them
    sets = [list(shingles(t, 5)) for t in texts]
    bulk = MinHash.bulk([s for s in sets if s], num_perm=112, seed=3, scheme=scheme)
    ours = [s for s in hasher.signatures_from_shingles(sets) if s is not None]
    assert all(np.array_equal(m.hashvalues, s) for m, s in zip(bulk, ours))


def test_signatures_load_as_lean_minhash_and_index_in_datasketch_lsh(real_docs):
    hasher = MinHasher(seed=1)
    a, b = real_docs[0], real_docs[1]
    sa, sb = hasher.signatures([a, b])
    la, lb = hasher.lean(sa), LeanMinHash(seed=1, hashvalues=sb, scheme="affine32")
    m = MinHash(num_perm=112, seed=1)
    m.update_batch(list(shingles(a)))
    assert la == LeanMinHash(m) and la.jaccard(LeanMinHash(m)) == 1.0
    assert la.jaccard(lb) == pytest.approx(float(np.mean(sa == sb)))
    lsh = MinHashLSH(num_perm=112, params=(14, 8))
    lsh.insert("a", la)
    assert lsh.query(LeanMinHash(m)) == ["a"]
    buf = bytearray(la.bytesize())
    la.serialize(buf)
    assert np.array_equal(LeanMinHash.deserialize(buf).hashvalues, sa)


def test_union_find_keeps_smallest_root():
    uf = UnionFind(5)
    uf.union(4, 3)
    uf.union(3, 1)
    uf.union(2, 0)
    assert uf.roots() == [0, 1, 0, 1, 1]


def _edit(text: str, fraction: float, seed: int) -> str:
    rng = random.Random(seed)
    toks = text.split()
    for i in rng.sample(range(len(toks)), int(len(toks) * fraction)):
        toks[i] = f"zz{rng.randrange(10**6)}"
    return " ".join(toks)


def test_dedup_cli_writes_clusters(real_docs, tmp_path):
    base = [t for t in real_docs if len(t.split()) > 400][:6]
    docs = [{"id": f"d{i}", "text": t} for i, t in enumerate(base)]
    docs.append({"id": "exact", "text": base[1].upper()})  # exact copy (case/space only)
    docs.append({"id": "near", "text": _edit(base[2], 0.01, 1)})  # 5-gram Jaccard ~0.9
    docs.append({"id": "far", "text": _edit(base[3], 0.3, 2)})  # not a near duplicate
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cfg = tmp_path / "dedup.yaml"
    cfg.write_text("minhash:\n  verify: true\n  verify_threshold: 0.8\n")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "out.jsonl"
    assert run(parser.parse_args([str(src), "--out", str(out), "--config", str(cfg)])) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [d["id"] for d in docs]
    by = {r["id"]: r for r in rows}
    assert by["exact"] == {"id": "exact", "cluster": "d1", "keep": False}
    assert by["near"] == {"id": "near", "cluster": "d2", "keep": False}
    assert by["far"]["keep"] and by["far"]["cluster"] == "far"
    assert sum(r["keep"] for r in rows) == 7
    assert load_dedup_config(cfg).minhash.verify is True
    # verification rejects a candidate pair below the threshold
    strict = tmp_path / "strict.yaml"
    strict.write_text("curate:\n  dedup:\n    minhash:\n      verify: true\n      verify_threshold: 0.99\n")
    run(parser.parse_args([str(src), "--out", str(out), "--config", str(strict)]))
    by = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert by["near"]["keep"] and not by["exact"]["keep"]


def test_incremental_index_persists_and_flags_new_near_duplicates(real_docs, tmp_path):
    from tasks.dedup.index import MinHashIndex

    base = [t for t in real_docs if len(t.split()) > 400][:5]
    hasher = MinHasher(seed=1)
    idx = MinHashIndex(14, 8, seed=1)
    assert idx.add([f"a{i}" for i in range(5)], hasher.signatures(base)) == [None] * 5
    idx.save(tmp_path / "idx")
    loaded = MinHashIndex.load(tmp_path / "idx", bands=14, rows=8, seed=1, scheme="affine32")
    assert loaded.keys == idx.keys and loaded.docs == 5
    new = [_edit(base[2], 0.01, 7), real_docs[-1], _edit(real_docs[-1], 0.01, 8)]
    assert loaded.add(["b0", "b1", "b2"], hasher.signatures(new)) == ["a2", None, "b1"]
    with pytest.raises(ValueError, match="rows"):
        MinHashIndex.load(tmp_path / "idx", rows=4)
