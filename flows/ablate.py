"""The `ablate` flow: does curation help the model?

    ablate
    └── ablate_curation   ingest → curate (a: langid only | b: full + quality) → one tokenizer (b)
                          → tokens ×2 → torchrun training ×2 (same token budget) → held-out loss ×2

Both losses side by side in MLflow (the stage run is the parent of one run per arm) and in Prefect
(table and markdown artifacts); the JSON result in runs/<run>/ablate/ablation.json.
Run it with `crucible ablate CONFIG` (against the local stack) or `python -m flows.ablate CONFIG`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from prefect import flow

from flows.cli import run_flow_cli
from flows.run_context import ablation_scope, new_run_name, open_run
from flows.stage_task import run_stage_task
from infra.settings import CrucibleConfig
from tasks.config import PipelineConfig


@flow(name="ablate")
def ablate(config: dict, run_name: str | None = None) -> dict:
    cfg = CrucibleConfig.model_validate(config)
    run = open_run(cfg, run_name).model_copy(update={"root_job": "ablate"})
    with ablation_scope(cfg, run):
        result = run_stage_task("ablate", cfg, run)
    return {**result.data, "run_name": run.run_name, "run_dir": run.run_dir, "lineage_log": run.lineage_log}


def run_ablation_flow(cfg: PipelineConfig, out: str | Path | None = None, run_name: str | None = None) -> dict:
    """Run the ablate flow (against PREFECT_API_URL if set); write its JSON result to `out` too."""
    result = ablate(config=cfg.model_dump(mode="json"), run_name=run_name or new_run_name(cfg))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    return run_flow_cli("python -m flows.ablate", __doc__, run_ablation_flow, "--out",
                        "also write the JSON result here",
                        ("heldout_loss", "relative_improvement", "run_dir"), argv)


if __name__ == "__main__":
    sys.exit(main())
