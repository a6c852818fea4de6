"""Mixture of experts (tasks/train/moe.py) and expert parallelism (tasks/train/expert_parallel.py).

Single process: the layer against a naive per-token loop (dropless top-k routing, weights from the
unbiased scores, shared experts), the selection bias, the bias update, the aux and z losses (in the
gradient only), activation-checkpoint recomputation, inference paths, active parameters and FLOPs.
Distributed (real 4-process torchrun training, gloo): ep 1, 2, 4 against one process.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tasks.train.flops import flops_per_token
from tasks.train.model import GPT, GPTConfig, KVCache, SwiGLU
from tasks.train.moe import MoE, MoEArgs, balance_experts, moe_metrics, set_moe_loss_scale

D, H = 16, 24


def make_moe(seed: int = 0, dtype=torch.float64, **options) -> MoE:
    args = MoEArgs(**{"n_experts": 4, "top_k": 2, **options})
    torch.manual_seed(seed)
    moe = MoE(D, H, args)
    for p in moe.parameters():  # the model's init is tested with the model; here any spread will do
        torch.nn.init.normal_(p, std=0.3)
    return moe.to(dtype)


def naive(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer token by token: scores, top-k of scores + bias, weights from the plain scores."""
    a = moe.args
    out = torch.zeros_like(x)
    for t in range(x.size(0)):
        logits = moe.router.weight @ x[t]
        s = torch.sigmoid(logits) if a.score_func == "sigmoid" else torch.softmax(logits, -1)
        chosen = sorted(range(moe.n_experts), key=lambda e: -(s[e] + moe.expert_bias[e]).item())[:moe.top_k]
        w = s[chosen] / (s[chosen].sum() if a.route_norm else 1)
        for wk, e in zip(w, chosen):
            ex = moe.experts
            out[t] += wk * (ex.w2[e] @ (F.silu(ex.w1[e] @ x[t]) * (ex.w3[e] @ x[t])))
        if moe.shared is not None:
            out[t] += moe.shared(x[t])
    return out


@pytest.mark.parametrize("options", [{}, {"score_func": "sigmoid", "n_shared_experts": 2},
                                     {"route_norm": False, "top_k": 3}])
def test_layer_equals_a_per_token_loop(options):
    moe = make_moe(**options).eval()
    x = torch.randn(40, D, dtype=torch.float64)
    torch.testing.assert_close(moe(x), naive(moe, x), rtol=1e-10, atol=1e-12)
    # (B, T, C) as the model and the KV-cached inference call it
    torch.testing.assert_close(moe(x.view(4, 10, D)), naive(moe, x).view(4, 10, D), rtol=1e-10, atol=1e-12)


def test_dropless_routing_every_token_reaches_top_k_experts():
    moe = make_moe().train()
    moe.expert_bias[2] = 10.0  # every token wants expert 2: no capacity limit may drop any of them
    x = torch.randn(64, D, dtype=torch.float64)
    _, _, chosen, _ = moe.route(x)
    assert (chosen[:, 0] == 2).all()
    assert all(len(set(row.tolist())) == moe.top_k for row in chosen)  # k distinct experts per token
    out = moe(x)
    assert moe.tokens_per_expert[2] == 64 and moe.tokens_per_expert.sum() == 64 * moe.top_k
    torch.testing.assert_close(out, naive(moe, x), rtol=1e-10, atol=1e-12)


def test_one_expert_is_the_dense_swiglu():
    """n_experts 1, top_k 1: every token through the one expert at weight 1 = a dense SwiGLU."""
    moe = make_moe(n_experts=1, top_k=1).eval()
    dense = SwiGLU(D, H).to(torch.float64)
    with torch.no_grad():
        dense.w1.weight.copy_(moe.experts.w1[0])
        dense.w3.weight.copy_(moe.experts.w3[0])
        dense.w2.weight.copy_(moe.experts.w2[0])
    x = torch.randn(2, 8, D, dtype=torch.float64)
    torch.testing.assert_close(moe(x), dense(x), rtol=1e-12, atol=1e-12)


def test_bias_steers_selection_but_not_the_weights():
    moe = make_moe()
    x = torch.randn(32, D, dtype=torch.float64)
    _, scores, chosen0, w0 = moe.route(x)
    moe.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 5.0], dtype=torch.float64))
    _, scores1, chosen1, w1 = moe.route(x)
    assert not torch.equal(chosen0, chosen1) and (chosen1 == 3).any(dim=1).all()
    torch.testing.assert_close(scores, scores1)  # the bias never enters the scores
    picked = scores.gather(1, chosen1)
    torch.testing.assert_close(w1, picked / picked.sum(-1, keepdim=True))


def test_bias_update_moves_towards_balance():
    moe = make_moe(bias_update_rate=0.1).train()
    moe.expert_bias[0] = 1.0  # expert 0 starts overloaded
    x = torch.randn(128, D, dtype=torch.float64)
    with torch.no_grad():
        moe(x)
    first = balance_experts([moe])
    assert moe.tokens_per_expert.sum() == 0  # counts reset
    assert first[0]["tokens"][0] == max(first[0]["tokens"]) and first[0]["imbalance"] > 1.5
    assert moe.expert_bias[0] < 1.0 and moe.expert_bias.sum().abs() < 1.0 + 1e-9  # loaded expert down, centred
    for _ in range(15):
        with torch.no_grad():
            moe(x)
        last = balance_experts([moe])
    assert last[0]["imbalance"] < 1.25 < 1.5 < first[0]["imbalance"]
    metrics = moe_metrics(last)
    assert set(metrics) == {"moe/layer0/imbalance"} | {f"moe/layer0/tokens_e{j}" for j in range(4)}
    # a skipped batch: counts reset, bias kept
    bias = moe.expert_bias.clone()
    with torch.no_grad():
        moe(x)
    balance_experts([moe], update_bias=False)
    assert torch.equal(bias, moe.expert_bias) and moe.tokens_per_expert.sum() == 0


def test_aux_and_z_losses_change_gradients_not_the_output():
    x = torch.randn(48, D, dtype=torch.float64)
    g = torch.randn(48, D, dtype=torch.float64)
    plain = make_moe().train()
    lossy = make_moe(aux_loss=0.1, router_z_loss=0.01).train()
    set_moe_loss_scale([lossy], 0.5)  # as with 2 micro-batches
    out_plain, out_lossy = plain(x), lossy(x)
    assert torch.equal(out_plain, out_lossy)  # the forward value is the layer's output alone
    (out_plain * g).sum().backward()
    (out_lossy * g).sum().backward()
    assert not torch.allclose(plain.router.weight.grad, lossy.router.weight.grad)
    # the extra gradient is exactly that of 0.5 x (aux + z), computed by hand
    ref = make_moe().train()
    logits = x @ ref.router.weight.T
    probs = torch.softmax(logits, -1)
    chosen = torch.topk(probs, 2, dim=-1).indices
    f = torch.bincount(chosen.flatten(), minlength=4).double() / (48 * 2)
    extra = 0.1 * 4 * (f * probs.mean(0)).sum() + 0.01 * torch.logsumexp(logits, -1).pow(2).mean()
    ((ref(x) * g).sum() + 0.5 * extra).backward()
    torch.testing.assert_close(lossy.router.weight.grad, ref.router.weight.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lossy.experts.w1.grad, plain.experts.w1.grad)  # experts: no aux gradient


def test_only_training_forwards_count_tokens():
    """Activation checkpointing's recomputation and forwards under `uncounted` (a pipeline stage's
    shape inference) add nothing; an eval forward neither."""
    from torch.utils.checkpoint import checkpoint

    from tasks.train.moe import uncounted

    moe = make_moe(aux_loss=0.1).train()
    x = torch.randn(30, D, dtype=torch.float64, requires_grad=True)
    checkpoint(moe, x, use_reentrant=False).sum().backward()
    assert moe.tokens_per_expert.sum() == 30 * moe.top_k
    assert moe.router.weight.grad is not None
    with uncounted():
        moe(x).sum().backward()
    moe.eval()
    moe(x)
    assert moe.tokens_per_expert.sum() == 30 * moe.top_k


def tiny_moe(**moe) -> GPTConfig:
    return GPTConfig(vocab_size=64, n_layer=4, n_head=2, d_model=32, seq_len=16,
                     moe={"n_experts": 4, "top_k": 2, "every_n_layers": 2, **moe})


def test_model_layers_config_round_trip_and_inference():
    cfg = tiny_moe(n_shared_experts=1)
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    assert [type(b.mlp).__name__ for b in model.blocks] == ["SwiGLU", "MoE", "SwiGLU", "MoE"]
    assert "blocks.1.mlp.expert_bias" in model.state_dict()  # persistent: checkpoints carry it
    assert "blocks.1.mlp.tokens_per_expert" not in model.state_dict()
    assert model.blocks[1].mlp.experts.w2.shape == (4, 32, cfg.mlp_hidden)
    # checkpoint meta: the moe section round-trips; a meta from before MoE is dense
    meta = cfg.to_dict()
    assert GPTConfig(**meta) == cfg and isinstance(meta["moe"], dict)
    old = {k: v for k, v in meta.items() if k != "moe"}
    assert GPTConfig(**old).moe.n_experts == 0
    with pytest.raises(ValueError, match="unknown option"):
        GPTConfig(**{**meta, "moe": {**meta["moe"], "capacity_factor": 1.25}})
    # same seed, same weights; KV-cached prefill / decode_step reach the same logits as forward
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(GPT(cfg).state_dict().values(), model.state_dict().values()))
    idx = torch.randint(0, 64, (1, 9))
    full, _ = model(idx)
    cache = KVCache(cfg)
    torch.testing.assert_close(model.prefill(idx[:, :8], cache), full[:, 7], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.decode_step(idx[0, 8:9], [cache]), full[:, 8], rtol=1e-5, atol=1e-5)


def test_bf16_autocast_and_a_bf16_model():
    """DDP's bf16 autocast (fp32 weights, bf16 matmuls) trains; a model cast to bf16 still counts
    tokens exactly (an integer buffer: bf16 holds whole numbers only up to 256)."""
    cfg = tiny_moe(n_shared_experts=1, aux_loss=0.01)
    model = GPT(cfg)
    idx = torch.randint(0, 64, (4, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, loss = model(idx, idx)
    loss.backward()
    assert logits.dtype == torch.bfloat16 and model.blocks[1].mlp.experts.w1.grad is not None
    model = GPT(cfg).to(torch.bfloat16)
    for _ in range(3):
        model(idx)
    assert model.blocks[1].mlp.tokens_per_expert.sum() == 3 * 4 * 16 * 2


def test_config_fields_match():
    """MoEArgs carries exactly the pipeline config's model.moe fields (a new option must reach the model)."""
    from tasks.config import MoEConfig

    assert set(MoEConfig.model_fields) == set(MoEArgs().to_dict())
    assert MoEArgs.of(MoEConfig(n_experts=8, top_k=2)).n_experts == 8


def test_active_params_and_flops():
    cfg = tiny_moe(n_shared_experts=1)
    model = GPT(cfg)
    dense = GPT(GPTConfig(vocab_size=64, n_layer=4, n_head=2, d_model=32, seq_len=16))
    assert dense.num_active_params() == dense.num_matmul_params()
    per_expert = 3 * 32 * cfg.mlp_hidden
    # 2 MoE layers, each 4 experts of which a token uses 2
    assert model.num_matmul_params() - model.num_active_params() == 2 * 2 * per_expert
    # an MoE layer with top_k routed + shared experts costs what its active matrices cost
    moe_layer = 32 * 4 + 2 * per_expert + per_expert  # router + 2 routed + 1 shared
    dense_layer = per_expert
    assert model.num_active_params() - dense.num_active_params() == 2 * (moe_layer - dense_layer)
    n = model.num_active_params()
    assert flops_per_token(n, 4, 2, 16, 16) == 6 * n + 12 * 4 * 32 * 16
    assert not math.isclose(flops_per_token(model.num_matmul_params(), 4, 2, 16, 16), flops_per_token(n, 4, 2, 16, 16))


# ---------------------------------------------------------------------- distributed (4 processes)

# layers 1 and 3 sparse: 4 experts, top 2, one shared; both router losses on, bias moving; untied
# head so the pipeline layout can share the 1-process reference
MOE_MODEL = {"tie_embeddings": False,
             "moe": {"n_experts": 4, "top_k": 2, "every_n_layers": 2, "n_shared_experts": 1, "expert_hidden": 64,
                     "aux_loss": 0.01, "router_z_loss": 0.001, "bias_update_rate": 1e-3}}
MOE_TRAIN = {"checkpoint_every": 5}
E = MOE_MODEL["moe"]["n_experts"]
MOE_LAYOUTS = {"ep1": {"dp_shard": 4, "ep": 1}, "ep2": {"dp_shard": 4, "ep": 2}, "ep4": {"dp_shard": 4, "ep": 4},
               "pp2_ep2": {"pp": 2, "dp_shard": 2, "ep": 2}}


@pytest.fixture(scope="module")
def moe_ref(base):
    from layout_helpers import reference_run

    return reference_run(base, train=MOE_TRAIN, model=MOE_MODEL)


MLFLOW_LAYOUT = "pp2_ep2"  # the run that also logs to MLflow: rank 0 holds layer 1 only, layer 3 comes over pp


def _moe_run(base, layout: str):
    from layout_helpers import run_layout

    return run_layout(base, 4, train={**MOE_TRAIN, "parallel": MOE_LAYOUTS[layout]}, model=MOE_MODEL,
                      mlflow=layout == MLFLOW_LAYOUT)


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_expert_parallel_training_equals_one_process(base, moe_ref, layout, monkeypatch):
    """ep 1, 2, 4 on 4 ranks (dp_shard 4; the experts FSDP-sharded over the dp_shard / ep ranks left)
    and pp 2 x dp_shard 2 x ep 2: 10 steps' losses within 1e-4 and grad norms within 1e-3 of one
    process, the same tokens per expert in every layer (so the same selection bias; under pp the other
    stage's layer comes over the pp group), experts really sharded over the ep mesh, tokens really sent;
    the pp run's per-layer metrics reach MLflow."""
    from layout_helpers import assert_matches_reference

    dims = MOE_LAYOUTS[layout]
    run = _moe_run(base, layout)
    assert_matches_reference(run.rows, moe_ref.rows)
    for r, q in zip(run.rows, moe_ref.rows):
        for layer in (1, 3):
            assert [r[f"moe/layer{layer}/tokens_e{j}"] for j in range(E)] == \
                   [q[f"moe/layer{layer}/tokens_e{j}"] for j in range(E)], r["step"]
            assert r[f"moe/layer{layer}/imbalance"] == q[f"moe/layer{layer}/imbalance"] >= 1.0
    held = 0
    for rank in run.layout["ranks"]:
        for layer in (1, 3):
            rec = rank["params"].get(f"blocks.{layer}.mlp.experts.w1")
            if rec is None:  # another pipeline stage's layer
                assert dims.get("pp", 1) > 1
                continue
            held += 1
            # each rank holds E / dp_shard expert rows: split over ep, then FSDP over dp_shard / ep
            assert rec["local_shape"][0] * dims["dp_shard"] == E, rec
            if dims["ep"] == 1:
                assert "ep" not in rec["mesh_dims"], rec
            else:
                assert rec["dtensor"] and rec["placements"][rec["mesh_dims"].index("ep")] == "S(0)", rec
    assert held == 2 * 4 // dims.get("pp", 1)
    sent = [r[f"moe/layer{layer}/ep_sent"] for r in run.rows for layer in (1, 3) if f"moe/layer{layer}/ep_sent" in r]
    if dims["ep"] == 1:
        assert not sent
    else:  # logged for every step and layer; token rows went to other ep ranks (not necessarily in
        # every step: a layer whose routing collapsed onto rank 0's experts sends nothing)
        assert len(sent) == 20 and sum(sent) > 100
    if layout == MLFLOW_LAYOUT:  # every sparse layer's per-step metrics reach MLflow, as logged
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # the run's file store (layout_helpers)
        _assert_moe_metrics_in_mlflow(run)


def _assert_moe_metrics_in_mlflow(run) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=run.mlflow["tracking_uri"])
    for layer in (1, 3):
        for key in [f"moe/layer{layer}/imbalance", f"moe/layer{layer}/ep_sent"] + \
                   [f"moe/layer{layer}/tokens_e{j}" for j in range(E)]:
            got = {m.step: m.value for m in client.get_metric_history(run.mlflow["run_id"], key)}
            assert got == pytest.approx({r["step"]: r[key] for r in run.rows}), key


def test_expert_parallel_checkpoint_resumes_under_another_ep(base, moe_ref, tmp_path):
    """The ep 2 run's step-5 checkpoint (expert shards written by every rank) resumed under dp_shard 4 x
    ep 4 (other expert rows on every rank): steps 6-10 equal the 1-process run's, and the step-10 weights
    (loaded into one process) and expert biases equal its too."""
    from layout_helpers import assert_matches_reference, copy_at_step, run_layout
    from tasks.train import load_model_for_inference
    from tasks.train.checkpoint import checkpoint_dir, read_meta

    saved = _moe_run(base, "ep2")
    out = copy_at_step(saved.out_dir, tmp_path / "resumed", 5)
    meta = read_meta(checkpoint_dir(out, 5))
    assert meta["model"]["moe"] == {**meta["model"]["moe"], **MOE_MODEL["moe"]}
    assert meta["layout"]["ep"] == 2
    run = run_layout(base, 4, train={**MOE_TRAIN, "parallel": MOE_LAYOUTS["ep4"], "resume": True}, model=MOE_MODEL,
                     out_dir=out, name="resumed")
    assert "at step 5" in run.log
    assert_matches_reference(run.rows, moe_ref.rows)
    assert read_meta(checkpoint_dir(out, 10))["layout"]["ep"] == 4
    mine, _ = load_model_for_inference(checkpoint_dir(out, 10))
    theirs, _ = load_model_for_inference(checkpoint_dir(moe_ref.out_dir, 10))
    bias = mine.blocks[1].mlp.expert_bias
    assert bias.abs().sum() > 0  # the bias moved (and was restored: 10 steps of updates, not 5)
    for (name, a), b in zip(mine.state_dict().items(), theirs.state_dict().values()):
        if name.endswith("expert_bias"):
            assert torch.equal(a, b), name
        else:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=name)
