"""Realistic lineage logs written with Crucible's own emitter, for tests, demos and benchmarks.

`emit_pipeline` writes small real files and emits the events one `pretrain` run emits, with the
same flow and task names as flows/pretrain.py: pretrain → curate (ingest_sources,
filter_and_dedup) → train_tokenizer (train_bpe) → prepare_tokens (encode_and_pack) → train
(torchrun_train) → evaluate (evaluate_checkpoint × N) → deploy (gate_register_serve) → a
registered model version. Raw inputs carry their licences (`crucible_source`).

With `stats=True` the stage runs also carry the run facets the provenance report reads
(`crucible_stats` with drop counts, `crucible_config`, `crucible_eval`) and the curated outputs an
`outputStatistics` facet. They are added to the COMPLETE event on its way to the emitter's
transport (see `_RunFacetsClient`); the pipeline itself uses `ActiveRun.run_facets`. Derived
artifacts get the union of their raw sources' licences from the emitter, as in a real run.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import attr
from openlineage.client.event_v2 import RunState
from openlineage.client.facet_v2 import RunFacet, output_statistics_output_dataset

from tasks.lineage.emitter import (
    CrucibleConfigRunFacet,
    CrucibleEvalRunFacet,
    CrucibleStatsRunFacet,
    JobRef,
)
from tasks.lineage.emitter import LineageEmitter, dataset_for_path, model_version_dataset
from tasks.lineage.service.store import node_id

PRODUCER = "https://github.com/crucible-ml/crucible"


class _RunFacetsClient:
    """Wraps the emitter's client: adds queued run facets to a run's COMPLETE event."""

    def __init__(self, client):
        self.client = client
        self.pending: dict[str, dict] = {}

    def emit(self, event) -> None:
        if event.eventType == RunState.COMPLETE and event.run.runId in self.pending:
            for name, facet in self.pending.pop(event.run.runId).items():
                facet._producer = PRODUCER
                event.run.facets[name] = facet
        self.client.emit(event)


# The source registry of configs/tiny.yaml (names, licences, provenance) with raw file names.
DEFAULT_SOURCES = [
    {"name": "docs_crawl", "files": ["docs-crawl-00000.warc.gz", "docs-crawl-00001.warc.gz"],
     "licence": "GPL-2.0+ OR CC-BY-SA-3.0 (Debian handbook); PSF-2.0 (Python docs); GPL-2.0 (kernel docs)",
     "provenance": "Constructed WARC of HTML pages from Debian bookworm packages debian-handbook, python3.11-doc,"
                   " linux-doc-6.1"},
    {"name": "wget_sample", "files": ["wget-sample-0001.warc.gz"],
     "licence": "third-party web content (wget capture), dolma test data Apache-2.0",
     "provenance": "allenai/dolma tests/data/warc/sample-0001.warc.gz"},
    {"name": "cc_main_2019_30", "files": ["cc-main-2019-30-sample.jsonl.gz"],
     "licence": "third-party web content from Common Crawl CC-MAIN-2019-30 (Common Crawl terms of use)",
     "provenance": "allenai/dolma tests/data/formats/gz sample of CC-MAIN-20190717121559-20190717143559-00140"},
    {"name": "cc_net_head", "files": ["cc-net-head-sample.jsonl.gz"],
     "licence": "third-party web content from Common Crawl CC-MAIN-2020-16 (Common Crawl terms of use)",
     "provenance": "allenai/dolma tests/data/multiple_files cc_en_head-0091 + cc_en_head-0174 (cc_net output)"},
]

RAW_DOCS = 150  # documents per raw file (as recorded in the dataQualityMetrics input facet)
FILTER_DROPS = {"langid": 120, "gopher_quality": 84, "gopher_repetition": 17, "c4": 31, "fineweb": 12,
                "exact_dedup": 9, "minhash_dedup": 23}


@dataclass
class SamplePipeline:
    run_name: str
    root: JobRef
    raw_files: list[Path] = field(default_factory=list)
    shards: list[Path] = field(default_factory=list)
    curated: list[Path] = field(default_factory=list)
    tokenizer: Path | None = None
    tokens_index: Path | None = None
    checkpoints: list[Path] = field(default_factory=list)
    reports: list[Path] = field(default_factory=list)
    model_namespace: str = ""
    model_name: str = ""
    model_version_node: str = ""
    runs: dict[str, str] = field(default_factory=dict)  # job name -> run id

    def file_node(self, path: Path) -> str:
        return node_id("DATASET", "file", str(Path(path).resolve()))


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def ensure_raw_files(raw_dir: Path, sources: list[dict]) -> list[tuple[Path, dict]]:
    """Small stand-ins for the raw files of each source (created once, shared by all runs)."""
    out = []
    for src in sources:
        for name in src["files"]:
            path = raw_dir / name
            if not path.exists():
                _write(path, "".join(f"{src['name']} document {i}: {name}\n" for i in range(40)))
            out.append((path, src))
    return out


def emit_pipeline(emitter: LineageEmitter, workdir: str | Path, *, run_name: str = "tiny-run",
                  sources: list[dict] | None = None, raw_dir: str | Path | None = None,
                  tracking_uri: str = "http://127.0.0.1:5000", model_name: str = "crucible-tiny", version: int = 1,
                  resume_from: Path | None = None, n_shards: int = 2, n_checkpoints: int = 2,
                  stats: bool = True) -> SamplePipeline:
    """Write one pipeline run's artifacts under workdir/run_name and emit its lineage events."""
    workdir = Path(workdir)
    run_dir = workdir / run_name
    sources = sources or DEFAULT_SOURCES
    raw = ensure_raw_files(Path(raw_dir) if raw_dir else workdir / "raw", sources)
    client = _RunFacetsClient(emitter.client)
    emitter.client = client
    em = emitter
    new = lambda name: JobRef(name, str(uuid.uuid4()))  # noqa: E731
    p = SamplePipeline(run_name=run_name, root=new("pretrain"), raw_files=[f for f, _ in raw])
    p.runs["pretrain"] = p.root.run_id

    def facets(job: JobRef, **named) -> None:
        if stats:
            client.pending[job.run_id] = named

    def task(flow: JobRef, name: str) -> JobRef:
        job = new(f"{flow.name}.{name}")
        p.runs[job.name] = job.run_id
        return job

    try:
        with em.run(p.root, job_type="FLOW"):
            curate = new("curate")
            with em.run(curate, parent=p.root, root=p.root, job_type="FLOW"):
                ingest = task(curate, "ingest_sources")
                docs_in = RAW_DOCS * len(raw)
                with em.run(ingest, parent=curate, root=p.root) as run:
                    p.shards = [_write(run_dir / "ingest" / f"shard-{i:05d}.parquet", f"{run_name} shard {i}\n" * 30)
                                for i in range(n_shards)]
                    # the raw files read are known at the end: COMPLETE carries them with their licences
                    run.inputs += [dataset_for_path(f, rows=RAW_DOCS, n_bytes=f.stat().st_size, source=src) for f, src in raw]
                    run.outputs += [dataset_for_path(s, output=True) for s in p.shards]
                    facets(ingest, crucible_stats=CrucibleStatsRunFacet(
                        stage="ingest", docs_in=docs_in, docs_out=docs_in - 6,
                        dropped={"extraction_failed": 4, "too_large": 2}))
                filt = task(curate, "filter_and_dedup")
                with em.run(filt, parent=curate, root=p.root, inputs=[dataset_for_path(s) for s in p.shards]) as run:
                    p.curated = [_write(run_dir / "curate" / f"curated-{i:05d}.parquet", f"{run_name} clean {i}\n" * 20)
                                 for i in range(n_shards)]
                    kept = docs_in - 6 - sum(FILTER_DROPS.values())
                    for c in p.curated:
                        out = dataset_for_path(c, output=True)
                        if stats:
                            out.outputFacets = {"outputStatistics": output_statistics_output_dataset.
                                                OutputStatisticsOutputDatasetFacet(rowCount=kept // n_shards,
                                                                                   size=c.stat().st_size)}
                        run.outputs.append(out)
                    facets(filt, crucible_stats=CrucibleStatsRunFacet(
                        stage="curate", docs_in=docs_in - 6, docs_out=kept, dropped=dict(FILTER_DROPS)))
            tok_flow = new("train_tokenizer")
            with em.run(tok_flow, parent=p.root, root=p.root, job_type="FLOW"):
                bpe = task(tok_flow, "train_bpe")
                with em.run(bpe, parent=tok_flow, root=p.root, inputs=[dataset_for_path(c) for c in p.curated]) as run:
                    p.tokenizer = _write(run_dir / "tokenizer" / "tokenizer.json",
                                         json.dumps({"model": {"type": "BPE"}, "run": run_name}))
                    run.outputs.append(dataset_for_path(p.tokenizer, output=True))
                    facets(bpe, crucible_config=CrucibleConfigRunFacet(config={
                        "vocab_size": 4096, "min_frequency": 2, "bos_token": "<|bos|>", "eos_token": "<|endoftext|>"}))
            tokens_flow = new("prepare_tokens")
            with em.run(tokens_flow, parent=p.root, root=p.root, job_type="FLOW"):
                enc = task(tokens_flow, "encode_and_pack")
                with em.run(enc, parent=tokens_flow, root=p.root,
                            inputs=[dataset_for_path(p.tokenizer)] + [dataset_for_path(c) for c in p.curated]) as run:
                    p.tokens_index = _write(run_dir / "tokens" / "index.json", json.dumps({"run": run_name}))
                    splits = [_write(run_dir / "tokens" / f"{s}.bin", f"{run_name} {s}\n") for s in ("train", "val")]
                    run.outputs += [dataset_for_path(f, output=True) for f in [p.tokens_index] + splits]
            train_flow = new("train")
            with em.run(train_flow, parent=p.root, root=p.root, job_type="FLOW"):
                tr = task(train_flow, "torchrun_train")
                inputs = [dataset_for_path(p.tokens_index)] + ([dataset_for_path(resume_from)] if resume_from else [])
                with em.run(tr, parent=train_flow, root=p.root, inputs=inputs) as run:
                    for step in range(1, n_checkpoints + 1):
                        ckpt = run_dir / "train" / f"step-{step * 100:06d}"
                        _write(ckpt / "__0_0.distcp", f"{run_name} weights {step}\n")
                        _write(ckpt / ".metadata", f"{run_name} metadata {step}\n")
                        p.checkpoints.append(ckpt)
                    run.outputs += [dataset_for_path(c, output=True) for c in p.checkpoints]
                    facets(tr, crucible_config=CrucibleConfigRunFacet(config={
                        "model": {"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 128},
                        "train": {"max_steps": 100 * n_checkpoints, "lr": 0.003, "nproc_per_node": 2,
                                  "resume": resume_from is not None}}))
            eval_flow = new("evaluate")
            losses = []
            with em.run(eval_flow, parent=p.root, root=p.root, job_type="FLOW"):
                for i, ckpt in enumerate(p.checkpoints):
                    ev = task(eval_flow, "evaluate_checkpoint")
                    p.runs[f"{ev.name}#{i}"] = ev.run_id
                    with em.run(ev, parent=eval_flow, root=p.root, inputs=[
                            dataset_for_path(ckpt), dataset_for_path(p.tokenizer), dataset_for_path(p.tokens_index)]) as run:
                        loss = round(6.5 - 0.6 * i, 3)
                        losses.append(loss)
                        report = _write(run_dir / "evaluate" / f"{ckpt.name}.json", json.dumps({"val_loss": loss}))
                        p.reports.append(report)
                        run.outputs.append(dataset_for_path(report, output=True))
                        facets(ev, crucible_eval=CrucibleEvalRunFacet(val_loss=loss, perplexity=round(2.718 ** loss, 1),
                                                                      step=100 * (i + 1)))
            deploy_flow = new("deploy")
            with em.run(deploy_flow, parent=p.root, root=p.root, job_type="FLOW"):
                dep = task(deploy_flow, "gate_register_serve")
                best = losses.index(min(losses))
                from tasks.core.hashing import sha256_tree

                with em.run(dep, parent=deploy_flow, root=p.root, inputs=[
                        dataset_for_path(p.checkpoints[best]), dataset_for_path(p.reports[best]),
                        dataset_for_path(p.tokenizer)]) as run:
                    mv = model_version_dataset(tracking_uri, model_name, version, sha256_tree(p.checkpoints[best]))
                    run.outputs.append(mv)
                    p.model_namespace, p.model_name = mv.namespace, mv.name
                    p.model_version_node = node_id("DATASET", mv.namespace, mv.name)
    finally:
        emitter.client = client.client
    return p


def write_sample_log(workdir: str | Path, *, pipelines: int = 1, continued: bool = True, **kwargs) -> tuple[Path, list[SamplePipeline]]:
    """`pipelines` runs into workdir/lineage.jsonl; with `continued`, each run resumes training from
    the previous run's last checkpoint and registers the next model version."""
    workdir = Path(workdir)
    log = workdir / "lineage.jsonl"
    em = LineageEmitter(log, "crucible", PRODUCER)
    out: list[SamplePipeline] = []
    for i in range(pipelines):
        resume = out[-1].checkpoints[-1] if continued and out else None
        out.append(emit_pipeline(em, workdir, run_name=f"tiny-{i:04d}", version=i + 1, resume_from=resume, **kwargs))
    return log, out
