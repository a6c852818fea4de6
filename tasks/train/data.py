"""Training batches: random windows of seq_len + 1 tokens from the memory-mapped train split.

The generator for each step is seeded from (seed, rank, step), so a batch depends only on
those three numbers: ranks see different data, and a resumed run draws the same batches.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tasks.tokens.binfile import open_split


class RandomWindows:
    def __init__(self, index_path: str | Path, split: str, seq_len: int, batch_size: int,
                 seed: int, rank: int = 0):
        self.tokens = open_split(index_path, split)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.seed, self.rank = seed, rank
        if len(self.tokens) < seq_len + 1:
            raise ValueError(f"{split} split has {len(self.tokens)} tokens, fewer than seq_len + 1 "
                             f"= {seq_len + 1}: make the corpus larger or seq_len smaller")

    def batch(self, step: int, micro: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (batch_size, seq_len) int64, y shifted by one token."""
        rng = np.random.default_rng([self.seed, self.rank, step, micro])
        starts = rng.integers(0, len(self.tokens) - self.seq_len, size=self.batch_size)
        windows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64)
                            for s in starts])
        w = torch.from_numpy(windows)
        return w[:, :-1], w[:, 1:]
