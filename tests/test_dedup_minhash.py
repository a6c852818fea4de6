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
from infra.cli.dedup import add_arguments, load_dedup_config, run
from tasks.dedup.minhash import MinHasher, UnionFind, fast_hash32, sha1_hash32_many, shingles

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
@pytest.mark.parametrize("shingle_hash", ["sha1", "fast"])
def test_signatures_equal_datasketch(real_docs, scheme, shingle_hash):
    # fast_hash32 runs per shingle in Python inside datasketch: fewer documents for that one
    texts = real_docs[: 60 if shingle_hash == "sha1" else 15]
    texts += ["", "!!!", "three words only", "naïve café " * 40, "w" * 80 + " long token doc here",
              "a b c d e", "a b c d", "x"]
    hasher = MinHasher(bands=14, rows=8, seed=3, ngram=5, scheme=scheme, hash=shingle_hash)
    # datasketch's own default hash for "sha1"; our fast_hash32 handed to datasketch for "fast"
    kw = {} if shingle_hash == "sha1" else {"hashfunc": fast_hash32}
    sigs = hasher.signatures(texts, max_shingles=2000)  # several vectorised batches
    for text, sig in zip(texts, sigs):
        sh = shingles(text, 5)
        if not sh:
            assert sig is None
            continue
        m = MinHash(num_perm=112, seed=3, scheme=scheme, **kw)
        m.update_batch(list(sh))
        assert np.array_equal(m.hashvalues, sig)
    # from the same shingle sets, as MinHash.bulk takes them
    sets = [list(shingles(t, 5)) for t in texts]
    bulk = MinHash.bulk([s for s in sets if s], num_perm=112, seed=3, scheme=scheme, **kw)
    ours = [s for s in hasher.signatures_from_shingles(sets) if s is not None]
    assert len(bulk) == len(ours) and all(np.array_equal(m.hashvalues, s) for m, s in zip(bulk, ours))


def test_fast_hash_is_deterministic_order_sensitive_and_differs_from_sha1():
    import subprocess
    import sys

    assert fast_hash32(b"the quick brown fox jumps") == fast_hash32(b"the quick brown fox jumps")
    assert fast_hash32(b"the quick brown fox jumps") != fast_hash32(b"quick the brown fox jumps")
    assert fast_hash32(b"the quick brown fox jumps") != sha1_hash32(b"the quick brown fox jumps")
    # another interpreter (another PYTHONHASHSEED) gives the same value: no Python hash()
    code = "from tasks.dedup.minhash import fast_hash32; print(fast_hash32(b'the quick brown fox jumps'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"})
    assert int(out.stdout) == fast_hash32(b"the quick brown fox jumps")
    # spread: distinct 5-grams of real words give distinct 32-bit values (birthday bound ≈ 1e-3)
    words = [f"w{i}" for i in range(3000)]
    grams = {" ".join(words[i:i + 5]).encode() for i in range(len(words) - 4)}
    assert len({fast_hash32(g) for g in grams}) == len(grams)


@pytest.mark.parametrize("shingle_hash", ["sha1", "fast"])
def test_signatures_load_as_lean_minhash_and_index_in_datasketch_lsh(real_docs, shingle_hash):
    hasher = MinHasher(seed=1, hash=shingle_hash)
    a, b = real_docs[0], real_docs[1]
    sa, sb = hasher.signatures([a, b])
    la, lb = hasher.lean(sa), LeanMinHash(seed=1, hashvalues=sb, scheme="affine32")
    m = MinHash(num_perm=112, seed=1, hashfunc=hasher.hashfunc)
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


def _run_cli(tmp_path: Path, docs: list[dict], config_yaml: str,
             config_name: str = "dedup.yaml") -> tuple[int, list[dict], Path]:
    """The dedup command (infra.cli.dedup) on `docs` written as JSONL, with `config_yaml` as its
    --config: its exit code, its output rows in order, and the config file."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    cfg = tmp_path / config_name
    cfg.write_text(config_yaml)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    out = tmp_path / "out.jsonl"
    rc = run(parser.parse_args([str(src), "--out", str(out), "--config", str(cfg)]))
    return rc, [json.loads(line) for line in out.read_text().splitlines()], cfg


def test_dedup_cli_writes_clusters(real_docs, tmp_path):
    base = [t for t in real_docs if len(t.split()) > 400][:6]
    docs = [{"id": f"d{i}", "text": t} for i, t in enumerate(base)]
    docs.append({"id": "exact", "text": base[1].upper()})  # exact copy (case/space only)
    docs.append({"id": "near", "text": _edit(base[2], 0.01, 1)})  # 5-gram Jaccard ~0.9
    docs.append({"id": "far", "text": _edit(base[3], 0.3, 2)})  # not a near duplicate
    rc, rows, cfg = _run_cli(tmp_path, docs, "minhash:\n  verify: true\n  verify_threshold: 0.8\n")
    assert rc == 0
    assert [r["id"] for r in rows] == [d["id"] for d in docs]
    by = {r["id"]: r for r in rows}
    assert by["exact"] == {"id": "exact", "cluster": "d1", "keep": False}
    assert by["near"] == {"id": "near", "cluster": "d2", "keep": False}
    assert by["far"]["keep"] and by["far"]["cluster"] == "far"
    assert sum(r["keep"] for r in rows) == 7
    assert load_dedup_config(cfg).minhash.verify is True
    # verification rejects a candidate pair below the threshold
    _, rows, _ = _run_cli(tmp_path, docs, "curate:\n  dedup:\n    minhash:\n      verify: true\n"
                          "      verify_threshold: 0.99\n", config_name="strict.yaml")
    by = {r["id"]: r for r in rows}
    assert by["near"]["keep"] and not by["exact"]["keep"]


def test_incremental_index_persists_and_flags_new_near_duplicates(real_docs, tmp_path):
    from tasks.dedup.index import MinHashIndex

    base = [t for t in real_docs if len(t.split()) > 400][:5]
    hasher = MinHasher(seed=1)
    idx = MinHashIndex(14, 8, seed=1)
    assert idx.add([f"a{i}" for i in range(5)], hasher.signatures(base)) == [None] * 5
    idx.save(tmp_path / "idx")
    loaded = MinHashIndex.load(tmp_path / "idx", bands=14, rows=8, seed=1, scheme="affine32")
    assert np.array_equal(loaded.key_array, idx.key_array) and loaded.ids == idx.ids and loaded.docs == 5
    assert len(loaded.key_array) == 5 * 14 and loaded.key_array.dtype == np.uint64  # 12 bytes a key
    # the same documents again (a re-run): not duplicates of themselves, nothing added
    assert loaded.add([f"a{i}" for i in range(5)], hasher.signatures(base)) == [None] * 5 and loaded.docs == 5
    new = [_edit(base[2], 0.01, 7), real_docs[-1], _edit(real_docs[-1], 0.01, 8)]
    assert loaded.add(["b0", "b1", "b2"], hasher.signatures(new)) == ["a2", None, "b1"]
    # a banding that differs names the setting to change: the index's own rows a band
    with pytest.raises(ValueError, match=r"rows=8, this run wants 4: .*set curate\.dedup\.minhash\.index_rows: 8"):
        MinHashIndex.load(tmp_path / "idx", rows=4)
    with pytest.raises(ValueError, match=r"set curate\.dedup\.minhash\.hash: 'fast'"):  # sha1 signatures differ
        MinHashIndex.load(tmp_path / "idx", hash="sha1")


def test_index_is_memory_mapped_and_saved_by_generation(real_docs, tmp_path):
    """Opened from disk the arrays are memory-mapped; a save merges this run's additions into a new
    generation and removes the old one; a crashed save (a half-written generation) changes nothing."""
    from tasks.dedup.index import MinHashIndex

    texts = [t for t in real_docs if len(t.split()) > 200][:9]
    sigs = MinHasher(seed=1).signatures(texts)
    d = tmp_path / "idx"
    idx = MinHashIndex.open(d, 14, 8, 1, "affine32", "fast")
    assert idx.add([f"a{i}" for i in range(3)], sigs[:3]) == [None] * 3
    idx.save(d)
    assert sorted(p.name for p in d.iterdir()) == ["gen-000001", "meta.json"]
    for step in (1, 2):  # two later runs, each adding three documents
        idx = MinHashIndex.open(d, 14, 8, 1, "affine32", "fast")
        assert idx.memory_mapped and idx.generation == step
        got = idx.add([f"b{step}{i}" for i in range(3)] + ["a0"], sigs[3 * step:3 * step + 3] + [sigs[0]])
        assert got == [None] * 4  # new documents, and a0 is not its own duplicate
        idx.save(d)
        assert sorted(p.name for p in d.iterdir()) == [f"gen-{step + 1:06d}", "meta.json"]
    idx = MinHashIndex.load(d)
    assert idx.docs == 9 and idx.keys == 9 * 14 and idx.ids == ["a0", "a1", "a2", "b10", "b11", "b12", "b20", "b21", "b22"]
    assert np.array_equal(np.asarray(idx._keys), np.sort(np.asarray(idx._keys)))
    assert idx.add(["c0"], [_near(sigs[7])]) == ["b21"]  # found across generations
    # a save that died after writing part of its generation: meta.json still names the old one
    (d / "gen-000004").mkdir()
    (d / "gen-000004" / "keys.npy").write_bytes(b"partial")
    again = MinHashIndex.load(d)
    assert again.generation == 3 and again.docs == 9
    again.save(d)  # the next save writes generation 4 afresh
    assert MinHashIndex.load(d).docs == 9 and sorted(p.name for p in d.iterdir()) == ["gen-000004", "meta.json"]
    # two writers: the second save of an index opened before the first one saved is refused
    first, second = MinHashIndex.load(d), MinHashIndex.load(d)
    first.add(["w1"], [sigs[8] ^ np.uint32(1)])
    first.save(d)
    second.add(["w2"], [sigs[8] ^ np.uint32(2)])
    with pytest.raises(RuntimeError, match="one writer at a time"):
        second.save(d)
    assert MinHashIndex.load(d).ids[-1] == "w1"
    # the same id twice in one batch is indexed once and is not its own duplicate
    idx = MinHashIndex.load(d)
    assert idx.add(["z", "z"], [sigs[8] ^ np.uint32(3), sigs[8] ^ np.uint32(3)]) == [None, None]
    assert idx.ids.count("z") == 1


def _near(sig: np.ndarray) -> np.ndarray:
    """The signature with all but its first band changed: shares exactly one band key."""
    out = sig.copy()
    out[8:] = out[8:] ^ np.uint32(0x5A5A5A5A)
    return out


def test_index_merge_keeps_order_and_earlier_entries_first(tmp_path):
    from tasks.dedup.index import merge_sorted_into

    rng = np.random.default_rng(3)
    base = np.sort(rng.integers(0, 50, size=1000).astype(np.uint64))
    new = np.sort(rng.integers(0, 60, size=300).astype(np.uint64))
    base_v, new_v = np.arange(1000, dtype=np.int32), np.arange(1000, 1300, dtype=np.int32)
    merge_sorted_into(base, base_v, new, new_v, tmp_path / "k.npy", tmp_path / "v.npy", chunk=64)
    k, v = np.load(tmp_path / "k.npy"), np.load(tmp_path / "v.npy")
    order = np.argsort(np.concatenate([base, new]), kind="stable")  # base entries before new on ties
    assert np.array_equal(k, np.concatenate([base, new])[order])
    assert np.array_equal(v, np.concatenate([base_v, new_v])[order])


def test_index_of_the_previous_format_is_read_and_rewritten(real_docs, tmp_path):
    """An index saved as format 2 (Parquet tables) loads, answers, and the next save converts it."""
    import json as _json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.dedup.index import MinHashIndex, index_keys

    texts = [t for t in real_docs if len(t.split()) > 200][:3]
    sigs = MinHasher(seed=1).signatures(texts)
    keys = index_keys(np.stack(sigs), 14, 8)
    flat, docs = keys.reshape(-1), np.repeat(np.arange(3, dtype=np.int32), 14)
    order = np.argsort(flat, kind="stable")
    d = tmp_path / "old"
    d.mkdir()
    pq.write_table(pa.table({"key": pa.array(flat[order], pa.uint64()), "doc": pa.array(docs[order], pa.int32())}),
                   d / "index.parquet")
    pq.write_table(pa.table({"id": ["x0", "x1", "x2"]}), d / "ids.parquet")
    (d / "meta.json").write_text(_json.dumps({"format": 2, "bands": 14, "rows": 8, "seed": 1, "scheme": "affine32",
                                              "hash": "fast", "docs": 3, "keys": 42}))
    idx = MinHashIndex.open(d, 14, 8, 1, "affine32", "fast")
    assert idx.add(["x1", "y0"], [sigs[1], _near(sigs[2])]) == [None, "x2"]
    idx.save(d)
    assert sorted(p.name for p in d.iterdir()) == ["gen-000001", "meta.json"]
    assert MinHashIndex.load(d).ids == ["x0", "x1", "x2"] and _json.loads((d / "meta.json").read_text())["format"] == 3


def test_dedup_cli_quality_survivor_and_report(real_docs, tmp_path, capsys):
    base = [t for t in real_docs if len(t.split()) > 400][:4]
    docs = [{"id": f"d{i}", "text": t, "source": "kernel", "quality_score": 0.5} for i, t in enumerate(base)]
    docs.append({"id": "better", "text": _edit(base[0], 0.01, 3), "source": "mirror", "quality_score": 0.9})
    docs.append({"id": "worse", "text": _edit(base[1], 0.01, 4), "source": "mirror", "quality_score": 0.1})
    docs.append({"id": "copy", "text": base[2] + "\n", "source": "mirror"})  # exact copy, no score
    rc, rows, _ = _run_cli(tmp_path, docs, "minhash:\n  survivor: quality\n")
    assert rc == 0
    by = {r["id"]: r for r in rows}
    assert by["better"]["keep"] and by["d0"] == {"id": "d0", "cluster": "better", "keep": False}
    assert by["d1"]["keep"] and by["worse"]["cluster"] == "d1"
    assert by["copy"]["cluster"] == "d2" and not by["copy"]["keep"]
    summary = json.loads(capsys.readouterr().out)
    rep = summary["report"]
    assert rep["duplicates"] == 3 and rep["by_source"]["mirror"]["duplicates"] == 2
    assert rep["by_source"]["mirror"]["exact_duplicates"] == 1 and rep["by_source"]["kernel"]["near_duplicates"] == 1
    assert rep["cluster_sizes"] == {"1": 1, "2": 3}
    assert all(0.8 < e["jaccard"] <= 1.0 for e in rep["examples"])
    assert summary["clustering"] == "local"


def test_verifier_jaccard_of_hashed_shingles_equals_the_string_sets(real_docs):
    """The verifier's Jaccard (sorted 64-bit shingle hashes, `verify.shingle_sets`) is the exact one
    of `shingles`' byte-string sets: real pages, edited copies, short and empty texts, Unicode."""
    from tasks.dedup.minhash import jaccard
    from tasks.dedup.verify import JaccardVerifier, ListTexts

    rng = random.Random(1)
    edited = []
    for t in real_docs[:20]:
        words = t.split()
        for i in rng.sample(range(len(words)), len(words) // 20):
            words[i] = "the"
        edited.append(" ".join(words))
    texts = real_docs[:20] + edited + ["", "  !! ", "one", "Two words", "a b c d", "a b c d e", "a b c d e f",
                                       "Héllo wörld ünïcode 1,000.5 ça", "ÉTÉ été ete"]
    pairs = np.array([(i, j) for i in range(len(texts)) for j in range(i, len(texts))])
    for ngram in (5, 3):
        got = JaccardVerifier(ListTexts(texts), 0.7, ngram=ngram).similarities(pairs)
        sets = [shingles(t, ngram) for t in texts]
        want = np.array([jaccard(sets[a], sets[b]) for a, b in pairs])
        assert np.array_equal(got, want)
        assert 0 < np.mean((want > 0) & (want < 1))  # partial overlaps were compared, not only 0 / 1


def test_verifier_reads_and_shingles_in_sub_batches_within_its_character_cap(real_docs, monkeypatch):
    """Shingling holds ~25x its texts in word lists, so `JaccardVerifier` reads and shingles the
    documents a call needs `batch_chars` characters of text at a time (one longer document alone):
    several reads and shingle batches, none over the cap, the same similarities as one batch; the
    in-process clustering calls it `VERIFY_CHUNK_PAIRS` pairs at a time."""
    from tasks.dedup import minhash, verify
    from tasks.dedup.verify import JaccardVerifier, ListTexts

    class Counting(ListTexts):
        def read(self, rows):
            reads.append(len(rows))
            return super().read(rows)

    def counted(texts, ngram):
        batches.append(sum(map(len, texts)) if len(texts) > 1 else 0)  # one text may exceed the cap
        return shingle_sets(texts, ngram)

    shingle_sets = verify.shingle_sets
    monkeypatch.setattr(verify, "shingle_sets", counted)
    texts = real_docs[:40] + [t[: len(t) // 2] for t in real_docs[:40]]  # pairs at Jaccard ~0.5
    pairs = np.array([(i, i + 40) for i in range(40)] + [(i, i + 1) for i in range(79)])
    reads, batches = [], []
    whole = JaccardVerifier(Counting(texts), 0.7).similarities(pairs)
    assert reads == [80] and len(batches) == 1  # the default cap holds these 80 pages at once
    cap = sum(map(len, texts)) // 10
    reads.clear(), batches.clear()
    capped = JaccardVerifier(Counting(texts), 0.7, batch_chars=cap).similarities(pairs)
    assert np.array_equal(capped, whole) and 0 < np.mean((whole > 0.3) & (whole < 1))
    assert len(reads) >= 3 and sum(reads) == 80  # each document read once, in several reads
    assert len(batches) >= 10 and max(batches) <= cap
    calls = []
    monkeypatch.setattr(minhash, "VERIFY_CHUNK_PAIRS", 50)
    monkeypatch.setattr(JaccardVerifier, "mask", lambda self, p: calls.append(len(p)) or self.similarities(p) >= 0.7)
    sigs = MinHasher(28, 4).signatures(texts + texts)  # 80 exact copies: 80+ candidate pairs
    roots = minhash.minhash_clusters(sigs, 28, 4, verify=JaccardVerifier(ListTexts(texts + texts), 0.7))
    assert len(calls) >= 2 and max(calls) <= 50 and roots[80:] == list(range(80))


def test_the_hasher_is_built_without_importing_datasketch():
    """The curate driver builds the hasher for its actors: its permutations are drawn as datasketch
    draws them (every signature equal: test_signatures_equal_datasketch) without importing datasketch,
    which pulls in scipy and redis."""
    import subprocess
    import sys

    code = ("import sys; from tasks.dedup.minhash import MinHasher; "
            "h = MinHasher(28, 4, seed=1, scheme='affine32'); MinHasher(14, 8, seed=2, scheme='legacy'); "
            "h.signatures(['one two three four five six seven']); "
            "print(sorted(m for m in ('datasketch', 'scipy', 'redis') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]"
