"""Export a checkpoint as a Hugging Face-compatible model directory with a model card.

    python -m tasks.deploy.export --checkpoint DIR --tokenizer tokenizer.json --out DIR \\
        [--config run_dir/config.json] [--report eval-report.json]

The GPT is Llama-shaped (pre-norm RMSNorm, rotary embeddings with the rotate-half convention,
SwiGLU MLP, no biases, tied embeddings), so the export is a `LlamaForCausalLM` checkpoint:

    config.json                 model_type llama, sizes, rope_theta, rms_norm_eps, tie_word_embeddings
    model.safetensors           the weights (float32, safetensors)
    generation_config.json
    tokenizer.json              the run's tokenizer, unchanged
    tokenizer_config.json       PreTrainedTokenizerFast, eos "<|endoftext|>", model_max_length
    special_tokens_map.json
    README.md                   model card: sources and licences, training config, evaluation, limitations
    crucible_export.json        what was exported from where (hashes)

Weight names: tok_emb -> model.embed_tokens; blocks.i.attn.qkv (rows q|k|v) -> self_attn.{q,k,v}_proj;
attn.proj -> o_proj; mlp.w1/w3/w2 -> mlp.gate_proj/up_proj/down_proj; attn_norm / mlp_norm ->
input_layernorm / post_attention_layernorm; norm -> model.norm. `load_exported` maps them back.

Nothing is unpickled on either side (issue 24): the checkpoint is read by
`load_model_for_inference` (verified against its run's signed manifest, safetensors and signed JSON),
and `load_exported` reads config.json and model.safetensors only, so a planted file fails to parse.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

from tasks.core.hashing import sha256_file, sha256_tree

RMS_EPS = 1e-6  # tasks.train.model.RMSNorm's default
EOS_TOKEN = "<|endoftext|>"


def to_hf_state_dict(model) -> dict[str, torch.Tensor]:
    sd, C = model.state_dict(), model.cfg.d_model
    out = {"model.embed_tokens.weight": sd["tok_emb.weight"], "model.norm.weight": sd["norm.weight"]}
    for i in range(model.cfg.n_layer):
        p, h = f"blocks.{i}.", f"model.layers.{i}."
        q, k, v = sd[p + "attn.qkv.weight"].split(C, dim=0)
        out.update({
            h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k, h + "self_attn.v_proj.weight": v,
            h + "self_attn.o_proj.weight": sd[p + "attn.proj.weight"],
            h + "mlp.gate_proj.weight": sd[p + "mlp.w1.weight"], h + "mlp.up_proj.weight": sd[p + "mlp.w3.weight"],
            h + "mlp.down_proj.weight": sd[p + "mlp.w2.weight"],
            h + "input_layernorm.weight": sd[p + "attn_norm.weight"],
            h + "post_attention_layernorm.weight": sd[p + "mlp_norm.weight"],
        })
    if not model.cfg.tie_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    return {k: v.detach().to(torch.float32).contiguous().clone() for k, v in out.items()}


def check_llama_compatible(model_cfg) -> None:
    """Llama has no QK-norm and no logit soft cap: exporting such a model as Llama would load
    in transformers and silently compute something else, so refuse with the reason."""
    unsupported = [name for name, on in (("model.qk_norm", model_cfg.qk_norm),
                                         ("model.logit_softcap", model_cfg.logit_softcap)) if on]
    if unsupported:
        raise ValueError(f"cannot export as a Hugging Face Llama model: {', '.join(unsupported)} "
                         "has no Llama equivalent (train with these options off to export)")


def from_hf_state_dict(hf: dict[str, torch.Tensor], n_layer: int) -> dict[str, torch.Tensor]:
    sd = {"tok_emb.weight": hf["model.embed_tokens.weight"], "norm.weight": hf["model.norm.weight"]}
    for i in range(n_layer):
        p, h = f"blocks.{i}.", f"model.layers.{i}."
        sd[p + "attn.qkv.weight"] = torch.cat([hf[h + f"self_attn.{x}_proj.weight"] for x in "qkv"], dim=0)
        sd[p + "attn.proj.weight"] = hf[h + "self_attn.o_proj.weight"]
        sd[p + "mlp.w1.weight"] = hf[h + "mlp.gate_proj.weight"]
        sd[p + "mlp.w3.weight"] = hf[h + "mlp.up_proj.weight"]
        sd[p + "mlp.w2.weight"] = hf[h + "mlp.down_proj.weight"]
        sd[p + "attn_norm.weight"] = hf[h + "input_layernorm.weight"]
        sd[p + "mlp_norm.weight"] = hf[h + "post_attention_layernorm.weight"]
    if "lm_head.weight" in hf:
        sd["lm_head.weight"] = hf["lm_head.weight"]
    return sd


def hf_config(model_cfg, eos_id: int, bos_id: int | None) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": model_cfg.vocab_size, "hidden_size": model_cfg.d_model,
        "intermediate_size": model_cfg.mlp_hidden, "num_hidden_layers": model_cfg.n_layer,
        "num_attention_heads": model_cfg.n_head, "num_key_value_heads": model_cfg.n_head,
        "head_dim": model_cfg.head_dim, "max_position_embeddings": model_cfg.seq_len,
        "hidden_act": "silu", "rms_norm_eps": RMS_EPS, "rope_theta": model_cfg.rope_theta, "rope_scaling": None,
        "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": model_cfg.tie_embeddings,
        "initializer_range": 0.02, "use_cache": True, "torch_dtype": "float32",
        "bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": None,
    }


def export_hf(ckpt_dir: str | Path, tokenizer_path: str | Path, out_dir: str | Path, cfg=None,
              eval_report: dict | None = None) -> dict:
    """Write the Hugging Face directory; returns {"out_dir", "weights", "format", "files"}.
    `cfg` (PipelineConfig) and `eval_report` (an evaluate-stage report) feed the model card."""
    from tasks.tokenizer.bpe import load_tokenizer
    from tasks.train.checkpoint import load_model_for_inference

    ckpt_dir, tokenizer_path, out = Path(ckpt_dir).resolve(), Path(tokenizer_path).resolve(), Path(out_dir)
    model, meta = load_model_for_inference(ckpt_dir)
    check_llama_compatible(model.cfg)
    want = meta.get("tokenizer_sha256")
    if want and want != sha256_file(tokenizer_path):
        raise ValueError(f"tokenizer {tokenizer_path} is not the one checkpoint {ckpt_dir} was trained with")
    tok = load_tokenizer(tokenizer_path)
    eos_id = meta.get("eos_id", tok.token_to_id(EOS_TOKEN))
    bos_id = tok.token_to_id("<|bos|>")
    out.mkdir(parents=True, exist_ok=True)

    from safetensors.torch import save_file

    weights_file, fmt = out / "model.safetensors", "safetensors"
    save_file(to_hf_state_dict(model), str(weights_file), metadata={"format": "pt"})

    (out / "config.json").write_text(json.dumps(hf_config(model.cfg, eos_id, bos_id), indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": bos_id, "eos_token_id": eos_id, "do_sample": True, "temperature": 1.0,
         "max_length": model.cfg.seq_len}, indent=2) + "\n")
    shutil.copyfile(tokenizer_path, out / "tokenizer.json")
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
    (out / "README.md").write_text(model_card(model, meta, cfg, eval_report, fmt))
    (out / "crucible_export.json").write_text(json.dumps(
        {"checkpoint": str(ckpt_dir), "checkpoint_sha256_tree": sha256_tree(ckpt_dir),
         "tokenizer_sha256": sha256_file(tokenizer_path), "step": meta.get("step"), "run_name": meta.get("run_name"),
         "weights": weights_file.name, "format": fmt}, indent=2) + "\n")
    return {"out_dir": str(out), "weights": str(weights_file), "format": fmt,
            "files": sorted(p.name for p in out.iterdir())}


def load_exported(out_dir: str | Path):
    """Our GPT from an exported directory (round-trip check; no transformers needed)."""
    from tasks.train.model import GPT, GPTConfig

    out = Path(out_dir)
    c = json.loads((out / "config.json").read_text())
    from safetensors.torch import load_file

    hf = load_file(str(out / "model.safetensors"))
    cfg = GPTConfig(vocab_size=c["vocab_size"], n_layer=c["num_hidden_layers"], n_head=c["num_attention_heads"],
                    d_model=c["hidden_size"], seq_len=c["max_position_embeddings"], rope_theta=c["rope_theta"],
                    tie_embeddings=c.get("tie_word_embeddings", True))
    if cfg.mlp_hidden != c["intermediate_size"]:
        raise ValueError("intermediate_size does not match the GPT's mlp_ratio rounding")
    model = GPT(cfg)
    model.load_state_dict(from_hf_state_dict(hf, cfg.n_layer))
    return model.eval()


def _table(rows: list[tuple]) -> str:
    head, *body = rows
    lines = ["| " + " | ".join(map(str, head)) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join("" if v is None else str(v) for v in r) + " |" for r in body]
    return "\n".join(lines)


def model_card(model, meta: dict, cfg, report: dict | None, fmt: str) -> str:
    mc = model.cfg
    name = cfg.deploy.model_name if cfg is not None else (meta.get("run_name") or "crucible-gpt")
    licences = sorted({s.licence for s in cfg.sources}) if cfg is not None else []
    front = ["---", "library_name: transformers", "pipeline_tag: text-generation", "tags: [crucible, llama, causal-lm]"]
    front += [f"license: other", f"license_name: \"{' + '.join(licences) or 'unknown'}\""]
    front.append("---")
    parts = ["\n".join(front), f"# {name}",
             f"A {model.num_params() / 1e6:.2f}M-parameter decoder-only language model trained from scratch by the "
             f"Crucible pre-training pipeline (run `{meta.get('run_name')}`, step {meta.get('step')}). "
             f"Architecture: Llama-style ({mc.n_layer} layers, {mc.n_head} heads, d_model {mc.d_model}, "
             f"context {mc.seq_len} tokens, vocabulary {mc.vocab_size}, RMSNorm, RoPE θ={mc.rope_theta:g}, "
             f"SwiGLU, tied embeddings). Weights: {fmt}."]
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
