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


def test_a_checkpoint_on_a_store_is_evaluated_where_it_lives(base, run, tmp_path):
    """An object-store run's checkpoint, tokenizer and token index, evaluated by their URIs: the same
    report as from local files, the checkpoint verified against the run's signed manifest on the
    store, the val split read and checked against its recorded sha256, the train split never read."""
    from s3_helpers import moto_s3
    from tasks.train.checkpoint import UnverifiedCheckpoint

    ckpt = Path(run["checkpoints"][-1])
    index = Path(tokens_artifact(base)["index_path"])
    local = _eval(base, run, ckpt, tmp_path / "local.json")
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        def put(path: Path, key: str) -> None:
            s3.client.upload_file(str(path), "runs", f"r1/{key}")

        for p in ckpt.parent.rglob("*"):  # the checkpoints folder: its manifest and the checkpoints
            if p.is_file():
                put(p, f"train/checkpoints/{p.relative_to(ckpt.parent).as_posix()}")
        put(Path(tokenizer_artifact(base)["path"]), "tokenizer/tokenizer.json")
        split = json.loads(index.read_text())["splits"]
        for p in index.parent.iterdir():
            if p.is_file() and p.name != Path(split["train"]["path"]).name:  # the train split stays local
                put(p, f"tokens/{p.name}")
        cfg = tiny_cfg(storage={"options": s3.options, "cache_dir": str(tmp_path / "cache")})
        uris = {k: f"s3://runs/r1/{k}" for k in ("tokenizer/tokenizer.json", "tokens/index.json")}
        ckpt_uri = f"s3://runs/r1/train/checkpoints/{ckpt.name}"
        got = evaluate_checkpoint(cfg, ckpt_uri, uris["tokenizer/tokenizer.json"], uris["tokens/index.json"],
                                  tmp_path / "store.json")
        assert got["checkpoint"] == ckpt_uri and got["checkpoint_sha256"] == local["checkpoint_sha256"]
        assert (got["val_loss"], got["samples"], got["task_metrics"]) == \
            (local["val_loss"], local["samples"], local["task_metrics"])
        assert not (tmp_path / "cache").exists()  # no working copy, no cache: read where it lives

        val_key = f"r1/tokens/{Path(split['val']['path']).name}"
        body = s3.client.get_object(Bucket="runs", Key=val_key)["Body"].read()
        s3.client.put_object(Bucket="runs", Key=val_key, Body=bytes(reversed(body)))
        with pytest.raises(ValueError, match="sha256 its token index .*records"):
            evaluate_checkpoint(cfg, ckpt_uri, uris["tokenizer/tokenizer.json"], uris["tokens/index.json"],
                                tmp_path / "x.json")
        s3.client.put_object(Bucket="runs", Key=f"r1/train/checkpoints/{ckpt.name}/extra.bin", Body=b"x")
        with pytest.raises(UnverifiedCheckpoint):
            evaluate_checkpoint(cfg, ckpt_uri, uris["tokenizer/tokenizer.json"], uris["tokens/index.json"],
                                tmp_path / "y.json")


def test_the_report_attests_the_bytes_it_scored(base, run, tmp_path, monkeypatch):
    """Attack: a run-folder writer swaps in another checkpoint's files right after the verified copy
    was loaded. The signed report must record the hash of what was scored (the verified copy), not
    of whatever the folder holds when the report is written."""
    import shutil

    from tasks.core import fs
    from tasks.train import checkpoint

    folder = tmp_path / "r" / "train" / "checkpoints"
    shutil.copytree(Path(run["checkpoints"][-1]).parent, folder)
    scored, other = folder / Path(run["checkpoints"][-1]).name, folder / Path(run["checkpoints"][0]).name
    genuine = fs.tree_sha256(scored)
    real_load, swaps = checkpoint._dcp_load, []

    def load_then_swap(*a, **kw):
        real_load(*a, **kw)
        if not swaps:  # the swap: rename another checkpoint's files into place
            staged = scored.with_name(".swap")
            shutil.copytree(other, staged)
            shutil.rmtree(scored)
            staged.rename(scored)
            swaps.append(True)

    monkeypatch.setattr(checkpoint, "_dcp_load", load_then_swap)
    rep = _eval(base, run, scored, tmp_path / "rep.json")
    assert swaps and fs.tree_sha256(scored) != genuine  # the swap happened
    assert rep["checkpoint_sha256"] == genuine and rep["step"] == 20


def test_the_tokenizer_checked_is_the_tokenizer_loaded(base, run, tmp_path, monkeypatch):
    """Attack: the tokenizer file is another one while it is loaded and the genuine one again when it
    is hashed. Read once: the bytes hashed against the checkpoint's tokenizer_sha256 are the bytes parsed."""
    import shutil

    from tasks.tokenizer import bpe

    tok = tmp_path / "tokenizer.json"
    genuine = Path(tokenizer_artifact(base)["path"]).read_bytes()
    tok.write_bytes(genuine + b"\n")  # parses the same, other bytes: not the checkpoint's tokenizer
    real, loads = bpe.Tokenizer, []

    def swap_back_after(load):  # the attacker puts the genuine file back once it was parsed
        def loaded(arg):
            loads.append(arg)
            out = load(arg)
            tok.write_bytes(genuine)
            return out
        return staticmethod(loaded)

    class SwapBackAfterLoad:
        from_file = swap_back_after(real.from_file)
        from_str = swap_back_after(real.from_str)

    monkeypatch.setattr(bpe, "Tokenizer", SwapBackAfterLoad)
    with pytest.raises(ValueError, match="not the one"):
        evaluate_checkpoint(tiny_cfg(), Path(run["checkpoints"][-1]), tok, Path(tokens_artifact(base)["index_path"]),
                            tmp_path / "x.json")
    assert not loads  # refused on the bytes read, before anything parsed them (a load + re-hash swapped back)


def _rewrite_val(folder: Path, put) -> bytes:
    """The attack on a token index: other val tokens, and the index's recorded val sha256 rewritten to
    match them (`put(name, bytes)` writes a file of the index's folder). Returns the new val bytes."""
    import hashlib

    index = json.loads((folder / "index.json").read_text())
    val_name = Path(index["splits"]["val"]["path"]).name
    forged = bytes(reversed((folder / val_name).read_bytes()))
    index["splits"]["val"]["sha256"] = hashlib.sha256(forged).hexdigest()
    put(val_name, forged)
    put("index.json", json.dumps(index, indent=2).encode())
    return forged


def test_a_token_index_rewritten_to_match_other_val_tokens_is_refused(base, tmp_path):
    """Attack: a writer of the store (or of the run folder) swaps the val split and rewrites the token
    index's recorded sha256 to match. Checking the split against the index's own hash accepts that (the
    evaluation then scores the attacker's tokens, and deploy gates on that val_loss); the index is
    signed by the stack, so a rewritten one is refused, locally and on the store."""
    import shutil

    from s3_helpers import moto_s3
    from tasks.core.signing import SignatureError
    from tasks.evaluate.evaluate import val_tokens

    genuine = Path(tokens_artifact(base)["index_path"]).parent
    local = tmp_path / "tokens"
    shutil.copytree(genuine, local)
    index, val = val_tokens(local / "index.json")  # the genuine index, as the tokens stage signed it
    assert len(val) == index["splits"]["val"]["tokens"] > 0
    val = val.tobytes()
    _rewrite_val(local, lambda name, data: (local / name).write_bytes(data))
    with pytest.raises(SignatureError, match="does not verify"):
        val_tokens(local / "index.json")

    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        for p in genuine.iterdir():
            s3.client.upload_file(str(p), "runs", f"r1/tokens/{p.name}")
        uri = "s3://runs/r1/tokens/index.json"
        assert val_tokens(uri, s3.options)[1].tobytes() == val
        _rewrite_val(genuine, lambda name, data: s3.client.put_object(Bucket="runs", Key=f"r1/tokens/{name}",
                                                                       Body=data))
        with pytest.raises(SignatureError, match="does not verify"):
            val_tokens(uri, s3.options)
