"""The `continue-pretraining` flow: one cycle of scheduled continued pretraining.

    continue-pretraining
    ├── discover          the data ledger's new raw files (none: a "no new data" artifact, done)
    ├── curate            ingest_sources → filter_and_dedup → quality_filter   (only the new files;
    │                     MinHash against the persistent index of everything kept before)
    ├── prepare_tokens    encode_and_pack (the champion's tokenizer, sha256-checked) → mix_replay
    ├── train             plan_training → torchrun_train   (step 0 = the champion's weights; re-warm)
    ├── evaluate          evaluate_checkpoint × N
    └── gate_and_deploy   score_yardstick → gate_register_serve   (champion and challenger on one
                          pinned set, bits per byte: better on the new data, no forgetting)
    then the ledger commits the cycle's files (model registered, or refused by the gate: consumed
    either way); a cycle that fails or is killed commits nothing, so the next one takes them again.

With no champion yet, the cycle bootstraps: the full pretrain DAG (its own tokenizer) on the new
files. `crucible up --config CONFIG` registers this flow as a deployment with continue.schedule
(cron) and a concurrency limit of 1, run by the stack's worker (flows/deployments.py);
`crucible run --continue CONFIG` runs one cycle now.

One cycle of a model at a time, however it was started: a scheduled run due while one is going
waits in Prefect (state AwaitingConcurrencySlot, the deployment's ENQUEUE strategy), and every
cycle, `crucible run --continue` included, holds a lock beside the data ledger
(<state_dir>/continue-<model>.lock): one that finds it taken says so and waits for it.
"""
from __future__ import annotations

import json
import re
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from prefect import flow

from flows.artifacts import publish_quietly
from flows.cli import run_flow_cli
from flows.pretrain import curate, evaluate, prepare_tokens, pretrain_dag, train
from flows.run_context import RunContext, new_run_name, open_run, pretrain_scope
from flows.stage_task import flow_lineage, run_stage_task
from flows.triggers import triggers_active
from infra.settings import CrucibleConfig
from tasks.config import PipelineConfig
from tasks.core.constants import CONTINUE_FLOW
from tasks.core.stage import DeployResult, EvalResult, Markdown, StageInputs, StageResult, TokensResult
from tasks.core.storage import push_path, store_for

CYCLE_TAG = "crucible.cycle"
CYCLE_STATE = ".continue"  # under an object-store run_root: the ledger and the MinHash index


@flow(name="gate_and_deploy")
def gate_and_deploy(cfg: PipelineConfig, run: RunContext, evaluations: list[EvalResult], tokenizer: str,
                    tokens_index: str, replay: dict[str, str],
                    train_run_id: str | None) -> tuple[StageResult, DeployResult]:
    """The best checkpoint against the champion on the yardstick, then the deploy stage with that verdict."""
    with flow_lineage(cfg, run):
        best = min(evaluations, key=lambda e: e.val_loss)
        yardstick = run_stage_task("yardstick", cfg, run, StageInputs(
            evaluation=best.data, tokenizer=tokenizer, tokens_index=tokens_index, replay=replay))
        # deployed here, never by the triggered deploy-model flow (whose gate compares val_loss)
        deployed = run_stage_task("deploy", cfg, run.model_copy(update={"triggered": False}), StageInputs(
            evaluation=best.data | {"yardstick": yardstick.data}, tokenizer=tokenizer, train_run_id=train_run_id))
        return yardstick, deployed


@flow(name="replay_mix")
def replay_mix(cfg: PipelineConfig, run: RunContext, tokens_index: str, replay: dict[str, str]) -> TokensResult:
    with flow_lineage(cfg, run):
        return run_stage_task("mix", cfg, run, StageInputs(tokens_index=tokens_index, replay=replay))


def _state_dir(cfg: PipelineConfig) -> Path:
    from infra.stack import state_dir

    return state_dir(cfg.stack)


def _cycle_state_dir(cfg: PipelineConfig) -> Path:
    """Where the data ledger and the persistent MinHash index live: the stack's state directory,
    or with an object-store run_root <run_root>/.continue, brought from the store before the cycle
    (another machine may have run the last one) and pushed back once it is committed."""
    store = store_for(cfg, check=True)
    if store is None:
        return _state_dir(cfg)
    store.pull(CYCLE_STATE)
    return store.local_root / CYCLE_STATE


def hold_cycle_slot(cfg: PipelineConfig, stack: ExitStack) -> float:
    """Take the model's one cycle slot for the rest of `stack`: an exclusive lock on
    <state_dir>/continue-<model>.lock, beside the ledger it protects (the OS releases it when its
    holder exits or is killed). A cycle that finds it taken says so and waits. Returns the seconds waited."""
    import fcntl

    path = _state_dir(cfg) / f"continue-{re.sub(r'[^A-Za-z0-9_.-]', '_', cfg.deploy.model_name)}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    f = stack.enter_context(open(path, "a+"))
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return 0.0
    except BlockingIOError:
        pass
    print(f"[continue] another cycle of {cfg.deploy.model_name} is running (it holds {path}); this one waits "
          "for it to finish", flush=True)
    t0 = time.monotonic()
    fcntl.flock(f, fcntl.LOCK_EX)
    waited = time.monotonic() - t0
    print(f"[continue] the other cycle finished; starting after {waited:.0f}s of waiting", flush=True)
    return waited


@flow(name=CONTINUE_FLOW)
def continue_pretraining(config: dict, run_name: str | None = None) -> dict:
    """`config` is the resolved pipeline config as JSON (what the deployment passes); validated here."""
    cfg = CrucibleConfig.model_validate(config)
    with ExitStack() as slot:
        waited = hold_cycle_slot(cfg, slot)
        summary = _cycle(cfg, run_name)
        summary["waited_for_other_cycle_s"] = round(waited, 1)
        return summary


def _cycle(cfg: PipelineConfig, run_name: str | None) -> dict:
    from flows.run_context import default_tracking_uri
    from tasks.continued.cycle import cycle_config, find_champion
    from tasks.continued.ledger import Ledger

    state = _cycle_state_dir(cfg)
    ledger = Ledger.for_config(cfg, state)
    discovery = ledger.discover(cfg)
    if discovery.empty:
        publish_quietly([Markdown("continue-no-new-data", f"# No new data\n\n{discovery.message}\n\nNothing was "
                                  "trained; the champion keeps serving.", "Why this cycle trained nothing")])
        print(f"[continue] {discovery.message}", flush=True)
        return {"status": "NO_NEW_DATA", "message": discovery.message, "discovery": discovery.to_dict()}
    tracking_uri = default_tracking_uri(cfg)
    champion = find_champion(cfg, tracking_uri)
    cycle_cfg = cycle_config(cfg, discovery, champion, state)  # refuses a config that would not continue it
    number = int((champion.tags.get(CYCLE_TAG) if champion else 0) or 0) + 1
    run_name = run_name or new_run_name(cfg)
    ledger.pending(run_name, discovery.files)
    print(f"[continue] cycle {number} ({run_name}): {discovery.message}", flush=True)
    if champion is None:
        summary = pretrain_dag(cycle_cfg, run_name, root_job=CONTINUE_FLOW)
    else:
        summary = _continue(cycle_cfg, run_name, champion)
    summary["cycle"] = {"number": number, "discovery": discovery.to_dict(),
                        "champion": champion.to_dict() if champion else None,
                        # rewarm_cosine from the champion, or wsd from its run's pre-decay checkpoint
                        "schedule": {"lr_schedule": "wsd" if cycle_cfg.train.lr_schedule == "wsd" and champion
                                     else "rewarm_cosine" if champion else None,
                                     "init_from": cycle_cfg.train.init_from}}
    _close_cycle(cycle_cfg, ledger, run_name, number, summary, champion)
    push_path(state)  # the committed ledger and the grown index (an object-store run_root)
    return summary


def _continue(cfg: PipelineConfig, run_name: str, champion) -> dict:
    """The cycle's DAG with a champion: curate the new files, encode them with the champion's
    tokenizer, add the replay, train from the champion, evaluate, gate."""
    from tasks.continued.mix import vouched_pool

    run = open_run(cfg, run_name).model_copy(update={"triggered": triggers_active(cfg), "root_job": CONTINUE_FLOW})
    with pretrain_scope(cfg, run) as summary:
        ingested, curated, scored = curate(cfg, run)
        tokenizer = str(champion.tokenizer)
        # held to the champion's signed tokenizer_sha256 on the bytes the stage encodes with
        tokens = prepare_tokens(cfg, run, tokenizer, scored.shards, champion.tokenizer_sha256)
        # {index: sha256} as the champion's signed chain vouches for each: build_mix mixes those bytes or refuses
        pool = vouched_pool(champion.tokens_index, champion.tags.get("data.tokens_index_sha256") or "")
        mix = replay_mix(cfg, run, tokens.index_path, pool)
        plan, trained = train(cfg, run, mix.index_path, tokenizer)
        evals = evaluate(cfg, run, trained.checkpoints, tokenizer, tokens.index_path, trained.mlflow_run_id)
        # the pool with its vouched hashes: a member from before signing is held to its hash, not a signature
        yardstick, deployed = gate_and_deploy(cfg, run, evals, tokenizer, tokens.index_path, pool,
                                              trained.mlflow_run_id)
        summary.record(ingest=ingested.data, curate=curated.data, quality=scored.data, tokens=tokens.data,
                       mix=mix.data | {"trained": _trained_share(cfg, mix.index_path, trained.checkpoints)},
                       plan=plan.data, train=trained.data, evaluate=[e.data for e in evals],
                       yardstick=yardstick.data, deploy=deployed.data)
    return summary.as_dict()


def _trained_share(cfg: PipelineConfig, index_path: str, checkpoints: list[str]) -> dict:
    """The replay share of the tokens the run really trained on (its loader replayed to the last checkpoint)."""
    from tasks.continued.mix import trained_replay_share
    from tasks.core.storage import stored
    from tasks.train.checkpoint import read_meta

    if not checkpoints:
        return {}
    state = read_meta(*stored(checkpoints[-1])).get("trainer") or {}  # an object-store run's: read there
    return trained_replay_share(index_path, cfg.model.seq_len, cfg.train.seed, int(state.get("consumed_samples", 0)),
                                [tuple(r) for r in state.get("skip_ranges", [])])


def _close_cycle(cfg: PipelineConfig, ledger, run_name: str, number: int, summary: dict, champion) -> None:
    """Commit the cycle's files once its model is registered or refused by the gate, and tag the
    cycle's MLflow run and the new model version (cycle number, parent version, previous run)."""
    from tasks.tracking import Tracker

    deployed = summary["stages"].get("deploy") or {}
    version = deployed.get("version")
    note = (f"model {deployed.get('model_name')} version {version} registered" if version is not None
            else f"not promoted: {deployed.get('reason')}")
    ledger.commit(run_name, note=note)
    tracking_uri, run_id = summary["mlflow"]["tracking_uri"], summary["mlflow"]["run_id"]
    tags = {CYCLE_TAG: str(number), "crucible.ledger_note": note}
    if champion is not None:
        tags |= {"crucible.parent_model_version": str(champion.version),
                 "crucible.previous_cycle_run": str(champion.run_name)}
    Tracker(tracking_uri, cfg.name).set_tags(run_id, tags)
    if version is not None and deployed.get("model_name"):
        from tasks.deploy.registry import set_version_tags  # signed, like every tag the pipeline writes

        set_version_tags(tracking_uri, deployed["model_name"], version, {
            CYCLE_TAG: str(number), **({"continued_from": str(champion.version)} if champion is not None else {})})
    summary["cycle"]["ledger"] = note
    path = Path(summary["run_dir"]) / "summary.json"
    path.write_text(json.dumps(summary, indent=2, default=str))


def run_cycle(cfg: PipelineConfig, summary_path: str | Path | None = None, run_name: str | None = None) -> dict:
    """Run one cycle (against PREFECT_API_URL if set) and return its summary."""
    state = continue_pretraining(config=cfg.model_dump(mode="json"), run_name=run_name, return_state=True)
    if not state.is_completed():
        raise RuntimeError(f"{CONTINUE_FLOW} flow {state.name}: {state.message}")
    summary = state.result()
    if summary_path:
        Path(summary_path).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_path).write_text(json.dumps(summary, indent=2, default=str))
    return summary


def build_deployment(cfg: PipelineConfig, job_variables: dict | None = None):
    """The continue-pretraining deployment: this config as its parameters, the cron schedule of
    continue.schedule (none: on demand only), and at most one cycle at a time (a run due while one is
    going is enqueued and starts when it ends: Prefect's ENQUEUE collision strategy). A module
    entrypoint, `job_variables` for the work pool's jobs (flows/deployments.py registers it)."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.types.entrypoint import EntrypointType

    c = cfg.continue_
    schedules = [CronSchedule(cron=c.schedule, timezone=c.timezone)] if c.schedule else None
    return continue_pretraining.to_deployment(
        name=CONTINUE_FLOW, parameters={"config": cfg.model_dump(mode="json")}, schedules=schedules,
        entrypoint_type=EntrypointType.MODULE_PATH, job_variables=job_variables, tags=["crucible"],
        concurrency_limit=ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE),
        description=f"Continued pretraining of {cfg.deploy.model_name} on the new files of {len(cfg.sources)} "
                    f"source(s); schedule {c.schedule or 'none (on demand)'} ({c.timezone}).")


def set_schedule(cfg: PipelineConfig, cron: str | None = None, paused: bool | None = None) -> dict:
    """Change the registered deployment's schedule (a new cron, in continue.timezone) and/or pause or
    resume it; returns {"deployment", "schedules": [{"cron", "timezone", "active"}], "paused"}."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule

    from tasks.core.constants import CONTINUE_DEPLOYMENT

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name(CONTINUE_DEPLOYMENT)
        if cron is not None:
            schedule = CronSchedule(cron=cron, timezone=cfg.continue_.timezone)
            for existing in client.read_deployment_schedules(deployment.id):
                client.delete_deployment_schedule(deployment.id, existing.id)
            client.create_deployment_schedules(deployment.id, [DeploymentScheduleCreate(schedule=schedule, active=True)])
        if paused is True:
            client.pause_deployment(deployment.id)
        elif paused is False:
            client.resume_deployment(deployment.id)
        deployment = client.read_deployment(deployment.id)
        return {"deployment": CONTINUE_DEPLOYMENT, "paused": deployment.paused,
                "schedules": [{"cron": getattr(s.schedule, "cron", None), "timezone": getattr(s.schedule, "timezone", None),
                               "active": s.active} for s in client.read_deployment_schedules(deployment.id)]}


def main(argv: list[str] | None = None) -> int:
    return run_flow_cli("python -m flows.continued", __doc__, run_cycle, "--summary",
                        "also write the cycle's JSON summary here", ("status", "run_dir", "message"), argv)


if __name__ == "__main__":
    sys.exit(main())
