"""The `ablate` flow: does curation help the model?

    ablate
    └── ablate_curation   ingest → curate (a: langid only | b: full + quality) → one tokenizer (b)
                          → tokens ×2 → torchrun training ×2 (same token budget) → held-out loss ×2

Both losses side by side in MLflow (the stage run is the parent of one run per arm) and in Prefect
(table and markdown artifacts); the JSON result in runs/<run>/ablate/ablation.json.
Run it with `crucible ablate CONFIG` (against the local stack) or `python -m flows.ablate CONFIG`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from prefect import flow

from tasks.ablate.run import ablation_scope
from tasks.config import ConfigError, PipelineConfig, load_config
from tasks.pipeline_run import new_run_name, open_run
from tasks.prefect_tasks import ablate_curation


@flow(name="ablate")
def ablate(config: dict, run_name: str | None = None) -> dict:
    cfg = PipelineConfig.model_validate(config)
    ctx = open_run(cfg, run_name).model_copy(update={"root_job": "ablate"})
    with ablation_scope(cfg, ctx):
        result = ablate_curation(config, ctx)
    return {**result, "run_name": ctx.run_name, "run_dir": ctx.run_dir, "lineage_log": ctx.lineage_log}


def run_ablation_flow(cfg: PipelineConfig, out: str | Path | None = None, run_name: str | None = None) -> dict:
    """Run the ablate flow (against PREFECT_API_URL if set); write its JSON result to `out` too."""
    result = ablate(config=cfg.model_dump(mode="json"), run_name=run_name or new_run_name(cfg))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.ablate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=None, help="also write the JSON result here")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    result = run_ablation_flow(cfg, args.out)
    print(json.dumps({k: result[k] for k in ("heldout_loss", "relative_improvement", "run_dir")}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
