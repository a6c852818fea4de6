"""MLflow tracking: one experiment per config name, a parent run per pipeline run, a nested run per stage.

Tracker and flatten are imported on first use, so `tasks.tracking.auth` (the stack's MLflow login,
loaded by MLflow's plugin registry and by infra/stack.py) does not import MLflow."""
from __future__ import annotations

__all__ = ["Tracker", "flatten"]


def __getattr__(name: str):
    if name in __all__:
        from tasks.tracking import mlflow_tracking

        return getattr(mlflow_tracking, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
