"""Prefect flows of the pipeline."""
from __future__ import annotations

from tasks.tracking.links import rewrite_prefect_log_links


def prefect_ui_base() -> str | None:
    """The Prefect UI this process's client names (PREFECT_UI_URL, else the API URL without /api):
    the base of every Prefect link Crucible prints, and of Prefect's own (its url_for reads the
    same settings)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    ui = PREFECT_UI_URL.value() or (PREFECT_API_URL.value() or "").removesuffix("/api")
    return ui.rstrip("/") or None


# every flow entry point imports this package before a flow runs (`python -m flows.X`, `crucible run`,
# the stack's worker running a deployment): Prefect's "View at" line then names the page through the
# UI's login route, as every other printed link does (a deep link fails in a browser not logged in)
rewrite_prefect_log_links(prefect_ui_base)
