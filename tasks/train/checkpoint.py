"""Checkpoints with torch.distributed.checkpoint (DCP), as torchtitan does.

Layout: out_dir/checkpoints/step-000100/ holds the DCP files (.metadata, __*_*.distcp) with

    {"model": model state (FQNs without the DDP "module." prefix),
     "optim": {"state": AdamW moments per parameter FQN},
     "train": {"step": tensor}}

and, beside them, crucible_checkpoint.json: step, model config, vocab size, eos id, run ids.
Only tensors go into DCP (the optimizer's param groups are rebuilt from the config), so nothing is
ever unpickled on load. A checkpoint is written into step-XXXXXX.tmp and renamed once complete,
so a directory named step-XXXXXX is always whole.

`load_model_for_inference` works in a plain process without a process group.
"""
from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from tasks.train.model import GPT, GPTConfig

META_FILE = "crucible_checkpoint.json"
FORMAT = "torch.distributed.checkpoint"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_dir(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step-{step:06d}"


def list_checkpoints(out_dir: str | Path) -> list[Path]:
    """Complete checkpoints under out_dir/checkpoints, oldest first."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / META_FILE).is_file()]
    return [p for _, p in sorted(found)]


def read_meta(ckpt_dir: str | Path) -> dict:
    return json.loads((Path(ckpt_dir) / META_FILE).read_text())


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def save_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    out_dir: str | Path, meta: dict) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory."""
    final = checkpoint_dir(out_dir, step)
    tmp = final.with_name(final.name + ".tmp")
    rank = _rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier()
    osd = get_optimizer_state_dict(model, optimizer)
    state = {
        "model": get_model_state_dict(model),
        "optim": {"state": osd["state"]},
        "train": {"step": torch.tensor(step, dtype=torch.int64)},
    }
    dcp.save(state, checkpoint_id=str(tmp))  # returns on every rank once the metadata is written
    if rank == 0:
        full_meta = {"format": FORMAT, "step": step, **meta}
        (tmp / META_FILE).write_text(json.dumps(full_meta, indent=2) + "\n")
        if final.exists():  # a rerun of the same out_dir without resume
            shutil.rmtree(final)
        tmp.rename(final)
    _barrier()
    return final


def load_checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, ckpt_dir: str | Path) -> int:
    """Collective resume: load model and optimizer state in place; returns the checkpoint's step."""
    osd = get_optimizer_state_dict(model, optimizer)  # initialises moments so shapes are known
    state = {
        "model": get_model_state_dict(model),
        "optim": {"state": osd["state"]},
        "train": {"step": torch.tensor(0, dtype=torch.int64)},
    }
    dcp.load(state, checkpoint_id=str(ckpt_dir))
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer,
                             {"state": state["optim"]["state"], "param_groups": osd["param_groups"]},
                             options=StateDictOptions(strict=True))
    return int(state["train"]["step"])


def load_model_for_inference(ckpt_dir: str | Path, device: str | torch.device = "cpu"
                             ) -> tuple[GPT, dict]:
    """Build the model from the checkpoint's JSON and load its weights (no process group needed).

    Returns (model in eval mode, meta dict).
    """
    ckpt_dir = Path(ckpt_dir)
    if not (ckpt_dir / META_FILE).is_file():
        raise FileNotFoundError(f"{ckpt_dir} is not a complete checkpoint (no {META_FILE})")
    meta = read_meta(ckpt_dir)
    cfg = GPTConfig(**meta["model"])
    model = GPT(cfg)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=True)
    model.load_state_dict(state["model"], strict=True)
    model.to(device).eval()
    return model, meta
