"""Checkpoint save time (sync vs async), size on disk and resume time, at the model size of
benchmarks/train_throughput.py; nanoGPT's torch.save checkpoint as the reference, in the same run.
Prints the figures and writes benchmarks/results/checkpoint.json.

    .venv/bin/python benchmarks/checkpoint.py [--d-model 256 --n-layer 4 --n-head 4 --seq-len 256
        --batch 8 --vocab 4096 --rounds 3 --threads 1]

One process with a 1-rank gloo group, as a torchrun worker has (so DCP runs its collectives and
the async writer uses its own group, see tasks.train.checkpoint.new_checkpoint_group):

- sync: start_checkpoint + wait_and_finalize back to back; the loop is blocked for all of it.
- async: start_checkpoint(async_save=True) (state copied to CPU memory, writer thread started),
  one real training step while the checkpoint is written, then wait_and_finalize. Blocked time =
  the start + whatever was left to wait for after the step; the step's time is compared with a
  step without a save in flight (the writer competes for the same cores).
- resume: load_checkpoint into a fresh model and optimizer (what a resumed run does: every file is
  first checked against the manifest), and
  load_model_for_inference (what evaluation and serving do).
- manifest: apply_retention's sha256 of every file (rank 0, after each save in the worker).
- reference_nanogpt: torch.save({"model", "optimizer"}) to one file, torch.load(weights_only=True)
  + load_state_dict (the reference only: it loads the file it wrote a moment before into its own
  temporary directory; Crucible's checkpoints are safetensors and JSON and are never unpickled).
Rounds alternate sync and async so load from other processes falls on both alike.
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _common import write_result  # noqa: E402
from benchmarks.train_throughput import (add_model_size_args, crucible_step_fn, model_size_setup,  # noqa: E402
                                         model_size_shape)
from tasks.config import TrainConfig  # noqa: E402
from tasks.train.checkpoint import (apply_retention, load_checkpoint, load_model_for_inference,  # noqa: E402
                                    new_checkpoint_group, start_checkpoint)
from tasks.train.model import GPT, GPTConfig  # noqa: E402
from tasks.train.optimizer import build_optimizer  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "checkpoint.json"


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def med(xs: list[float]) -> float:
    return round(statistics.median(xs), 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_size_args(ap)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work-dir", type=Path, default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=RESULT)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    work = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=a.work_dir))
    dist.init_process_group("gloo", init_method=f"file://{work / 'store'}", rank=0, world_size=1)
    try:
        return run(a, work)
    finally:
        dist.destroy_process_group()
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class Bench:
    """The model under test, its optimizer and training step, and where its checkpoints go."""

    model: GPT
    optimizer: torch.optim.Optimizer
    state: dict  # {"step", "pos"}, advanced by `step`
    step: Callable[[], None]
    gcfg: GPTConfig
    tcfg: TrainConfig
    meta: dict
    group: dist.ProcessGroup | None  # the async writer's own group
    work: Path

    def train_step(self) -> float:
        t0 = time.perf_counter()
        self.step()
        return time.perf_counter() - t0

    def fresh(self) -> tuple[GPT, torch.optim.Optimizer]:
        """A new model and optimizer, as a resumed run builds them before loading."""
        model = GPT(self.gcfg)
        return model, build_optimizer(model, self.tcfg)


def run(a: argparse.Namespace, work: Path) -> int:
    bench = setup(a, work)
    load_start = os.getloadavg()[0]
    rounds, ckpt = save_rounds(bench, a.rounds)
    t0 = time.perf_counter()
    apply_retention(work / "async", ckpt, None)  # the manifest every load verifies the checkpoint against
    manifest_s = time.perf_counter() - t0
    resume = resume_rounds(bench, ckpt, a.rounds)  # includes that verification, as a real resume does
    results = summarise(bench, ckpt, rounds, resume, manifest_s)
    n_params = bench.model.num_params()
    out = {
        "benchmark": "checkpoint",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "threads": a.threads, "load_avg_1m_start": load_start, "load_avg_1m_end": os.getloadavg()[0],
                    "work_dir_fs": str(work.parent)},
        "note": "shared 2-core machine: other processes' load (load_avg) skews absolute figures; compare rows of one run",
        "shape": {**model_size_shape(a), "params": n_params, "rounds": a.rounds},
        "results": results,
    }
    print_summary(n_params, results, manifest_s)
    write_result(a.out, out)
    print(f"written {a.out}")
    return 0


def setup(a: argparse.Namespace, work: Path) -> Bench:
    """The model at add_model_size_args' size, trained two steps so AdamW's moments exist."""
    tokens, tcfg, gcfg = model_size_setup(a)
    torch.manual_seed(0)
    model = GPT(gcfg)
    model.train()
    optimizer = build_optimizer(model, tcfg)
    state = {"step": 0, "pos": 0}
    step = crucible_step_fn(model, tcfg, tokens, a.seq_len, a.batch, optimizer=optimizer, spike_check=False,
                            state=state)
    bench = Bench(model, optimizer, state, step, gcfg, tcfg, meta={}, group=None, work=work)
    for _ in range(2):  # AdamW moments exist from the first step on
        bench.train_step()
    bench.group = new_checkpoint_group()
    bench.meta = {"model": gcfg.to_dict(), "vocab_size": a.vocab, "trainer": {"consumed_samples": 0}}
    return bench


def save_rounds(b: Bench, rounds: int) -> tuple[dict[str, dict[str, list[float]]], Path]:
    """Per round: a sync save, an async save with a training step in flight, a step with no save in
    flight and nanoGPT's torch.save/torch.load. Returns each figure's seconds by round, and the last
    async checkpoint."""
    times: dict[str, dict[str, list[float]]] = {"sync": {}, "async": {}, "plain": {}, "ref": {}}
    ckpt = None
    for r in range(rounds):
        sync = sync_save(b)
        asyn, ckpt = async_save(b)
        plain = {"step_s": b.train_step()}
        ref = reference_save_load(b)
        for name, figures in (("sync", sync), ("async", asyn), ("plain", plain), ("ref", ref)):
            for key, seconds in figures.items():
                times[name].setdefault(key, []).append(seconds)
        print(f"round {r + 1}: sync blocked {sync['blocked_s']:.3f}s | async blocked {asyn['blocked_s']:.3f}s "
              f"(start {asyn['start_s']:.3f} + wait {asyn['wait_s']:.3f}; written in {asyn['written_s']:.3f}s) | "
              f"step {plain['step_s']:.2f}s, with async save in flight {asyn['step_s']:.2f}s | "
              f"nanoGPT torch.save {ref['save_s']:.3f}s", flush=True)
    return times, ckpt


def sync_save(b: Bench) -> dict[str, float]:
    """The loop waits for the whole save; then one training step."""
    p = start_checkpoint(b.model, b.optimizer, b.state["step"], b.work / "sync", b.meta)
    p.wait_and_finalize()
    return {"blocked_s": p.total_s, "step_s": b.train_step()}


def async_save(b: Bench) -> tuple[dict[str, float], Path]:
    """One training step runs while the checkpoint is written."""
    p = start_checkpoint(b.model, b.optimizer, b.state["step"], b.work / "async", b.meta, async_save=True,
                         process_group=b.group)
    step_s = b.train_step()
    t0 = time.perf_counter()
    ckpt = p.wait_and_finalize()
    wait_s = time.perf_counter() - t0
    return {"blocked_s": p.blocked_s + wait_s, "start_s": p.blocked_s, "wait_s": wait_s, "written_s": p.write_s,
            "step_s": step_s}, ckpt


def reference_save_load(b: Bench) -> dict[str, float]:
    """nanoGPT's single-file checkpoint: torch.save, then torch.load into a fresh model and optimizer."""
    ref_path = b.work / "ref" / "ckpt.pt"
    ref_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    torch.save({"model": b.model.state_dict(), "optimizer": b.optimizer.state_dict(), "iter_num": b.state["step"]},
               ref_path)
    save_s = time.perf_counter() - t0
    fresh, fresh_opt = b.fresh()
    t0 = time.perf_counter()
    ck = torch.load(ref_path, map_location="cpu", weights_only=True)  # nanoGPT's way; our own file, just written
    fresh.load_state_dict(ck["model"])
    fresh_opt.load_state_dict(ck["optimizer"])
    return {"save_s": save_s, "load_s": time.perf_counter() - t0}


def resume_rounds(b: Bench, ckpt: Path, rounds: int) -> dict[str, list[float]]:
    """Seconds to resume training from `ckpt` (load_checkpoint) and to load it for inference."""
    resume: dict[str, list[float]] = {"load_checkpoint_s": [], "load_model_for_inference_s": []}
    for _ in range(rounds):
        fresh, fresh_opt = b.fresh()
        t0 = time.perf_counter()
        load_checkpoint(fresh, fresh_opt, ckpt)
        resume["load_checkpoint_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        load_model_for_inference(ckpt)
        resume["load_model_for_inference_s"].append(time.perf_counter() - t0)
    return resume


def summarise(b: Bench, ckpt: Path, rounds: dict[str, dict[str, list[float]]], resume: dict[str, list[float]],
              manifest_s: float) -> dict:
    sync, asyn, ref = rounds["sync"], rounds["async"], rounds["ref"]
    ckpt_bytes = dir_bytes(ckpt)
    weights_bytes = sum(t.numel() * t.element_size() for t in b.model.state_dict().values())
    results = {
        "sync": {"blocked_s": med(sync["blocked_s"]), "blocked_s_all": [round(x, 4) for x in sync["blocked_s"]]},
        "async": {"blocked_s": med(asyn["blocked_s"]), "start_s": med(asyn["start_s"]),
                  "wait_after_one_step_s": med(asyn["wait_s"]), "written_s": med(asyn["written_s"]),
                  "blocked_s_all": [round(x, 4) for x in asyn["blocked_s"]]},
        "step_s": {"no_save": med(rounds["plain"]["step_s"]), "async_save_in_flight": med(asyn["step_s"]),
                   "after_sync_save": med(sync["step_s"])},
        "size": {"checkpoint_bytes": ckpt_bytes, "weights_fp32_bytes": weights_bytes,
                 "bytes_over_weights": round(ckpt_bytes / weights_bytes, 3),
                 "files": sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())},
        "resume": {key: med(seconds) for key, seconds in resume.items()},
        "manifest_sha256_s": round(manifest_s, 4),
        "reference_nanogpt_torch_save": {"save_s": med(ref["save_s"]), "load_s": med(ref["load_s"]),
                                         "bytes": (b.work / "ref" / "ckpt.pt").stat().st_size},
    }
    results["async_blocked_vs_sync"] = round(results["async"]["blocked_s"] / results["sync"]["blocked_s"], 3)
    return results


def print_summary(n_params: int, results: dict, manifest_s: float) -> None:
    ref = results["reference_nanogpt_torch_save"]
    print(f"{n_params:,} params | checkpoint {results['size']['checkpoint_bytes'] / 1e6:.1f} MB "
          f"({results['size']['bytes_over_weights']}x fp32 weights: + AdamW moments) | "
          f"nanoGPT torch.save {ref['bytes'] / 1e6:.1f} MB")
    print(f"save, loop blocked: sync {results['sync']['blocked_s']:.3f}s, async {results['async']['blocked_s']:.3f}s "
          f"({results['async_blocked_vs_sync']}x; written in background in {results['async']['written_s']:.3f}s) | "
          f"nanoGPT torch.save {ref['save_s']:.3f}s")
    print(f"resume: load_checkpoint {results['resume']['load_checkpoint_s']:.3f}s, "
          f"load_model_for_inference {results['resume']['load_model_for_inference_s']:.3f}s | "
          f"nanoGPT torch.load {ref['load_s']:.3f}s | "
          f"manifest sha256 {manifest_s:.3f}s")


if __name__ == "__main__":
    sys.exit(main())
