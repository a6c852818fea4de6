"""Prefect artifacts: the stages' reports, progress bars and the run's checkpoint table."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from tasks.core.stage import Markdown, Table

log = logging.getLogger(__name__)


def publish_reports(reports: list) -> None:
    """Each Markdown / Table report of a stage as a Prefect artifact."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    for report in reports:
        if isinstance(report, Markdown):
            create_markdown_artifact(key=report.key, markdown=report.markdown, description=report.description)
        elif isinstance(report, Table):
            create_table_artifact(key=report.key, table=report.rows, description=report.description)
        else:
            raise TypeError(f"not a report: {report!r}")


def publish_quietly(reports: list) -> None:
    """publish_reports that never raises: a report people read must not fail the stage it reports on."""
    try:
        publish_reports(reports)
    except Exception as e:  # noqa: BLE001
        log.warning("could not publish %s: %s", ", ".join(r.key for r in reports), e)


def publish_eval_table(run_dir: str | Path, run_name: str) -> None:
    """The run's checkpoint table (tasks.evaluate.stage.eval_table) as an artifact; never raises."""
    from tasks.evaluate.stage import eval_table

    publish_quietly(eval_table(run_dir, run_name))


def stage_progress(stage: str, unit: str, interval: float = 2.0):
    """A `progress(done, total, note)` callback for a stage: a console bar on stderr and a Prefect
    progress artifact (`<stage>-progress`), created at the first call, updated at most every
    `interval` seconds and at the end (each update is an API call)."""
    from prefect.artifacts import create_progress_artifact, update_progress_artifact

    from tasks.core.progress import ConsoleProgress, Throttle, fan_out

    state: dict[str, Any] = {"id": None}
    throttle = Throttle(interval)

    def artifact(done: int, total: int, note: str = "") -> None:
        pct = 100.0 * done / total if total else 100.0
        description = f"{stage}: {done}/{total} {unit}" + (f" ({note})" if note and note != stage else "")
        if state["id"] is None:
            state["id"] = create_progress_artifact(progress=pct, key=f"{stage}-progress", description=description)
        elif throttle(done, total):
            update_progress_artifact(state["id"], progress=pct, description=description)

    return fan_out(ConsoleProgress(stage), artifact)
