"""GPU training throughput and MFU of the Crucible model, with the worker's own parallelism,
precision and compile settings (train.parallelism / train.dtype / train.compile).

    .venv/bin/python benchmarks/gpu_mfu.py [--config configs/h100.yaml] [--steps 20 --warmup 8]
        [--set train.micro_batch_size=2 ...] [--out benchmarks/results/gpu_mfu.json]
    torchrun --standalone --nproc_per_node 8 benchmarks/gpu_mfu.py --config configs/h100.yaml

Without a CUDA GPU it prints one `SKIP` line, writes {"skipped": true, "reason": ...} and exits 0.
`--device cpu` runs the same code path on CPU with gloo, to check the script where no GPU is; its
MFU against a GPU's peak means nothing.

What is measured: the model of tasks/train/model.py built from the config's `model` section (vocab
from `tokenizer.vocab_size`), parallelized as the trainer does it (ParallelDims from the config, then
tasks.train.parallelize.parallelize_model: FSDP2 fully_shard per block with a bf16
MixedPrecisionPolicy, or DDP + autocast; torch.compile per block), AdamW from
build_optimizer, gradient accumulation to the config's global batch, grad clipping, optimizer step.
Batches are uniform random token ids: the data loader is not part of the GPU's work, and throughput
does not depend on the token values. Warm-up steps (compilation, allocator) are not timed; the
figure is the median timed step. MFU = flops_per_token (6N + 12·L·H·Q·T, torchtitan's count, N the active matmul parameters
(MoE: top_k of n_experts routed), as the worker logs it) x tokens/s per GPU / peak FLOP/s per GPU, the peak from `train.peak_flops_per_s`
or else the config's planner table (`plan.gpus[--gpu]`).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
RESULT = REPO / "benchmarks" / "results" / "gpu_mfu.json"

from _common import write_result  # noqa: E402
from tasks.core.net import free_port  # noqa: E402


def init_distributed(backend: str) -> tuple[int, int, int]:
    """(rank, world, local_rank): from torchrun's environment, else a one-process group."""
    import torch.distributed as dist

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    dist.init_process_group(backend=backend)
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))


def peak_flops(cfg, gpu: str) -> tuple[float, str]:
    if cfg.train.peak_flops_per_s:
        return cfg.train.peak_flops_per_s, "train.peak_flops_per_s"
    spec = cfg.plan.gpus.get(gpu.lower())
    if spec is None:
        raise SystemExit(f"no peak FLOP/s: set train.peak_flops_per_s or pick --gpu from {sorted(cfg.plan.gpus)}")
    return spec.peak_bf16_flops, f"plan.gpus.{gpu.lower()}.peak_bf16_flops"


def run(cfg, args, device_type: str) -> dict:
    import torch
    import torch.distributed as dist

    from tasks.train.model import GPT, GPTConfig, lm_loss
    from tasks.train.optimizer import build_optimizer
    from tasks.train.flops import flops_per_token
    from tasks.train.parallel_dims import ParallelDims
    from tasks.train.parallelize import autocast_context, grad_sync_context, parallelize_model

    tcfg = cfg.train
    rank, world, local_rank = init_distributed("nccl" if device_type == "cuda" else "gloo")
    try:
        if device_type == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
            torch.backends.cuda.matmul.allow_tf32 = True  # fp32 leftovers (loss upcast) on tensor cores
        else:
            device = torch.device("cpu")
            torch.set_num_threads(tcfg.threads_per_proc)
        gcfg = GPTConfig.from_model_config(cfg.model, cfg.tokenizer.vocab_size)
        dims = ParallelDims.from_config(cfg, world)  # the trainer's layout for these settings
        mesh = None if dims.legacy_ddp else dims.build_mesh(device_type)
        G, accum = dims.global_batch(tcfg, gcfg.seq_len)
        torch.manual_seed(tcfg.seed)
        model = GPT(gcfg).to(device)
        n_params, n_matmul, n_active = model.num_params(), model.num_matmul_params(), model.num_active_params()
        wrapped = parallelize_model(model, dims, mesh, tcfg, device)
        optimizer = build_optimizer(model, tcfg)
        gen = torch.Generator(device=device).manual_seed(tcfg.seed + rank)
        B, T = tcfg.micro_batch_size, gcfg.seq_len

        def sync() -> None:
            if device_type == "cuda":
                torch.cuda.synchronize(device)
            dist.barrier()

        def step() -> float:
            sync()
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            for micro in range(accum):
                batch = torch.randint(0, gcfg.vocab_size, (B, T + 1), device=device, generator=gen)
                x, y = batch[:, :-1], batch[:, 1:]
                with grad_sync_context(wrapped, micro == accum - 1):
                    with autocast_context(tcfg, device, wrapped):
                        logits, _ = wrapped(x)
                        loss, _, _ = lm_loss(logits, y, tcfg.z_loss)
                    (loss / accum).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            optimizer.step()
            sync()
            return time.perf_counter() - t0

        warm = [step() for _ in range(args.warmup)]
        if device_type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        timed = [step() for _ in range(args.steps)]
        median = statistics.median(timed)
        tokens_per_step = G * T
        tps = tokens_per_step / median
        fpt = flops_per_token(n_active, gcfg.n_layer, gcfg.n_head, gcfg.head_dim, T)
        peak, peak_source = peak_flops(cfg, args.gpu)
        result = {
            "device": torch.cuda.get_device_name(device) if device_type == "cuda" else platform.processor() or "cpu",
            "world_size": world,
            "settings": {"parallelism": tcfg.parallelism, "dtype": tcfg.dtype, "compile": tcfg.compile,
                         "micro_batch_size": B, "grad_accum_steps": accum, "global_batch_sequences": G,
                         "seq_len": T, "tokens_per_step": tokens_per_step},
            "model": {**gcfg.to_dict(), "params": n_params, "matmul_params": n_matmul, "active_params": n_active},
            "flops_per_token": fpt,
            "peak_flops_per_gpu": peak, "peak_source": peak_source,
            "warmup_steps": args.warmup, "first_step_s": round(warm[0], 3) if warm else None,
            "steps_timed": len(timed), "median_step_s": round(median, 4),
            "step_s_min_max": [round(min(timed), 4), round(max(timed), 4)],
            "tokens_per_s": round(tps, 1), "tokens_per_s_per_gpu": round(tps / world, 1),
            "model_flops_per_s_per_gpu": fpt * tps / world,
            "mfu": float(f"{fpt * tps / world / peak:.4g}"),  # 4 significant digits: tiny on CPU
        }
        if device_type == "cuda":
            result["max_memory_allocated_gb"] = round(torch.cuda.max_memory_allocated(device) / 1e9, 2)
            result["max_memory_reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / 1e9, 2)
        return result if rank == 0 else {}
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=REPO / "configs" / "h100.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--gpu", default="h100", help="planner table entry for the peak when train.peak_flops_per_s is unset")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: check the code path only")
    p.add_argument("--out", type=Path, default=RESULT)
    args = p.parse_args(argv)

    import torch

    from infra.settings import load_config

    cfg = load_config(args.config, args.set)
    base = {"benchmark": "gpu_mfu", "config": str(args.config), "overrides": args.set, "torch": torch.__version__,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    if args.device == "cuda" and not torch.cuda.is_available():
        reason = (f"no CUDA GPU visible (torch {torch.__version__}, built with CUDA {torch.version.cuda}, "
                  f"torch.cuda.is_available() is False)")
        print(f"SKIP gpu_mfu: {reason}", flush=True)
        write_result(args.out, {**base, "skipped": True, "reason": reason})
        return 0
    if args.device == "cuda" and cfg.train.dtype == "bf16" and not torch.cuda.is_bf16_supported():
        reason = f"{torch.cuda.get_device_name()} has no bf16 support; set train.dtype=fp32"
        print(f"SKIP gpu_mfu: {reason}", flush=True)
        write_result(args.out, {**base, "skipped": True, "reason": reason})
        return 0
    try:
        result = run(cfg, args, args.device)
    except torch.OutOfMemoryError as e:
        msg = f"out of memory: lower train.micro_batch_size (--set train.micro_batch_size=N): {e}"
        print(f"FAIL gpu_mfu: {msg[:500]}", flush=True)
        if int(os.environ.get("RANK", "0")) == 0:
            write_result(args.out, {**base, "skipped": False, "error": msg[:2000]})
        return 1
    if not result:  # ranks other than 0
        return 0
    result = {**base, "skipped": False, **result}
    write_result(args.out, result)
    s = result["settings"]
    print(f"gpu_mfu: {result['device']} x{result['world_size']} | {s['parallelism']} {s['dtype']}"
          f"{' compiled' if s['compile'] else ''} | {result['model']['params'] / 1e6:.0f}M params, "
          f"{s['tokens_per_step']:,} tokens/step | {result['median_step_s']:.3f} s/step | "
          f"{result['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU | MFU {100 * result['mfu']:.1f}% "
          f"(peak {result['peak_flops_per_gpu']:.3g} FLOP/s from {result['peak_source']})"
          + (f" | max memory {result['max_memory_allocated_gb']} GB" if "max_memory_allocated_gb" in result else ""),
          flush=True)
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
