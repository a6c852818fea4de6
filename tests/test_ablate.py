"""The curation ablation on a reduced budget: both arms are built by the pipeline's own stages from
one ingest, trained with the same token budget, and scored on the same held-out WikiText-2 tokens."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from tasks.config import DATA_ROOT_ENV, DEFAULT_DATA_ROOT, PipelineConfig, load_config

REPO = Path(__file__).resolve().parent.parent
DATA = Path(os.environ.get(DATA_ROOT_ENV) or DEFAULT_DATA_ROOT)
pytestmark = pytest.mark.skipif(not (DATA / "eval" / "wikitext-2" / "valid.txt").exists(),
                                reason=f"no data under {DATA}")


def _small_config(tmp: Path) -> PipelineConfig:
    """configs/tiny.yaml with JSONL sources only (no HTML extraction), a very small model and budget."""
    cfg = load_config(REPO / "configs" / "tiny.yaml", [
        f"run_root={tmp / 'runs'}", "model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.seq_len=32",
        "train.max_steps=6", "train.nproc_per_node=1", "train.micro_batch_size=4", "train.checkpoint_every=6",
        "train.warmup_steps=1", "tokenizer.vocab_size=400", "curate.decontam.enabled=false",
        "quality.classifier.max_docs_per_class=200", "quality.classifier.positives=[text/gutenberg/*.txt]",
        "quality.kenlm.max_docs=200", "quality.kenlm.reference=[text/gutenberg/*.txt]",
        "ablate.eval_max_tokens=3000", "evaluate.threads=1"])
    cfg.sources = [s for s in cfg.sources if s.format == "jsonl"]
    return PipelineConfig.model_validate(cfg.model_dump())


def test_langid_only_arm_switches_off_everything_but_langid():
    from tasks.ablate import langid_only
    from tasks.curate.filters import filter_names

    cfg = load_config(REPO / "configs" / "tiny.yaml")
    a = langid_only(cfg)
    assert filter_names(a.curate) == ["langid"]
    assert not a.curate.dedup.exact and not a.curate.dedup.minhash.enabled and not a.quality.enabled
    assert not a.curate.dedup.url.enabled and not a.curate.dedup.lines.enabled
    assert cfg.quality.enabled and len(filter_names(cfg.curate)) > 1  # the original is untouched
    assert a.train == cfg.train and a.model == cfg.model and a.tokens == cfg.tokens


def test_ablation_same_budget_same_eval_tokens(tmp_path):
    from mlflow.tracking import MlflowClient

    from tasks.ablate import ablation_markdown, run_ablation

    cfg = _small_config(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    r = run_ablation(cfg, tmp_path / "ablate", uri)

    a, b = r["arms"]["langid_only"], r["arms"]["curated"]
    # (b) is a strict curation of (a): fewer documents, quality stage on
    assert 0 < b["corpus"]["docs"] < a["corpus"]["docs"]
    for arm in (a, b):  # per-source composition adds up to the corpus
        assert sum(v["docs"] for v in arm["corpus"]["by_source"].values()) == arm["corpus"]["docs"]
        assert sum(v["bytes"] for v in arm["corpus"]["by_source"].values()) == arm["corpus"]["bytes"]
    assert set(b["corpus"]["by_source"]) <= set(a["corpus"]["by_source"])
    assert not a["quality"]["enabled"] and b["quality"]["enabled"]
    assert set(a["curate"]["dropped"]) and all(k.startswith("langid") for k in a["curate"]["dropped"])
    # same token budget, same held-out tokens
    assert a["tokens_trained"] == b["tokens_trained"] == r["token_budget"]["tokens"] == 6 * 4 * 32
    assert a["steps"] == b["steps"] == 6
    assert a["eval_tokens_scored"] == b["eval_tokens_scored"] > 2000
    assert r["eval"]["tokens"] == 3000 and r["eval"]["path"].endswith("wikitext-2/valid.txt")
    la, lb = r["heldout_loss"]["langid_only"], r["heldout_loss"]["curated"]
    assert math.isfinite(la) and math.isfinite(lb) and la > 0 and lb > 0
    assert r["relative_improvement"] == pytest.approx((la - lb) / la, abs=1e-5)
    assert json.loads((tmp_path / "ablate" / "ablation.json").read_text())["heldout_loss"] == r["heldout_loss"]
    md = ablation_markdown(r)
    assert "langid_only" in md and "curated" in md and "## Composition" in md

    # MLflow: the parent run has both losses side by side; one child run per arm
    client = MlflowClient(tracking_uri=uri)
    parent = client.get_run(r["mlflow"]["parent_run_id"])
    assert parent.data.metrics["heldout_loss_langid_only"] == pytest.approx(la)
    assert parent.data.metrics["heldout_loss_curated"] == pytest.approx(lb)
    for arm in ("langid_only", "curated"):
        child = client.get_run(r["arms"][arm]["mlflow_run_id"])
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.tags["crucible.ablation_arm"] == arm
        assert child.data.metrics["heldout_loss"] == pytest.approx(r["heldout_loss"][arm])
        assert "grad_norm" in child.data.metrics  # the training curve from the torchrun worker
