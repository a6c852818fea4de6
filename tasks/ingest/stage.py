"""The ingest stage: raw files of every registered source -> Parquet document shards."""
from __future__ import annotations

from typing import Annotated

from tasks.config import PipelineConfig
from tasks.core.sections import Reads
from tasks.core.stage import DocumentsResult, Stage
from tasks.lineage import dataset_for_path
from tasks.lineage.emitter import dataset_for_uri
from tasks.lineage.outputs import DATASET_DOCS, optional_output, shard_output, source_entry


class IngestStage(Stage):
    name, task, flow = "ingest", "ingest_sources", "curate"
    doc = ("Read the raw files of every registered source (WARC/WET/JSONL/...), extract and normalise the text "
           "and write Parquet document shards; unreadable or oversized records go to quarantine.jsonl.")
    result_type = DocumentsResult

    def run(self, cfg: Annotated[PipelineConfig, Reads("sources", "ingest", "ray")], inputs, ctx) -> DocumentsResult:
        from tasks.ingest import run_ingest

        data = run_ingest(cfg, ctx.stage_dir(self.name), progress=ctx.progress("source files read"))
        formats = {s.name: s.format for s in cfg.sources}
        # The raw files read are known only now: COMPLETE carries them as inputs with their licences
        # (a local file versioned by its sha256, a remote object by its ETag: it is not read again).
        options = {s.name: s.storage_options for s in cfg.sources}

        def raw_dataset(name: str, f: str):
            doc = DATASET_DOCS["raw"].format(source=name, format=formats.get(name))
            if "://" in f and not f.startswith("file://"):
                return dataset_for_uri(f, options.get(name), source=source_entry(cfg, name), doc=doc)
            return dataset_for_path(f, source=source_entry(cfg, name), doc=doc)

        raw = [raw_dataset(name, f) for name, info in data["sources"].items() for f in info["files"]]
        outputs = [shard_output(cfg, p, DATASET_DOCS["ingest_shard"]) for p in data["shards"]]
        outputs += optional_output(data.get("quarantine_file"), DATASET_DOCS["quarantine"])
        return DocumentsResult(data, inputs=raw, outputs=outputs)
