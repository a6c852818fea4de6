"""The `pretrain` flow: raw web pages → curated corpus → tokenizer → token shards → torchrun training →
evaluation of every checkpoint → gated deployment.

    pretrain
    ├── curate            ingest_sources → filter_and_dedup → quality_filter
    ├── train_tokenizer   train_bpe
    ├── prepare_tokens    encode_and_pack
    ├── train             plan_training → torchrun_train   (emits crucible.checkpoint.saved per checkpoint)
    ├── evaluate          evaluate_checkpoint × N
    └── deploy            gate_register_serve       (best passing checkpoint)

Run it with `crucible run CONFIG` (against the local stack) or `python -m flows.pretrain CONFIG`.
With the stack's triggers service up, the event-triggered flows (flows/triggers.py) evaluate and
deploy the checkpoints while training runs; `evaluate` and `deploy` then collect their results
instead of doing the work again. Without it they evaluate and deploy directly.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from prefect import flow

from flows.triggers import triggers_active
from tasks.config import PipelineConfig
from tasks.core.cli import run_flow_cli
from tasks.pipeline_run import RunContext, new_run_name, open_run, pretrain_scope
from tasks.prefect_tasks import (
    encode_and_pack,
    evaluate_one,
    filter_and_dedup,
    flow_lineage,
    gate_register_serve,
    ingest_sources,
    plan_training,
    quality_filter,
    torchrun_train,
    train_bpe,
)


@flow(name="curate")
def curate(config: dict, ctx: RunContext) -> dict:
    with flow_lineage(PipelineConfig.model_validate(config), ctx):
        ingested = ingest_sources(config, ctx)
        curated = filter_and_dedup(config, ctx, ingested["shards"])
        scored = quality_filter(config, ctx, curated["shards"])
    return {"ingest": ingested, "curate": curated, "quality": scored}


@flow(name="train_tokenizer")
def train_tokenizer(config: dict, ctx: RunContext, shards: list[str]) -> dict:
    with flow_lineage(PipelineConfig.model_validate(config), ctx):
        return train_bpe(config, ctx, shards)


@flow(name="prepare_tokens")
def prepare_tokens(config: dict, ctx: RunContext, tokenizer_path: str, shards: list[str]) -> dict:
    with flow_lineage(PipelineConfig.model_validate(config), ctx):
        return encode_and_pack(config, ctx, tokenizer_path, shards)


@flow(name="train")
def train(config: dict, ctx: RunContext, tokens_index: str) -> dict:
    with flow_lineage(PipelineConfig.model_validate(config), ctx):
        plan = plan_training(config, ctx, tokens_index)
        return dict(torchrun_train(config, ctx, tokens_index), plan=plan)


@flow(name="evaluate")
def evaluate(config: dict, ctx: RunContext, checkpoints: list[str], tokenizer_path: str, tokens_index: str,
             train_mlflow_run_id: str | None = None) -> list[dict]:
    with flow_lineage(PipelineConfig.model_validate(config), ctx):
        return [evaluate_one(config, ctx, c, tokenizer_path, tokens_index, train_mlflow_run_id) for c in checkpoints]


@flow(name="deploy")
def deploy(config: dict, ctx: RunContext, evaluations: list[dict], tokenizer_path: str,
           train_mlflow_run_id: str | None = None) -> dict:
    with flow_lineage(PipelineConfig.model_validate(config), ctx):
        best = min(evaluations, key=lambda e: e["val_loss"])
        return gate_register_serve(config, ctx, best, tokenizer_path, train_mlflow_run_id)


@flow(name="pretrain")
def pretrain(config: dict, run_name: str | None = None) -> dict:
    cfg = PipelineConfig.model_validate(config)
    ctx = open_run(cfg, run_name)
    # with the stack's triggers service up, its flows evaluate and deploy each checkpoint as it is
    # saved; evaluate/deploy below then collect their results instead of doing the work again
    ctx = ctx.model_copy(update={"triggered": triggers_active(cfg)})
    with pretrain_scope(cfg, ctx) as summary:
        data = curate(config, ctx)
        shards = data["quality"]["shards"]
        tok = train_tokenizer(config, ctx, shards)
        tokens = prepare_tokens(config, ctx, tok["path"], shards)
        trained = train(config, ctx, tokens["index_path"])
        evals = evaluate(config, ctx, trained["checkpoints"], tok["path"], tokens["index_path"],
                         trained.get("mlflow_run_id"))
        deployed = deploy(config, ctx, evals, tok["path"], trained.get("mlflow_run_id"))
        summary.record(ingest=data["ingest"], curate=data["curate"], quality=data["quality"], tokenizer=tok, tokens=tokens,
                       plan=trained.pop("plan"), train=trained, evaluate=evals, deploy=deployed)
    return summary.as_dict()


def run_pipeline(cfg: PipelineConfig, summary_path: str | Path | None = None, run_name: str | None = None) -> dict:
    """Run the pretrain flow (against PREFECT_API_URL if set) and return its JSON summary.

    A failed run still writes the summary (status FAILED and the error) before re-raising."""
    run_name = run_name or new_run_name(cfg)
    state = pretrain(config=cfg.model_dump(mode="json"), run_name=run_name, return_state=True)
    summary = state.result() if state.is_completed() else _failed_summary(cfg, run_name, state)
    if summary_path:
        Path(summary_path).parent.mkdir(parents=True, exist_ok=True)
        Path(summary_path).write_text(json.dumps(summary, indent=2, default=str))
    if not state.is_completed():
        raise RuntimeError(f"pretrain flow {state.name}: {summary.get('error')}")
    return summary


def _failed_summary(cfg: PipelineConfig, run_name: str, state) -> dict:
    """The summary the flow wrote before failing, else a minimal one."""
    path = Path(cfg.run_root) / run_name / "summary.json"
    summary = json.loads(path.read_text()) if path.exists() else {"run_name": run_name, "stages": {}}
    summary["status"] = "FAILED"
    summary.setdefault("error", state.message)
    return summary


def main(argv: list[str] | None = None) -> int:
    return run_flow_cli("python -m flows.pretrain", __doc__, run_pipeline, "--summary",
                        "also write the run summary JSON here", ("status", "run_dir", "lineage_log"), argv)


if __name__ == "__main__":
    sys.exit(main())
