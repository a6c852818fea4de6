"""torchrun entry of benchmarks/train_layouts.py: the training worker (tasks.train.worker.main, with the
trainer it builds by default), plus a record per rank of its memory and of what the layout built.

    run_training(..., worker_module="benchmarks.train_layouts_worker")

Each rank writes <out_dir>/layout_ranks/rank<r>.json:
  rss_before_mb      VmRSS once the process group is up and torch imported, before the trainer is built
  peak_train_mb      VmHWM (the kernel's peak resident set of this process) right after the last
                     training step, before its final checkpoint is written
  peak_exit_mb       VmHWM when train() returns (the final checkpoint included)
  model_state_mb     bytes of the parameters, gradients and optimizer states this rank holds (its local
                     shards of DTensors), counted from the tensors after the last step
  built              what the trainer really built on this rank: DTensor mesh dimensions of its
                     parameters, parameter elements held here against the model's, checkpoint
                     wrappers, MoE layers, the sequence positions a cp rank holds (so a layout the trainer ignored is caught, not timed as if it ran)
  cuda_max_allocated_gb, cuda_max_reserved_gb   on a GPU: torch.cuda's peaks over the whole run
The memory is the process's own (/proc/self/status), read by the process itself: nothing samples it
from outside, so no peak between two samples is missed.

With CRUCIBLE_BENCH_NO_CHECKPOINT=1 in the environment no checkpoint is written (benchmarks/
gpu_layouts.py: an 8 B model's weights and Adam moments are ~100 GB, and their write is not a step).
"""
from __future__ import annotations

import inspect
import json
import os
import sys
from pathlib import Path

RANKS_DIR = "layout_ranks"
NO_CHECKPOINT_ENV = "CRUCIBLE_BENCH_NO_CHECKPOINT"


def proc_status_mb(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS, VmHWM) in MiB."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # the kernel reports kB
    raise RuntimeError(f"/proc/self/status has no {field}")


def _modules(trainer) -> list:
    """The nn.Modules this rank trains: the pipeline's stage modules where the trainer has them, else its model."""
    import torch

    for name in ("model_parts", "stage_modules", "stages"):
        parts = getattr(trainer, name, None)
        if parts:
            mods = [getattr(p, "submod", p) for p in parts]
            if all(isinstance(m, torch.nn.Module) for m in mods):
                return mods
    return [trainer.model]


def built_summary(trainer) -> dict:
    """What the layout built on this rank, from the live parameters and modules."""
    from torch.distributed.tensor import DTensor

    mesh_dims: set[str] = set()
    local = logical = 0
    layers: set[str] = set()
    seen: set[int] = set()
    ckpt_wrappers = moe_layers = 0
    for mod in _modules(trainer):
        for name, p in mod.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            logical += p.numel()
            if isinstance(p, DTensor):
                local += p.to_local().numel()
                mesh_dims.update(p.device_mesh.mesh_dim_names or ())
            else:
                local += p.numel()
            parts = name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "").split(".")
            if "blocks" in parts and parts.index("blocks") + 1 < len(parts):
                layers.add(parts[parts.index("blocks") + 1])
        for m in mod.modules():
            cls = type(m).__name__
            ckpt_wrappers += "CheckpointWrapper" in cls
            moe_layers += cls == "MoE"
    cp = getattr(trainer, "context_parallel", None)  # set by the trainer when train.parallel.cp > 1
    return {"trainer": type(trainer).__name__, "dtensor_mesh_dims": sorted(mesh_dims),
            "cp_local_seq_len": None if cp is None else cp.local_len,
            "param_elements_here": int(local), "param_elements_of_modules_here": int(logical),
            "blocks_here": len(layers), "checkpoint_wrappers": int(ckpt_wrappers), "moe_layers": int(moe_layers)}


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def model_state_bytes(trainer) -> dict:
    """Parameters, gradients and optimizer states held on this rank, in bytes (local shards)."""
    import torch

    params = {id(p): p for mod in _modules(trainer) for p in mod.parameters()}
    opt = trainer.optimizer
    optimizers = list(getattr(opt, "optimizers", None) or [opt])
    states = sum(_local_bytes(v) for o in optimizers for st in o.state.values() for v in st.values()
                 if isinstance(v, torch.Tensor))
    return {"params": sum(_local_bytes(p) for p in params.values()),
            "grads": sum(_local_bytes(p.grad) for p in params.values() if p.grad is not None),
            "optimizer": states}


class MeasuredTrainer:
    """Runs a trainer unchanged and records this rank's memory and built layout beside it."""

    def __init__(self, trainer, out_dir: Path, rss_before_mb: float):
        self.trainer, self.out_dir, self.rss_before_mb = trainer, out_dir, rss_before_mb
        self.peak_train_mb = None
        step = trainer.train_step

        def train_step(*args, **kwargs):  # the instance attribute shadows the method train() calls
            result = step(*args, **kwargs)
            self.peak_train_mb = proc_status_mb("VmHWM")
            return result

        trainer.train_step = train_step
        if os.environ.get(NO_CHECKPOINT_ENV) == "1":
            trainer.maybe_checkpoint = lambda *args, **kwargs: None

    def train(self) -> int:
        built = built_summary(self.trainer)
        rc = self.trainer.train()
        import torch.distributed as dist

        states = model_state_bytes(self.trainer)

        record = {"rank": dist.get_rank(), "world": dist.get_world_size(), "rss_before_mb": round(self.rss_before_mb, 1),
                  "peak_train_mb": None if self.peak_train_mb is None else round(self.peak_train_mb, 1),
                  "peak_exit_mb": round(proc_status_mb("VmHWM"), 1),
                  "model_state_mb": {k: round(v / 2**20, 2) for k, v in states.items()}, "built": built}
        device = getattr(self.trainer, "device", None)
        if device is not None and device.type == "cuda":
            import torch

            record["cuda_max_allocated_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
            record["cuda_max_reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        folder = self.out_dir / RANKS_DIR
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{record['rank']}.json").write_text(json.dumps(record) + "\n")
        return rc


def main(argv: list[str] | None = None) -> int:
    from tasks.train import worker

    args = worker.parse_args(argv)
    # whatever trainer the worker builds by default (it may pick one per layout)
    default_factory = inspect.signature(worker.main).parameters["make_trainer"].default

    def make_trainer(cfg, job, events):
        rss = proc_status_mb("VmRSS")
        return MeasuredTrainer(default_factory(cfg, job, events), Path(args.out_dir), rss)

    return worker.main(argv, make_trainer=make_trainer)


if __name__ == "__main__":
    sys.exit(main())
