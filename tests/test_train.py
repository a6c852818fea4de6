"""Training: a real 2-process torchrun run, plus the pieces (schedule, optimizer, data, events)."""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from flows.train_worker import PrefectEvents
from lm_helpers import tiny_cfg, tokens_artifact
from tasks.core.constants import CHECKPOINT_EVENT
from tasks.train import TrainingError, list_checkpoints, load_model_for_inference, run_training
from tasks.train.checkpoint import META_FILE
from tasks.train.data import GlobalWindows, RandomWindows
from tasks.train.model import GPT, GPTConfig, lm_loss
from tasks.train.optimizer import build_optimizer
from tasks.train.schedule import lr_at


def _log(run) -> list[dict]:
    return [json.loads(line) for line in Path(run["train_log"]).read_text().splitlines()]


def test_loss_falls_and_every_step_logged(run):
    cfg = tiny_cfg()
    log = _log(run)
    assert run["steps"] == cfg.train.max_steps == 20
    assert [r["step"] for r in log] == list(range(1, 21))
    for r in log:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
        assert r["lr"] > 0 and r["tokens_per_s"] > 0
    assert abs(log[0]["loss"] - math.log(512)) < 0.3  # starts near uniform over the vocab
    first, last = np.mean([r["loss"] for r in log[:3]]), np.mean([r["loss"] for r in log[-3:]])
    assert last < first - 0.5, [round(r["loss"], 3) for r in log]
    assert run["first_loss"] == log[0]["loss"] and run["final_loss"] == log[-1]["loss"]
    assert run["tokens_per_s"] > 0
    # a console line every step (captured by the launcher), with the step's metrics
    console = [line for line in Path(run["log"]).read_text().splitlines() if line.startswith("step ")]
    assert [int(line.split("step")[1].split("/")[0]) for line in console] == list(range(1, 21)), console[:3]
    assert all(f"{k} " in console[-1] for k in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu"))


def test_metrics_in_mlflow_every_step(run, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=run["mlflow"]["tracking_uri"])
    for key in ("grad_norm", "train_loss", "lr", "tokens_per_s", "mfu"):
        hist = client.get_metric_history(run["mlflow"]["run_id"], key)
        assert sorted(m.step for m in hist) == list(range(1, 21)), key
        assert all(math.isfinite(m.value) and m.value > 0 for m in hist), key
    mfu = {m.step: m.value for m in client.get_metric_history(run["mlflow"]["run_id"], "mfu")}
    assert mfu == pytest.approx({r["step"]: r["flops_per_s"] / 1e11 for r in _log(run)}, rel=1e-5)
    grad = {m.step: m.value for m in client.get_metric_history(run["mlflow"]["run_id"], "grad_norm")}
    assert grad == pytest.approx({r["step"]: r["grad_norm"] for r in _log(run)}, rel=1e-5)
    params = client.get_run(run["mlflow"]["run_id"]).data.params
    assert params["model.d_model"] == "64" and params["world_size"] == "2"
    # the training options are run parameters too
    assert params["train.parallelism"] == "ddp" and params["train.dtype"] == "fp32"
    assert params["train.doc_mask"] == "False" and params["train.z_loss"] == "0.0"
    assert params["model.qk_norm"] == "False" and params["model.tie_embeddings"] == "True"


def test_checkpoints_written(run, base):
    ckpts = run["checkpoints"]
    assert [Path(c).name for c in ckpts] == ["step-000010", "step-000020"]
    for c in ckpts:
        assert Path(c).is_absolute() and len(list(Path(c).glob("*.safetensors"))) == 2  # one per rank
        assert not list(Path(c).glob(".metadata")) and not list(Path(c).glob("*.distcp"))  # no pickle
        meta = json.loads((Path(c) / META_FILE).read_text())
        assert meta["step"] == int(Path(c).name.split("-")[1])
        assert meta["vocab_size"] == 512 and meta["model"]["d_model"] == 64
        assert meta["run_name"] == "test-run" and meta["run_id"] == run["mlflow"]["run_id"]
        assert meta["world_size"] == 2
        # the index it was trained from, by the hash of its bytes (and its val split's): readers hold the
        # index they score on to it (tests/test_index_binding.py)
        index = Path(tokens_artifact(base)["index_path"])
        assert meta["tokens_index_sha256"] == hashlib.sha256(index.read_bytes()).hexdigest()
        assert meta["tokens_val_sha256"] == json.loads(index.read_text())["splits"]["val"]["sha256"]
    assert not list((base / "train" / "checkpoints").glob("*.tmp"))


def test_checkpoint_reloads_same_weights(run, base, tmp_path):
    from tasks.train.checkpoint import checkpoint_tensors

    model, meta = load_model_for_inference(run["checkpoints"][-1])
    assert meta["step"] == 20 and not model.training
    # an independent read of the files: the safetensors shards themselves, not DCP's loader
    full = checkpoint_tensors(run["checkpoints"][-1])
    for name in ("tok_emb.weight", "blocks.1.mlp.w2.weight", "norm.weight"):
        assert torch.equal(model.state_dict()[name], full[f"model.{name}"]), name
    assert int(full["train.step"]) == 20
    assert full["optim.state.tok_emb.weight.exp_avg"].shape == (512, 64)
    # trained, not freshly initialised: step 10 and step 20 differ, and the loss on training
    # windows is well below the uniform ln(512) = 6.24
    earlier, _ = load_model_for_inference(run["checkpoints"][0])
    assert not torch.equal(earlier.tok_emb.weight, model.tok_emb.weight)
    data = RandomWindows(tokens_artifact(base)["index_path"], "train", 64, 8, seed=tiny_cfg().train.seed)
    with torch.no_grad():
        losses = [model(*data.batch(step))[1].item() for step in (17, 18, 19, 20)]
    assert np.mean(losses) < math.log(512) - 0.5
    assert abs(np.mean(losses) - run["final_loss"]) < 0.5


def test_resume_continues_from_latest_checkpoint(run, base, tmp_path):
    import shutil

    out = tmp_path / "resumed"
    shutil.copytree(base / "train", out)
    # as after a crash at step 22: steps 21-22 are in the log but not in any checkpoint
    with open(out / "train_log.jsonl", "a") as f:
        f.write('{"step": 21, "loss": 9.0}\n{"step": 22, "loss": 9.0}\n')
    # also exercises gradient accumulation (2 micro-batches per step) on a single rank
    cfg = tiny_cfg(train={"max_steps": 24, "resume": True, "nproc_per_node": 1, "checkpoint_every": 100,
                          "grad_accum_steps": 2})
    res = run_training(cfg, Path(tokens_artifact(base)["index_path"]), out, None, None, "test-resume")
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 25))  # appended after the resumed step 20
    assert res["steps"] == 24 and Path(res["checkpoints"][-1]).name == "step-000024"
    assert "resumed from" in Path(res["log"]).read_text()
    # the schedule continued: the lr at step 21 is the cosine value, not a new warmup
    assert log[20]["lr"] == pytest.approx(lr_at(21, cfg.train), rel=1e-5)
    assert log[20]["loss"] < log[0]["loss"] - 0.5
    meta = json.loads((Path(res["checkpoints"][-1]) / META_FILE).read_text())
    assert meta["step"] == 24 and meta["world_size"] == 1


def test_failure_raises_with_log_tail(base, tmp_path):
    # seq_len larger than the val+train split cannot draw a window: the worker fails
    cfg = tiny_cfg(model={"seq_len": 1 << 20}, train={"nproc_per_node": 1})
    with pytest.raises(TrainingError) as err:
        run_training(cfg, Path(tokens_artifact(base)["index_path"]), tmp_path / "fail", None, None, "fail")
    assert "fewer than seq_len + 1" in str(err.value)
    assert (tmp_path / "fail" / "torchrun.log").is_file()


def test_lr_schedule():
    t = tiny_cfg(train={"max_steps": 100, "warmup_steps": 10, "lr": 1e-3, "min_lr": 1e-4}).train
    assert lr_at(1, t) == pytest.approx(1e-4)
    assert lr_at(10, t) == pytest.approx(1e-3)
    assert lr_at(55, t) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway through the cosine
    assert lr_at(100, t) == pytest.approx(1e-4)
    lrs = [lr_at(s, t) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_weight_decay_groups():
    model = GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, d_model=16, seq_len=8))
    opt = build_optimizer(model, tiny_cfg(train={"weight_decay": 0.1, "betas": (0.8, 0.9)}).train)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    no_decay = {names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0 for p in g["params"]}
    assert "tok_emb.weight" in no_decay and "norm.weight" in no_decay and "blocks.0.attn_norm.weight" in no_decay
    assert "blocks.0.attn.wq.weight" in decay and "blocks.0.mlp.w2.weight" in decay
    assert decay | no_decay == set(names.values()) and not decay & no_decay
    assert opt.param_groups[0]["betas"] == (0.8, 0.9)
    # the defaults are the recipe: AdamW beta 0.9/0.95, weight decay 0.1 on matrices only
    from tasks.config import TrainConfig

    default = build_optimizer(model, TrainConfig())
    assert isinstance(default, torch.optim.AdamW)
    assert [(g["betas"], g["weight_decay"]) for g in default.param_groups] == [((0.9, 0.95), 0.1), ((0.9, 0.95), 0.0)]


def test_random_windows(base):
    index = tokens_artifact(base)["index_path"]
    r0 = RandomWindows(index, "train", 32, 4, seed=1, rank=0)
    r1 = RandomWindows(index, "train", 32, 4, seed=1, rank=1)
    x, y = r0.batch(5)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    assert torch.equal(r0.batch(5)[0], x)  # reproducible per (seed, rank, step)
    assert not torch.equal(r1.batch(5)[0], x)  # ranks draw different windows
    assert not torch.equal(r0.batch(6)[0], x)


def test_checkpoint_event(monkeypatch):
    calls = []
    import prefect.events

    monkeypatch.setattr(prefect.events, "emit_event", lambda **kw: calls.append(kw) or object())
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    assert PrefectEvents().checkpoint_saved("/x/step-000010", 10, "rid", "runA") is False and calls == []
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    assert PrefectEvents().checkpoint_saved("/x/step-000010", 10, "rid", "runA") is True
    assert calls == [{
        "event": CHECKPOINT_EVENT,
        "resource": {"prefect.resource.id": "crucible.checkpoint.runA.10"},
        "payload": {"path": "/x/step-000010", "step": 10, "run_id": "rid", "run_name": "runA"},
    }]


def test_list_checkpoints_ignores_incomplete(tmp_path):
    for name in ("step-000010", "step-000020", "step-000030.tmp", "step-000005"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    for name in ("step-000010", "step-000020", "step-000005"):
        (tmp_path / "checkpoints" / name / META_FILE).write_text("{}")
    (tmp_path / "checkpoints" / "step-000005" / META_FILE).unlink()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000010", "step-000020"]


def test_the_worker_trains_only_on_a_config_signed_by_the_stack(tmp_path, monkeypatch):
    """A torchrun worker (and each of its elastic restarts) reads its config from the run directory,
    which anyone who can write there could edit between the launch and a restart. The launcher (and
    the pretrain flow, for the run's config.json the Kubernetes TrainJob names) writes it with a
    signature beside it; an unsigned, edited or foreign-signed config stops the worker before it
    joins the process group."""
    from tasks.core.signing import SIGNING_KEY_FILE_ENV, SignatureError
    from tasks.train.launcher import write_train_config
    from tasks.train.worker import main

    def launch(path):
        with pytest.raises(SignatureError):
            main(["--config-json", str(path), "--tokens-index", str(tmp_path / "i.json"),
                  "--out-dir", str(tmp_path / "train"), "--run-name", "r1"])

    cfg = tiny_cfg()
    unsigned = tmp_path / "unsigned.json"
    unsigned.write_text(cfg.model_dump_json(indent=2))
    launch(unsigned)
    signed = write_train_config(cfg, tmp_path / "config.json")
    assert json.loads(signed.read_text()) == json.loads(cfg.model_dump_json())  # plain config for people
    signed.write_text(signed.read_text().replace('"lr": ', '"lr": 1'))  # edited after signing
    launch(signed)
    own = os.environ[SIGNING_KEY_FILE_ENV]
    monkeypatch.setenv(SIGNING_KEY_FILE_ENV, str(tmp_path / "other.key"))
    foreign = write_train_config(cfg, tmp_path / "foreign.json")
    monkeypatch.setenv(SIGNING_KEY_FILE_ENV, own)
    launch(foreign)


def test_torchrun_command(tmp_path):
    from tasks.train.launcher import torchrun_command

    single = torchrun_command(tiny_cfg(), tmp_path / "c.json", tmp_path / "i.json", tmp_path, "r1", "abc")
    assert single[1:3] == ["-m", "torch.distributed.run"]
    assert "--standalone" in single and single[single.index("--nproc_per_node") + 1] == "2"
    assert single[single.index("-m", 3) + 1] == "tasks.train.worker"
    assert single[-2:] == ["--run-id", "abc"]
    assert single[single.index("--max-restarts") + 1] == "0"
    healing = torchrun_command(tiny_cfg(train={"max_restarts": 3}), tmp_path / "c.json", tmp_path / "i.json",
                               tmp_path, "r1", None)
    assert healing[healing.index("--max-restarts") + 1] == "3"
    multi = torchrun_command(tiny_cfg(train={"nnodes": 2, "rdzv_endpoint": "node0:29500"}),
                             tmp_path / "c.json", tmp_path / "i.json", tmp_path, "r1", None)
    assert "--standalone" not in multi and "--run-id" not in multi
    assert multi[multi.index("--rdzv-endpoint") + 1] == "node0:29500"
    assert multi[multi.index("--rdzv-backend") + 1] == "c10d"
    assert multi[multi.index("--rdzv-id") + 1] == "r1" and multi[multi.index("--nnodes") + 1] == "2"
    node1 = torchrun_command(tiny_cfg(train={"nnodes": 2, "rdzv_endpoint": "node0:29500", "node_rank": 1}),
                             tmp_path / "c.json", tmp_path / "i.json", tmp_path, "r1", None)
    assert node1[node1.index("--node-rank") + 1] == "1" and node1[node1.index("--rdzv-conf") + 1] == "is_host=false"
    with pytest.raises(Exception, match="rdzv_endpoint"):
        tiny_cfg(train={"nnodes": 2})


def test_wsd_schedule():
    t = tiny_cfg(train={"max_steps": 100, "warmup_steps": 10, "lr": 1e-3, "min_lr": 1e-4,
                        "lr_schedule": "wsd", "wsd_decay_fraction": 0.2}).train
    assert lr_at(5, t) == pytest.approx(5e-4)
    assert lr_at(10, t) == lr_at(50, t) == lr_at(80, t) == pytest.approx(1e-3)  # stable
    assert lr_at(90, t) == pytest.approx(1e-4 + 0.5 * 9e-4)  # linear decay over steps 81-100
    assert lr_at(100, t) == pytest.approx(1e-4)
    s = t.model_copy(update={"wsd_decay_shape": "sqrt"})
    assert lr_at(90, s) == pytest.approx(1e-4 + (1 - 0.5 ** 0.5) * 9e-4)
    lrs = [lr_at(k, t) for k in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_global_windows_independent_of_world_size(base):
    from tasks.train.data import GlobalWindows

    index = tokens_artifact(base)["index_path"]
    d = GlobalWindows(index, "train", 32, 2, seed=3)
    # one step of 8 samples starting at 16: 4 ranks x 1 micro, 2 ranks x 2 micro, 1 rank x 4 micro
    ref = d.samples(16, 8)
    for world, accum in ((4, 1), (2, 2), (1, 4)):
        parts = {(m * world + r): d.micro_batch(16, m, r, world) for m in range(accum) for r in range(world)}
        got = torch.cat([torch.cat([parts[i][0], parts[i][1][:, -1:]], dim=1) for i in sorted(parts)])
        assert torch.equal(got, ref), world
    # an epoch visits every window once, in a seeded order
    n = d.n_windows
    starts = {int(d._window(g)) for g in range(n)}
    assert starts == set(range(n))
    other = GlobalWindows(index, "train", 32, 2, seed=4)
    assert [d._window(g) for g in range(10)] != [other._window(g) for g in range(10)]
    d.skip_ranges = [(8, 16), (16, 24)]
    assert d.step_start(8) == 24 and d.step_start(4) == 4


def test_spike_detector():
    from tasks.train.spikes import SpikeDetector

    det = SpikeDetector(window=5, min_history=3, sigma=4.0, rollback_after=2)
    assert det.check(100.0, 100.0) is None  # no history yet: nothing is a spike
    for loss in (5.0, 4.9, 5.1, 5.0):
        assert det.check(loss, 1.0) is None
        det.healthy(loss, 1.0)
    assert det.check(5.05, 1.01) is None
    assert det.check(9.0, 1.0)["reason"] == "loss"
    assert det.check(5.0, 50.0)["reason"] == "grad_norm"
    assert det.check(float("nan"), 1.0) is not None
    assert det.spiked(10, 80) is False and det.spiked(11, 88) is True
    assert det.streak_first_step == 10 and det.streak_start == 80
    restored = SpikeDetector(window=5, min_history=3, sigma=4.0, rollback_after=2)
    restored.load(json.loads(json.dumps(det.state())))
    assert restored.state() == det.state()


def test_flops_batch_and_faults():
    from tasks.train.data import global_batch
    from tasks.train.flops import flops_per_token
    from train_faults import parse_faults

    assert flops_per_token(1000, 2, 4, 16, 64) == 6 * 1000 + 12 * 2 * 4 * 16 * 64
    t = tiny_cfg(train={"micro_batch_size": 4, "batch_tokens": 16 * 64}).train
    assert global_batch(t, 64, 2) == (16, 2) and global_batch(t, 64, 4) == (16, 1)
    with pytest.raises(ValueError, match="multiple"):
        global_batch(t, 64, 3)
    assert global_batch(tiny_cfg(train={"grad_accum_steps": 3}).train, 64, 2) == (48, 3)
    assert parse_faults("corrupt:9-10, kill:8:1,corrupt:13") == [
        ("corrupt", 9, 10, None), ("kill", 8, 8, 1), ("corrupt", 13, 13, None)]
    with pytest.raises(Exception, match="stop_at_step"):
        tiny_cfg(train={"stop_at_step": 30})


# ---------------------------------------------------------------- document masks, FSDP2, bf16, z-loss

def test_global_windows_documents_follow_the_index_boundaries(base):
    """Per input token: the document id (from 0 in each sequence) steps up exactly after an EOS,
    and the RoPE position restarts at 0 there."""
    from tasks.train.data import GlobalWindows

    info = tokens_artifact(base)
    d = GlobalWindows(info["index_path"], "train", 64, 4, seed=3, documents=True)
    eos = info["eos_id"]
    n = min(d.n_windows, 400)
    x = d.samples(0, n)[:, :-1]
    ids, pos = d.documents(0, n)
    assert ids.shape == pos.shape == x.shape and ids.dtype == pos.dtype == torch.int64
    boundary = x[:, :-1] == eos  # the token after an EOS starts a new document
    assert torch.equal(ids[:, 1:] - ids[:, :-1], boundary.long())
    assert torch.equal(pos[:, 1:], torch.where(boundary, 0, pos[:, :-1] + 1))
    assert bool((ids[:, 0] == 0).all()) and bool((pos[:, 0] == 0).all())
    assert int(boundary.sum()) > 10  # the check saw real boundaries
    # micro-batches line up with micro_batch's inputs
    mx, _ = d.micro_batch(16, 1, 0, 2)
    mids, _ = d.micro_batch_documents(16, 1, 0, 2)
    first = 16 + 2 * 4
    assert torch.equal(mx, x[first:first + 4]) and torch.equal(mids, ids[first:first + 4])


def test_untied_head_is_weight_decayed():
    model = GPT(GPTConfig(vocab_size=50, n_layer=1, n_head=2, d_model=16, seq_len=8, tie_embeddings=False))
    opt = build_optimizer(model, tiny_cfg().train)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert "lm_head.weight" in decay and "tok_emb.weight" not in decay


def test_fsdp2_matches_ddp_and_resumes_with_bf16_doc_mask_z_loss(run, base, tmp_path):
    """A 2-process FSDP2 (fully_shard, gloo, CPU) run: the same losses as the DDP run for the first
    steps; its sharded DCP checkpoint loads for inference and resumes training under FSDP2 with
    bf16 compute, document masking and z-loss switched on."""
    index = Path(tokens_artifact(base)["index_path"])
    out = tmp_path / "fsdp2"
    res = run_training(tiny_cfg(train={"parallelism": "fsdp2", "stop_at_step": 4, "log_every": 1}),
                       index, out, None, None, "fsdp2")
    text = Path(res["log"]).read_text()
    assert res["steps"] == 4 and "fsdp2 fp32" in text
    # what was built, not only what was asked for: every parameter a sharded DTensor ...
    assert re.search(r"built FSDP2 on dp_shard_cp 2: (\d+) parameters, sharded per mesh dim: dp_shard_cp \1;",
                     text), text[-2000:]
    assert re.search(r"built DDP over 2 ranks: \d+ parameters, sharded per mesh dim: none;", Path(run["log"]).read_text())
    # ... and a checkpoint of shards: each rank wrote half of the embedding's rows (DDP: one whole chunk)
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    def emb_chunks(ckpt):  # from the safetensors headers (no pickled .metadata)
        meta = HuggingFaceStorageReader(str(ckpt)).read_metadata().state_dict_metadata["model.tok_emb.weight"]
        return sorted(tuple(c.offsets) for c in meta.chunks)

    assert emb_chunks(res["checkpoints"][-1]) == [(0, 0), (512 // 2, 0)]  # 512-token vocabulary
    assert emb_chunks(run["checkpoints"][-1]) == [(0, 0)]
    ddp_log, log = _log(run), [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    for r, q in zip(log, ddp_log[:4]):
        assert r["loss"] == pytest.approx(q["loss"], rel=1e-4), (r, q)
        assert r["grad_norm"] == pytest.approx(q["grad_norm"], rel=1e-3), (r, q)
        assert r["data_start"] == q["data_start"]
    model, meta = load_model_for_inference(res["checkpoints"][-1])  # unsharded by DCP
    assert meta["step"] == 4 and model.tok_emb.weight.shape == (512, 64)

    res = run_training(tiny_cfg(train={"parallelism": "fsdp2", "resume": True, "stop_at_step": 6, "log_every": 1,
                                       "dtype": "bf16", "doc_mask": True, "z_loss": 1e-4}),
                       index, out, None, None, "fsdp2")
    text = Path(res["log"]).read_text()
    assert "resumed from" in text and "fsdp2 bf16 doc-mask" in text
    assert "forward computes in torch.bfloat16; the optimizer updates torch.float32 weights" in text
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [1, 2, 3, 4, 5, 6]
    for r, q in zip(log[4:], ddp_log[4:6]):
        assert abs(r["loss"] - q["loss"]) < 0.1, (r, q)  # bf16 and the mask move it a little
        assert 0 < r["z_loss"] < 1e-2  # 1e-4 * logsumexp^2, logged every step
    assert Path(res["checkpoints"][-1]).name == "step-000006"

    # the 2-rank sharded checkpoint (model and optimizer shards) resumes on 1 process: DCP reshards
    # it; the same global batch (2 micro-batches instead of 2 ranks) reads the same samples
    res = run_training(tiny_cfg(train={"parallelism": "fsdp2", "resume": True, "stop_at_step": 8, "log_every": 1,
                                       "nproc_per_node": 1, "grad_accum_steps": 2}),
                       index, out, None, None, "fsdp2")
    assert "resumed from" in Path(res["log"]).read_text()
    log = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == list(range(1, 9))
    assert [r["data_start"] for r in log] == [q["data_start"] for q in ddp_log[:8]]
    for r, q in zip(log[6:], ddp_log[6:8]):
        assert abs(r["loss"] - q["loss"]) < 0.1, (r, q)
    _, meta = load_model_for_inference(res["checkpoints"][-1])
    assert meta["step"] == 8 and meta["world_size"] == 1


def test_async_checkpoint_is_a_snapshot_published_only_when_complete(tmp_path):
    """dcp.async_save stages the state to CPU memory before returning: optimizer steps (and any
    in-place change) after the start do not reach the checkpoint, and the checkpoint only becomes
    visible (final name, meta file) in wait_and_finalize."""
    from tasks.train.checkpoint import load_checkpoint, start_checkpoint

    tcfg = tiny_cfg().train
    cfg = GPTConfig(vocab_size=128, n_layer=2, n_head=2, d_model=32, seq_len=16)

    def model_and_opt():
        torch.manual_seed(0)
        model = GPT(cfg)
        return model, build_optimizer(model, tcfg)

    model, opt = model_and_opt()
    x = torch.randint(0, 128, (4, 16))
    for _ in range(2):
        opt.zero_grad()
        model(x, targets=x)[1].backward()
        opt.step()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    want_moments = {n: opt.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    pending = start_checkpoint(model, opt, 2, tmp_path, {"model": cfg.to_dict(), "trainer": {}},
                               async_save=True)
    assert pending.is_async and list_checkpoints(tmp_path) == []
    for _ in range(2):  # training goes on while the checkpoint is written
        opt.zero_grad()
        model(x, targets=x)[1].backward()
        opt.step()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    assert list_checkpoints(tmp_path) == []  # not visible before wait_and_finalize
    path = pending.wait_and_finalize()
    assert list_checkpoints(tmp_path) == [path] and not path.with_name(path.name + ".tmp").exists()
    from tasks.train.checkpoint import UnverifiedCheckpoint, apply_retention

    with pytest.raises(UnverifiedCheckpoint):  # not loadable until the run's manifest vouches for it
        load_model_for_inference(path)
    apply_retention(tmp_path, path, None)  # what rank 0 of the trainer does next
    got, _ = load_model_for_inference(path)
    assert all(torch.equal(got.state_dict()[k], want[k]) for k in want)
    assert not torch.equal(got.state_dict()["tok_emb.weight"], model.state_dict()["tok_emb.weight"])
    fresh, fresh_opt = model_and_opt()
    assert load_checkpoint(fresh, fresh_opt, path) == 2
    for n, p in fresh.named_parameters():
        assert torch.equal(fresh_opt.state[p]["exp_avg"], want_moments[n]), n


def test_compile_option_through_torchrun(base, tmp_path):
    """train.compile=true in a real torchrun run: the worker compiles each block, trains, saves a
    checkpoint that loads without compile, and its losses follow the same run in eager mode."""
    index = Path(tokens_artifact(base)["index_path"])
    logs = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        res = run_training(tiny_cfg(train={"compile": compiled, "nproc_per_node": 1, "max_steps": 3,
                                           "checkpoint_every": 3, "log_every": 1}),
                           index, tmp_path / name, None, None, name)
        assert res["steps"] == 3
        text = Path(res["log"]).read_text()
        assert ("ddp fp32 compiled" in text) == compiled
        assert f"{2 if compiled else 0}/2 blocks compiled" in text  # nn.Module.compile really applied
        logs[name] = [json.loads(x)["loss"] for x in (tmp_path / name / "train_log.jsonl").read_text().splitlines()]
        model, meta = load_model_for_inference(res["checkpoints"][-1])
        assert meta["step"] == 3 and meta["train_options"]["compile"] is compiled
    assert logs["compiled"] == pytest.approx(logs["eager"], abs=2e-3)


def test_document_mask_reaches_the_training_forward(base, tmp_path):
    """train.doc_mask=true changes what the worker computes: the loss it logs for step 6 is the
    document-masked loss of that step's batch under the step-5 checkpoint, recomputed here, and not
    the plain causal one."""
    index = Path(tokens_artifact(base)["index_path"])
    cfg = tiny_cfg(train={"doc_mask": True, "nproc_per_node": 1, "max_steps": 6, "checkpoint_every": 5})
    res = run_training(cfg, index, tmp_path / "mask", None, None, "mask")
    assert res["steps"] == 6 and "doc-mask" in Path(res["log"]).read_text()
    logged = json.loads((tmp_path / "mask" / "train_log.jsonl").read_text().splitlines()[5])
    model, meta = load_model_for_inference(tmp_path / "mask" / "checkpoints" / "step-000005")

    data = GlobalWindows(index, "train", model.cfg.seq_len, cfg.train.micro_batch_size, seed=cfg.train.seed,
                         documents=True)
    pos = data.step_start(meta["trainer"]["consumed_samples"])
    assert logged["step"] == 6 and logged["data_start"] == pos
    x, y = data.micro_batch(pos, 0, 0, 1)
    doc_ids, positions = data.micro_batch_documents(pos, 0, 0, 1)
    assert (doc_ids[:, 1:] != doc_ids[:, :-1]).any()  # the batch has document boundaries to mask
    with torch.no_grad():
        masked = lm_loss(model(x, doc_ids=doc_ids, positions=positions)[0], y)[1].item()
        causal = lm_loss(model(x)[0], y)[1].item()
    print(f"step 6: logged {logged['loss']}, masked {masked}, causal {causal}")
    assert abs(masked - causal) > 1e-3, (masked, causal)
    assert logged["loss"] == pytest.approx(masked, rel=1e-5, abs=0)
    assert logged["loss"] != pytest.approx(causal, rel=1e-4, abs=0)
