"""The URLs Crucible prints and puts in artifacts for the Prefect and MLflow UIs, in the form that
opens the page in a browser that has not logged in yet, after one login.

Prefect: its UI keeps the login in the browser's local storage; a deep link opened before that
fails ("Oops. Something went wrong"), but its own login route takes the page to go to afterwards
(`/login?redirect=<path>`, the route its UI sends a refused page to), so every Prefect page link is
that route. MLflow: the basic-auth app answers the browser's first request with HTTP Basic, the
browser asks for the login once; the run page is opened in MLflow 3's model-training view
(`workflowType=machine_learning`), not the GenAI view a fresh browser defaults to."""
from __future__ import annotations

from typing import Callable
from urllib.parse import quote, urlsplit

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


# names of this machine's loopback interface: a UI printed as one is the same server as the other
_LOOPBACK = {"localhost", "127.0.0.1", "::1", "0.0.0.0"}


def _origin(url: str) -> tuple[str, str, int | None, str]:
    """(scheme, host with loopback aliases folded, port, path) of a URL."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    return parts.scheme, "127.0.0.1" if host in _LOOPBACK else host, port, parts.path.rstrip("/")


class PrefectLoginLinks:
    """A logging filter for Prefect's `prefect.flow_runs` logger: its "View at <UI>/runs/flow-run/<id>"
    line names the page through the UI's login route, like every other link Crucible prints. The UI
    is `ui_base`, or what the function `ui_base` returns when the line is logged (flows/__init__.py
    passes its prefect_ui_base); a line naming it by another loopback alias (localhost for
    127.0.0.1) is the same UI."""

    def __init__(self, ui_base: str | Callable[[], str | None]):
        self.ui_base = ui_base

    def filter(self, record) -> bool:
        message = record.getMessage()
        if not message.startswith("View at ") or "/login?" in message:
            return True
        url = message[len("View at "):].strip()
        try:
            base = self.ui_base() if callable(self.ui_base) else self.ui_base
            if not base or " " in url:
                return True
            scheme, host, port, path = _origin(url)
            b_scheme, b_host, b_port, b_path = _origin(base)
        except ValueError:  # a line that names no URL (e.g. a bad port) is left as it is, never raised
            return True
        if (scheme, host, port) == (b_scheme, b_host, b_port) and path.startswith(b_path + "/"):
            # the login route on the origin the line names: a browser keeps the login per origin
            origin = f"{scheme}://{urlsplit(url).netloc}"
            record.msg, record.args = f"View at {prefect_page(origin + b_path, path[len(b_path):])}", ()
        return True


def rewrite_prefect_log_links(ui_base: str | Callable[[], str | None]) -> None:
    """Install PrefectLoginLinks on Prefect's flow-run logger, once (flows/__init__.py does, so every
    flow entry point has it)."""
    import logging

    logger = logging.getLogger("prefect.flow_runs")
    if ui_base and not any(isinstance(f, PrefectLoginLinks) for f in logger.filters):
        logger.addFilter(PrefectLoginLinks(ui_base))
