"""Checkpoints move between training layouts: a checkpoint written by a dp_shard 2 x tp 2 run (real
4-process torchrun, FSDP2 over TP DTensors: every rank writes its 2-D shards) resumes under 4-way FSDP
and in one process with the same weights, AdamW moments and data position (the resumed steps equal a
1-process run's within 1e-4), starts a continued run (train.init_from) with bitwise the same weights,
and loads for inference with the trained model's loss. The checkpoint's meta records its layout."""
from __future__ import annotations

import pytest
import torch

from layout_helpers import (GLOBAL_SAMPLES, LAYOUT_MODEL, SHARED_SAVE_STEP, assert_matches_reference, copy_at_step,
                            reference_run, run_layout, shared_tp_run)
from tasks.train import load_model_for_inference
from tasks.train.checkpoint import checkpoint_dir, checkpoint_tensors, read_meta, weights_sha256

SAVE_STEP = SHARED_SAVE_STEP


@pytest.fixture(scope="module")
def ref(base):
    return reference_run(base).rows


@pytest.fixture(scope="module")
def saved(base):
    """The shared dp_shard 2 x tp 2 run of the 10-step schedule (tests/test_layouts.py checks its
    losses), checkpointed after steps 6 and 10; these tests use the step-6 checkpoint."""
    run = shared_tp_run(base)
    assert [read_meta(c)["step"] for c in run.checkpoints] == [SAVE_STEP, 10]
    run.checkpoints = [str(checkpoint_dir(run.out_dir, SAVE_STEP))]
    return run


def test_checkpoint_records_its_layout_and_holds_2d_shards(saved, ref):
    assert_matches_reference(saved.rows[:SAVE_STEP], ref[:SAVE_STEP])
    ckpt = saved.checkpoints[-1]
    meta = read_meta(ckpt)
    assert meta["step"] == SAVE_STEP and meta["world_size"] == 4
    assert (meta["layout"]["dp_shard"], meta["layout"]["tp"], meta["layout"]["describe"]) == (2, 2, "dp_shard 2 x tp 2")
    assert meta["trainer"]["consumed_samples"] == SAVE_STEP * GLOBAL_SAMPLES
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    chunks = HuggingFaceStorageReader(ckpt).read_metadata().state_dict_metadata
    # a column-wise TP weight under FSDP: four distinct shards, one per rank (tp halves of dp halves)
    assert len({tuple(c.offsets) for c in chunks["model.blocks.0.attn.wq.weight"].chunks}) == 4


def test_checkpoint_loads_for_inference_as_trained(saved, ref, base):
    """load_model_for_inference (continued pretraining's and the gate's loader) unshards the 2-D shards
    into the plain model: its tensors are the files' shards put together, and its loss on the next
    step's batch is the loss the 1-process run logged for that step."""
    from layout_helpers import layout_cfg
    from lm_helpers import tokens_artifact
    from tasks.train.data import GlobalWindows
    from tasks.train.model import lm_loss

    ckpt = saved.checkpoints[-1]
    model, meta = load_model_for_inference(ckpt)
    full = checkpoint_tensors(ckpt)
    for name, t in model.state_dict().items():
        assert torch.equal(t, full[f"model.{name}"]), name
    data = GlobalWindows(tokens_artifact(base)["index_path"], "train", LAYOUT_MODEL["seq_len"], GLOBAL_SAMPLES,
                         seed=layout_cfg(1).train.seed)
    pos = data.step_start(meta["trainer"]["consumed_samples"])
    x, y = data.micro_batch(pos, 0, 0, 1)  # the whole global batch of step 7
    with torch.no_grad():
        loss = lm_loss(model(x)[0], y)[1].item()
    logged = ref[SAVE_STEP]
    assert logged["step"] == SAVE_STEP + 1 and logged["data_start"] == pos
    assert loss == pytest.approx(logged["loss"], rel=1e-4)


@pytest.mark.parametrize("world, layout", [(4, {"dp_shard": 4}), (1, {})], ids=["dp_shard4", "one_process"])
def test_resume_in_another_layout_continues_exactly(saved, ref, base, tmp_path, world, layout):
    """The saved run resumed under `layout`: steps 7-10 equal the 1-process run's (weights, AdamW moments
    and step count restored, the data position exact), and its new checkpoint records the new layout."""
    out = copy_at_step(saved.out_dir, tmp_path / "resumed", SAVE_STEP)
    run = run_layout(base, world, train={"parallel": layout, "resume": True}, out_dir=out, name="resumed")
    assert f"step-{SAVE_STEP:06d} at step {SAVE_STEP}, data position {SAVE_STEP * GLOBAL_SAMPLES}" in run.log
    assert_matches_reference(run.rows, ref)
    meta = read_meta(run.checkpoints[-1])
    assert meta["step"] == 10 and meta["world_size"] == world
    assert meta["layout"]["describe"] == ("dp_shard 4" if world == 4 else "ddp x1")


def test_continued_run_starts_from_the_same_weights_under_fsdp(saved, base, tmp_path):
    """train.init_from (continued pretraining) of the dp_shard 2 x tp 2 checkpoint in a 4-way FSDP run:
    the weights it starts from hash (bitwise, whole tensors) like the checkpoint's loaded in one process."""
    import json

    from tasks.core.hashing import sha256_tree

    ckpt = saved.checkpoints[-1]
    out = tmp_path / "continued"
    run_layout(base, 4, train={"parallel": {"dp_shard": 4}, "init_from": ckpt, "init_sha256": sha256_tree(ckpt)},
               steps=1, out_dir=out, name="continued")
    record = json.loads((out / "init.json").read_text())
    model, _ = load_model_for_inference(ckpt)
    assert record["from_step"] == SAVE_STEP and record["weights_sha256"] == weights_sha256(model)
