"""Export a checkpoint as a Hugging Face-compatible model directory with a model card.

    python -m tasks.deploy.export --checkpoint DIR --tokenizer tokenizer.json --out DIR \\
        [--config run_dir/config.json] [--report eval-report.json]

The GPT is Llama-shaped (pre-norm RMSNorm, rotary embeddings with the rotate-half convention,
SwiGLU MLP, no biases, tied embeddings), so a dense model's export is a `LlamaForCausalLM` checkpoint:

    config.json                 model_type llama (mixtral, ernie4_5_moe), sizes, rope_theta, rms_norm_eps, ...
    model.safetensors           the weights (float32, safetensors)
    generation_config.json
    tokenizer.json              the run's tokenizer, unchanged
    tokenizer_config.json       PreTrainedTokenizerFast, eos "<|endoftext|>", model_max_length
    special_tokens_map.json
    README.md                   model card: sources and licences, training config, evaluation, energy, limitations
    crucible_export.json        what was exported from where (hashes)

Weight names: tok_emb -> model.embed_tokens; blocks.i.attn.wq/wk/wv -> self_attn.{q,k,v}_proj;
attn.proj -> o_proj; mlp.w1/w3/w2 -> mlp.gate_proj/up_proj/down_proj; attn_norm / mlp_norm ->
input_layernorm / post_attention_layernorm; norm -> model.norm. `load_exported` maps them back.

An MoE model (model.moe) exports as the Hugging Face architecture that computes it exactly
(`choose_architecture`): Mixtral (softmax router, renormalised top-k, MoE in every layer, no shared
experts, zero selection bias); else ERNIE 4.5 MoE (softmax, renormalised, plus the DeepSeek-V3
selection bias, shared experts and MoE every N-th layer); a sigmoid router as GLM-4.5 MoE (selection
bias, shared experts, optional renormalisation and QK-norm, MoE in the last layers). Settings none of
them represents are refused, naming them. Expert weights are written one tensor per expert, as the
published checkpoints of those models are: router.weight -> gate.weight; experts.w1/w3/w2[e] ->
experts.e.w1/w3/w2 (Mixtral) or experts.e.gate_proj/up_proj/down_proj (ERNIE, GLM); expert_bias ->
moe_statics.e_score_correction_bias (ERNIE) or gate.e_score_correction_bias (GLM); shared.w1/w3/w2 ->
shared_experts.gate_proj/up_proj/down_proj.

Nothing is unpickled on either side (issue 24): the checkpoint is read by
`load_model_for_inference` (verified against its run's signed manifest, safetensors and signed JSON),
and `load_exported` reads config.json and model.safetensors only, so a planted file fails to parse.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import torch

from tasks.core import fs
from tasks.core.io import atomic_write_bytes
from tasks.core.storage import stored

RMS_EPS = 1e-6  # tasks.train.model.RMSNorm's default
EOS_TOKEN = "<|endoftext|>"


# ------------------------------------------------------------------ which Hugging Face architecture

ARCHITECTURES = ("llama", "mixtral", "ernie4_5_moe", "glm4_moe")
SUPPORTED = ("llama: a dense model without QK-norm; mixtral: every layer an MoE layer, softmax router scores, "
             "top-k weights renormalised (model.moe.route_norm), no shared experts, zero selection bias "
             "(model.moe.bias_update_rate 0), no QK-norm; ernie4_5_moe: softmax scores with route_norm, any selection "
             "bias, shared experts and every_n_layers, no QK-norm; glm4_moe: sigmoid scores, route_norm on or off, "
             "any selection bias, shared experts, QK-norm on or off, MoE layers forming the last layers "
             "(every_n_layers 1, or n_layer <= every_n_layers); none has model.logit_softcap")


def sparse_layers(sd: dict[str, torch.Tensor], n_layer: int) -> list[int]:
    """The layers whose MLP is an MoE (they hold a router), read from the weights themselves."""
    return [i for i in range(n_layer) if f"blocks.{i}.mlp.router.weight" in sd]


def choose_architecture(model) -> str:
    """The Hugging Face architecture that computes exactly what `model` computes: "llama" (dense),
    "mixtral", "ernie4_5_moe" or "glm4_moe" (MoE). Anything these cannot represent is refused with
    the reason (exported anyway, it would load in transformers and silently compute something else).

    Mixtral routes softmax top-k renormalised, every layer, no shared experts and no selection bias.
    ERNIE 4.5 MoE adds what our DeepSeek-V3 style router needs beyond that: a per-expert
    e_score_correction_bias added to the softmax scores for selection only (weights gathered from
    the unbiased scores, renormalised), ungated shared experts, and MoE on layer i when
    (i + 1) % moe_layer_interval == 0 (our every_n_layers). Its RoPE rotates interleaved pairs,
    which a fixed permutation of each head's query and key rows turns into our rotate-half.
    GLM-4.5 (glm4_moe) is the DeepSeek-V3 router on sigmoid scores (n_group 1, scaling 1, optional
    renormalisation) with Llama attention and optional QK-norm, but its MoE layers are all layers
    from first_k_dense_replace on. Qwen2-MoE gates its shared expert by a sigmoid and has no
    selection bias; Qwen3-MoE always has QK-norm and neither; DeepSeek-V3 has MLA attention."""
    mc, sd = model.cfg, model.state_dict()
    sparse = sparse_layers(sd, mc.n_layer)
    if not sparse:
        unsupported = [name for name, on in (("model.qk_norm", mc.qk_norm), ("model.logit_softcap", mc.logit_softcap))
                       if on]
        if unsupported:
            raise ValueError(f"cannot export as a Hugging Face Llama model: {', '.join(unsupported)} "
                             "has no Llama equivalent (train with these options off to export)")
        return "llama"
    moe = mc.moe

    def refuse(why: str):
        raise ValueError(f"cannot export this MoE model to Hugging Face: {why} (exportable settings: {SUPPORTED})")

    if mc.logit_softcap:
        refuse("model.logit_softcap has no equivalent in Mixtral, ERNIE 4.5 MoE or GLM-4.5 MoE")
    every = [i for i in range(mc.n_layer) if (i + 1) % moe.every_n_layers == 0]
    if sparse != every:  # the MoE layer rule is the config's; weights that disagree are not this model
        raise ValueError(f"MoE layers {sparse} are not every {moe.every_n_layers}-th layer {every}")
    if moe.score_func == "sigmoid":
        if sparse != list(range(sparse[0], mc.n_layer)):
            refuse(f"model.moe.score_func='sigmoid' exports as GLM-4.5 MoE, whose MoE layers are the last ones, "
                   f"and model.moe.every_n_layers={moe.every_n_layers} makes layers {sparse} sparse")
        return "glm4_moe"
    if not moe.route_norm:
        refuse("Mixtral and ERNIE 4.5 MoE renormalise the softmax top-k weights, and this model has "
               "model.moe.route_norm=False")
    if mc.qk_norm:
        refuse("model.qk_norm has no equivalent in Mixtral or ERNIE 4.5 MoE (GLM-4.5 MoE has it, with "
               "model.moe.score_func='sigmoid')")
    shared = any(f"blocks.{i}.mlp.shared.w1.weight" in sd for i in sparse)
    bias = any(bool(sd[f"blocks.{i}.mlp.expert_bias"].any()) for i in sparse)
    if len(sparse) == mc.n_layer and not shared and not bias:
        return "mixtral"
    return "ernie4_5_moe"


# ------------------------------------------------------------------ weights

def _interleave_perm(head_dim: int) -> torch.Tensor:
    """Row order within a head that turns rotate-half RoPE pairs (j, j + h/2) into the interleaved
    pairs (2j, 2j + 1) ERNIE rotates: hf row 2j = our row j, hf row 2j + 1 = our row j + h/2.
    q.k is a sum over the head dimension, so permuting q and k alike keeps the attention scores."""
    return torch.arange(head_dim).view(2, head_dim // 2).t().reshape(-1)


def _permute_heads(w: torch.Tensor, head_dim: int, perm: torch.Tensor) -> torch.Tensor:
    return w.view(-1, head_dim, w.size(-1))[:, perm].reshape(w.shape)


def _swiglu_hf(sd: dict, ours: str, hf: str, names: tuple[str, str, str]) -> dict:
    """Our SwiGLU w1 (gate) / w3 (up) / w2 (down) under HF's three names for them."""
    return {f"{hf}.{n}.weight": sd[f"{ours}.{w}.weight"] for n, w in zip(names, ("w1", "w3", "w2"))}


def to_hf_state_dict(model, arch: str | None = None) -> dict[str, torch.Tensor]:
    """Our state dict under `arch`'s names (choose_architecture's by default), in the layout of the
    architecture's published checkpoints (one tensor per expert), which every transformers version
    and other HF loaders read."""
    arch = arch or choose_architecture(model)
    sd, mc = model.state_dict(), model.cfg
    hd = mc.head_dim
    perm = _interleave_perm(hd) if arch == "ernie4_5_moe" else None
    out = {"model.embed_tokens.weight": sd["tok_emb.weight"], "model.norm.weight": sd["norm.weight"]}
    for i in range(mc.n_layer):
        p, h = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = (sd[p + f"attn.w{x}.weight"] for x in "qkv")
        if perm is not None:
            q, k = _permute_heads(q, hd, perm), _permute_heads(k, hd, perm)
        out.update({
            h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k, h + "self_attn.v_proj.weight": v,
            h + "self_attn.o_proj.weight": sd[p + "attn.proj.weight"],
            h + "input_layernorm.weight": sd[p + "attn_norm.weight"],
            h + "post_attention_layernorm.weight": sd[p + "mlp_norm.weight"],
        })
        if p + "attn.q_norm.weight" in sd:  # glm4_moe only (choose_architecture)
            out[h + "self_attn.q_norm.weight"] = sd[p + "attn.q_norm.weight"]
            out[h + "self_attn.k_norm.weight"] = sd[p + "attn.k_norm.weight"]
        if p + "mlp.router.weight" not in sd:  # a dense layer: a SwiGLU
            out.update(_swiglu_hf(sd, p + "mlp", h + "mlp", ("gate_proj", "up_proj", "down_proj")))
            continue
        w1, w2, w3 = (sd[p + f"mlp.experts.{w}"] for w in ("w1", "w2", "w3"))
        if arch == "mixtral":
            m = h + "block_sparse_moe."
            out[m + "gate.weight"] = sd[p + "mlp.router.weight"]
            for e in range(w1.size(0)):
                out.update({m + f"experts.{e}.w1.weight": w1[e], m + f"experts.{e}.w2.weight": w2[e],
                            m + f"experts.{e}.w3.weight": w3[e]})
        else:
            m = h + "mlp."
            out[m + "gate.weight"] = sd[p + "mlp.router.weight"]
            if arch == "ernie4_5_moe":
                out[m + "moe_statics.e_score_correction_bias"] = sd[p + "mlp.expert_bias"][None]  # (1 group, E)
            else:
                out[m + "gate.e_score_correction_bias"] = sd[p + "mlp.expert_bias"]
            for e in range(w1.size(0)):
                out.update({m + f"experts.{e}.gate_proj.weight": w1[e], m + f"experts.{e}.up_proj.weight": w3[e],
                            m + f"experts.{e}.down_proj.weight": w2[e]})
            if p + "mlp.shared.w1.weight" in sd:
                out.update(_swiglu_hf(sd, p + "mlp.shared", m + "shared_experts",
                                      ("gate_proj", "up_proj", "down_proj")))
            elif arch == "glm4_moe":  # GLM always builds the shared expert: hidden 0 computes nothing
                d = w1.size(2)
                out.update({m + "shared_experts.gate_proj.weight": w1.new_zeros(0, d),
                            m + "shared_experts.up_proj.weight": w1.new_zeros(0, d),
                            m + "shared_experts.down_proj.weight": w1.new_zeros(d, 0)})
    if not mc.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def from_hf_state_dict(hf: dict[str, torch.Tensor], n_layer: int, arch: str = "llama",
                       head_dim: int | None = None) -> dict[str, torch.Tensor]:
    """to_hf_state_dict's inverse (head_dim: needed for ernie4_5_moe's RoPE row order)."""
    inverse = torch.argsort(_interleave_perm(head_dim)) if arch == "ernie4_5_moe" else None
    sd = {"tok_emb.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    for i in range(n_layer):
        p, h = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = (hf[h + f"self_attn.{x}_proj.weight"] for x in "qkv")
        if inverse is not None:
            q, k = _permute_heads(q, head_dim, inverse), _permute_heads(k, head_dim, inverse)
        sd.update({p + "attn.wq.weight": q, p + "attn.wk.weight": k, p + "attn.wv.weight": v})
        sd[p + "attn.proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        sd[p + "attn_norm.weight"] = hf[h + "input_layernorm.weight"]
        sd[p + "mlp_norm.weight"] = hf[h + "post_attention_layernorm.weight"]
        if h + "self_attn.q_norm.weight" in hf:
            sd[p + "attn.q_norm.weight"] = hf[h + "self_attn.q_norm.weight"]
            sd[p + "attn.k_norm.weight"] = hf[h + "self_attn.k_norm.weight"]
        moe = h + ("block_sparse_moe." if arch == "mixtral" else "mlp.")
        if moe + "gate.weight" not in hf:
            sd.update(_swiglu_ours(hf, h + "mlp", p + "mlp", ("gate_proj", "up_proj", "down_proj")))
            continue
        sd[p + "mlp.router.weight"] = hf[moe + "gate.weight"]
        names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        n_exp = hf[moe + "gate.weight"].size(0)
        for ours, theirs in zip(("w1", "w3", "w2"), names):
            sd[p + f"mlp.experts.{ours}"] = torch.stack([hf[moe + f"experts.{e}.{theirs}.weight"] for e in range(n_exp)])
        if arch == "mixtral":
            sd[p + "mlp.expert_bias"] = torch.zeros(n_exp)
        else:
            sd[p + "mlp.expert_bias"] = (hf[moe + "moe_statics.e_score_correction_bias"][0] if arch == "ernie4_5_moe"
                                         else hf[moe + "gate.e_score_correction_bias"])
            if hf.get(moe + "shared_experts.gate_proj.weight", torch.empty(0)).numel():
                sd.update(_swiglu_ours(hf, moe + "shared_experts", p + "mlp.shared", names))
    if "lm_head.weight" in hf:
        sd["lm_head.weight"] = hf["lm_head.weight"]
    return sd


def _swiglu_ours(hf: dict, theirs: str, ours: str, names: tuple[str, str, str]) -> dict:
    return {f"{ours}.{w}.weight": hf[f"{theirs}.{n}.weight"] for n, w in zip(names, ("w1", "w3", "w2"))}


def hf_config(model, arch: str, eos_id: int, bos_id: int | None) -> dict:
    """config.json for `arch`; MoE sizes are read from the weights (expert count, hidden sizes)."""
    mc, sd = model.cfg, model.state_dict()
    names = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
             "glm4_moe": "Glm4MoeForCausalLM"}
    c = {
        "architectures": [names[arch]], "model_type": arch,
        "vocab_size": mc.vocab_size, "hidden_size": mc.d_model,
        "intermediate_size": mc.mlp_hidden, "num_hidden_layers": mc.n_layer,
        "num_attention_heads": mc.n_head, "num_key_value_heads": mc.n_head,
        "head_dim": mc.head_dim, "max_position_embeddings": mc.seq_len,
        "hidden_act": "silu", "rms_norm_eps": RMS_EPS, "rope_theta": mc.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": mc.rope_theta},
        "attention_dropout": 0.0, "tie_word_embeddings": mc.tie_embeddings,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None,
    }
    if arch == "llama":
        return {**c, "rope_scaling": None, "attention_bias": False, "mlp_bias": False}
    sparse = sparse_layers(sd, mc.n_layer)
    n_experts, expert_hidden, _ = sd[f"blocks.{sparse[0]}.mlp.experts.w1"].shape
    if arch == "mixtral":
        return {**c, "intermediate_size": expert_hidden, "num_local_experts": n_experts,
                "num_experts_per_tok": mc.moe.top_k, "sliding_window": None, "router_jitter_noise": 0.0,
                "router_aux_loss_coef": mc.moe.aux_loss, "output_router_logits": False}
    shared = sd.get(f"blocks.{sparse[0]}.mlp.shared.w1.weight")
    n_shared = 0 if shared is None else shared.size(0) // expert_hidden
    if arch == "glm4_moe":
        return {**c, "rope_parameters": {**c["rope_parameters"], "partial_rotary_factor": 1.0},
                "partial_rotary_factor": 1.0,  # GLM rotates half of each head unless told otherwise
                "attention_bias": False, "use_qk_norm": mc.qk_norm, "n_routed_experts": n_experts,
                "num_experts_per_tok": mc.moe.top_k, "moe_intermediate_size": expert_hidden,
                "n_shared_experts": n_shared, "first_k_dense_replace": sparse[0], "norm_topk_prob": mc.moe.route_norm,
                "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "num_nextn_predict_layers": 0,
                "output_router_logits": False}
    return {**c, "use_bias": False, "moe_num_experts": n_experts, "moe_k": mc.moe.top_k,
            "moe_intermediate_size": expert_hidden,
            "moe_num_shared_experts": n_shared,
            "moe_layer_start_index": 0, "moe_layer_end_index": mc.n_layer - 1,
            "moe_layer_interval": mc.moe.every_n_layers, "moe_norm_min": 1e-12,
            "router_aux_loss_coef": mc.moe.aux_loss, "output_router_logits": False}


def export_hf(ckpt_dir: str | Path, tokenizer_path: str | Path, out_dir: str | Path, cfg=None,
              eval_report: dict | None = None) -> dict:
    """Write the Hugging Face directory; returns {"out_dir", "weights", "format", "files"}.
    `cfg` (PipelineConfig) and `eval_report` (an evaluate-stage report) feed the model card."""
    from tasks.tokenizer.bpe import load_tokenizer
    from tasks.train.checkpoint import load_verified_model

    # a local path, or an object-store run's URI (read there, never a working copy's)
    ckpt_dir, tokenizer_path, out = fs.canonical(ckpt_dir), fs.canonical(tokenizer_path), Path(out_dir)
    at, options = stored(ckpt_dir)
    model, meta, tree_sha256 = load_verified_model(at, storage_options=options)  # the hash of what was loaded
    arch = choose_architecture(model)  # refuses, naming the setting, what no HF architecture here computes
    tok_bytes = fs.read_bytes(*stored(tokenizer_path))  # read once: what is checked is what is exported
    tok_sha256 = hashlib.sha256(tok_bytes).hexdigest()
    want = meta.get("tokenizer_sha256")
    if want and want != tok_sha256:
        raise ValueError(f"tokenizer {tokenizer_path} is not the one checkpoint {ckpt_dir} was trained with")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "tokenizer.json", tok_bytes, fsync=False)
    tok = load_tokenizer(out / "tokenizer.json", expected_sha256=tok_sha256)
    eos_id = meta.get("eos_id", tok.token_to_id(EOS_TOKEN))
    bos_id = tok.token_to_id("<|bos|>")

    from safetensors.torch import save_file

    weights_file, fmt = out / "model.safetensors", "safetensors"
    save_file(to_hf_state_dict(model, arch), str(weights_file), metadata={"format": "pt"})

    (out / "config.json").write_text(json.dumps(hf_config(model, arch, eos_id, bos_id), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": True, "temperature": 1.0,
         "max_length": model.cfg.seq_len}, indent=2) + "\n")
    specials = {"eos_token": EOS_TOKEN, "unk_token": None}
    if bos_id is not None:
        specials["bos_token"] = "<|bos|>"
    if tok.token_to_id("<|pad|>") is not None:
        specials["pad_token"] = "<|pad|>"
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model.cfg.seq_len,
         "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
         **{k: v for k, v in specials.items() if v is not None}}, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {k: v for k, v in specials.items() if v is not None}, indent=2) + "\n")
    (out / "README.md").write_text(model_card(model, meta, cfg, eval_report, fmt, arch, run_energy_log(ckpt_dir)))
    (out / "crucible_export.json").write_text(json.dumps(
        {"checkpoint": str(ckpt_dir), "checkpoint_sha256_tree": tree_sha256,
         "tokenizer_sha256": tok_sha256, "step": meta.get("step"), "run_name": meta.get("run_name"),
         "weights": weights_file.name, "format": fmt, "architecture": arch}, indent=2) + "\n")
    return {"out_dir": str(out), "weights": str(weights_file), "format": fmt, "architecture": arch,
            "files": sorted(p.name for p in out.iterdir())}


def load_exported(out_dir: str | Path):
    """Our GPT from an exported directory (round-trip check; no transformers needed)."""
    from safetensors.torch import load_file

    from tasks.train.model import GPT, GPTConfig

    out = Path(out_dir)
    c = json.loads((out / "config.json").read_text())
    arch = c.get("model_type")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{out} holds a {arch!r} model; this loader reads {', '.join(ARCHITECTURES)}")
    hf = load_file(str(out / "model.safetensors"))
    moe = None
    if arch == "mixtral":
        moe = {"n_experts": c["num_local_experts"], "top_k": c["num_experts_per_tok"], "every_n_layers": 1,
               "expert_hidden": c["intermediate_size"]}
    elif arch == "ernie4_5_moe":
        if (c["moe_layer_start_index"], c["moe_layer_end_index"]) != (0, c["num_hidden_layers"] - 1):
            raise ValueError("ERNIE MoE layers must span the whole model to map onto model.moe.every_n_layers")
        moe = {"n_experts": c["moe_num_experts"], "top_k": c["moe_k"], "every_n_layers": c["moe_layer_interval"],
               "expert_hidden": c["moe_intermediate_size"], "n_shared_experts": c["moe_num_shared_experts"]}
    elif arch == "glm4_moe":
        first, n_layer = c["first_k_dense_replace"], c["num_hidden_layers"]
        if first not in (0, n_layer - 1) or c.get("routed_scaling_factor", 1.0) != 1.0 or c.get("n_group", 1) != 1:
            raise ValueError("only GLM-4.5 MoE configs this export writes map onto model.moe (first_k_dense_replace "
                             "0 or n_layer - 1, routed_scaling_factor 1, n_group 1)")
        moe = {"n_experts": c["n_routed_experts"], "top_k": c["num_experts_per_tok"],
               "every_n_layers": 1 if first == 0 else n_layer, "expert_hidden": c["moe_intermediate_size"],
               "n_shared_experts": c["n_shared_experts"], "score_func": "sigmoid", "route_norm": c["norm_topk_prob"]}
    cfg = GPTConfig(vocab_size=c["vocab_size"], n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"],
                    d_model=c["hidden_size"], seq_len=c["max_position_embeddings"], rope_theta=c["rope_theta"],
                    tie_embeddings=c.get("tie_word_embeddings", True), qk_norm=bool(c.get("use_qk_norm")),
                    **({} if moe is None else {"moe": {"score_func": "softmax", "route_norm": True, **moe}}))
    dense = any(not cfg.moe.is_moe_layer(i) for i in range(cfg.n_layer))
    if dense and cfg.mlp_hidden != c["intermediate_size"]:
        raise ValueError("intermediate_size does not match the GPT's mlp_ratio rounding")
    model = GPT(cfg)
    model.load_state_dict(from_hf_state_dict(hf, cfg.n_layer, arch, cfg.head_dim))
    return model.eval()


def _table(rows: list[tuple]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(map(str, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in r) + " |" for r in body]
    return "\n".join(lines)


def run_energy_log(ckpt_dir: Path | str) -> list[dict]:
    """The energy records of the run a pipeline checkpoint belongs to (tasks/core/energy.py), [] for another."""
    from tasks.core.energy import read_log
    from tasks.core.layout import RunLayout

    return read_log(RunLayout.of_checkpoint(ckpt_dir).energy_log) if RunLayout.is_run_checkpoint(ckpt_dir) else []


def model_card(model, meta: dict, cfg, report: dict | None, fmt: str, arch: str = "llama",
               energy: list[dict] | None = None) -> str:
    from tasks.core.energy import card_section

    mc = model.cfg
    name = cfg.deploy.model_name if cfg is not None else (meta.get("run_name") or "crucible-gpt")
    licences = sorted({s.licence for s in cfg.sources}) if cfg is not None else []
    front = ["---", "library_name: transformers", "pipeline_tag: text-generation", f"tags: [crucible, {arch}, causal-lm]"]
    front += [f"license: other", f"license_name: \"{' + '.join(licences) or 'unknown'}\""]
    front.append("---")
    mlp = "SwiGLU"
    sparse = sparse_layers(model.state_dict(), mc.n_layer)
    if sparse:
        moe = mc.moe
        shared = f", {moe.n_shared_experts} shared" if moe.n_shared_experts else ""
        mlp = (f"mixture-of-experts SwiGLU in {len(sparse)} of {mc.n_layer} layers ({moe.n_experts} experts, "
               f"top-{moe.top_k}{shared}; {model.num_active_params() / 1e6:.2f}M parameters active per token), "
               "dense SwiGLU elsewhere")
    parts = ["\n".join(front), f"# {name}",
             f"A {model.num_params() / 1e6:.2f}M-parameter decoder-only language model trained from scratch by the "
             f"Crucible pre-training pipeline (run `{meta.get('run_name')}`, step {meta.get('step')}). "
             f"Architecture: Llama-style ({mc.n_layer} layers, {mc.n_head} heads, d_model {mc.d_model}, "
             f"context {mc.seq_len} tokens, vocabulary {mc.vocab_size}, RMSNorm, RoPE θ={mc.rope_theta:g}, "
             f"{mlp}, {'tied' if mc.tie_embeddings else 'untied'} embeddings), exported as a Hugging Face "
             f"`{arch}` model. Weights: {fmt}."]
    parts.append("## Training data: sources and licences")
    if cfg is not None:
        parts.append(_table([("source", "licence", "provenance", "format", "mixture weight")] +
                            [(s.name, s.licence, s.provenance, s.format, s.mixture_weight) for s in cfg.sources]))
        parts.append("Documents were filtered for quality, deduplicated, and PII-redacted per the source policy "
                     "by Crucible's curation stage; the exact settings are in the configuration below.")
    else:
        parts.append("Not recorded (exported without the run's configuration).")
    parts.append("## Training configuration")
    if cfg is not None:
        dumped = cfg.model_dump(mode="json")
        parts.append("```json\n" + json.dumps({k: dumped[k] for k in ("tokenizer", "tokens", "model", "train")
                                                if k in dumped}, indent=2) + "\n```")
    else:
        parts.append("```json\n" + json.dumps(meta.get("model", mc.to_dict()), indent=2) + "\n```")
    parts.append("## Evaluation")
    if report:
        rows = [("metric", "value"), ("validation loss", report.get("val_loss")),
                ("validation perplexity", report.get("perplexity")), ("validation tokens", report.get("val_tokens"))]
        rows += [(k, v) for k, v in sorted((report.get("task_metrics") or {}).items())]
        parts.append(_table(rows))
        for s in report.get("samples", [])[:3]:
            parts.append(f"- prompt `{s['prompt']}` → `{s['completion']}`")
    else:
        parts.append("No evaluation report was given to the export.")
    parts.append("## Energy, emissions and cost")
    parts.append(card_section(energy or []))
    parts.append("## Limitations\n\n"
                 "- A small research model: it produces fluent-looking but frequently wrong or incoherent text; "
                 "do not rely on its output for facts, advice or decisions.\n"
                 f"- Context window of {mc.seq_len} tokens; English-centric web/document text only.\n"
                 "- Not instruction-tuned, no safety tuning: it can reproduce biases, offensive content or "
                 "personal data that survived filtering.\n"
                 "- Evaluation covers the metrics above only; benchmark subsets are small.\n"
                 "- Use is subject to the licences of the training sources listed above.")
    parts.append("## Usage\n\n```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
                 "tok = AutoTokenizer.from_pretrained(PATH)\nmodel = AutoModelForCausalLM.from_pretrained(PATH)\n"
                 "ids = tok(\"The Linux kernel\", return_tensors=\"pt\").input_ids\n"
                 "print(tok.decode(model.generate(ids, max_new_tokens=20)[0]))\n```")
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tasks.deploy.export", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=None, help="the run's config.json (for the model card)")
    ap.add_argument("--report", default=None, help="the checkpoint's evaluation report JSON")
    args = ap.parse_args(argv)
    cfg = None
    if args.config:
        from tasks.config import PipelineConfig

        cfg = PipelineConfig.model_validate_json(Path(args.config).read_text())
    report = json.loads(Path(args.report).read_text()) if args.report else None
    print(json.dumps(export_hf(args.checkpoint, args.tokenizer, args.out, cfg, report), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
