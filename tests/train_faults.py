"""Test-only torchrun entry: the training worker with faults injected, for the self-healing and
loss-spike tests. Run it with run_training(..., worker_module=WORKER_MODULE) and the faults in the
environment variable FAULTS_ENV (torchrun passes it to every rank):

    corrupt:A[-B]   the batches of steps A..B (counted as in a run without skips) become random token
                    ids, drawn from the rank's data stream, with the loss scaled by 100
    kill:S[:RANK]   SIGKILL the process (rank RANK, or every rank) at the start of step S, first
                    attempt only (torchrun's restarts then heal the run)

Items are comma-separated, e.g. "corrupt:9-10,kill:8:1".
"""
from __future__ import annotations

import functools
import os
import signal
import sys

import torch

from tasks.train.trainer import StepResult, Trainer
from tasks.train.worker import main

WORKER_MODULE = "tests.train_faults"  # importable from the repository root, which run_training puts on PYTHONPATH
FAULTS_ENV = "CRUCIBLE_TRAIN_FAULTS"

Fault = tuple[str, int, int, int | None]  # (kind, first step, last step, rank or None)


def parse_faults(text: str | None) -> list[Fault]:
    faults = []
    for item in filter(None, (t.strip() for t in (text or "").split(","))):
        kind, _, rest = item.partition(":")
        parts = rest.split(":")
        a, _, b = parts[0].partition("-")
        faults.append((kind, int(a), int(b or a), int(parts[1]) if len(parts) > 1 else None))
    return faults


class FaultyTrainer(Trainer):
    def __init__(self, *args, faults: list[Fault], **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = faults
        self.corrupt = False  # the current step's batch is corrupted

    def train_step(self, step: int) -> StepResult:
        for kind, a, _, who in self.faults:
            if kind == "kill" and a == step and self.job.restart == 0 and who in (None, self.rank):
                print(f"[fault] rank {self.rank}: SIGKILL at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
        return super().train_step(step)

    def micro_batch(self, pos: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().micro_batch(pos, micro)
        G = self.global_samples
        self.corrupt = any(kind == "corrupt" and (a - 1) * G <= pos < b * G for kind, a, b, _ in self.faults)
        if self.corrupt:
            vocab = self.gcfg.vocab_size
            x = torch.from_numpy(self.data_rng.integers(0, vocab, size=tuple(x.shape)))
            y = torch.from_numpy(self.data_rng.integers(0, vocab, size=tuple(y.shape)))
        return x, y

    def compute_loss(self, logits: torch.Tensor, targets: torch.Tensor):
        loss, ce, z = super().compute_loss(logits, targets)
        if self.corrupt:
            loss, ce = loss * 100.0, ce * 100.0
        return loss, ce, z


if __name__ == "__main__":
    faults = parse_faults(os.environ.get(FAULTS_ENV))
    sys.exit(main(make_trainer=functools.partial(FaultyTrainer, faults=faults)))
