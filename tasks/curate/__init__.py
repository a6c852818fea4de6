"""Curate stage: language id, heuristic quality filters, then deduplication (`tasks.dedup`).

Public API: `run_curate(cfg, in_shards, out_dir) -> summary dict` (see `tasks.curate.run`).
"""
from tasks.curate.run import run_curate

__all__ = ["run_curate"]
