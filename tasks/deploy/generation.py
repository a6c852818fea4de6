"""Text completion with a Crucible GPT checkpoint: the sampling loop shared by the model server
and the registered MLflow model.

The loop makes the same torch calls as `GPT.generate` (temperature, top-k, one multinomial draw
per step from a seeded generator), so with top_p = 1 and no stop strings a seeded completion equals
the evaluation stage's sample for the same prompt. On top it supports nucleus sampling (top_p),
stop strings and per-row finish reasons. No KV cache: each step reruns the last seq_len tokens.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from tasks.core.hashing import sha256_file

DEFAULT_EOS_TOKEN = "<|endoftext|>"
# Inference parameters of the registered pyfunc and their defaults (seed -1: unseeded).
PYFUNC_PARAMS = {"max_tokens": 16, "temperature": 1.0, "top_p": 1.0, "seed": -1}


@dataclass
class Completion:
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    completion_tokens: int


def load_tokenizer(path: str | Path):
    """tokenizer.json; a literal "<|endoftext|>" in user text stays text (never the EOS id)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    tok.encode_special_tokens = True
    return tok


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
                   eos_token: str = DEFAULT_EOS_TOKEN) -> "TextGenerator":
        """Load a checkpoint directory (tasks.train.checkpoint layout) and its tokenizer.json.

        Refuses a tokenizer whose hash differs from the one recorded in the checkpoint."""
        from tasks.train.checkpoint import load_model_for_inference

        checkpoint, tokenizer_path = Path(checkpoint).resolve(), Path(tokenizer_path).resolve()
        model, meta = load_model_for_inference(checkpoint)
        tok = load_tokenizer(tokenizer_path)
        want = meta.get("tokenizer_sha256")
        if want and want != sha256_file(tokenizer_path):
            raise ValueError(f"tokenizer {tokenizer_path} is not the one checkpoint {checkpoint} was trained with")
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

    @torch.no_grad()
    def complete(self, prompt_ids: list[int], max_tokens: int = 16, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int | None = None, n: int = 1, stop: list[str] | None = None,
                 seed: int | None = None) -> list[Completion]:
        """n completions of one tokenized prompt."""
        stop = [s for s in (stop or []) if s]
        ctx = self.context_ids(prompt_ids)
        with self.lock:
            gen = torch.Generator().manual_seed(seed) if seed is not None else None
            idx = torch.tensor([ctx] * n, dtype=torch.long)
            out: list[list[int]] = [[] for _ in range(n)]
            counted = [0] * n
            finish: list[str | None] = [None] * n
            cut: list[str | None] = [None] * n
            for _ in range(max_tokens):
                logits, _ = self.model(idx[:, -self.seq_len:])
                next_id = self._sample(logits[:, -1, :].float(), temperature, top_p, top_k, gen)
                for i in range(n):
                    if finish[i] is not None:
                        next_id[i, 0] = self.eos_id  # finished rows are padded, as in GPT.generate
                        continue
                    t = int(next_id[i, 0])
                    counted[i] += 1
                    if t == self.eos_id:
                        finish[i] = "stop"
                        continue
                    out[i].append(t)
                    if stop:
                        text = self.decode(out[i])
                        hit = _first_stop(text, stop)
                        if hit is not None:
                            finish[i], cut[i] = "stop", text[:hit]
                idx = torch.cat([idx, next_id], dim=1)
                if all(f is not None for f in finish):
                    break
        results = []
        for i in range(n):
            text = cut[i] if cut[i] is not None else self.decode(out[i])
            results.append(Completion(text, finish[i] or "length", counted[i]))
        return results

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
            sorted_p = sorted_p.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return torch.multinomial(probs, num_samples=1, generator=gen)


def _first_stop(text: str, stops: list[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None
