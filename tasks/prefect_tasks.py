"""Thin Prefect @task wrappers around the stages' plain-Python logic.

Each wrapper does the same things around the stage function: an MLflow run nested under the
pipeline's parent run (params, counts, timing), OpenLineage START/COMPLETE-or-FAIL for the task run
(Prefect's task-run id is the OpenLineage run id; the parent facet names the enclosing flow run;
`crucible_links` names the MLflow run and the Prefect runs), the real artifacts as lineage
inputs/outputs with their facets, and, when the lineage service is up, a Prefect link artifact to
the lineage page of the stage's main output. Stage logic never imports Prefect.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run, task_run
from tasks.config import PipelineConfig
from tasks.lineage import JobRef, dataset_for_path, model_version_dataset
from tasks.lineage.emitter import (
    CrucibleConfigRunFacet,
    CrucibleEvalRunFacet,
    CrucibleSourceDatasetFacet,
    CrucibleStatsRunFacet,
    file_node,
    model_version_node,
)
from tasks.lineage.artifacts import eval_data_inputs, token_split_paths
from tasks.lineage.facets import parquet_values
from tasks.lineage.torchrun import TorchrunLineage, checkpoint_output
from tasks.pipeline_run import RunContext, create_lineage_link
from tasks.tracking import Tracker

TASKS_CODE = "tasks/prefect_tasks.py"
FLOWS_CODE = "flows/pretrain.py"

# What each job does (the `documentation` job facet).
FLOW_DOCS = {
    "curate": "Subflow: ingest the registered sources, then filter and deduplicate the documents.",
    "train_tokenizer": "Subflow: train the byte-level BPE tokenizer on the curated corpus.",
    "prepare_tokens": "Subflow: encode the curated corpus with the tokenizer and pack it into token shards.",
    "train": "Subflow: train the model with torchrun, writing distributed checkpoints.",
    "evaluate": "Subflow: evaluate every checkpoint (validation loss, perplexity, task suite).",
    "deploy": "Subflow: gate the best checkpoint, register it in MLflow and serve it.",
}
TASK_DOCS = {
    "ingest": "Read the raw files of every registered source (WARC/WET/JSONL/...), extract and normalise the text "
              "and write Parquet document shards; unreadable or oversized records go to quarantine.jsonl.",
    "curate": "Language ID, Gopher quality/repetition, C4 and FineWeb filters, decontamination, PII redaction, "
              "exact and MinHash deduplication of the ingested shards; dropped documents are listed in dropped.jsonl.",
    "quality": "Train (or reuse, by content hash) the fastText quality classifier and the KenLM model, score every "
               "curated document on Ray workers and keep those passing the classifier threshold and KenLM buckets.",
    "tokenizer": "Train a byte-level BPE tokenizer (Hugging Face tokenizers) on the curated shards.",
    "tokens": "Encode the curated shards with the tokenizer and pack the token ids into train/validation shards.",
    "plan": "Price the configured training run with the scaling-law planner: parameters, token budget against "
            "the compute-optimal count, FLOPs, GPU hours, cost, checkpoint size and a parallel layout at scale.",
    "train": "Train the GPT model under torchrun (DDP) on the token shards, saving torch.distributed checkpoints.",
    "evaluate": "Evaluate one checkpoint: validation loss and perplexity, the task suite and sample generations.",
    "deploy": "Gate the best checkpoint on its evaluation, register it as an MLflow model version (alias challenger), "
              "serve it with the OpenAI-compatible model server and, once it answers, promote it to champion.",
    "ablate": "Curation ablation: train the same model with the same token budget on the langid-only and the fully "
              "curated corpus (one tokenizer) and compare their loss on clean held-out text.",
}
# What each artifact is (the `documentation` dataset facet).
DOCS = {
    "plan": "The training run priced by the scaling-law planner (tasks/plan): parameters, token budget, FLOPs, "
            "GPU hours, cost, checkpoint size and parallel layout, as JSON.",
    "raw": "Raw input file of source {source} ({format}) from the config's source registry.",
    "ingest_shard": "Ingested documents: text extracted from the raw records, NFC/whitespace normalised, one row per "
                    "document with its source, licence, URL and raw-file offset (Parquet, tasks/core/documents.py).",
    "quarantine": "Raw records set aside during ingest (unreadable or oversized), one JSON object per record with "
                  "the reason.",
    "curated_shard": "Curated documents: ingested documents that passed language ID, quality, repetition, "
                     "decontamination and deduplication filters, PII redacted (Parquet, same schema as ingest).",
    "dropped": "Documents removed by curation, one JSON object per document with the filter that removed it.",
    "quality_shard": "Quality-filtered documents: curated documents kept by the fastText quality classifier and the "
                     "KenLM perplexity buckets (Parquet, same schema as ingest).",
    "quality_scores": "Per-document quality scores of the curated corpus: classifier score, KenLM perplexity, "
                      "bucket and keep decision (Parquet).",
    "quality_dropped": "Documents removed by the quality stage, one JSON object per document with the reason.",
    "quality_classifier": "fastText quality classifier (reference corpus vs raw crawl) trained by the quality stage.",
    "quality_kenlm": "KenLM n-gram model (binary) trained on the normalised reference corpus by the quality stage.",
    "quality_reference": "Training file of the quality models (reference corpus or raw-crawl negatives).",
    "tokenizer": "Byte-level BPE tokenizer (Hugging Face tokenizers JSON) trained on the curated shards.",
    "tokenizer_report": "Tokenizer validation report: bytes per token per source and language on held-out documents, "
                        "round trip of every held-out document, code/maths/non-Latin-script behaviour vs a reference.",
    "tokens_index": "Index of the packed token shards: splits, token counts, dtype and the tokenizer used.",
    "tokens_split": "Packed token ids of the {split} split (flat binary array, see index.json for the dtype).",
    "eval_report": "Evaluation report of checkpoint {checkpoint}: validation loss, perplexity, task-suite scores and "
                   "sample generations (JSON).",
    "ablation": "Result of the curation ablation: held-out loss of each arm, corpus sizes, token budget (JSON).",
    "model_version": "Registered MLflow model version {name}/{version}: the checkpoint that passed the deployment "
                     "gate, served by the model server.",
}


def _current_flow() -> JobRef:
    return JobRef(flow_run.flow_name, flow_run.id)


@contextmanager
def flow_lineage(cfg: PipelineConfig, ctx: RunContext) -> Iterator[None]:
    """START/COMPLETE for a subflow run, parented to the pretrain flow run."""
    flow = _current_flow()
    links = ctx.links(mlflow_run_id=ctx.mlflow_parent_run_id, flow_run_id=flow.run_id)
    with ctx.emitter(cfg).run(flow, parent=ctx.root, root=ctx.root, job_type="FLOW",
                              run_facets={"crucible_links": links}, job_doc=FLOW_DOCS.get(flow.name),
                              code_path=FLOWS_CODE):
        yield


@contextmanager
def _stage(cfg: PipelineConfig, ctx: RunContext, stage: str, inputs: list) -> Iterator[dict]:
    """MLflow nested run + task-run lineage around one stage; the body fills `out` (inputs and
    outputs known at the end, `result`, and optionally `primary`: the output node to link to)."""
    tracker = Tracker(ctx.tracking_uri, ctx.experiment)
    mlflow_run = tracker.start_run(stage, parent_run_id=ctx.mlflow_parent_run_id,
                                   tags={"crucible.stage": stage, "crucible.run_name": ctx.run_name})
    job = JobRef(f"{flow_run.flow_name}.{task_run.task_name}", task_run.id)
    links = ctx.links(mlflow_run_id=mlflow_run, flow_run_id=flow_run.id, task_run_id=task_run.id)
    out: dict[str, Any] = {"mlflow_run_id": mlflow_run, "inputs": [], "outputs": [], "result": {}, "primary": None,
                           "job": job, "links": links}
    t0 = time.perf_counter()
    try:
        with ctx.emitter(cfg).run(job, parent=_current_flow(), root=ctx.root, inputs=inputs,
                                  run_facets={"crucible_links": links}, job_doc=TASK_DOCS.get(stage),
                                  code_path=TASKS_CODE) as active:
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
    primary = out["primary"] or (_node(out["outputs"][0]) if out["outputs"] else None)
    if primary:
        label = primary.split(":models/", 1)[1] if ":models/" in primary else primary.rsplit("/", 1)[-1]
        create_lineage_link(ctx, primary, f"the {stage} output {label}")


def _node(ds) -> str:
    return f"dataset:{ds.namespace}:{ds.name}"


STAGE_CONFIG = {"ingest": ("sources", "ingest"), "curate": ("curate",), "quality": ("quality",), "tokenizer": ("tokenizer",),
                "tokens": ("tokens",), "plan": ("model", "train", "plan"), "train": ("model", "train"), "evaluate": ("evaluate",), "deploy": ("deploy",),
                "ablate": ("curate", "quality", "tokenizer", "model", "train", "ablate")}


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


def _shard_sources(cfg: PipelineConfig, shard: str | Path) -> CrucibleSourceDatasetFacet | None:
    """The raw sources of one document shard, from its `source` column (None: unknown, so the
    emitter falls back to the union over the stage's inputs)."""
    known = {s.name for s in cfg.sources}
    names = [n for n in parquet_values(shard, "source") if n in known]
    if not names:
        return None
    return CrucibleSourceDatasetFacet.union(
        {"source": n, "licence": e["licence"], "provenance": e["provenance"]}
        for n in names for e in [_source_for(cfg, n)])


def _shard_output(cfg: PipelineConfig, path: str, doc: str):
    return dataset_for_path(path, output=True, doc=doc, source=_shard_sources(cfg, path))


def _optional_file(path: str | None, doc: str) -> list:
    """An extra output file (quarantine, dropped documents) if the stage wrote it."""
    return [dataset_for_path(path, output=True, doc=doc)] if path and Path(path).is_file() else []


TASK_OPTS = dict(cache_policy=NO_CACHE, persist_result=False)


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


@task(name="ingest_sources", **TASK_OPTS)
def ingest_sources(config: dict, ctx: RunContext) -> dict:
    from tasks.ingest import run_ingest

    cfg = PipelineConfig.model_validate(config)
    formats = {s.name: s.format for s in cfg.sources}
    with _stage(cfg, ctx, "ingest", inputs=[]) as out:
        result = run_ingest(cfg, ctx.stage_dir("ingest"), progress=stage_progress("ingest", "source files read"))
        # The raw files read are known only now; COMPLETE carries them as inputs with their licences
        # (local files: remote URIs are not hashed here).
        out["inputs"] += [dataset_for_path(f, source=_source_for(cfg, name),
                                           doc=DOCS["raw"].format(source=name, format=formats.get(name)))
                          for name, info in result["sources"].items() for f in info["files"] if "://" not in f]
        out["outputs"] += [_shard_output(cfg, p, DOCS["ingest_shard"]) for p in result["shards"]]
        out["outputs"] += _optional_file(result.get("quarantine_file"), DOCS["quarantine"])
        out["result"] = result
    return result


@task(name="filter_and_dedup", **TASK_OPTS)
def filter_and_dedup(config: dict, ctx: RunContext, shards: list[str]) -> dict:
    from tasks.curate import run_curate

    cfg = PipelineConfig.model_validate(config)
    with _stage(cfg, ctx, "curate", inputs=[dataset_for_path(p) for p in shards]) as out:
        result = run_curate(cfg, [Path(p) for p in shards], ctx.stage_dir("curate"),
                            progress=stage_progress("curate", "row groups filtered"))
        out["outputs"] += [_shard_output(cfg, p, DOCS["curated_shard"]) for p in result["shards"]]
        out["outputs"] += _optional_file(result.get("dropped_file"), DOCS["dropped"])
        out["result"] = result
        if result.get("dedup"):
            from tasks.dedup.report import report_metrics

            Tracker(ctx.tracking_uri, ctx.experiment).log_metrics(out["mlflow_run_id"], report_metrics(result["dedup"]))
    publish_curation_artifacts(result)
    return result


def publish_curation_artifacts(result: dict) -> None:
    """Per-step counts as a Prefect table, the dataset card as markdown: what a user checks first."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    rows = [{"step": s["name"], "docs_in": s["docs_in"], "docs_out": s["docs_out"],
             "dropped": sum(s["dropped"].values()), "bytes_in": s["bytes_in"], "bytes_out": s["bytes_out"],
             "seconds": s["seconds"]} for s in result["steps"]]
    create_table_artifact(key="curation-steps", table=rows, description="Documents and bytes per curation step")
    reasons = [{"reason": k, "docs": v} for k, v in sorted(result["dropped"].items(), key=lambda kv: -kv[1])]
    create_table_artifact(key="curation-drop-reasons", table=reasons, description="Dropped documents by reason")
    card = result.get("dataset_card")
    if card and Path(card).is_file():
        create_markdown_artifact(key="dataset-card", markdown=Path(card).read_text(),
                                 description="Dataset card of the curated corpus")
    if result.get("dedup"):
        from tasks.dedup.report import report_markdown, report_tables

        tables = report_tables(result["dedup"])
        create_table_artifact(key="dedup-by-source", table=tables["by_source"], description="Duplicate rate per source")
        create_table_artifact(key="dedup-cluster-sizes", table=tables["cluster_sizes"],
                              description="Clusters by number of documents (1: kept documents without copies)")
        create_markdown_artifact(key="dedup-report", markdown=report_markdown(result["dedup"]),
                                 description="Duplicates per source, cluster sizes, example pairs with their Jaccard")


@task(name="quality_filter", **TASK_OPTS)
def quality_filter(config: dict, ctx: RunContext, shards: list[str]) -> dict:
    from tasks.quality.run import run_quality

    cfg = PipelineConfig.model_validate(config)
    with _stage(cfg, ctx, "quality", inputs=[dataset_for_path(p) for p in shards]) as out:
        result = run_quality(cfg, [Path(p) for p in shards], ctx.stage_dir("quality"))
        models = result["models"]
        out["inputs"] += [dataset_for_path(f["path"], doc=DOCS["quality_reference"], source=_training_data_source(cfg, f["path"]))
                          for f in {f["path"]: f for m in models.values() for f in m["training_files"]}.values()]
        out["outputs"] += [_shard_output(cfg, p, DOCS["quality_shard"]) for p in result["shards"]
                           if result["enabled"]]
        out["outputs"] += _optional_file(result.get("scores_file"), DOCS["quality_scores"])
        out["outputs"] += _optional_file(result.get("dropped_file"), DOCS["quality_dropped"])
        out["outputs"] += [dataset_for_path(m["model"], output=True, doc=DOCS[f"quality_{kind}"])
                           for kind, m in models.items()]
        _log_quality_models(ctx, out["mlflow_run_id"], result)
        out["result"] = result
    if result["enabled"]:
        from prefect.artifacts import create_table_artifact

        rows = [{"step": s["name"], "docs_in": s["docs_in"], "docs_out": s["docs_out"],
                 "dropped": sum(s["dropped"].values())} for s in result["steps"]]
        rows += [{"step": f"model: {kind}", "docs_in": None, "docs_out": None,
                  "dropped": None, **{k: m.get("heldout", {}).get(k) for k in ("precision", "recall", "roc_auc")},
                  "reused": m["reused"], "sha256": m["sha256"][:12]} for kind, m in result["models"].items()]
        create_table_artifact(key="quality-steps", table=rows,
                              description="Model-based quality: documents per step and the models used")
    return result


def _training_data_source(cfg: PipelineConfig, path: str) -> dict | None:
    """The licence entry (quality.training_data) of a file the quality models trained on."""
    from fnmatch import fnmatch

    for entry in cfg.quality.training_data:
        if fnmatch(str(Path(path).resolve()), str(Path(cfg.resolve_uri(entry.pattern)).resolve())):
            return {"name": entry.name, "licence": entry.licence, "provenance": entry.provenance}
    return None


def _log_quality_models(ctx: RunContext, run_id: str, result: dict) -> None:
    """Held-out P/R/AUC as metrics; the models (path, sha256, reused) as params and, when small, artifacts."""
    tracker = Tracker(ctx.tracking_uri, ctx.experiment)
    tracker.log_metrics(run_id, result.get("metrics", {}))
    for kind, m in result["models"].items():
        tracker.log_params(run_id, {f"{kind}.model": m["model"], f"{kind}.sha256": m["sha256"],
                                    f"{kind}.key": m["key"], f"{kind}.reused": m["reused"]})
        if Path(m["model"]).stat().st_size <= 64 << 20:
            tracker.log_artifact(run_id, m["model"], f"quality/{kind}")
        info = Path(m["dir"]) / ("metrics.json" if kind == "classifier" else "kenlm.json")
        if info.is_file():
            tracker.log_artifact(run_id, info, f"quality/{kind}")


@task(name="train_bpe", **TASK_OPTS)
def train_bpe(config: dict, ctx: RunContext, shards: list[str]) -> dict:
    from tasks.tokenizer import TokenizerValidationError, train_tokenizer

    cfg = PipelineConfig.model_validate(config)
    with _stage(cfg, ctx, "tokenizer", inputs=[dataset_for_path(p) for p in shards]) as out:
        out_dir = ctx.stage_dir("tokenizer")
        try:
            result = train_tokenizer(cfg, [Path(p) for p in shards], out_dir)
        except TokenizerValidationError:
            publish_tokenizer_report(ctx, out["mlflow_run_id"], out_dir)  # the failing report is what to read
            raise
        publish_tokenizer_report(ctx, out["mlflow_run_id"], out_dir)
        out["outputs"].append(dataset_for_path(result["path"], output=True, doc=DOCS["tokenizer"]))
        out["outputs"].append(dataset_for_path(result["report_path"], output=True, doc=DOCS["tokenizer_report"]))
        out["result"] = result
    return result


def publish_tokenizer_report(ctx: RunContext, mlflow_run_id: str, out_dir: Path) -> None:
    """The validation report as a Prefect markdown + table artifact and as MLflow metrics/artifacts."""
    import json

    from prefect.artifacts import create_markdown_artifact, create_table_artifact
    from tasks.tokenizer.bpe import REPORT_FILE, REPORT_MARKDOWN
    from tasks.tokenizer.report import compression_rows, report_metrics

    report_path, md_path = Path(out_dir) / REPORT_FILE, Path(out_dir) / REPORT_MARKDOWN
    if not report_path.is_file():
        return
    report = json.loads(report_path.read_text())
    create_markdown_artifact(key="tokenizer-report", markdown=md_path.read_text(),
                             description="Tokenizer validation: compression, round trip, code/maths/scripts vs reference")
    create_table_artifact(key="tokenizer-compression", table=compression_rows(report),
                          description="Bytes per token per slice and probe, crucible vs reference tokenizer")
    tracker = Tracker(ctx.tracking_uri, ctx.experiment)
    tracker.log_metrics(mlflow_run_id, report_metrics(report))
    tracker.log_artifact(mlflow_run_id, report_path, "tokenizer")
    tracker.log_artifact(mlflow_run_id, md_path, "tokenizer")


@task(name="encode_and_pack", **TASK_OPTS)
def encode_and_pack(config: dict, ctx: RunContext, tokenizer_path: str, shards: list[str]) -> dict:
    from tasks.tokens import prepare_tokens

    cfg = PipelineConfig.model_validate(config)
    inputs = [dataset_for_path(tokenizer_path)] + [dataset_for_path(p) for p in shards]
    with _stage(cfg, ctx, "tokens", inputs=inputs) as out:
        result = prepare_tokens(cfg, Path(tokenizer_path), [Path(p) for p in shards], ctx.stage_dir("tokens"))
        out["outputs"] += [dataset_for_path(result["index_path"], output=True, doc=DOCS["tokens_index"])]
        out["outputs"] += [dataset_for_path(s["path"], output=True, doc=DOCS["tokens_split"].format(split=name),
                                            rows=s.get("tokens"))
                           for name, s in result["splits"].items()]
        # document start offsets: training reads them for document-aware attention masks
        out["outputs"] += [dataset_for_path(s["doc_starts"], output=True) for s in result["splits"].values()]
        out["result"] = result
    return result


@task(name="plan_training", **TASK_OPTS)
def plan_training(config: dict, ctx: RunContext, tokens_index: str) -> dict:
    from prefect.artifacts import create_markdown_artifact

    from tasks.plan import plan_for_run
    from tasks.plan.cli import format_plan
    from tasks.tokens import load_index

    cfg = PipelineConfig.model_validate(config)
    with _stage(cfg, ctx, "plan", inputs=[dataset_for_path(tokens_index)]) as out:
        result = plan_for_run(cfg, load_index(Path(tokens_index))["vocab_size"])
        path = ctx.stage_dir("plan") / "plan.json"
        path.write_text(json.dumps(result, indent=2) + "\n")
        out["outputs"].append(dataset_for_path(str(path), output=True, doc=DOCS["plan"]))
        out["result"] = dict(result, path=str(path))
        create_markdown_artifact(
            key="training-plan", description="The configured run priced by the scaling-law planner",
            markdown=(f"**{result['params']:,} parameters, {result['tokens']:,} tokens** "
                      f"({result['budget_vs_compute_optimal']:.2f}x the compute-optimal "
                      f"{result['compute_optimal_tokens']:,.0f})\n\n```\n{format_plan(result['plan'])}\n```"))
    return out["result"]


@task(name="torchrun_train", **TASK_OPTS)
def torchrun_train(config: dict, ctx: RunContext, tokens_index: str) -> dict:
    from tasks.train import run_training

    cfg = PipelineConfig.model_validate(config)
    inputs = [dataset_for_path(tokens_index)] + [dataset_for_path(p) for p in token_split_paths(tokens_index)]
    with _stage(cfg, ctx, "train", inputs=inputs) as out:
        # the torchrun job is a lineage run of its own, child of this task run (tasks/lineage/torchrun.py)
        torchrun = TorchrunLineage(ctx.emitter(cfg), parent=out["job"], root=ctx.root,
                                   run_facets={"crucible_links": out["links"]},
                                   tokenizer=Path(ctx.run_dir) / "tokenizer" / "tokenizer.json")
        result = run_training(cfg, Path(tokens_index), ctx.stage_dir("train"), ctx.tracking_uri,
                              out["mlflow_run_id"], ctx.run_name, lineage=torchrun)
        result["lineage_run_id"] = torchrun.run_id
        out["outputs"] += [checkpoint_output(c) for c in result["checkpoints"]]
        if result["checkpoints"]:
            out["primary"] = file_node(result["checkpoints"][-1])
        out["result"] = result
    return result


@task(name="evaluate_checkpoint", **TASK_OPTS)
def evaluate_one(config: dict, ctx: RunContext, checkpoint: str, tokenizer_path: str, tokens_index: str,
                 train_mlflow_run_id: str | None = None) -> dict:
    from tasks.deploy import gate
    from tasks.deploy.registry import champion_val_loss
    from tasks.deploy.triggered import await_evaluation, write_gate
    from tasks.evaluate import evaluate_checkpoint

    cfg = PipelineConfig.model_validate(config)
    inputs = [dataset_for_path(checkpoint), dataset_for_path(tokenizer_path), dataset_for_path(tokens_index)]
    inputs += [dataset_for_path(p) for p in token_split_paths(tokens_index, ("val",))]
    with _stage(cfg, ctx, "evaluate", inputs=inputs) as out:
        # with the stack's triggers service up, the evaluate-checkpoint flow already evaluates each
        # checkpoint as it is saved: collect its report (None: it failed, so evaluate here)
        result = await_evaluation(ctx.run_dir, checkpoint) if ctx.triggered else None
        if result is None:
            report = ctx.stage_dir("evaluate") / f"{Path(checkpoint).name}.json"
            result = evaluate_checkpoint(cfg, Path(checkpoint), Path(tokenizer_path), Path(tokens_index), report,
                                         tracking_uri=ctx.tracking_uri, run_id=train_mlflow_run_id)
            champion_loss = champion_val_loss(ctx.tracking_uri, cfg.deploy.model_name)
            write_gate(result, gate(cfg.deploy, result, champion_loss), champion_loss)  # verdict now, for the table
        out["inputs"] += eval_data_inputs(result, cfg.data_root)  # the benchmark files the suite read
        out["outputs"].append(dataset_for_path(result["report_path"], output=True,
                                               doc=DOCS["eval_report"].format(checkpoint=Path(checkpoint).name)))
        out["result"] = result
    publish_eval_table(ctx.run_dir, ctx.run_name)
    return result


def publish_eval_table(run_dir: str | Path, run_name: str) -> None:
    """All evaluated checkpoints of the run side by side (step, val loss, ppl, suite metrics, gate)
    as a Prefect table artifact keyed per run; every evaluation, triggered or direct, updates it.
    Never raises: the table is a view of the reports on disk."""
    from prefect.artifacts import create_table_artifact

    from tasks.evaluate.compare import checkpoint_rows, table_key

    try:
        rows = checkpoint_rows(run_dir)
        if rows:
            create_table_artifact(key=table_key(run_name), table=rows,
                                  description=f"Checkpoints of run {run_name}: validation loss, perplexity, "
                                              f"task-suite metrics and the deployment gate's verdict")
    except Exception as e:  # noqa: BLE001
        import logging

        logging.getLogger(__name__).warning("could not publish the checkpoint table of %s: %s", run_name, e)


@task(name="gate_register_serve", **TASK_OPTS)
def gate_register_serve(config: dict, ctx: RunContext, evaluation: dict, tokenizer_path: str,
                        train_mlflow_run_id: str | None = None) -> dict:
    from tasks.deploy import deploy_if_better
    from tasks.deploy.triggered import await_deployment

    cfg = PipelineConfig.model_validate(config)
    inputs = [dataset_for_path(evaluation["checkpoint"]), dataset_for_path(evaluation["report_path"]),
              dataset_for_path(tokenizer_path)]
    with _stage(cfg, ctx, "deploy", inputs=inputs) as out:
        # with the stack's triggers service up, deploy-model runs deploy passing checkpoints as they
        # are evaluated: report what they did (None: one failed, so deploy here)
        result = await_deployment(cfg, ctx.tracking_uri, ctx.run_dir, evaluation) if ctx.triggered else None
        if result is None:
            result = deploy_if_better(cfg, ctx.tracking_uri, evaluation, Path(tokenizer_path), train_mlflow_run_id)
        if result.get("version") is not None:
            name, version = result["model_name"], result["version"]
            out["outputs"].append(model_version_dataset(
                ctx.tracking_uri, name, version, content_hash=result["content_hash"],
                doc=DOCS["model_version"].format(name=name, version=version)))
            out["primary"] = model_version_node(ctx.tracking_uri, name, version)
        out["result"] = result
    return result


@task(name="ablate_curation", **TASK_OPTS)
def ablate_curation(config: dict, ctx: RunContext) -> dict:
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from tasks.ablate import ablation_markdown, run_ablation

    cfg = PipelineConfig.model_validate(config)
    with _stage(cfg, ctx, "ablate", inputs=[]) as out:
        result = run_ablation(cfg, ctx.stage_dir("ablate"), ctx.tracking_uri, ctx.experiment,
                              parent_run_id=out["mlflow_run_id"], run_name=ctx.run_name)
        out["inputs"].append(dataset_for_path(result["eval"]["path"]))
        out["outputs"].append(dataset_for_path(Path(ctx.stage_dir("ablate")) / "ablation.json", output=True,
                                               doc=DOCS["ablation"]))
        out["outputs"].append(dataset_for_path(result["tokenizer"]["path"], output=True, doc=DOCS["tokenizer"]))
        out["outputs"] += [checkpoint_output(a["checkpoint"]) for a in result["arms"].values()]
        out["result"] = result
    create_table_artifact(key="ablation", description="Curation ablation: held-out loss per arm", table=[
        {"arm": arm, "docs": a["corpus"]["docs"], "train_tokens": a["train_tokens_available"],
         "tokens_trained": a["tokens_trained"], "epochs": a["epochs"], "heldout_loss": a["heldout_loss"]}
        for arm, a in result["arms"].items()])
    create_markdown_artifact(key="ablation-report", markdown=ablation_markdown(result),
                             description="Curation ablation report")
    return result
