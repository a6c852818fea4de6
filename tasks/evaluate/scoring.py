"""Log-likelihood scoring of text with a Crucible GPT: the core under the task suite and the
lm-evaluation-harness adapter.

Semantics follow lm-evaluation-harness (`TemplateLM.loglikelihood`, `HFLM._loglikelihood_tokens`,
`utils.get_rolling_token_windows`) so that numbers from `tasks.evaluate.suite` and from lm-eval
through `CrucibleLM` agree:

- (context, continuation): trailing spaces of the context move to the continuation; the
  continuation's tokens are those of encode(context + continuation) after the first
  len(encode(context)) tokens. An empty context is replaced by the EOS token (Crucible separates
  training documents with EOS, so it means "start of a document").
- The model sees at most seq_len tokens. Targets are predicted in chunks: the first chunk holds up
  to seq_len targets, later chunks `stride` targets each, and every chunk's input is the seq_len
  tokens just before its last target (fewer at the start of the sequence). So a continuation that
  fits is scored in one pass on the last seq_len + 1 tokens of context + continuation, exactly as
  lm-eval truncates, and with stride = seq_len a document is split into disjoint prediction windows
  whose last (partial) window gets a full context, as lm-eval's `loglikelihood_rolling` does. A
  smaller stride gives every later token at least seq_len - stride + 1 tokens of context, at
  seq_len / stride times the cost (lm-eval's `context_len` = seq_len - stride + 1).
- is_greedy: every target token is the argmax of the model's distribution at its position.

Windows of all requests are sorted by length and run in right-padded batches (causal attention:
padding after a row's tokens cannot change them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Scored:
    """Summed log-probability (natural log) of the scored tokens, whether all of them are the
    greedy (argmax) choice, and how many tokens were scored."""

    logprob: float
    is_greedy: bool
    n_tokens: int


def rolling_chunks(n: int, first: int, seq_len: int, stride: int | None = None) -> list[tuple[int, int, int]]:
    """Windows that predict seq[first:n] of a sequence of n tokens, each target exactly once.

    Returns (input_start, input_end, n_scored) per window: the model reads seq[input_start:input_end]
    (at most seq_len tokens) and its last n_scored predictions are targets
    seq[input_end - n_scored + 1 : input_end + 1]. The first window predicts up to seq_len targets,
    the following ones `stride` (default seq_len) each.
    """
    stride = seq_len if stride is None else stride
    if not 1 <= stride <= seq_len:
        raise ValueError(f"stride must be in 1..seq_len ({seq_len}), got {stride}")
    if first < 1:
        raise ValueError("the first target needs at least one token before it")
    out, a, size = [], first, seq_len
    while a < n:
        b = min(n, a + size)  # targets a..b-1
        s = max(0, b - 1 - seq_len)
        out.append((s, b - 1, b - a))
        a, size = b, stride
    return out


class LMScorer:
    """A loaded model and tokenizer, scoring and generating text (CPU, no grad)."""

    def __init__(self, model, tokenizer, eos_id: int, batch_size: int = 16):
        self.model = model.eval()
        self.tok = tokenizer
        self.eos_id = int(eos_id)
        self.batch_size = int(batch_size)
        self.seq_len = int(model.cfg.seq_len)
        self.device = next(model.parameters()).device

    @classmethod
    def from_files(cls, checkpoint: str | Path, tokenizer_path: str | Path, batch_size: int = 16,
                   eos_token: str = "<|endoftext|>", expected_tree_sha256: str | None = None) -> "LMScorer":
        """Load a checkpoint directory (verified: its run's manifest, or `expected_tree_sha256` for a
        copy) and its tokenizer.json; refuses a tokenizer whose hash differs from the one the
        checkpoint records."""
        from tasks.core.storage import stored
        from tasks.tokenizer.bpe import load_tokenizer
        from tasks.train.checkpoint import load_model_for_inference

        # either may be an object of an open store (an object-store run's checkpoint, read where it lives)
        at, options = stored(checkpoint)
        model, meta = load_model_for_inference(at, expected_tree_sha256=expected_tree_sha256, storage_options=options)
        # read once, hashed and parsed from the same bytes
        tok = load_tokenizer(*stored(tokenizer_path), expected_sha256=meta.get("tokenizer_sha256") or None)
        eos_id = meta.get("eos_id")
        if eos_id is None:
            eos_id = tok.token_to_id(eos_token)
        if eos_id is None:
            raise ValueError(f"no eos_id in {checkpoint} and no {eos_token!r} token in {tokenizer_path}")
        scorer = cls(model, tok, eos_id, batch_size)
        scorer.meta = meta
        return scorer

    # ------------------------------------------------------------------------------ text

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)] if texts else []

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """lm-eval's split of (context, continuation) into token ids (see the module doc)."""
        if context == "":
            return [self.eos_id], self.encode(continuation)
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        if context == "":  # the context was only whitespace
            return [self.eos_id], self.encode(continuation)
        whole = self.encode(context + continuation)
        ctx = self.encode(context)
        return ctx, whole[len(ctx):]

    # --------------------------------------------------------------------------- scoring

    @torch.no_grad()
    def score_tokens(self, requests: list[tuple[list[int], list[int]]], stride: int | None = None
                     ) -> list[Scored]:
        """Score each continuation token list given its (non-empty) context token list."""
        windows = []  # (request, input ids, target ids of the scored positions)
        for r, (ctx, cont) in enumerate(requests):
            if not ctx:
                raise ValueError("empty context: pass [eos_id] to score from the start of a document")
            seq = list(ctx) + list(cont)
            for s, e, k in rolling_chunks(len(seq), len(ctx), self.seq_len, stride):
                windows.append((r, seq[s:e], seq[e - k + 1:e + 1]))
        logprob = [0.0] * len(requests)
        greedy = [True] * len(requests)
        count = [0] * len(requests)
        order = sorted(range(len(windows)), key=lambda i: -len(windows[i][1]))
        for i in range(0, len(order), self.batch_size):
            batch = [windows[j] for j in order[i:i + self.batch_size]]
            width = len(batch[0][1])
            x = torch.zeros((len(batch), width), dtype=torch.long)
            for row, (_, inp, _) in enumerate(batch):
                x[row, :len(inp)] = torch.tensor(inp, dtype=torch.long)
            logits, _ = self.model(x.to(self.device))
            logp = F.log_softmax(logits.float(), dim=-1)
            for row, (r, inp, tgt) in enumerate(batch):
                k, t = len(tgt), len(inp)
                lp = logp[row, t - k:t]
                target = torch.tensor(tgt, dtype=torch.long, device=lp.device)
                logprob[r] += float(lp.gather(-1, target[:, None]).double().sum())
                greedy[r] = greedy[r] and bool((lp.argmax(dim=-1) == target).all())
                count[r] += k
        return [Scored(lp, g, n) for lp, g, n in zip(logprob, greedy, count)]

    def loglikelihood(self, pairs: list[tuple[str, str]]) -> list[Scored]:
        """log P(continuation | context) for each (context, continuation) pair of strings."""
        return self.score_tokens([self.encode_pair(c, x) for c, x in pairs])

    def loglikelihood_rolling(self, texts: list[str], stride: int | None = None) -> list[Scored]:
        """log P(text) of each whole text, from the start of a document (after EOS)."""
        return self.score_tokens([([self.eos_id], ids) for ids in self.encode_batch(texts)], stride)

    # ------------------------------------------------------------------------- generation

    @torch.no_grad()
    def generate_until(self, context: str, until: list[str] | None = None, max_gen_toks: int = 256,
                       temperature: float = 0.0, generator: torch.Generator | None = None) -> str:
        """Continue `context` (greedy unless temperature > 0) until EOS, a stop string (cut before
        it, as lm-eval does) or max_gen_toks tokens. The context keeps its last seq_len tokens and
        the window slides as tokens are added (the model has no KV cache)."""
        until = [u for u in (until or []) if u]
        ids = self.encode(context)[-self.seq_len:] or [self.eos_id]
        out: list[int] = []
        for _ in range(max_gen_toks):
            logits, _ = self.model(torch.tensor([ids[-self.seq_len:]], dtype=torch.long, device=self.device))
            last = logits[0, -1].float()
            if temperature > 0:
                probs = F.softmax(last / temperature, dim=-1)
                t = int(torch.multinomial(probs, 1, generator=generator))
            else:
                t = int(last.argmax())
            if t == self.eos_id:
                break
            out.append(t)
            ids.append(t)
            if until and _cut(self.decode(out), until) is not None:
                break
        text = self.decode(out)
        cut = _cut(text, until)
        return text if cut is None else text[:cut]


def _cut(text: str, until: list[str]) -> int | None:
    hits = [i for i in (text.find(u) for u in until) if i >= 0]
    return min(hits) if hits else None


def perplexity(total_logprob: float, count: int) -> float:
    """exp(-total / count); inf when the log-probability underflows."""
    if count <= 0:
        return float("nan")
    x = -total_logprob / count
    return math.exp(x) if x < 700 else float("inf")
