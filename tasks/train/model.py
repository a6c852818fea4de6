"""A small decoder-only GPT in plain PyTorch, in one file (nanoGPT style, Llama-flavoured blocks).

    tokens -> embedding -> n_layer x [x + attn(norm(x)); x + mlp(norm(x))] -> norm -> logits

- RMSNorm instead of LayerNorm, pre-norm residual blocks, no biases anywhere.
- Rotary position embeddings (RoPE) on queries and keys; no learned position table.
- Causal self-attention through F.scaled_dot_product_attention(is_causal=True); with document ids
  (packed sequences) a block-diagonal causal boolean mask instead, so attention never crosses a
  document boundary, and RoPE positions restart at 0 in every document (each document is computed
  exactly as if it were alone, as it is at inference).
- Optional QK-norm: RMSNorm over head_dim on each head's queries and keys, before RoPE (OLMo 2 /
  Qwen3 style), which keeps attention logits bounded at high learning rates.
- SwiGLU MLP: w2(silu(w1 x) * w3 x).
- Tied embeddings by default (the output projection reuses the token embedding matrix); optional
  separate output head. Optional logit soft-capping cap * tanh(logits / cap) (Gemma 2).
- Cross-entropy through `cross_entropy`, a hand-written backward that turns the saved log-probs
  into the gradient in place (same values as F.cross_entropy, half its passes over the logits).
- `lm_loss` adds the optional z-loss coef * logsumexp(logits)^2 (PaLM) to the cross-entropy.
- Inference only: a per-sequence KV cache (`KVCache`, `GPT.prefill`, `GPT.decode_step`) used by
  the model server; `forward` and `generate` never touch it.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from tasks.train.mlp import SwiGLU
from tasks.train.moe import GroupedExperts, MoE, MoEArgs
from tasks.train.parallel_dims import mlp_hidden


@dataclass
class GPTConfig:
    vocab_size: int
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    seq_len: int = 128
    mlp_ratio: float = 8 / 3
    rope_theta: float = 10000.0
    dropout: float = 0.0
    # the defaults below are the original architecture, so checkpoints written before these
    # options existed (their JSON lacks the keys) load unchanged
    qk_norm: bool = False
    logit_softcap: float | None = None
    tie_embeddings: bool = True
    # mixture of experts (model.moe); n_experts 0 (and a checkpoint without the key) is dense
    moe: MoEArgs = field(default_factory=MoEArgs)

    def __post_init__(self):
        self.moe = MoEArgs.of(self.moe)  # a checkpoint's meta and the pipeline config give a dict

    @classmethod
    def from_model_config(cls, model_cfg, vocab_size: int) -> "GPTConfig":
        """From the pipeline's ModelConfig section (or a plain dict of the same fields)."""
        fields = model_cfg if isinstance(model_cfg, dict) else model_cfg.model_dump()
        return cls(vocab_size=vocab_size, **fields)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def mlp_hidden(self) -> int:
        return mlp_hidden(self.d_model, self.mlp_ratio)


class _RMSNormFn(torch.autograd.Function):
    """y = x * rsqrt(mean(x^2) + eps) * w with a hand-written backward. On CPU every kernel is a
    pass over memory and a thread barrier: autograd through the plain formula makes about twelve
    passes per norm, this makes seven (one fused norm reduction, a dot product, an addcmul). Same
    maths to rounding; gradchecked in the tests."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16/fp16 -> fp32 statistics
        ms = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_().div_(x.size(-1))
        rstd = ms.add_(eps).rsqrt_()
        xhat = x32 * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.in_dtype = x.dtype
        return xhat.type_as(x) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xhat, rstd, weight = ctx.saved_tensors
        g = grad.to(xhat.dtype)
        gw = g * weight.to(xhat.dtype)
        grad_w = (g * xhat).sum(dim=tuple(range(g.dim() - 1))).to(weight.dtype)
        # d/dx of xhat = x * rstd: rstd * (gw - xhat * mean(gw * xhat))
        dot = torch.linalg.vecdot(gw, xhat).unsqueeze(-1)
        grad_x = torch.addcmul(gw, xhat, dot, value=-1.0 / g.size(-1)).mul_(rstd)
        return grad_x.to(ctx.in_dtype), grad_w, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _RMSNormFn.apply(x, self.weight, self.eps)


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq_len, head_dim // 2): position t, frequency pair i."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :h/2], x[..., h/2:]) by the position angle. x: (B, n_head, T, head_dim)."""
    T = x.size(-2)
    return _rotate(x, cos[:T], sin[:T])


def document_causal_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    """Boolean SDPA mask (B, 1, T, T) from document ids (B, T): position i may attend to j iff
    j <= i and both lie in the same document. The diagonal is always allowed, so no row is empty."""
    T = doc_ids.size(1)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]


class _RotateHalfFn(torch.autograd.Function):
    """Rotate pairs (x1, x2) = (x[..., :h/2], x[..., h/2:]) by the position angle:
    [x1 cos - x2 sin, x2 cos + x1 sin]. Each half is written in place into one output tensor by a
    multiply and a fused multiply-add: two passes over memory instead of the seven kernels of the
    plain formula (on CPU every kernel is a pass over memory and a thread barrier, which is what
    eager training time goes to). The gradient is the inverse rotation, computed the same way."""

    @staticmethod
    def _rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        out = torch.empty_like(x) if out is None else out
        o1, o2 = out.chunk(2, dim=-1)
        torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-sign)
        torch.mul(x2, cos, out=o2).addcmul_(x1, sin, value=sign)
        return out

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _RotateHalfFn._rotate_into(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        return _RotateHalfFn._rotate_into(grad, cos, sin, -1.0), None, None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope with cos/sin already aligned to x's positions (broadcastable to x[..., :h/2])."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)  # bf16 under autocast
    if torch.compiler.is_compiling():  # the plain formula: inductor fuses it by itself
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return _RotateHalfFn.apply(x, cos, sin)


class CausalSelfAttention(nn.Module):
    """Separate query, key and value projections (not one fused qkv matrix): tensor parallelism
    shards each by output rows, i.e. by heads, which a fused matrix's q|k|v rows would mix. The
    head count is read from the projections' output (view(B, T, -1, head_dim)), so the same
    forward runs on a tensor-parallel rank's local heads."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.dropout = cfg.dropout
        self.q_norm = RMSNorm(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim) if cfg.qk_norm else None
        # context parallelism (tasks/train/context_parallel.py): x is this rank's slice of the
        # sequence; keys and values are gathered from the other cp ranks
        self.context_parallel = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        """cos/sin already aligned to the positions: (T, head_dim/2) or (B, 1, T, head_dim/2).
        mask: None for plain causal attention, else a boolean (B, 1, T, T) "may attend" mask."""
        q, k, v = self._qkv_heads(x)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        dropout = self.dropout if self.training else 0.0
        if self.context_parallel is not None:  # mask: ContextParallel.document_mask's (local, seq_len) one
            y = self.context_parallel.attend(q, k, v, dropout, mask)
        elif mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        return self._out(y)

    def _qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, T, C) -> q, k, v of (B, heads, T, head_dim), QK-norm applied (RoPE not yet)."""
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _out(self, y: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = y.shape
        return self.proj(y.transpose(1, 2).contiguous().view(B, T, -1))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = (MoE(cfg.d_model, cfg.mlp_hidden, cfg.moe) if cfg.moe.is_moe_layer(layer)
                    else SwiGLU(cfg.d_model, cfg.mlp_hidden))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.attn_norm(x), cos, sin, mask))
        x = x + self.drop(self.mlp(self.mlp_norm(x)))
        return x


class KVCache:
    """Keys and values of one sequence for every layer, (n_layer, n_head, seq_len, head_dim) each;
    positions [0, length) are filled. Inference only (no grad)."""

    def __init__(self, cfg: GPTConfig, dtype: torch.dtype = torch.float32, device=None):
        shape = (cfg.n_layer, cfg.n_head, cfg.seq_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.size(2)


class _CrossEntropyFn(torch.autograd.Function):
    """Mean cross-entropy over the targets that are not -1, as F.cross_entropy(ignore_index=-1).
    The gradient is (softmax - onehot) / n: the backward turns the saved log-probs into it in
    place (exp, one scatter, one scale) instead of autograd's zero fill + scatter + log_softmax
    backward, which reads and writes the (tokens x vocab) logits twice as often. With a 4k-32k
    vocabulary that matrix is the largest activation of a small model. The tests compare value and
    gradient with F.cross_entropy in float64 (gradcheck needs a second backward, which this refuses)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, dim=-1)
        keep = targets != -1
        safe = targets.clamp(min=0)
        count = keep.sum()
        loss = -(logp.gather(1, safe[:, None])[:, 0] * keep).sum() / count  # nan if all ignored, as F.cross_entropy
        ctx.save_for_backward(logp, safe, keep, count)
        ctx.consumed = False
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.consumed:  # the saved log-probs became the first call's gradient
            raise RuntimeError("cross_entropy's backward ran twice (retain_graph is not supported)")
        ctx.consumed = True
        logp, safe, keep, count = ctx.saved_tensors
        probs = logp.exp_()
        probs[torch.arange(probs.size(0), device=probs.device), safe] -= 1.0
        # all targets ignored: the loss is nan, as torch's, but the gradient zero, as torch's
        return probs.mul_((keep.to(probs.dtype) * (grad / count.clamp(min=1)))[:, None]), None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; logits (..., vocab), targets (...), -1 ignored."""
    return _CrossEntropyFn.apply(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, z_loss: float = 0.0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Training objective: (total, cross-entropy, z-loss or None). The z-loss, coef * mean of
    logsumexp(logits)^2 over the scored positions (PaLM, coef ~1e-4), pulls the softmax normaliser
    towards 1 and so keeps logits from drifting; target -1 is ignored in both terms."""
    ce = cross_entropy(logits, targets)
    if not z_loss:
        return ce, ce, None
    flat = logits.float().reshape(-1, logits.size(-1))
    targets = targets.reshape(-1)
    keep = (targets != -1).float()
    z = z_loss * (torch.logsumexp(flat, dim=-1).pow(2) * keep).sum() / keep.sum().clamp(min=1)
    return ce + z, ce, z


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head or cfg.head_dim % 2:
            raise ValueError("d_model must split into n_head heads of even size")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # RoPE tables are derived from the config, so they are not saved in checkpoints
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.context_parallel = None  # set by context_parallel.apply_cp: idx is then this rank's slice
        self.apply(self._init_weights)
        # GPT-2: scale the residual output projections by 1/sqrt(2 * n_layer)
        # (the MoE's expert and shared down projections are residual outputs too)
        for name, p in self.named_parameters():
            if name.endswith(("attn.proj.weight", "mlp.w2.weight", "mlp.shared.w2.weight", "mlp.experts.w2")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, GroupedExperts):
            for w in (module.w1, module.w3, module.w2):
                nn.init.normal_(w, mean=0.0, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def num_matmul_params(self) -> int:
        """Parameters used in matmuls, for FLOPs: a separate embedding table is only a lookup
        (tied, it is also the output projection and counts)."""
        return self.num_params() - (0 if self.lm_head is None else self.tok_emb.weight.numel())

    def num_active_params(self) -> int:
        """Matmul parameters one token passes through, the N of 6N for FLOPs and MFU: as
        num_matmul_params, but each MoE layer's routed experts count top_k / n_experts of their
        size (router and shared experts in full). A dense model's equals num_matmul_params."""
        idle = 0
        for block in self.blocks:
            if isinstance(block.mlp, MoE):
                routed = sum(w.numel() for w in block.mlp.experts.parameters())  # global size for DTensors too
                idle += routed - routed // block.mlp.n_experts * block.mlp.top_k
        return self.num_matmul_params() - idle

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states -> logits (tied or separate head, then the soft cap)."""
        logits = F.linear(x, self.tok_emb.weight if self.lm_head is None else self.lm_head.weight)
        if self.cfg.logit_softcap:
            cap = self.cfg.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        return logits

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx, targets: (B, T) int64 with T <= seq_len. Returns logits (B, T, vocab) and the mean
        cross-entropy over all positions (None without targets; target -1 is ignored).

        doc_ids (B, T): document of each token in a packed sequence; attention then stays inside
        each document. positions (B, T): RoPE position of each token (default 0..T-1), restarting
        at 0 in every document for packed sequences (see data.GlobalWindows.documents). Under context
        parallelism idx and positions are this rank's slice of the sequence, doc_ids the whole one's."""
        B, T = idx.shape
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds the model's seq_len {self.cfg.seq_len}")
        if positions is None and self.context_parallel is not None:  # the slice's global positions
            at = self.context_parallel.on("positions", self.rope_cos.device)
            cos, sin = self.rope_cos[at], self.rope_sin[at]
        elif positions is None:
            cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        else:
            cos, sin = self.rope_cos[positions][:, None], self.rope_sin[positions][:, None]
        if doc_ids is None:
            mask = None
        elif self.context_parallel is not None:  # doc_ids: the whole sequences', positions: the slice's
            mask = self.context_parallel.document_mask(doc_ids)
        else:
            mask = document_causal_mask(doc_ids)
        logits = self._trunk(idx, cos, sin, mask)
        loss = None
        if targets is not None:
            loss = cross_entropy(logits, targets)
        return logits, loss

    def _trunk(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None = None,
               layers: list[int] | None = None) -> torch.Tensor:
        """The forward's middle, shared with a pipeline stage (tasks/train/pipeline.GPTStage calls it
        on itself): the embedding of token ids if this module holds it (else `h` is hidden states),
        the blocks `layers` (default all), then the final norm and head if it holds them (else the
        hidden states are returned)."""
        x = self.drop(self.tok_emb(h)) if self.tok_emb is not None else h
        for i in range(len(self.blocks)) if layers is None else layers:
            x = self.blocks[i](x, cos, sin, mask)
        return x if self.norm is None else GPT._head(self, self.norm(x))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, eos_id: int | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Append up to max_new_tokens sampled tokens to idx (B, T); returns (B, T + n).

        temperature 0 means greedy. The context is cropped to the last seq_len tokens (no KV
        cache: each step reruns the window). Stops early once every row has produced eos_id;
        rows that finished earlier are padded with eos_id.
        """
        was_training = self.training
        self.eval()
        done = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.cfg.seq_len:])
            logits = logits[:, -1, :].float()
            if temperature == 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = F.softmax(logits, dim=-1)
                next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            if eos_id is not None:
                next_id = torch.where(done[:, None], torch.full_like(next_id, eos_id), next_id)
                done |= next_id[:, 0] == eos_id
            idx = torch.cat([idx, next_id], dim=1)
            if eos_id is not None and bool(done.all()):
                break
        self.train(was_training)
        return idx

    # ------------------------------------------------------------------ KV-cached inference

    @torch.no_grad()
    def prefill(self, idx: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Run one sequence idx (1, T), T <= seq_len, at positions 0..T-1, filling `cache` from
        scratch; returns the last position's logits (1, vocab). Same math as forward(idx)."""
        B, T = idx.shape
        if B != 1 or T > self.cfg.seq_len or T == 0:
            raise ValueError(f"prefill takes one sequence of 1..{self.cfg.seq_len} tokens, got {tuple(idx.shape)}")
        x = self.tok_emb(idx)
        for layer, block in enumerate(self.blocks):
            attn = block.attn
            q, k, v = attn._qkv_heads(block.attn_norm(x))
            q, k = apply_rope(q, self.rope_cos, self.rope_sin), apply_rope(k, self.rope_cos, self.rope_sin)
            cache.k[layer, :, :T] = k[0]
            cache.v[layer, :, :T] = v[0]
            x = x + attn._out(F.scaled_dot_product_attention(q, k, v, is_causal=True))
            x = x + block.mlp(block.mlp_norm(x))
        cache.length = T
        return self._head(self.norm(x[:, -1:]))[:, 0]

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, caches: list[KVCache]) -> torch.Tensor:
        """One new token per sequence: tokens (B,) go at position caches[i].length of sequence i
        (each < seq_len); appends their keys/values to the caches and returns logits (B, vocab).
        Sequences of different lengths are batched with a padding mask."""
        B = tokens.size(0)
        pos = torch.tensor([c.length for c in caches], dtype=torch.long)
        if B != len(caches) or int(pos.max()) >= self.cfg.seq_len:
            raise ValueError("decode_step needs one cache per token, each with room for one more position")
        S = int(pos.max()) + 1  # attend over the longest sequence's positions only
        K = torch.stack([c.k[:, :, :S] for c in caches])  # (B, n_layer, n_head, S, head_dim)
        V = torch.stack([c.v[:, :, :S] for c in caches])
        cos, sin = self.rope_cos[pos][:, None, None, :], self.rope_sin[pos][:, None, None, :]
        mask = (torch.arange(S)[None, :] <= pos[:, None])[:, None, None, :]  # (B, 1, 1, S)
        rows = torch.arange(B)
        x = self.tok_emb(tokens[:, None])
        for layer, block in enumerate(self.blocks):
            attn = block.attn
            q, k, v = attn._qkv_heads(block.attn_norm(x))  # (B, n_head, 1, head_dim)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            K[rows, layer, :, pos] = k[:, :, 0]
            V[rows, layer, :, pos] = v[:, :, 0]
            y = F.scaled_dot_product_attention(q, K[:, layer], V[:, layer], attn_mask=mask)
            x = x + attn._out(y)
            x = x + block.mlp(block.mlp_norm(x))
        for i, c in enumerate(caches):
            p = int(pos[i])
            c.k[:, :, p] = K[i, :, :, p]
            c.v[:, :, p] = V[i, :, :, p]
            c.length = p + 1
        return self._head(self.norm(x))[:, 0]
