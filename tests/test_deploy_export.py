"""Hugging Face-compatible export: files, model card, weights that round-trip to the same logits;
loading with transformers only if it is installed. MoE models export as Mixtral, ERNIE 4.5 MoE or
GLM-4.5 MoE and transformers computes the same logits; settings none represents are refused."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from lm_helpers import TINY_MOE, random_checkpoint, sample_tokenizer, sharpen_moe
from tasks.config import PipelineConfig
from tasks.deploy.export import export_hf, load_exported
from tasks.train.checkpoint import load_model_for_inference


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    tok = sample_tokenizer(root / "tokenizer.json")
    ckpt = random_checkpoint(root / "train", tok, 10, 0)
    cfg = PipelineConfig.model_validate({
        "name": "t", "run_root": str(root / "runs"),
        "sources": [{"name": "wiki", "uri": "x.jsonl", "format": "jsonl", "licence": "CC-BY-SA-4.0",
                     "provenance": "https://dumps.wikimedia.org"}],
        "deploy": {"model_name": "crucible-export-test"}})
    report = {"val_loss": 5.5, "perplexity": 244.69, "val_tokens": 1024, "task_metrics": {"lambada_acc": 0.01},
              "samples": [{"prompt": "The", "completion": " kernel"}]}
    res = export_hf(ckpt, tok, root / "hf", cfg, report)
    return {"res": res, "ckpt": ckpt, "tok": tok, "out": root / "hf"}


def test_export_files_and_card(exported):
    out = exported["out"]
    files = set(exported["res"]["files"])
    assert exported["res"]["format"] == "safetensors"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
            "generation_config.json", "README.md"} <= files
    c = json.loads((out / "config.json").read_text())
    assert c["model_type"] == "llama" and c["tie_word_embeddings"] and c["num_hidden_layers"] == 2
    assert c["eos_token_id"] == 1 and c["max_position_embeddings"] == 32
    card = (out / "README.md").read_text()
    for needle in ("CC-BY-SA-4.0", "https://dumps.wikimedia.org", "## Training configuration", "5.5",
                   "lambada_acc", "## Limitations", "crucible-export-test"):
        assert needle in card, needle


def test_weights_round_trip_to_the_same_logits(exported):
    model, _ = load_model_for_inference(exported["ckpt"])
    back = load_exported(exported["out"])
    x = torch.randint(0, model.cfg.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(x)[0], model(x)[0])


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_transformers_loads_the_export_with_the_same_logits(exported):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(exported["out"]).eval()
    assert isinstance(hf, LlamaForCausalLM)  # a standard architecture, no remote code
    tok = AutoTokenizer.from_pretrained(exported["out"])
    model, _ = load_model_for_inference(exported["ckpt"])
    text = "The Linux kernel is a free and open-source operating system kernel."
    ids = tok(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == Tokenizer.from_file(str(exported["tok"])).encode(text, add_special_tokens=False).ids
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids)[0], rtol=1e-4, atol=1e-4)
        # greedy decoding with transformers' own KV cache picks the same tokens as our model
        ours = model.generate(ids[:, :8], 6, temperature=0.0)
        theirs = hf.generate(ids[:, :8], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert theirs[0].tolist() == ours[0].tolist()


def test_untied_head_exports_and_round_trips(tmp_path):
    tok = sample_tokenizer(tmp_path / "tokenizer.json")
    ckpt = random_checkpoint(tmp_path / "train", tok, 10, 3, tie_embeddings=False)
    res = export_hf(ckpt, tok, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["tie_word_embeddings"] is False
    model, _ = load_model_for_inference(ckpt)
    back = load_exported(res["out_dir"])
    x = torch.randint(0, model.cfg.vocab_size, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(back(x)[0], model(x)[0])


@pytest.mark.parametrize("option,match", [
    ({"qk_norm": True}, "no Llama equivalent"), ({"logit_softcap": 30.0}, "no Llama equivalent"),
    # GLM-4.5 MoE (the sigmoid router's architecture) makes the last layers sparse, not every other one
    ({"moe": {**TINY_MOE, "score_func": "sigmoid"}, "n_layer": 4}, r"score_func='sigmoid'.*layers \[1, 3\]"),
    ({"moe": {**TINY_MOE, "route_norm": False}}, "route_norm=False"),
    ({"moe": TINY_MOE, "qk_norm": True}, "model.qk_norm has no equivalent in Mixtral or ERNIE"),
    ({"moe": TINY_MOE, "logit_softcap": 30.0}, "model.logit_softcap has no equivalent")])
def test_options_without_a_hf_equivalent_are_refused(tmp_path, option, match):
    tok = sample_tokenizer(tmp_path / "tokenizer.json")
    ckpt = random_checkpoint(tmp_path / "train", tok, 10, 3, **option)
    with pytest.raises(ValueError, match=match):
        export_hf(ckpt, tok, tmp_path / "hf")
    assert not (tmp_path / "hf" / "model.safetensors").exists()


def _zero_bias(model) -> None:
    sharpen_moe(model)
    for b in model.blocks:
        if hasattr(b.mlp, "expert_bias"):
            b.mlp.expert_bias.zero_()


def _sharpen_with_qk_norm(model) -> None:
    sharpen_moe(model)
    g = torch.Generator().manual_seed(7)
    for b in model.blocks:  # norm gains other than 1, so a dropped one shows
        for norm in (b.attn.q_norm, b.attn.k_norm):
            norm.weight.data.uniform_(0.5, 1.5, generator=g)


# ernie: a dense layer then a sparse one with a shared expert and a nonzero selection bias, untied
# head; mixtral: every layer sparse, no shared expert, zero bias (model.moe.bias_update_rate 0);
# glm: ernie's layout on sigmoid scores, not renormalised, with QK-norm
MOE_CASES = {
    "ernie4_5_moe": ({"moe": TINY_MOE, "tie_embeddings": False}, sharpen_moe, "Ernie4_5_MoeForCausalLM"),
    "glm4_moe": ({"moe": {**TINY_MOE, "score_func": "sigmoid", "route_norm": False}, "qk_norm": True},
                 _sharpen_with_qk_norm, "Glm4MoeForCausalLM"),
    "mixtral": ({"moe": {**TINY_MOE, "n_shared_experts": 0, "every_n_layers": 1, "bias_update_rate": 0.0}},
                _zero_bias, "MixtralForCausalLM"),
}


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
@pytest.mark.parametrize("arch", sorted(MOE_CASES))
def test_moe_exports_to_transformers_with_the_same_logits(tmp_path, arch):
    import transformers
    from transformers import AutoModelForCausalLM

    options, init, cls_name = MOE_CASES[arch]
    tok = sample_tokenizer(tmp_path / "tokenizer.json")
    ckpt = random_checkpoint(tmp_path / "train", tok, 10, 5, init=init, **options)
    res = export_hf(ckpt, tok, tmp_path / "hf")
    assert res["architecture"] == arch
    c = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert c["model_type"] == arch and c["architectures"] == [cls_name]
    assert "mixture-of-experts" in (tmp_path / "hf" / "README.md").read_text()

    model, _ = load_model_for_inference(ckpt)
    sparse = [i for i, b in enumerate(model.blocks) if hasattr(b.mlp, "router")]
    assert sparse == ([0, 1] if arch == "mixtral" else [1])
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    hf.eval()
    assert type(hf) is getattr(transformers, cls_name)  # a standard architecture, no remote code
    assert not any(info.values()), info  # every weight used, none missing (a missing one is random)
    x = torch.randint(0, model.cfg.vocab_size, (3, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model(x)[0], hf(x).logits
        print(f"{arch}: max |logit difference| {(ours - theirs).abs().max().item():.3g}")
        torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(load_exported(tmp_path / "hf")(x)[0], ours)  # and back
        if arch != "mixtral":  # the selection bias decides the experts, so a match needs it honoured
            moe = model.blocks[1].mlp
            bias = moe.expert_bias.clone()
            moe.expert_bias.zero_()
            assert (model(x)[0] - ours).abs().max() > 1e-2
            moe.expert_bias.copy_(bias)
        # greedy decoding with transformers' own KV cache picks the same tokens as ours
        want = model.generate(x[:, :8], 8, temperature=0.0)
        got = hf.generate(x[:, :8], attention_mask=torch.ones_like(x[:, :8]), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0)  # the mask: token 0 in a prompt is not padding
    assert got.tolist() == want.tolist()


def test_a_checkpoint_on_a_store_exports_by_its_uri(tmp_path, monkeypatch):
    """A store run's checkpoint and tokenizer are named by their URIs (nothing is synced into a working
    copy): export reads them there, verified (Path(uri).resolve() named a local path that is not there);
    a tokenizer that is not the checkpoint's is refused."""
    from s3_helpers import moto_s3
    from tasks.core import fs, storage
    from tasks.core.hashing import sha256_file

    monkeypatch.setattr(storage, "_STORES", {})
    tok = sample_tokenizer(tmp_path / "tokenizer.json")
    ckpt = random_checkpoint(tmp_path / "r1" / "train", tok, 10, 3)
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        for p in (tmp_path / "r1").rglob("*"):
            if p.is_file():
                fs.upload(p, store.uri(p.relative_to(tmp_path).as_posix()), s3.options)
        uri, tok_uri = store.uri(ckpt.relative_to(tmp_path).as_posix()), store.uri("r1/tokenizer/tokenizer.json")
        fs.upload(tok, tok_uri, s3.options)
        res = export_hf(uri, tok_uri, tmp_path / "hf")
        record = json.loads((tmp_path / "hf" / "crucible_export.json").read_text())
        assert record["checkpoint"] == uri and record["checkpoint_sha256_tree"] == fs.tree_sha256(ckpt)
        assert sha256_file(tmp_path / "hf" / "tokenizer.json") == sha256_file(tok) == record["tokenizer_sha256"]
        model, _ = load_model_for_inference(ckpt)
        x = torch.randint(0, model.cfg.vocab_size, (2, 12))
        with torch.no_grad():
            torch.testing.assert_close(load_exported(res["out_dir"])(x)[0], model(x)[0])
        fs.write_bytes(tok_uri, Path(tok).read_bytes().replace(b'"', b' "', 1), s3.options)
        with pytest.raises(ValueError, match="not the one"):
            export_hf(uri, tok_uri, tmp_path / "hf2")
