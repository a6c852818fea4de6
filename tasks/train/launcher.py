"""Launch the training worker under torchrun as a subprocess and summarise the run.

Single node: `torch.distributed.run --standalone --nnodes 1 --nproc_per_node N`.
Several nodes: run `run_training` on every node with the same config; they meet at
cfg.train.rdzv_endpoint (c10d rendezvous, id cfg.train.rdzv_id or the run name). The output
directory must then be on storage every node sees (checkpoints are written by all ranks).
"""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tasks.config import PipelineConfig
from tasks.core.constants import REPO_ROOT
from tasks.train.checkpoint import list_checkpoints
from tasks.train.metrics import TRAIN_LOG

if TYPE_CHECKING:
    from tasks.lineage.torchrun import TorchrunLineage

TORCHRUN_LOG = "torchrun.log"
CONFIG_JSON = "train_config.json"
WORKER_MODULE = "tasks.train.worker"  # the plain torchrun entry; the pipeline's is flows.train_worker


class TrainingError(RuntimeError):
    """torchrun exited non-zero; the message ends with the tail of its log."""


def torchrun_command(cfg: PipelineConfig, config_json: Path, tokens_index: Path, out_dir: Path,
                     run_name: str, run_id: str | None, worker_module: str = WORKER_MODULE) -> list[str]:
    """The torchrun command line that runs `worker_module` (an importable module run with -m)."""
    t = cfg.train
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if t.nnodes == 1:
        cmd += ["--standalone", "--nnodes", "1"]
    else:
        cmd += ["--nnodes", str(t.nnodes), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", str(t.rdzv_endpoint), "--rdzv-id", t.rdzv_id or run_name]
        if t.node_rank is not None:
            # node 0 hosts the rendezvous store at rdzv_endpoint; the others only connect (torchrun's
            # guess from the host name fails when several "nodes" share one machine)
            cmd += ["--node-rank", str(t.node_rank),
                    "--rdzv-conf", f"is_host={'true' if t.node_rank == 0 else 'false'}"]
    # on a worker failure torchrun restarts every worker (up to max_restarts times); a restarted
    # worker sees TORCHELASTIC_RESTART_COUNT > 0 and resumes from the newest checkpoint
    cmd += ["--nproc_per_node", str(t.nproc_per_node), "--max-restarts", str(t.max_restarts),
            "-m", worker_module,
            "--config-json", str(config_json), "--tokens-index", str(tokens_index),
            "--out-dir", str(out_dir), "--run-name", run_name]
    if run_id:
        cmd += ["--run-id", run_id]
    return cmd


def read_train_log(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_training(cfg: PipelineConfig, tokens_index: Path, out_dir: Path, mlflow_tracking_uri: str | None,
                 mlflow_run_id: str | None, run_name: str, lineage: TorchrunLineage | None = None,
                 worker_module: str = WORKER_MODULE) -> dict:
    """Train under torchrun; stream its output to the console and out_dir/torchrun.log.

    Returns {"steps", "first_loss", "final_loss", "checkpoints" (absolute paths, oldest first),
    "log" (torchrun.log), "train_log" (train_log.jsonl), "tokens_per_s" (mean over steps after the
    first), "seconds"}. Raises TrainingError with the log tail when torchrun fails.
    With `lineage`, the torchrun job is an OpenLineage job run of its own (tasks/lineage/torchrun.py):
    START before torchrun starts, COMPLETE with the checkpoints, or FAIL with the error.
    `worker_module` is the torchrun entry: "flows.train_worker" under the pipeline (it also emits
    Prefect checkpoint events), a test module for fault injection; importable from the repository root.
    """
    if lineage is not None:
        with lineage.run(cfg, tokens_index) as job:
            result = run_training(cfg, tokens_index, out_dir, mlflow_tracking_uri, mlflow_run_id, run_name,
                                  worker_module=worker_module)
            job.outputs += lineage.outputs(result)
        return result
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    tokens_index = Path(tokens_index).resolve()
    # several "nodes" sharing one out_dir (e.g. on one machine) each keep their own config and log
    suffix = f"-node{cfg.train.node_rank}" if cfg.train.nnodes > 1 and cfg.train.node_rank is not None else ""
    config_json = out_dir / (Path(CONFIG_JSON).stem + suffix + ".json")
    config_json.write_text(cfg.model_dump_json(indent=2))

    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = str(cfg.train.threads_per_proc)
    # the worker's MLflow target comes only from the arguments, never from a stale environment
    env.pop("MLFLOW_RUN_ID", None)
    env.pop("MLFLOW_TRACKING_URI", None)
    if mlflow_run_id:
        env["MLFLOW_RUN_ID"] = mlflow_run_id
        if mlflow_tracking_uri:
            env["MLFLOW_TRACKING_URI"] = mlflow_tracking_uri
    # make `-m <worker_module>` importable even when the package is not installed
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])

    cmd = torchrun_command(cfg, config_json, tokens_index, out_dir, run_name, mlflow_run_id, worker_module)
    log_path = out_dir / (Path(TORCHRUN_LOG).stem + suffix + ".log")
    tail: collections.deque[str] = collections.deque(maxlen=60)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                text=True, errors="replace", bufsize=1)
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                log.write(line)
                log.flush()
                tail.append(line)
            rc = proc.wait()
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise TrainingError(f"torchrun exited with code {rc}; full log: {log_path}\n--- last lines ---\n"
                            + "".join(tail))

    records = read_train_log(out_dir / TRAIN_LOG)
    if not records:
        raise TrainingError(f"torchrun succeeded but {out_dir / TRAIN_LOG} has no steps; log: {log_path}")
    tps = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]
    return {
        "steps": records[-1]["step"],
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "checkpoints": [str(p.resolve()) for p in list_checkpoints(out_dir)],
        "log": str(log_path),
        "train_log": str(out_dir / TRAIN_LOG),
        "tokens_per_s": round(sum(tps) / len(tps), 1),
        "seconds": round(seconds, 2),
    }
