"""Launch the training worker under torchrun as a subprocess and summarise the run.

Single node: `torch.distributed.run --standalone --nnodes 1 --nproc_per_node N`.
Several nodes: run `run_training` on every node with the same config; they meet at
cfg.train.rdzv_endpoint (c10d rendezvous, id cfg.train.rdzv_id or the run name). The output
directory must then be on storage every node sees (checkpoints are written by all ranks): a shared
file system, or an object store.

On an object store (out_dir and/or tokens_index fsspec URIs such as s3://bucket/prefix/run/train,
with cfg.storage.options; tasks/core/fs.py): the token files are staged into the node's cache
once, before torchrun starts (tasks/train/remote.py), and the ranks read them from there; checkpoints, their manifest and
rank 0's train_log.jsonl / spikes.jsonl go to out_dir. The worker config and the torchrun log are
written in the node's working directory (remote.run_work_dir, under storage.cache_dir), the log
streamed there as today, and both are copied to out_dir (config when torchrun starts, log when it exits).
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
from tasks.core.signing import SIDECAR_SUFFIX
from tasks.core.fs import is_file, is_remote, join, location, read_text, upload
from tasks.train.checkpoint import list_checkpoints
from tasks.train.metrics import TRAIN_LOG
from tasks.train.remote import run_work_dir, stage_tokens

if TYPE_CHECKING:
    from tasks.lineage.torchrun import TorchrunLineage

TORCHRUN_LOG = "torchrun.log"
CONFIG_JSON = "train_config.json"
WORKER_MODULE = "tasks.train.worker"  # the plain torchrun entry; the pipeline's is flows.train_worker


PIPELINE_CONFIG_PURPOSE = "pipeline-config"  # the config a torchrun worker trains on (tasks/core/signing.py)


def write_train_config(cfg: PipelineConfig, path: str | Path) -> Path:
    """The config as JSON, signed beside it (`<path>.sig`): the worker and each of its elastic restarts
    read it from the run directory, and take it only if the stack signed these bytes."""
    from tasks.core.signing import write_with_signature

    return write_with_signature(path, cfg.model_dump_json(indent=2).encode(), PIPELINE_CONFIG_PURPOSE)


def read_train_config(path: str | Path) -> PipelineConfig:
    """The config `write_train_config` wrote; SignatureError (logged as refused) for any other."""
    from tasks.core.signing import read_with_signature

    return PipelineConfig.model_validate_json(read_with_signature(path, PIPELINE_CONFIG_PURPOSE))


class TrainingError(RuntimeError):
    """torchrun exited non-zero; the message ends with the tail of its log."""


def torchrun_command(cfg: PipelineConfig, config_json: Path, tokens_index: Path | str, out_dir: Path | str,
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


def read_train_log(path: Path | str, storage_options: dict | None = None) -> list[dict]:
    if not is_file(path, storage_options):
        return []
    return [json.loads(line) for line in read_text(path, storage_options).splitlines() if line.strip()]


def run_training(cfg: PipelineConfig, tokens_index: Path | str, out_dir: Path | str, mlflow_tracking_uri: str | None,
                 mlflow_run_id: str | None, run_name: str, lineage: TorchrunLineage | None = None,
                 worker_module: str = WORKER_MODULE) -> dict:
    """Train under torchrun; stream its output to the console and out_dir/torchrun.log.

    Returns {"steps", "first_loss", "final_loss", "checkpoints" (absolute paths, oldest first),
    "log" (torchrun.log), "train_log" (train_log.jsonl), "tokens_per_s" (mean over steps after the
    first), "seconds"}. Raises TrainingError with the log tail when torchrun fails.
    tokens_index and out_dir may be object-store URIs (see the module docstring): "checkpoints" and
    "train_log" are then URIs, "log" the node's local torchrun log (its copy is out_dir/torchrun*.log).
    With `lineage`, the torchrun job is an OpenLineage job run of its own (tasks/lineage/torchrun.py):
    START before torchrun starts, COMPLETE with the checkpoints, or FAIL with the error.
    `worker_module` is the torchrun entry: "flows.train_worker" under the pipeline (it also emits
    Prefect checkpoint events), a test module for fault injection; importable from the repository root.
    """
    if lineage is not None:
        return lineage.around(cfg, tokens_index, lambda: run_training(
            cfg, tokens_index, out_dir, mlflow_tracking_uri, mlflow_run_id, run_name, worker_module=worker_module))
    out_dir, work_dir, tokens_index, staged = _locations(cfg, tokens_index, out_dir)
    storage = cfg.storage.options
    # several "nodes" sharing one out_dir (e.g. on one machine) each keep their own config and log
    suffix = f"-node{cfg.train.node_rank}" if cfg.train.nnodes > 1 and cfg.train.node_rank is not None else ""
    config_json = work_dir / (Path(CONFIG_JSON).stem + suffix + ".json")
    write_train_config(cfg, config_json)
    if is_remote(out_dir):
        for name in (config_json.name, config_json.name + SIDECAR_SUFFIX):
            upload(work_dir / name, join(out_dir, name), storage)

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
    log_path = work_dir / (Path(TORCHRUN_LOG).stem + suffix + ".log")
    t0 = time.perf_counter()
    try:
        rc, tail = _stream(cmd, env, log_path, staged)
    finally:
        if is_remote(out_dir):  # the log is the run's record too (also of a failed run)
            _copy_log(log_path, join(out_dir, log_path.name), storage)
    seconds = time.perf_counter() - t0
    if rc != 0:
        raise TrainingError(f"torchrun exited with code {rc}; full log: {log_path}\n--- last lines ---\n"
                            + "".join(tail))

    records = read_train_log(join(out_dir, TRAIN_LOG), storage)
    if not records:
        raise TrainingError(f"torchrun succeeded but {join(out_dir, TRAIN_LOG)} has no steps; log: {log_path}")
    tps = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]
    return {
        "steps": records[-1]["step"],
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "checkpoints": [p if is_remote(p) else str(p.resolve()) for p in list_checkpoints(out_dir, storage)],
        "log": str(log_path),
        "train_log": str(join(out_dir, TRAIN_LOG)),
        "tokens_per_s": round(sum(tps) / len(tps), 1),
        "seconds": round(seconds, 2),
    }


def _locations(cfg: PipelineConfig, tokens_index: Path | str, out_dir: Path | str
               ) -> tuple[Path | str, Path, Path | str, str]:
    """(out_dir, the node's working dir for the config and log, tokens_index, a line on staging).
    Local paths come back absolute, with the working dir out_dir itself; a remote tokens_index is
    staged into this node's cache here, once, before any rank starts."""
    out_dir, tokens_index, staged = location(out_dir), location(tokens_index), ""
    work_dir = run_work_dir(cfg.storage, out_dir) if is_remote(out_dir) else out_dir.resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    if is_remote(tokens_index):
        local, fetched = stage_tokens(tokens_index, cfg.storage)
        staged = f"[tokens] {tokens_index}: staged in {local} ({fetched} file(s) downloaded)\n"
    else:
        tokens_index = tokens_index.resolve()
    return (out_dir if is_remote(out_dir) else work_dir), work_dir, tokens_index, staged


def _copy_log(log_path: Path, uri: str, storage_options: dict) -> None:
    """Best effort: a store that fails here must not hide how training ended (the log stays on the node)."""
    try:
        upload(log_path, uri, storage_options)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        print(f"[train] WARNING: could not copy {log_path} to {uri}: {type(e).__name__}: {e}", flush=True)


def _stream(cmd: list[str], env: dict, log_path: Path, first_lines: str = "") -> tuple[int, list[str]]:
    """Run torchrun, copying its output to the console and `log_path`; (exit code, last 60 lines)."""
    tail: collections.deque[str] = collections.deque(maxlen=60)
    with open(log_path, "w", encoding="utf-8") as log:
        log.write("$ " + " ".join(cmd) + "\n" + first_lines)
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
            return proc.wait(), list(tail)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
