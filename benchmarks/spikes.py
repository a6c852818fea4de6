"""Does the loss-spike detector leave healthy runs alone? The demo's real training, with the
detector on, at several lengths, and the count of what it did; writes benchmarks/results/spikes.json.

    .venv/bin/python benchmarks/spikes.py [--config configs/tiny.yaml] [--set k=v ...]
        [--steps 200 300 1000] [--tokens-index runs/<run>/tokens/index.json] [--work DIR] [--no-before]

Data: the config's sources run through the pipeline's own stages as plain Python (ingest, curate,
quality, tokenizer, tokens) once, under --work (reused when it already holds them), unless
--tokens-index names a finished run's token shards. Training: run_training (torchrun, the config's
processes, model and train settings; only max_steps changes), so the figures are the demo's.

Arms, each at every length:
- after: the pipeline's trainer and detector (tasks/train/spikes.py).
- before: the detector as it was before issue 17 (mean + sigma * std of the healthy window, std
  floored at 2 % of the mean; the window frozen while skipping; "rollback_unavailable" each step of
  a streak with no checkpoint), copied below and run as this file's torchrun worker.

Reported per run: batches skipped and their share of the steps, the longest run of consecutive
skips, re-baselines, rollbacks, wall time, and the peak loss and grad norm relative to the median of
the steps before (the headroom left to train.spike_loss_ratio and spike_grad_ratio). Target (issue 17): at most 0.5 % of steps skipped on these
healthy runs and no streak longer than train.spike_rollback_after.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from infra.settings import load_config  # noqa: E402
from tasks.config import PipelineConfig  # noqa: E402
from tasks.train.metrics import SPIKE_LOG, TRAIN_LOG  # noqa: E402
from tasks.train.trainer import StepResult, Trainer  # noqa: E402

RESULT = REPO / "benchmarks" / "results" / "spikes.json"
BEFORE_WORKER = "benchmarks.spikes"  # torchrun runs this file as the before arm's worker
MAX_SKIPPED_SHARE = 0.005  # issue 17


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs" / "tiny.yaml"))
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--steps", type=int, nargs="+", default=[200, 300, 1000])
    ap.add_argument("--tokens-index", type=Path, help="token shards to train on (default: built from the config)")
    ap.add_argument("--work", type=Path, help="working directory, kept (default: a temporary one)")
    ap.add_argument("--no-before", action="store_true", help="run the current detector only")
    ap.add_argument("--out", default=str(RESULT))
    args = ap.parse_args()
    if args.work is not None:
        return run(args, args.work.resolve())
    with tempfile.TemporaryDirectory(prefix="crucible-spikes-") as tmp:
        return run(args, Path(tmp))


def run(args: argparse.Namespace, work: Path) -> int:
    from _common import write_result  # here: the torchrun worker (below) has no benchmarks/ on sys.path

    cfg = load_config(args.config, [f"run_root={work}", *args.overrides])
    index = args.tokens_index.resolve() if args.tokens_index else build_tokens_index(cfg, work)
    arms = ("after",) if args.no_before else ("after", "before")
    runs = [train_arm(cfg, index, work, steps, arm) for steps in args.steps for arm in arms]
    out = summarise(args, cfg, index, runs)
    print_summary(out)
    write_result(args.out, out)
    return 0


def build_tokens_index(cfg: PipelineConfig, work: Path) -> Path:
    """The config's sources through ingest, curate, quality, tokenizer and tokens, run as plain
    Python stages (no Prefect, no MLflow) into work/data; reused when already built there."""
    from tasks.core.layout import RunLayout
    from tasks.core.stage import StageContext, StageInputs
    from tasks.registry import STAGES

    layout = RunLayout.for_run(work, "data")
    if layout.tokens_index.is_file():
        print(f"[spikes] reusing {layout.tokens_index}", flush=True)
        return layout.tokens_index
    ctx = StageContext(layout=layout, run_name="spikes-data", tracking_uri="", experiment="spikes")
    inputs = StageInputs()
    for name in ("ingest", "curate", "quality"):
        inputs = StageInputs(shards=STAGES[name].run(cfg, inputs, ctx).shards)
        print(f"[spikes] {name}: {len(inputs.shards)} shard(s)", flush=True)
    tokenizer = STAGES["tokenizer"].run(cfg, inputs, ctx).path
    return Path(STAGES["tokens"].run(cfg, StageInputs(shards=inputs.shards, tokenizer=tokenizer), ctx).index_path)


def train_arm(cfg: PipelineConfig, index: Path, work: Path, steps: int, arm: str) -> dict:
    """One real training run of `steps` steps; what the spike handling did in it."""
    from tasks.train import run_training

    train = cfg.train.model_copy(update={"max_steps": steps})
    run_cfg = cfg.model_copy(update={"train": train})
    out_dir = work / f"{arm}-{steps}"
    worker = {"worker_module": BEFORE_WORKER} if arm == "before" else {}
    print(f"[spikes] {arm}: {steps} steps -> {out_dir}", flush=True)
    result = run_training(run_cfg, index, out_dir, None, None, f"spikes-{arm}-{steps}", **worker)
    actions = [json.loads(line) for line in (out_dir / SPIKE_LOG).read_text().splitlines()] \
        if (out_dir / SPIKE_LOG).is_file() else []
    skips = [a for a in actions if a["action"] == "skip"]
    count = {name: sum(a["action"] == name for a in actions) for name in ("rebaseline", "rollback",
                                                                          "rollback_unavailable")}
    return {"arm": arm, "steps": steps, "skipped": len(skips), "skipped_share": round(len(skips) / steps, 4),
            "longest_streak": max((a["consecutive"] for a in skips), default=0),
            "rebaselines": count["rebaseline"], "rollbacks": count["rollback"],
            "rollback_unavailable": count["rollback_unavailable"],
            "skipped_steps": [a["step"] for a in skips][:50],
            "skip_reasons": sorted({a["reason"] for a in skips}),
            **peak_ratios(out_dir / TRAIN_LOG, cfg.train.spike_window),
            "final_loss": round(result["final_loss"], 4), "wall_s": result["seconds"]}


def peak_ratios(train_log: Path, window: int) -> dict:
    """The largest loss and grad norm relative to the median of the `window` steps before (as the
    detector's baseline, counting every logged step): how close the run came to the ratio tests."""
    rows = [json.loads(line) for line in train_log.read_text().splitlines()]
    out = {}
    for key in ("loss", "grad_norm"):
        values = [r[key] for r in rows]
        ratio, step = max((values[i] / median(values[max(0, i - window):i]), rows[i]["step"])
                          for i in range(1, len(values)))
        out[f"peak_{key}_ratio"] = {"ratio": round(ratio, 3), "step": step}
    return out


def summarise(args: argparse.Namespace, cfg: PipelineConfig, index: Path, runs: list[dict]) -> dict:
    t = cfg.train
    after = [r for r in runs if r["arm"] == "after"]
    return {
        "benchmark": "loss-spike detector on healthy demo runs (issue 17)",
        "config": os.path.relpath(args.config, REPO),
        "overrides": args.overrides,
        "tokens_index": {"built_from": "the config's sources (ingest, curate, quality, tokenizer, tokens)"
                         if args.tokens_index is None else str(index),
                         "train_tokens": json.loads(index.read_text())["splits"]["train"]["tokens"]},
        "training": {"nproc_per_node": t.nproc_per_node, "micro_batch_size": t.micro_batch_size,
                     "seq_len": cfg.model.seq_len, "checkpoint_every": t.checkpoint_every,
                     "warmup_steps": t.warmup_steps, "lr": t.lr},
        "detector": {k: getattr(t, k) for k in ("spike_window", "spike_min_history", "spike_sigma",
                                                "spike_loss_ratio", "spike_grad_ratio", "spike_rollback_after",
                                                "spike_max_rollbacks")},
        "target": {"max_skipped_share": MAX_SKIPPED_SHARE, "max_streak": t.spike_rollback_after},
        "target_met": all(r["skipped_share"] <= MAX_SKIPPED_SHARE and r["longest_streak"] <= t.spike_rollback_after
                          for r in after),
        "runs": runs,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }


def print_summary(out: dict) -> None:
    print(f"\n{'arm':7} {'steps':>6} {'skipped':>8} {'share':>7} {'streak':>7} {'rebase':>7} {'rollbk':>7} "
          f"{'unavail':>8} {'wall s':>8} {'peak loss':>10} {'peak grad':>10}")
    for r in out["runs"]:
        print(f"{r['arm']:7} {r['steps']:>6} {r['skipped']:>8} {r['skipped_share']:>7.2%} {r['longest_streak']:>7} "
              f"{r['rebaselines']:>7} {r['rollbacks']:>7} {r['rollback_unavailable']:>8} {r['wall_s']:>8.1f} "
              f"{r['peak_loss_ratio']['ratio']:>10.3f} {r['peak_grad_norm_ratio']['ratio']:>10.2f}")
    print(f"target (<= {out['target']['max_skipped_share']:.1%} skipped, streak <= {out['target']['max_streak']}): "
          f"{'met' if out['target_met'] else 'NOT met'}")


# ------------------------------------------------------------------ the before arm (pre-issue-17 detector)

@dataclass
class PreFixDetector:
    """tasks/train/spikes.py's SpikeDetector before issue 17, verbatim in its decisions."""
    window: int = 20
    min_history: int = 5
    sigma: float = 6.0
    rollback_after: int = 3
    losses: deque = field(default_factory=deque)
    grad_norms: deque = field(default_factory=deque)
    consecutive: int = 0
    streak_start: int | None = None
    streak_first_step: int | None = None

    def _threshold(self, values: deque) -> float | None:
        if len(values) < self.min_history:
            return None
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        return mean + self.sigma * max(std, 0.02 * abs(mean))

    def check(self, loss: float, grad_norm: float) -> dict | None:
        lt, gt = self._threshold(self.losses), self._threshold(self.grad_norms)
        reasons = []
        if not math.isfinite(loss) or (lt is not None and loss > lt):
            reasons.append("loss")
        if not math.isfinite(grad_norm) or (gt is not None and grad_norm > gt):
            reasons.append("grad_norm")
        if not reasons:
            return None
        return {"reason": "+".join(reasons), "loss": loss, "grad_norm": grad_norm,
                "loss_threshold": lt, "grad_threshold": gt}

    def healthy(self, loss: float, grad_norm: float) -> None:
        self.losses.append(loss)
        self.grad_norms.append(grad_norm)
        while len(self.losses) > self.window:
            self.losses.popleft()
            self.grad_norms.popleft()
        self.consecutive, self.streak_start, self.streak_first_step = 0, None, None

    def spiked(self, step: int, position: int) -> bool:
        if self.consecutive == 0:
            self.streak_start, self.streak_first_step = position, step
        self.consecutive += 1
        return self.consecutive >= self.rollback_after

    def state(self) -> dict:
        return {"losses": list(self.losses), "grad_norms": list(self.grad_norms), "consecutive": self.consecutive,
                "streak_start": self.streak_start, "streak_first_step": self.streak_first_step}

    def load(self, state: dict) -> None:
        self.losses = deque(state.get("losses", []))
        self.grad_norms = deque(state.get("grad_norms", []))
        self.consecutive = state.get("consecutive", 0)
        self.streak_start = state.get("streak_start")
        self.streak_first_step = state.get("streak_first_step")


class PreFixTrainer(Trainer):
    """The pipeline's trainer with the pre-issue-17 detector and streak handling."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        t = self.tcfg
        self.detector = PreFixDetector(t.spike_window, t.spike_min_history, t.spike_sigma, t.spike_rollback_after)

    def on_spike(self, result: StepResult) -> int | None:
        step, pos, end = result.step, result.pos, result.end
        persistent = self.detector.spiked(step, pos)
        self.report_spike(step, "skip", **result.spike, data_range=[pos, end], consecutive=self.detector.consecutive)
        if not persistent:
            return None
        from tasks.train.checkpoint import latest_checkpoint

        self.finish_checkpoint()
        target = latest_checkpoint(self.out_dir, before_step=self.detector.streak_first_step)
        if target is not None and self.rollbacks < self.tcfg.spike_max_rollbacks:
            return self.roll_back(target, step, end)
        why = "no checkpoint before the spike" if target is None else "spike_max_rollbacks reached"
        self.report_spike(step, "rollback_unavailable", reason=why)
        return None


if __name__ == "__main__":
    if "LOCAL_RANK" in os.environ:  # started by torchrun: the before arm's worker
        from tasks.train.worker import main as worker_main

        sys.exit(worker_main(make_trainer=PreFixTrainer))
    sys.exit(main())
