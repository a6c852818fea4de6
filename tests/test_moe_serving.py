"""MoE checkpoints downstream of training: the model server's KV-cached prefill and batched decode
route every token like the uncached forward, a registered MoE checkpoint is served with GPT.generate's
greedy tokens, and the evaluation stage scores one (val loss, samples, task suite)."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from infra.services.model_server.server import create_app
from lm_helpers import TINY_MOE, random_checkpoint, sample_tokenizer, sharpen_moe, tiny_cfg, tokenizer_artifact, \
    tokens_artifact
from tasks.train.model import GPT, GPTConfig, KVCache
from tasks.train.moe import MoE


def _sparse(model) -> list[int]:
    return [i for i, b in enumerate(model.blocks) if isinstance(b.mlp, MoE)]


def test_kv_cache_prefill_and_batched_decode_route_like_forward():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=32, seq_len=16, moe=TINY_MOE)).eval()
    sharpen_moe(m)
    assert _sparse(m) == [1]
    seqs = [torch.randint(0, 64, (1, n)) for n in (1, 4, 9)]
    caches = [KVCache(m.cfg) for _ in seqs]
    for s, c in zip(seqs, caches):
        torch.testing.assert_close(m.prefill(s, c), m(s)[0][:, -1], rtol=1e-5, atol=1e-5)
    for _ in range(5):  # one decode step routes the new tokens of sequences of different lengths together
        new = torch.randint(0, 64, (len(seqs),))
        logits = m.decode_step(new, caches)
        seqs = [torch.cat([s, new[i:i + 1, None]], 1) for i, s in enumerate(seqs)]
        for i, s in enumerate(seqs):
            torch.testing.assert_close(logits[i], m(s)[0][0, -1], rtol=1e-5, atol=1e-5)


def test_a_registered_moe_checkpoint_is_served_with_gpt_generate_tokens(tmp_path):
    from tasks.core.hashing import sha256_tree
    from tasks.deploy.generation import TextGenerator
    from tasks.deploy.registry import export_for_inference

    tok = sample_tokenizer(tmp_path / "tokenizer.json")
    ckpt = random_checkpoint(tmp_path / "train", tok, 10, 0, init=sharpen_moe, moe=TINY_MOE)
    # what registering stores and a server loads: the weights-only copy, verified against its tree hash
    # (the MLflow transfer around it is model-agnostic; tests/test_deploy.py covers it)
    copy = export_for_inference(ckpt, tmp_path / "registered")
    gen = TextGenerator.from_files(copy, tok, expected_tree_sha256=sha256_tree(copy))
    assert _sparse(gen.model) == [1] and bool(gen.model.blocks[1].mlp.expert_bias.any())  # the trained routing came along

    prompts = ["The Linux kernel is", "Debian", "In Python, a list"]
    with TestClient(create_app(gen, "moe", max_tokens_limit=64, max_batch=8), raise_server_exceptions=True) as client:
        # one request of three prompts: the scheduler prefills each and decodes them in one batch;
        # 30 new tokens pass the 32-token window, so the cache fills and the window slides
        r = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 30, "temperature": 0})
        assert r.status_code == 200, r.text
        served = {c["index"]: c["text"] for c in r.json()["choices"]}
        assert client.get("/health").json()["batching"]["steps"] > 0
    for i, p in enumerate(prompts):
        ids = gen.encode(p)
        want = gen.model.generate(torch.tensor([ids]), 30, temperature=0.0)[0, len(ids):].tolist()
        assert served[i] == gen.decode(want), p


def test_evaluation_scores_an_moe_checkpoint(base, tmp_path, monkeypatch):
    from tasks.evaluate import evaluate_checkpoint

    tok = Path(tokenizer_artifact(base)["path"])
    cfg = tiny_cfg()
    ckpt = random_checkpoint(tmp_path / "train", tok, 10, 0, init=sharpen_moe, moe=TINY_MOE,
                             seq_len=cfg.model.seq_len)
    routed = []  # tokens each MoE forward routed: the stage really ran the sparse layers
    forward = MoE.forward

    def counting(self, x):
        routed.append(x.numel() // x.size(-1))
        return forward(self, x)

    monkeypatch.setattr(MoE, "forward", counting)
    rep = evaluate_checkpoint(cfg, ckpt, tok, Path(tokens_artifact(base)["index_path"]), tmp_path / "report.json")
    assert math.isfinite(rep["val_loss"]) and rep["perplexity"] == pytest.approx(math.exp(rep["val_loss"]), rel=1e-4)
    assert rep["val_tokens"] == cfg.evaluate.max_val_batches * cfg.evaluate.batch_size * cfg.model.seq_len
    assert all(s["completion"] for s in rep["samples"])
    for metric in ("lambada_acc", "hellaswag_acc_norm", "wikitext_word_perplexity"):
        assert rep["task_metrics"].get(metric) is not None, metric
    assert sum(routed) >= rep["val_tokens"]
