"""The loss-spike detector on synthetic traces (fast, no torchrun): a healthy run whose grad norm
drifts up on a loss plateau (issue 17's misfire) is never skipped, real spikes still are, and a
persistent spike with no checkpoint ends in a reported re-baseline instead of an endless streak.
tests/test_resume_training.py covers skip and rollback in a real torchrun run."""
from __future__ import annotations

import json
import math
import random

import pytest

from lm_helpers import tiny_cfg
from tasks.train.metrics import SPIKE_LOG, MetricsLogger
from tasks.train.spikes import SpikeDetector
from tasks.train.trainer import StepResult, Trainer, TrainJob


def issue_trace(steps: int = 120) -> list[tuple[float, float]]:
    """(loss, grad norm) per step 1..steps, shaped like the demo run of issue 17: the loss falls
    from 8.3 to a plateau near 7.0 by step 20 and stays there; the grad norm falls to 0.4 during
    warm-up, drifts up slowly over steps 20-39 (0.42-0.5: a narrow window, whose mean + 6 std the
    old detector froze as its threshold), then rises to 0.7-1.0 over steps 40-61 and stays near 1.0.
    A few percent of deterministic noise on both."""
    rng = random.Random(17)
    trace = []
    for step in range(1, steps + 1):
        if step < 20:
            loss, grad = 8.3 - 1.3 * step / 20, 1.4 - 1.0 * step / 20
        elif step < 40:
            loss, grad = 7.0, 0.42 + 0.08 * (step - 20) / 20
        elif step < 62:
            loss, grad = 7.0, 0.7 + 0.3 * (step - 40) / 21
        else:
            loss, grad = 7.0, 1.0
        trace.append((loss * (1 + rng.gauss(0, 0.006)), grad * (1 + rng.gauss(0, 0.03))))
    return trace


class RecordedEvents:
    """An EventSink that keeps what it is told."""

    def __init__(self):
        self.spikes: list[tuple[str, int, dict]] = []

    def checkpoint_saved(self, path, step, run_id, run_name) -> bool:
        return False

    def spike(self, action, step, run_id, run_name, **details) -> bool:
        self.spikes.append((action, step, details))
        return True

    def drain(self) -> None:
        pass


@pytest.fixture
def trainer(tmp_path):
    """The Trainer's spike handling on one rank without a process group: the detector, the
    rollback/re-baseline decision, spikes.jsonl and the event sink. Its output directory holds no
    checkpoint, so a persistent spike cannot roll back."""
    t = Trainer.__new__(Trainer)  # no model, data or process group: only the spike path runs
    t.cfg = cfg = tiny_cfg(train={"max_steps": 200})
    t.tcfg, t.out_dir, t.pending, t.rollbacks, t.skip_ranges = cfg.train, tmp_path, None, 0, []
    t.job = TrainJob(tokens_index=tmp_path / "index.json", out_dir=tmp_path, run_name="spikes", run_id="run-1")
    t.events = RecordedEvents()
    t.metrics = MetricsLogger(tmp_path, 200, 10)
    tc = cfg.train
    t.detector = SpikeDetector(tc.spike_window, tc.spike_min_history, tc.spike_sigma, tc.spike_rollback_after,
                               loss_ratio=tc.spike_loss_ratio, grad_ratio=tc.spike_grad_ratio)
    return t


def train_on(trainer: Trainer, trace: list[tuple[float, float]]) -> list[int]:
    """Feed the trace to the trainer's spike handling as train_step does; returns the skipped steps."""
    skipped, samples = [], 16
    for step, (loss, grad_norm) in enumerate(trace, start=1):
        spike = trainer.detector.check(loss, grad_norm)
        if spike is None:
            trainer.detector.healthy(loss, grad_norm)
            continue
        skipped.append(step)
        pos = (step - 1) * samples
        result = StepResult(step, pos, pos + samples, 1e-3, loss, 0.0, grad_norm, spike, 0.1)
        assert trainer.on_spike(result) is None  # no checkpoint: never a rollback
    return skipped


def actions(trainer: Trainer) -> list[tuple[str, int]]:
    path = trainer.out_dir / SPIKE_LOG
    return [(r["action"], r["step"]) for r in map(json.loads, path.read_text().splitlines())] if path.exists() else []


def test_drifting_grad_norm_on_a_plateau_is_not_a_spike(trainer):
    assert train_on(trainer, issue_trace()) == []
    assert actions(trainer) == [] and trainer.events.spikes == []


def test_injected_spikes_are_still_skipped(trainer):
    trace = issue_trace()
    loss, grad = trace[79]
    trace[79] = (10 * loss, grad)  # step 80: a 10x loss spike
    loss, grad = trace[99]
    trace[99] = (loss, 100 * grad)  # step 100: a grad-norm explosion at a normal loss
    trace[109] = (math.nan, math.nan)  # step 110: a non-finite loss
    assert train_on(trainer, trace) == [80, 100, 110]
    found = [json.loads(line) for line in (trainer.out_dir / SPIKE_LOG).read_text().splitlines()]
    assert [(r["action"], r["step"], r["reason"]) for r in found] == [
        ("skip", 80, "loss"), ("skip", 100, "grad_norm"), ("skip", 110, "loss+grad_norm")]
    assert found[0]["loss_threshold"] < 8.0 and found[1]["grad_threshold"] < 40.0


def test_persistent_spike_without_checkpoint_rebaselines(trainer):
    """The loss jumps 30 % at step 70 and stays there: with no checkpoint to roll back to, the
    third skip in a row re-baselines (reported everywhere), and training goes on at the new level."""
    n = trainer.tcfg.spike_rollback_after
    trace = [(loss * (1.3 if step >= 70 else 1.0), grad) for step, (loss, grad) in enumerate(issue_trace(), start=1)]
    assert train_on(trainer, trace) == list(range(70, 70 + n))
    assert actions(trainer) == [("skip", s) for s in range(70, 70 + n)] + [("rebaseline", 70 + n - 1)]
    rebaseline = json.loads((trainer.out_dir / SPIKE_LOG).read_text().splitlines()[-1])
    assert rebaseline["reason"] == "no checkpoint before the spike" and rebaseline["spike_steps"] == [70, 72]
    assert 9.0 < rebaseline["loss"] < 9.2 and rebaseline["rebaselines"] == 1
    assert [a for a, _, _ in trainer.events.spikes] == ["skip"] * n + ["rebaseline"]
    assert trainer.detector.consecutive == 0 and len(trainer.detector.losses) == trainer.tcfg.spike_window


def test_non_finite_streak_cannot_rebaseline(trainer):
    trace = issue_trace(60)[:40] + [(math.nan, math.nan)] * 5
    with pytest.raises(FloatingPointError, match="non-finite"):
        train_on(trainer, trace)
    assert actions(trainer) == [("skip", s) for s in (41, 42, 43)]


def test_state_round_trips_mid_streak():
    """A detector restored from its JSON state (as from a checkpoint) in the middle of a streak
    decides and re-baselines exactly as the one that kept running."""
    a = SpikeDetector(window=10, min_history=5, rollback_after=3)
    for loss, grad in issue_trace(30):
        a.healthy(loss, grad)
    assert a.check(9.5, 0.5) is not None and a.spiked(31, 480, 9.5, 0.5) is False
    assert a.check(9.6, 0.5) is not None and a.spiked(32, 496, 9.6, 0.5) is False
    b = SpikeDetector(window=10, min_history=5, rollback_after=3)
    b.load(json.loads(json.dumps(a.state())))
    assert b.state() == a.state() and b.streak == [[9.5, 0.5], [9.6, 0.5]]
    for det in (a, b):
        assert det.check(9.4, 0.5) is not None and det.spiked(33, 512, 9.4, 0.5) is True
        assert det.streak_start == 480 and det.streak_first_step == 31
    assert a.rebaseline() == b.rebaseline() == {"loss": 9.5, "grad_norm": 0.5, "rebaselines": 1}
    assert a.state() == b.state() and a.check(9.55, 0.5) is None
