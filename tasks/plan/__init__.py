"""Scaling-law planner: Chinchilla sizing, training FLOPs, time, cost and a parallel layout."""
from tasks.plan.planner import PlanError, estimate_shape, flops_per_token, make_plan, suggest_layout

__all__ = ["make_plan", "PlanError", "estimate_shape", "flops_per_token", "suggest_layout"]
