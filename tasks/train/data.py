"""Training batches: random windows of seq_len + 1 tokens from the memory-mapped train split.

The generator for each step is seeded from (seed, rank, step), so a batch depends only on
those three numbers: ranks see different data, and a resumed run draws the same batches.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tasks.tokens.binfile import load_index, open_doc_starts, open_split


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


class GlobalWindows:
    """Training samples addressed by a global sample index, independent of the world size.

    The train split is cut into n = (tokens - 1) // seq_len windows of seq_len + 1 tokens (stride
    seq_len). Epoch e visits them in a permutation seeded by (seed, e); global sample g is window
    perm_{g // n}[g % n]. Optimizer step s reads the global samples [c, c + global_batch) where c
    is the loader position (samples consumed so far), and data-parallel rank r, micro-batch m of W
    data-parallel ranks takes the slice starting at c + (m * W + r) * micro_batch_size (the tensor,
    pipeline and context-parallel ranks of one replica read the same samples: `rank` and `world` here
    are the "dp" mesh dimension's). So a run resumed on another layout, with the same global batch,
    reads the same samples in the same steps.

    `skip_ranges` ([start, end) global sample ranges) are jumped over: a loss-spike rollback
    records the offending data there.

    A continued-pretraining mix (index.json "mix": new tokens, then replayed ones from token
    `replay_start`) is stratified: each epoch permutes the new windows and the replay windows
    separately and interleaves them evenly, so every stretch of training sees the configured
    replay share (up to one window), not just the epoch as a whole.

    With `documents=True` the split's document starts are loaded and `micro_batch_documents`
    gives, per input token, its document id within the sequence and its position in that
    document (for the model's document mask and per-document RoPE positions). A document cut by
    the window's start counts from 0 at the window start, as the unmasked model would see it.
    """

    def __init__(self, index_path: str | Path, split: str, seq_len: int, micro_batch_size: int,
                 seed: int, documents: bool = False):
        self.tokens = open_split(index_path, split)
        self.doc_starts = np.asarray(open_doc_starts(index_path, split)) if documents else None
        self.seq_len, self.micro_batch_size, self.seed = seq_len, micro_batch_size, seed
        self.n_windows = (len(self.tokens) - 1) // seq_len
        if self.n_windows < 1:
            raise ValueError(f"{split} split has {len(self.tokens)} tokens, fewer than seq_len + 1 "
                             f"= {seq_len + 1}: make the corpus larger or seq_len smaller")
        self._perm_epoch, self._perm = -1, None
        self.skip_ranges: list[tuple[int, int]] = []
        mix = load_index(index_path).get("mix")
        # windows starting before the replay part are the new data's stratum
        self.n_new = min(self.n_windows, -(-mix["replay_start"] // seq_len)) if mix else self.n_windows

    def window_start(self, g: int) -> int:
        """Token offset in the split where global sample g's window starts."""
        return self._window(g) * self.seq_len

    def _window(self, g: int) -> int:
        epoch, i = divmod(g, self.n_windows)
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.seed, epoch])
            if self.n_new == self.n_windows:
                self._perm = rng.permutation(self.n_windows)
            else:  # two strata, interleaved evenly (Bresenham): the replay share holds in every prefix
                new, replay = rng.permutation(self.n_new), self.n_new + rng.permutation(self.n_windows - self.n_new)
                k = np.arange(1, self.n_windows + 1)
                is_replay = np.diff(np.concatenate(([0], k * len(replay) // self.n_windows))).astype(bool)
                self._perm = np.empty(self.n_windows, dtype=np.int64)
                self._perm[is_replay], self._perm[~is_replay] = replay, new
            self._perm_epoch = epoch
        return int(self._perm[i])

    def documents(self, first: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(doc_ids, positions), each (count, seq_len) int64, for the input tokens of global
        samples first .. first + count - 1: doc_ids count documents from 0 in each sequence."""
        if self.doc_starts is None:
            raise RuntimeError("GlobalWindows was built without documents=True")
        offsets = np.arange(self.seq_len, dtype=np.int64)
        ids, pos = [], []
        for g in range(first, first + count):
            s = self._window(g) * self.seq_len
            doc = np.searchsorted(self.doc_starts, s + offsets, side="right") - 1
            begin = np.maximum(self.doc_starts[doc], s)
            ids.append(doc - doc[0])
            pos.append(s + offsets - begin)
        return torch.from_numpy(np.stack(ids)), torch.from_numpy(np.stack(pos))

    def samples(self, first: int, count: int) -> torch.Tensor:
        """(count, seq_len + 1) int64 windows for global samples first .. first + count - 1."""
        rows = []
        for g in range(first, first + count):
            s = self._window(g) * self.seq_len
            rows.append(np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64))
        return torch.from_numpy(np.stack(rows))

    def step_start(self, position: int) -> int:
        """First sample of the next step from a loader position (skipping recorded bad ranges)."""
        moved = True
        while moved:
            moved = False
            for a, b in self.skip_ranges:
                if a <= position < b:
                    position, moved = b, True
        return position

    def micro_batch(self, step_start: int, micro: int, rank: int, world: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) for one rank's micro-batch of the step whose first global sample is step_start."""
        w = self.samples(self._first(step_start, micro, rank, world), self.micro_batch_size)
        return w[:, :-1], w[:, 1:]

    def micro_batch_documents(self, step_start: int, micro: int, rank: int, world: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(doc_ids, positions) matching micro_batch's x."""
        return self.documents(self._first(step_start, micro, rank, world), self.micro_batch_size)

    def _first(self, step_start: int, micro: int, rank: int, world: int) -> int:
        return step_start + (micro * world + rank) * self.micro_batch_size


def global_batch(tcfg, seq_len: int, world: int) -> tuple[int, int]:
    """(global samples per optimizer step, micro-batches per rank per step) when all `world` ranks are
    data-parallel: ParallelDims.global_batch, which the trainer uses for any layout (the batch is split
    over the data-parallel ranks only)."""
    from tasks.train.parallel_dims import ParallelDims

    return ParallelDims(pp=1, dp_replicate=1, dp_shard=world, cp=1, tp=1, ep=1, world=world).global_batch(tcfg, seq_len)
