"""MLflow tracking: one experiment per config name, a parent run per pipeline run, a nested run per stage."""
from tasks.tracking.mlflow_tracking import Tracker, flatten

__all__ = ["Tracker", "flatten"]
