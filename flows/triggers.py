"""Event-triggered evaluation and deployment: two deployments the stack registers with its work
pool (flows/deployments.py), each flow run a process of the stack's worker (infra/stack.py):

    evaluate-checkpoint/evaluate-checkpoint
        triggered by `crucible.checkpoint.saved` (flows/train_worker.py, resource
        crucible.checkpoint.<run>.<step>; payload path/step/run_id/run_name). Evaluates the
        checkpoint (tasks.evaluate.evaluate_checkpoint) and emits `crucible.eval.completed`
        (resource crucible.eval.<run>.<step>, label crucible.eval.passed "true"/"false"; payload
        passed, reason, val_loss, perplexity, checkpoint, step, run_name, run_id, report_path,
        tokenizer). `passed` is the deployment gate against the current champion at that moment, on
        the fixed yardstick (tasks/deploy/yardstick.py), which the report keeps for deploy-model.
    deploy-model/deploy-model
        triggered by `crucible.eval.completed` with crucible.eval.passed = "true". Runs
        tasks.deploy.deploy_if_better (the gate again, against the champion of now: register,
        alias champion, swap into the running model server). Deployment concurrency limit 1.

The run's other artifacts are derived from the checkpoint path, which the pipeline lays out as
run_dir/train/checkpoints/step-N: run_dir/tokenizer/tokenizer.json, run_dir/tokens/index.json. The
run's config is the stack's signed copy that the pretrain flow registered when it opened the run
(<state_dir>/run-configs/), never run_dir/config.json.

Evaluations of one run never run two at a time: each holds a slot of the Prefect global
concurrency limit `crucible-eval-<run_name>` (limit 1, created on first use). A failed evaluation
is retried (task retries, exponential backoff with jitter; the run config's stack.eval_retries,
default 2, and stack.eval_retry_backoff seconds, default 10). Reports go to run_dir/evaluate/triggered/ (with
the gate's verdict under "gate"; a failed gate is also recorded on the training run), deploy
results to run_dir/deploy/triggered/ (tasks/deploy/triggered.py). Each evaluation updates the
run's Prefect table artifact comparing all its checkpoints (key eval-checkpoints-<run>).

Lineage: each flow run emits OpenLineage START and COMPLETE/FAIL (run id: the Prefect flow run's
id) into its pipeline run's lineage log (run_dir/lineage.jsonl) and to the lineage service, as the
pretrain flow's runs do, and so does the `evaluate` task run (job `evaluate-checkpoint.evaluate`,
parented to its flow run). A flow run's `parent` facet names the training run that spawned it (the
torchrun job run that wrote the checkpoint, found in that log: tasks/lineage/runs.py), its `root`
the pretrain flow run above that; `crucible_links` names the training run in MLflow. Datasets:
evaluate reads the checkpoint, the tokenizer, the token index and val split and the task suite's
evaluation data and writes the report (the flow adds the gate's verdict to it: a new version);
deploy-model reads the checkpoint, the report and the tokenizer and writes the registered model
version and the served model (namespace the server, name models/<name>, version the model version).

With the stack up (`crucible run`, or a run of the pretrain deployment), the pretrain flow leaves
evaluation and deployment to these flows (triggers_active), waits on their flow runs through
Prefect's client and hands what they recorded to its evaluate and deploy stage tasks
(flows/triggered_runs.py). Without it (plain `python -m flows.pretrain`) none of this runs: those
stage tasks evaluate and deploy the checkpoints themselves. A flow run that starts after the pretrain
flow stopped waiting for it and does the work itself (its takeover marker) does nothing and ends CANCELLED.
"""
from __future__ import annotations

import logging
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.tasks import exponential_backoff

from flows.artifacts import publish_eval_table
from tasks.core.constants import (CHECKPOINT_EVENT, DEPLOY_FLOW, DEPLOYED_EVENT, EVAL_EVENT, EVAL_FLOW,
                                  EVENT_DEPLOYMENTS)
from tasks.core.layout import RunLayout
from tasks.core.fs import canonical, files, is_file
from tasks.core.storage import (PathEscape, is_remote, local_place, open_store, push_path, store_holding, stored,
                                 uri_lineage_name)
from tasks.lineage.emitter import ActiveRun, JobRef, dataset_for_path
from tasks.lineage.outputs import DATASET_DOCS

log = logging.getLogger("crucible.triggers")
TRIGGERS_CODE = "flows/triggers.py"
JOB_DOCS = {
    EVAL_FLOW: "Event-triggered flow (crucible.checkpoint.saved): evaluate one checkpoint as training saves it, "
               "gate it against the champion on the yardstick, record the verdict in the report and emit "
               "crucible.eval.completed.",
    f"{EVAL_FLOW}.evaluate": "Evaluate one checkpoint: validation loss and perplexity on the val split, the task "
                             "suite and sample generations (retried with backoff, one evaluation per run at a time).",
    DEPLOY_FLOW: "Event-triggered flow (crucible.eval.completed, passed): check the event's claim against the "
                 "pipeline's records, gate the checkpoint against the champion of now, register it, promote it to "
                 "champion once a server of its own answers, and swap it into the running model server.",
}


def _none(v):
    """Trigger parameters are rendered templates: a missing payload value arrives as "None" or ""."""
    return None if v is None or (isinstance(v, str) and v.strip() in ("", "None", "null")) else v


def run_paths(checkpoint: str | Path) -> dict:
    """{run_dir, config, tokenizer, tokens_index, checkpoint} of a checkpoint in a pipeline run,
    all derived from the run's own layout: an event names the checkpoint and nothing else. A
    checkpoint on a store (its URI) is read there, and so are its run's tokenizer and token index:
    this worker may not be on the machine that ran the stages (run_dir: where this flow writes its
    records, in the store's working copy, before it pushes them)."""
    layout = RunLayout.of_checkpoint(checkpoint)
    ckpt = canonical(checkpoint)
    read_at = (lambda p: str(stored(p)[0])) if is_remote(ckpt) else str
    return {"run_dir": str(layout.run_dir), "checkpoint": str(ckpt), "config": str(layout.config_file),
            "tokenizer": read_at(layout.tokenizer_file), "tokens_index": read_at(layout.tokens_index)}


def _exists(loc: str | Path) -> bool:
    """A file, or a folder with files, local or on a store."""
    at, options = stored(loc)
    return is_file(at, options) or bool(files(at, options))


def trusted_run_paths(checkpoint: str | Path) -> dict:
    """run_paths of a checkpoint under one of the run roots `crucible run` registered with this
    stack (stack.register_run_root); an event naming a checkpoint anywhere else is refused."""
    from infra import stack
    from infra.settings import StackConfig
    from tasks.deploy.triggered import ForgedClaim

    stack_cfg = StackConfig()  # the state dir: $CRUCIBLE_STATE_DIR, set for the stack's processes
    stores = [open_store(s["root"], s["options"], s["cache_dir"]) for s in stack.run_stores(stack_cfg)]
    if is_remote(str(checkpoint)):  # an object on a store: read there, its run's records in its working copy
        if store_holding(str(checkpoint), stores) is None:
            raise ForgedClaim(f"{checkpoint} is not in a run store of this stack "
                              f"({', '.join(s.root for s in stores) or 'none'})")
        try:  # `..` in the key would climb into another registered store's working copy
            local_place(str(checkpoint))
        except PathEscape as e:
            raise ForgedClaim(f"{checkpoint}: {e}") from None
    paths = run_paths(checkpoint)
    roots = stack.run_roots(stack_cfg)
    run_dir = Path(paths["run_dir"])
    if not any(run_dir.is_relative_to(root) for root in roots):
        raise ForgedClaim(f"{paths['checkpoint']} is not under a run root of this stack "
                          f"({', '.join(map(str, roots)) or 'none'}; `crucible run` registers its config's run_root)")
    return paths


def _load_cfg(paths: dict):
    """The run's config: the stack's registered, signed copy (flows/run_context.register_config),
    never the run directory's config.json, which a writer of that directory could point elsewhere
    (lineage.http_url at itself for the write token, evaluate.wikitext.path at any file, a looser
    gate); a missing, unsigned, altered or other run's copy is refused (ForgedClaim). An object-store
    run_root's store is opened, so this flow's files are named in lineage as the objects they become."""
    from infra import stack
    from infra.settings import CrucibleConfig, StackConfig
    from tasks.core.signing import SignatureError
    from tasks.core.storage import store_for
    from tasks.deploy.triggered import ForgedClaim

    try:
        config = stack.registered_run_config(StackConfig(), paths["run_dir"])
    except SignatureError as e:
        log.warning("refused: the run's config for %s: %s", paths["checkpoint"], e)
        raise ForgedClaim(f"refused: no trusted config of the run {paths['run_dir']}: {e}") from None
    cfg = CrucibleConfig.model_validate(config)
    store_for(cfg)
    return cfg


def _tracking_uri(cfg) -> str:
    from flows.run_context import default_tracking_uri

    return default_tracking_uri(cfg)


def triggers_active(cfg) -> bool:
    """True when the stack's worker is up with the event-triggered deployments in its pool and this
    process talks to that stack's Prefect and MLflow: those flows then evaluate and deploy this run's
    checkpoints (the pretrain flow waits for them instead of doing the work twice)."""
    from infra import stack

    if not cfg.stack.triggers:
        return False
    api = (os.environ.get("PREFECT_API_URL") or "").rstrip("/")
    if api != stack.prefect_api_url(cfg.stack).rstrip("/") or _tracking_uri(cfg) != stack.mlflow_tracking_uri(cfg.stack):
        return False
    try:
        return stack.worker_runs(cfg.stack, cfg.lineage, EVENT_DEPLOYMENTS)
    except Exception as e:  # noqa: BLE001 - unknown means: do the work here
        log.warning("cannot tell whether the stack's worker runs the triggered flows (%s); evaluating in the flow", e)
        return False


def eval_limit_name(run_name: str) -> str:
    return "crucible-eval-" + re.sub(r"[^A-Za-z0-9_.-]", "_", run_name or "unknown")


def ensure_limit(name: str) -> None:
    """Create the global concurrency limit `name` (limit 1) unless it exists."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return
        except ObjectNotFound:
            pass
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        except ObjectAlreadyExists:
            pass


def _emit(event: str, resource: dict, payload: dict) -> None:
    from prefect.events import emit_event
    from prefect.events.worker import EventsWorker

    emit_event(event=event, resource=resource, payload=payload)
    EventsWorker.drain_all(timeout=10)


def _checkpoint_with_sources(datasets: list, paths: dict, training) -> list:
    """The checkpoint among `datasets` gets the licences of what its training run read (its own
    producer's COMPLETE, listing it, comes only when training ends)."""
    ckpt = paths["checkpoint"]
    names = {ckpt, uri_lineage_name(ckpt)[1]} if is_remote(ckpt) else {ckpt}  # a store's object: named by its key
    for ds in datasets:
        if ds.name in names and training.sources is not None:
            ds.facets["crucible_source"] = training.sources
    return datasets


@contextmanager
def triggered_lineage(cfg, paths: dict, mlflow_run_id: str | None, inputs=None,
                      task: bool = False) -> Iterator[tuple[ActiveRun, object]]:
    """START/COMPLETE (or FAIL) of the current triggered flow run, or (task) of the current task run
    of it, parented to that flow run, in the pipeline run's lineage log; `inputs(training)` -> the
    START inputs. Yields (the active run, the checkpoint's TrainingRun)."""
    from prefect.runtime import flow_run, task_run

    from flows.run_context import lineage_emitter, lineage_targets, run_links
    from tasks.lineage.runs import training_run_of

    layout = RunLayout(paths["run_dir"])
    # an object-store run's log as the store has it (the train stage pushed the torchrun START before
    # training): this worker's working copy may not be the one of the machine that ran the stages
    log_at = stored(layout.lineage_log)[0] if is_remote(paths["checkpoint"]) else layout.lineage_log
    training = training_run_of(log_at, paths["checkpoint"])
    flow = JobRef(flow_run.flow_name, flow_run.id)
    if task:
        job, up, job_type = JobRef(f"{flow.name}.{task_run.task_name}", task_run.id), flow, "TASK"
        task_run_id = task_run.id
    else:
        job, up, job_type, task_run_id = flow, training.run, "FLOW", None
    tracking_uri = _tracking_uri(cfg)
    links = run_links(tracking_uri, cfg.name, _experiment_id(tracking_uri, mlflow_run_id), mlflow_run_id=mlflow_run_id,
                      flow_run_id=flow_run.id, task_run_id=task_run_id)
    emitter = lineage_emitter(cfg, layout.lineage_log, lineage_targets(cfg)[0])
    with emitter.run(job, parent=up, root=training.root, inputs=inputs(training) if inputs else [],
                     job_type=job_type, run_facets={"crucible_links": links}, job_doc=JOB_DOCS.get(job.name),
                     code_path=TRIGGERS_CODE) as active:
        yield active, training


def _experiment_id(tracking_uri: str, run_id: str | None) -> str | None:
    """The MLflow experiment of the training run (for its page's URL); None if it cannot be read."""
    if not run_id:
        return None
    try:
        from mlflow import MlflowClient

        return MlflowClient(tracking_uri=tracking_uri).get_run(run_id).info.experiment_id
    except Exception:  # noqa: BLE001 - a link, never a failure
        return None


@task(name="evaluate", retry_jitter_factor=0.2, cache_policy=NO_CACHE, persist_result=False)
def evaluate_task(paths: dict, run_id: str | None) -> dict:
    from flows.stage_task import run_facets, stage_energy
    from tasks.core.stage import StageInputs
    from tasks.evaluate import evaluate_checkpoint
    from tasks.evaluate.stage import report_datasets
    from tasks.registry import STAGES

    cfg = _load_cfg(paths)
    stage = STAGES["evaluate"]
    missing = [f"{key} {paths[key]} does not exist" for key in ("checkpoint", "tokenizer", "tokens_index")
               if not _exists(paths[key])]
    read = (None if missing else lambda training: _checkpoint_with_sources(stage.input_datasets(cfg, StageInputs(
        checkpoint=paths["checkpoint"], tokenizer=paths["tokenizer"], tokens_index=paths["tokens_index"])),
        paths, training))
    with triggered_lineage(cfg, paths, run_id, read, task=True) as (active, _):
        if missing:
            raise FileNotFoundError("; ".join(missing))
        with stage_energy(cfg, RunLayout(paths["run_dir"]), "evaluate", active):  # the run summary counts it
            report = evaluate_checkpoint(cfg, paths["checkpoint"], paths["tokenizer"], paths["tokens_index"],
                                         RunLayout(paths["run_dir"]).triggered_eval_report(paths["checkpoint"]),
                                         tracking_uri=_tracking_uri(cfg), run_id=run_id)
        inputs, outputs = report_datasets(cfg, report)
        active.inputs.extend(inputs)
        active.outputs.extend(outputs)
        active.run_facets.update(run_facets(cfg, stage, report))
    return report


def retried(evaluate, stack_cfg):
    """The evaluation task with the run config's retries (stack.eval_retries, exponential backoff)."""
    return evaluate.with_options(retries=stack_cfg.eval_retries, retry_delay_seconds=exponential_backoff(
        backoff_factor=stack_cfg.eval_retry_backoff)(stack_cfg.eval_retries))


def _held_off(deployment: str, checkpoint: str):
    """A CANCELLED state when the pretrain flow run of this checkpoint's run does this flow's work
    itself (its takeover marker, flows/triggered_runs.py: it stopped waiting for this run), before
    any of the work is done; None: do it."""
    from prefect.states import Cancelled

    from flows.triggered_runs import taken_over

    if why := taken_over(deployment, checkpoint):
        get_run_logger().warning("not running %s for %s: %s", deployment, checkpoint, why)
        return Cancelled(message=f"taken over: {why}")
    return None


@flow(name=EVAL_FLOW, log_prints=True)
def evaluate_checkpoint_flow(checkpoint: str, step: str | int | None = None, run_name: str | None = None,
                             run_id: str | None = None) -> dict:
    """Evaluate one checkpoint (one at a time per run), gate it, emit crucible.eval.completed."""
    from prefect.concurrency.sync import concurrency

    from flows.stage_task import stage_energy
    from tasks.deploy.registry import record_gate
    from tasks.deploy.triggered import write_gate
    from tasks.deploy.yardstick import gate_at_evaluation

    run_id, run_name = _none(run_id), _none(run_name)
    if (held := _held_off(EVAL_FLOW, checkpoint)) is not None:
        return held
    paths = trusted_run_paths(checkpoint)  # nothing, lineage included, is written for an untrusted claim
    run_name = run_name or Path(paths["run_dir"]).name
    cfg = _load_cfg(paths)
    with triggered_lineage(cfg, paths, run_id) as (active, training):
        limit = eval_limit_name(run_name)
        ensure_limit(limit)
        with concurrency(limit, occupy=1, strict=True):
            report = retried(evaluate_task, cfg.stack)(paths, run_id)
        # against the champion of now, on the fixed yardstick; deploy-model re-gates if the champion changes.
        # Scoring champion and challenger is the evaluate stage's work, as in the pipeline's evaluate stage
        with stage_energy(cfg, RunLayout(paths["run_dir"]), "evaluate", active):  # the run summary counts it
            decision, yardstick = gate_at_evaluation(cfg, _tracking_uri(cfg), report, paths["tokenizer"])
        active.inputs.extend(_checkpoint_with_sources([dataset_for_path(paths["checkpoint"]),
                                                       dataset_for_path(paths["tokenizer"]),
                                                       dataset_for_path(report["report_path"])], paths, training))
        write_gate(report, decision, yardstick)  # the report's version with the gate's verdict
        push_path(report["report_path"])  # an object-store run: the record is the store's
        doc = DATASET_DOCS["eval_report"].format(checkpoint=Path(paths["checkpoint"]).name)
        active.outputs.append(dataset_for_path(report["report_path"], output=True, doc=doc))
        if not decision["passed"]:  # no deploy-model run follows: the verdict is recorded here
            record_gate(_tracking_uri(cfg), run_id, report.get("step"), decision, yardstick)
        publish_eval_table(paths["run_dir"], run_name)
    step = report.get("step", _none(step))
    payload = {"passed": decision["passed"], "reason": decision["reason"], "val_loss": report["val_loss"],
               "perplexity": report.get("perplexity"), "checkpoint": paths["checkpoint"], "step": step,
               "run_name": run_name, "run_id": run_id, "report_path": report["report_path"],
               "tokenizer": paths["tokenizer"], "task_metrics": report.get("task_metrics", {})}
    _emit(EVAL_EVENT, {"prefect.resource.id": f"crucible.eval.{run_name}.{step}",
                       "crucible.eval.passed": str(decision["passed"]).lower()}, payload)  # after COMPLETE
    print(f"evaluated {paths['checkpoint']}: val_loss {report['val_loss']}; gate: {decision['reason']}")
    return payload


@flow(name=DEPLOY_FLOW, log_prints=True)
def deploy_model_flow(checkpoint: str, report_path: str, run_name: str | None = None,
                      run_id: str | None = None) -> dict:
    """Check the event's claim against the pipeline's records, gate against the current champion
    (on the yardstick), register, alias champion, serve (swap in place). A claim that does not match
    the records is refused and logged as forged; nothing is deployed."""
    from flows.stage_task import model_server_status, serve_model, stage_energy, verify_model
    from tasks.deploy import deploy_if_better
    from tasks.deploy.stage import deploy_outputs
    from tasks.deploy.triggered import ForgedClaim, evaluation_claim_problem, write_deploy_record

    run_id, run_name = _none(run_id), _none(run_name)
    if (held := _held_off(DEPLOY_FLOW, checkpoint)) is not None:
        return held
    paths = trusted_run_paths(checkpoint)  # nothing, lineage included, is written for an untrusted claim
    cfg = _load_cfg(paths)
    recorded = RunLayout(paths["run_dir"]).triggered_eval_report(paths["checkpoint"])  # not the event's path

    def read(training) -> list:
        files = [p for p in (paths["checkpoint"], recorded, paths["tokenizer"]) if _exists(p)]
        return _checkpoint_with_sources([dataset_for_path(p) for p in files], paths, training)

    evaluation, problem = evaluation_claim_problem(paths["checkpoint"], report_path, run_id, _tracking_uri(cfg))
    # a refused claim still gets its FAIL, but never a link to the MLflow run it named
    with triggered_lineage(cfg, paths, None if problem else run_id, read) as (active, _):
        if problem:
            log = get_run_logger()
            log.warning("refusing a forged or stale crucible.eval.completed claim for %s: %s", checkpoint, problem)
            raise ForgedClaim(f"refused: the event's claim does not match the pipeline's records: {problem}")
        with stage_energy(cfg, RunLayout(paths["run_dir"]), "deploy", active):  # the run summary counts it
            result = deploy_if_better(cfg, _tracking_uri(cfg), evaluation, paths["tokenizer"], run_id,
                                      serve_model=serve_model, verify_model=verify_model,
                                      server_status=model_server_status(cfg), lineage_namespace=cfg.lineage.namespace)
        record = RunLayout(paths["run_dir"]).triggered_deploy_record(paths["checkpoint"])
        write_deploy_record(record, result)  # signed: the pretrain flow verifies it (triggered_deployment)
        push_path(record)
        active.outputs.extend(deploy_outputs(_tracking_uri(cfg), result))
    if result.get("version") is not None:
        _emit(DEPLOYED_EVENT, {"prefect.resource.id": f"crucible.model.{result['model_name']}.{result['version']}"},
              {k: result.get(k) for k in ("model_name", "version", "checkpoint", "val_loss", "endpoint")})
    print(f"deploy {checkpoint}: {result['reason']}")
    return result


def build_deployments(job_variables: dict | None = None) -> list:
    """evaluate-checkpoint and deploy-model with their event triggers (module entrypoints: see
    flows/deployments.py, which registers them; `job_variables` for the work pool's jobs)."""
    from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger
    from prefect.types.entrypoint import EntrypointType

    evaluate = evaluate_checkpoint_flow.to_deployment(
        name=EVAL_FLOW, tags=["crucible"], entrypoint_type=EntrypointType.MODULE_PATH, job_variables=job_variables,
        description="Evaluate a checkpoint when training saves it (crucible.checkpoint.saved).",
        triggers=[DeploymentEventTrigger(
            name="on-checkpoint-saved", expect={CHECKPOINT_EVENT},
            match={"prefect.resource.id": "crucible.checkpoint.*"},
            parameters={"checkpoint": "{{ event.payload.path }}", "step": "{{ event.payload.step }}",
                        "run_name": "{{ event.payload.run_name }}", "run_id": "{{ event.payload.run_id }}"})])
    deploy = deploy_model_flow.to_deployment(
        name=DEPLOY_FLOW, tags=["crucible"], concurrency_limit=1, entrypoint_type=EntrypointType.MODULE_PATH,
        job_variables=job_variables,
        description="Register and serve an evaluated checkpoint that passed the gate (crucible.eval.completed).",
        triggers=[DeploymentEventTrigger(
            name="on-eval-passed", expect={EVAL_EVENT},
            match={"prefect.resource.id": "crucible.eval.*", "crucible.eval.passed": "true"},
            parameters={"checkpoint": "{{ event.payload.checkpoint }}",
                        "report_path": "{{ event.payload.report_path }}",
                        "run_name": "{{ event.payload.run_name }}", "run_id": "{{ event.payload.run_id }}"})])
    return [evaluate, deploy]
