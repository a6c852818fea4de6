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
    ({"cp": 2, "tp": 2}, {}),
    ({"pp": 2, "cp": 2, "dp_shard": 1, "pp_microbatches": 2}, {}),
], ids=["cp2_tp2_selective_doc_mask", "cp2_tp2", "pp2_cp2"])
def test_cp_with_tp_or_pp_matches_one_process(base, parallel, extra):
    """cp with tensor (+ sequence) parallelism, with packed-sequence document masks (the boolean-mask
    path) and without (the lower-right key-prefix path): each tp rank's heads attend over the K/V its
    cp peers gathered (within each document), the residual stream holds
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
        assert all(b["selective"] for b in r0["blocks"].values()) == bool(extra.get("activation_checkpointing"))
    else:
        stages = [st["layers"] for rank in run.layout["pipeline"]["ranks"] for st in rank["stages"]]
        assert sorted(sum(stages, [])) == list(range(LAYOUT_MODEL["n_layer"])) and all(len(st) == 2 for st in stages)


def _attend_both_paths(rank: int, world: int, init: str) -> None:
    """One cp rank: ContextParallel.attend on its slice of a whole-sequence q, k, v, by the chunked
    lower-right path and by the boolean-mask path, against 1-process causal attention (outputs and
    the q, k, v gradients, the K/V ones summed back from every rank by the all-gather's backward)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.attention.bias import CausalBias
    from torch.overrides import TorchFunctionMode

    from tasks.train.context_parallel import ContextParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        seq, chunk = 16, 16 // (2 * world)
        cp = ContextParallel(dist.group.WORLD, seq)
        gen = torch.Generator().manual_seed(0)
        q, k, v, w = (torch.randn(2, 3, seq, 8, generator=gen) for _ in range(4))  # the same on every rank
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = F.scaled_dot_product_attention(*whole, is_causal=True)
        (ref * w).sum().backward()
        pos = cp.positions

        def run(**kw):
            local = [t.index_select(2, pos).requires_grad_() for t in (q, k, v)]
            y = cp.attend(*local, **kw)
            (y * w.index_select(2, pos)).sum().backward()
            return y, [t.grad for t in local]

        calls = []  # every SDPA call's query and key lengths and its mask

        class RecordAttention(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is F.scaled_dot_product_attention:
                    calls.append((args[0].size(2), args[1].size(2), kwargs.get("attn_mask")))
                return func(*args, **kwargs)

        with RecordAttention():
            y, grads = run()
        assert "mask" not in vars(cp), "the (local, seq_len) boolean mask was built"
        # one call per query chunk (global chunks rank and 2 cp - 1 - rank), over its key prefix only
        want = [(chunk, (a + 1) * chunk) for a in (rank, 2 * world - 1 - rank)]
        assert [(n_q, n_k) for n_q, n_k, _ in calls] == want, calls
        assert all(isinstance(m, CausalBias) and (m.seq_len_q, m.seq_len_kv) == (n_q, n_k)
                   for n_q, n_k, m in calls), calls
        torch.testing.assert_close(y, ref.index_select(2, pos), rtol=1e-5, atol=1e-6)
        for g, t in zip(grads, whole):
            torch.testing.assert_close(g, t.grad.index_select(2, pos), rtol=1e-5, atol=1e-6)
        # the boolean-mask path (what doc_mask takes), given the plain causal mask: the same numbers
        calls.clear()
        with RecordAttention():
            y_mask, grads_mask = run(mask=cp.on("mask", q.device))
        # one call over the whole gathered sequence with the boolean (local, seq_len) mask
        assert [(n_q, n_k, m.dtype, tuple(m.shape)) for n_q, n_k, m in calls] == \
               [(2 * chunk, seq, torch.bool, (2 * chunk, seq))], calls
        torch.testing.assert_close(y_mask, y, rtol=1e-5, atol=1e-6)
        for a, b in zip(grads_mask, grads):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_takes_the_lower_right_prefix_path(world, tmp_path):
    """Without document masks every cp rank attends per query chunk over its key prefix with
    torch's lower-right CausalBias (flash / efficient SDPA kernels on GPU): no (local, seq_len)
    boolean mask is built and the keys past a chunk are not multiplied; outputs and gradients
    (through the K/V all-gather's reduce-scatter) equal 1-process causal attention and the
    boolean-mask path (gloo, `world` processes)."""
    import torch.multiprocessing as mp

    mp.start_processes(_attend_both_paths, args=(world, (tmp_path / "init").as_uri()), nprocs=world,
                       start_method="spawn")


def _compiled_blocks_under_cp(rank: int, world: int, init: str) -> None:
    """One cp rank: two transformer blocks sharing one ContextParallel (as apply_cp installs it),
    each torch.compile'd (backend "eager": Dynamo's tracing and guards, no codegen), run forward and
    backward several times with recompilation an error: attend must keep no Python state that
    Dynamo guards on (a per-call counter made every call recompile, then fall back to eager)."""
    import torch
    import torch._dynamo
    import torch.distributed as dist

    from tasks.train.context_parallel import ContextParallel
    from tasks.train.model import Block, GPTConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16)
        cp = ContextParallel(dist.group.WORLD, cfg.seq_len)
        blocks = [Block(cfg, i) for i in range(cfg.n_layer)]
        for b in blocks:
            b.attn.context_parallel = cp
            b.compile(backend="eager")
        half = cfg.head_dim // 2
        cos, sin = torch.ones(cp.local_len, half), torch.zeros(cp.local_len, half)
        torch._dynamo.reset()
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(4):
                x = torch.randn(2, cp.local_len, cfg.d_model, requires_grad=True)
                h = x
                for b in blocks:
                    h = b(h, cos, sin)
                h.sum().backward()
                assert x.grad is not None and torch.isfinite(x.grad).all()
    finally:
        dist.destroy_process_group()


def test_cp_attention_compiles_once(tmp_path):
    """With train.compile and cp, the compiled blocks keep their graphs across calls (no recompile,
    no silent fall-back to eager), 2 gloo processes."""
    import torch.multiprocessing as mp

    mp.start_processes(_compiled_blocks_under_cp, args=(2, (tmp_path / "init").as_uri()), nprocs=2,
                       start_method="spawn")
