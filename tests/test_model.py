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




def test_hand_written_backwards_match_autograd():
    """RMSNorm and RoPE have hand-written backwards (fewer passes over memory on CPU): their
    forwards equal the plain formulas to rounding (fused multiply-adds, a fused norm reduction),
    and gradcheck confirms the gradients."""
    from tasks.train.model import RMSNorm, _RMSNormFn, _rotate

    torch.manual_seed(0)
    norm = RMSNorm(8)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, 8)
    plain = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    assert torch.allclose(norm(x), plain, rtol=1e-5, atol=1e-6)
    w64 = norm.weight.detach().double().requires_grad_()
    x64 = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: _RMSNormFn.apply(a, w, 1e-6), (x64, w64))

    # RoPE as the attention applies it: (B, heads, T, head_dim) queries laid out (B, T, heads, head_dim)
    # in memory (the projection's view, transposed), plain causal and per-document positions
    cos, sin = rope_tables(6, 8, 10000.0)
    per_doc = torch.tensor([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 5]])
    q = torch.randn(2, 6, 3, 8, dtype=torch.float64).transpose(1, 2).requires_grad_()
    for c, s in ((cos.double(), sin.double()), (cos[per_doc][:, None].double(), sin[per_doc][:, None].double())):
        x1, x2 = q.detach().chunk(2, dim=-1)
        cc, ss = c.expand_as(x1), s.expand_as(x1)
        assert torch.allclose(_rotate(q, c, s).detach(), torch.cat([x1 * cc - x2 * ss, x1 * ss + x2 * cc], -1),
                              rtol=1e-12, atol=1e-12)
        assert torch.autograd.gradcheck(lambda a: _rotate(a, c, s), (q,))


def test_cross_entropy_matches_torch():
    """The hand-written cross-entropy equals F.cross_entropy(ignore_index=-1) in value and
    gradient (float64), including ignored targets, all-ignored rows (nan, as torch) and a
    second backward, which it refuses (its backward reuses the saved log-probs in place)."""
    from tasks.train.model import _CrossEntropyFn, cross_entropy

    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.float64) * 3
    targets = torch.tensor([3, -1, 0, 10, -1, 7])
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    ours = _CrossEntropyFn.apply(a, targets)
    theirs = torch.nn.functional.cross_entropy(b, targets, ignore_index=-1)
    assert torch.allclose(ours, theirs, rtol=1e-12, atol=1e-12)
    (ours * 2.5).backward()
    (theirs * 2.5).backward()
    assert torch.allclose(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    assert a.grad[1].abs().sum() == 0  # ignored row gets no gradient

    x = torch.randn(2, 3, 11, requires_grad=True)  # (B, T, vocab) float32 path used by the model
    y = torch.randint(0, 11, (2, 3))
    assert torch.allclose(cross_entropy(x, y), torch.nn.functional.cross_entropy(x.view(-1, 11), y.view(-1)))
    ignored = x.detach().clone().requires_grad_()
    loss = cross_entropy(ignored, torch.full((2, 3), -1))
    loss.backward()
    assert torch.isnan(loss) and torch.equal(ignored.grad, torch.zeros_like(ignored))  # as torch's

    loss = cross_entropy(x, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


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


# ---------------------------------------------------------------- document masking, QK-norm, soft cap, z-loss

def _packed(model, d1, d2):
    """Run the two documents packed into one sequence with the document mask and per-document
    RoPE positions, as the training loader feeds them."""
    ids = torch.tensor([[0] * d1.size(1) + [1] * d2.size(1)])
    pos = torch.tensor([list(range(d1.size(1))) + list(range(d2.size(1)))])
    return model(torch.cat([d1, d2], 1), doc_ids=ids, positions=pos)[0]


@pytest.mark.parametrize("options", [{}, {"qk_norm": True, "logit_softcap": 20.0, "tie_embeddings": False}])
def test_packed_documents_match_running_each_alone(options):
    model = tiny(**options).eval()
    torch.manual_seed(2)
    d1, d2 = torch.randint(0, 97, (1, 6)), torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        packed = _packed(model, d1, d2)
        alone1, alone2 = model(d1)[0], model(d2)[0]
        unmasked = model(torch.cat([d1, d2], 1))[0]
    # identical up to float32 rounding (the matmuls run on other shapes, so not bit for bit)
    assert torch.allclose(packed[:, 6:], alone2, rtol=0, atol=1e-5)
    assert torch.allclose(packed[:, :6], alone1, rtol=0, atol=1e-5)
    # without the mask, doc 2 sees doc 1 and its logits are different
    assert (unmasked[:, 6:] - alone2).abs().max() > 1e-3


def test_document_mask_blocks_cross_document_attention():
    from tasks.train.model import document_causal_mask

    mask = document_causal_mask(torch.tensor([[0, 0, 1, 1, 1]]))
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert mask.shape == (1, 1, 5, 5) and torch.equal(mask[0, 0], expected)
    model = tiny().eval()
    d1, d2 = torch.randint(0, 97, (1, 6)), torch.randint(0, 97, (1, 10))
    other = (d1 + 1) % 97
    with torch.no_grad():
        a, b = _packed(model, d1, d2), _packed(model, other, d2)
    assert torch.equal(a[:, 6:], b[:, 6:])  # changing doc 1 changes nothing in doc 2, bit for bit
    assert not torch.allclose(a[:, :6], b[:, :6])
    # and no gradient flows from doc 2's outputs into doc 1's inputs (one block, embeddings as leaves)
    ids = torch.tensor([[0] * 6 + [1] * 10])
    pos = torch.tensor([list(range(6)) + list(range(10))])
    x = model.tok_emb(torch.cat([d1, d2], 1)).detach().requires_grad_(True)
    out = model.blocks[0](x, model.rope_cos[pos][:, None], model.rope_sin[pos][:, None], document_causal_mask(ids))
    out[:, 6:].sum().backward()
    assert torch.count_nonzero(x.grad[:, :6]) == 0 and torch.count_nonzero(x.grad[:, 6:]) > 0


def test_qk_norm_makes_attention_invariant_to_query_key_scale():
    """RMSNorm on q and k: scaling the q/k projections cannot blow up the attention logits."""
    idx = torch.randint(0, 97, (2, 16))
    for qk_norm in (True, False):
        model = tiny(qk_norm=qk_norm).eval()
        with torch.no_grad():
            before = model(idx)[0]
            for block in model.blocks:
                block.attn.wq.weight *= 30.0
                block.attn.wk.weight *= 30.0
            after = model(idx)[0]
        same = torch.allclose(before, after, atol=1e-4)
        assert same == qk_norm, qk_norm
    names = [n for n, _ in tiny(qk_norm=True).named_parameters()]
    assert "blocks.0.attn.q_norm.weight" in names and "blocks.0.attn.k_norm.weight" in names


def test_logit_softcap_and_untied_head():
    model = tiny(logit_softcap=2.0, tie_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(500.0)  # raw logits far beyond the cap
        logits = model(torch.randint(0, 97, (2, 16)))[0]
    assert logits.abs().max() <= 2.0 and logits.abs().max() > 1.9
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" in names and model.lm_head.weight is not model.tok_emb.weight
    # FLOPs count the head but not the (lookup-only) embedding table; tied, the table is the head
    assert model.num_matmul_params() == model.num_params() - 97 * 32
    assert tiny().num_matmul_params() == tiny().num_params()


def test_kv_cache_matches_forward_with_new_options():
    """The server's prefill/decode path applies QK-norm, the soft cap and the untied head too."""
    from tasks.train.model import KVCache

    model = tiny(qk_norm=True, logit_softcap=5.0, tie_embeddings=False).eval()
    idx = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        full = model(idx)[0]
        cache = KVCache(model.cfg)
        first = model.prefill(idx[:, :8], cache)
        nxt = model.decode_step(idx[0, 8:9], [cache])
    assert torch.allclose(first, full[:, 7], atol=1e-5) and torch.allclose(nxt, full[:, 8], atol=1e-5)


def test_z_loss_value_and_ignore_index():
    from tasks.train.model import lm_loss

    torch.manual_seed(4)
    logits = torch.randn(2, 5, 11) * 3
    targets = torch.randint(0, 11, (2, 5))
    targets[1, 3] = -1
    total, ce, z = lm_loss(logits, targets, 1e-2)
    keep = targets.reshape(-1) != -1
    lse = torch.logsumexp(logits.reshape(-1, 11), -1)[keep]
    expected_ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 11)[keep], targets.reshape(-1)[keep])
    assert torch.allclose(ce, expected_ce) and torch.allclose(z, 1e-2 * lse.pow(2).mean())
    assert torch.allclose(total, ce + z)
    total0, ce0, z0 = lm_loss(logits, targets, 0.0)
    assert z0 is None and torch.equal(total0, ce0) and torch.equal(ce0, ce)
    # the model's own loss is the plain cross-entropy
    model = tiny()
    x, y = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    logits, loss = model(x, y)
    assert torch.equal(loss, lm_loss(logits, y)[0])


# ---------------------------------------------------------------- bf16 autocast and torch.compile

def test_bf16_autocast_keeps_fp32_master_weights():
    from tasks.train.parallelize import autocast_context
    from tasks.train.model import lm_loss

    from lm_helpers import tiny_cfg

    model = tiny(qk_norm=True)
    x, y = torch.randint(0, 97, (2, 16)), torch.randint(0, 97, (2, 16))
    ref_loss = lm_loss(model(x)[0], y)[0].item()
    with autocast_context(tiny_cfg(train={"dtype": "bf16"}).train, torch.device("cpu")):
        logits, _ = model(x)
        loss, _, _ = lm_loss(logits, y, 1e-4)
    loss.backward()
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    assert abs(loss.item() - ref_loss) < 0.05
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    with autocast_context(tiny_cfg().train, torch.device("cpu")):  # fp32 (the default): no autocast
        assert model(x)[0].dtype == torch.float32


def _cxx_compiler() -> str | None:
    import shutil

    return shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


@pytest.mark.skipif(_cxx_compiler() is None, reason="torch.compile (inductor, CPU) needs a C++ compiler; none on PATH")
def test_compiled_blocks_train_like_eager():
    from tasks.train.parallelize import compile_blocks

    eager, compiled = tiny(n_layer=1), tiny(n_layer=1)
    compile_blocks(compiled)
    assert list(compiled.state_dict()) == list(eager.state_dict())  # checkpoints keep their names
    torch.manual_seed(5)
    x = torch.randint(0, 97, (4, 16))
    y = torch.roll(x, -1, dims=1)
    losses = {}
    for name, model in (("eager", eager), ("compiled", compiled)):
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses[name] = []
        for _ in range(3):
            _, loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["compiled"] == pytest.approx(losses["eager"], abs=1e-4)
    assert losses["compiled"][-1] < losses["compiled"][0]
