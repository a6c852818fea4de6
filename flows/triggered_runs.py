"""The pretrain flow's side of the event-triggered flows (flows/triggers.py): with the stack's worker
running them (triggers_active), the evaluate and deploy subflows wait on their flow runs for this
run's checkpoints through Prefect's client and hand what those runs recorded to the evaluate / deploy
stages as inputs (StageInputs.triggered), which report it instead of doing the work again.

    evaluate-checkpoint run of a checkpoint   found by deployment and its `checkpoint` parameter,
                                              its state read until it is final;
                                              COMPLETED: its signed report (tasks/deploy/triggered.py)
    deploy-model run of each passing one      the same; all COMPLETED: their signed deploy records

A run that ends FAILED, CRASHED or CANCELLED, or a record that does not verify, gives the stage
nothing to report: it does the work itself, the triggered run being over. A run that is not final
after stack.triggered_timeout seconds (or never appears) is cancelled first, so that a checkpoint is
never evaluated or deployed by both at once.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

import anyio
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
from prefect.client.schemas.objects import FlowRun
from prefect.client.schemas.sorting import FlowRunSort
from prefect.states import Cancelling
from prefect.utilities.asyncutils import run_coro_as_sync

from flows.run_context import RunContext
from flows.stage_task import model_server_status
from infra.settings import CrucibleConfig
from tasks.core.constants import DEPLOY_FLOW, EVAL_FLOW
from tasks.core.fs import is_remote
from tasks.core.storage import run_uri
from tasks.deploy.triggered import passing_triggered_checkpoints, triggered_deployment, triggered_evaluation

log = logging.getLogger("crucible.triggers")

POLL = 2.0  # seconds between reads of a flow run (or of the runs, until the automation has created it)
RECENT_RUNS = 200  # the newest flow runs of a deployment searched for a checkpoint's


def _checkpoint_param(value: str) -> str:
    return value if is_remote(value) else str(Path(value).resolve())


async def find_flow_run(client: PrefectClient, deployment: str, checkpoint: str | Path) -> FlowRun | None:
    """The newest flow run of `deployment` for `checkpoint` (its `checkpoint` parameter: the event
    named it by its path, or for an object-store run_root by its object); None if there is none."""
    runs = await client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])),
                                       sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=RECENT_RUNS)
    want = {str(Path(checkpoint).resolve()), run_uri(checkpoint)}
    return next((r for r in runs if _checkpoint_param(str(r.parameters.get("checkpoint", ""))) in want), None)


async def _final_run(deployment: str, checkpoint: str | Path, timeout: float) -> FlowRun | None:
    deadline = time.monotonic() + timeout
    async with get_client() as client:
        run = await find_flow_run(client, deployment, checkpoint)
        while run is None and time.monotonic() < deadline:  # the automation creates it after the event
            await anyio.sleep(POLL)
            run = await find_flow_run(client, deployment, checkpoint)
        if run is None:
            log.warning("triggered: no %s flow run for %s after %.0f s", deployment, checkpoint, timeout)
            return None
        # its state, read through the client (not Prefect's wait_for_flow_run: its subscription to the
        # server's event stream hung a pretrain run on the stack's loaded SQLite server, the DB locked)
        while not (run.state and run.state.is_final()) and time.monotonic() < deadline:
            await anyio.sleep(POLL)
            run = await client.read_flow_run(run.id)
        if run.state and run.state.is_final():
            return run
        # cancelled, so that it never does the work the stage now does itself
        await client.set_flow_run_state(run.id, Cancelling(message=f"not final after {timeout:.0f} s: the "
                                                           "pretrain flow does the work itself"), force=True)
        log.warning("triggered: %s flow run %s not final after %.0f s; cancelled", deployment, run.name, timeout)
        return None


def completed_flow_run(deployment: str, checkpoint: str | Path, timeout: float) -> FlowRun | None:
    """The COMPLETED flow run of `deployment` for `checkpoint`, once it is final; None (logged why)
    if it ended otherwise, or was cancelled after `timeout` seconds."""
    run = run_coro_as_sync(_final_run(deployment, checkpoint, timeout))
    if run is None:
        return None
    if not run.state or not run.state.is_completed():
        log.warning("triggered: %s flow run %s %s", deployment, run.name, run.state.type.value if run.state else "?")
        return None
    return run


def collect_evaluation(cfg: CrucibleConfig, run: RunContext, checkpoint: str) -> dict | None:
    """The evaluate-checkpoint run's report of `checkpoint`, for the evaluate stage (None: it evaluates)."""
    if completed_flow_run(EVAL_FLOW, checkpoint, cfg.stack.triggered_timeout) is None:
        return None
    return triggered_evaluation(run.layout, checkpoint)


def collect_deployment(cfg: CrucibleConfig, run: RunContext, best: dict) -> dict | None:
    """What the deploy-model runs of this run's passing checkpoints did, for the deploy stage (None:
    it deploys `best` itself)."""
    checkpoints = passing_triggered_checkpoints(run.layout)
    if checkpoints is None:
        return None
    for ckpt in checkpoints:
        if completed_flow_run(DEPLOY_FLOW, ckpt, cfg.stack.triggered_timeout) is None:
            return None
    return triggered_deployment(cfg, run.tracking_uri, run.layout, best, checkpoints, model_server_status(cfg))
