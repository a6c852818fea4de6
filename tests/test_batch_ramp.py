"""Batch-size ramp in tokens (tasks/train/batch_ramp.py): per-step batches and lr follow the ramp,
bad settings fail at config load naming the field, a run stopped mid-ramp and resumed (also on
another world size) continues it, and without a ramp nothing changes."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lm_helpers import tiny_cfg, tokens_artifact
from tasks.train.batch_ramp import BatchRamp, tokens_trained_from_meta
from tasks.train.parallel_dims import ParallelDims
from tasks.train.schedule import lr_at, schedule_record

SEQ = 64
# 2 ranks x micro-batch 2 = 4 sequences a step at the least; the full batch 16 (4 micro-batches each)
RAMP = {"micro_batch_size": 2, "grad_accum_steps": 4, "batch_ramp_start_tokens": 4 * SEQ,
        "batch_ramp_tokens": 16 * SEQ * 4, "warmup_steps": 5}


def _ramp(cfg) -> BatchRamp:
    return BatchRamp.for_layout(cfg.train, ParallelDims.from_config(cfg), cfg.model.seq_len)


def _walk(ramp: BatchRamp, steps: int, tokens: int = 0) -> list[int]:
    out = []
    for _ in range(steps):
        out.append(ramp.samples_at(tokens))
        tokens += out[-1] * ramp.seq_len
    return out


def test_batches_grow_linearly_with_tokens_in_whole_micro_batches():
    ramp = _ramp(tiny_cfg(train=RAMP))
    assert (ramp.start_samples, ramp.full_samples, ramp.granularity) == (4, 16, 4)
    # 4 + 12 x tokens / 4096, rounded to a multiple of 4: by hand
    assert _walk(ramp, 10) == [4, 4, 4, 8, 8, 8, 12, 12, 16, 16]
    assert [ramp.micro_batches_at(t) for t in (0, 1280, 3072, 4096, 10**9)] == [1, 2, 3, 4, 4]
    assert ramp.steps_to_full() == 9
    rec = ramp.record(1280)
    assert rec == {"start_tokens": 256, "ramp_tokens": 4096, "full_tokens": 1024, "tokens_trained": 1280,
                   "next_batch_tokens": 512}
    assert tokens_trained_from_meta({"schedule": schedule_record(tiny_cfg().train, rec)}) == 1280
    assert tokens_trained_from_meta({"schedule": schedule_record(tiny_cfg().train)}) is None
    # a pipeline's granularity holds its micro-batches: 1 dp rank x micro 2 x pp_microbatches 2
    pp = tiny_cfg(model={"tie_embeddings": False}, train={
        "micro_batch_size": 2, "grad_accum_steps": 8, "batch_ramp_start_tokens": 4 * SEQ,
        "batch_ramp_tokens": 10_000, "parallel": {"pp": 2, "pp_microbatches": 2}})
    assert _ramp(pp).granularity == 4 and set(_walk(_ramp(pp), 30)) <= {4, 8, 12, 16}
    with pytest.raises(ValueError, match="multiple of the step granularity 256 tokens .* x pp_microbatches 2"):
        tiny_cfg(model={"tie_embeddings": False}, train={
            "micro_batch_size": 2, "grad_accum_steps": 8, "batch_ramp_start_tokens": 2 * SEQ,
            "batch_ramp_tokens": 10_000, "parallel": {"pp": 2, "pp_microbatches": 2}})


def test_lr_warmup_follows_the_ramp_tokens_and_is_unchanged_without_a_ramp():
    cfg = tiny_cfg(train=RAMP)
    ramp, full = _ramp(cfg), 16 * SEQ
    tokens, lrs = 0, []
    for step, b in enumerate(_walk(ramp, 12), 1):
        tokens += b * SEQ
        lrs.append(lr_at(step, cfg.train, tokens, full))
    # the warm-up spans warmup_steps x the full batch = 5120 tokens: step 3 has trained 768 of them
    assert lrs[2] == pytest.approx(cfg.train.lr * 768 / 5120)
    assert lrs[:9] == sorted(lrs[:9]) and lrs[4] < 0.5 * lr_at(5, cfg.train)  # slower than by steps
    # then it meets the cosine decay by steps (continuous, never above it)
    assert all(lr <= lr_at(s, cfg.train) + 1e-12 for s, lr in enumerate(lrs, 1) if s > 5)
    assert lrs[11] == pytest.approx(lr_at(12, cfg.train))
    for schedule in ("cosine", "wsd"):  # the token form without a ramp is today's schedule
        t = tiny_cfg(train={"lr_schedule": schedule}).train
        assert [lr_at(s, t, s * 1024, 1024) for s in range(1, 21)] == pytest.approx([lr_at(s, t) for s in range(1, 21)])


@pytest.mark.parametrize("train,match", [
    ({"batch_ramp_start_tokens": 2 * SEQ, "batch_ramp_tokens": 100}, "batch_ramp_start_tokens .* multiple of the step granularity 256"),
    ({"batch_ramp_start_tokens": 16 * SEQ, "batch_ramp_tokens": 100}, "batch_ramp_start_tokens .* below the full batch of 1024"),
    ({"batch_ramp_start_tokens": 4 * SEQ}, "batch_ramp_tokens must be > 0"),
    ({"batch_ramp_tokens": 100}, "batch_ramp_tokens is set without train.batch_ramp_start_tokens"),
])
def test_bad_ramp_fails_at_config_load_naming_the_field(train, match):
    with pytest.raises(ValueError, match=f"train.{match}"):
        tiny_cfg(train={"micro_batch_size": 2, "grad_accum_steps": 4, **train})


# --- real torchrun training with the ramp: per-step batches, lr, and a resume mid-ramp ---

TRAIN = {"parallel": {"dp_shard": 2}, "max_steps": 8, "micro_batch_size": 2, "batch_tokens": 16 * SEQ, "batch_ramp_start_tokens": 4 * SEQ,
         "batch_ramp_tokens": 16 * SEQ * 4, "warmup_steps": 5, "checkpoint_every": 100, "log_every": 1,
         "spike_detection": False}


def _train(base, out, model: dict | None = None, **train) -> list[dict]:
    from tasks.train import run_training

    cfg = tiny_cfg(model=model or {}, train={**TRAIN, **train})
    run_training(cfg, Path(tokens_artifact(base)["index_path"]), out, None, None, "ramp")
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def _meta(out: Path, step: int) -> dict:
    from tasks.train.checkpoint import read_meta

    return read_meta(out / "checkpoints" / f"step-{step:06d}")


def test_ramp_trains_resumes_mid_ramp_and_on_another_world_size(base, tmp_path):
    """2 processes (FSDP2, dp_shard 2): batches of 4, 4, 4, 8, 8, 8, 12, 12 sequences (the 16-sequence full batch after
    4096 tokens), the lr warm-up by tokens; resumed from its step-4 checkpoint (a copy without the later
    one), the same losses as the uninterrupted run; the 2-process checkpoint resumed on 1 process continues the ramp from its tokens
    (the 1-process rounding from there) at the exact data position."""
    assert "dp_shard 2" in ParallelDims.from_config(tiny_cfg(train=TRAIN)).describe()
    whole = _train(base, tmp_path / "whole", checkpoint_every=4)  # step 4's checkpoint: the resumes' start
    cfg = tiny_cfg(train=TRAIN)
    assert [r["batch_tokens"] // SEQ for r in whole] == [4, 4, 4, 8, 8, 8, 12, 12]
    starts = [r["data_start"] for r in whole]
    assert [b - a for a, b in zip(starts, starts[1:])] == [4, 4, 4, 8, 8, 8, 12]  # consumed_samples follows
    tokens = np.cumsum([r["batch_tokens"] for r in whole])
    assert [r["lr"] for r in whole] == pytest.approx([lr_at(s, cfg.train, int(t), 16 * SEQ)
                                                      for s, t in zip(range(1, 9), tokens)], rel=1e-6)
    assert whole[0]["lr"] < lr_at(1, cfg.train) / 3  # a 4-sequence step warms up a quarter as far
    rec = _meta(tmp_path / "whole", 8)["schedule"]["batch_ramp"]
    assert rec["tokens_trained"] == tokens[-1] and rec["next_batch_tokens"] == 16 * SEQ

    from layout_helpers import copy_at_step

    assert _meta(tmp_path / "whole", 4)["schedule"]["batch_ramp"]["tokens_trained"] == tokens[3]
    out = copy_at_step(tmp_path / "whole", tmp_path / "resumed", 4)
    other = copy_at_step(tmp_path / "whole", tmp_path / "one-process", 4)
    resumed = _train(base, out, resume=True)
    assert f"at step 4, data position {starts[4]}" in (out / "torchrun.log").read_text()  # resumed, not retrained
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert [r["batch_tokens"] for r in resumed] == [r["batch_tokens"] for r in whole]
    assert [r["data_start"] for r in resumed] == starts
    for r, w in zip(resumed, whole):
        assert r["loss"] == pytest.approx(w["loss"], rel=1e-5), (r, w)
        assert r["lr"] == pytest.approx(w["lr"], rel=1e-9)

    single = {"nproc_per_node": 1, "parallel": {}}  # FSDP2 over 2 ranks -> 1 process
    one = _train(base, other, resume=True, max_steps=7, **single)
    one_cfg = tiny_cfg(train={**TRAIN, **single})
    ramp = BatchRamp.for_layout(one_cfg.train, ParallelDims.from_config(one_cfg), SEQ)
    assert ramp.granularity == 2
    assert [r["batch_tokens"] // SEQ for r in one[4:]] == _walk(ramp, 3, int(tokens[3]))  # [8, 10, 12]
    assert one[4]["data_start"] == starts[4] and one[5]["data_start"] == starts[5]
    assert one[4]["loss"] == pytest.approx(whole[4]["loss"], rel=1e-4)  # the same 8 sequences, 1 rank


def test_ramp_through_a_pipeline_matches_one_process(base, tmp_path):
    """pp 2 (1f1b, 2 micro-batches) with the ramp: batches of 2, 2, 4, 4, 6 sequences, so the
    pipeline's micro-batches grow (a schedule per shape) and every step's loss equals a 1-process
    run of the same ramp (micro-batch 2: the same granularity, the same samples) within 1e-4."""
    ramp = {"max_steps": 5, "batch_tokens": 8 * SEQ, "batch_ramp_start_tokens": 2 * SEQ,
            "batch_ramp_tokens": 8 * SEQ * 3, "warmup_steps": 3}
    model = {"tie_embeddings": False}
    pp = _train(base, tmp_path / "pp", model=model, micro_batch_size=1,
                parallel={"pp": 2, "pp_microbatches": 2}, **ramp)
    one = _train(base, tmp_path / "one", model=model, micro_batch_size=2, nproc_per_node=1, parallel={}, **ramp)
    stages = json.loads((tmp_path / "pp" / "layout.json").read_text())["pipeline"]["ranks"]
    assert [s["layers"] for r in stages for s in r["stages"]] == [[0], [1]]  # really two pipeline stages
    assert [r["batch_tokens"] // SEQ for r in pp] == [r["batch_tokens"] // SEQ for r in one] == [2, 2, 4, 4, 6]
    for r, q in zip(pp, one):
        assert r["loss"] == pytest.approx(q["loss"], rel=1e-4), (r, q)
        assert r["data_start"] == q["data_start"] and r["lr"] == pytest.approx(q["lr"], rel=1e-9)
