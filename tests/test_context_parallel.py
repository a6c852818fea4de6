"""Context parallelism (train.parallel.cp, tasks/train/context_parallel.py) against one process: real
4-process torchrun runs (gloo, CPU, fp32) whose first 10 steps' losses equal the 1-process run on the
same global batch within 1e-4 relative and whose grad norms agree within 1e-3 (tests/layout_helpers.py):
a mixture of experts under cp 2 x dp_shard 2 x ep 2 (tests/test_moe.py's model, whose Switch aux loss,
router z-loss and bias updates all depend on the tokens routed: the same tokens per expert as one
process in every step and layer), and a dense model under cp 2 x tp 2 with selective checkpointing.

Each run also proves cp was on: every rank's layout record holds its load-balanced slice of the
sequence (chunks i and 2 cp - 1 - i: half the positions, disjoint between the cp ranks of a replica,
together the whole sequence), so a run that left the sequences whole would fail; and attention that
did not gather the other ranks' keys and values would not reach the 1-process losses.
A checkpoint saved under cp 2 x dp_shard 2 x ep 2 resumes in one process where the 1-process run was.
"""
from __future__ import annotations

import pytest

from layout_helpers import (GLOBAL_SAMPLES, LAYOUT_MODEL, assert_matches_reference, copy_at_step, reference_run,
                            run_layout)
from tasks.train.checkpoint import read_meta
from test_moe import E, MOE_MODEL, MOE_TRAIN

SEQ = LAYOUT_MODEL["seq_len"]
SAVE_STEP = MOE_TRAIN["checkpoint_every"]


def assert_context_parallel(layout: dict, cp: int) -> None:
    """Every rank attends from its own cp slice: chunks c and 2 cp - 1 - c of the sequence (c its cp
    coordinate), seq_len / cp positions; the cp ranks of one replica (same dp, tp and pp coordinates)
    hold disjoint slices that make up the whole sequence, and read the same samples."""
    assert layout["dims"]["cp"] == cp and layout["context_parallel"]["local_seq_len"] == SEQ // cp
    chunk = SEQ // (2 * cp)
    replicas: dict[tuple, list[int]] = {}
    for r in layout["ranks"]:
        rec, c = r["context_parallel"], r["coords"]["cp"]
        assert (rec["cp"], rec["cp_rank"], rec["local_seq_len"]) == (cp, c, SEQ // cp), rec
        want = [*range(c * chunk, (c + 1) * chunk), *range((2 * cp - 1 - c) * chunk, (2 * cp - c) * chunk)]
        held = [pos for start, stop in rec["position_runs"] for pos in range(start, stop)]
        assert held == want, rec
        key = (r["dp_rank"], r["coords"]["tp"], r["coords"]["pp"])
        replicas.setdefault(key, []).extend(held)
    for positions in replicas.values():
        assert sorted(positions) == list(range(SEQ))
    # FSDP2 shards every parameter over dp_shard x cp (experts under ep: over the cp ranks holding them)
    for r in layout["ranks"]:
        for name, p in r["params"].items():
            dims = dict(zip(p["mesh_dims"], p["placements"]))
            assert "R" != dims.get("dp_shard_cp", dims.get("dp_shard_mod_ep_cp", "R")), (name, p)


def test_cp_2_dp_shard_2_ep_2_moe_matches_one_process_and_resumes_in_one(base, tmp_path):
    ref = reference_run(base, train=MOE_TRAIN, model=MOE_MODEL).rows  # tests/test_moe.py's, cached
    parallel = {"dp_shard": 2, "cp": 2, "ep": 2}
    run = run_layout(base, 4, train={**MOE_TRAIN, "parallel": parallel}, model=MOE_MODEL)
    assert_matches_reference(run.rows, ref)
    for r, q in zip(run.rows, ref):  # the same routing: the cp ranks' slices add up to the batch's tokens
        for layer in (1, 3):
            assert [r[f"moe/layer{layer}/tokens_e{j}"] for j in range(E)] == \
                   [q[f"moe/layer{layer}/tokens_e{j}"] for j in range(E)], r["step"]
    assert_context_parallel(run.layout, 2)
    assert sorted({r["dp_rank"] for r in run.layout["ranks"]}) == [0, 1]  # two replicas' slices of each batch
    assert "layout dp_shard 2 x cp 2 x ep 2" in run.log
    for rank in run.layout["ranks"]:  # experts split over ep, then FSDP over the cp ranks holding the same ones
        rec = rank["params"]["blocks.1.mlp.experts.w1"]
        placements = dict(zip(rec["mesh_dims"], rec["placements"]))
        assert placements["ep"] == "S(0)" and placements["dp_shard_mod_ep_cp"] != "R", rec
        assert rec["local_shape"][0] * 4 == E, rec
    # the step-5 checkpoint resumes in one process: steps 6-10 are the 1-process run's
    ckpt = [c for c in run.checkpoints if read_meta(c)["step"] == SAVE_STEP]
    assert ckpt and read_meta(ckpt[0])["layout"]["cp"] == 2
    out = copy_at_step(run.out_dir, tmp_path / "resumed", SAVE_STEP)
    resumed = run_layout(base, 1, train={**MOE_TRAIN, "resume": True}, model=MOE_MODEL, out_dir=out, name="resumed")
    assert f"at step {SAVE_STEP}, data position {SAVE_STEP * GLOBAL_SAMPLES}" in resumed.log
    assert_matches_reference(resumed.rows, ref)


@pytest.mark.parametrize("parallel, extra", [
    ({"cp": 2, "tp": 2}, {"activation_checkpointing": "selective", "doc_mask": True}),
    ({"pp": 2, "cp": 2, "dp_shard": 1, "pp_microbatches": 2}, {}),
], ids=["cp2_tp2_selective_doc_mask", "pp2_cp2"])
def test_cp_with_tp_or_pp_matches_one_process(base, parallel, extra):
    """cp with tensor (+ sequence) parallelism and packed-sequence document masks: each tp rank's heads
    attend over the K/V its cp peers gathered, within each document, the residual stream holds
    1 / (cp x tp) of the sequence; with a pipeline (1f1b): each stage's attention gathers over cp, the
    stages hold disjoint layers."""
    run = run_layout(base, 4, train={"parallel": parallel, **extra})
    ref = reference_run(base, train=extra).rows  # the 1-process run with the same doc_mask
    assert_matches_reference(run.rows, ref)
    if extra.get("doc_mask"):  # the masks mattered: some batch crossed a document boundary
        assert any(r["loss"] != q["loss"] for r, q in zip(ref, reference_run(base).rows))
    assert_context_parallel(run.layout, 2)
    assert {r["dp_rank"] for r in run.layout["ranks"]} == {0}  # one replica: the other dims split its sequences
    r0 = next(r for r in run.layout["ranks"] if r["rank"] == 0)
    if parallel.get("tp"):
        wq = r0["params"]["blocks.0.attn.wq.weight"]
        assert dict(zip(wq["mesh_dims"], wq["placements"]))["tp"] == "S(0)"
        assert all(b["selective"] for b in r0["blocks"].values())
    else:
        stages = [st["layers"] for rank in run.layout["pipeline"]["ranks"] for st in rank["stages"]]
        assert sorted(sum(stages, [])) == list(range(LAYOUT_MODEL["n_layer"])) and all(len(st) == 2 for st in stages)
