"""A signed token index is tied to the run that trained on it. Attack: run A's genuine signed index.json
(with its val split and document starts) copied into run B's tokens/ verifies (the stack signed it), so
B's checkpoints would be evaluated and yardstick-scored on A's held-out set, and registered as trained
on A's index. The trainer records the sha256 of the index bytes it read in each checkpoint's signed meta
(tokens_index_sha256, and its val split's tokens_val_sha256); evaluation, the yardstick and deploy's
lineage tags hold the index to it as well as to the signature. A checkpoint from before the trainer
recorded it is held to the signature only."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest


@pytest.fixture
def runs(base, tmp_path):
    """Run B (the session's tokens, and a checkpoint whose signed meta records their index as the trainer
    does: tests/test_train.py checks the trainer writes it) and run A's tokens (another split seed: another
    held-out set), both indexes signed by the stack."""
    from lm_helpers import corpus_shards, random_checkpoint, tiny_cfg, tokenizer_artifact, tokens_artifact
    from tasks.core.hashing import sha256_file
    from tasks.tokens import prepare_tokens

    tok = Path(tokenizer_artifact(base)["path"])
    b = tmp_path / "B"
    shutil.copytree(Path(tokens_artifact(base)["index_path"]).parent, b / "tokens")
    index = b / "tokens" / "index.json"
    a = Path(prepare_tokens(tiny_cfg(tokens={"seed": 8}), tok, corpus_shards(base), tmp_path / "A" / "tokens")
             ["index_path"]).parent
    trained = {"tokens_index": str(index), "tokens_index_sha256": sha256_file(index),
               "tokens_val_sha256": json.loads(index.read_text())["splits"]["val"]["sha256"]}
    ckpt = random_checkpoint(b / "train", tok, 10, 1, meta_extra=trained)
    old = random_checkpoint(tmp_path / "old" / "train", tok, 10, 1)  # written before the trainer recorded it
    assert json.loads((a / "index.json").read_text())["splits"]["val"]["sha256"] != trained["tokens_val_sha256"]
    return {"tok": tok, "index": index, "a": a, "ckpt": ckpt, "old": old}


def _copy_run_a_in(runs) -> None:
    for p in runs["a"].iterdir():
        if p.is_file():
            shutil.copy(p, runs["index"].parent / p.name)


def test_evaluation_refuses_another_runs_signed_index(runs, tmp_path):
    from lm_helpers import tiny_cfg
    from tasks.evaluate.evaluate import TokensChanged, evaluate_checkpoint, val_tokens
    from tasks.train.checkpoint import read_meta

    _copy_run_a_in(runs)
    val_tokens(runs["index"])  # the copy is genuinely signed: the signature alone lets it through
    with pytest.raises(TokensChanged, match="trained"):
        evaluate_checkpoint(tiny_cfg(), runs["ckpt"], runs["tok"], runs["index"], tmp_path / "report.json")
    with pytest.raises(TokensChanged, match="trained"):
        val_tokens(runs["index"], trained=read_meta(runs["ckpt"]))
    # a checkpoint from before the trainer recorded the hash: held to the signature only, still evaluated
    assert len(val_tokens(runs["index"], trained=read_meta(runs["old"]))[1])


def test_yardstick_refuses_another_runs_held_out_set(runs):
    """The challenger's "new" part of the gate's set comes from the index it was trained from."""
    from tasks.deploy.yardstick import _held_out
    from tasks.evaluate.evaluate import TokensChanged
    from tasks.tokenizer.bpe import load_tokenizer
    from tasks.train.checkpoint import read_meta

    tok, meta = load_tokenizer(runs["tok"]), read_meta(runs["ckpt"])
    assert _held_out(runs["index"], tok, 4, 200, trained=meta)
    _copy_run_a_in(runs)
    with pytest.raises(TokensChanged, match="trained"):
        _held_out(runs["index"], tok, 4, 200, trained=meta)
    assert _held_out(runs["index"], tok, 4, 200, trained=read_meta(runs["old"]))
    # through the gate: against_champion hands build_yardstick the challenger's signed meta, so the set
    # is refused before anything is scored (without it the copied index would be scored as "new")
    from lm_helpers import tiny_cfg
    from tasks.deploy.yardstick import against_champion

    with pytest.raises(TokensChanged, match="trained"):
        against_champion(tiny_cfg(), "sqlite:///unused.db", {"checkpoint": str(runs["ckpt"])}, runs["tok"],
                         {"version": 1, "tags": {}}, out_dir=runs["index"].parent.parent / "gate")


def test_deploy_does_not_register_another_runs_index_as_trained_on(runs):
    from lm_helpers import tiny_cfg
    from tasks.core.hashing import sha256_file
    from tasks.deploy import lineage_tags
    from tasks.deploy.yardstick import UntrustedTokenIndex

    evaluation = {"checkpoint": str(runs["ckpt"]), "run_name": "test"}
    assert lineage_tags(tiny_cfg(), evaluation, runs["tok"])["data.tokens_index_sha256"] == sha256_file(runs["index"])
    _copy_run_a_in(runs)
    # refused as an untrusted index (deploy turns that into the gate's refusal)
    with pytest.raises(UntrustedTokenIndex, match="trained"):
        lineage_tags(tiny_cfg(), evaluation, runs["tok"])
