"""Evaluation of a trained checkpoint: val loss, perplexity, samples, report."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from lm_helpers import tiny_cfg, tokenizer_artifact, tokens_artifact
from tasks.evaluate import evaluate_checkpoint, val_window_starts
from tasks.evaluate.evaluate import read_report


def _eval(base, run, ckpt, out, **kw):
    return evaluate_checkpoint(tiny_cfg(), Path(ckpt), Path(tokenizer_artifact(base)["path"]),
                               Path(tokens_artifact(base)["index_path"]), out, **kw)


def test_report(base, run, tmp_path):
    cfg = tiny_cfg()
    rep = _eval(base, run, run["checkpoints"][-1], tmp_path / "eval" / "report.json")
    assert rep["step"] == 20
    assert rep["checkpoint"] == run["checkpoints"][-1]
    assert math.isfinite(rep["val_loss"]) and rep["val_loss"] < math.log(512) - 0.3  # learned something
    assert rep["perplexity"] == pytest.approx(math.exp(rep["val_loss"]), rel=1e-4)
    assert rep["val_tokens"] == cfg.evaluate.max_val_batches * cfg.evaluate.batch_size * cfg.model.seq_len
    assert [s["prompt"] for s in rep["samples"]] == cfg.evaluate.prompts
    assert all(isinstance(s["completion"], str) and s["completion"] for s in rep["samples"])
    on_disk = json.loads(Path(rep["report_path"]).read_text())  # readable JSON; the signature is one more field
    assert on_disk["signature"].startswith("hmac-sha256:")
    assert read_report(rep["report_path"]) == {k: v for k, v in rep.items() if k != "seconds"}


def test_deterministic_and_improves_with_training(base, run, tmp_path):
    a = _eval(base, run, run["checkpoints"][-1], tmp_path / "a.json")
    b = _eval(base, run, run["checkpoints"][-1], tmp_path / "b.json")
    assert a["val_loss"] == b["val_loss"] and a["samples"] == b["samples"]
    early = _eval(base, run, run["checkpoints"][0], tmp_path / "early.json")
    assert early["step"] == 10 and a["val_loss"] < early["val_loss"]


def test_logs_to_mlflow(base, run, tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    ml = run["mlflow"]
    rep = _eval(base, run, run["checkpoints"][-1], tmp_path / "r.json",
                tracking_uri=ml["tracking_uri"], run_id=ml["run_id"])
    hist = MlflowClient(tracking_uri=ml["tracking_uri"]).get_metric_history(ml["run_id"], "val_loss")
    assert [(m.step, m.value) for m in hist] == [(20, rep["val_loss"])]


def test_wrong_tokenizer_rejected(base, run, tmp_path):
    from tasks.tokenizer import train_tokenizer
    from lm_helpers import corpus_shards

    other = train_tokenizer(tiny_cfg(tokenizer={"vocab_size": 400}), corpus_shards(base)[:1], tmp_path / "tok")
    with pytest.raises(ValueError, match="not the one"):
        evaluate_checkpoint(tiny_cfg(), Path(run["checkpoints"][-1]), Path(other["path"]),
                            Path(tokens_artifact(base)["index_path"]), tmp_path / "x.json")


def test_val_window_starts():
    assert val_window_starts(100, 10, 50).tolist() == list(range(0, 100, 10))
    s = val_window_starts(1000, 10, 7)
    assert len(s) == 7 and s[0] == 0 and s[-1] == 990 and np.all(np.diff(s) >= 10)
    assert val_window_starts(5, 10, 3).size == 0


def test_sample_independent_of_other_prompts(base, run, tmp_path):
    cfg = tiny_cfg(evaluate={"prompts": ["Alice was"]})
    alone = evaluate_checkpoint(cfg, Path(run["checkpoints"][-1]), Path(tokenizer_artifact(base)["path"]),
                                Path(tokens_artifact(base)["index_path"]), tmp_path / "alone.json")
    both = _eval(base, run, run["checkpoints"][-1], tmp_path / "both.json")
    assert alone["samples"][0] == both["samples"][1]
