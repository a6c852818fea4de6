"""Training metrics from rank 0: a console line, train_log.jsonl and MLflow.

Every step goes to the console, to train_log.jsonl and (buffered, flushed with log_batch every
`log_every` steps and at the end) to MLflow with its step number, so the MLflow history holds
every step too.
MLflow is used only when a run id is given (the launcher passes MLFLOW_TRACKING_URI and
MLFLOW_RUN_ID); a failed flush keeps the buffer and retries at the next one.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

log = logging.getLogger("crucible.train")

TRAIN_LOG = "train_log.jsonl"
SPIKE_LOG = "spikes.jsonl"
LAYOUT_FILE = "layout.json"  # rank 0: what the trainer built on every rank (rank_layout), once per launch
# jsonl field -> MLflow metric key
MLFLOW_KEYS = {"loss": "train_loss", "grad_norm": "grad_norm", "lr": "lr", "tokens_per_s": "tokens_per_s"}


class MetricsLogger:
    def __init__(self, out_dir: str | Path, max_steps: int, log_every: int,
                 tracking_uri: str | None = None, run_id: str | None = None, resume_step: int = 0):
        """resume_step > 0 keeps the log's records up to that step (later ones were not
        checkpointed and are redone); 0 starts a new log."""
        self.path = Path(out_dir) / TRAIN_LOG
        self.max_steps, self.log_every = max_steps, log_every
        kept = []
        if resume_step > 0 and self.path.is_file():
            kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                    if line.strip() and json.loads(line)["step"] <= resume_step]
        self._file = open(self.path, "w", encoding="utf-8")
        self._file.writelines(line + "\n" for line in kept)
        self._client = None
        self._run_id = run_id
        self._pending: list = []
        if run_id:
            from mlflow import MlflowClient  # imported only when used: it is slow to import

            self._client = MlflowClient(tracking_uri=tracking_uri)
            print(f"[metrics] logging to MLflow run {run_id} at {self._client.tracking_uri}", flush=True)
        else:
            print("[metrics] MLFLOW_RUN_ID not set: not logging to MLflow", flush=True)

    def log_step(self, step: int, **values: float) -> None:
        rec = {"step": step, **{k: (float(f"{v:.7g}") if isinstance(v, float) else v) for k, v in values.items()}}
        self._file.write(json.dumps(rec) + "\n")
        self._file.flush()
        if self._client is not None:
            from mlflow.entities import Metric

            ts = int(time.time() * 1000)
            self._pending += [Metric(MLFLOW_KEYS.get(k, k), float(v), ts, step)
                              for k, v in values.items() if isinstance(v, (int, float))]
        parts = [f"step {step:5d}/{self.max_steps}"]
        for k, v in values.items():
            parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
        print(" | ".join(parts), flush=True)
        if step == 1 or step % self.log_every == 0 or step == self.max_steps:
            self.flush()

    def rewind(self, step: int) -> None:
        """Drop the log's records after `step` (a loss-spike rollback redoes those steps)."""
        self._file.close()
        kept = [line for line in self.path.read_text(encoding="utf-8").splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        self._file = open(self.path, "w", encoding="utf-8")
        self._file.writelines(line + "\n" for line in kept)
        self._file.flush()

    def log_spike(self, step: int, action: str, **details) -> None:
        """A loss-spike action: a line in spikes.jsonl, an MLflow metric (spike_skip /
        spike_rollback = 1 at that step) and the tag spike.last_action."""
        rec = {"step": step, "action": action, **details}
        with open(self.path.parent / SPIKE_LOG, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"[spike] step {step}: {action} " + json.dumps(details), flush=True)
        if self._client is not None:
            from mlflow.entities import Metric

            self._pending.append(Metric(f"spike_{action}", 1.0, int(time.time() * 1000), step))
            try:
                self._client.set_tag(self._run_id, "spike.last_action", f"{action}@{step}")
            except Exception as e:
                print(f"[metrics] WARNING: MLflow set_tag failed: {e}", flush=True)
            self.flush()

    def log_params(self, params: dict) -> None:
        if self._client is None:
            return
        from mlflow.entities import Param

        existing = self._client.get_run(self._run_id).data.params
        fresh = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in existing]
        try:
            for i in range(0, len(fresh), 100):
                self._client.log_batch(self._run_id, params=fresh[i:i + 100])
        except Exception as e:  # params are context; never fail training on them
            print(f"[metrics] WARNING: MLflow log_params failed: {e}", flush=True)

    def flush(self) -> bool:
        if self._client is None or not self._pending:
            return True
        try:
            for i in range(0, len(self._pending), 1000):  # MLflow caps a batch at 1000 metrics
                self._client.log_batch(self._run_id, metrics=self._pending[i:i + 1000])
        except Exception as e:
            print(f"[metrics] WARNING: MLflow log_batch failed ({len(self._pending)} pending, will retry): {e}",
                  flush=True)
            return False
        self._pending = []
        return True

    def close(self) -> None:
        if not self.flush():
            print(f"[metrics] WARNING: {len(self._pending)} metric values never reached MLflow", flush=True)
        self._file.close()


# ---------------------------------------------------------------- what was built (layout.json)

# wrapper attributes that torch inserts into parameter names (activation checkpointing, torch.compile)
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def clean_fqn(name: str) -> str:
    """A parameter's name as the model and its checkpoints spell it (wrappers' attributes removed)."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def rank_layout(model_parts: list, rank: int, mesh=None) -> dict:
    """This rank's part of layout.json: its mesh coordinates, and per parameter (clean FQN) whether it
    is a DTensor, its mesh dims and placements, global and local shapes; per transformer block its
    module type, whether FSDP2 manages it and whether its activations are recomputed. The record is
    read back from the modules (not from the config), so a test asserts what really ran."""
    from torch.distributed.tensor import DTensor

    coords = {}
    if mesh is not None:
        coords = {name: int(mesh[name].get_local_rank()) for name in mesh.mesh_dim_names}
    params, blocks = {}, {}
    for i, part in enumerate(model_parts):
        for name, p in part.named_parameters():
            rec = {"part": i, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
            if isinstance(p, DTensor):
                rec.update(dtensor=True, mesh_dims=list(p.device_mesh.mesh_dim_names or ()),
                           placements=[str(pl) for pl in p.placements], local_shape=list(p.to_local().shape))
            else:
                rec.update(dtensor=False, local_shape=list(p.shape))
            params[clean_fqn(name)] = rec
        for name, m in part.named_modules():
            parts = clean_fqn(name + ".").rstrip(".").split(".")
            if len(parts) == 2 and parts[0] == "blocks" and parts[1].isdigit():
                rec = blocks.setdefault(parts[1], {"part": i, "types": [], "selective": False})
                rec["types"].append(type(m).__name__)
                # torchtitan's selective policy reaches torch's checkpoint as a context_fn
                fn = getattr(m, "checkpoint_fn", None)
                rec["selective"] |= "context_fn" in (getattr(fn, "keywords", None) or {})
    for rec in blocks.values():
        types = rec.pop("types")
        rec["type"] = types[0]
        rec["fsdp"] = any(t.startswith("FSDP") for t in types)
        rec["checkpointed"] = any("CheckpointWrapper" in t for t in types)
    return {"rank": rank, "coords": coords, "params": params, "blocks": blocks}
