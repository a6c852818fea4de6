"""Exact resume, resharding, retention, self-healing, loss spikes and multi-node, with real torchrun runs.

One reference run (2 processes, 12 steps) is compared with: the same run stopped at step 6 and
resumed (bitwise equal), resumed on 1 process instead (same data, same global batches), and a
run whose rank 1 is SIGKILLed at step 8 and healed by torchrun's restart (bitwise equal).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from lm_helpers import tiny_cfg, tokens_artifact, train_on_nodes
from tasks.core.net import free_port
from tasks.train import list_checkpoints, load_model_for_inference, run_training
from tasks.core.hashing import sha256_file
from tasks.core.signing import dumps_signed
from tasks.train.checkpoint import (MANIFEST, META_FILE, META_PURPOSE, apply_retention, checkpoint_tensors,
                                    latest_checkpoint, read_manifest)
from tasks.train.metrics import SPIKE_LOG
from train_faults import FAULTS_ENV, WORKER_MODULE

# 8 sequences of 64 tokens per optimizer step whatever the world size: 2 ranks x 4, or 1 x 4 x 2 micro
TRAIN = {"max_steps": 12, "checkpoint_every": 3, "micro_batch_size": 4, "batch_tokens": 8 * 64,
         "warmup_steps": 3, "keep_last_checkpoints": 2, "peak_flops_per_s": 1e11, "log_every": 6}
MODEL = {"dropout": 0.1}  # dropout makes the per-rank torch RNG state matter


def cfg(**train):
    return tiny_cfg(train={**TRAIN, **train}, model=MODEL)


@pytest.fixture(scope="module")
def index(base) -> Path:
    return Path(tokens_artifact(base)["index_path"])


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("resume")


def _log(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def _params(ckpt) -> dict:
    model, _ = load_model_for_inference(ckpt)
    return model.state_dict()




@pytest.fixture(scope="module")
def reference(work, index) -> Path:
    out = work / "reference"
    run_training(cfg(), index, out, None, None, "ref")
    return out


@pytest.fixture(scope="module")
def stopped(work, index) -> Path:
    """The same run stopped after step 6 (its schedule still spans 12 steps)."""
    out = work / "stopped"
    res = run_training(cfg(stop_at_step=6), index, out, None, None, "ref")
    assert res["steps"] == 6 and Path(res["checkpoints"][-1]).name == "step-000006"
    return out


def test_resume_is_bitwise_identical(reference, stopped, work, index):
    out = work / "resumed"
    shutil.copytree(stopped, out)
    res = run_training(cfg(resume=True), index, out, None, None, "ref")
    assert "resumed from" in Path(res["log"]).read_text()
    ref_log, log = _log(reference), _log(out)
    assert [r["step"] for r in log] == list(range(1, 13))
    for key in ("loss", "grad_norm", "lr", "data_start"):
        assert [r[key] for r in log] == [r[key] for r in ref_log], key
    a, b = _params(list_checkpoints(reference)[-1]), _params(list_checkpoints(out)[-1])
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the trainer state carries the loader position in global samples
    meta = json.loads((list_checkpoints(out)[-1] / META_FILE).read_text())
    assert meta["trainer"]["consumed_samples"] == 12 * 8 and meta["global_batch_samples"] == 8
    assert sorted(p.name for p in (list_checkpoints(out)[-1] / "rng").iterdir()) == \
        ["rank-00000.json", "rank-00001.json"]


def test_resume_on_one_process_reshards_without_repeating_data(reference, stopped, work, index):
    out = work / "resharded"
    shutil.copytree(stopped, out)
    res = run_training(cfg(resume=True, nproc_per_node=1), index, out, None, None, "ref")
    assert res["steps"] == 12
    ref_log, log = _log(reference), _log(out)
    # the same global samples in the same steps: positions 0, 8, 16, ... whatever the world size
    assert [r["data_start"] for r in log] == [r["data_start"] for r in ref_log] == [8 * i for i in range(12)]
    det = ("step", "loss", "grad_norm", "lr", "data_start")
    assert [{k: r[k] for k in det} for r in log[:6]] == [{k: r[k] for k in det} for r in ref_log[:6]]
    for r, q in zip(log[6:], ref_log[6:]):  # other reduction order and dropout masks: close, not equal
        assert abs(r["loss"] - q["loss"]) < 0.1, (r, q)
    meta = json.loads((list_checkpoints(out)[-1] / META_FILE).read_text())
    assert meta["world_size"] == 1 and meta["trainer"]["consumed_samples"] == 96


def test_resharded_resume_without_dropout_follows_the_uninterrupted_run(work, index):
    """Without dropout nothing per-rank is random: a 2-process run stopped at step 4 and resumed on
    one process (2 micro-batches instead of 2 ranks) continues the 2-process run to float rounding,
    so the optimizer moments came through DCP's resharding too (with them lost, the first resumed
    Adam update alone moves the weights by about the learning rate)."""
    plain = dict(max_steps=8, checkpoint_every=4, keep_last_checkpoints=None)
    ref_dir, out = work / "plain-ref", work / "plain-resharded"
    run_training(tiny_cfg(train={**TRAIN, **plain}), index, ref_dir, None, None, "plain")
    run_training(tiny_cfg(train={**TRAIN, **plain, "stop_at_step": 4}), index, out, None, None, "plain")
    res = run_training(tiny_cfg(train={**TRAIN, **plain, "resume": True, "nproc_per_node": 1}), index, out,
                       None, None, "plain")
    assert res["steps"] == 8 and "resumed from" in Path(res["log"]).read_text()
    ref_log, log = _log(ref_dir), _log(out)
    assert [r["data_start"] for r in log] == [r["data_start"] for r in ref_log] == [8 * i for i in range(8)]
    for r, q in zip(log[4:], ref_log[4:]):
        assert r["loss"] == pytest.approx(q["loss"], rel=1e-5), (r, q)
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=1e-3), (r, q)
    a, b = _params(list_checkpoints(ref_dir)[-1]), _params(list_checkpoints(out)[-1])
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst < 1e-5, worst  # lr is 3e-3: a lost or mis-sharded moment would show by orders of magnitude


def test_retention_manifest_and_metrics(reference):
    ckpts = list_checkpoints(reference)
    assert [p.name for p in ckpts] == ["step-000009", "step-000012"]  # keep_last_checkpoints = 2
    manifest = read_manifest(reference)
    assert [e["step"] for e in manifest["checkpoints"]] == [9, 12]
    for entry, path in zip(manifest["checkpoints"], ckpts):
        assert META_FILE in entry["files"] and not any(f.endswith((".metadata", ".distcp")) for f in entry["files"])
        assert sum(f.endswith(".safetensors") for f in entry["files"]) == 2  # one per rank
        assert all(sha256_file(path / f) == h for f, h in entry["files"].items())
    log = _log(reference)
    # FLOPs per token counted here from the trained model itself: 6 N (the tied embedding counted
    # once, as the output matmul) + 12 L d T for attention; flops_per_s is per process
    model, meta = load_model_for_inference(ckpts[-1])
    n = sum(p.numel() for p in model.parameters())
    per_token = 6 * n + 12 * model.cfg.n_layer * model.cfg.d_model * model.cfg.seq_len
    for r in log:
        assert r["tokens_per_s"] > 0 and r["flops_per_s"] > 0
        assert r["flops_per_s"] * meta["world_size"] / r["tokens_per_s"] == pytest.approx(per_token, rel=1e-5)
        assert r["mfu"] == pytest.approx(r["flops_per_s"] / 1e11, rel=1e-4)
    # a corrupted shard of a real run's checkpoint fails verification: resume falls back to the previous one
    assert latest_checkpoint(reference) == ckpts[-1]
    copy = reference.parent / "reference-corrupted"
    shutil.copytree(reference, copy)
    shard = sorted((copy / "checkpoints" / ckpts[-1].name).glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # one bit flipped
    shard.write_bytes(bytes(data))
    assert latest_checkpoint(copy).name == ckpts[0].name


def test_keep_best_and_verification(tmp_path):
    root = tmp_path / "checkpoints"
    losses = {1: 5.0, 2: 3.0, 3: 4.0, 4: 4.5, 5: 4.2}
    for step, loss in losses.items():
        d = root / f"step-{step:06d}"
        d.mkdir(parents=True)
        (d / "data.safetensors").write_bytes(bytes([step]) * 10)
        (d / META_FILE).write_text(dumps_signed({"step": step, "train_loss": loss}, META_PURPOSE))
        manifest = apply_retention(tmp_path, d, keep_last=2, keep_best=1)
    assert [e["step"] for e in manifest["checkpoints"]] == [2, 4, 5]  # best (3.0) + last two
    assert [e["best"] for e in manifest["checkpoints"]] == [True, False, False]
    assert {k: v for k, v in json.loads((root / MANIFEST).read_text()).items() if k != "signature"} == manifest
    (root / "step-000005" / "data.safetensors").write_bytes(b"corrupt")
    assert latest_checkpoint(tmp_path).name == "step-000004"
    assert latest_checkpoint(tmp_path, before_step=4).name == "step-000002"


def test_sigkilled_worker_heals_and_matches(reference, work, index, monkeypatch):
    out = work / "healed"
    c = cfg(max_restarts=2)
    monkeypatch.setenv(FAULTS_ENV, "kill:8:1")  # rank 1 SIGKILLs itself at step 8, first attempt
    res = run_training(c, index, out, None, None, "ref", worker_module=WORKER_MODULE)
    text = Path(res["log"]).read_text()
    assert "SIGKILL at step 8" in text and "restart 1 (torchrun): resumed from" in text
    assert res["steps"] == 12
    log = _log(out)
    assert [r["step"] for r in log] == list(range(1, 13))
    assert [r["loss"] for r in log] == [r["loss"] for r in _log(reference)]
    a, b = _params(list_checkpoints(reference)[-1]), _params(list_checkpoints(out)[-1])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_async_checkpoints_equal_sync_ones_and_resume(reference, stopped, work, index, tmp_path):
    """train.async_checkpoint: the run trains on while each checkpoint is written; the checkpoints
    hold exactly what the synchronous run saves, and resuming from them is still bitwise exact."""
    out = work / "async"
    res = run_training(cfg(stop_at_step=6, async_checkpoint=True), index, out, None, None, "ref")
    assert "(async: blocked" in Path(res["log"]).read_text()
    assert [p.name for p in list_checkpoints(out)] == [p.name for p in list_checkpoints(stopped)] == \
        ["step-000003", "step-000006"]
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.endswith(".tmp")]
    assert [e["step"] for e in read_manifest(out)["checkpoints"]] == [3, 6]
    for a_dir, s_dir in zip(list_checkpoints(out), list_checkpoints(stopped)):
        a, s = checkpoint_tensors(a_dir), checkpoint_tensors(s_dir)  # model, optimizer moments, step, position
        assert a.keys() == s.keys() and any(k.startswith("optim.") for k in a)
        assert all(torch.equal(a[k], s[k]) for k in a), a_dir.name
        a_meta, s_meta = (json.loads((d / META_FILE).read_text()) for d in (a_dir, s_dir))
        assert a_meta["trainer"] == s_meta["trainer"]
    res = run_training(cfg(resume=True, async_checkpoint=True), index, out, None, None, "ref")
    assert "resumed from" in Path(res["log"]).read_text() and res["steps"] == 12
    ref_log, log = _log(reference), _log(out)
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in log] == [(r["step"], r["loss"], r["grad_norm"])
                                                                     for r in ref_log]
    a, b = _params(list_checkpoints(reference)[-1]), _params(list_checkpoints(out)[-1])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_loss_spike_skip_and_rollback(work, index, monkeypatch):
    out = work / "spike"
    # steps 9-10: a persistent spike -> roll back to step 8's checkpoint and skip their data;
    # the batch of step 13 (as counted without skips: samples 96-103) is a single spike -> skipped; after
    # the rollback skipped 16 samples, step 11 reads it
    monkeypatch.setenv(FAULTS_ENV, "corrupt:9-10,corrupt:13")
    # a checkpoint every step: the one after the skipped step 11 must equal the one before it
    c = tiny_cfg(model=MODEL, train={**TRAIN, "max_steps": 16, "checkpoint_every": 1, "keep_last_checkpoints": None,
                                     "spike_min_history": 4, "spike_rollback_after": 2})
    from mlflow import MlflowClient

    from tasks.tracking import Tracker

    store = f"sqlite:///{(work / 'spike-mlflow.db').resolve()}"
    run_id = Tracker(store, "spike").start_run("spike")
    res = run_training(c, index, out, store, run_id, "spike", worker_module=WORKER_MODULE)
    assert res["steps"] == 16
    actions = [json.loads(line) for line in (out / SPIKE_LOG).read_text().splitlines()]
    assert [(a["action"], a["step"]) for a in actions] == [("skip", 9), ("skip", 10), ("rollback", 8), ("skip", 11)]
    assert actions[2]["skipped_data"] == [64, 80] and actions[2]["to_checkpoint"] == "step-000008"
    log = _log(out)
    assert [r["step"] for r in log] == list(range(1, 17))
    assert [r["data_start"] for r in log] == [8 * i for i in range(8)] + [8 * i for i in range(10, 18)]
    assert [r["step"] for r in log if r.get("skipped")] == [11]
    # a skipped batch changes nothing: weights and optimizer moments after step 11 are those after step 10
    before, after = (checkpoint_tensors(out / "checkpoints" / f"step-{n:06d}") for n in (10, 11))
    tensors = [k for k, v in before.items() if torch.is_tensor(v) and (k.startswith("model.") or ".exp_avg" in k)]
    assert len(tensors) > 16 and any(".exp_avg_sq" in k for k in tensors)
    assert all(torch.equal(before[k], after[k]) for k in tensors)
    assert after["train.step"] == 11 and after["train.consumed_samples"] == before["train.consumed_samples"] + 8
    # while a step that trains does change them
    step9 = checkpoint_tensors(out / "checkpoints" / "step-000009")
    assert not torch.equal(step9["model.tok_emb.weight"], before["model.tok_emb.weight"])
    assert actions[3]["data_range"] == [96, 104] and actions[3]["loss"] > 100
    meta = json.loads((list_checkpoints(out)[-1] / META_FILE).read_text())
    assert meta["trainer"]["skip_ranges"] == [[64, 80]] and meta["trainer"]["rollbacks"] == 1
    # the logged grad norm is the global norm before clipping: the corrupted batch's is far above the clip
    assert actions[3]["grad_norm"] > 10 * c.train.grad_clip
    # each action is in MLflow: a metric at its step and the run's last-action tag
    client = MlflowClient(tracking_uri=store)
    hist = {k: sorted(m.step for m in client.get_metric_history(run_id, k)) for k in ("spike_skip", "spike_rollback")}
    assert hist == {"spike_skip": [9, 10, 11], "spike_rollback": [8]}
    assert client.get_run(run_id).data.tags["spike.last_action"] == "skip@11"


def test_two_nodes_c10d_rendezvous(work, index):
    out = work / "multinode"
    endpoint = f"127.0.0.1:{free_port()}"
    results = train_on_nodes(lambda rank: tiny_cfg(train={
        "nnodes": 2, "node_rank": rank, "nproc_per_node": 1, "rdzv_endpoint": endpoint, "rdzv_id": "mn-test",
        "max_steps": 4, "checkpoint_every": 2, "log_every": 2}), index, out, "multinode")
    assert results[0]["steps"] == 4 and results[1]["steps"] == 4
    assert (out / "torchrun-node0.log").is_file() and (out / "torchrun-node1.log").is_file()
    meta = json.loads((list_checkpoints(out)[-1] / META_FILE).read_text())
    assert meta["world_size"] == 2 and meta["step"] == 4
