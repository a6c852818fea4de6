"""Checkpoints written before attention had separate wq/wk/wv projections (one fused `attn.qkv`,
commit 7dfb9a8 split it) still load: resume (weights and AdamW moments), evaluation and serving
(load_model_for_inference) and the Hugging Face export give the new-format model's tensors and logits.
The old checkpoint is written by the real checkpoint writer and listed in its run's signed manifest, so
the manifest is verified on the bytes read, as for any checkpoint."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from lm_helpers import sample_tokenizer
from tasks.core.hashing import sha256_file
from tasks.train.checkpoint import (UnverifiedCheckpoint, apply_retention, checkpoint_tensors, load_model_for_inference,
                                    restore_checkpoint, save_checkpoint)
from tasks.train.model import GPT, GPTConfig, lm_loss


def to_old_format(model: GPT) -> GPT:
    """The model as it was before commit 7dfb9a8: each attention's one fused projection holds the q, k
    and v rows in that order (its forward split qkv(x) into q, k, v by d_model)."""
    for block in model.blocks:
        a = block.attn
        fused = nn.Linear(a.wq.in_features, 3 * a.wq.out_features, bias=False)
        fused.weight = nn.Parameter(torch.cat([a.wq.weight, a.wk.weight, a.wv.weight]).detach().clone())
        del a.wq, a.wk, a.wv
        a.qkv = fused
    return model


def save_both_formats(base, cfg: GPTConfig, tok) -> tuple[GPT, dict]:
    """One AdamW step of the same model from the same gradients, saved once in the new and once in the
    old format (each in its own run folder base/new, base/old, listed in its signed manifest)."""
    new = GPT(cfg)
    old = to_old_format(GPT(cfg))
    old.load_state_dict({**{k: v for k, v in new.state_dict().items() if ".attn.w" not in k},
                         **{f"blocks.{i}.attn.qkv.weight": torch.cat([b.attn.wq.weight, b.attn.wk.weight,
                                                                      b.attn.wv.weight])
                            for i, b in enumerate(new.blocks)}})
    x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    lm_loss(new(x)[0], x)[1].backward()
    grads = {n: p.grad for n, p in new.named_parameters()}
    for n, p in old.named_parameters():
        p.grad = (torch.cat([grads[n.replace("qkv", w)] for w in ("wq", "wk", "wv")]) if ".qkv." in n
                  else grads[n].clone())
    meta = {"model": cfg.to_dict(), "eos_id": 1, "tokenizer_sha256": sha256_file(tok), "run_name": "old"}
    out = {}
    for name, model in (("new", new), ("old", old)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        opt.step()
        ckpt = save_checkpoint(model, opt, 1, base / name, meta)
        apply_retention(base / name, ckpt, None)
        out[name] = ckpt
    assert "model.blocks.0.attn.qkv.weight" in checkpoint_tensors(out["old"])
    assert "model.blocks.0.attn.wq.weight" not in checkpoint_tensors(out["old"])
    return new, out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    base = tmp_path_factory.mktemp("old-ckpt")
    tok = sample_tokenizer(base / "tokenizer.json")
    torch.manual_seed(0)
    new, out = save_both_formats(base, GPTConfig(vocab_size=320, n_layer=2, n_head=2, d_model=32, seq_len=32), tok)
    return {**out, "model": new, "tok": tok, "x": torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(1))}


def test_resume_reads_old_format_weights_and_moments(checkpoints):
    torch.manual_seed(5)  # other weights: the load must overwrite every one
    ref = GPT(checkpoints["model"].cfg)
    results = {}
    for name in ("new", "old"):
        model = GPT(ref.cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step, meta, _ = restore_checkpoint(model, opt, checkpoints[name])
        assert step == 1
        results[name] = (model.state_dict(), {n: opt.state[p] for n, p in model.named_parameters()})
    (new_w, new_m), (old_w, old_m) = results["new"], results["old"]
    assert new_w.keys() == old_w.keys()
    for k in new_w:
        assert torch.equal(new_w[k], old_w[k]), k
        assert torch.equal(new_w[k], checkpoints["model"].state_dict()[k]), k
    for n in new_m:
        for s in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(new_m[n][s], old_m[n][s]), (n, s)
    assert new_m["blocks.0.attn.wk.weight"]["exp_avg"].abs().sum() > 0  # real moments, not fresh zeros


def test_evaluation_serving_and_export_give_the_new_format_logits(checkpoints, tmp_path):
    from tasks.deploy.export import export_hf, load_exported
    from tasks.deploy.generation import TextGenerator

    x = checkpoints["x"]
    with torch.no_grad():
        want = checkpoints["model"].eval()(x)[0]
        got = {"evaluation": load_model_for_inference(checkpoints["old"])[0](x)[0],
               "server": TextGenerator.from_files(checkpoints["old"], checkpoints["tok"]).model(x)[0]}
        export_hf(checkpoints["old"], checkpoints["tok"], tmp_path / "hf")
        got["export"] = load_exported(tmp_path / "hf")(x)[0]
    for where, logits in got.items():
        assert torch.equal(logits, want), where


def test_old_format_checkpoint_is_still_verified(checkpoints, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(checkpoints["old"].parent.parent, run)
    ckpt = run / checkpoints["old"].parent.name / checkpoints["old"].name
    f = next(ckpt.glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    with pytest.raises(UnverifiedCheckpoint):
        load_model_for_inference(ckpt)


def test_continued_run_under_fsdp_and_tp_starts_from_old_checkpoint(base, tmp_path):
    """train.init_from (continued pretraining, the gate's champion) of an old-format checkpoint in a
    4-process dp_shard 2 x tp 2 run: the fused rows are split and resharded into the FSDP/TP DTensor
    shards, so the weights it starts from hash (whole tensors) like the new-format model's."""
    import json

    from layout_helpers import layout_cfg, rank_record, run_layout
    from lm_helpers import tokenizer_artifact, tokens_artifact
    from tasks.core.hashing import sha256_tree
    from tasks.train.checkpoint import weights_sha256
    from tasks.train.data import load_index

    vocab = load_index(Path(tokens_artifact(base)["index_path"]))["vocab_size"]
    torch.manual_seed(3)
    new, ckpts = save_both_formats(tmp_path, GPTConfig.from_model_config(layout_cfg(4).model, vocab),
                                   Path(tokenizer_artifact(base)["path"]))
    out = tmp_path / "continued"
    run = run_layout(base, 4, train={"parallel": {"dp_shard": 2, "tp": 2}, "init_from": str(ckpts["old"]),
                                     "init_sha256": sha256_tree(ckpts["old"])}, steps=1, out_dir=out, name="continued")
    d = layout_cfg(4).model.d_model  # each wq a quarter of the whole on a rank: tp halves of dp halves
    assert rank_record(run.layout)["params"]["blocks.0.attn.wq.weight"]["local_shape"] == [d // 4, d]
    record = json.loads((out / "init.json").read_text())
    assert record["weights_sha256"] == weights_sha256(new)
