"""The private torch APIs the trainer relies on, looked up in one place.

torch makes no promise about underscored names: an upgrade may move or drop one. Each use in
tasks/train goes through `private(name)`, so a missing one fails with an error naming the API, what
the trainer needs it for, the installed torch and the version this code was written against, rather
than as an AttributeError deep inside a training process. tests/test_torch_private.py resolves every
entry against the installed torch, so an upgrade that breaks one fails there first.
"""
from __future__ import annotations

import functools
import importlib

import torch

WRITTEN_FOR = "2.13"  # the pinned torch (pyproject.toml) these uses were written and tested against

# name -> (module, attribute path, what the trainer uses it for)
PRIVATE_APIS: dict[str, tuple[str, str, str]] = {
    "DeviceMesh._flatten": ("torch.distributed.device_mesh", "DeviceMesh._flatten",
                            "the flattened dp, dp_shard_cp and dp_cp meshes (parallel_dims.build_mesh), "
                            "the experts' FSDP mesh dp_shard_mod_ep_cp (expert_parallel.expert_mesh)"),
    "DeviceMesh._unflatten": ("torch.distributed.device_mesh", "DeviceMesh._unflatten",
                              "the ep mesh carved from dp_shard (expert_parallel.expert_mesh)"),
    "_current_graph_task_id": ("torch._C", "_current_graph_task_id",
                               "MoE token counts skipping activation recomputation (moe._in_backward)"),
    "SAC_IGNORED_OPS": ("torch.utils.checkpoint", "SAC_IGNORED_OPS",
                        "selective activation checkpointing ignoring profiler markers (parallelize)"),
    "checkpoint_wrapper": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "checkpoint_wrapper",
                           "activation checkpointing of blocks (parallelize.apply_ac)"),
    "CheckpointImpl": ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "CheckpointImpl",
                       "activation checkpointing of blocks (parallelize.apply_ac)"),
    "FSDPModule._get_fsdp_state": ("torch.distributed.fsdp", "FSDPModule._get_fsdp_state",
                                   "naming FSDP's mesh in the start-up line (parallelize.describe_built)"),
    "_PipelineSchedule._initialize_pp_stages": (
        "torch.distributed.pipelining.schedules", "_PipelineSchedule._initialize_pp_stages",
        "the pipeline's shape inference not counted as MoE tokens (pipeline.schedule_for)"),
    "FileSystem": ("torch.distributed.checkpoint._fsspec_filesystem", "FileSystem",
                   "checkpoints written onto object stores (checkpoint._dcp_target)"),
    "CUSTOM_METADATA_KEY": ("torch.distributed.checkpoint._hf_utils", "CUSTOM_METADATA_KEY",
                            "reading checkpoint shards' offsets (checkpoint.checkpoint_tensors)"),
    "SAVED_OFFSETS_KEY": ("torch.distributed.checkpoint._hf_utils", "SAVED_OFFSETS_KEY",
                          "reading checkpoint shards' offsets (checkpoint.checkpoint_tensors)"),
}


@functools.cache
def private(name: str):
    """The private torch object `name` (a key of PRIVATE_APIS); RuntimeError naming it if missing."""
    module, path, used_for = PRIVATE_APIS[name]
    try:
        obj = importlib.import_module(module)
        for part in path.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise RuntimeError(f"torch {torch.__version__} has no {module}.{path}, a private torch API the trainer "
                           f"uses for {used_for}; this code was written for torch {WRITTEN_FOR}: install that "
                           "version, or port this use to the installed one") from None
    return obj
