"""Scaling-law planner: Chinchilla sizing, training FLOPs, time, cost and a parallel layout."""
from tasks.plan.for_run import global_batch_tokens, plan_for_run
from tasks.plan.planner import PlanError, estimate_shape, make_plan, suggest_layout

__all__ = ["make_plan", "plan_for_run", "global_batch_tokens", "PlanError", "estimate_shape", "suggest_layout"]
