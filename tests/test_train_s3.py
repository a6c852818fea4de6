"""Training on an object store, against a real S3-compatible server (moto, IAM auth on; tests/s3_helpers.py).

Two torchrun "nodes" (threads, as test_resume_training.test_two_nodes_c10d_rendezvous) read their
token shards from s3:// (staged once per node into the node's cache, checked against the index's
sha256) and write their checkpoints to s3:// (DCP's HuggingFaceStorageWriter through fsspec: safetensors,
no pickle); one node then resumes the 2-node checkpoint from s3:// on one process. A tampered shard
object (a pickle that would run code) is refused, a manifest whose hash was rewritten to match it is
refused for its signature, and a checkpoint whose meta object is missing is absent.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
from pathlib import Path

import pytest
import torch

from lm_helpers import tiny_cfg, tokens_artifact, train_on_nodes
from s3_helpers import moto_s3
from tasks.core.net import free_port
from tasks.train import load_model_for_inference, run_training
from tasks.core.fs import tree_sha256
from tasks.train.checkpoint import (META_FILE, UnverifiedCheckpoint, checkpoint_problem,
                                    latest_checkpoint, list_checkpoints, read_manifest, verify_checkpoint,
                                    weights_sha256)
from tasks.train.data import GlobalWindows
from tasks.train.model import lm_loss
from tasks.train.remote import stage_tokens

BUCKET, PREFIX = "runs", "exp/run"
OUT = f"s3://{BUCKET}/{PREFIX}/train"
# 8 sequences of 64 tokens per step whatever the world size: 2 ranks x 4, or 1 x 4 x 2 micro-batches;
# the 2-node run stops after step 4 of a 6-step schedule, the 1-node run resumes it
TRAIN = {"max_steps": 6, "checkpoint_every": 2, "micro_batch_size": 4, "batch_tokens": 8 * 64,
         "warmup_steps": 2, "log_every": 2, "keep_last_checkpoints": None}


@pytest.fixture(scope="module")
def index(base) -> Path:
    return Path(tokens_artifact(base)["index_path"])


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with moto_s3(tmp_path_factory.mktemp("s3"), buckets=[BUCKET]) as server:
        yield server


def _upload_tokens(s3, index: Path, prefix: str) -> str:
    for p in sorted(index.parent.iterdir()):
        if p.is_file():
            s3.client.upload_file(str(p), BUCKET, f"{prefix}/{p.name}")
    return f"s3://{BUCKET}/{prefix}/index.json"


def _get(s3, key: str) -> bytes:
    return s3.client.get_object(Bucket=BUCKET, Key=key)["Body"].read()


def _cfg(s3, cache: Path, **train):
    return tiny_cfg(train={**TRAIN, **train}, storage={"options": s3.options, "cache_dir": str(cache)})


def _log(s3) -> list[dict]:
    return [json.loads(line) for line in _get(s3, f"{PREFIX}/train/train_log.jsonl").decode().splitlines()]


@pytest.fixture(scope="module")
def two_nodes(s3, index, tmp_path_factory) -> dict:
    tokens = _upload_tokens(s3, index, f"{PREFIX}/tokens")
    local = tmp_path_factory.mktemp("nodes")  # each node's cache_dir: local/node0, local/node1
    endpoint = f"127.0.0.1:{free_port()}"
    results = train_on_nodes(lambda rank: _cfg(s3, local / f"node{rank}", stop_at_step=4, nnodes=2, node_rank=rank,
                                               nproc_per_node=1, rdzv_endpoint=endpoint, rdzv_id="s3-test"),
                             tokens, OUT, "s3run")
    return {"tokens": tokens, "local": local, "results": results, "log": _log(s3)}


def test_two_nodes_train_on_s3_and_one_node_resumes(two_nodes, s3, index):
    results, local = two_nodes["results"], two_nodes["local"]
    ckpts = [f"{OUT}/checkpoints/step-{s:06d}" for s in (2, 4)]
    assert [results[r]["steps"] for r in (0, 1)] == [4, 4]
    assert results[0]["checkpoints"] == results[1]["checkpoints"] == ckpts
    keys = s3.keys(BUCKET, f"{PREFIX}/train/")
    for ckpt in ckpts:  # both ranks' safetensors shards and RNG states and the publishing meta object
        key = ckpt.split(f"{BUCKET}/", 1)[1]
        assert sorted(k[len(key) + 1:] for k in keys if k.startswith(key + "/")) == sorted(
            ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors",
             META_FILE, "rng/rank-00000.json", "rng/rank-00001.json"])
    assert not [k for k in keys if ".tmp" in k]
    assert {f"{PREFIX}/train/{n}" for n in ("train_log.jsonl", "torchrun-node0.log", "torchrun-node1.log",
                                             "train_config-node0.json", "checkpoints/checkpoints.json")} <= set(keys)
    manifest = read_manifest(OUT, s3.options)  # the manifest's sha256s are those of the objects in the bucket
    assert [e["step"] for e in manifest["checkpoints"]] == [2, 4]
    for e in manifest["checkpoints"]:
        assert all(hashlib.sha256(_get(s3, f"{PREFIX}/train/checkpoints/{e['path']}/{f}")).hexdigest() == h
                   for f, h in e["files"].items())
    # nothing of the run on local disk but each node's cache: its token files (one verified copy per
    # node, downloaded by the launcher before torchrun; the rank found it cached) and its working files
    sha = json.loads(index.read_text())["splits"]["train"]["sha256"]
    for r in (0, 1):
        assert sorted(p.name for p in (local / f"node{r}" / "node").iterdir()) == ["tokens", "train"]
        cached = list((local / f"node{r}" / "node" / "tokens").glob("*-train.bin"))
        assert [p.name for p in cached] == [f"{sha}-train.bin"]
        text = Path(results[r]["log"]).read_text()  # (c10d rendezvous: global rank 0 may be on either node)
        assert int(re.search(r"staged in \S+ \((\d+) file\(s\) downloaded\)", text).group(1)) >= 3
        assert re.search(r"\[tokens\] rank \d: s3://\S+ read from \S+ \(0 file\(s\) downloaded\)", text)
    assert not list(local.rglob("*.safetensors")) and not list(local.rglob("checkpoints*"))

    # resume on one node, one process, from the 2-node checkpoint on s3 (saving step 6 asynchronously)
    cached = local / "node0" / "node" / "tokens" / f"{sha}-train.bin"
    stamp = cached.stat().st_ino  # a download would rename a new file into place (a use only touches it)
    res = run_training(_cfg(s3, local / "node0", resume=True, nproc_per_node=1, async_checkpoint=True,
                            keep_last_checkpoints=2), two_nodes["tokens"], OUT, None, None, "s3run")
    text = Path(res["log"]).read_text()
    assert f"resumed from {ckpts[-1]} at step 4, data position 32" in text and "(async: blocked" in text
    assert res["steps"] == 6 and cached.stat().st_ino == stamp  # the node's token cache was reused
    log = _log(s3)
    assert [r["step"] for r in log] == list(range(1, 7)) and log[:4] == two_nodes["log"]
    assert [r["data_start"] for r in log] == [8 * i for i in range(6)]
    # step 5's loss is the step-4 checkpoint's loss on samples 32..39 (the weights came from s3), and
    # the evaluation path loads that checkpoint from s3 too
    model, meta = load_model_for_inference(ckpts[-1], storage_options=s3.options)
    assert meta["world_size"] == 2 and meta["trainer"]["consumed_samples"] == 32
    x, y = GlobalWindows(index, "train", model.cfg.seq_len, 8, seed=tiny_cfg().train.seed).micro_batch(32, 0, 0, 1)
    with torch.no_grad():
        ce = lm_loss(model(x)[0], y)[1].item()
    assert log[4]["loss"] == pytest.approx(ce, rel=1e-4)
    assert log[5]["loss"] < log[0]["loss"]
    # retention on the store: step 2 went, meta object and all
    assert list_checkpoints(OUT, s3.options) == res["checkpoints"] == [ckpts[-1], f"{OUT}/checkpoints/step-000006"]
    assert not s3.keys(BUCKET, f"{PREFIX}/train/checkpoints/step-000002/")
    assert [e["step"] for e in read_manifest(OUT, s3.options)["checkpoints"]] == [4, 6]
    assert verify_checkpoint(res["checkpoints"][-1], storage_options=s3.options)


def test_tampered_shard_on_s3_is_refused_and_never_unpickled(two_nodes, s3, tmp_path):
    """A copy of the run's checkpoints whose newest shard object is replaced by a pickle that creates a
    directory when unpickled: loading refuses it, resuming falls back to the checkpoint before; once
    the manifest's hash is rewritten to match (unsigned by the stack's key), every checkpoint of the
    run is refused; the pickle never runs."""
    src, dst = f"{PREFIX}/train/checkpoints/", "exp/tampered/train/checkpoints/"
    for key in s3.keys(BUCKET, src):
        s3.client.copy_object(Bucket=BUCKET, Key=dst + key[len(src):], CopySource={"Bucket": BUCKET, "Key": key})
    out = f"s3://{BUCKET}/exp/tampered/train"
    ckpts = list_checkpoints(out, s3.options)  # steps 2 and 4, or 4 and 6 once the resume test ran
    before, newest = ckpts[:2]
    assert latest_checkpoint(out, storage_options=s3.options) == ckpts[-1]

    class Payload:
        def __init__(self, path: Path):
            self.path = path

        def __reduce__(self):
            return os.mkdir, (str(self.path),)

    pickle.loads(pickle.dumps(Payload(tmp_path / "proof")))  # the payload is live: unpickling runs it
    assert (tmp_path / "proof").is_dir()
    sentinel = tmp_path / "unpickled"
    shard = "shard-00001-model-00001-of-00001.safetensors"
    for ckpt in ckpts[1:]:
        s3.client.put_object(Bucket=BUCKET, Key=f"{ckpt.split(BUCKET + '/', 1)[1]}/{shard}",
                             Body=pickle.dumps(Payload(sentinel)))
    with pytest.raises(UnverifiedCheckpoint, match=re.escape(f"{newest}/{shard} does not have the sha256")):
        load_model_for_inference(newest, storage_options=s3.options)
    assert not verify_checkpoint(newest, storage_options=s3.options)
    assert shard in checkpoint_problem(newest, storage_options=s3.options)
    assert latest_checkpoint(out, storage_options=s3.options) == before  # resume skips the tampered ones
    assert not sentinel.exists()
    # the hash rewritten in the manifest object: its signature no longer verifies
    manifest_key = "exp/tampered/train/checkpoints/checkpoints.json"
    genuine = _get(s3, manifest_key)
    forged = json.loads(genuine)
    for e in forged["checkpoints"]:
        if e["path"] == newest.rsplit("/", 1)[1]:
            e["files"][shard] = hashlib.sha256(pickle.dumps(Payload(sentinel))).hexdigest()
    s3.client.put_object(Bucket=BUCKET, Key=manifest_key, Body=json.dumps(forged).encode())
    with pytest.raises(UnverifiedCheckpoint, match="signature that does not verify"):
        load_model_for_inference(newest, storage_options=s3.options)
    with pytest.raises(UnverifiedCheckpoint, match="signature that does not verify"):
        latest_checkpoint(out, storage_options=s3.options)
    assert not sentinel.exists()
    s3.client.put_object(Bucket=BUCKET, Key=manifest_key, Body=genuine)
    # a checkpoint without its meta object (never published, or being deleted) does not exist
    s3.client.delete_object(Bucket=BUCKET, Key=f"{before.split(BUCKET + '/', 1)[1]}/{META_FILE}")
    assert before not in list_checkpoints(out, s3.options)
    assert latest_checkpoint(out, storage_options=s3.options) is None
    with pytest.raises(FileNotFoundError, match="not a complete checkpoint"):
        load_model_for_inference(before, storage_options=s3.options)


def test_a_continued_run_starts_from_a_checkpoint_on_the_store(two_nodes, s3, tmp_path):
    """train.init_from as an s3:// object (what the train stage passes for a champion in a store's
    working copy): downloaded, verified by its tree hash, and its weights are the run's step 0."""
    ckpt = f"{OUT}/checkpoints/step-000004"
    out = f"s3://{BUCKET}/exp/continued/train"
    res = run_training(_cfg(s3, tmp_path / "node", max_steps=1, checkpoint_every=1, init_from=ckpt,
                            init_sha256=tree_sha256(ckpt, s3.options)), two_nodes["tokens"], out, None, None, "cont")
    assert res["steps"] == 1 and res["checkpoints"] == [f"{out}/checkpoints/step-000001"]
    record = json.loads(_get(s3, "exp/continued/train/init.json"))
    model, _ = load_model_for_inference(ckpt, storage_options=s3.options)
    assert record["init_from"] == ckpt and record["from_step"] == 4
    assert record["weights_sha256"] == weights_sha256(model)


def test_a_token_object_that_is_not_the_indexed_one_is_refused(s3, index, tmp_path):
    tokens = _upload_tokens(s3, index, "exp/bad-tokens")
    data = bytearray((index.parent / "train.bin").read_bytes())
    data[0] ^= 1  # same size, one bit flipped
    s3.client.put_object(Bucket=BUCKET, Key="exp/bad-tokens/train.bin", Body=bytes(data))
    storage = _cfg(s3, tmp_path / "cache").storage
    with pytest.raises(ValueError, match=r"exp/bad-tokens/train\.bin does not have the sha256 its token index"):
        stage_tokens(tokens, storage)
    assert not list((tmp_path / "cache" / "node" / "tokens").glob("*train.bin*"))  # nothing kept, no temp file
