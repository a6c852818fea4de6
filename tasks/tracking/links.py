"""The URLs Crucible prints and puts in artifacts for the Prefect and MLflow UIs, in the form that
opens the page in a browser that has not logged in yet, after one login.

Prefect: its UI keeps the login in the browser's local storage; a deep link opened before that
fails ("Oops. Something went wrong"), but its own login route takes the page to go to afterwards
(`/login?redirect=<path>`, the route its UI sends a refused page to), so every Prefect page link is
that route. MLflow: the basic-auth app answers the browser's first request with HTTP Basic, the
browser asks for the login once; the run page is opened in MLflow 3's model-training view
(`workflowType=machine_learning`), not the GenAI view a fresh browser defaults to."""
from __future__ import annotations

from urllib.parse import quote

MLFLOW_WORKFLOW = "workflowType=machine_learning"


def prefect_page(ui_base: str | None, path: str) -> str | None:
    """The Prefect UI page `path` (e.g. /runs/flow-run/<id>) through its login route: the login form
    in a fresh browser, then the page."""
    if not ui_base:
        return None
    return f"{ui_base.rstrip('/')}/login?redirect={quote('/' + path.lstrip('/'), safe='/')}"


def mlflow_run_page(tracking_uri: str, experiment_id: str | None, run_id: str | None) -> str | None:
    """An MLflow run's page in the model-training view; None for a store without a UI (SQLite) or an
    unknown experiment."""
    if not (run_id and experiment_id and tracking_uri.startswith("http")):
        return None
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}?{MLFLOW_WORKFLOW}"



class PrefectLoginLinks:
    """A logging filter for Prefect's `prefect.flow_runs` logger: its "View at <UI>/runs/flow-run/<id>"
    line (printed by `crucible run`) names the page through the UI's login route, like every other
    link Crucible prints."""

    def __init__(self, ui_base: str):
        self.ui_base = ui_base.rstrip("/")

    def filter(self, record) -> bool:
        message = record.getMessage()
        prefix = f"View at {self.ui_base}/"
        if message.startswith(prefix) and "/login?" not in message:
            record.msg, record.args = f"View at {prefect_page(self.ui_base, message[len(prefix):])}", ()
        return True


def rewrite_prefect_log_links(ui_base: str | None) -> None:
    """Install PrefectLoginLinks on Prefect's flow-run logger (a no-op without a UI or when installed)."""
    import logging

    logger = logging.getLogger("prefect.flow_runs")
    if ui_base and not any(isinstance(f, PrefectLoginLinks) for f in logger.filters):
        logger.addFilter(PrefectLoginLinks(ui_base))
