"""The planner applied to the run a config describes: what the configured model and token budget
cost at scale, and how far the budget is from compute-optimal. The pretrain flow's `plan` stage
publishes it before training starts, so a platform team sees the bill before paying it."""
from __future__ import annotations

from tasks.config import PipelineConfig
from tasks.plan.planner import make_plan


def global_batch_tokens(cfg: PipelineConfig) -> int:
    """Tokens per optimizer step over all ranks (train.batch_tokens, else micro-batch x seq_len x
    world size x accumulation steps)."""
    t = cfg.train
    if t.batch_tokens:
        return t.batch_tokens
    return t.micro_batch_size * cfg.model.seq_len * t.nproc_per_node * t.nnodes * t.grad_accum_steps


def run_tokens(cfg: PipelineConfig) -> int:
    """Tokens the configured run trains: max_steps x the global batch, less what a batch-size ramp's
    smaller first steps leave out (train.batch_ramp_start_tokens, tasks/train/batch_ramp.py)."""
    t, full = cfg.train, global_batch_tokens(cfg)
    if t.batch_ramp_start_tokens is None:
        return t.max_steps * full
    from tasks.train.batch_ramp import BatchRamp
    from tasks.train.parallel_dims import ParallelDims

    ramp = BatchRamp.for_layout(t, ParallelDims.from_config(cfg), cfg.model.seq_len)
    tokens = 0
    for _ in range(t.max_steps):
        tokens += ramp.samples_at(tokens) * ramp.seq_len
    return tokens


def count_params(cfg: PipelineConfig, vocab_size: int, active: bool = False) -> int:
    """Matmul parameters of the configured model (the N of 6N; `active`: those one token passes
    through, a MoE layer's routed experts at top_k / n_experts), counted on the meta device: no
    memory is allocated, so a 70B config is counted as cheaply as the tiny one."""
    import torch

    from tasks.train.model import GPT, GPTConfig

    with torch.device("meta"):
        model = GPT(GPTConfig.from_model_config(cfg.model, vocab_size))
        return model.num_active_params() if active else model.num_matmul_params()


def plan_for_run(cfg: PipelineConfig, vocab_size: int, gpu: str | None = None) -> dict:
    """make_plan for the configured model and token budget (max_steps x global batch, less a batch
    ramp's shortfall: run_tokens), plus the
    Chinchilla comparison: compute-optimal tokens for this size and the budget's ratio to them.
    A mixture of experts is priced on its active parameters, its memory on the total."""
    params = count_params(cfg, vocab_size)
    m = cfg.model
    active = count_params(cfg, vocab_size, active=True) if m.moe.n_experts else None
    tokens = run_tokens(cfg)
    plan = make_plan(params=params, tokens=tokens, gpu=gpu or cfg.plan.gpu, seq_len=m.seq_len, n_layer=m.n_layer,
                     d_model=m.d_model, n_head=m.n_head, active_params=active, cfg=cfg.plan, energy=cfg.energy,
                     vocab_size=vocab_size)
    optimal = cfg.plan.tokens_per_param * (active or params)  # Chinchilla's N: the compute-driving one
    return {"params": params, "active_params": active or params, "tokens": tokens, "vocab_size": vocab_size,
            "compute_optimal_tokens": optimal, "budget_vs_compute_optimal": tokens / optimal,
            "flops": plan["flops"], "flops_per_token": plan["flops"] / tokens,
            "gpu_hours": plan["gpu_hours"], "cost_usd": plan["cost_usd"], "energy_kwh": plan["energy_kwh"],
            "co2e_kg": plan["co2e_kg"],
            "checkpoint_bytes": plan["checkpoint_bytes"], "plan": plan}
