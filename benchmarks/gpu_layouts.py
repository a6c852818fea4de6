"""GPU training layouts on one 8-GPU node: tokens/s per GPU, MFU and memory of each train.parallel layout
of configs/dense-8b.yaml (Llama-3.1-8B-sized) and configs/moe-8x.yaml (8 experts, top-2), against
torchtitan's published Llama 3.1 8B figures on 8 H100s. Writes benchmarks/results/gpu_layouts.json.

    .venv/bin/python benchmarks/gpu_layouts.py [--config configs/dense-8b.yaml --config configs/moe-8x.yaml]
        [--layouts fsdp8,fsdp8_compile,...] [--steps 30 --warmup 10] [--batch 16] [--no-compile]
        [--tokens-index runs/<run>/tokens/index.json] [--set train.micro_batch_size=2 ...]
    .venv/bin/python benchmarks/gpu_layouts.py --dry-run      # on CPU: configs, layouts, model sizes

What runs: for every layout, `run_training` (torchrun over the node's 8 GPUs, nccl, bf16, the trainer the
worker builds: the same code as `crucible run`) on the config with the layout's train.parallel settings,
`--steps` optimizer steps of `--batch` sequences (16 x 8,192 tokens: torchtitan's global batch), the
config's micro-batch size and activation checkpointing. No checkpoint is written (an 8 B model's is
~100 GB; benchmarks/train_layouts_worker.py). Data: `--tokens-index` (a run's tokens stage), else uniform
random ids at the config's vocabulary (throughput does not depend on the ids).

Figures per layout: tokens/s per GPU over the steps after `--warmup` (rank 0's train_log.jsonl: compile
and the allocator settle first; torchtitan reads its figure at step 90 of a longer run); MFU =
FLOPs per token x tokens/s per GPU / peak, FLOPs per token 6·N_active + 12·L·d·T (tasks/train/flops.py,
torchtitan's count; N_active: GPT.num_active_params), peak train.peak_flops_per_s (989 TFLOP/s, H100 SXM
dense bf16); torch.cuda max allocated / reserved GiB per rank.

The peer, torchtitan docs/performance.md, Table 1 (1D parallelism, FSDP; Llama 3.1 8B, 8 GPUs, local
batch 2, global batch 16, sequence 8,192, selective activation checkpointing, H100 96 GB at 500 W):
FSDP 5,762 tokens/s/GPU (82.4 GiB), FSDP + torch.compile 6,667 (77.0 GiB). configs/dense-8b.yaml has
Llama 3.1 8B's parameter count and FLOPs per token exactly (its header), so tokens/s per GPU compare
directly; their MFU by the same count is 33.7 % and 39.0 % (the page quotes 33 % to 39 %).
fsdp8 (no compile) is compared with the first, fsdp8_compile with the second; both run with selective
activation checkpointing as torchtitan's did, one sequence per micro-batch and two micro-batches per
rank (torchtitan: local batch 2; a 96 GB card held 82.4 GiB, an 80 GB one may not); the other layouts
run with the config's settings (the planner's: no checkpointing) and are compared with fsdp8_compile
of the same run.

Fewer CUDA GPUs than `--gpus`: it refuses (exit 2) naming what it found, and writes the dry run's checks
with {"skipped": true, "reason": ...}. `--dry-run` needs no GPU: it loads each config with each layout
(ParallelDims checks the layout against the model and the world size, naming the field), builds the
model on the meta device for its parameter counts and FLOPs per token, and prints the run commands.
`--device cpu` runs the measuring path itself with gloo processes instead of GPUs (a test does, with a
small model): its MFU against a GPU's peak means nothing.
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

from _common import write_result  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "gpu_layouts.json"
CONFIGS = [REPO / "configs" / "dense-8b.yaml", REPO / "configs" / "moe-8x.yaml"]
WORKER = "benchmarks.train_layouts_worker"

TORCHTITAN = {
    "source": "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md, Table 1 (1D Parallelism "
              "(FSDP). Llama 3.1 8B model. 8 GPUs. Local batch size 2, global batch size 16. Selective "
              "activation checkpointing); the TorchTitan paper, arXiv:2410.06511",
    "hardware": "8 x NVIDIA H100 (96 GB HBM2e, 500 W power limit; Grand Teton hosts, NVLink)",
    "model": {"name": "Llama 3.1 8B", "n_layer": 32, "d_model": 4096, "n_head": 32, "n_kv_head": 8,
              "mlp_hidden": 14336, "vocab": 128256, "seq_len": 8192, "params": 8_030_261_248,
              "params_besides_input_embedding": 7_504_924_672},
    "fsdp": {"tokens_per_s_per_gpu": 5762, "memory_gib": 82.4},
    "fsdp_compile": {"tokens_per_s_per_gpu": 6667, "memory_gib": 77.0},
}

# layout name -> (train.parallel settings, other train settings, torchtitan peer key or None).
# Settings not named keep the defaults (no tp, pp or ep; dp_shard the rest); compile unset: the config's.
DENSE_LAYOUTS: dict[str, tuple[dict, dict, str | None]] = {
    # torchtitan's Table 1 settings: FSDP over the 8 GPUs, selective activation checkpointing
    "fsdp8": ({"dp_shard": 8}, {"compile": False, "activation_checkpointing": "selective"}, "fsdp"),
    "fsdp8_compile": ({"dp_shard": 8}, {"compile": True, "activation_checkpointing": "selective"}, "fsdp_compile"),
    "planner": (None, {}, None),  # the config's own train.parallel (the planner's layout)
    "dp_shard4_tp2": ({"dp_shard": 4, "tp": 2}, {}, None),
    "dp_shard2_tp4": ({"dp_shard": 2, "tp": 4}, {}, None),
    "tp8": ({"dp_shard": 1, "tp": 8}, {}, None),
    "pp2_dp_shard4_1f1b": ({"pp": 2, "dp_shard": 4, "pp_schedule": "1f1b", "pp_microbatches": 4}, {}, None),
    "pp2_dp_shard4_interleaved_1f1b": ({"pp": 2, "dp_shard": 4, "pp_schedule": "interleaved_1f1b",
                                        "pp_microbatches": 4}, {}, None),
    "pp2_dp_shard4_gpipe": ({"pp": 2, "dp_shard": 4, "pp_schedule": "gpipe", "pp_microbatches": 4}, {}, None),
    "pp2_tp4": ({"pp": 2, "tp": 4, "dp_shard": 1, "pp_microbatches": 8}, {}, None),
}
MOE_LAYOUTS: dict[str, tuple[dict, dict, str | None]] = {
    "planner": (None, {}, None),
    "ep1": ({"dp_shard": 8, "ep": 1}, {}, None),
    "ep2": ({"dp_shard": 8, "ep": 2}, {}, None),
    "ep4": ({"dp_shard": 8, "ep": 4}, {}, None),
    "ep8": ({"dp_shard": 8, "ep": 8}, {}, None),
}
PARALLEL_DEFAULTS = {"dp_replicate": 1, "dp_shard": -1, "tp": 1, "pp": 1, "pp_schedule": "1f1b",
                     "pp_microbatches": None, "ep": 1, "cp": 1}


def layouts_for(cfg) -> dict[str, tuple[dict, dict, str | None]]:
    return MOE_LAYOUTS if cfg.model.moe.n_experts else DENSE_LAYOUTS


def layout_overrides(parallel: dict | None, extra: dict, a: argparse.Namespace, seq_len: int) -> list[str]:
    """--set overrides of one layout's benchmark run (`crucible run` takes the same)."""
    sets = [f"train.nproc_per_node={a.gpus}", f"train.max_steps={a.steps}", f"train.checkpoint_every={a.steps}",
            f"train.batch_tokens={a.batch * seq_len}", "train.spike_detection=false",
            "train.batch_ramp_start_tokens=null"]
    if a.device == "cpu":  # the code-path check: gloo processes on this machine's cores
        sets += ["train.device=cpu", "train.backend=gloo", "train.threads_per_proc=1"]
    if parallel is not None:
        sets += [f"train.parallel.{k}={'null' if v is None else v}" for k, v in {**PARALLEL_DEFAULTS, **parallel}.items()]
    if "activation_checkpointing" in extra:
        sets.append(f"train.activation_checkpointing={extra['activation_checkpointing']}")
    compile_ = extra.get("compile")
    if a.no_compile:
        compile_ = False
    if compile_ is not None:
        sets.append(f"train.compile={str(compile_).lower()}")
    return sets


def model_figures(cfg) -> dict:
    """Parameter counts and FLOPs per token of the config's model, built on the meta device (no memory)."""
    import torch

    from tasks.train.flops import flops_per_token
    from tasks.train.model import GPT, GPTConfig

    gcfg = GPTConfig.from_model_config(cfg.model, cfg.tokenizer.vocab_size)
    with torch.device("meta"):
        model = GPT(gcfg)
    active = model.num_active_params()
    return {"params": model.num_params(), "matmul_params": model.num_matmul_params(), "active_params": active,
            "flops_per_token": flops_per_token(active, gcfg.n_layer, gcfg.n_head, gcfg.head_dim, gcfg.seq_len)}


def torchtitan_mfu(peak: float) -> dict:
    """torchtitan's published tokens/s as MFU by this repository's count (same model FLOPs as dense-8b)."""
    from tasks.train.flops import flops_per_token

    m = TORCHTITAN["model"]
    fpt = flops_per_token(m["params_besides_input_embedding"], m["n_layer"], m["n_head"], m["d_model"] // m["n_head"],
                          m["seq_len"])
    return {"flops_per_token": fpt, **{k: round(fpt * TORCHTITAN[k]["tokens_per_s_per_gpu"] / peak, 4)
                                       for k in ("fsdp", "fsdp_compile")}}


def check_layouts(config: Path, a: argparse.Namespace) -> dict:
    """Each layout of `config` loaded and checked as a run would be (the dry run); never raises."""
    from infra.settings import load_config
    from tasks.train.parallel_dims import ParallelDims

    out: dict = {"config": str(config), "layouts": {}}
    try:
        base = load_config(config, a.set)
    except Exception as e:  # noqa: BLE001 - reported
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    out["model"] = model_figures(base)
    out["planner_layout"] = ParallelDims.from_config(base).describe()
    names = a.layouts or list(layouts_for(base))
    for name in names:
        spec = layouts_for(base).get(name)
        if spec is None:
            out["layouts"][name] = {"ok": False, "error": f"no layout {name!r} for this config; known: "
                                                            f"{', '.join(layouts_for(base))}"}
            continue
        parallel, extra, peer = spec
        sets = a.set + layout_overrides(parallel, extra, a, base.model.seq_len)
        try:
            cfg = load_config(config, sets)
            dims = ParallelDims.from_config(cfg)
            samples, accum = dims.global_batch(cfg.train, cfg.model.seq_len)
            out["layouts"][name] = {
                "ok": True, "layout": dims.describe(), "compile": cfg.train.compile,
                "activation_checkpointing": cfg.train.activation_checkpointing,
                "micro_batch_size": cfg.train.micro_batch_size, "micro_batches_per_dp_rank": accum,
                "global_batch_sequences": samples, "peer": peer,
                "command": f"crucible run {config.relative_to(REPO) if config.is_relative_to(REPO) else config} "
                           + " ".join(f"--set {s}" for s in sets)}
        except Exception as e:  # noqa: BLE001 - a refused layout is reported with the field it names
            out["layouts"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:1500]}
    return out


def random_tokens_index(folder: Path, vocab_size: int, n_tokens: int, seed: int = 0) -> Path:
    """index.json of uniform random token ids (train and a small val split) in the tokens stage's format
    (tasks/tokens/binfile.py); one document per split."""
    import numpy as np

    from tasks.tokens.binfile import dtype_for_vocab

    folder.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for_vocab(vocab_size)
    rng = np.random.default_rng(seed)
    splits = {}
    for split, n in (("train", n_tokens), ("val", max(n_tokens // 100, 1 << 16))):
        rng.integers(0, vocab_size, size=n, dtype=np.int64).astype(dtype).tofile(folder / f"{split}.bin")
        np.save(folder / f"{split}.doc_starts.npy", np.zeros(1, dtype=np.int64))
        splits[split] = {"path": f"{split}.bin", "tokens": n, "docs": 1, "doc_starts": f"{split}.doc_starts.npy"}
    index = {"dtype": dtype.name, "byteorder": "little", "vocab_size": vocab_size, "eos_id": vocab_size - 1,
             "tokenizer_sha256": None, "splits": splits, "note": "uniform random ids (benchmarks/gpu_layouts.py)"}
    path = folder / "index.json"
    path.write_text(json.dumps(index, indent=2) + "\n")
    return path


def steady(records: list[dict], tokens_per_step: int, warmup: int) -> dict:
    rows = [r for r in records if r["step"] > warmup] or records[-1:]
    seconds = [tokens_per_step / r["tokens_per_s"] for r in rows]
    return {"tokens_per_s": tokens_per_step * len(seconds) / sum(seconds), "steps_timed": len(seconds),
            "step_s_median": round(statistics.median(seconds), 3)}


def run_layout(config: Path, name: str, check: dict, model: dict, a: argparse.Namespace, tokens_index: Path,
               work: Path, reference: dict) -> dict:
    from infra.settings import load_config
    from tasks.train import run_training
    from tasks.train.launcher import read_train_log
    from train_layouts import check_built
    from train_layouts_worker import NO_CHECKPOINT_ENV, RANKS_DIR

    cfg0 = load_config(config, a.set)
    parallel, extra, peer = layouts_for(cfg0)[name]
    cfg = load_config(config, a.set + layout_overrides(parallel, extra, a, cfg0.model.seq_len))
    out = work / f"{cfg.name}-{name}"
    shutil.rmtree(out, ignore_errors=True)
    os.environ[NO_CHECKPOINT_ENV] = "1"
    t0 = time.perf_counter()
    try:
        run_training(cfg, tokens_index, out, None, None, f"gpu-layouts-{cfg.name}-{name}", worker_module=WORKER)
    except Exception as e:  # noqa: BLE001 - one layout failing (OOM, unsupported) does not stop the others
        traceback.print_exc(limit=3)
        return {**check, "ok": False, "error": f"{type(e).__name__}: {str(e)[-3000:]}",
                "seconds": round(time.perf_counter() - t0, 1)}
    records = read_train_log(out / "train_log.jsonl")
    ranks = [json.loads(p.read_text()) for p in sorted((out / RANKS_DIR).glob("rank*.json"))]
    tokens_per_step = a.batch * cfg.model.seq_len
    s = steady(records, tokens_per_step, a.warmup)
    per_gpu = s["tokens_per_s"] / a.gpus
    peak = cfg.train.peak_flops_per_s or cfg.plan.gpus[cfg.plan.gpu].peak_bf16_flops
    row = {**check, "tokens_per_s": round(s["tokens_per_s"], 1), "tokens_per_s_per_gpu": round(per_gpu, 1),
           "steps_timed": s["steps_timed"], "step_s_median": s["step_s_median"],
           "mfu": float(f"{model['flops_per_token'] * per_gpu / peak:.4g}"),  # 4 significant digits: tiny on CPU
           "mfu_logged": float(f"{statistics.mean(r['mfu'] for r in records if r['step'] > a.warmup):.4g}")
           if all("mfu" in r for r in records) and len(records) > a.warmup else None,
           "cuda_max_allocated_gib_max": max((r.get("cuda_max_allocated_gb") or 0) for r in ranks) if ranks else None,
           "cuda_max_reserved_gib_max": max((r.get("cuda_max_reserved_gb") or 0) for r in ranks) if ranks else None,
           "built": [r["built"] for r in ranks], "loss_first": records[0]["loss"], "loss_last": records[-1]["loss"],
           "seconds": round(time.perf_counter() - t0, 1)}
    problems = check_built(cfg, ranks)
    if problems:  # figures kept, but not as the layout's: the trainer built something else
        row["ok"], row["error"] = False, "layout not built as asked: " + "; ".join(problems)
    if peer:
        ref = TORCHTITAN[peer]["tokens_per_s_per_gpu"]
        row["vs_torchtitan"] = {"peer": peer, "tokens_per_s_per_gpu": ref, "mfu": reference[peer],
                                "ratio": round(per_gpu / ref, 3)}
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", type=Path, action="append", default=None, help="config (repeatable; default: "
                    "configs/dense-8b.yaml and configs/moe-8x.yaml)")
    ap.add_argument("--layouts", type=lambda s: [x.strip() for x in s.split(",") if x.strip()], default=None,
                    help="comma-separated layout names (default: all of each config's): dense "
                         + ", ".join(DENSE_LAYOUTS) + "; MoE " + ", ".join(MOE_LAYOUTS))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every run")
    ap.add_argument("--gpus", type=int, default=8, help="GPUs of the node the layouts are written for")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=10, help="first steps left out of the figures")
    ap.add_argument("--batch", type=int, default=16, help="global batch in sequences (torchtitan's: 16)")
    ap.add_argument("--no-compile", action="store_true", help="torch.compile off in every layout")
    ap.add_argument("--tokens-index", type=Path, help="a tokens stage's index.json (default: random ids)")
    ap.add_argument("--work-dir", type=Path, help="run folders (default: a temporary folder, removed after)")
    ap.add_argument("--dry-run", action="store_true", help="check configs and layouts on CPU; start nothing")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: run the same code path with --gpus gloo processes, to check the script where no "
                         "GPU is (with a small model through --set); its MFU against a GPU's peak means nothing")
    ap.add_argument("--out", type=Path, default=RESULT)
    a = ap.parse_args(argv)
    if a.warmup >= a.steps:
        ap.error("--warmup must be below --steps")
    return a


def print_checks(checks: list[dict]) -> None:
    """What the dry run found for every config and layout."""
    for c in checks:
        print(f"{c['config']}: " + (c.get("error") or f"{c['model']['params'] / 1e9:.2f} B params, "
              f"{c['model']['active_params'] / 1e9:.2f} B active, {c['model']['flops_per_token'] / 1e9:.1f} GFLOP/token; "
              f"planner layout {c['planner_layout']}"), flush=True)
        for n, r in c["layouts"].items():
            print(f"  {n:32s} " + (f"{r['layout']}, {r['micro_batches_per_dp_rank']} micro-batch(es) of "
                                   f"{r['micro_batch_size']} per dp rank, compile {r['compile']}, activation "
                                   f"checkpointing {r['activation_checkpointing']}" if r["ok"]
                                   else f"REFUSED: {r['error'][:300]}"), flush=True)


def print_table(results: list[dict]) -> None:
    """One line per config and layout: tokens/s per GPU, MFU, against torchtitan, memory."""
    print(f"\n{'config/layout':40s} {'tokens/s/GPU':>12s} {'MFU':>6s} {'vs torchtitan':>14s} {'GiB':>6s}")
    for c in results:
        for n, r in c.get("layouts", {}).items():
            label = f"{Path(c['config']).stem}/{n}"
            if "mfu" not in r:
                print(f"{label:40s} FAILED {r.get('error', '')[-150:]}")
                continue
            vs = r.get("vs_torchtitan")
            print(f"{label:40s} {r['tokens_per_s_per_gpu']:12,.0f} {r['mfu']:6.1%} "
                  f"{(str(vs['ratio']) + 'x ' + vs['peer']) if vs else '':>14s} {r['cuda_max_reserved_gib_max']:6}"
                  + ("" if r["ok"] else f"  {r['error']}"))


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    configs = a.config or CONFIGS

    import torch

    base = {"benchmark": "gpu_layouts", "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch": torch.__version__, "gpus_required": a.gpus, "steps": a.steps, "warmup_steps_excluded": a.warmup,
            "global_batch_sequences": a.batch, "overrides": a.set, "torchtitan": TORCHTITAN}
    checks = [check_layouts(Path(c), a) for c in configs]
    peak = 989e12
    try:
        from infra.settings import load_config

        cfg0 = load_config(configs[0], a.set)
        peak = cfg0.train.peak_flops_per_s or cfg0.plan.gpus[cfg0.plan.gpu].peak_bf16_flops
    except Exception:  # noqa: BLE001 - the check above reports a config that does not load
        pass
    reference = torchtitan_mfu(peak)
    base["torchtitan_mfu_by_this_count"] = reference
    base["peak_flops_per_gpu"] = peak
    refused = [f"{c['config']}: {n}: {r['error']}" for c in checks for n, r in c["layouts"].items() if not r["ok"]]
    refused += [f"{c['config']}: {c['error']}" for c in checks if "error" in c]
    print_checks(checks)

    if a.dry_run:
        write_result(a.out, {**base, "dry_run": True, "checks": checks, "refused": refused})
        print(("dry run: every config and layout checks out" if not refused else
               f"dry run: {len(refused)} refused") + f"; written {a.out}", flush=True)
        return 1 if refused else 0

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if a.device == "cuda" and found < a.gpus:
        reason = (f"gpu_layouts needs {a.gpus} CUDA GPUs on this node (the layouts are written for "
                  f"train.nproc_per_node={a.gpus}); found {found} (torch {torch.__version__}, CUDA "
                  f"{torch.version.cuda}). Nothing was measured. --dry-run checks the configs and layouts on CPU.")
        print(f"REFUSED gpu_layouts: {reason}", file=sys.stderr, flush=True)
        write_result(a.out, {**base, "skipped": True, "reason": reason, "checks": checks, "refused": refused})
        return 2
    if a.device == "cuda" and not torch.cuda.is_bf16_supported():
        reason = f"{torch.cuda.get_device_name()} has no bf16 support"
        print(f"REFUSED gpu_layouts: {reason}", file=sys.stderr, flush=True)
        write_result(a.out, {**base, "skipped": True, "reason": reason, "checks": checks})
        return 2

    work = a.work_dir or Path(tempfile.mkdtemp(prefix="crucible-gpu-layouts-"))
    os.environ.setdefault("CRUCIBLE_SIGNING_KEY_FILE", str(work / "secrets" / "signing.key"))
    results = []
    for c in checks:
        if "error" in c:
            results.append(c)
            continue
        cfg0 = load_config(Path(c["config"]), a.set)
        n_tokens = (a.steps + 2) * a.batch * (cfg0.model.seq_len + 1)
        tokens_index = a.tokens_index or random_tokens_index(work / f"tokens-{cfg0.tokenizer.vocab_size}",
                                                             cfg0.tokenizer.vocab_size, n_tokens)
        rows = {}
        for name, check in c["layouts"].items():
            if not check["ok"]:
                rows[name] = check
                continue
            print(f"=== {cfg0.name} {name}: {check['layout']}", flush=True)
            rows[name] = run_layout(Path(c["config"]), name, check, c["model"], a, tokens_index, work / "runs",
                                    reference)
            r = rows[name]
            print(f"=== {cfg0.name} {name}: " + (f"{r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {r['mfu']:.1%}, "
                                                 f"max reserved {r['cuda_max_reserved_gib_max']} GiB"
                                                 if "mfu" in r else f"FAILED {r['error'][-300:]}"), flush=True)
        same_run_peer = "ep1" if cfg0.model.moe.n_experts else "fsdp8_compile"
        peer_row = rows.get(same_run_peer, {})
        for name, r in rows.items():
            if "mfu" in r and "mfu" in peer_row and name != same_run_peer:
                r["vs_same_run"] = {"peer": same_run_peer, "tokens_per_s_per_gpu": round(
                    r["tokens_per_s_per_gpu"] / peer_row["tokens_per_s_per_gpu"], 3)}
        results.append({**c, "layouts": rows})
    write_result(a.out, {**base, "skipped": False, "device": torch.cuda.get_device_name(0) if a.device == "cuda" else
                         f"cpu x{a.gpus} gloo processes (code-path check; MFU against a GPU peak means nothing)",
                         "gpus_found": found,
                         "platform": platform.platform(), "results": results})
    print_table(results)
    print(f"written {a.out}", flush=True)
    if a.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
