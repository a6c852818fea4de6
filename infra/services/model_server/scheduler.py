"""Continuous batching for the model server.

One scheduler thread owns the model calls. Requests submit `Sequence`s (tasks.deploy.generation);
between two steps the thread admits waiting sequences (up to max_batch active), then advances all
active sequences by one token together (`step_sequences`: one batched KV-cached decode per loaded
model). A finished or cancelled sequence leaves the batch at once, so a short request never waits for
a long one. max_batch=1 serves sequences one at a time (the baseline the benchmark compares with).

A sequence carries the TextGenerator it was encoded with, so swapping in a new champion
(`TextGenerator` replaced on the server) never touches sequences already admitted: they finish on
the old model, new ones start on the new one.
"""
from __future__ import annotations

import collections
import logging
import threading

import torch

from tasks.deploy.generation import Sequence, step_sequences

log = logging.getLogger("crucible.scheduler")


class BatchScheduler:
    def __init__(self, max_batch: int = 32):
        self.max_batch = max(1, int(max_batch))
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._active: list[Sequence] = []
        self._cv = threading.Condition()
        self._stop = False
        self.steps = 0
        self.max_seen_batch = 0
        self._thread = threading.Thread(target=self._loop, name="crucible-batcher", daemon=True)
        self._thread.start()

    def submit(self, seqs: list[Sequence]) -> None:
        with self._cv:
            if self._stop:
                raise RuntimeError("the scheduler is stopped")
            self._waiting.extend(seqs)
            self._cv.notify()

    def stats(self) -> dict:
        with self._cv:
            return {"active": len(self._active), "waiting": len(self._waiting), "steps": self.steps,
                    "max_batch": self.max_batch, "max_seen_batch": self.max_seen_batch}

    @property
    def stopped(self) -> bool:
        return self._stop

    def shutdown(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._stop and not self._waiting and not self._active:
                    self._cv.wait()
                if self._stop:
                    for s in list(self._waiting) + self._active:
                        s.error = "the server is shutting down"
                        _safe_notify(s)
                    return
                while self._waiting and len(self._active) < self.max_batch:
                    s = self._waiting.popleft()
                    if s.done:  # cancelled while waiting, or max_tokens=0
                        _safe_notify(s)
                    else:
                        self._active.append(s)
                batch = list(self._active)
            if not batch:
                continue
            self.max_seen_batch = max(self.max_seen_batch, len(batch))
            try:
                step_sequences(batch)
            except Exception as e:  # never let one bad sequence kill the thread: fail the batch
                log.exception("generation step failed")
                for s in batch:
                    if not s.done:
                        s.error = f"generation failed: {type(e).__name__}: {e}"
                        _safe_notify(s)
            self.steps += 1
            with self._cv:
                self._active = [s for s in self._active if not s.done]


def _safe_notify(s: Sequence) -> None:
    try:
        s._notify()
    except Exception:  # a callback must not break the loop
        log.exception("sequence callback failed")
