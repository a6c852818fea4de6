"""Training FLOPs per token, as torchtitan counts them for MFU (PaLM, Chowdhery et al. 2022, appendix B).

One implementation for the training worker's logged MFU and the planner's cost estimate, so what a
run logs is what `crucible plan` predicts. Plain arithmetic: no torch import.
"""
from __future__ import annotations


def dense_and_attention_flops(params: float, n_layer: int, d_model: int, seq_len: int) -> tuple[float, float]:
    """(6N, 12·L·d·T): the dense and attention parts of training FLOPs per token.

    6N covers the matmuls of forward and backward; 12·L·d·T (d = heads x head width, T = sequence
    length) the attention scores and values. N counts a tied embedding once: as the output
    projection it is a real matmul. For a mixture of experts N is the active count, the parameters
    one token passes through (GPT.num_active_params: routed experts at top_k / n_experts), not
    the total: a token's FLOPs do not grow with experts it never visits."""
    return 6.0 * params, 12.0 * n_layer * d_model * seq_len


def flops_per_token(n_params: int, n_layer: int, n_head: int, head_dim: int, seq_len: int) -> int:
    """Training FLOPs per token, 6N + 12·L·H·Q·T, as a whole number (what the worker logs MFU from);
    n_params: GPT.num_active_params() (the matmul parameters a token uses; all of them when dense)."""
    dense, attention = dense_and_attention_flops(n_params, n_layer, n_head * head_dim, seq_len)
    return int(dense + attention)
