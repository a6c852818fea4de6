"""Batch-size ramp in tokens (GPT-3 style): the global batch starts at train.batch_ramp_start_tokens
and grows linearly with the tokens trained to the full batch (train.batch_tokens, else micro_batch_size
x dp x grad_accum_steps x seq_len) over the first train.batch_ramp_tokens tokens.

The batch of a step is a function of the tokens trained before it, in integers, rounded to the
nearest multiple of the layout's step granularity (micro_batch_size x dp sequences, x
pp_microbatches with a pipeline): each data-parallel rank then runs a whole number of micro-batches,
a number that changes from step to step while the ramp lasts (a pipeline's micro-batches grow
instead: tasks/train/pipeline.py keeps a schedule per micro-batch shape). The tokens trained so far are part of
the loop's state and of every checkpoint's schedule record (tasks/train/schedule.py), so a resumed
run, on another layout or world size too, continues the ramp from the same point (with a different
granularity the batches round differently from there on; the data position stays exact).

The learning-rate warm-up follows the ramp's tokens: see tasks/train/schedule.py. The checks of the ramp
settings (`check_ramp`) live in tasks/train/parallel_dims.py with the other layout checks.
"""
from __future__ import annotations

from dataclasses import dataclass

from tasks.train.parallel_dims import ParallelDims, check_ramp, step_granularity


@dataclass(frozen=True)
class BatchRamp:
    """The ramp on one layout, in sequences (samples) of seq_len tokens."""
    start_samples: int  # global batch of the first step
    full_samples: int  # global batch once the ramp is over
    ramp_tokens: int  # tokens over which the batch grows from start to full
    granularity: int  # every step's batch is a multiple of this (micro_batch_size x dp [x pp_microbatches])
    micro_samples: int  # one micro-batch on every data-parallel rank: micro_batch_size x dp
    seq_len: int

    @classmethod
    def for_layout(cls, tcfg, dims: ParallelDims, seq_len: int) -> "BatchRamp | None":
        """The configured ramp on `dims` (checked), or None without one."""
        check_ramp(dims, tcfg, seq_len)
        if tcfg.batch_ramp_start_tokens is None:
            return None
        return cls(start_samples=tcfg.batch_ramp_start_tokens // seq_len,
                   full_samples=dims.global_batch(tcfg, seq_len)[0], ramp_tokens=tcfg.batch_ramp_tokens,
                   granularity=step_granularity(dims, tcfg), micro_samples=tcfg.micro_batch_size * dims.dp,
                   seq_len=seq_len)

    def samples_at(self, tokens_trained: int) -> int:
        """Global batch (sequences) of the step that starts after `tokens_trained` tokens."""
        if tokens_trained >= self.ramp_tokens:
            return self.full_samples
        grow = (self.full_samples - self.start_samples) * tokens_trained // self.ramp_tokens
        g = self.granularity
        rounded = (self.start_samples + grow + g // 2) // g * g  # nearest multiple, halves up
        return min(self.full_samples, max(g, rounded))

    def micro_batches_at(self, tokens_trained: int) -> int:
        """Micro-batches of micro_batch_size each data-parallel rank runs in that step (a pipeline
        splits those sequences into its pp_microbatches)."""
        return self.samples_at(tokens_trained) // self.micro_samples

    def record(self, tokens_trained: int) -> dict:
        """What a checkpoint's schedule record holds of the ramp at this point."""
        return {"start_tokens": self.start_samples * self.seq_len, "ramp_tokens": self.ramp_tokens,
                "full_tokens": self.full_samples * self.seq_len, "tokens_trained": int(tokens_trained),
                "next_batch_tokens": self.samples_at(tokens_trained) * self.seq_len}

    def steps_to_full(self) -> int:
        """Optimizer steps until the batch is full (the ramp's length in steps on this layout)."""
        tokens, steps = 0, 0
        while tokens < self.ramp_tokens:
            tokens += self.samples_at(tokens) * self.seq_len
            steps += 1
        return steps


def tokens_trained_from_meta(meta: dict) -> int | None:
    """The ramp's tokens trained recorded in a checkpoint meta's schedule record (None: not recorded)."""
    ramp = (meta.get("schedule") or {}).get("batch_ramp")
    return None if not ramp else int(ramp["tokens_trained"])
