"""The scaling-law planner: published figures, MoE rule, layout sanity, cost arithmetic, CLI."""
import json
import math
import shutil
from pathlib import Path

import pytest

from tasks.config import GpuSpec, PipelineConfig, PlanConfig
from tasks.plan import PlanError, estimate_shape, make_plan
from infra.cli.plan import main
from tasks.core.constants import REPO_ROOT


def test_chinchilla_tokens_from_params():
    plan = make_plan(params=7e9)
    assert plan["tokens"] == pytest.approx(1.4e11)
    assert plan["flops_6nd"] == pytest.approx(6 * 7e9 * 1.4e11)


def test_flops_6nd_for_a_7b_model_on_2t_tokens():
    plan = make_plan(params=7e9, tokens=2e12, gpus=256)
    assert plan["flops_6nd"] == pytest.approx(8.4e22)
    assert plan["flops"] > plan["flops_6nd"]  # attention on top


def test_compute_optimal_split_of_a_flop_budget():
    plan = make_plan(flops=1e22)
    assert plan["params"] == pytest.approx(9.13e9, rel=1e-3)  # sqrt(1e22 / 120)
    assert plan["tokens"] == pytest.approx(1.826e11, rel=1e-3)
    assert plan["flops_6nd"] == pytest.approx(1e22)
    assert plan["flops_budget"] == 1e22


def test_flops_with_params_or_tokens_fixes_the_other():
    assert make_plan(params=1e9, flops=1.2e20)["tokens"] == pytest.approx(2e10)
    assert make_plan(flops=1.2e20, tokens=2e10)["params"] == pytest.approx(1e9)


def test_attention_term_follows_palm_appendix_b():
    plan = make_plan(params=1e9, tokens=2e10, n_layer=24, d_model=2048, seq_len=2048)
    per_token = 6 * 1e9 + 12 * 24 * 2048 * 2048
    assert plan["flops"] == pytest.approx(per_token * 2e10)
    assert plan["shape_estimated"] is False


def test_shape_estimate_is_near_known_models():
    n_layer, d_model = estimate_shape(7e9)  # Llama-7B is 32 x 4096
    assert 28 <= n_layer <= 36 and 3840 <= d_model <= 4608 and d_model % 128 == 0
    assert 12 * n_layer * d_model**2 == pytest.approx(7e9, rel=0.1)
    assert estimate_shape(7e9, n_layer=32) == (32, round((7e9 / (12 * 32)) ** 0.5))


def test_moe_active_params_drive_flops_total_params_drive_memory():
    moe = make_plan(params=47e9, active_params=13e9, tokens=1e12, gpus=256)
    dense = make_plan(params=47e9, tokens=1e12, gpus=256)
    assert moe["flops_6nd"] == pytest.approx(6 * 13e9 * 1e12)
    assert moe["checkpoint_bytes"] == dense["checkpoint_bytes"] == pytest.approx(47e9 * 12)
    assert moe["model_state_bytes"] == pytest.approx(47e9 * 16)
    assert moe["seconds"] < dense["seconds"]
    assert make_plan(params=47e9, active_params=13e9)["tokens"] == pytest.approx(20 * 13e9)


def test_checkpoint_bytes_are_weights_and_adam():
    # the trainer's checkpoint: fp32 weights (FSDP2's master copy) + Adam m, v
    assert make_plan(params=7e9)["checkpoint_bytes"] == pytest.approx(7e9 * (4 + 8))
    # a trainer keeping bf16 weights and a separate fp32 master is described by the plan section
    megatron = PlanConfig(weight_bytes=2, grad_bytes=2, master_bytes=4)
    assert make_plan(params=7e9, cfg=megatron)["checkpoint_bytes"] == pytest.approx(7e9 * (2 + 4 + 8))


def test_time_and_cost_arithmetic():
    cfg = PlanConfig(gpus={"testgpu": GpuSpec(peak_bf16_flops=1e15, memory_gb=80, price_per_hour=2.0)})
    plan = make_plan(params=1e9, tokens=2e10, n_layer=24, d_model=2048, seq_len=2048,
                     gpus=8, gpu="testgpu", mfu=0.5, cfg=cfg)
    flops = (6e9 + 12 * 24 * 2048 * 2048) * 2e10  # 1.44159e20
    assert plan["seconds"] == pytest.approx(flops / (8 * 1e15 * 0.5))  # ≈ 36,040 s
    assert plan["days"] == pytest.approx(plan["seconds"] / 86400)
    assert plan["gpu_hours"] == pytest.approx(plan["seconds"] * 8 / 3600)  # ≈ 80.1
    assert plan["cost_usd"] == pytest.approx(plan["gpu_hours"] * 2.0)  # ≈ $160
    assert plan["cost_usd"] == pytest.approx(160.18, abs=0.01)


def test_default_mfu_and_hardware_table():
    plan = make_plan(params=7e9, gpus=64)
    assert plan["mfu"] == 0.4 and plan["gpu"] == "h100" and plan["peak_flops_per_gpu"] == 989e12
    assert make_plan(params=7e9, gpus=64, gpu="A100")["seconds"] == pytest.approx(plan["seconds"] * 989 / 312)


def test_config_extends_the_gpu_table():
    cfg = PipelineConfig.model_validate({
        "name": "x", "sources": [{"name": "a", "uri": "u", "format": "text", "licence": "l", "provenance": "p"}],
        "plan": {"gpus": {"H100": {"price_per_hour": 2.0},
                          "tpu": {"peak_bf16_flops": 459e12, "memory_gb": 95, "price_per_hour": 4.2}}}})
    assert cfg.plan.gpus["h100"].price_per_hour == 2.0 and cfg.plan.gpus["h100"].peak_bf16_flops == 989e12
    assert cfg.plan.gpus["tpu"].memory_gb == 95 and "mi300x" in cfg.plan.gpus


@pytest.mark.parametrize("params,gpus", [(1e9, 8), (7e9, 256), (70e9, 1024), (1e12, 1024), (7e9, 12)])
def test_layout_uses_every_gpu(params, gpus):
    lay = make_plan(params=params, gpus=gpus)["layout"]
    assert lay["tp"] * lay["pp"] * lay["dp"] == gpus
    assert lay["tp"] <= 8 and lay["tp"] & (lay["tp"] - 1) == 0
    assert lay["fits"] and lay["rationale"]


def test_small_model_needs_no_pipeline():
    lay = make_plan(params=1e9, gpus=8)["layout"]
    assert (lay["tp"], lay["pp"], lay["dp"]) == (1, 1, 8)
    assert lay["bubble_fraction"] == 0


def test_trillion_parameter_model_is_pipelined():
    lay = make_plan(params=1e12, gpus=1024)["layout"]
    assert lay["pp"] > 1 and lay["tp"] == 8
    m, pp = lay["microbatches"], lay["pp"]
    assert lay["bubble_fraction"] == pytest.approx((pp - 1) / (m + pp - 1))
    assert "pp=" in lay["rationale"]


def test_too_few_gpus_is_flagged():
    plan = make_plan(params=7e9, gpus=1)
    assert plan["layout"]["fits"] is False
    assert any("does not fit" in a for a in plan["assumptions"])


def test_gpu_count_is_picked_when_missing():
    plan = make_plan(params=7e9)
    assert plan["days"] <= 30 and plan["layout"]["fits"]


@pytest.mark.parametrize("kwargs,match", [
    ({}, "params"),
    ({"tokens": 1e12}, "params"),
    ({"params": -1}, "params"),
    ({"params": 7e9, "gpus": 0}, "gpus"),
    ({"params": 7e9, "gpus": 2.5}, "gpus"),
    ({"params": 7e9, "gpu": "tpu9"}, "unknown gpu"),
    ({"params": 7e9, "mfu": 1.5}, "mfu"),
    ({"params": 7e9, "tokens": 1e12, "flops": 1e22}, "at most two"),
    ({"flops": 1e22, "active_params": 1e9}, "active_params"),
    ({"params": 1e9, "active_params": 2e9}, "exceed"),
    ({"params": float("nan")}, "params"),
])
def test_invalid_input_raises(kwargs, match):
    with pytest.raises(PlanError, match=match):
        make_plan(**kwargs)


def test_cli_json(capsys):
    assert main(["--params", "7e9", "--tokens", "2e12", "--gpus", "256", "--gpu", "h100", "--mfu", "0.45",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["flops_6nd"] == pytest.approx(8.4e22)
    assert plan["gpus"] == 256 and plan["mfu"] == 0.45
    for key in ("params", "active_params", "tokens", "flops", "gpu", "seconds", "days", "gpu_hours",
                "cost_usd", "checkpoint_bytes", "layout", "assumptions"):
        assert key in plan
    assert set(plan["layout"]) >= {"tp", "pp", "dp", "microbatches", "bubble_fraction", "rationale"}
    assert plan["params"] == 7e9 and plan["tokens"] == 2e12 and plan["gpu"] == "h100"
    # time and cost follow from the FLOPs, the GPU's peak and the MFU asked for
    assert plan["seconds"] == pytest.approx(plan["flops"] / (256 * 989e12 * 0.45), rel=1e-6)
    assert plan["gpu_hours"] == pytest.approx(plan["seconds"] * 256 / 3600, rel=1e-6)
    assert plan["cost_usd"] == pytest.approx(plan["gpu_hours"] * 3.0, rel=1e-6)  # the default $3/GPU-hour
    assert plan["checkpoint_bytes"] == pytest.approx(12 * 7e9)  # fp32 weights (the master) + Adam m, v
    layout = plan["layout"]
    assert layout["tp"] * layout["pp"] * layout["dp"] == 256


def test_cli_table(capsys):
    assert main(["--flops", "1e22", "--gpus", "64"]) == 0
    out = capsys.readouterr().out
    assert "9.13B" in out and "182.57B" in out and "layout" in out and "assumptions:" in out


@pytest.mark.parametrize("argv,match", [
    ([], "give params"),
    (["--params", "-7e9"], "positive"),
    (["--params", "abc"], "not a number"),
    (["--params", "7e9", "--gpu", "tpu9"], "unknown gpu"),
    (["--params", "7e9", "--gpus", "3.5"], "whole number"),
    (["--params", "7e9", "--config", "/nonexistent/plan.yaml"], "not found"),
])
def test_cli_errors_exit_2(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


def test_plan_for_the_configured_run():
    """The flows' plan stage prices the run the config describes: N counted from the real model,
    the token budget from steps x global batch, and the FLOPs per token the training worker logs."""
    import torch

    from tasks.config import load_config
    from tasks.plan import global_batch_tokens, plan_for_run
    from tasks.train.model import GPT, GPTConfig
    from tasks.train.flops import flops_per_token

    cfg = load_config("configs/tiny.yaml")
    plan = plan_for_run(cfg, vocab_size=4096)
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_model_config(cfg.model, 4096))
    n = sum(p.numel() for p in model.parameters())  # tied embeddings: counted once
    assert plan["params"] == n
    m, t = cfg.model, cfg.train
    assert global_batch_tokens(cfg) == t.micro_batch_size * m.seq_len * t.nproc_per_node * t.grad_accum_steps
    assert plan["tokens"] == t.max_steps * global_batch_tokens(cfg)
    assert plan["compute_optimal_tokens"] == pytest.approx(20 * n)
    assert plan["budget_vs_compute_optimal"] == pytest.approx(plan["tokens"] / (20 * n))
    per_token = 6 * n + 12 * m.n_layer * m.d_model * m.seq_len
    assert plan["flops_per_token"] == pytest.approx(per_token)
    assert flops_per_token(n, m.n_layer, m.n_head, m.d_model // m.n_head, m.seq_len) == per_token
    assert plan["plan"]["layout"]["fits"] and plan["gpu_hours"] > 0
    # a config with batch_tokens: the budget follows it, whatever the micro-batch split
    big = cfg.model_copy(update={"train": t.model_copy(update={"batch_tokens": 8 * m.seq_len * 4})})
    assert plan_for_run(big, 4096)["tokens"] == t.max_steps * 8 * m.seq_len * 4
    # a batch ramp's smaller first steps: the budget is what the steps really train
    unit = t.micro_batch_size * t.nproc_per_node * m.seq_len  # one micro-batch on every rank
    ramped = load_config("configs/tiny.yaml", ["train.grad_accum_steps=4", f"train.batch_ramp_start_tokens={unit}",
                                               f"train.batch_ramp_tokens={100 * 4 * unit}"])
    full = t.max_steps * 4 * unit
    assert full - 100 * 4 * unit < plan_for_run(ramped, 4096)["tokens"] < full - 30 * 4 * unit
    # a mixture of experts: FLOPs from the active parameters, memory from the total
    moe = plan_for_run(load_config("configs/tiny.yaml", ["model.moe.n_experts=4"]), 4096)
    assert moe["active_params"] < moe["params"] and moe["plan"]["params"] == moe["params"]
    assert moe["plan"]["flops_6nd"] == pytest.approx(6 * moe["active_params"] * moe["tokens"])
    assert moe["plan"]["model_state_bytes"] == pytest.approx(16 * moe["params"])
    assert moe["compute_optimal_tokens"] == pytest.approx(20 * moe["active_params"])
    # the accelerator comes from plan.gpu (checked against the table when the config loads)
    on_a100 = load_config("configs/tiny.yaml", ["plan.gpu=A100"])
    assert plan_for_run(on_a100, 4096)["plan"]["gpu"] == "a100" and plan["plan"]["gpu"] == "h100"
    with pytest.raises(Exception, match="plan.gpu 'tpu9'"):
        load_config("configs/tiny.yaml", ["plan.gpu=tpu9"])


# --- `crucible plan --curate`: curation priced from the measured rates in benchmarks/results ---

CURATE_STAGES = {"extract", "langid + filters", "line dedup", "exact/MinHash dedup", "quality scoring", "tokenization"}


def _curate(argv, capsys) -> dict:
    assert main(["--curate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_curate_plan_follows_the_rates(capsys, tmp_path):
    plan = _curate(["10TB", "--nodes", "4"], capsys)
    assert {s["stage"] for s in plan["stages"]} == CURATE_STAGES
    for s in plan["stages"]:  # every stage names the file and key its rate came from
        assert s["rate"]["file"] and s["rate"]["key"] and s["rate"]["value"] > 0
        assert s["core_hours"] == pytest.approx(s["items_in"] / s["rate"]["value"] / 3600)
    assert plan["not_measured"] == [] and all(s["rate"]["measured"] for s in plan["stages"])
    assert plan["pages"] == pytest.approx(10e12 / plan["bytes_per_page"]["value"])
    assert plan["hours"] == pytest.approx(plan["core_hours"] / (4 * 64))
    assert plan["compute_cost_usd"] == pytest.approx(4 * plan["hours"] * 3.2256)
    # doubling the corpus doubles the core-hours
    assert _curate(["20TB", "--nodes", "4"], capsys)["core_hours"] == pytest.approx(2 * plan["core_hours"])
    # a rerun benchmark changes the plan: halve the extraction rate in a copy of the results
    rates = tmp_path / "results"
    shutil.copytree(REPO_ROOT / "benchmarks" / "results", rates)
    data = json.loads((rates / "extraction.json").read_text())
    data["comparison"]["speed"]["resiliparse"]["pages_per_s_per_core"] /= 2
    (rates / "extraction.json").write_text(json.dumps(data))
    data = json.loads((rates / "stage_rates.json").read_text())  # and the quality scoring rate
    data["quality"]["score"]["docs_per_s_cpu"] /= 2
    (rates / "stage_rates.json").write_text(json.dumps(data))
    slower = _curate(["10TB", "--nodes", "4", "--rates-dir", str(rates)], capsys)
    extract, quality = (next(s["core_hours"] for s in plan["stages"] if s["stage"] == n)
                        for n in ("extract", "quality scoring"))
    assert slower["core_hours"] == pytest.approx(plan["core_hours"] + extract + quality)
    (rates / "minhash.json").unlink()
    assert main(["--curate", "10TB", "--rates-dir", str(rates)]) == 2
    assert "minhash.json is missing" in capsys.readouterr().err


def test_curate_text_input_skips_extraction(capsys):
    plan = _curate(["500GB", "--input", "text", "--target-hours", "12"], capsys)
    assert "extract" not in {s["stage"] for s in plan["stages"]} and plan["hours"] <= 12
    assert plan["nodes"] == math.ceil(plan["core_hours"] / (64 * 12))


@pytest.mark.parametrize("argv,match", [
    (["--curate", "10XB"], "like 10TB"),
    (["--curate=-5GB"], "like 10TB"),
    (["--curate", "0TB"], "like 10TB"),
    (["--curate", "10TB", "--params", "7e9"], "without --params"),
    (["--curate", "10TB", "--input", "pdf"], "invalid choice"),
])
def test_curate_bad_input_exit_2(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err


# --- the planner and the trainer agree: emitted configs validate, memory matches the real shards ---

def _emit(tmp_path, capsys, argv, base=None) -> tuple[dict, dict]:
    """(the plan, the config written) of `crucible plan ARGV --emit-config`."""
    import yaml

    out = tmp_path / "planned.yaml"
    assert main([*argv, "--json", "--emit-config", str(out), *(["--config", base] if base else [])]) == 0
    return json.loads(capsys.readouterr().out), yaml.safe_load(out.read_text())


def _dims_of(raw: dict):
    from tasks.train.parallel_dims import ParallelDims

    cfg = PipelineConfig.model_validate(raw)
    return cfg, ParallelDims.from_config(cfg)


def test_the_70b_plan_is_accepted_by_the_trainers_config_validation(tmp_path, capsys):
    from tasks.config import load_config
    from tasks.train.parallel_dims import ParallelDims

    plan, fragment = _emit(tmp_path, capsys, ["--params", "7e10", "--gpus", "512", "--gpu", "h100"])
    lay = plan["layout"]
    assert (lay["tp"], lay["pp"], lay["dp"], lay["dp_shard"], lay["dp_replicate"]) == (4, 1, 128, 8, 16)
    # the fragment, unchanged, in the smallest config: the layout the planner prescribed
    cfg, dims = _dims_of({"name": "x", "sources": [{"name": "a", "uri": "u", "format": "text", "licence": "l",
                                                   "provenance": "p"}], **fragment})
    assert (dims.tp, dims.pp, dims.dp_shard, dims.dp_replicate, dims.world) == (4, 1, 8, 16, 512)
    assert cfg.model.n_head % dims.tp == 0 and (cfg.model.n_layer, cfg.model.d_model) == (plan["n_layer"],
                                                                                        plan["d_model"])
    assert cfg.train.nnodes * cfg.train.nproc_per_node == 512 and cfg.train.rdzv_endpoint
    # merged into a pipeline config: a file `crucible run` loads as it is
    _, merged = _emit(tmp_path, capsys, ["--params", "7e10", "--gpus", "512", "--gpu", "h100"], "configs/tiny.yaml")
    full = load_config(tmp_path / "planned.yaml")
    assert ParallelDims.from_config(full).describe() == "dp_replicate 16 x dp_shard 8 x tp 4"
    assert full.name == load_config("configs/tiny.yaml").name and merged["sources"]


@pytest.mark.parametrize("seq_len, gpus, want", [
    (131072, 8, {"cp": 4, "tp": 1, "dp_shard": 2, "dp_replicate": 1, "ac": "full"}),
    (131072, 64, {"cp": 4, "tp": 1, "dp_shard": 8, "dp_replicate": 2, "ac": "full"}),
    (8192, 8, {"cp": 1, "tp": 2, "dp_shard": 4, "dp_replicate": 1, "ac": "none"}),
], ids=["8b-128k-8gpus", "8b-128k-64gpus", "8b-8k-8gpus"])
def test_long_context_plans_context_parallelism_the_trainer_accepts(tmp_path, capsys, seq_len, gpus, want):
    """Llama 3 8B's shape at 128k tokens: even at tp 8 with full activation checkpointing one
    sequence's activations (its 128k x 128,256 fp32 log-probs alone 67 GB) do not fit in half an
    H100, so the planner splits the sequence over cp 4 ranks taken from data parallelism; at 8k
    tokens cp stays 1. The emitted config, unchanged, is accepted by the trainer's validation and
    builds that layout (FSDP over dp_shard x cp)."""
    from tasks.plan.planner import activation_bytes

    argv = ["--params", "8.03e9", "--n-layer", "32", "--d-model", "4096", "--gpus", str(gpus),
            "--seq-len", str(seq_len)]
    plan, fragment = _emit(tmp_path, capsys, argv)
    lay = plan["layout"]
    assert lay["fits"] and (lay["cp"], lay["tp"], lay["dp_shard"], lay["dp_replicate"]) == (
        want["cp"], want["tp"], want["dp_shard"], want["dp_replicate"])
    assert lay["tp"] * lay["cp"] * lay["pp"] * lay["dp"] == gpus
    src = {"name": "x", "sources": [{"name": "a", "uri": "u", "format": "text", "licence": "l", "provenance": "p"}]}
    cfg, dims = _dims_of({**src, **fragment})
    assert (dims.cp, dims.tp, dims.dp_shard, dims.dp_replicate, dims.world) == (
        want["cp"], want["tp"], want["dp_shard"], want["dp_replicate"], gpus)
    assert cfg.train.activation_checkpointing == want["ac"] and cfg.model.seq_len == seq_len
    assert cfg.train.batch_tokens == dims.dp * seq_len  # one sequence per data-parallel rank, split over cp
    half = 80e9 * PlanConfig().usable_memory_fraction / 2
    fit = activation_bytes(32, seq_len, 4096, tp=lay["tp"], cp=lay["cp"], checkpointed=want["ac"] == "full",
                           vocab_size=plan["vocab_size"])
    assert fit <= half and lay["activation_gb_per_gpu"] == pytest.approx(fit / 1e9)
    if lay["cp"] > 1:  # the smallest cp that fits: half of it does not, at any tp of the node
        assert all(activation_bytes(32, seq_len, 4096, tp=t, cp=lay["cp"] // 2, checkpointed=True,
                                    vocab_size=plan["vocab_size"]) > half for t in (1, 2, 4, 8))
        assert f"cp={lay['cp']}" in lay["rationale"]


def test_cp_without_recompute_is_preferred_when_tp_x_cp_fits_in_a_node():
    """1B at 64k on 8 GPUs: tp 8 alone does not fit without recompute, tp 4 x cp 2 does (one node), so
    the plan takes cp 2 and no checkpointing rather than cp 1 with full recompute (~1/3 more compute);
    8B at 128k fits no tp x cp within a node without recompute: full checkpointing, then cp 4 (the
    long-context tests above). The rule is stated in the assumptions."""
    from tasks.plan.planner import activation_bytes

    plan = make_plan(params=1e9, n_layer=16, d_model=2048, n_head=16, seq_len=65536, gpus=8)
    lay, half = plan["layout"], 80e9 * PlanConfig().usable_memory_fraction / 2
    assert (lay["tp"], lay["cp"], lay["activation_checkpointing"], lay["fits"]) == (4, 2, False, True)
    assert activation_bytes(16, 65536, 2048, tp=8, vocab_size=plan["vocab_size"]) > half  # cp was needed
    assert lay["activation_gb_per_gpu"] <= half / 1e9
    assert any("without recompute while tp x cp stays within a node" in a for a in plan["assumptions"])
    long = make_plan(params=8.03e9, n_layer=32, d_model=4096, seq_len=131072, gpus=8)["layout"]
    assert (long["cp"], long["activation_checkpointing"]) == (4, True)
    assert "nor with any cp x tp within a node of 8" in long["rationale"]


def test_cli_vocab_sizes_the_log_prob_term_and_the_header_multiplies_out(tmp_path, capsys):
    """`--vocab`: with a 32k vocabulary the 128k-token log-probs no longer force cp (tp 4 within the node
    fits), with Llama 3's 128,256 they do; the emitted header names every factor, so it multiplies out
    to the GPU count."""
    argv = ["--params", "8.03e9", "--n-layer", "32", "--d-model", "4096", "--gpus", "8", "--seq-len", "131072"]
    for vocab, cp in ((32000, 1), (128256, 4)):
        plan, _ = _emit(tmp_path, capsys, [*argv, "--vocab", str(vocab)])
        lay = plan["layout"]
        assert plan["vocab_size"] == vocab and lay["cp"] == cp
        header = (tmp_path / "planned.yaml").read_text().splitlines()[0]
        assert f"tp {lay['tp']} x pp {lay['pp']} x cp {cp} x dp {lay['dp']}" in header
        assert lay["tp"] * lay["pp"] * cp * lay["dp"] == 8


def test_cli_config_vocabulary_sizes_the_plan_unless_vocab_is_given(capsys):
    """`--config` without `--vocab`: the config's tokenizer.vocab_size (what `crucible run` trains and
    plan_for_run prices), not Llama 3's 128,256: configs/tiny.yaml's 4,096-token log-probs leave 8B
    at 128k on 8 GPUs without cp; `--vocab` still wins; the assumptions name the source."""
    from tasks.config import load_config

    argv = ["--params", "8.03e9", "--n-layer", "32", "--d-model", "4096", "--gpus", "8", "--seq-len", "131072",
            "--json", "--config", "configs/tiny.yaml"]
    vocab = load_config("configs/tiny.yaml").tokenizer.vocab_size
    for extra, want, source in (([], vocab, "tokenizer.vocab_size of configs/tiny.yaml"),
                                (["--vocab", "128256"], 128256, "--vocab")):
        assert main([*argv, *extra]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["vocab_size"] == want and f"vocab_size {want:,}: {source}" in plan["assumptions"]
        assert plan["layout"]["cp"] == (1 if want == vocab else 4)


def test_cli_warns_when_cp_meets_a_config_with_doc_mask(tmp_path, capsys):
    """A base config with train.doc_mask planned at cp > 1: the boolean masks that path builds (2 x 128k x
    32k bytes = 8.6 GB at cp 4) are not in the activation estimate, so the plan says so (stderr and
    assumptions); the same config without doc_mask, or a plan at cp 1, carries no warning."""
    import yaml

    argv = ["--params", "8.03e9", "--n-layer", "32", "--d-model", "4096", "--gpus", "8", "--seq-len", "131072",
            "--json", "--emit-config", str(tmp_path / "planned.yaml")]
    raw = yaml.safe_load(Path("configs/tiny.yaml").read_text())
    for doc_mask, vocab, warned in ((True, "128256", True), (False, "128256", False), (True, "32000", False)):
        base = tmp_path / f"base-{doc_mask}.yaml"
        base.write_text(yaml.safe_dump({**raw, "train": {**raw.get("train", {}), "doc_mask": doc_mask}}))
        assert main([*argv, "--config", str(base), "--vocab", vocab]) == 0
        out = capsys.readouterr()
        plan = json.loads(out.out)
        notes = [a for a in plan["assumptions"] if "train.doc_mask with cp=" in a]
        assert bool(notes) == warned and ("train.doc_mask with cp=4" in out.err) == warned, (doc_mask, vocab)
        if warned:
            assert plan["layout"]["cp"] == 4 and "8.6 GB" in notes[0]


def test_expert_parallel_groups_span_cp_x_tp_ranks_within_a_node():
    """ep ranks sit cp x tp apart in the (pp, dp_replicate, dp_shard, cp, tp) mesh, so ep x cp x tp must
    fit in a node: 47B/13B-active at 64k plans tp 4 x cp 2 on 8-GPU nodes, which leaves ep 1 (ep 2 would
    put its all-to-all across nodes); at 128k, tp 2 x cp 4, also ep 1; without cp, tp 2 takes ep 4."""
    from tasks.plan.planner import expert_parallel

    assert [expert_parallel(8, 8, 2, 8, cp=c) for c in (1, 2, 4)] == [4, 2, 1]
    for seq_len, tp, cp in ((65536, 4, 2), (131072, 2, 4)):
        plan = make_plan(params=47e9, active_params=13e9, n_experts=8, gpus=64, seq_len=seq_len)
        lay = plan["layout"]
        assert (lay["tp"], lay["cp"], lay["dp_shard"]) == (tp, cp, 8)
        assert plan["moe"]["ep"] == 1 and plan["moe"]["ep"] * cp * tp <= PlanConfig().gpus_per_node


def test_pipelined_and_moe_plans_validate_as_emitted(tmp_path, capsys):
    plan, fragment = _emit(tmp_path, capsys, ["--params", "1e12", "--gpus", "1024"])
    lay = plan["layout"]
    assert lay["pp"] > 1 and plan["n_layer"] % lay["pp"] == 0  # estimated layers: whole stages
    src = {"name": "x", "sources": [{"name": "a", "uri": "u", "format": "text", "licence": "l", "provenance": "p"}]}
    cfg, dims = _dims_of({**src, **fragment})
    assert (dims.tp, dims.pp, dims.dp, dims.pp_microbatches, dims.pp_schedule) == (
        lay["tp"], lay["pp"], lay["dp"], lay["microbatches"], "1f1b")
    assert cfg.model.tie_embeddings is False and cfg.train.activation_checkpointing == "full"
    # a mixture of experts: experts sized from the active params, counted from the total
    plan, fragment = _emit(tmp_path, capsys, ["--params", "47e9", "--active-params", "13e9", "--gpus", "256",
                                              "--n-experts", "8"])
    cfg, dims = _dims_of({**src, **fragment})
    moe = plan["moe"]
    assert cfg.model.moe.n_experts == 8 and cfg.model.moe.top_k == 2 and cfg.model.moe.expert_hidden == moe["expert_hidden"]
    # expert parallelism: the largest divisor of the 8 experts dividing dp_shard 8 with ep x tp 2 in a node
    assert (dims.tp, dims.dp_shard, dims.ep, moe["ep"]) == (2, 8, 4, 4) and not dims.legacy_ddp
    assert "parallelism" not in fragment["train"]  # the explicit layout decides (FSDP2)
    assert moe["active_params_of_shape"] == pytest.approx(13e9, rel=0.05)
    assert plan["flops_6nd"] == pytest.approx(6 * 13e9 * plan["tokens"])  # active params drive FLOPs
    assert plan["model_state_bytes"] == pytest.approx(47e9 * 16)  # the total drives memory
    # a plan that does not fit writes nothing
    out = tmp_path / "none.yaml"
    assert main(["--params", "7e9", "--gpus", "1", "--emit-config", str(out)]) == 2
    assert "does not fit" in capsys.readouterr().err and not out.exists()


def test_layout_respects_heads_and_layers():
    assert make_plan(params=1e12, gpus=1024)["layout"]["tp"] == 8
    lay = make_plan(params=1e12, gpus=1024, n_layer=168, d_model=22272, n_head=12)["layout"]
    assert lay["tp"] == 4 and lay["n_head"] == 12  # tp divides the heads: 8 does not
    lay = make_plan(params=1e12, gpus=1024, n_layer=100, d_model=25600)["layout"]
    assert 100 % lay["pp"] == 0 and lay["pp"] > 1


def _measure_model_states(rank: int, world: int, init: str, cases: list, dtype: str, out: str) -> None:
    """One rank: for each (train.parallel, model.moe) case, the real parallelized model's local bytes
    of params, grads (after a backward) and AdamW states (after a step); the cases share one spawn."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for i, (parallel, moe) in enumerate(cases):
            _measure_case(rank, world, parallel, moe, dtype, Path(out, f"rank{rank}-{i}.json"))
    finally:
        dist.destroy_process_group()


def _measure_case(rank: int, world: int, parallel: dict, moe: dict, dtype: str, out: Path) -> None:
    import torch
    from torch.distributed.tensor import DTensor

    from lm_helpers import tiny_cfg
    from tasks.train.model import GPT, GPTConfig, lm_loss
    from tasks.train.optimizer import build_optimizer
    from tasks.train.parallel_dims import ParallelDims
    from tasks.train.parallelize import parallelize_model

    cfg = tiny_cfg(model={"n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 32, "moe": moe},
                   train={"nproc_per_node": world, "micro_batch_size": 2, "dtype": dtype,
                          "parallel": parallel})
    dims = ParallelDims.from_config(cfg)
    mesh = dims.build_mesh("cpu")
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_model_config(cfg.model, 512))
    n_params = model.num_params()
    # the MoE layers' parameters (router, experts): not tp-sharded
    moe_params = sum(p.numel() for b in model.blocks if hasattr(b.mlp, "experts") for p in b.mlp.parameters())
    parallelize_model(model, dims, mesh, cfg.train, torch.device("cpu"))
    opt = build_optimizer(model, cfg.train)
    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    logits, _ = model(x)
    lm_loss(logits, x, 0.0)[0].backward()

    def local_bytes(t) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = list(model.parameters())
    grads = sum(local_bytes(p.grad) for p in params)
    opt.step()
    states = sum(local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    out.write_text(json.dumps({
        "n_params": n_params, "moe_params": moe_params, "params": sum(local_bytes(p) for p in params), "grads": grads,
        "optimizer": states, "dtensors": sum(isinstance(p, DTensor) for p in params), "n_tensors": len(params),
        "dtypes": sorted({str(p.dtype) for p in params})}))


MOE = {"n_experts": 4, "top_k": 2}


@pytest.mark.parametrize("cases,dtype", [
    ([({"dp_shard": 2, "tp": 2}, {}), ({"dp_shard": 2, "tp": 2}, MOE), ({"dp_shard": 2, "tp": 2, "ep": 2}, MOE)], "fp32"),
    ([({"dp_shard": 4}, {})], "fp32"), ([({"dp_shard": 4}, {})], "bf16")],
    ids=["dp_shard2xtp2+moe", "dp_shard4", "dp_shard4-bf16"])
def test_planner_memory_matches_the_parallelized_models_shards(cases, dtype, tmp_path):
    """The planner's per-GPU model-state bytes (model_state_bytes_per_gpu, the formula its layouts
    are sized with) against what each of 4 CPU processes really holds: the local shards of the
    parallelized model's parameters, their gradients after a backward and AdamW's states after a
    step, each within 10 %. With bf16 the sharded parameters stay fp32 (FSDP2 gathers bf16 copies):
    the planner's 4-byte weights and no separate master copy. MoE layers run whole on every tp rank:
    their states are sharded over dp_shard only (ep x FSDP), as the planner counts them (dividing
    them by tp too would underestimate this model's states by about a third)."""
    import torch.multiprocessing as mp

    from tasks.plan.planner import model_state_bytes_per_gpu

    world = 4
    mp.start_processes(_measure_model_states, args=(world, (tmp_path / "init").as_uri(), cases, dtype,
                                                    str(tmp_path)),
                       nprocs=world, start_method="spawn")
    cfg = PlanConfig()
    parts = {"params": cfg.weight_bytes + cfg.master_bytes, "grads": cfg.grad_bytes, "optimizer": cfg.optimizer_bytes}
    for i, (parallel, moe) in enumerate(cases):
        ranks = [json.loads((tmp_path / f"rank{r}-{i}.json").read_text()) for r in range(world)]
        n, n_moe = ranks[0]["n_params"], ranks[0]["moe_params"]
        assert (n_moe > n / 2) == bool(moe)  # the MoE model's states are mostly experts
        assert all(r["dtensors"] == r["n_tensors"] for r in ranks)  # every parameter really sharded
        assert all(r["dtypes"] == ["torch.float32"] for r in ranks)
        tp, dp_shard = parallel.get("tp", 1), parallel["dp_shard"]
        sharded = (n - n_moe) / (tp * dp_shard) + n_moe / dp_shard  # parameters held per rank
        for r in ranks:
            for name, per_param in parts.items():
                assert r[name] == pytest.approx(sharded * per_param, rel=0.10), (name, parallel, r)
            measured = r["params"] + r["grads"] + r["optimizer"]
            estimate = model_state_bytes_per_gpu(n, tp=tp, pp=1, dp_shard=dp_shard, cfg=cfg, moe_params=n_moe)
            assert measured == pytest.approx(estimate, rel=0.10), (parallel, measured, estimate)
        print(f"{parallel} moe {moe}: planner {estimate:,.0f} B per rank, measured "
              f"{[r['params'] + r['grads'] + r['optimizer'] for r in ranks]}")


def _measure_activations(rank: int, world: int, init: str, out: str) -> None:
    """One rank: the bytes autograd saves for the backward (unique storages, parameters and buffers
    excluded) in the forward and loss of the real GPT at 2 and 4 layers, whole (every rank the same
    sequence) and under context parallelism over the `world` ranks (tasks/train/context_parallel.py)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from lm_helpers import tiny_cfg
    from tasks.train.context_parallel import apply_cp
    from tasks.train.model import GPT, GPTConfig, lm_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
        x = torch.randint(0, ACT_VOCAB, (ACT_BATCH, ACT_SEQ), generator=torch.Generator().manual_seed(1))
        record = {}
        for n_layer in (2, 4):
            for cp in (False, True):
                torch.manual_seed(0)
                cfg = tiny_cfg(model={"n_layer": n_layer, "n_head": 4, "d_model": ACT_D, "seq_len": ACT_SEQ,
                                      "dropout": 0.0})
                model = GPT(GPTConfig.from_model_config(cfg.model, ACT_VOCAB))
                context = apply_cp(model, mesh, ACT_SEQ) if cp else None
                idx = context.shard(x) if cp else x
                skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
                saved: dict[int, int] = {}

                def pack(t):
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in skip:
                        saved[ptr] = t.untyped_storage().nbytes()
                    return t

                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    logits, _ = model(idx)
                    loss = lm_loss(logits, idx, 0.0)[0]
                loss.backward()  # the saved graph is a real one
                record[f"{'cp' if cp else 'whole'}{n_layer}"] = sum(saved.values())
        Path(out, f"act{rank}.json").write_text(json.dumps(record))
    finally:
        dist.destroy_process_group()


ACT_BATCH, ACT_SEQ, ACT_D, ACT_VOCAB = 2, 64, 64, 4096


def test_planner_cp_activation_term_matches_the_saved_tensors(tmp_path):
    """The planner's context-parallel activation term (activation_bytes) against what autograd
    really saves on each of 2 gloo ranks: per layer, 1/cp of the 1-process activations but the whole
    sequence's K and V (the all-gathered ones attention keeps) and a second copy of the attention
    output (the query chunks' SDPA outputs and their concatenation), and 1/cp of the output
    layer's fp32 log-probs, each within 10 % (on CPU SDPA also keeps the lower-right bias it
    materialises, c x (a + 1) c floats: ~1 % here, nothing with GPU flash attention). The per-layer bytes per token and width (per_token_per_d) are
    this fp32 model's own, measured in the same run (the planner's 34 is Korthikanti's 16-bit GPT
    count); the layers' share is the 4-layer model's saved bytes less the 2-layer one's."""
    import torch.multiprocessing as mp

    from tasks.plan.planner import activation_bytes

    world = 2
    mp.start_processes(_measure_activations, args=(world, (tmp_path / "init").as_uri(), str(tmp_path)),
                       nprocs=world, start_method="spawn")
    per_rank = [json.loads((tmp_path / f"act{r}.json").read_text()) for r in range(world)]
    unit = ACT_BATCH * ACT_SEQ * ACT_D  # token x width of the whole batch
    for m in per_rank:
        layer_whole, layer_cp = (m["whole4"] - m["whole2"]) / 2, (m["cp4"] - m["cp2"]) / 2
        per_token_per_d = layer_whole / unit
        predicted = ACT_BATCH * activation_bytes(1, ACT_SEQ, ACT_D, cp=world, per_token_per_d=per_token_per_d,
                                                 value_bytes=4)
        assert layer_cp == pytest.approx(predicted, rel=0.10), (layer_cp, predicted, layer_whole, m)
        assert layer_cp > layer_whole / world * 1.1  # the gathered K/V are really kept: not just 1 / cp
        # the output layer: the rest of the model, mostly fp32 log-probs of 4,096 entries per position
        for name, cp in (("whole", 1), ("cp", world)):
            rest = m[f"{name}2"] - 2 * (layer_whole if cp == 1 else layer_cp)
            logits = ACT_BATCH * activation_bytes(0, ACT_SEQ, ACT_D, cp=cp, vocab_size=ACT_VOCAB)
            assert rest == pytest.approx(logits, rel=0.10), (name, rest, logits, m)
    print(f"per layer: whole {layer_whole:,.0f} B ({per_token_per_d:.1f} B per token x width), cp {world}: "
          f"{layer_cp:,.0f} B measured, {predicted:,.0f} B planned")
