"""Batch-size ramp in tokens (tasks/train/batch_ramp.py): per-step batches and lr follow the ramp,
bad settings fail at config load naming the field, a run stopped mid-ramp and resumed (also on
another world size) continues it, and without a ramp nothing changes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lm_helpers import tiny_cfg
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
    # a pipeline's granularity holds its micro-batches: 1 rank x micro 2 x pp_microbatches 2
    pp = tiny_cfg(model={"tie_embeddings": False}, train={
        "micro_batch_size": 2, "grad_accum_steps": 8, "batch_ramp_start_tokens": 4 * SEQ,
        "batch_ramp_tokens": 10_000, "parallel": {"pp": 2, "pp_microbatches": 2}})
    assert _ramp(pp).granularity == 4 and set(_walk(_ramp(pp), 30)) <= {4, 8, 12, 16}


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
