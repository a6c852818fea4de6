"""Trust boundaries (issue 16): nothing found in run storage is unpickled before it is verified.

DCP reads a checkpoint's `.metadata` with pickle. A checkpoint whose `.metadata` was replaced by a
pickle that writes a marker file, either in place of a real checkpoint's or as a copy placed beside
a run's real checkpoints, must be refused by every entry point that loads checkpoints, and the
marker must never be written."""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from fastapi.testclient import TestClient


class _WritesMarker:
    """Unpickling this creates the file `path`: what an attacker's .metadata would do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (Path(self.path),))


@pytest.fixture(scope="module")
def poisoned(run, base, tmp_path_factory):
    """A copy of the session's training run in which step 20's .metadata is a marker-writing pickle
    (`tampered`), plus a poisoned copy of step 20 placed beside the run's checkpoints (`planted`)."""
    from lm_helpers import tokenizer_artifact, tokens_artifact

    root = tmp_path_factory.mktemp("poisoned")
    train = root / "run" / "train"
    shutil.copytree(Path(run["checkpoints"][-1]).parent.parent, train)
    marker = root / "PWNED"
    payload = pickle.dumps(_WritesMarker(str(marker)))
    ckpts = train / "checkpoints"
    tampered = ckpts / "step-000020"
    planted = ckpts / "step-000099"
    shutil.copytree(tampered, planted)
    for d in (tampered, planted):
        (d / ".metadata").write_bytes(payload)
    return {"tampered": tampered, "planted": planted, "good": ckpts / "step-000010", "marker": marker,
            "train": train, "tokenizer": Path(tokenizer_artifact(base)["path"]),
            "tokens_index": Path(tokens_artifact(base)["index_path"]), "root": root}


def _refused(fn, p: dict) -> str:
    from tasks.train.checkpoint import UnverifiedCheckpoint

    with pytest.raises(UnverifiedCheckpoint) as e:
        fn()
    assert not p["marker"].exists(), "the pickle ran"
    return str(e.value)


def test_every_checkpoint_loader_refuses_a_poisoned_checkpoint(poisoned):
    import torch

    from lm_helpers import tiny_cfg
    from tasks.deploy.export import export_hf
    from tasks.deploy.generation import TextGenerator
    from tasks.deploy.registry import export_for_inference
    from tasks.evaluate import evaluate_checkpoint
    from tasks.evaluate.scoring import LMScorer
    from tasks.train.checkpoint import (init_from_checkpoint, latest_checkpoint, load_checkpoint,
                                        load_model_for_inference, read_meta)
    from tasks.train.model import GPT, GPTConfig

    p = poisoned
    tok = p["tokenizer"]
    for ckpt in (p["tampered"], p["planted"]):
        why = _refused(lambda: load_model_for_inference(ckpt), p)
        assert ("not listed in its run's checkpoint manifest" in why) == (ckpt == p["planted"])
        _refused(lambda: TextGenerator.from_files(ckpt, tok), p)  # model server start and reload
        _refused(lambda: LMScorer.from_files(ckpt, tok), p)  # the yardstick gate
        _refused(lambda: evaluate_checkpoint(tiny_cfg(), ckpt, tok, p["tokens_index"],  # (triggered) evaluation
                                             p["root"] / "eval.json"), p)
        _refused(lambda: export_for_inference(ckpt, p["root"] / "export"), p)  # registration
        _refused(lambda: export_hf(ckpt, tok, p["root"] / "hf"), p)
        model = GPT(GPTConfig(**read_meta(p["good"])["model"]))
        opt = torch.optim.AdamW(model.parameters())
        _refused(lambda: load_checkpoint(model, opt, ckpt), p)  # resume, rollback
        _refused(lambda: init_from_checkpoint(model, opt, ckpt, "0" * 64), p)  # continued pretraining
    # resuming skips both and takes the newest checkpoint that verifies
    assert latest_checkpoint(p["train"]) == p["good"]
    load_model_for_inference(p["good"])  # the real one still loads
    assert not p["marker"].exists()


def test_the_model_server_reload_refuses_a_poisoned_checkpoint(poisoned):
    from infra.services.model_server.server import create_app
    from tasks.deploy.generation import TextGenerator

    p = poisoned
    # as if a registry entry pointed at the poisoned directories (the server never takes a path)
    registry = {2: p["tampered"], 3: p["planted"]}
    client = TestClient(create_app(TextGenerator.from_files(p["good"], p["tokenizer"]), "m", admin_key="adm1n",
                                   resolve_version=lambda v, a: (str(registry[v]), str(p["tokenizer"]), None, v)))
    for version in registry:
        r = client.post("/v1/admin/reload", json={"version": version}, headers={"Authorization": "Bearer adm1n"})
        assert r.status_code == 400 and "does not verify" in r.json()["error"]["message"], r.text
        assert not p["marker"].exists()
    r = client.post("/v1/admin/reload", json={"checkpoint": str(p["tampered"])}, headers={"Authorization": "Bearer adm1n"})
    assert r.status_code == 400 and not p["marker"].exists()
    assert client.get("/health").json()["step"] == 10  # still the verified model


def test_a_registered_copy_is_verified_before_it_is_loaded(poisoned, tmp_path):
    """The registered pyfunc checks its checkpoint's tree hash (recorded at registration) first."""
    import mlflow.pyfunc
    from mlflow import MlflowClient

    from tasks.deploy.registry import register

    p = poisoned
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = MlflowClient(tracking_uri=uri).create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    run_id = MlflowClient(tracking_uri=uri).create_run(exp).info.run_id
    reg = register(uri, "trust", p["good"], p["tokenizer"], {"val_loss": 5.0, "step": 10}, run_id)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=reg["source"], dst_path=str(tmp_path / "dl"),
                                                     tracking_uri=uri))
    assert mlflow.pyfunc.load_model(str(local)).predict(["The"], params={"max_tokens": 1}) is not None
    (next(local.rglob("checkpoint")) / ".metadata").write_bytes(pickle.dumps(_WritesMarker(str(p["marker"]))))
    with pytest.raises(Exception, match="does not verify"):
        mlflow.pyfunc.load_model(str(local))
    assert not p["marker"].exists()


def test_stored_job_results_are_json_and_a_pickle_is_never_loaded(tmp_path):
    """Resumable stages keep finished jobs' results as JSON; a pickle put in their place is not run."""
    from tasks.core.resume import JOB_SUFFIX, JobStore

    store = JobStore(tmp_path)
    part = tmp_path / "part-0.parquet"
    part.write_bytes(b"rows")
    store.save("job-0", "key", {"parts": [str(part)], "docs": 3})
    assert json.loads((tmp_path / f"job-0{JOB_SUFFIX}").read_text())["result"]["docs"] == 3
    assert store.load("job-0", "key") == {"parts": [str(part)], "docs": 3}
    marker = tmp_path / "PWNED"
    (tmp_path / f"job-1{JOB_SUFFIX}").write_bytes(pickle.dumps(_WritesMarker(str(marker))))
    (tmp_path / "job-1.pkl").write_bytes(pickle.dumps(_WritesMarker(str(marker))))  # the old format
    assert store.load("job-1", "key") is None and not marker.exists()
