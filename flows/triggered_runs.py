"""The pretrain flow's side of the event-triggered flows (flows/triggers.py): with the stack's worker
running them (triggers_active), the evaluate and deploy subflows wait on their flow runs for this
run's checkpoints through Prefect's client and hand what those runs recorded to the evaluate / deploy
stages as inputs (StageInputs.triggered), which report them instead of doing the work again.

    evaluate-checkpoint run of a checkpoint   found by deployment, its `checkpoint` parameter and a
                                              start after the pretrain flow run's (an earlier attempt's
                                              run in the same run directory is not this one's);
                                              its state read until it is final;
                                              COMPLETED: its signed report (tasks/deploy/triggered.py)
    deploy-model run of each passing one      the same; all COMPLETED: their signed deploy records

A run that ends FAILED, CRASHED or CANCELLED, or a record that does not verify, gives the stage
nothing to report: it does the work itself, the triggered run being over. Each subflow waits at most
stack.triggered_timeout seconds in all. Then a checkpoint is never evaluated or deployed by both at once:

    takeover marker   a Prefect Variable per flow and checkpoint (takeover_variable), naming the pretrain
                      flow run, set before the stage does the work itself; a triggered flow run that
                      starts while that flow run is not final does nothing and ends CANCELLED (taken_over)
    cancellation      a run not final by then is cancelled through orchestration (never forced: a run
                      that has just COMPLETED stays so and is taken), then read until it is final, at
                      most CANCEL_GRACE seconds (logged as an error if it is not)
"""
from __future__ import annotations

import hashlib
import logging
import time
from datetime import datetime
from pathlib import Path

import anyio
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas.actions import VariableCreate, VariableUpdate
from prefect.client.schemas.filters import (DeploymentFilter, DeploymentFilterName, FlowRunFilter,
                                            FlowRunFilterExpectedStartTime)
from prefect.client.schemas.objects import FlowRun
from prefect.client.schemas.responses import SetStateStatus
from prefect.client.schemas.sorting import FlowRunSort
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelling
from prefect.utilities.asyncutils import run_coro_as_sync

from flows.run_context import RunContext
from flows.stage_task import model_server_status
from infra.settings import CrucibleConfig
from tasks.core.constants import DEPLOY_FLOW, EVAL_FLOW
from tasks.core.fs import canonical, is_remote
from tasks.core.storage import run_uri
from tasks.deploy.triggered import (EVALUATED_BY, passing_triggered_checkpoints, triggered_deployment,
                                    triggered_evaluation)

log = logging.getLogger("crucible.triggers")

POLL = 2.0  # seconds between reads of a flow run (or of the runs, until the automation has created it)
RECENT_RUNS = 200  # the newest flow runs of a deployment searched for a checkpoint's
CANCEL_GRACE = 120.0  # seconds a cancelled run has to end (its worker stops its process) before the stage works
TAKEOVER = "crucible-takeover"  # the takeover markers' name prefix (Prefect Variables)


def _checkpoint_param(value: str) -> str:
    return value if is_remote(value) else str(Path(value).resolve())


def _checkpoint_names(checkpoint: str | Path) -> set[str]:
    """How an event names `checkpoint`: its path, or for an object-store run_root its object (the
    train stage names a store run's checkpoints by their URIs)."""
    return {str(canonical(checkpoint)), run_uri(checkpoint)} - {None}


def _final(run: FlowRun) -> bool:
    return bool(run.state and run.state.is_final())


def takeover_variable(deployment: str, checkpoint_param: str) -> str:
    """The name of the takeover marker of `deployment`'s work on a checkpoint (as its `checkpoint`
    parameter names it, _checkpoint_param): Variable names allow letters, digits, - and _ only."""
    digest = hashlib.sha256(f"{deployment}\n{checkpoint_param}".encode()).hexdigest()[:40]
    return f"{TAKEOVER}-{digest}"


async def _mark_taken_over(client: PrefectClient, deployment: str, checkpoint: str | Path, owner: str) -> None:
    for name in _checkpoint_names(checkpoint):
        variable, value = takeover_variable(deployment, name), {"flow_run_id": owner, "checkpoint": name}
        if await client.read_variable_by_name(variable) is None:
            await client.create_variable(VariableCreate(name=variable, value=value, tags=["crucible"]))
        else:
            await client.update_variable(VariableUpdate(name=variable, value=value))


async def _taken_over(deployment: str, checkpoint: str) -> str | None:
    async with get_client() as client:
        marker = await client.read_variable_by_name(takeover_variable(deployment, _checkpoint_param(checkpoint)))
        owner = marker.value.get("flow_run_id") if marker and isinstance(marker.value, dict) else None
        if not owner:
            return None
        try:
            taker = await client.read_flow_run(owner)
        except ObjectNotFound:
            return None
    # an earlier attempt's marker (its pretrain flow run is over) does not hold this attempt's runs
    return None if _final(taker) else f"the pretrain flow run {taker.name} ({owner}) does this work itself"


def taken_over(deployment: str, checkpoint: str) -> str | None:
    """Why `deployment`'s flow run for `checkpoint` (its parameter) must do nothing (None: it does the
    work): the pretrain flow run that set its takeover marker is still running and does it itself."""
    return run_coro_as_sync(_taken_over(deployment, checkpoint))


def flow_run_started(flow_run_id: str) -> datetime | None:
    """When a flow run (the pretrain flow's) started, by the Prefect server's clock."""
    async def read():
        async with get_client() as client:
            return (await client.read_flow_run(flow_run_id)).start_time
    return run_coro_as_sync(read())


async def find_flow_run(client: PrefectClient, deployment: str, checkpoint: str | Path,
                        since: datetime | None = None) -> FlowRun | None:
    """The newest flow run of `deployment` for `checkpoint` (its `checkpoint` parameter: the event
    named it by its path, or for an object-store run_root by its object) scheduled at or after `since`
    (the pretrain flow run's start: a run of an earlier attempt in the same run directory is not
    this one's); None if there is none."""
    runs = await client.read_flow_runs(
        deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[deployment])),
        flow_run_filter=FlowRunFilter(expected_start_time=FlowRunFilterExpectedStartTime(after_=since)) if since else None,
        sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=RECENT_RUNS)
    want = _checkpoint_names(checkpoint)
    return next((r for r in runs if _checkpoint_param(str(r.parameters.get("checkpoint", ""))) in want), None)


async def _cancel(client: PrefectClient, run: FlowRun, deployment: str, why: str) -> FlowRun | None:
    """Cancel `run` and read it until it is final (the run: COMPLETED if it finished first); None if
    it is not final after CANCEL_GRACE seconds."""
    # not forced: orchestration refuses to cancel a run that has just ended (a COMPLETED one stays so)
    result = await client.set_flow_run_state(run.id, Cancelling(message=f"{why}: the pretrain flow does the "
                                                                         "work itself"), force=False)
    if result.status != SetStateStatus.ACCEPT:
        run = await client.read_flow_run(run.id)
        if _final(run):
            return run
        log.warning("triggered: cancelling %s flow run %s was not accepted (%s); waiting for it to end",
                    deployment, run.name, result.status.value)
    else:
        log.warning("triggered: %s flow run %s %s; cancelled", deployment, run.name, why)
    grace = time.monotonic() + CANCEL_GRACE
    while True:  # CANCELLING is a request: the worker stops the run's process, then it is CANCELLED
        run = await client.read_flow_run(run.id)
        if _final(run):
            return run
        if time.monotonic() >= grace:
            break
        await anyio.sleep(POLL)
    log.error("triggered: %s flow run %s is still %s %.0f s after it was cancelled: it may be doing the work the "
              "stage now does itself", deployment, run.name, run.state.type.value if run.state else "?", CANCEL_GRACE)
    return None


async def _final_run(deployment: str, checkpoint: str | Path, timeout: float, since: datetime | None,
                     owner: str | None) -> FlowRun | None:
    deadline = time.monotonic() + timeout
    async with get_client() as client:
        run = await find_flow_run(client, deployment, checkpoint, since)
        while run is None and time.monotonic() < deadline:  # the automation creates it after the event
            await anyio.sleep(POLL)
            run = await find_flow_run(client, deployment, checkpoint, since)
        # its state, read through the client (not Prefect's wait_for_flow_run: its subscription to the
        # server's event stream hung a pretrain run on the stack's loaded SQLite server, the DB locked)
        while run is not None and not _final(run) and time.monotonic() < deadline:
            await anyio.sleep(POLL)
            run = await client.read_flow_run(run.id)
        if run is not None and _final(run) and run.state.is_completed():
            return run
        # the stage does the work itself: first the marker, so that a run the automation creates from
        # now on does nothing, then a run created before it is looked for again and cancelled
        if owner:
            await _mark_taken_over(client, deployment, checkpoint, owner)
        if run is None:
            run = await find_flow_run(client, deployment, checkpoint, since)
        if run is None:
            log.warning("triggered: no %s flow run for %s after %.0f s", deployment, checkpoint, timeout)
            return None
        if _final(run):
            return run
        return await _cancel(client, run, deployment, f"not final after {timeout:.0f} s")


def completed_flow_run(deployment: str, checkpoint: str | Path, timeout: float, since: datetime | None = None,
                       owner: str | None = None) -> FlowRun | None:
    """The COMPLETED flow run of `deployment` for `checkpoint` scheduled since `since`, once it is
    final; None (logged why) if it ended otherwise, or none completed in `timeout` seconds (a run
    still going is cancelled). With None the stage does the work itself: `owner`, the pretrain flow
    run's id, then holds off a run that starts later (its takeover marker)."""
    run = run_coro_as_sync(_final_run(deployment, checkpoint, max(0.0, timeout), since, owner))
    if run is None:
        return None
    if not run.state or not run.state.is_completed():
        log.warning("triggered: %s flow run %s %s", deployment, run.name, run.state.type.value if run.state else "?")
        return None
    return run


def wait_deadline(cfg: CrucibleConfig) -> float:
    """The time.monotonic() by which a subflow has waited enough: stack.triggered_timeout for all of
    its checkpoints together, not for each."""
    return time.monotonic() + cfg.stack.triggered_timeout


def collect_evaluation(cfg: CrucibleConfig, run: RunContext, checkpoint: str, deadline: float | None = None,
                       since: datetime | None = None) -> dict | None:
    """The evaluate-checkpoint run's report of `checkpoint`, for the evaluate stage (None: it evaluates)."""
    deadline = wait_deadline(cfg) if deadline is None else deadline
    if completed_flow_run(EVAL_FLOW, checkpoint, deadline - time.monotonic(), since, run.root_run_id) is None:
        return None
    return triggered_evaluation(run.layout, checkpoint)


def deploys_itself(best: dict, checkpoints: list[str]) -> bool:
    """Whether the deploy stage deploys `best` itself although the triggered flows ran: it passed its
    gate but was evaluated by the pretrain flow (its triggered evaluation failed, was cancelled or its
    report refused: evaluate/step-N.json), so no deploy-model run was triggered for it (it is not among
    `checkpoints`, those whose triggered evaluation passed)."""
    ckpt = best.get("checkpoint")
    return bool(ckpt and best.get("evaluated_by") != EVALUATED_BY and (best.get("gate") or {}).get("passed")
                and not _checkpoint_names(ckpt) & set().union(*map(_checkpoint_names, checkpoints)))


def collect_deployment(cfg: CrucibleConfig, run: RunContext, best: dict, since: datetime | None = None) -> dict | None:
    """What the deploy-model runs of this run's passing checkpoints did, for the deploy stage (None:
    it deploys `best` itself)."""
    deadline = wait_deadline(cfg)
    checkpoints = passing_triggered_checkpoints(run.layout)
    if checkpoints is None:
        return None
    # every one waited on (or cancelled), so that none still deploys while the stage does
    done = [completed_flow_run(DEPLOY_FLOW, c, deadline - time.monotonic(), since, run.root_run_id) for c in checkpoints]
    if not all(done):
        return None
    if deploys_itself(best, checkpoints):
        ckpt = best["checkpoint"]
        log.info("triggered: the best checkpoint %s was evaluated directly and passed its gate; deploying directly",
                 ckpt)
        # a deploy-model run of it that the automation still starts is held off, one going cancelled
        if completed_flow_run(DEPLOY_FLOW, ckpt, 0.0, since, run.root_run_id) is None:
            return None
        checkpoints = [*checkpoints, ckpt]
    return triggered_deployment(cfg, run.tracking_uri, run.layout, best, checkpoints, model_server_status(cfg))
