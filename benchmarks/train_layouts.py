"""CPU training layouts: tokens/s and peak memory per rank of the real trainer under each train.parallel
layout, against the data-parallel baseline measured in the same run. Prints a table and writes
benchmarks/results/train_layouts.json.

    .venv/bin/python benchmarks/train_layouts.py [--steps 14 --warmup 4 --nproc 4 --threads 1
        --n-layer 4 --d-model 256 --n-head 8 --seq-len 128 --batch 16] [--only ddp4,tp4,...]
    .venv/bin/python benchmarks/train_layouts.py --only cp2_dp_shard2,cp4 --merge [--note "..."]

At a fixed global batch a cp rank holds as many tokens as a data-parallel rank (fewer of each sequence,
more sequences), so the default run cannot show what cp is for: a sequence too long for one rank.
That comparison is two runs at one sequence per rank against one sequence over 4 cp ranks:

    ... --only dp_shard4 --seq-len 1024 --batch 4 --steps 8 --warmup 3 --out benchmarks/results/train_layouts_seq1024_dp_shard4.json
    ... --only cp4 --seq-len 1024 --batch 1 --steps 8 --warmup 3 --out benchmarks/results/train_layouts_seq1024_cp4.json

What runs: `run_training` (torchrun, gloo, `--nproc` processes, the trainer the worker builds) on real
text (the tokenizer and token files tests/lm_helpers builds from shared/data/text, vocab 512), one
fresh run per layout, all at the same model, the same global batch (`--batch` sequences of `--seq-len`
tokens per optimizer step, one micro-batch per data-parallel rank, which a pipeline splits into 4) and
the same seed. The default size keeps the 13 runs within about 15 minutes on the 2-core machine
(each run also pays ~35 s of torchrun and import start-up):

  ddp4 (the baseline)           dp_shard4 (FSDP2)          dp_shard2_tp2          tp4
  pp2_dp_shard2 x {1f1b, interleaved_1f1b, gpipe}          pp2_tp2
  moe_ep1 / moe_ep2 / moe_ep4: 8 experts, top-2, expert hidden half the dense MLP's (the same active
      FLOPs per token as the dense model, 4x its MLP parameters), dp_shard 4
  dp_shard4_ac_selective / dp_shard4_ac_full: activation checkpointing
  cp2_dp_shard2 / cp4: context parallelism (each cp rank holds seq_len / cp tokens of every sequence;
      seq_len must be a multiple of 2 x cp), FSDP over dp_shard x cp

- tokens/s: steady state, from rank 0's train_log.jsonl: the global batch's tokens over the summed step
  times of the steps after `--warmup` (first steps: allocator, thread pools, gloo connections).
- memory: each rank's own peak resident set (VmHWM of /proc/self/status), read by the rank right after its
  last training step (benchmarks/train_layouts_worker.py), so the final checkpoint's write is not in it;
  `train_mb` is that peak less the rank's resident set before the trainer was built (torch and the
  process group alone), i.e. what the model, optimizer, activations and communication buffers took.
- `model_state_mb`: the bytes of weights, gradients and AdamW moments each rank holds (local shards).
- each layout is checked to have been built as asked (tp: parameters are DTensors on the tp mesh
  dimension; pp: no rank holds every block; ep: DTensors on the ep mesh dimension; MoE: MoE layers
  exist; checkpointing: wrapped blocks; cp: every rank's trainer holds seq_len / cp positions); a layout that failed (its config refused, the trainer raised)
  is reported with its error and the others go on.

Relative figures compare against ddp4 (and dp_shard4, the MoE layouts also against moe_ep1) of the same
run. On a shared 2-core machine the processes compete for the cores: absolute figures move with other
load (load_avg in the result), compare rows of one run.

`--merge` runs only the `--only` layouts and merges their rows into the existing `--out` file (same
shape required), keeping the other rows. Every row carries the run it came from (`run`: code commit,
date, load average, `--note`); each `vs_<baseline>` ratio says whether the baseline row is of the same
run (`same_run`): a tokens/s ratio across runs compares different loads, the memory ratios hold.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # lm_helpers: the real-text tokenizer and token files the LM tests use

from _common import add_int_options, code_commit, write_result  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "train_layouts.json"
WORKER = "benchmarks.train_layouts_worker"
BASELINE, FSDP_BASELINE, MOE_BASELINE = "ddp4", "dp_shard4", "moe_ep1"

# name -> (train.parallel settings, other train settings, MoE model?)
LAYOUTS: dict[str, tuple[dict, dict, bool]] = {
    "ddp4": ({}, {"parallelism": "ddp"}, False),
    "dp_shard4": ({"dp_shard": 4}, {}, False),
    "dp_shard2_tp2": ({"dp_shard": 2, "tp": 2}, {}, False),
    "tp4": ({"dp_shard": 1, "tp": 4}, {}, False),
    "pp2_dp_shard2_1f1b": ({"pp": 2, "dp_shard": 2, "pp_schedule": "1f1b", "pp_microbatches": 4}, {}, False),
    "pp2_dp_shard2_interleaved_1f1b": ({"pp": 2, "dp_shard": 2, "pp_schedule": "interleaved_1f1b",
                                        "pp_microbatches": 4}, {}, False),
    "pp2_dp_shard2_gpipe": ({"pp": 2, "dp_shard": 2, "pp_schedule": "gpipe", "pp_microbatches": 4}, {}, False),
    "pp2_tp2": ({"pp": 2, "tp": 2, "dp_shard": 1, "pp_microbatches": 4}, {}, False),
    "moe_ep1": ({"dp_shard": 4, "ep": 1}, {}, True),
    "moe_ep2": ({"dp_shard": 4, "ep": 2}, {}, True),
    "moe_ep4": ({"dp_shard": 4, "ep": 4}, {}, True),
    "dp_shard4_ac_selective": ({"dp_shard": 4}, {"activation_checkpointing": "selective"}, False),
    "dp_shard4_ac_full": ({"dp_shard": 4}, {"activation_checkpointing": "full"}, False),
    "cp2_dp_shard2": ({"cp": 2, "dp_shard": 2}, {}, False),
    "cp4": ({"cp": 4, "dp_shard": 1}, {}, False),
}


def layout_config(name: str, a: argparse.Namespace):
    """The PipelineConfig of one layout (validated here: a refused layout raises before torchrun starts)."""
    from lm_helpers import tiny_cfg

    parallel, extra, moe = LAYOUTS[name]
    dims = {"pp": 1, "tp": 1, "cp": 1, "dp_replicate": 1, **parallel}
    # the global batch splits over the data-parallel ranks only (tp, pp and cp ranks share samples)
    dp = a.nproc if extra.get("parallelism") == "ddp" else a.nproc // (
        dims["pp"] * dims["tp"] * dims["cp"] * dims["dp_replicate"])
    model = {"n_layer": a.n_layer, "n_head": a.n_head, "d_model": a.d_model, "seq_len": a.seq_len,
             "tie_embeddings": False}  # untied: the pipeline puts embedding and head on different stages
    if moe:
        from tasks.train.model import GPTConfig

        dense_hidden = GPTConfig(vocab_size=1, d_model=a.d_model).mlp_hidden
        model["moe"] = {"n_experts": a.n_experts, "top_k": 2, "expert_hidden": dense_hidden // 2}
    train = {"nproc_per_node": a.nproc, "max_steps": a.steps, "warmup_steps": 2,
             "micro_batch_size": max(1, a.batch // dp), "batch_tokens": a.batch * a.seq_len,
             "checkpoint_every": a.steps, "log_every": a.steps, "threads_per_proc": a.threads,
             "spike_detection": False,  # a benchmark step is never skipped: every step does the same work
             "peak_flops_per_s": None, "parallelism": "fsdp2", "parallel": parallel, **extra}
    return tiny_cfg(model=model, train=train)


def steady_tokens_per_s(records: list[dict], tokens_per_step: int, warmup: int) -> dict:
    """Tokens/s over the steps after `warmup` (rank 0's step times), and the per-step median."""
    steady = [r for r in records if r["step"] > warmup] or records[-1:]
    seconds = [tokens_per_step / r["tokens_per_s"] for r in steady]
    return {"tokens_per_s": round(tokens_per_step * len(seconds) / sum(seconds), 1),
            "tokens_per_s_median_step": round(statistics.median(r["tokens_per_s"] for r in steady), 1),
            "step_s_median": round(statistics.median(seconds), 4), "steps_timed": len(seconds)}


def check_built(cfg, ranks: list[dict]) -> list[str]:
    """Why the trainer did not build what the config's layout asks for (empty: it did), from the ranks'
    records (benchmarks/train_layouts_worker.py). benchmarks/gpu_layouts.py checks its runs with it too."""
    from tasks.train.parallel_dims import ParallelDims

    p, moe = cfg.train.parallel, cfg.model.moe
    problems = []
    built = [r["built"] for r in ranks]
    world = cfg.train.nnodes * cfg.train.nproc_per_node
    if len(ranks) != world:
        problems.append(f"{len(ranks)} of {world} ranks reported")
    if p.tp > 1 and not all("tp" in b["dtensor_mesh_dims"] for b in built):
        problems.append("tp: parameters are not DTensors on the tp mesh dimension on every rank")
    if p.pp > 1 and not all(b["blocks_here"] < cfg.model.n_layer for b in built):
        problems.append("pp: a rank holds every transformer block")
    if p.ep > 1 and not all("ep" in b["dtensor_mesh_dims"] for b in built):
        problems.append("ep: expert weights are not DTensors on an ep mesh dimension on every rank")
    if moe.n_experts and not all(b["moe_layers"] > 0 for b in built):
        problems.append("moe: no MoE layer in the model")
    if p.cp > 1 and not all(b.get("cp_local_seq_len") == cfg.model.seq_len // p.cp for b in built):
        problems.append(f"cp: not every rank's trainer holds seq_len / cp = {cfg.model.seq_len // p.cp} positions")
    if cfg.train.activation_checkpointing != "none" and not all(b["checkpoint_wrappers"] > 0 for b in built):
        problems.append("activation_checkpointing: no checkpoint-wrapped module")
    if not ParallelDims.from_config(cfg).legacy_ddp and p.dp_shard > 1 and not all(
            {"dp_shard", "dp_shard_cp", "dp"} & set(b["dtensor_mesh_dims"]) for b in built):
        problems.append("dp_shard: parameters are not sharded over a data-parallel mesh dimension")
    return problems


def error_summary(e: BaseException) -> str:
    """The exception's type and message; for a failed torchrun the log lines that name the error."""
    text = str(e)
    if "--- last lines ---" in text:
        head, tail = text.split("--- last lines ---", 1)
        lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
        errs = [ln for ln in lines if "Error" in ln or "error:" in ln or "Exception" in ln]
        text = head.strip().splitlines()[0] + " | " + " | ".join((errs or lines)[-4:])
    return f"{type(e).__name__}: {text}"[:1500]


def run_layout(name: str, a: argparse.Namespace, tokens_index: Path, work: Path) -> dict:
    from tasks.train import run_training
    from tasks.train.launcher import read_train_log
    from tasks.train.parallel_dims import ParallelDims
    from train_layouts_worker import RANKS_DIR

    t0 = time.perf_counter()
    try:
        cfg = layout_config(name, a)
        dims = ParallelDims.from_config(cfg)
        out = work / name
        shutil.rmtree(out, ignore_errors=True)
        result = run_training(cfg, tokens_index, out, None, None, f"layouts-{name}", worker_module=WORKER)
    except Exception as e:  # noqa: BLE001 - reported in the table and the JSON, the other layouts go on
        traceback.print_exc(limit=3)
        return {"ok": False, "error": error_summary(e), "seconds": round(time.perf_counter() - t0, 1)}
    records = read_train_log(out / "train_log.jsonl")
    ranks = [json.loads(p.read_text()) for p in sorted((out / RANKS_DIR).glob("rank*.json"))]
    problems = check_built(cfg, ranks)
    peaks = [r["peak_train_mb"] for r in ranks]
    train_mb = [r["peak_train_mb"] - r["rss_before_mb"] for r in ranks]
    row = {
        "ok": not problems, "layout": dims.describe(), "parallel": LAYOUTS[name][0], **LAYOUTS[name][1],
        "moe": cfg.model.moe.model_dump() if cfg.model.moe.n_experts else None,
        **steady_tokens_per_s(records, a.batch * a.seq_len, a.warmup),
        "memory": {"peak_mb_per_rank": peaks, "peak_mb_max": max(peaks),
                   "train_mb_per_rank": [round(x, 1) for x in train_mb], "train_mb_max": round(max(train_mb), 1),
                   "rss_before_mb_per_rank": [r["rss_before_mb"] for r in ranks],
                   "peak_with_final_checkpoint_mb_max": max(r["peak_exit_mb"] for r in ranks),
                   # weights + gradients + AdamW moments this rank holds: what sharding saves, without the
                   # allocator and activations that VmHWM also counts
                   "model_state_mb_per_rank": [round(sum(r["model_state_mb"].values()), 2) for r in ranks],
                   "model_state_mb_max": round(max(sum(r["model_state_mb"].values()) for r in ranks), 2)},
        "built": [r["built"] for r in ranks],
        "loss_step1": records[0]["loss"], "grad_norm_step1": records[0]["grad_norm"],
        "loss_final": records[-1]["loss"], "steps": records[-1]["step"],
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if problems:
        row["error"] = "layout not built as asked: " + "; ".join(problems)
    return row


def merge_rows(previous: dict, rows: dict, run: dict) -> dict:
    """The previous file's rows (each tagged with its run) with `rows` replacing those of the same name."""
    merged = {n: r for n, r in previous.get("results", {}).items() if n not in rows}  # each carries its run
    merged.update({n: {**r, "run": run} for n, r in rows.items()})
    return {n: merged[n] for n in [*LAYOUTS, *sorted(set(merged) - set(LAYOUTS))] if n in merged}


def relative(rows: dict) -> None:
    """Ratios against the baselines, in place; `same_run` False where the baseline row is of another run
    (its tokens/s ran under another load: only the memory ratios compare)."""
    for name, row in rows.items():
        if not row.get("ok"):
            continue
        peers = [BASELINE, FSDP_BASELINE] + ([MOE_BASELINE] if row.get("moe") else [])
        for peer in peers:
            base = rows.get(peer)
            if peer == name or not (base and base.get("ok")):
                continue
            row[f"vs_{peer}"] = {
                "same_run": row.get("run", {}).get("when") == base.get("run", {}).get("when"),
                "tokens_per_s": round(row["tokens_per_s"] / base["tokens_per_s"], 3),
                "peak_mb_max": round(row["memory"]["peak_mb_max"] / base["memory"]["peak_mb_max"], 3),
                "train_mb_max": round(row["memory"]["train_mb_max"] / base["memory"]["train_mb_max"], 3),
                "model_state_mb_max": round(row["memory"]["model_state_mb_max"] / base["memory"]["model_state_mb_max"], 3),
            }


def print_table(rows: dict) -> None:
    print(f"\n{'layout':32s} {'tokens/s':>9s} {'vs ddp4':>8s} {'peak MB':>8s} {'train MB':>9s} {'vs ddp4':>8s} "
          f"{'states MB':>10s} {'vs ddp4':>8s} {'loss@1':>7s}   (memory: the largest rank's)")
    for name, row in rows.items():
        if "tokens_per_s" not in row:
            print(f"{name:32s} FAILED  {row['error'][:160]}")
            continue
        rel, mem = row.get(f"vs_{BASELINE}", {}), row["memory"]
        print(f"{name:32s} {row['tokens_per_s']:9,.0f} {rel.get('tokens_per_s', 1.0):7.2f}x {mem['peak_mb_max']:8,.0f} "
              f"{mem['train_mb_max']:9,.0f} {rel.get('train_mb_max', 1.0):7.2f}x {mem['model_state_mb_max']:10,.1f} "
              f"{rel.get('model_state_mb_max', 1.0):7.2f}x {row['loss_step1']:7.4f}"
              + ("" if row["ok"] else f"  NOT BUILT AS ASKED: {row['error']}"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_int_options(ap, n_layer=4, d_model=256, n_head=8, seq_len=128, batch=16, n_experts=8,
                    steps=14, warmup=4, nproc=4, threads=1)
    ap.add_argument("--only", default="", help="comma-separated layout names (default: all): " + ", ".join(LAYOUTS))
    ap.add_argument("--work-dir", type=Path, default=None, help="runs and token files (default: a temporary folder)")
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--merge", action="store_true",
                    help="merge the --only layouts' rows into the existing --out file (same shape), keeping its other rows")
    ap.add_argument("--note", default="", help="a remark stored with this run's rows (e.g. the machine's load)")
    a = ap.parse_args(argv)
    names = [n.strip() for n in a.only.split(",") if n.strip()] or list(LAYOUTS)
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; known: {', '.join(LAYOUTS)}")
    if a.warmup >= a.steps:
        ap.error("--warmup must be below --steps")
    previous = json.loads(a.out.read_text()) if a.merge and a.out.exists() else None
    if a.merge and previous is None:
        ap.error(f"--merge: {a.out} does not exist")

    work = a.work_dir or Path(tempfile.mkdtemp(prefix="crucible-layouts-"))
    work.mkdir(parents=True, exist_ok=True)
    # the launcher signs the worker's config: a key of this benchmark's own, not the stack's
    os.environ.setdefault("CRUCIBLE_SIGNING_KEY_FILE", str(work / "secrets" / "signing.key"))
    from lm_helpers import tokens_artifact

    import torch

    tokens = tokens_artifact(work / "data")
    shape = {"n_layer": a.n_layer, "d_model": a.d_model, "n_head": a.n_head, "seq_len": a.seq_len,
             "vocab": tokens.get("vocab_size"), "global_batch_sequences": a.batch,
             "tokens_per_step": a.batch * a.seq_len, "steps": a.steps, "warmup_steps_excluded": a.warmup,
             "dtype": "fp32", "tie_embeddings": False}
    if previous is not None and (previous.get("shape") != shape or previous["machine"]["processes"] != a.nproc
                                 or previous["machine"]["threads_per_process"] != a.threads):
        ap.error(f"--merge: {a.out} was measured at another shape or process count "
                 f"({previous.get('shape')}, {previous['machine'].get('processes')} processes); rows would not compare")
    commit = code_commit(REPO, "tasks/train", "tasks/config.py", "tasks/core", "benchmarks/train_layouts.py",
                         "benchmarks/train_layouts_worker.py", "tests/lm_helpers.py") or "unknown (not a git checkout)"
    started, load_start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), os.getloadavg()[0]
    rows: dict[str, dict] = {}
    for name in names:
        print(f"=== {name}", flush=True)
        rows[name] = run_layout(name, a, Path(tokens["index_path"]), work / "runs")
        row = rows[name]
        print(f"=== {name}: " + (f"{row['tokens_per_s']:,.0f} tokens/s, peak {row['memory']['peak_mb_max']:,.0f} MB"
                                  if "tokens_per_s" in row else "FAILED") + f" ({row['seconds']} s)", flush=True)
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    load_end = os.getloadavg()[0]
    run = {"when": when, "started": started, "code_commit": commit, "load_avg_1m_start": load_start,
           "load_avg_1m_end": load_end, "layouts": names, "note": a.note or None}
    rows = merge_rows(previous, rows, run) if previous is not None else {n: {**r, "run": run} for n, r in rows.items()}
    relative(rows)
    out = {
        "benchmark": "train_layouts",
        "when": when,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "processes": a.nproc, "threads_per_process": a.threads, "backend": "gloo",
                    "load_avg_1m_start": load_start, "load_avg_1m_end": load_end},
        "shape": shape,
        "method": {"tokens_per_s": "rank 0's train_log.jsonl: tokens per step x steps / summed step seconds, "
                                   f"steps after the first {a.warmup}",
                   "memory": "each rank's VmHWM (/proc/self/status) read by the rank itself after its last "
                             "training step (benchmarks/train_layouts_worker.py); train_mb = that peak - the "
                             "rank's VmRSS before the trainer was built",
                   "baseline": f"{BASELINE} (DistributedDataParallel over all ranks) of the same run; also "
                               f"{FSDP_BASELINE}, and {MOE_BASELINE} for the MoE layouts"},
        "note": "shared 2-core machine, 4 processes: absolute figures move with other load; compare rows of one "
                "run (each row's `run`; `machine.load_avg_*` is the latest run's)",
        "runs": list({r["run"]["when"]: r["run"] for r in rows.values()}.values()),  # each run once
        "results": rows,
        "failed": {n: r["error"] for n, r in rows.items() if not r.get("ok")},
    }
    write_result(a.out, out)
    print_table(rows)
    print(f"\nwritten {a.out}", flush=True)
    if a.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
