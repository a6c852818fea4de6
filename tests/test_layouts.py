"""Training layouts (train.parallel) against one process: real 4-process torchrun runs (gloo, CPU, fp32,
fixed seed) of a 4-layer model whose first 10 steps' losses equal a 1-process run on the same global
batch within 1e-4 relative and whose grad norms agree within 1e-3 (tests/layout_helpers.py). Each test
also reads what the trainer really built (rank 0's layout.json): a layout silently run as plain data
parallelism would match the losses too, so each asserts its dimension (parameters sharded on the tp
mesh dim with the tp-local shapes, FSDP shards on dp_shard, checkpoint wrappers on the blocks).
And bad layouts fail at config load, naming the field.
"""
from __future__ import annotations

import math
import re

import pydantic
import pytest

from layout_helpers import (LAYOUT_MODEL, assert_matches_reference, layout_cfg, rank_record, reference_run, run_layout,
                            shared_tp_run)
from tasks.train.parallel_dims import ParallelDims

D, HIDDEN, VOCAB = LAYOUT_MODEL["d_model"], 192, 512  # mlp_hidden of d_model 64; the test tokenizer's vocab
COLWISE = ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")  # output features split over tp
ROWWISE = ("attn.proj", "mlp.w2")  # input features split over tp
FSDP_DIM = "dp_shard_cp"  # FSDP2 shards over dp_shard x cp (flattened; cp is 1 here)


@pytest.fixture(scope="module")
def ref(base):
    return reference_run(base).rows


def _placement(rec: dict, dim: str) -> str:
    return rec["placements"][rec["mesh_dims"].index(dim)]


def assert_tensor_parallel(layout: dict, tp: int, dp_shard: int) -> None:
    """Every rank's block matrices are DTensors split over the "tp" mesh dim (column-wise: output rows,
    Shard(0); row-wise: input columns, Shard(1)), each rank holding 1 / (tp x dp_shard) of them; the tp
    ranks of one replica read the same data, the replicas different data."""
    assert layout["dims"]["tp"] == tp and layout["dims"]["dp_shard"] == dp_shard
    for r in layout["ranks"]:
        for i in range(LAYOUT_MODEL["n_layer"]):
            for name in COLWISE + ROWWISE:
                rec = r["params"][f"blocks.{i}.{name}.weight"]
                assert rec["dtensor"] and "tp" in rec["mesh_dims"], (name, rec)
                want = "S(0)" if name in COLWISE else "S(1)"
                assert _placement(rec, "tp") == want, (name, rec)
                numel = rec["shape"][0] * rec["shape"][1]
                local = rec["local_shape"][0] * rec["local_shape"][1]
                assert local * tp * dp_shard == numel, (name, rec)
    dp_of = {tuple(sorted(r["coords"].items())): r["dp_rank"] for r in layout["ranks"]}
    assert sorted(set(dp_of.values())) == list(range(dp_shard))  # tp ranks share their replica's dp rank
    assert all(r["dp_rank"] == r["coords"]["dp_shard"] for r in layout["ranks"])


def assert_fsdp(layout: dict, dp_shard: int) -> None:
    """FSDP2 manages every block and shards its parameters over the dp_shard (x cp) mesh dim."""
    for r in layout["ranks"]:
        assert all(b["fsdp"] for b in r["blocks"].values()), r["blocks"]
        for name, rec in r["params"].items():
            assert rec["dtensor"] and _placement(rec, FSDP_DIM) != "R", (name, rec)
            # each rank holds its 1 / (ranks splitting it) share: dp_shard x (tp where TP splits it too)
            split = math.prod(layout["mesh"][d] if d != FSDP_DIM else dp_shard
                              for d, pl in zip(rec["mesh_dims"], rec["placements"]) if pl != "R")
            assert math.prod(rec["local_shape"]) * split == math.prod(rec["shape"]), (name, rec)
        assert r["params"]["tok_emb.weight"]["shape"] == [VOCAB, D]


def assert_checkpointed(layout: dict, mode: str) -> None:
    """Every rank's every block is wrapped for activation checkpointing in `mode` (the recompute itself
    is proven in tests/test_parallelize.py; here: the trainer applied it, and the losses stay the same)."""
    assert layout["activation_checkpointing"] == mode
    for r in layout["ranks"]:
        blocks = r["blocks"]
        assert len(blocks) == LAYOUT_MODEL["n_layer"] and all(b["checkpointed"] for b in blocks.values()), blocks
        assert all(b["selective"] == (mode == "selective") for b in blocks.values()), blocks


def test_dp_shard_4_full_checkpointing_matches_one_process(base, ref):
    run = run_layout(base, 4, train={"parallel": {"dp_shard": 4}, "activation_checkpointing": "full"})
    assert_matches_reference(run.rows, ref)
    assert_checkpointed(run.layout, "full")
    assert_fsdp(run.layout, 4)
    r0 = rank_record(run.layout)
    assert all(rec["dtensor"] and _placement(rec, FSDP_DIM) == "S(0)" for rec in r0["params"].values())
    assert r0["params"]["blocks.0.mlp.w1.weight"]["local_shape"] == [HIDDEN // 4, D]
    assert sorted(r["dp_rank"] for r in run.layout["ranks"]) == [0, 1, 2, 3]  # four slices of each batch
    assert "layout dp_shard 4" in run.log
    # meta-device init (tasks/train/meta_init.py): sharded while still on meta, then a rank allocates
    # only its quarter, generating one whole tensor at a time; the losses above equal the 1-process
    # run's, whose model is built whole (the `ddp` shorthand): same seed, same weights
    init = run.layout["init"]
    assert init["built_on_meta"] and init["rank_param_bytes"] * 4 == init["model_param_bytes"]
    assert init["largest_init_tensor_bytes"] == VOCAB * D * 4 < init["model_param_bytes"] / 4


def test_dp_shard_2_tp_2_selective_checkpointing_matches_one_process(base, ref, monkeypatch):
    run = shared_tp_run(base)  # also test_layout_resharding's saved run
    assert_matches_reference(run.rows, ref)
    assert_checkpointed(run.layout, "selective")
    assert_tensor_parallel(run.layout, tp=2, dp_shard=2)
    assert_fsdp(run.layout, 2)
    assert "layout dp_shard 2 x tp 2" in run.log
    # the resolved layout is a run parameter in MLflow
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    params = MlflowClient(tracking_uri=run.mlflow["tracking_uri"]).get_run(run.mlflow["run_id"]).data.params
    assert (params["layout.tp"], params["layout.dp_shard"], params["layout.describe"]) == ("2", "2", "dp_shard 2 x tp 2")


def test_tp_4_matches_one_process(base, ref):
    run = run_layout(base, 4, train={"parallel": {"tp": 4}})
    assert_matches_reference(run.rows, ref)
    assert_tensor_parallel(run.layout, tp=4, dp_shard=1)
    r0 = rank_record(run.layout)
    assert r0["params"]["blocks.0.attn.wq.weight"]["local_shape"] == [D // 4, D]
    assert r0["params"]["blocks.0.mlp.w2.weight"]["local_shape"] == [D, HIDDEN // 4]
    assert run.layout["micro_batches_per_rank"] == 4  # one replica: the whole batch, accumulated
    assert "layout tp 4 | fp32" in run.log  # the start-up line names the layout (no ddp shorthand it ignored)
    assert {r["dp_rank"] for r in run.layout["ranks"]} == {0}


# ---------------------------------------------------------------- layouts refused at config load

@pytest.mark.parametrize("world, parallel, model, message", [
    (3, {"tp": 3}, {}, "train.parallel.tp (3) must divide model.n_head (4)"),
    (2, {"dp_shard": 2, "tp": 2}, {}, "= 4, but the world size is 2"),
    (4, {"pp": 2, "pp_microbatches": 1}, {"tie_embeddings": False}, "train.parallel.pp_microbatches (1) must be at least pp (2)"),
    (2, {"pp": 2}, {"n_layer": 3, "tie_embeddings": False}, "model.n_layer (3) must split evenly"),
    (2, {"ep": 2}, {}, "train.parallel.ep > 1 needs a mixture-of-experts model (model.moe.n_experts)"),
    (2, {"cp": 2}, {"seq_len": 30}, "train.parallel.cp (2): model.seq_len (30) must be a multiple of 2 x cp = 4"),
    (8, {"cp": 2, "tp": 4}, {"seq_len": 36}, "train.parallel.tp (4) must divide model.seq_len (36) / cp (2)"),
])
def test_bad_layouts_fail_at_config_load_naming_the_field(world, parallel, model, message):
    with pytest.raises(pydantic.ValidationError, match=re.escape(message)):
        layout_cfg(world, train={"parallel": parallel}, model=model)



def test_shorthands_resolve_to_layouts():
    ddp = ParallelDims.from_config(layout_cfg(4, train={"parallelism": "ddp"}))
    assert ddp.legacy_ddp and (ddp.dp_replicate, ddp.dp_shard) == (4, 1) and ddp.describe() == "ddp x4"
    fsdp = ParallelDims.from_config(layout_cfg(4, train={"parallelism": "fsdp2"}))
    assert not fsdp.legacy_ddp and (fsdp.dp_shard, fsdp.tp) == (4, 1) and fsdp.describe() == "dp_shard 4"
    # any explicit dimension uses the mesh, whatever the shorthand says
    mixed = ParallelDims.from_config(layout_cfg(4, train={"parallelism": "ddp", "parallel": {"tp": 2}}))
    assert not mixed.legacy_ddp and (mixed.dp_shard, mixed.tp) == (2, 2)
    assert mixed.global_batch(layout_cfg(4).train, LAYOUT_MODEL["seq_len"]) == (8, 2)  # 8 samples over 2 dp ranks
