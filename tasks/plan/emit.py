"""A plan (tasks.plan.planner.make_plan) as the config settings that train it: `crucible plan ...
--emit-config PATH`.

The fragment holds the planned layout as train.parallel (the planner's tp, pp and context parallel
cp, which a long sequence needs; its dp as FSDP's dp_shard within groups of plan.fsdp_shard_limit,
replicated dp_replicate times; FSDP shards over dp_shard x cp), the pipeline
schedule (1f1b, the one the planner's bubble is computed for) and its micro-batches, the
micro-batch size (one sequence per GPU: what the planner's activation estimate assumes), activation
checkpointing, the processes (nproc_per_node x nnodes), the model's shape and, for a mixture of
experts, model.moe and the plan's expert parallelism (train.parallel.ep). With a base config
(`--config BASE`) the written file is BASE with the fragment merged in, a config `crucible run
PATH` runs unchanged; without one, the fragment alone, validated
against the defaults, to merge into a config of one's own. Either way it is checked with the
pipeline config's own validation (ParallelDims.from_config included) before it is written.
"""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

DEFAULT_RDZV = "node-0:29500"  # a multi-node plan's rendezvous until --rdzv-endpoint names the first node


def config_fragment(plan: dict, gpus_per_node: int, rdzv_endpoint: str | None = None) -> dict:
    """The `model` / `train` / `plan` settings that train `plan` on its GPUs."""
    lay, gpus = plan["layout"], plan["gpus"]
    tp, pp, dp = lay["tp"], lay["pp"], lay["dp"]
    # processes per node: a whole node where the GPUs fill nodes, else the largest node-sized
    # divisor of the GPU count holding whole tp groups (tensor parallelism stays inside a node)
    nproc = max(n for n in range(1, min(gpus, gpus_per_node) + 1) if gpus % n == 0 and n % tp == 0)
    nnodes = gpus // nproc
    micro, accum = 1, (lay["microbatches"] if pp > 1 else 1)
    model = {"n_layer": plan["n_layer"], "d_model": plan["d_model"], "n_head": plan["n_head"],
             "seq_len": plan["seq_len"]}
    if pp > 1:
        model["tie_embeddings"] = False  # the embedding and the output head sit on different stages
    if plan.get("moe"):
        moe = plan["moe"]
        model["moe"] = {"n_experts": moe["n_experts"], "top_k": moe["top_k"], "expert_hidden": moe["expert_hidden"]}
    # no `parallelism: fsdp2`: an explicit layout (dp_shard is always given) sets it aside
    # (ParallelDims.from_config); FSDP2 is what every explicit layout uses
    train = {"nproc_per_node": nproc, "nnodes": nnodes, "device": "cuda", "backend": "nccl", "dtype": "bf16",
             "micro_batch_size": micro, "grad_accum_steps": accum,
             "batch_tokens": micro * dp * accum * plan["seq_len"],
             "activation_checkpointing": "full" if lay["activation_checkpointing"] else "none",
             "parallel": {"dp_replicate": lay["dp_replicate"], "dp_shard": lay["dp_shard"], "tp": tp, "pp": pp,
                          "pp_schedule": "1f1b", "pp_microbatches": lay["microbatches"] if pp > 1 else None,
                          "cp": lay.get("cp", 1)}}
    if plan.get("moe"):
        train["parallel"]["ep"] = plan["moe"].get("ep", 1)
    if nnodes > 1:
        train["rdzv_endpoint"] = rdzv_endpoint or DEFAULT_RDZV
    return {"model": model, "train": train, "plan": {"gpu": plan["gpu"]}}


def merge(base: dict, fragment: dict) -> dict:
    """`base` with `fragment`'s values put in, section by section (mappings merged, others replaced)."""
    out = copy.deepcopy(base)
    for key, value in fragment.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


# what the fragment is validated against when no base config is given: the smallest valid config
_STANDALONE = {"name": "plan", "sources": [{"name": "plan", "uri": "-", "format": "text", "licence": "-",
                                            "provenance": "-"}]}


def write_config(fragment: dict, path: str | Path, base: str | Path | None = None, header: str = "") -> dict:
    """Validate the fragment (merged into the YAML of `base`, or into the smallest valid config) and
    write it to `path`: the merged config with a base, else the fragment. Returns what was written.
    Raises tasks.config.ConfigError naming the field of a setting the trainer would refuse."""
    from pydantic import ValidationError

    from tasks.config import ConfigError, PipelineConfig, _format_errors, load_config

    if base is not None:
        load_config(base)  # the base itself must be valid first: its own errors name its own fields
        raw = yaml.safe_load(Path(base).read_text()) or {}
        out = merge(raw, fragment)
        check = out
    else:
        out, check = fragment, merge(_STANDALONE, fragment)
    try:
        PipelineConfig.model_validate(check)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(header + yaml.safe_dump(out, sort_keys=False))
    return out
