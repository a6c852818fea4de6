"""Does curation help the model? Train the same model on two corpora, score both on clean text.

Arms, both built by the pipeline's own stage functions from one ingest of the configured sources:

  (a) langid_only   `run_curate` with every step but language ID switched off (no heuristic
                    filters, decontamination, PII redaction or dedup) and no quality stage
  (b) curated       `run_curate` with the config as given, then `run_quality` (the fully curated
                    corpus the pretrain flow trains on)

One BPE tokenizer (`train_tokenizer`) is trained on the (b) corpus and used by both arms, so both
models are scored on the very same held-out token ids. Each arm is encoded (`prepare_tokens`),
trained under torchrun (`run_training`) with the same model, optimiser, seed and number of steps
of the same global batch — the same token budget, whatever the size of its corpus (a smaller
corpus is repeated over more epochs) — and its final checkpoint scored (`val_loss`, the pipeline's
evaluation function) on the held-out text: WikiText-2 validation by default
(`ablate.eval_path`), cut into articles, detokenised as lm-eval does, each article followed by
EOS.

MLflow: a parent run (`ablation`, or the run given) with one child run per arm (training curves
from the torchrun worker, held-out loss); the parent has both losses and the relative
improvement side by side. The result JSON (`out_dir/ablation.json`) has the same.
"""
from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import numpy as np

from tasks.config import PipelineConfig
from tasks.plan.for_run import global_batch_tokens

ARMS = ("langid_only", "curated")


def langid_only(cfg: PipelineConfig) -> PipelineConfig:
    """The config of arm (a): curation reduced to language ID, no quality stage."""
    c = cfg.model_copy(deep=True)
    cur = c.curate
    for section in (cur.gopher_quality, cur.gopher_repetition, cur.c4, cur.fineweb, cur.decontam, cur.pii):
        section.enabled = False
    cur.langid.enabled = True
    cur.dedup.exact = False
    cur.dedup.minhash.enabled = False
    cur.dedup.url.enabled = False
    cur.dedup.lines.enabled = False
    c.quality.classifier.enabled = False
    c.quality.kenlm.enabled = False
    # type(cfg): a config with the stack's sections (infra.settings.CrucibleConfig) keeps them
    return type(cfg).model_validate(c.model_dump())


def eval_tokens(cfg: PipelineConfig, tokenizer_path: Path) -> np.ndarray:
    """The held-out text as one token array: each article encoded, followed by EOS."""
    from tasks.evaluate.suite import load_wikitext_pages, wikitext_detokenizer
    from tasks.tokenizer.bpe import load_tokenizer

    a = cfg.ablate
    path = Path(cfg.resolve_uri(a.eval_path))
    if not path.is_file():
        raise FileNotFoundError(f"ablate.eval_path {path} does not exist")
    tok = load_tokenizer(tokenizer_path)
    eos = tok.token_to_id(cfg.tokenizer.eos_token)
    pages = load_wikitext_pages(path)
    if a.detokenize:
        pages = [wikitext_detokenizer(p) for p in pages]
    ids: list[int] = []
    for enc in tok.encode_batch(pages, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
        if a.eval_max_tokens and len(ids) >= a.eval_max_tokens:
            break
    arr = np.asarray(ids[:a.eval_max_tokens] if a.eval_max_tokens else ids, dtype=np.int64)
    return arr


def heldout_loss(cfg: PipelineConfig, checkpoint: Path, tokens: np.ndarray) -> tuple[float, int]:
    import torch

    from tasks.evaluate.evaluate import val_loss
    from tasks.train.checkpoint import load_model_for_inference

    prev = torch.get_num_threads()
    torch.set_num_threads(cfg.evaluate.threads or prev)
    try:
        model, _ = load_model_for_inference(Path(checkpoint))
        windows = math.ceil(len(tokens) / (model.cfg.seq_len + 1))
        batches = math.ceil(windows / cfg.ablate.eval_batch_size)
        return val_loss(model, tokens, model.cfg.seq_len, cfg.ablate.eval_batch_size, batches)
    finally:
        torch.set_num_threads(prev)


def corpus_stats(shards: list[str]) -> dict:
    """Documents and bytes of an arm's corpus, in all and per source: what curation kept of each
    source explains most of a held-out difference (the mix moves towards or away from the
    held-out text's domain)."""
    from tasks.core.documents import iter_docs

    docs = nbytes = 0
    by_source: dict[str, dict[str, int]] = {}
    for d in iter_docs(shards, columns=["text", "source"]):
        n = len(d["text"].encode("utf-8"))
        docs += 1
        nbytes += n
        src = by_source.setdefault(d.get("source") or "?", {"docs": 0, "bytes": 0})
        src["docs"] += 1
        src["bytes"] += n
    return {"docs": docs, "bytes": nbytes, "by_source": dict(sorted(by_source.items()))}


def run_ablation(cfg: PipelineConfig, out_dir: Path, tracking_uri: str, experiment: str | None = None,
                 parent_run_id: str | None = None, run_name: str = "ablation") -> dict:
    """Run both arms (see module doc); returns the result dict, also written to out_dir/ablation.json."""
    from tasks.curate import run_curate
    from tasks.ingest import run_ingest
    from tasks.quality.run import run_quality
    from tasks.tokenizer import train_tokenizer
    from tasks.tokens import prepare_tokens
    from tasks.tracking import Tracker
    from tasks.train import run_training

    t0 = time.perf_counter()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(tracking_uri, experiment or cfg.name)
    own_parent = parent_run_id is None
    parent = parent_run_id or tracker.start_run(run_name, tags={"crucible.stage": "ablate"})
    try:
        ingested = run_ingest(cfg, out_dir / "ingest")
        configs = {"langid_only": langid_only(cfg), "curated": cfg}
        arms: dict[str, dict] = {}
        for arm, acfg in configs.items():
            curated = run_curate(acfg, [Path(p) for p in ingested["shards"]], out_dir / arm / "curate")
            quality = run_quality(acfg, [Path(p) for p in curated["shards"]], out_dir / arm / "quality")
            arms[arm] = {"curate": {k: curated[k] for k in ("docs_in", "docs_out", "dropped")},
                         "quality": {k: quality[k] for k in ("enabled", "docs_in", "docs_out", "dropped")},
                         "shards": quality["shards"]}
            arms[arm]["corpus"] = corpus_stats(quality["shards"])
        # one tokenizer, trained on the curated corpus, for both arms: same held-out token ids
        tok = train_tokenizer(cfg, [Path(p) for p in arms["curated"]["shards"]], out_dir / "tokenizer")
        tokenizer_path = Path(tok["path"])
        held = eval_tokens(cfg, tokenizer_path)
        held_sha = hashlib.sha256(held.astype("<i8").tobytes()).hexdigest()
        budget_steps, per_step = cfg.train.max_steps, global_batch_tokens(cfg)
        for arm, acfg in configs.items():
            a = arms[arm]
            tokens = prepare_tokens(acfg, tokenizer_path, [Path(p) for p in a["shards"]], out_dir / arm / "tokens")
            child = tracker.start_run(f"{run_name}-{arm}", parent_run_id=parent,
                                      tags={"crucible.stage": "ablate", "crucible.ablation_arm": arm})
            try:
                trained = run_training(acfg, Path(tokens["index_path"]), out_dir / arm / "train", tracking_uri,
                                       child, f"{run_name}-{arm}")
                loss, n_scored = heldout_loss(acfg, Path(trained["checkpoints"][-1]), held)
            except BaseException:
                tracker.end_run(child, "FAILED")
                raise
            train_tokens = tokens["splits"]["train"]["tokens"]
            a.update({
                "train_tokens_available": train_tokens,
                "tokens_trained": trained["steps"] * per_step,
                "epochs": round(trained["steps"] * per_step / max(1, train_tokens), 3),
                "steps": trained["steps"], "final_train_loss": trained["final_loss"],
                "checkpoint": trained["checkpoints"][-1],
                "heldout_loss": round(loss, 6), "heldout_perplexity": round(math.exp(loss), 4),
                "eval_tokens_scored": n_scored, "mlflow_run_id": child,
            })
            tracker.log_metrics(child, {"heldout_loss": loss, "heldout_perplexity": math.exp(loss),
                                        "corpus_docs": a["corpus"]["docs"], "corpus_bytes": a["corpus"]["bytes"],
                                        "train_tokens_available": train_tokens, "epochs": a["epochs"]})
            tracker.end_run(child)
        la, lb = arms["langid_only"]["heldout_loss"], arms["curated"]["heldout_loss"]
        result = {
            "arms": arms,
            "token_budget": {"steps": budget_steps, "tokens_per_step": per_step,
                             "tokens": budget_steps * per_step},
            "tokenizer": {"path": str(tokenizer_path), "trained_on": "curated", "vocab_size": cfg.tokenizer.vocab_size},
            "eval": {"path": str(Path(cfg.resolve_uri(cfg.ablate.eval_path))), "detokenize": cfg.ablate.detokenize,
                     "tokens": int(len(held)), "sha256": held_sha},
            "heldout_loss": {"langid_only": la, "curated": lb},
            "relative_improvement": round((la - lb) / la, 6),
            "target_improvement": cfg.ablate.target_improvement,
            "mlflow": {"tracking_uri": tracking_uri, "parent_run_id": parent},
        }
        result["meets_target"] = result["relative_improvement"] >= cfg.ablate.target_improvement
        result["seconds"] = round(time.perf_counter() - t0, 3)
        tracker.log_metrics(parent, {"heldout_loss_langid_only": la, "heldout_loss_curated": lb,
                                     "relative_improvement": result["relative_improvement"],
                                     "token_budget": budget_steps * per_step, "eval_tokens": len(held)})
        tracker.log_dict(parent, result, "ablation.json")
        (out_dir / "ablation.json").write_text(json.dumps(result, indent=2) + "\n")
    except BaseException:
        if own_parent:
            tracker.end_run(parent, "FAILED")
        raise
    if own_parent:
        tracker.end_run(parent)
    return result


def ablation_markdown(result: dict) -> str:
    rows = []
    for arm in ARMS:
        a = result["arms"][arm]
        rows.append(f"| {arm} | {a['corpus']['docs']} | {a['corpus']['bytes']:,} | {a['train_tokens_available']:,} | "
                    f"{a['tokens_trained']:,} | {a['epochs']} | {a['final_train_loss']:.4f} | "
                    f"**{a['heldout_loss']:.4f}** | {a['heldout_perplexity']:.1f} |")
    e = result["eval"]
    return ("# Curation ablation\n\n"
            "| arm | docs | bytes | train tokens | tokens trained | epochs | final train loss | held-out loss | "
            "held-out ppl |\n|---|---|---|---|---|---|---|---|---|\n" + "\n".join(rows) +
            f"\n\nHeld-out text: {e['path']} ({e['tokens']:,} tokens, sha256 {e['sha256'][:12]}), one tokenizer "
            f"trained on the curated corpus. Relative improvement of (b) over (a): "
            f"**{100 * result['relative_improvement']:.2f} %** (target ≥ {100 * result['target_improvement']:.0f} %).\n"
            + _composition_markdown(result))


def _composition_markdown(result: dict) -> str:
    """Share of each source in each arm's corpus (bytes)."""
    arms = {arm: result["arms"][arm]["corpus"] for arm in ARMS}
    sources = sorted({s for c in arms.values() for s in c.get("by_source", {})})
    if not sources:
        return ""
    rows = []
    for s in sources:
        cells = []
        for c in arms.values():
            b = c.get("by_source", {}).get(s, {"docs": 0, "bytes": 0})
            cells.append(f"{b['docs']} docs, {100 * b['bytes'] / max(1, c['bytes']):.1f} %")
        rows.append(f"| {s} | " + " | ".join(cells) + " |")
    return ("\n## Composition (documents, share of bytes)\n\n| source | " + " | ".join(ARMS) + " |\n|---|"
            + "---|" * len(ARMS) + "\n" + "\n".join(rows) + "\n")
