"""CPU training throughput: Crucible's training step against a nanoGPT-style reference loop, at the
same model size, sequence length and batch, on this machine; with and without torch.compile.
Prints the figures and writes benchmarks/results/train_throughput.json.

    .venv/bin/python benchmarks/train_throughput.py [--d-model 256 --n-layer 4 --n-head 4
        --seq-len 256 --batch 8 --vocab 4096 --steps 20 --warmup 5 --threads 2] [--no-compile]

- crucible: tasks.train's pieces as the worker uses them in one process (no DDP): GPT (RMSNorm,
  RoPE, SwiGLU, tied embeddings), build_optimizer's AdamW groups, lr_at, GlobalWindows batches,
  clip_grad_norm_, the loss-spike check, optimizer step.
- reference: a loop written here in the structure of nanoGPT's train.py (random windows drawn
  from a token array, GPT-2 blocks with LayerNorm, learned positions, GELU MLP 4x, AdamW with
  decay on matrices only, grad clipping, per-iteration lr). Its MLP is sized so the parameter
  count matches crucible's within a few percent (the figures report both counts).
- compile: the same loops with the model wrapped in torch.compile; skipped (with the reason
  recorded) when compilation fails here.

Tokens/s counts batch x seq_len tokens per optimizer step; MFU-style FLOPs use 6N + 12 L H Q T.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from _common import add_int_options, write_result  # noqa: E402
from tasks.config import TrainConfig  # noqa: E402
from tasks.train.data import GlobalWindows  # noqa: E402
from tasks.train.model import GPT, GPTConfig  # noqa: E402
from tasks.train.optimizer import build_optimizer  # noqa: E402
from tasks.train.schedule import lr_at, set_lr  # noqa: E402
from tasks.train.spikes import SpikeDetector  # noqa: E402
from tasks.train.flops import flops_per_token  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "train_throughput.json"


# ------------------------------------------------------------------ reference (nanoGPT-style) model

class RefAttention(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(d, 3 * d)
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class RefBlock(nn.Module):
    def __init__(self, d: int, n_head: int, hidden: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = RefAttention(d, n_head)
        self.mlp = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class RefGPT(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d: int, n_layer: int, n_head: int, hidden: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.h = nn.ModuleList(RefBlock(d, n_head, hidden) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, targets):
        T = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def ref_optimizer(model: nn.Module, lr: float, wd: float):
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


# ------------------------------------------------------------------ loops

def timed(step_fn, steps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        step_fn()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step_fn()
        out.append(time.perf_counter() - t0)
    return out


class ArrayWindows(GlobalWindows):
    """GlobalWindows over an in-memory token array (the benchmark needs no tokens stage)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch_size: int, seed: int):
        self.tokens, self.seq_len, self.micro_batch_size, self.seed = tokens, seq_len, micro_batch_size, seed
        self.n_windows = (len(tokens) - 1) // seq_len
        self.n_new = self.n_windows  # one stratum: not a continued-pretraining mix
        self._perm_epoch, self._perm, self.skip_ranges = -1, None, []


def crucible_step_fn(model, tcfg: TrainConfig, tokens: np.ndarray, seq_len: int, batch: int,
                     optimizer=None, spike_check: bool = True, state: dict | None = None):
    """One optimizer step of tasks.train per call. `state` ({"step", "pos"}: steps taken, loader
    position) is kept in the dict given, for a caller that checkpoints (benchmarks/checkpoint.py)."""
    optimizer = optimizer or build_optimizer(model, tcfg)
    data = ArrayWindows(tokens, seq_len, batch, seed=tcfg.seed)
    detector = SpikeDetector() if spike_check else None
    state = {"step": 0, "pos": 0} if state is None else state

    def step():
        state["step"] += 1
        set_lr(optimizer, lr_at(state["step"], tcfg))
        optimizer.zero_grad(set_to_none=True)
        pos = data.step_start(state["pos"])
        x, y = data.micro_batch(pos, 0, 0, 1)
        _, loss = model(x, y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        if detector is None:
            optimizer.step()
        else:
            gn, lv = float(grad_norm), loss.item()
            if detector.check(lv, gn) is None:
                optimizer.step()
                detector.healthy(lv, gn)
        state["pos"] = pos + batch
    return step


def reference_step_fn(model, tcfg: TrainConfig, tokens: np.ndarray, seq_len: int, batch: int):
    optimizer = ref_optimizer(model, tcfg.lr, tcfg.weight_decay)
    data = torch.from_numpy(tokens.astype(np.int64))
    state = {"it": 0}

    def get_batch():
        ix = torch.randint(len(data) - seq_len - 1, (batch,))
        x = torch.stack([data[i:i + seq_len] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + seq_len] for i in ix])
        return x, y

    def get_lr(it):
        if it < tcfg.warmup_steps:
            return tcfg.lr * (it + 1) / (tcfg.warmup_steps + 1)
        ratio = min(1.0, (it - tcfg.warmup_steps) / max(1, tcfg.max_steps - tcfg.warmup_steps))
        return tcfg.min_lr + 0.5 * (1 + math.cos(math.pi * ratio)) * (tcfg.lr - tcfg.min_lr)

    state["xy"] = get_batch()

    def step():
        for g in optimizer.param_groups:
            g["lr"] = get_lr(state["it"])
        x, y = state["xy"]
        _, loss = model(x, y)
        state["xy"] = get_batch()  # fetch the next batch before backward, as nanoGPT does
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss.item()
        state["it"] += 1
    return step


def summarise(times: list[float], tokens_per_step: int, fpt: int) -> dict:
    med = statistics.median(times)
    return {"median_step_s": round(med, 5), "tokens_per_s": round(tokens_per_step / med, 1),
            "tokens_per_s_mean": round(tokens_per_step * len(times) / sum(times), 1),
            # the fastest step is the least disturbed by other processes on a shared machine
            "min_step_s": round(min(times), 5), "tokens_per_s_best": round(tokens_per_step / min(times), 1),
            "flops_per_s": float(f"{fpt * tokens_per_step / med:.4g}"), "steps_timed": len(times)}


def add_model_size_args(ap: argparse.ArgumentParser) -> None:
    """The model and batch size the training benchmarks run at (this one and checkpoint.py)."""
    add_int_options(ap, d_model=256, n_layer=4, n_head=4, seq_len=256, batch=8, vocab=4096)


def model_size_setup(a: argparse.Namespace) -> tuple[np.ndarray, TrainConfig, GPTConfig]:
    """Random tokens (seed 0), the training config and the model config for add_model_size_args' sizes."""
    tokens = np.random.default_rng(0).integers(0, a.vocab, size=400_000, dtype=np.int64)
    tcfg = TrainConfig(max_steps=1000, warmup_steps=10, micro_batch_size=a.batch)
    gcfg = GPTConfig(vocab_size=a.vocab, n_layer=a.n_layer, n_head=a.n_head, d_model=a.d_model, seq_len=a.seq_len)
    return tokens, tcfg, gcfg


def model_size_shape(a: argparse.Namespace) -> dict:
    """add_model_size_args' values, as the "shape" of a result."""
    return {"d_model": a.d_model, "n_layer": a.n_layer, "n_head": a.n_head, "seq_len": a.seq_len,
            "batch": a.batch, "vocab": a.vocab}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_size_args(ap)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULT)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    tokens, tcfg, gcfg = model_size_setup(a)
    tokens_per_step = a.batch * a.seq_len

    def ours():
        torch.manual_seed(0)
        return GPT(gcfg)

    def ref():
        torch.manual_seed(0)
        # size the GELU MLP so the parameter count matches crucible's SwiGLU (3 matrices of mlp_hidden)
        hidden = int(round(3 * gcfg.mlp_hidden / 2))
        return RefGPT(a.vocab, a.seq_len, a.d_model, a.n_layer, a.n_head, hidden)

    load_start = os.getloadavg()[0]
    results: dict = {}
    # Eager: both loops built first, then timed in alternating rounds, so load from other processes
    # on a shared machine falls on both alike.
    built = {}
    for name, build, make_step in (("crucible", ours, crucible_step_fn),
                                   ("reference_nanogpt_style", ref, reference_step_fn)):
        model = build()
        model.train()
        n = sum(p.numel() for p in model.parameters())
        fpt = flops_per_token(n, a.n_layer, a.n_head, a.d_model // a.n_head, a.seq_len)
        step = make_step(model, tcfg, tokens, a.seq_len, a.batch)
        for _ in range(a.warmup):
            step()
        built[name] = (step, n, fpt, [])
    # one step each in turn (order swapped every round): a load burst from another process lands
    # on both loops alike instead of on one loop's block of steps
    order = list(built.items())
    for i in range(a.steps):
        for name, (step, _, _, times) in (order if i % 2 == 0 else order[::-1]):
            times += timed(step, 1, 0)
    for name, (step, n, fpt, times) in built.items():
        r = summarise(times, tokens_per_step, fpt)
        r["params"] = n
        results[name] = {"eager": r}
        print(f"{name:24s} eager    {r['tokens_per_s']:>10,.0f} tokens/s  ({n:,} params)", flush=True)
    for name, build, make_step in (("crucible", ours, crucible_step_fn),
                                   ("reference_nanogpt_style", ref, reference_step_fn)):
        n, fpt = built[name][1], built[name][2]
        if a.no_compile:
            results[name]["compiled"] = {"skipped": "--no-compile"}
            continue
        try:
            model = build()
            model.train()
            compiled = torch.compile(model)
            t0 = time.perf_counter()
            step = make_step(compiled, tcfg, tokens, a.seq_len, a.batch)
            step()  # compiles
            compile_s = time.perf_counter() - t0
            r = summarise(timed(step, a.steps, a.warmup), tokens_per_step, fpt)
            r["compile_s"] = round(compile_s, 1)
            results[name]["compiled"] = r
            print(f"{name:24s} compiled {r['tokens_per_s']:>10,.0f} tokens/s  (compile {compile_s:.0f} s)", flush=True)
        except Exception as e:  # noqa: BLE001 - recorded and reported
            results[name]["compiled"] = {"skipped": f"{type(e).__name__}: {str(e)[:300]}"}
            print(f"{name:24s} compiled skipped: {type(e).__name__}: {str(e)[:200]}", flush=True)
            traceback.print_exc(limit=2)
    ours_e, ref_e = results["crucible"]["eager"], results["reference_nanogpt_style"]["eager"]
    out = {
        "benchmark": "train_throughput",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                    "threads": a.threads, "load_avg_1m_start": load_start, "load_avg_1m_end": os.getloadavg()[0]},
        "note": "shared 2-core machine: other processes' load (load_avg) skews absolute figures; compare rows of one run",
        "shape": {**model_size_shape(a), "tokens_per_step": tokens_per_step},
        "results": results,
        "crucible_vs_reference_eager": round(ours_e["tokens_per_s"] / ref_e["tokens_per_s"], 3),
        "crucible_vs_reference_eager_best": round(ours_e["tokens_per_s_best"] / ref_e["tokens_per_s_best"], 3),
    }
    for name in results:
        c = results[name].get("compiled", {})
        if "tokens_per_s" in c:
            out.setdefault("compile_speedup", {})[name] = round(c["tokens_per_s"] / results[name]["eager"]["tokens_per_s"], 3)
    write_result(a.out, out)
    print(f"crucible / reference (eager): {out['crucible_vs_reference_eager']}x median, "
          f"{out['crucible_vs_reference_eager_best']}x best step; written {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
