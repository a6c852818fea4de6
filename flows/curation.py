"""The `curation` flow: the curation alone, for teams that curate without training and for the
benchmarks.

    curation
    └── curate            ingest_sources → filter_and_dedup → quality_filter

The same subflow, stages, run directory, MLflow parent run, lineage and summary (per-stage counts
and timings) as the pretrain flow, which it stops after. Run it with `crucible curate CONFIG`
(against the local stack) or `python -m flows.curation CONFIG`.
"""
from __future__ import annotations

import sys
from pathlib import Path

from prefect import flow

from flows.cli import run_flow_cli
from flows.pretrain import curate, run_summarised
from flows.run_context import open_run, pretrain_scope
from infra.settings import CrucibleConfig
from tasks.config import PipelineConfig
from tasks.core.constants import CURATION_FLOW


@flow(name=CURATION_FLOW)
def curation(config: dict, run_name: str | None = None) -> dict:
    """`config`: the resolved pipeline config as JSON, validated once, here."""
    cfg = CrucibleConfig.model_validate(config)
    run = open_run(cfg, run_name).model_copy(update={"root_job": CURATION_FLOW})
    with pretrain_scope(cfg, run) as summary:
        ingested, curated, scored = curate(cfg, run)
        summary.record(ingest=ingested.data, curate=curated.data, quality=scored.data)
    return summary.as_dict()


def run_curation(cfg: PipelineConfig, summary_path: str | Path | None = None, run_name: str | None = None) -> dict:
    """Run the curation flow (against PREFECT_API_URL if set) and return its JSON summary; a failed
    run still writes the summary (status FAILED and the error) before re-raising."""
    return run_summarised(curation, cfg, summary_path, run_name)


def main(argv: list[str] | None = None) -> int:
    return run_flow_cli("python -m flows.curation", __doc__, run_curation, "--summary",
                        "also write the run summary JSON here", ("status", "run_dir", "timings_s"), argv)


if __name__ == "__main__":
    sys.exit(main())
