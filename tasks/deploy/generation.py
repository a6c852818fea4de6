"""Text completion with a Crucible GPT checkpoint: the sampling loop shared by the model server
and the registered MLflow model.

The loop makes the same torch calls as `GPT.generate` (temperature, top-k, one multinomial draw
per step from a seeded generator), so with top_p = 1 and no stop strings a seeded completion equals
the evaluation stage's sample for the same prompt. On top it supports nucleus sampling (top_p),
stop strings, per-row finish reasons and logprobs.

Generation is KV-cached (tasks.train.model.KVCache): a `Sequence` is prefilled once and then decoded
one token per step; `step_sequences` advances any number of sequences (of any lengths, even of
different loaded models) together, which is what the model server's continuous-batching scheduler
(infra/services/model_server/scheduler.py) calls between admissions. Once a sequence has filled
the model's window, each step re-runs the last seq_len tokens from scratch, exactly as the uncached
loop crops its context, so outputs equal GPT.generate's (up to float rounding in the batched
attention).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tasks.tokenizer.bpe import load_tokenizer  # a literal "<|endoftext|>" in user text stays text

DEFAULT_EOS_TOKEN = "<|endoftext|>"
# Inference parameters of a registered version's predict (tasks/deploy/mlflow_model.py) and their defaults (seed -1: unseeded).
PYFUNC_PARAMS = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "seed": -1}


@dataclass
class Completion:
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    completion_tokens: int
    logprobs: dict | None = None  # OpenAI's {"tokens", "token_logprobs", "top_logprobs", "text_offset"}


class TextGenerator:
    """A loaded model + tokenizer. Thread-safe: generation is serialised by a lock."""

    def __init__(self, model, tokenizer, eos_id: int, meta: dict | None = None,
                 checkpoint: str | None = None, tokenizer_path: str | None = None):
        self.model = model.eval()
        self.tok = tokenizer
        self.eos_id = int(eos_id)
        self.meta = dict(meta or {})
        self.checkpoint = checkpoint
        self.tokenizer_path = tokenizer_path
        self.seq_len = int(model.cfg.seq_len)
        self.vocab_size = int(model.cfg.vocab_size)
        self.lock = threading.Lock()
        self.loaded_at = time.time()

    @classmethod
    def from_files(cls, checkpoint: str | Path, tokenizer_path: str | Path,
                   eos_token: str = DEFAULT_EOS_TOKEN, expected_tree_sha256: str | None = None) -> "TextGenerator":
        """Load a checkpoint directory (tasks.train.checkpoint layout, verified: its run's manifest,
        or `expected_tree_sha256` for a copy) and its tokenizer.json.

        Refuses a tokenizer whose hash differs from the one recorded in the checkpoint."""
        from tasks.core import fs
        from tasks.core.storage import stored
        from tasks.train.checkpoint import load_model_for_inference

        # either may be an object of a store this process has open (an object-store run's, read there)
        (checkpoint, options), (tokenizer_path, tok_options) = stored(checkpoint), stored(tokenizer_path)
        checkpoint, tokenizer_path = fs.canonical(checkpoint), fs.canonical(tokenizer_path)
        model, meta = load_model_for_inference(checkpoint, expected_tree_sha256=expected_tree_sha256,
                                               storage_options=options)
        # read once, hashed and parsed from the same bytes
        tok = load_tokenizer(tokenizer_path, tok_options, expected_sha256=meta.get("tokenizer_sha256") or None)
        if tok.get_vocab_size() > model.cfg.vocab_size:
            raise ValueError(f"tokenizer vocab {tok.get_vocab_size()} > model vocab {model.cfg.vocab_size}")
        eos_id = meta.get("eos_id")
        if eos_id is None:
            eos_id = tok.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"no eos_id in the checkpoint and no {eos_token!r} token in {tokenizer_path}")
        return cls(model, tok, eos_id, meta, str(checkpoint), str(tokenizer_path))

    # ------------------------------------------------------------------------------ encoding

    def encode(self, prompt: str) -> list[int]:
        return self.tok.encode(prompt, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def context_ids(self, prompt_ids: list[int]) -> list[int]:
        """What the model is conditioned on: an empty prompt starts a new document (after EOS),
        a prompt longer than the window keeps its last seq_len tokens."""
        return list(prompt_ids[-self.seq_len:]) if prompt_ids else [self.eos_id]

    # ---------------------------------------------------------------------------- sampling

    def new_sequence(self, prompt_ids: list[int], max_tokens: int = 16, temperature: float = 1.0,
                     top_p: float = 1.0, top_k: int | None = None, stop: list[str] | None = None,
                     seed: int | None = None, logprobs: int | None = None, on_event=None) -> "Sequence":
        return Sequence(self, self.context_ids(prompt_ids), max_tokens, temperature, top_p, top_k,
                        [s for s in (stop or []) if s], seed, logprobs, on_event)

    @torch.no_grad()
    def complete(self, prompt_ids: list[int], max_tokens: int = 16, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int | None = None, n: int = 1, stop: list[str] | None = None,
                 seed: int | None = None, logprobs: int | None = None) -> list[Completion]:
        """n completions of one tokenized prompt, generated together (KV-cached) under the lock.
        Choice j > 0 of a seeded request uses seed + j * CHOICE_SEED_STRIDE."""
        seqs = [self.new_sequence(prompt_ids, max_tokens, temperature, top_p, top_k, stop,
                                  choice_seed(seed, j), logprobs) for j in range(n)]
        with self.lock:
            run_to_completion(seqs)
        return [s.result() for s in seqs]

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int | None,
                gen: torch.Generator | None) -> torch.Tensor:
        if temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = F.softmax(logits, dim=-1)
        if top_p < 1.0:
            sorted_p, order = torch.sort(probs, dim=-1, descending=True)
            # drop a token when the mass before it already reaches top_p (the top token always stays)
            drop = (sorted_p.cumsum(dim=-1) - sorted_p) >= top_p
            drop[..., 0] = False  # even when top_p underflows to 0 in the tensor's dtype (a fuzzer found it)
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return torch.multinomial(probs, num_samples=1, generator=gen)


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


CHOICE_SEED_STRIDE = 1_000_003


def choice_seed(seed: int | None, j: int) -> int | None:
    return None if seed is None else seed + j * CHOICE_SEED_STRIDE


class Sequence:
    """One completion being generated: its context, KV cache, sampling settings and output.

    on_event(seq, delta_text, finished) is called from the stepping thread after each step that
    produced safe-to-show text (stop-string prefixes and partial UTF-8 are held back) and once at
    the end with finished=True."""

    def __init__(self, gen: TextGenerator, ctx: list[int], max_tokens: int, temperature: float, top_p: float,
                 top_k: int | None, stop: list[str], seed: int | None, logprobs: int | None, on_event=None):
        self.gen, self.ctx = gen, list(ctx)
        self.max_tokens, self.temperature, self.top_p, self.top_k = max_tokens, temperature, top_p, top_k
        self.stop, self.logprobs, self.on_event = stop, logprobs, on_event
        self.rng = torch.Generator().manual_seed(seed) if seed is not None else None
        self.out: list[int] = []
        self.counted = 0
        self.finish: str | None = "length" if max_tokens <= 0 else None
        self.cut: str | None = None
        self.cache = None
        self.logits: torch.Tensor | None = None  # next-token logits (vocab,) once prefilled
        self.emitted = 0  # characters of text already passed to on_event
        self.cancelled = False
        self.error: str | None = None
        self.index, self.prompt_text = 0, ""  # the server's choice index and prompt text
        self.lp_tokens: list[str] = []
        self.lp_values: list[float] = []
        self.lp_top: list[dict] = []

    @property
    def done(self) -> bool:
        return self.finish is not None or self.cancelled or self.error is not None

    def text(self) -> str:
        return self.cut if self.cut is not None else self.gen.decode(self.out)

    def result(self) -> Completion:
        lp = None
        if self.logprobs is not None:
            offsets, pos = [], 0
            for t in self.lp_tokens:
                offsets.append(pos)
                pos += len(t)
            lp = {"tokens": self.lp_tokens, "token_logprobs": self.lp_values,
                  "top_logprobs": self.lp_top if self.logprobs > 0 else None, "text_offset": offsets}
        return Completion(self.text(), self.finish or "length", self.counted, lp)

    # --------------------------------------------------------------------- model calls

    def _prefill(self) -> None:
        from tasks.train.model import KVCache

        model = self.gen.model
        if self.cache is None:
            self.cache = KVCache(model.cfg)
        window = self.ctx[-self.gen.seq_len:]
        self.logits = model.prefill(torch.tensor([window], dtype=torch.long), self.cache)[0].float()

    def _accept(self, t: int) -> None:
        """Record sampled token t; decide whether the sequence is finished."""
        self.counted += 1
        if self.logprobs is not None:
            lp = torch.log_softmax(self.logits, dim=-1)
            piece = self.gen.decode([t]) if t != self.gen.eos_id else ""
            self.lp_tokens.append(piece)
            self.lp_values.append(round(float(lp[t]), 6))
            if self.logprobs > 0:
                top = torch.topk(lp, min(self.logprobs, lp.numel()))
                self.lp_top.append({self.gen.decode([int(i)]): round(float(v), 6)
                                    for v, i in zip(top.values, top.indices)})
        if t == self.gen.eos_id:
            self.finish = "stop"
            return
        self.out.append(t)
        if self.stop:
            text = self.gen.decode(self.out)
            hit = _first_stop(text, self.stop)
            if hit is not None:
                self.finish, self.cut = "stop", text[:hit]
                return
        if self.counted >= self.max_tokens:
            self.finish = "length"
        self.ctx.append(t)

    def _notify(self) -> None:
        if self.on_event is None:
            return
        if self.done:
            text = self.text()
            delta = text[self.emitted:]
            self.emitted = len(text)
            self.on_event(self, delta, True)
            return
        text = self.gen.decode(self.out)
        safe = len(text)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for its next bytes
            safe = len(text.rstrip("\ufffd"))
        for s in self.stop:  # hold back a tail that could still become a stop string
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        if safe > self.emitted:
            delta = text[self.emitted:safe]
            self.emitted = safe
            self.on_event(self, delta, False)


def step_sequences(seqs: list[Sequence]) -> None:
    """Advance every unfinished sequence by one token: prefill the new ones (their first token is
    sampled from the prefill logits), sample, then one batched decode step per loaded model for the
    sequences that continue. Callers serialise calls per model."""
    live = [s for s in seqs if not s.done]
    for s in live:
        if s.logits is None:
            s._prefill()
    for s in live:
        t = int(TextGenerator._sample(s.logits[None], s.temperature, s.top_p, s.top_k, s.rng)[0, 0])
        s._accept(t)
    going = [s for s in live if not s.done]
    by_model: dict[int, list[Sequence]] = {}
    for s in going:
        if s.cache.length >= s.gen.seq_len:  # the window is full: recompute it, as the uncached loop does
            s._prefill()
        else:
            by_model.setdefault(id(s.gen.model), []).append(s)
    for group in by_model.values():
        model = group[0].gen.model
        logits = model.decode_step(torch.tensor([s.ctx[-1] for s in group], dtype=torch.long),
                                   [s.cache for s in group]).float()
        for s, row in zip(group, logits):
            s.logits = row
    for s in live:
        s._notify()
        if s.done:
            s.cache = s.logits = None  # free memory early


@torch.no_grad()
def run_to_completion(seqs: list[Sequence]) -> None:
    for s in seqs:
        if s.done:
            s._notify()
    while any(not s.done for s in seqs):
        step_sequences(seqs)
