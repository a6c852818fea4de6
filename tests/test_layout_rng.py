"""Per-rank RNG (dropout) streams under the training layouts, at the unit level: each rank's mesh
coordinates come from the real DeviceMesh of 4 ranks, built in one process on torch's fake process
group (no collectives run). tp ranks of one replica share a stream, replicas, cp slices and stages differ; a
checkpoint's saved streams are reused only under the same mesh, not merely the same world size."""
from __future__ import annotations

import dataclasses

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from tasks.train.parallel_dims import ParallelDims
from tasks.train.trainer import rank_stream_seed, saved_streams_fit, stream_coords
from tests.lm_helpers import tiny_cfg

SEED, STEP = 1337, 10


def _dims(parallelism: str = "fsdp2", **parallel) -> ParallelDims:
    return ParallelDims.from_config(
        tiny_cfg(model={"n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 64, "tie_embeddings": False},
                 train={"nproc_per_node": 4, "parallelism": parallelism, "parallel": parallel}), 4)


def _seeds(dims: ParallelDims, step: int) -> list[int]:
    """Each rank's stream seed as the trainer derives it (from its mesh coordinates)."""
    seeds = []
    for rank in range(dims.world):
        dist.init_process_group("fake", rank=rank, world_size=dims.world, store=FakeStore())
        try:
            mesh = None if dims.legacy_ddp else dims.build_mesh("cpu")
            seeds.append(rank_stream_seed(SEED, *stream_coords(mesh, rank, dims.world), step))
        finally:
            dist.destroy_process_group()
    return seeds


def test_rank_streams_follow_the_layout_on_start_and_resume():
    for step in (0, STEP):  # a fresh start; a resume that derives fresh streams
        a, b, c, d = _seeds(_dims(dp_shard=2, tp=2), step)
        assert a == b and c == d and a != c  # tp peers share, the two replicas differ
        assert len(set(_seeds(_dims(dp_shard=4), step))) == 4
        assert len(set(_seeds(_dims(pp=2, dp_shard=2), step))) == 4  # replicas x stages
        assert len(set(_seeds(_dims(dp_shard=2, cp=2), step))) == 4  # cp slices hold other positions
        a, b, c, d = _seeds(_dims(cp=2, tp=2), step)
        assert a == b and c == d and a != c  # tp peers share, the two cp slices differ
    assert _seeds(_dims("ddp"), 0) == [SEED + 1 + r for r in range(4)]  # the legacy formula, unchanged
    assert set(_seeds(_dims(dp_shard=2, tp=2), STEP)).isdisjoint(_seeds(_dims(dp_shard=2, tp=2), 0))


def test_saved_streams_are_reused_only_under_the_same_mesh():
    saved = _dims(dp_shard=2, tp=2)
    meta = {"world_size": 4, "layout": dataclasses.asdict(saved)}
    assert saved_streams_fit(meta, _dims(dp_shard=2, tp=2), 4)
    assert not saved_streams_fit(meta, _dims(dp_shard=4), 4)  # same world, two replicas would share a stream
    assert not saved_streams_fit(meta, _dims(tp=4), 4)
    assert not saved_streams_fit({"world_size": 4}, saved, 4)  # no layout recorded
    assert not saved_streams_fit({**meta, "world_size": 8}, saved, 4)
