"""The GPT model: shapes, causality, tied embeddings, learning, generation."""
from __future__ import annotations

import pytest
import torch

from tasks.config import ModelConfig
from tasks.train.model import GPT, GPTConfig, apply_rope, rope_tables


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models are fastest on one thread, and far slower on oversubscribed cores."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def tiny(vocab=97, **kw) -> GPT:
    torch.manual_seed(0)
    fields = {"n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, **kw}
    return GPT(GPTConfig.from_model_config(ModelConfig(**fields), vocab_size=vocab))


def test_shapes_and_initial_loss():
    model = tiny()
    idx = torch.randint(0, 97, (3, 16))
    logits, loss = model(idx)
    assert logits.shape == (3, 16, 97) and loss is None
    logits, loss = model(idx, torch.randint(0, 97, (3, 16)))
    assert loss.shape == () and torch.isfinite(loss)
    # small init: the loss on unrelated targets is close to uniform, ln(vocab)
    assert abs(loss.item() - torch.log(torch.tensor(97.0)).item()) < 0.5
    assert model(idx[:, :5])[0].shape == (3, 5, 97)  # shorter than seq_len is fine
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.randint(0, 97, (1, 17)))


def test_causality():
    model = tiny().eval()
    idx = torch.randint(0, 97, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 97
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)  # earlier positions unaffected
    assert not torch.allclose(a[:, 10:], b[:, 10:], atol=1e-4)  # later ones do change


def test_tied_embeddings_and_no_bias():
    model = tiny()
    names = [n for n, _ in model.named_parameters()]
    assert "tok_emb.weight" in names
    assert not any("lm_head" in n or n.endswith(".bias") for n in names)
    # the output projection is the embedding: a gradient reaches it through the logits
    idx = torch.randint(0, 97, (1, 8))
    _, loss = model(idx, idx)
    loss.backward()
    assert model.tok_emb.weight.grad is not None
    assert model.state_dict().keys() == {n for n in names}  # RoPE tables are not saved


def test_loss_falls_on_repeated_batch():
    model = tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(1)
    x = torch.randint(0, 97, (4, 16))
    y = torch.roll(x, -1, dims=1)
    losses = []
    for _ in range(40):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::5]


def test_rope_preserves_norm_and_relative_position():
    cos, sin = rope_tables(16, 8, 10000.0)
    q = torch.randn(1, 1, 16, 8)
    rq = apply_rope(q, cos, sin)
    assert torch.allclose(rq.norm(dim=-1), q.norm(dim=-1), atol=1e-5)
    assert torch.allclose(rq[..., 0, :], q[..., 0, :])  # position 0 is not rotated
    # dot products depend only on the offset: <R_m q, R_n k> == <R_{m+s} q, R_{n+s} k>
    v = torch.randn(8)
    k = torch.randn(8)
    qs = apply_rope(v.expand(1, 1, 16, 8), cos, sin)[0, 0]
    ks = apply_rope(k.expand(1, 1, 16, 8), cos, sin)[0, 0]
    assert torch.allclose(qs[5] @ ks[2], qs[12] @ ks[9], atol=1e-4)


def test_generate():
    model = tiny()
    prompt = torch.randint(0, 97, (2, 4))
    out = model.generate(prompt, max_new_tokens=20, temperature=0.0)  # longer than seq_len: crops
    assert out.shape == (2, 24) and torch.equal(out[:, :4], prompt)
    again = model.generate(prompt, max_new_tokens=20, temperature=0.0)
    assert torch.equal(out, again)  # greedy is deterministic
    g1 = model.generate(prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(3))
    g2 = model.generate(prompt, 10, temperature=1.0, top_k=5, generator=torch.Generator().manual_seed(3))
    assert torch.equal(g1, g2)
    # eos stops generation: take the first greedy token as "eos"
    eos = int(out[0, 4])
    stopped = model.generate(prompt[:1], max_new_tokens=20, temperature=0.0, eos_id=eos)
    assert stopped.shape == (1, 5) and stopped[0, -1].item() == eos


def test_config_validation():
    with pytest.raises(ValueError):
        ModelConfig(d_model=30, n_head=4)
    with pytest.raises(ValueError):
        ModelConfig(d_model=12, n_head=4)  # head dim 3 is odd
