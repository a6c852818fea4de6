"""OpenLineage provenance: every task run emits START and COMPLETE/FAIL with its real artifacts."""
from tasks.lineage.emitter import JobRef, LineageEmitter, dataset_for_path, model_version_dataset

__all__ = ["JobRef", "LineageEmitter", "dataset_for_path", "model_version_dataset"]
