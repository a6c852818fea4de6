"""Thin Prefect @task wrappers around the stages' plain-Python logic.

Each wrapper does the same three things around the stage function: an MLflow run nested under the
pipeline's parent run (params, counts, timing), OpenLineage START/COMPLETE-or-FAIL for the task run
(Prefect's task-run id is the OpenLineage run id; the parent facet names the enclosing flow run),
and the real artifacts as lineage inputs/outputs. Stage logic never imports Prefect.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run
from tasks.config import PipelineConfig
from tasks.lineage import JobRef, dataset_for_path, model_version_dataset
from tasks.lineage.emitter import CrucibleConfigRunFacet, CrucibleEvalRunFacet, CrucibleStatsRunFacet
from tasks.pipeline_run import RunContext
from tasks.tracking import Tracker


def _current_flow() -> JobRef:
    return JobRef(flow_run.flow_name, flow_run.id)


@contextmanager
def flow_lineage(cfg: PipelineConfig, ctx: RunContext) -> Iterator[None]:
    """START/COMPLETE for a subflow run, parented to the pretrain flow run."""
    with ctx.emitter(cfg).run(_current_flow(), parent=ctx.root, root=ctx.root, job_type="FLOW"):
        yield


@contextmanager
def _stage(cfg: PipelineConfig, ctx: RunContext, stage: str, inputs: list) -> Iterator[dict]:
    """MLflow nested run + task-run lineage around one stage; the body fills `out`."""
    tracker = Tracker(ctx.tracking_uri, ctx.experiment)
    mlflow_run = tracker.start_run(stage, parent_run_id=ctx.mlflow_parent_run_id,
                                   tags={"crucible.stage": stage, "crucible.run_name": ctx.run_name})
    job = JobRef(f"{flow_run.flow_name}.{task_run.task_name}", task_run.id)
    out: dict[str, Any] = {"mlflow_run_id": mlflow_run, "inputs": [], "outputs": [], "result": {}}
    t0 = time.perf_counter()
    try:
        with ctx.emitter(cfg).run(job, parent=_current_flow(), root=ctx.root, inputs=inputs) as active:
            yield out
            active.inputs.extend(out["inputs"])
            active.outputs.extend(out["outputs"])
            active.run_facets.update(_run_facets(cfg, stage, out["result"]))
    except BaseException:
        tracker.end_run(mlflow_run, "FAILED")
        raise
    seconds = time.perf_counter() - t0
    out["result"]["seconds"] = round(seconds, 3)
    out["result"]["mlflow_run_id"] = mlflow_run
    tracker.log_metrics(mlflow_run, {k: v for k, v in out["result"].items() if isinstance(v, (int, float))})
    tracker.log_metrics(mlflow_run, {f"dropped.{k}": v for k, v in out["result"].get("dropped", {}).items()})
    tracker.log_dict(mlflow_run, out["result"], f"{stage}.json")
    tracker.end_run(mlflow_run)


STAGE_CONFIG = {"ingest": ("sources", "ingest"), "curate": ("curate",), "tokenizer": ("tokenizer",),
                "tokens": ("tokens",), "train": ("model", "train"), "evaluate": ("evaluate",), "deploy": ("deploy",)}


def _run_facets(cfg: PipelineConfig, stage: str, result: dict) -> dict:
    """Custom run facets auditors read: the stage's resolved config, its counts, eval results."""
    dumped = cfg.model_dump(mode="json")
    facets = {"crucible_config": CrucibleConfigRunFacet(config={k: dumped[k] for k in STAGE_CONFIG[stage]})}
    if "docs_in" in result:
        facets["crucible_stats"] = CrucibleStatsRunFacet(stage=stage, docs_in=result["docs_in"],
                                                         docs_out=result["docs_out"], dropped=result.get("dropped", {}))
    if stage == "evaluate":
        facets["crucible_eval"] = CrucibleEvalRunFacet(val_loss=result["val_loss"], perplexity=result["perplexity"],
                                                       step=result["step"])
    return facets


def _source_for(cfg: PipelineConfig, name: str) -> dict:
    src = next(s for s in cfg.sources if s.name == name)
    return {"name": src.name, "licence": src.licence, "provenance": src.provenance}


TASK_OPTS = dict(cache_policy=NO_CACHE, persist_result=False)


@task(name="ingest_sources", **TASK_OPTS)
def ingest_sources(config: dict, ctx: RunContext) -> dict:
    from tasks.ingest import run_ingest

    cfg = PipelineConfig.model_validate(config)
    with _stage(cfg, ctx, "ingest", inputs=[]) as out:
        result = run_ingest(cfg, ctx.stage_dir("ingest"))
        # The raw files read are known only now; COMPLETE carries them as inputs with their licences.
        out["inputs"] += [dataset_for_path(f, source=_source_for(cfg, name))
                          for name, info in result["sources"].items() for f in info["files"]]
        out["outputs"] += [dataset_for_path(p, output=True) for p in result["shards"]]
        out["result"] = result
    return result


@task(name="filter_and_dedup", **TASK_OPTS)
def filter_and_dedup(config: dict, ctx: RunContext, shards: list[str]) -> dict:
    from tasks.curate import run_curate

    cfg = PipelineConfig.model_validate(config)
    with _stage(cfg, ctx, "curate", inputs=[dataset_for_path(p) for p in shards]) as out:
        result = run_curate(cfg, [Path(p) for p in shards], ctx.stage_dir("curate"))
        out["outputs"] += [dataset_for_path(p, output=True) for p in result["shards"]]
        out["result"] = result
    return result


@task(name="train_bpe", **TASK_OPTS)
def train_bpe(config: dict, ctx: RunContext, shards: list[str]) -> dict:
    from tasks.tokenizer import train_tokenizer

    cfg = PipelineConfig.model_validate(config)
    with _stage(cfg, ctx, "tokenizer", inputs=[dataset_for_path(p) for p in shards]) as out:
        result = train_tokenizer(cfg, [Path(p) for p in shards], ctx.stage_dir("tokenizer"))
        out["outputs"].append(dataset_for_path(result["path"], output=True))
        out["result"] = result
    return result


@task(name="encode_and_pack", **TASK_OPTS)
def encode_and_pack(config: dict, ctx: RunContext, tokenizer_path: str, shards: list[str]) -> dict:
    from tasks.tokens import prepare_tokens

    cfg = PipelineConfig.model_validate(config)
    inputs = [dataset_for_path(tokenizer_path)] + [dataset_for_path(p) for p in shards]
    with _stage(cfg, ctx, "tokens", inputs=inputs) as out:
        result = prepare_tokens(cfg, Path(tokenizer_path), [Path(p) for p in shards], ctx.stage_dir("tokens"))
        out["outputs"] += [dataset_for_path(result["index_path"], output=True)]
        out["outputs"] += [dataset_for_path(s["path"], output=True) for s in result["splits"].values()]
        out["result"] = result
    return result


@task(name="torchrun_train", **TASK_OPTS)
def torchrun_train(config: dict, ctx: RunContext, tokens_index: str) -> dict:
    from tasks.train import run_training

    cfg = PipelineConfig.model_validate(config)
    with _stage(cfg, ctx, "train", inputs=[dataset_for_path(tokens_index)]) as out:
        result = run_training(cfg, Path(tokens_index), ctx.stage_dir("train"), ctx.tracking_uri,
                              out["mlflow_run_id"], ctx.run_name)
        out["outputs"] += [dataset_for_path(c, output=True) for c in result["checkpoints"]]
        out["result"] = result
    return result


@task(name="evaluate_checkpoint", **TASK_OPTS)
def evaluate_one(config: dict, ctx: RunContext, checkpoint: str, tokenizer_path: str, tokens_index: str,
                 train_mlflow_run_id: str | None = None) -> dict:
    from tasks.evaluate import evaluate_checkpoint

    cfg = PipelineConfig.model_validate(config)
    inputs = [dataset_for_path(checkpoint), dataset_for_path(tokenizer_path), dataset_for_path(tokens_index)]
    with _stage(cfg, ctx, "evaluate", inputs=inputs) as out:
        report = ctx.stage_dir("evaluate") / f"{Path(checkpoint).name}.json"
        result = evaluate_checkpoint(cfg, Path(checkpoint), Path(tokenizer_path), Path(tokens_index), report,
                                     tracking_uri=ctx.tracking_uri, run_id=train_mlflow_run_id)
        out["outputs"].append(dataset_for_path(result["report_path"], output=True))
        out["result"] = result
    return result


@task(name="gate_register_serve", **TASK_OPTS)
def gate_register_serve(config: dict, ctx: RunContext, evaluation: dict, tokenizer_path: str,
                        train_mlflow_run_id: str | None = None) -> dict:
    from tasks.deploy import deploy_if_better

    cfg = PipelineConfig.model_validate(config)
    inputs = [dataset_for_path(evaluation["checkpoint"]), dataset_for_path(evaluation["report_path"]),
              dataset_for_path(tokenizer_path)]
    with _stage(cfg, ctx, "deploy", inputs=inputs) as out:
        result = deploy_if_better(cfg, ctx.tracking_uri, evaluation, Path(tokenizer_path), train_mlflow_run_id)
        if result.get("version") is not None:
            out["outputs"].append(model_version_dataset(ctx.tracking_uri, result["model_name"], result["version"],
                                                        content_hash=result["content_hash"]))
        out["result"] = result
    return result
