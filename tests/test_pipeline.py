"""Pipeline parallelism (train.parallel.pp, tasks/train/pipeline.py): how the model is split into
stages, the config refusals, and real 4-process torchrun runs (gloo, fp32) whose first 10 steps
match a 1-process run on the same global batch, for each schedule and with tensor parallelism; a
checkpoint saved by a pipelined run resumes in one process."""
from __future__ import annotations

import pytest
import torch

from tasks.train.model import GPT, GPTConfig
from tasks.train.pipeline import AbsentBlock, GPTStage, split_model, stage_layout

TINY = GPTConfig(vocab_size=61, n_layer=4, n_head=4, d_model=32, seq_len=16, tie_embeddings=False)


def _names(module: torch.nn.Module) -> set[str]:
    return {n for n, _ in module.named_parameters()}


@pytest.mark.parametrize("stages_per_rank", [1, 2])
def test_stages_hold_disjoint_layers_named_as_in_the_full_model(stages_per_rank):
    """Each pp rank's stages hold other layers than every other rank's, under the full model's
    parameter names, together exactly the full model; run in stage order they compute its logits."""
    torch.manual_seed(0)
    model = GPT(TINY)
    full = _names(model)
    idx = torch.randint(0, TINY.vocab_size, (3, TINY.seq_len))
    with torch.no_grad():
        want = model(idx)[0]
    pp, by_rank, stages = 2, [], {}
    for rank in range(pp):
        parts = split_model(model, rank, pp, stages_per_rank)
        by_rank.append(set().union(*(_names(p) for _, p in parts)))
        stages.update(parts)
    assert not by_rank[0] & by_rank[1]
    assert by_rank[0] | by_rank[1] == full
    n_stages = pp * stages_per_rank
    assert sorted(stages) == list(range(n_stages))
    # loop assignment: stage s on rank s % pp, each an even contiguous slice of the blocks
    layout = stage_layout(pp, stages_per_rank, TINY.n_layer)
    per = TINY.n_layer // n_stages
    for rec in layout:
        for st in rec["stages"]:
            assert st["stage"] % pp == rec["pp_rank"]
            assert st["layers"] == list(range(st["stage"] * per, (st["stage"] + 1) * per))
            assert stages[st["stage"]].layers == st["layers"]
    assert stages[0].is_first and "tok_emb.weight" in _names(stages[0])
    assert stages[n_stages - 1].is_last and {"norm.weight", "lm_head.weight"} <= _names(stages[n_stages - 1])
    for s, stage in stages.items():
        absent = [i for i, b in enumerate(stage.blocks) if isinstance(b, AbsentBlock)]
        assert absent == [i for i in range(TINY.n_layer) if i not in stage.layers]
        assert all(not list(stage.blocks[i].parameters()) for i in absent)
    h = idx
    with torch.no_grad():
        for s in range(n_stages):
            h = stages[s](h)
    torch.testing.assert_close(h, want, rtol=0, atol=0)


def test_a_stage_never_runs_a_layer_it_does_not_hold():
    stage = split_model(GPT(TINY), 0, 2, 1)[0][1]
    assert isinstance(stage, GPTStage)
    with pytest.raises(RuntimeError, match="does not hold"):
        stage.blocks[TINY.n_layer - 1](torch.zeros(1, 2, TINY.d_model))


@pytest.mark.parametrize("model, parallel, field", [
    ({"n_layer": 3}, {"pp": 2}, "model.n_layer"),
    ({"n_layer": 4}, {"pp": 2, "pp_schedule": "interleaved_1f1b", "pp_microbatches": 4}, None),
    ({"n_layer": 6}, {"pp": 2, "pp_schedule": "interleaved_1f1b"}, "model.n_layer"),
    ({"n_layer": 4}, {"pp": 2, "pp_microbatches": 1}, "train.parallel.pp_microbatches"),
    ({"n_layer": 4}, {"pp": 4, "pp_microbatches": 3}, "train.parallel.pp_microbatches"),
    ({"n_layer": 4, "tie_embeddings": True}, {"pp": 2}, "model.tie_embeddings"),
])
def test_pipeline_layouts_refused_at_config_load_name_the_field(model, parallel, field):
    from pydantic import ValidationError

    from lm_helpers import tiny_cfg

    def cfg():
        return tiny_cfg(model={"tie_embeddings": False, **model},
                        train={"nproc_per_node": 4, "micro_batch_size": 4, "parallel": parallel})
    if field is None:
        cfg()  # the legal neighbour of the refusals: accepted
        return
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        cfg()


def _pipeline_worker(rank: int, init_file: str, results) -> None:
    """One of 2 gloo processes. A pp 2 (1f1b, 2 micro-batches) pipeline of TINY's seeded model trains
    on batches of 4, 8, then 4 sequences; each step's loss and this rank's gradients are compared
    with the whole model's on the same batch. Then an MoE pipeline's first step: the tokens its
    experts counted."""
    import dataclasses

    import torch.distributed as dist

    from tasks.train.model import lm_loss
    from tasks.train.moe import moe_layers
    from tasks.train.parallel_dims import ParallelDims
    from tasks.train.pipeline import build_pipeline

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        dims = ParallelDims(pp=2, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1, world=2,
                            pp_schedule="1f1b", pp_microbatches=2)
        mesh, cpu = dims.build_mesh("cpu"), torch.device("cpu")
        torch.manual_seed(0)
        model, whole = GPT(TINY), GPT(TINY)
        whole.load_state_dict(model.state_dict())
        pipe = build_pipeline(model, dims, mesh, cpu, lambda logits, y: lm_loss(logits, y, 1e-4))
        worst = 0.0
        gen = torch.Generator().manual_seed(1)
        for batch in (4, 8, 4):
            x, y = (torch.randint(0, TINY.vocab_size, (batch, TINY.seq_len), generator=gen) for _ in range(2))
            for m in (*pipe.model_parts, whole):
                m.zero_grad(set_to_none=True)
            got = pipe.step(x, y)
            total, ce, z = lm_loss(whole(x)[0], y, 1e-4)
            total.backward()
            worst = max(worst, abs(got[0].item() - ce.item()) / ce.item(), abs(got[1].item() - z.item()) / z.item())
            grads = dict(whole.named_parameters())
            for part in pipe.model_parts:
                for name, p in part.named_parameters():
                    want = grads[name].grad
                    worst = max(worst, ((p.grad - want).abs().max() / want.abs().max()).item())
        n_schedules = len(pipe._schedules)
        torch.manual_seed(0)
        moe = build_pipeline(GPT(dataclasses.replace(TINY, moe={"n_experts": 4, "top_k": 2})), dims, mesh, cpu,
                             lambda logits, y: lm_loss(logits, y))
        moe.step(*(torch.randint(0, TINY.vocab_size, (4, TINY.seq_len), generator=gen) for _ in range(2)))
        counts = [int(m.tokens_per_expert.sum()) for _, m in moe_layers(moe.model_parts)]
        results[rank] = (worst, n_schedules, counts)
    finally:
        dist.destroy_process_group()


def test_pipeline_step_equals_the_whole_model_as_the_batch_shape_changes(tmp_path):
    """The pipeline's step loss (on every pp rank) and each stage's gradients equal the whole model's
    on the same batch (the loss divides by the micro-batches, the schedule does not scale), also when
    the micro-batch shape changes from one step to the next (a schedule per shape). The stages' shape
    inference (a schedule's first step runs them once more) counts no tokens towards MoE balancing:
    each rank's 2 MoE layers counted the step's 4 x seq_len tokens x top_k 2 slots, once."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.spawn(_pipeline_worker, args=(str(tmp_path / "init"), results), nprocs=2)
    for rank in range(2):
        worst, n_schedules, counts = results[rank]
        assert worst < 1e-5, (rank, worst)
        assert n_schedules == 2  # micro-batches of 2 and of 4 sequences
        assert counts == [4 * TINY.seq_len * 2] * 2, (rank, counts)


# ---------------------------------------------------------------- real pipelined runs (4 processes)

# the embedding and the head live on different stages (untied, as layout_helpers' default: one
# 1-process reference for these and tests/test_layouts.py)
PP_MODEL = {"tie_embeddings": False}
SCHEDULE_CLASSES = {"1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B", "gpipe": "ScheduleGPipe"}
SAVE_STEP = 6  # the 1f1b run also checkpoints here, for the resume in one process


@pytest.fixture(scope="module")
def ref(base):
    from layout_helpers import reference_run

    return reference_run(base, model=PP_MODEL)


def _assert_stages_split_the_model(run, ref, pp_schedule: str, stages_per_rank: int) -> None:
    """From layout.json (read back from the built modules): the pp ranks hold disjoint parameters,
    together exactly the 1-process model's; each holds the layers its stages name; the schedule built
    is the one asked for."""
    pipe = run.layout["pipeline"]
    assert pipe["schedule"] == SCHEDULE_CLASSES[pp_schedule]
    full = set(ref.layout["ranks"][0]["params"])
    by_pp: dict[int, set[str]] = {}
    for rec in run.layout["ranks"]:
        names = set(rec["params"])
        held = by_pp.setdefault(rec["coords"]["pp"], names)
        assert held == names  # the dp / tp ranks of one stage hold the same parameters
    assert sorted(by_pp) == [0, 1]
    assert not by_pp[0] & by_pp[1]
    assert by_pp[0] | by_pp[1] == full
    for rank in pipe["ranks"]:
        assert len(rank["stages"]) == stages_per_rank
        layers = {str(i) for st in rank["stages"] for i in st["layers"]}
        assert {n.split(".")[1] for n in by_pp[rank["pp_rank"]] if n.startswith("blocks.")} == layers
    assert "tok_emb.weight" in by_pp[0] and "lm_head.weight" in by_pp[1]


def _assert_sharded_on(run, mesh_dim: str) -> None:
    """Every rank holds DTensor parameters sharded over `mesh_dim`: that dimension really ran."""
    for rec in run.layout["ranks"]:
        sharded = [n for n, p in rec["params"].items() if p["dtensor"] and mesh_dim in p["mesh_dims"]
                   and any(pl.startswith(("S(", "Shard")) for pl, d in zip(p["placements"], p["mesh_dims"])
                           if d == mesh_dim)]
        assert sharded, f"rank {rec['rank']}: no parameter sharded over {mesh_dim}"


@pytest.mark.parametrize("pp_schedule", ["1f1b", "interleaved_1f1b", "gpipe"])
def test_pp2_dp_shard2_matches_one_process(base, ref, tmp_path, pp_schedule):
    """pp 2 x dp_shard 2 (FSDP2 inside each stage): the first 10 steps' losses and grad norms equal a
    1-process run on the same global batch (1e-4 / 1e-3 relative)."""
    from layout_helpers import assert_matches_reference, run_layout

    train = {"parallel": {"pp": 2, "dp_shard": 2, "pp_schedule": pp_schedule}}
    if pp_schedule == "1f1b":  # also a checkpoint mid-run, for test_pp_checkpoint_resumes_in_one_process
        train["checkpoint_every"] = SAVE_STEP
    run = run_layout(base, 4, train=train, model=PP_MODEL)
    worst = assert_matches_reference(run.rows, ref.rows)
    print(f"pp 2 x dp_shard 2 {pp_schedule}: {worst}")
    _assert_stages_split_the_model(run, ref, pp_schedule, 2 if pp_schedule == "interleaved_1f1b" else 1)
    _assert_sharded_on(run, "dp_shard_cp")


def test_pp2_tp2_matches_one_process(base, ref):
    """pp 2 x tp 2 (tensor and sequence parallel stages; the hidden states cross stages sharded)."""
    from layout_helpers import assert_matches_reference, run_layout

    run = run_layout(base, 4, train={"parallel": {"pp": 2, "tp": 2}}, model=PP_MODEL)
    worst = assert_matches_reference(run.rows, ref.rows)
    print(f"pp 2 x tp 2: {worst}")
    _assert_stages_split_the_model(run, ref, "1f1b", 1)
    _assert_sharded_on(run, "tp")


def test_pp_checkpoint_resumes_in_one_process(base, ref, tmp_path):
    """The pp 2 x dp_shard 2 run's step-6 checkpoint holds the whole model (each pp rank wrote its own
    layers, under the full model's names) and resumes in one process: steps 7-10 equal the 1-process
    run's (weights, AdamW moments and data position restored)."""
    import shutil

    from layout_helpers import GLOBAL_SAMPLES, assert_matches_reference, run_layout
    from tasks.train.checkpoint import checkpoint_tensors, list_checkpoints, read_meta, remove_checkpoint

    saved = run_layout(base, 4, train={"parallel": {"pp": 2, "dp_shard": 2, "pp_schedule": "1f1b"},
                                       "checkpoint_every": SAVE_STEP}, model=PP_MODEL)  # cached by the test above
    out = tmp_path / "resumed"
    shutil.copytree(saved.out_dir, out)
    steps = {read_meta(c)["step"]: c for c in list_checkpoints(out)}
    assert sorted(steps) == [SAVE_STEP, 10]
    remove_checkpoint(steps[10])  # resume from step 6
    ckpt = steps[SAVE_STEP]
    meta = read_meta(ckpt)
    assert meta["layout"]["pp"] == 2 and meta["world_size"] == 4
    assert meta["trainer"]["consumed_samples"] == SAVE_STEP * GLOBAL_SAMPLES
    names = {k.removeprefix("model.") for k in checkpoint_tensors(ckpt) if k.startswith("model.")}
    assert names == set(ref.layout["ranks"][0]["params"])
    run = run_layout(base, 1, train={"resume": True}, model=PP_MODEL, out_dir=out, name="resumed")
    assert f"at step {SAVE_STEP}, data position {SAVE_STEP * GLOBAL_SAMPLES}" in run.log
    assert_matches_reference(run.rows, ref.rows)
    assert read_meta(run.checkpoints[-1])["world_size"] == 1
