"""Runs of the real training (tasks.train.run_training under torchrun) in a given train.parallel
layout, compared step by step with a 1-process run on the same global batch (imported, not a conftest).

A layout run trains a small model (4 layers, 4 heads, width 64, 32-token sequences, fp32, no dropout,
no spike detection) for a few steps on the session's token files (lm_helpers.tokens_artifact) with a
fixed global batch (train.batch_tokens), so every layout, whatever its data-parallel size, reads the
same samples in the same steps as the 1-process reference. Each step's loss and grad norm come from
the run's train_log.jsonl; what the trainer really built comes from rank 0's out_dir/layout.json
(tasks/train/metrics.py LAYOUT_FILE: the ParallelDims, each rank's mesh coordinates and per-parameter
placements and local shapes, the activation-checkpointed blocks, the pipeline stages).

    rows = layout_losses(base, 4, train={"parallel": {"dp_shard": 2, "tp": 2}})
    assert_matches_reference(rows, reference_losses(base))

The 1-process reference is cached per (model, common train options) under `base`, so every test
module of a session shares it.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from lm_helpers import tiny_cfg, tokens_artifact

LAYOUT_FILE = "layout.json"  # written by rank 0 of the trainer (tasks/train/metrics.py)

# the layout test model and schedule; tests override single fields through model= / train=
# untied: the dense layouts and the pipeline layouts (whose head lives on another stage than the
# embedding) share one 1-process reference; the tied head under TP is tests/test_parallelize.py's tp 4
LAYOUT_MODEL = {"n_layer": 4, "n_head": 4, "d_model": 64, "seq_len": 32, "dropout": 0.0, "tie_embeddings": False}
GLOBAL_SAMPLES = 8  # sequences per optimizer step in every layout
LAYOUT_TRAIN = {"max_steps": 10, "micro_batch_size": 2, "batch_tokens": GLOBAL_SAMPLES * LAYOUT_MODEL["seq_len"],
                "dtype": "fp32", "spike_detection": False, "checkpoint_every": 1000, "log_every": 1,
                "warmup_steps": 3, "grad_clip": 1.0}
# options that choose how a step is computed, not what it computes: the reference leaves them out
LAYOUT_OPTIONS = ("parallel", "parallelism", "nproc_per_node", "micro_batch_size", "activation_checkpointing",
                  "compile", "stop_at_step", "resume")


@dataclass
class LayoutRun:
    out_dir: Path
    rows: list[dict]  # train_log.jsonl, one record per step
    layout: dict  # rank 0's layout.json ({} if the trainer wrote none)
    log: str  # the torchrun log's text
    checkpoints: list[str]
    mlflow: dict | None = None  # {"tracking_uri", "run_id"} of a run logged to MLflow (a file store)


def layout_cfg(world: int, train: dict | None = None, model: dict | None = None, steps: int = 10):
    """The PipelineConfig of a layout run on `world` processes."""
    model = {**LAYOUT_MODEL, **(model or {})}
    train = {**LAYOUT_TRAIN, "max_steps": steps, "batch_tokens": GLOBAL_SAMPLES * model["seq_len"],
             **(train or {}), "nproc_per_node": world}
    return tiny_cfg(model=model, train=train)


def _key(world: int, train: dict, model: dict, steps: int, mlflow: bool) -> str:
    # the merged options, so that an override equal to the default (tie_embeddings False) shares the run
    blob = json.dumps({"world": world, "train": {**LAYOUT_TRAIN, **train}, "model": {**LAYOUT_MODEL, **model},
                       "steps": steps, "mlflow": mlflow}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def run_layout(base: Path, world: int, train: dict | None = None, model: dict | None = None, steps: int = 10,
               out_dir: Path | None = None, name: str = "layout", mlflow: bool = False) -> LayoutRun:
    """Train `steps` steps in the layout train["parallel"] on `world` processes under torchrun (with
    `mlflow`, logging to a fresh MLflow run in a file store under the run's folder). Without `out_dir`
    the run goes to base/layouts/<hash of the arguments>/ and is reused when it is complete (a run
    with resume or a given out_dir always trains)."""
    import os

    from tasks.train import run_training

    train, model = dict(train or {}), dict(model or {})
    cfg = layout_cfg(world, train, model, steps)
    cached = out_dir is None and not train.get("resume")
    out = out_dir or base / "layouts" / _key(world, train, model, steps, mlflow)
    done = out / "layout-run.done"
    if not (cached and done.is_file()):
        uri = run_id = None
        old = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
        try:
            if mlflow:
                from mlflow import MlflowClient

                os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # a file store keeps the test fast (no DB setup)
                out.mkdir(parents=True, exist_ok=True)
                uri = (out / "mlruns").resolve().as_uri()
                client = MlflowClient(tracking_uri=uri)
                run_id = client.create_run(client.create_experiment(name)).info.run_id
                (out / "mlflow.json").write_text(json.dumps({"tracking_uri": uri, "run_id": run_id}))
            run_training(cfg, Path(tokens_artifact(base)["index_path"]), out, uri, run_id, name)
        finally:
            if old is None:
                os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
            else:
                os.environ["MLFLOW_ALLOW_FILE_STORE"] = old
        if cached:
            done.write_text("ok\n")
    return read_layout_run(out)


# One dp_shard 2 x tp 2 run (selective activation checkpointing, logged to MLflow, checkpoints after
# steps 6 and 10) shared by tests/test_layouts.py (losses, placements, checkpoint wrappers, MLflow
# params) and tests/test_layout_resharding.py (its step-6 checkpoint in other layouts): one 4-process
# launch instead of three. A test that resumes copies the folder and removes the step-10 checkpoint.
SHARED_SAVE_STEP = 6
SHARED_TP_TRAIN = {"parallel": {"dp_shard": 2, "tp": 2}, "activation_checkpointing": "selective",
                   "checkpoint_every": SHARED_SAVE_STEP}


def shared_tp_run(base: Path) -> LayoutRun:
    """The shared dp_shard 2 x tp 2 run (trained on first use, cached under `base`)."""
    return run_layout(base, 4, train=SHARED_TP_TRAIN, mlflow=True)


def copy_at_step(src: Path, out: Path, step: int) -> Path:
    """A copy of the run folder `src` at `out` without its checkpoints after `step`, so a resume there
    continues from `step` (one run serves as both the uninterrupted run and the one to resume)."""
    import shutil

    from tasks.train.checkpoint import list_checkpoints, read_meta, remove_checkpoint

    shutil.copytree(src, out)
    later = [c for c in list_checkpoints(out) if read_meta(c)["step"] > step]
    assert len(later) < len(list_checkpoints(out)), f"{src} has no checkpoint at or before step {step}"
    for c in later:
        remove_checkpoint(c)
    return out


def read_layout_run(out: Path) -> LayoutRun:
    from tasks.train.checkpoint import list_checkpoints

    rows = [json.loads(x) for x in (out / "train_log.jsonl").read_text().splitlines() if x.strip()]
    layout = json.loads((out / LAYOUT_FILE).read_text()) if (out / LAYOUT_FILE).is_file() else {}
    log = (out / "torchrun.log").read_text() if (out / "torchrun.log").is_file() else ""
    mlflow = json.loads((out / "mlflow.json").read_text()) if (out / "mlflow.json").is_file() else None
    return LayoutRun(out, rows, layout, log, [str(p) for p in list_checkpoints(out)], mlflow)


def layout_losses(base: Path, world: int, train: dict | None = None, model: dict | None = None,
                  steps: int = 10) -> list[dict]:
    """Each step's train_log.jsonl record ({"step", "loss", "grad_norm", "data_start", ...}) of a layout run."""
    return run_layout(base, world, train, model, steps).rows


def reference_run(base: Path, train: dict | None = None, model: dict | None = None, steps: int = 10) -> LayoutRun:
    """The 1-process run on the same global batch (gradient accumulation instead of ranks) as a layout
    run given the same `train` / `model`: the layout options (LAYOUT_OPTIONS) are dropped. Cached."""
    common = {k: v for k, v in (train or {}).items() if k not in LAYOUT_OPTIONS}
    return run_layout(base, 1, common, model, steps, name="reference")


def reference_losses(base: Path, train: dict | None = None, model: dict | None = None, steps: int = 10) -> list[dict]:
    return reference_run(base, train, model, steps).rows


def assert_matches_reference(rows: list[dict], ref: list[dict], loss_rel: float = 1e-4,
                             grad_rel: float = 1e-3) -> dict:
    """Step by step: the same steps and data positions, losses within `loss_rel` and grad norms within
    `grad_rel` (relative) of the reference. Returns the largest relative differences seen."""
    assert [r["step"] for r in rows] == [r["step"] for r in ref], ([r["step"] for r in rows], [r["step"] for r in ref])
    assert [r["data_start"] for r in rows] == [r["data_start"] for r in ref]
    worst = {"loss": 0.0, "grad_norm": 0.0}
    for r, q in zip(rows, ref):
        for key, rel in (("loss", loss_rel), ("grad_norm", grad_rel)):
            diff = abs(r[key] - q[key]) / abs(q[key])
            worst[key] = max(worst[key], diff)
            assert diff <= rel, f"step {r['step']}: {key} {r[key]} vs the 1-process {q[key]} (relative {diff:.2e} > {rel})"
    print(f"largest relative differences from the 1-process run: loss {worst['loss']:.2e}, "
          f"grad_norm {worst['grad_norm']:.2e}")
    return worst


def rank_record(layout: dict, rank: int = 0) -> dict:
    """One rank's part of layout.json: {"rank", "coords" {mesh dim: index}, "params" {fqn: {...}}, ...}."""
    return next(r for r in layout["ranks"] if r["rank"] == rank)
