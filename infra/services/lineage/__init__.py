"""The lineage service: an OpenLineage store (SQLite) with a Marquez-compatible API, provenance
reports and a page for auditors. `python -m infra.services.lineage --db PATH` serves it."""
from infra.services.lineage.app import create_app
from infra.services.lineage.store import LineageStore

__all__ = ["LineageStore", "create_app"]
