"""Meta-device init (tasks/train/meta_init.py): the model built on torch.device("meta") and filled after
sharding has bitwise the weights of `torch.manual_seed(seed); GPT(cfg)` (tests/test_layouts.py checks the
sharded case: its layouts start from meta, its 1-process reference from the whole model), leaves the
RNG where that left it, and refuses a tensor it would leave uninitialised."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from lm_helpers import TINY_MOE
from tasks.train.meta_init import build_on_meta, materialize
from tasks.train.model import GPT, GPTConfig


@pytest.mark.parametrize("options", [{"tie_embeddings": False}, {"tie_embeddings": True},
                                     {"moe": TINY_MOE, "qk_norm": True}], ids=["untied", "tied", "moe"])
def test_meta_init_gives_the_seeded_whole_model_weights(options):
    cfg = GPTConfig(vocab_size=320, n_layer=2, n_head=2, d_model=32, seq_len=32, **options)
    torch.manual_seed(7)
    ref = GPT(cfg)
    rng_after = torch.get_rng_state()
    torch.manual_seed(99)  # materialize reseeds: the state before does not matter
    model, record = build_on_meta(cfg, 7)
    assert all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))
    stats = materialize([model], record, cfg, torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), rng_after)
    want, got = ref.state_dict(), model.state_dict()
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    assert torch.equal(model.rope_cos, ref.rope_cos) and torch.equal(model.rope_sin, ref.rope_sin)
    assert stats["rank_param_bytes"] == sum(p.nbytes for p in ref.parameters())


def test_a_tensor_no_init_sets_is_refused():
    cfg = GPTConfig(vocab_size=320, n_layer=2, n_head=2, d_model=32, seq_len=32)
    model, record = build_on_meta(cfg, 0)
    model.blocks[0].extra = nn.Parameter(torch.empty(3, device="meta"))  # as a new module's torch.zeros(...) would be
    with pytest.raises(RuntimeError, match="blocks.0.extra"):
        materialize([model], record, cfg, torch.device("cpu"))
