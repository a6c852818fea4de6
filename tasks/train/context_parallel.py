"""Context parallelism (train.parallel.cp): the sequence of every sample split over the cp ranks.

All-gather context parallelism, as in the Llama 3 paper and torchtitan's "allgather" rotate method:
each cp rank holds a slice of every sequence (its inputs, targets, residual stream and activations),
and in each attention layer the keys and values of the whole sequence are all-gathered over the cp
group (one collective per layer, K and V stacked; its backward reduce-scatters the K/V gradients
back to the ranks that computed them); the rank's queries attend to them under the causal mask at
their global positions, and RoPE rotates each token by its global position. Everything outside
attention (norms, MLP, MoE routing, the loss) is per token and runs unchanged on the local slice;
only the MoE Switch loss, whose expert fractions are batch statistics, counts them over the cp group.

Load-balanced causal sharding: the sequence is cut into 2 x cp chunks and rank i takes chunks i and
2 x cp - 1 - i, so every rank's queries see the same number of keys in total (an early chunk with
a late one) and the causal work is even.

The loss: each rank's cross-entropy is the mean over its seq_len / cp targets, the same count on
every rank, so the mean over the cp ranks is the 1-process mean. FSDP2 shards over dp_shard x cp
and averages the gradients over those ranks, which is that mean's gradient: rank r's gradient holds
its own tokens' terms plus, through the K/V reduce-scatter, every rank's queries' terms for its
keys and values. The trainer averages the logged loss over dp x cp (the "dp_cp" mesh).

Attention without a materialised mask: the gathered K/V are put in sequence order, and each of the
rank's two query chunks (global chunk a, c positions) attends in one SDPA call to the key prefix
K[0 : (a + 1) c] under `causal_lower_right(c, (a + 1) c)`, the causal mask aligned at the bottom
right. SDPA dispatches that bias to the flash / memory-efficient kernels on GPU (on CPU it builds the
c x (a + 1) c mask itself), and the keys past a chunk are never multiplied: (2 cp + 1) c keys per
rank's query pair instead of 2 x 2 cp c. Only packed sequences (`doc_mask`, document boundaries)
still take one SDPA call with a boolean (local, seq_len) mask over the gathered sequence.

Unlike torch's `context_parallel` (ring attention through CUDA's flash / efficient SDPA kernels) this
runs on any backend (gloo on CPU included); its cost is one all-gather of the whole sequence's K/V
per layer, which the Llama 3 paper found acceptable for GQA models.
"""
from __future__ import annotations

from functools import cached_property

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def load_balanced_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The sequence positions cp rank `rank` holds: chunks rank and 2 cp - 1 - rank of 2 cp equal
    chunks (int64, ascending). seq_len must be a multiple of 2 cp (ParallelDims.check)."""
    chunk = seq_len // (2 * cp)
    if chunk * 2 * cp != seq_len or not 0 <= rank < cp:
        raise ValueError(f"seq_len {seq_len} does not split into 2 x cp ({2 * cp}) chunks (rank {rank})")
    early, late = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(early, early + chunk), torch.arange(late, late + chunk)])


class ContextParallel:
    """One cp rank's part of every sequence of length seq_len, and attention over the whole sequence.
    Installed on every CausalSelfAttention and on the GPT itself (`apply_cp`); the trainer calls
    `shard` on each micro-batch's inputs and targets."""

    def __init__(self, group, seq_len: int):
        self.group, self.seq_len = group, seq_len
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.positions = load_balanced_positions(seq_len, self.cp, self.rank)  # this rank's queries
        # the all-gather concatenates the ranks' slices in rank order: the keys' positions then
        self.keys = torch.cat([load_balanced_positions(seq_len, self.cp, r) for r in range(self.cp)])
        self.chunk = seq_len // (2 * self.cp)
        # gathered chunk j (rank j // 2, its early or late half) holds global chunk keys[j c] / c:
        # the gathered chunks in this order are the sequence in order (Python ints: constants to
        # torch.compile, where a device copy cached on first use is a guard that forces a recompile)
        self.chunk_order = torch.argsort(self.keys[::self.chunk] // self.chunk).tolist()
        self.query_chunks = (self.rank, 2 * self.cp - 1 - self.rank)  # global chunks of the local queries
        # each query chunk's bias over its key prefix, built once: torch.compile traces a prebuilt
        # CausalBias whole but breaks the graph where one is constructed. No mutable Python state is
        # touched in attend (a call counter was): Dynamo guards on it and recompiles every call
        self.biases = tuple(causal_lower_right(self.chunk, (a + 1) * self.chunk) for a in self.query_chunks)
        self._on_device: dict = {}  # (name, device) -> the tensor there: copied to an accelerator once

    @cached_property
    def mask(self) -> torch.Tensor:
        """(local, seq_len) boolean "query may attend key" over the gathered (rank-ordered) keys: built
        only for document masks (packed sequences); plain causal attention never materialises it."""
        return self.keys[None, :] <= self.positions[:, None]

    def on(self, name: str, device: torch.device) -> torch.Tensor:
        """self.positions, self.keys or self.mask on `device` (cached; called outside the compiled blocks)."""
        key = (name, device)
        if key not in self._on_device:
            self._on_device[key] = getattr(self, name).to(device)
        return self._on_device[key]

    @property
    def local_len(self) -> int:
        return self.positions.numel()

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's positions of a whole-sequence tensor (inputs, targets: (B, seq_len))."""
        if t.size(dim) != self.seq_len:
            raise ValueError(f"context parallelism splits sequences of {self.seq_len} tokens, got {t.size(dim)}")
        return t.index_select(dim, self.on("positions", t.device))

    def document_mask(self, doc_ids: torch.Tensor) -> torch.Tensor:
        """The (B, 1, local, seq_len) "may attend" mask of packed sequences (model.document_causal_mask
        for this rank's queries and the gathered keys): causal and within one document. doc_ids: the
        whole sequences' (B, seq_len), which every cp rank of a replica reads."""
        device = doc_ids.device
        doc_q = doc_ids.index_select(1, self.on("positions", device))
        doc_k = doc_ids.index_select(1, self.on("keys", device))
        return (self.on("mask", device) & (doc_q[:, :, None] == doc_k[:, None, :]))[:, None]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
               mask: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of the local queries (B, heads, local, head_dim) over the whole sequence's
        keys and values, gathered from the cp ranks (the local k and v: (B, heads, local, head_dim));
        `mask`: document_mask's, for packed sequences."""
        import torch.distributed._functional_collectives as funcol

        # one all-gather for K and V, along dim 0 (the only gather dim the autograd version takes)
        kv = torch.stack((k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3)), dim=1)  # (local, 2, B, heads, head_dim), one copy
        kv = funcol.all_gather_single_autograd(kv, 0, self.group)  # backward: reduce-scatter (sum)
        if mask is not None:  # document boundaries: one call, the boolean mask over the rank-ordered keys
            k, v = kv.permute(1, 2, 3, 0, 4).unbind(0)  # (B, heads, seq_len, head_dim) each, ranks' order
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        return self._attend_prefixes(q, kv, dropout_p)

    def _attend_prefixes(self, q: torch.Tensor, kv: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """Causal attention of each local query chunk (global chunk a) over the key prefix
        K[0 : (a + 1) c] with the lower-right causal bias (flash / efficient kernels on GPU); kv: the
        gathered (seq_len, 2, B, heads, head_dim) in ranks' order."""
        c = self.chunk
        # into sequence order, one copy (its backward scatters the rows back for the reduce-scatter)
        chunks = kv.unflatten(0, (2 * self.cp, c))
        kv = torch.cat([chunks[j] for j in self.chunk_order])
        k, v = kv.permute(1, 2, 3, 0, 4).unbind(0)  # (B, heads, seq_len, head_dim), positions 0..seq_len-1
        out = []
        for i, (a, bias) in enumerate(zip(self.query_chunks, self.biases)):
            keys = (a + 1) * c
            out.append(F.scaled_dot_product_attention(
                q[:, :, i * c:(i + 1) * c], k[:, :, :keys], v[:, :, :keys], attn_mask=bias, dropout_p=dropout_p))
        return torch.cat(out, dim=2)

    def record(self) -> dict:
        """What this rank really holds, its positions as [start, stop) runs (two per rank, not
        seq_len / cp integers: the record is gathered into layout.json at any context length)."""
        runs: list[list[int]] = []
        for pos in self.positions.tolist():
            if runs and runs[-1][1] == pos:
                runs[-1][1] = pos + 1
            else:
                runs.append([pos, pos + 1])
        return {"cp": self.cp, "cp_rank": self.rank, "local_seq_len": self.local_len, "position_runs": runs}


def apply_cp(model: nn.Module, cp_mesh, seq_len: int) -> ContextParallel:
    """Context parallelism over `cp_mesh` (the world mesh's "cp" dimension) on a GPT or a pipeline
    stage of one, in place: every attention layer gathers K/V over it, the model (stage) rotates by
    the slice's global positions. Returns
    the ContextParallel whose `shard` the trainer applies to inputs and targets; each MoE layer's
    Switch loss counts its expert fractions over the cp group. Collective-free."""
    from tasks.train.model import CausalSelfAttention
    from tasks.train.moe import MoE

    context = ContextParallel(cp_mesh.get_group(), seq_len)
    attention = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    if not attention:
        raise ValueError("train.parallel.cp > 1 but the model has no attention layer")
    for m in attention:
        m.context_parallel = context
    for m in model.modules():
        if isinstance(m, MoE):
            m.sequence_group = context.group
    model.context_parallel = context
    return context
