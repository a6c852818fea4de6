"""The `pretrain` flow: raw web pages → curated corpus → tokenizer → token shards → torchrun training →
evaluation of every checkpoint → gated deployment.

    pretrain
    ├── curate            ingest_sources → filter_and_dedup → quality_filter
    ├── train_tokenizer   train_bpe
    ├── prepare_tokens    encode_and_pack
    ├── train             plan_training → torchrun_train   (emits crucible.checkpoint.saved per checkpoint)
    ├── evaluate          evaluate_checkpoint × N
    └── deploy            gate_register_serve       (best passing checkpoint)

Each task is a registered stage (tasks/registry.py) run by flows/stage_task.py. Run it with
`crucible run CONFIG` (against the local stack), `python -m flows.pretrain CONFIG`, or as the
stack's `pretrain` deployment (the Prefect UI's Run: the stack's worker runs it with the config
`crucible up` registered; flows/deployments.py). With the stack's worker running the
event-triggered flows (flows/triggers.py), they evaluate and deploy the checkpoints while training
runs; `evaluate` and `deploy` then wait on those flow runs through Prefect's client and hand their
results to the same stage tasks, which report them instead of doing the work again
(flows/triggered_runs.py). Without them the stage tasks evaluate and deploy directly.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from prefect import flow

from flows.cli import run_flow_cli
from flows.run_context import RunContext, new_run_name, open_run, pretrain_scope
from flows.stage_task import flow_lineage, run_stage_task
from flows.triggered_runs import collect_deployment, collect_evaluation, flow_run_started, wait_deadline
from flows.triggers import triggers_active
from infra.settings import CrucibleConfig
from tasks.config import PipelineConfig
from tasks.core.constants import PRETRAIN_FLOW
from tasks.core.layout import RunLayout
from tasks.core.stage import (DeployResult, DocumentsResult, EvalResult, PlanResult, StageInputs, TokenizerResult,
                              TokensResult, TrainResult)


@flow(name="curate")
def curate(cfg: PipelineConfig, run: RunContext) -> tuple[DocumentsResult, DocumentsResult, DocumentsResult]:
    with flow_lineage(cfg, run):
        ingested = run_stage_task("ingest", cfg, run)
        curated = run_stage_task("curate", cfg, run, StageInputs(shards=ingested.shards))
        scored = run_stage_task("quality", cfg, run, StageInputs(shards=curated.shards))
    return ingested, curated, scored


@flow(name="train_tokenizer")
def train_tokenizer(cfg: PipelineConfig, run: RunContext, shards: list[str]) -> TokenizerResult:
    with flow_lineage(cfg, run):
        return run_stage_task("tokenizer", cfg, run, StageInputs(shards=shards))


@flow(name="prepare_tokens")
def prepare_tokens(cfg: PipelineConfig, run: RunContext, tokenizer: str, shards: list[str],
                   tokenizer_sha256: str | None = None) -> TokensResult:
    with flow_lineage(cfg, run):
        return run_stage_task("tokens", cfg, run, StageInputs(tokenizer=tokenizer, shards=shards,
                                                              tokenizer_sha256=tokenizer_sha256))


@flow(name="train")
def train(cfg: PipelineConfig, run: RunContext, tokens_index: str, tokenizer: str) -> tuple[PlanResult, TrainResult]:
    with flow_lineage(cfg, run):
        inputs = StageInputs(tokens_index=tokens_index, tokenizer=tokenizer)
        plan = run_stage_task("plan", cfg, run, inputs)
        return plan, run_stage_task("train", cfg, run, inputs)


@flow(name="evaluate")
def evaluate(cfg: PipelineConfig, run: RunContext, checkpoints: list[str], tokenizer: str, tokens_index: str,
             train_run_id: str | None = None) -> list[EvalResult]:
    with flow_lineage(cfg, run):
        # with the stack's triggered flows on, each checkpoint's evaluate-checkpoint run evaluated it:
        # its report, once that run completed, is the stage's input (flows/triggered_runs.py). All are
        # collected first, within one stack.triggered_timeout for the subflow, then the stage tasks run
        triggered = [None] * len(checkpoints)
        if run.triggered:
            deadline, since = wait_deadline(cfg), flow_run_started(run.root_run_id)
            triggered = [collect_evaluation(cfg, run, c, deadline, since) for c in checkpoints]
        return [run_stage_task("evaluate", cfg, run, StageInputs(
            checkpoint=c, tokenizer=tokenizer, tokens_index=tokens_index, train_run_id=train_run_id,
            triggered=t)) for c, t in zip(checkpoints, triggered)]


@flow(name="deploy")
def deploy(cfg: PipelineConfig, run: RunContext, evaluations: list[EvalResult], tokenizer: str,
           train_run_id: str | None = None) -> DeployResult:
    with flow_lineage(cfg, run):
        best = min(evaluations, key=lambda e: e.val_loss)
        return run_stage_task("deploy", cfg, run, StageInputs(
            evaluation=best.data, tokenizer=tokenizer, train_run_id=train_run_id,
            triggered=collect_deployment(cfg, run, best.data, flow_run_started(run.root_run_id))
            if run.triggered else None))


@flow(name=PRETRAIN_FLOW)
def pretrain(config: dict, run_name: str | None = None) -> dict:
    """`config` is the resolved pipeline config as JSON (what a deployment or the UI passes); it is
    validated once, here, and the subflows get the validated PipelineConfig."""
    return pretrain_dag(CrucibleConfig.model_validate(config), run_name)


def pretrain_dag(cfg: PipelineConfig, run_name: str | None = None, root_job: str = "pretrain") -> dict:
    """The pretrain DAG inside the current flow run (`root_job`: that flow's name; the
    continue-pretraining flow bootstraps its first cycle with it)."""
    # with the stack's worker running the event-triggered flows, they evaluate and deploy each
    # checkpoint as it is saved; evaluate/deploy below then wait on those runs and take their results
    run = open_run(cfg, run_name).model_copy(update={"triggered": triggers_active(cfg), "root_job": root_job})
    with pretrain_scope(cfg, run) as summary:
        ingested, curated, scored = curate(cfg, run)
        tok = train_tokenizer(cfg, run, scored.shards)
        tokens = prepare_tokens(cfg, run, tok.path, scored.shards)
        plan, trained = train(cfg, run, tokens.index_path, tok.path)
        evals = evaluate(cfg, run, trained.checkpoints, tok.path, tokens.index_path, trained.mlflow_run_id)
        deployed = deploy(cfg, run, evals, tok.path, trained.mlflow_run_id)
        summary.record(ingest=ingested.data, curate=curated.data, quality=scored.data, tokenizer=tok.data,
                       tokens=tokens.data, plan=plan.data, train=trained.data, evaluate=[e.data for e in evals],
                       deploy=deployed.data)
    return summary.as_dict()


def run_pipeline(cfg: PipelineConfig, summary_path: str | Path | None = None, run_name: str | None = None) -> dict:
    """Run the pretrain flow (against PREFECT_API_URL if set) and return its JSON summary.

    A failed run still writes the summary (status FAILED and the error) before re-raising."""
    return run_summarised(pretrain, cfg, summary_path, run_name)


def run_summarised(root_flow, cfg: PipelineConfig, summary_path: str | Path | None = None,
                   run_name: str | None = None) -> dict:
    """Run a root flow that returns the run's summary (pretrain, curation); see `run_pipeline`."""
    run_name = run_name or new_run_name(cfg)
    state = root_flow(config=cfg.model_dump(mode="json"), run_name=run_name, return_state=True)
    summary = state.result() if state.is_completed() else _failed_summary(cfg, run_name, state)
    if summary_path:
        Path(summary_path).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_path).write_text(json.dumps(summary, indent=2, default=str))
    if not state.is_completed():
        raise RuntimeError(f"{root_flow.name} flow {state.name}: {summary.get('error')}")
    return summary


def _failed_summary(cfg: PipelineConfig, run_name: str, state) -> dict:
    """The summary the flow wrote before failing, else a minimal one."""
    path = RunLayout.for_run(cfg.run_root, run_name).summary_file
    summary = json.loads(path.read_text()) if path.exists() else {"run_name": run_name, "stages": {}}
    summary["status"] = "FAILED"
    summary.setdefault("error", state.message)
    return summary


def main(argv: list[str] | None = None) -> int:
    return run_flow_cli("python -m flows.pretrain", __doc__, run_pipeline, "--summary",
                        "also write the run summary JSON here", ("status", "run_dir", "lineage_log"), argv)


if __name__ == "__main__":
    sys.exit(main())
