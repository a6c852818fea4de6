"""Realistic lineage logs written with Crucible's own emitter, for tests, demos and benchmarks.

`emit_pipeline` writes small real files and emits the events one `pretrain` run emits. The flows,
their tasks and the lineage job names (`<flow>.<task>`) and documentation come from the stage
registry (tasks/registry.py), so the sample follows the pipeline as stages are added:

    pretrain → curate (ingest_sources, filter_and_dedup, quality_filter) → train_tokenizer (train_bpe)
    → prepare_tokens (encode_and_pack) → train (plan_training, torchrun_train)
    → evaluate (evaluate_checkpoint × N) → deploy (gate_register_serve) → a registered model version.

What each stage reads and writes is written here (SAMPLE_STAGES, one function per stage); a stage
registered without one fails loudly. Raw inputs carry their licences (`crucible_source`), and files
go where a real run keeps them (tasks.core.layout.RunLayout).

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
from typing import Callable

from openlineage.client.event_v2 import RunState
from openlineage.client.facet_v2 import output_statistics_output_dataset

from tasks.core.hashing import sha256_tree
from tasks.core.layout import RunLayout
from tasks.core.stage import Stage
from tasks.lineage.emitter import JobRef, LineageEmitter, dataset_for_path, file_node, model_version_dataset, model_version_node
from tasks.lineage.facets import CrucibleConfigRunFacet, CrucibleEvalRunFacet, CrucibleStatsRunFacet
from tasks.registry import FLOW_DOCS, PRETRAIN_FLOWS

PRODUCER = "https://github.com/crucible-ml/crucible"
ROOT_FLOW = "pretrain"


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
INGEST_DROPS = {"extraction_failed": 4, "too_large": 2}
FILTER_DROPS = {"langid": 120, "gopher_quality": 84, "gopher_repetition": 17, "c4": 31, "fineweb": 12,
                "exact_dedup": 9, "minhash_dedup": 23}
QUALITY_DROPS = {"quality_classifier": 41, "kenlm_tail": 18}


@dataclass
class SamplePipeline:
    run_name: str
    root: JobRef
    raw_files: list[Path] = field(default_factory=list)
    shards: list[Path] = field(default_factory=list)
    curated: list[Path] = field(default_factory=list)
    quality: list[Path] = field(default_factory=list)
    tokenizer: Path | None = None
    tokens_index: Path | None = None
    plan: Path | None = None
    checkpoints: list[Path] = field(default_factory=list)
    reports: list[Path] = field(default_factory=list)
    val_losses: list[float] = field(default_factory=list)  # per checkpoint, as evaluated
    model_namespace: str = ""
    model_name: str = ""
    model_version_node: str = ""
    runs: dict[str, str] = field(default_factory=dict)  # job name -> run id

    def file_node(self, path: Path) -> str:
        return file_node(path)


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


@dataclass
class _SampleRun:
    """One sample pipeline run while its events are emitted: what the stage writers share."""
    em: LineageEmitter
    client: _RunFacetsClient
    p: SamplePipeline
    layout: RunLayout
    raw: list[tuple[Path, dict]]
    stats: bool
    n_shards: int
    n_checkpoints: int
    resume_from: Path | None
    tracking_uri: str
    model_name: str
    version: int

    def facets(self, job: JobRef, **named) -> None:
        if self.stats:
            self.client.pending[job.run_id] = named

    def job(self, flow: JobRef, stage: Stage) -> JobRef:
        """A new run of the stage's lineage job, `<flow>.<task>` as the pipeline names it."""
        job = JobRef(f"{flow.name}.{stage.task}", str(uuid.uuid4()))
        self.p.runs[job.name] = job.run_id
        return job

    def run(self, job: JobRef, flow: JobRef, stage: Stage, inputs: list | None = None):
        return self.em.run(job, parent=flow, root=self.p.root, inputs=inputs, job_doc=stage.doc)

    def shards(self, stage: str, prefix: str, line: str, repeat: int) -> list[Path]:
        folder = self.layout.stage_dir(stage)
        return [_write(folder / f"{prefix}-{i:05d}.parquet", f"{self.p.run_name} {line} {i}\n" * repeat)
                for i in range(self.n_shards)]

    @property
    def docs_in(self) -> int:
        return RAW_DOCS * len(self.raw)


def _ingest(s: _SampleRun, flow: JobRef, stage: Stage) -> None:
    job = s.job(flow, stage)
    with s.run(job, flow, stage) as run:
        s.p.shards = s.shards(stage.name, "shard", "shard", 30)
        # the raw files read are known at the end: COMPLETE carries them with their licences
        run.inputs += [dataset_for_path(f, rows=RAW_DOCS, n_bytes=f.stat().st_size, source=src) for f, src in s.raw]
        run.outputs += [dataset_for_path(f, output=True) for f in s.p.shards]
        s.facets(job, crucible_stats=CrucibleStatsRunFacet(
            stage=stage.name, docs_in=s.docs_in, docs_out=s.docs_in - sum(INGEST_DROPS.values()),
            dropped=dict(INGEST_DROPS)))


def _curate(s: _SampleRun, flow: JobRef, stage: Stage) -> None:
    job = s.job(flow, stage)
    with s.run(job, flow, stage, inputs=[dataset_for_path(f) for f in s.p.shards]) as run:
        s.p.curated = s.shards(stage.name, "curated", "clean", 20)
        docs_in = s.docs_in - sum(INGEST_DROPS.values())
        kept = docs_in - sum(FILTER_DROPS.values())
        for c in s.p.curated:
            out = dataset_for_path(c, output=True)
            if s.stats:
                out.outputFacets = {"outputStatistics": output_statistics_output_dataset.
                                    OutputStatisticsOutputDatasetFacet(rowCount=kept // s.n_shards,
                                                                       size=c.stat().st_size)}
            run.outputs.append(out)
        s.facets(job, crucible_stats=CrucibleStatsRunFacet(
            stage=stage.name, docs_in=docs_in, docs_out=kept, dropped=dict(FILTER_DROPS)))


def _quality(s: _SampleRun, flow: JobRef, stage: Stage) -> None:
    job = s.job(flow, stage)
    with s.run(job, flow, stage, inputs=[dataset_for_path(f) for f in s.p.curated]) as run:
        s.p.quality = s.shards(stage.name, "quality", "good", 15)
        run.outputs += [dataset_for_path(f, output=True) for f in s.p.quality]
        docs_in = s.docs_in - sum(INGEST_DROPS.values()) - sum(FILTER_DROPS.values())
        s.facets(job, crucible_stats=CrucibleStatsRunFacet(
            stage=stage.name, docs_in=docs_in, docs_out=docs_in - sum(QUALITY_DROPS.values()),
            dropped=dict(QUALITY_DROPS)))


def _tokenizer(s: _SampleRun, flow: JobRef, stage: Stage) -> None:
    job = s.job(flow, stage)
    with s.run(job, flow, stage, inputs=[dataset_for_path(f) for f in s.p.quality]) as run:
        s.p.tokenizer = _write(s.layout.tokenizer_file, json.dumps({"model": {"type": "BPE"}, "run": s.p.run_name}))
        run.outputs.append(dataset_for_path(s.p.tokenizer, output=True))
        s.facets(job, crucible_config=CrucibleConfigRunFacet(config={
            "vocab_size": 4096, "min_frequency": 2, "bos_token": "<|bos|>", "eos_token": "<|endoftext|>"}))


def _tokens(s: _SampleRun, flow: JobRef, stage: Stage) -> None:
    job = s.job(flow, stage)
    inputs = [dataset_for_path(s.p.tokenizer)] + [dataset_for_path(f) for f in s.p.quality]
    with s.run(job, flow, stage, inputs=inputs) as run:
        s.p.tokens_index = _write(s.layout.tokens_index, json.dumps({"run": s.p.run_name}))
        splits = [_write(s.layout.tokens_index.parent / f"{split}.bin", f"{s.p.run_name} {split}\n")
                  for split in ("train", "val")]
        run.outputs += [dataset_for_path(f, output=True) for f in [s.p.tokens_index] + splits]


def _plan(s: _SampleRun, flow: JobRef, stage: Stage) -> None:
    job = s.job(flow, stage)
    with s.run(job, flow, stage, inputs=[dataset_for_path(s.p.tokens_index)]) as run:
        s.p.plan = _write(s.layout.plan_file, json.dumps({"params": 1_000_000, "tokens": 20_000_000}))
        run.outputs.append(dataset_for_path(s.p.plan, output=True))


def _train(s: _SampleRun, flow: JobRef, stage: Stage) -> None:
    job = s.job(flow, stage)
    inputs = [dataset_for_path(s.p.tokens_index)] + ([dataset_for_path(s.resume_from)] if s.resume_from else [])
    with s.run(job, flow, stage, inputs=inputs) as run:
        for step in range(1, s.n_checkpoints + 1):
            ckpt = s.layout.checkpoints_dir / f"step-{step * 100:06d}"
            _write(ckpt / "shard-00000-model-00001-of-00001.safetensors", f"{s.p.run_name} weights {step}\n")
            _write(ckpt / "crucible_checkpoint.json", f"{s.p.run_name} meta {step}\n")
            s.p.checkpoints.append(ckpt)
        run.outputs += [dataset_for_path(c, output=True) for c in s.p.checkpoints]
        s.facets(job, crucible_config=CrucibleConfigRunFacet(config={
            "model": {"n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 128},
            "train": {"max_steps": 100 * s.n_checkpoints, "lr": 0.003, "nproc_per_node": 2,
                      "resume": s.resume_from is not None}}))


def _evaluate(s: _SampleRun, flow: JobRef, stage: Stage) -> None:
    """One run per checkpoint (the same job); runs["<job>#i"] names each, runs["<job>"] the last."""
    for i, ckpt in enumerate(s.p.checkpoints):
        job = s.job(flow, stage)
        s.p.runs[f"{job.name}#{i}"] = job.run_id
        inputs = [dataset_for_path(ckpt), dataset_for_path(s.p.tokenizer), dataset_for_path(s.p.tokens_index)]
        with s.run(job, flow, stage, inputs=inputs) as run:
            loss = round(6.5 - 0.6 * i, 3)
            s.p.val_losses.append(loss)
            report = _write(s.layout.eval_report(ckpt), json.dumps({"val_loss": loss}))
            s.p.reports.append(report)
            run.outputs.append(dataset_for_path(report, output=True))
            s.facets(job, crucible_eval=CrucibleEvalRunFacet(val_loss=loss, perplexity=round(2.718 ** loss, 1),
                                                             step=100 * (i + 1)))


def _deploy(s: _SampleRun, flow: JobRef, stage: Stage) -> None:
    job = s.job(flow, stage)
    best = s.p.val_losses.index(min(s.p.val_losses))
    inputs = [dataset_for_path(s.p.checkpoints[best]), dataset_for_path(s.p.reports[best]),
              dataset_for_path(s.p.tokenizer)]
    with s.run(job, flow, stage, inputs=inputs) as run:
        mv = model_version_dataset(s.tracking_uri, s.model_name, s.version, sha256_tree(s.p.checkpoints[best]))
        run.outputs.append(mv)
        s.p.model_namespace, s.p.model_name = mv.namespace, mv.name
        s.p.model_version_node = model_version_node(s.tracking_uri, s.model_name, s.version)


# What each registered stage of the pretrain flow reads and writes in the sample.
SAMPLE_STAGES: dict[str, Callable[[_SampleRun, JobRef, Stage], None]] = {
    "ingest": _ingest, "curate": _curate, "quality": _quality, "tokenizer": _tokenizer, "tokens": _tokens,
    "plan": _plan, "train": _train, "evaluate": _evaluate, "deploy": _deploy}


def emit_pipeline(emitter: LineageEmitter, workdir: str | Path, *, run_name: str = "tiny-run",
                  sources: list[dict] | None = None, raw_dir: str | Path | None = None,
                  tracking_uri: str = "http://127.0.0.1:5000", model_name: str = "crucible-tiny", version: int = 1,
                  resume_from: Path | None = None, n_shards: int = 2, n_checkpoints: int = 2,
                  stats: bool = True) -> SamplePipeline:
    """Write one pipeline run's artifacts under workdir/run_name and emit its lineage events."""
    workdir = Path(workdir)
    missing = [s.name for f in PRETRAIN_FLOWS for s in f.stages if s.name not in SAMPLE_STAGES]
    if missing:
        raise KeyError(f"no sample writer for the registered stage(s) {missing}: add them to SAMPLE_STAGES")
    raw = ensure_raw_files(Path(raw_dir) if raw_dir else workdir / "raw", sources or DEFAULT_SOURCES)
    client = _RunFacetsClient(emitter.client)
    p = SamplePipeline(run_name=run_name, root=JobRef(ROOT_FLOW, str(uuid.uuid4())), raw_files=[f for f, _ in raw])
    p.runs[ROOT_FLOW] = p.root.run_id
    s = _SampleRun(emitter, client, p, RunLayout(workdir / run_name), raw, stats, n_shards, n_checkpoints,
                   resume_from, tracking_uri, model_name, version)
    emitter.client = client
    try:
        with emitter.run(p.root, job_type="FLOW", job_doc=FLOW_DOCS.get(ROOT_FLOW)):
            for spec in PRETRAIN_FLOWS:
                flow = JobRef(spec.name, str(uuid.uuid4()))
                with emitter.run(flow, parent=p.root, root=p.root, job_type="FLOW", job_doc=spec.doc):
                    for stage in spec.stages:
                        SAMPLE_STAGES[stage.name](s, flow, stage)
    finally:
        emitter.client = client.client
    return p


def write_sample_log(workdir: str | Path, *, pipelines: int = 1, continued: bool = True,
                     **kwargs) -> tuple[Path, list[SamplePipeline]]:
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
