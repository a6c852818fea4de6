"""The lineage service: an OpenLineage store (SQLite) with a Marquez-compatible API, provenance
reports and a page for auditors. `python -m tasks.lineage.service --db PATH` serves it."""
from tasks.lineage.service.app import create_app
from tasks.lineage.service.replay import replay
from tasks.lineage.service.store import LineageStore

__all__ = ["LineageStore", "create_app", "replay"]
