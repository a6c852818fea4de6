"""`crucible`: run the pre-training pipeline against an embedded local stack.

    main.py      the argument parser and the dispatch (`crucible = "infra.cli:main"`)
    commands.py  the stack and pipeline commands: up, down, status, login, run, ablate, lineage replay
    plan.py      `crucible plan`: size a run with the scaling-law planner (tasks.plan)
    filter.py    `crucible filter`: language id + heuristic filters on JSONL documents
    dedup.py     `crucible dedup`: exact + MinHash dedup of JSONL documents

Heavy modules (Prefect, MLflow, torch) are imported only after the config has validated, so a bad
config fails in well under a second; the document tools are imported only when they run.
"""
from infra.cli.main import main

__all__ = ["main"]
