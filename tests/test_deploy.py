"""Deployment: the gate, the MLflow registry (SQLite store in tmp_path), the OpenAI-compatible
server (in process through TestClient, and as a real background process of the stack).

The model is a small randomly initialised GPT saved with tasks.train's own checkpoint code."""
from __future__ import annotations

import json
import math
import socket
import time
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from infra import stack
from infra.services.model_server.server import create_app
from infra.services.model_server.supervisor import serve_model, server_status, start_or_refresh_server, verify_model
from lm_helpers import random_checkpoint, sample_tokenizer
from infra.settings import CrucibleConfig, StackConfig
from tasks.config import DeployConfig, PipelineConfig
from tasks.core.net import free_port
from tasks.deploy import deploy_if_better, gate
from tasks.deploy.gate import read_gate_record
from tasks.deploy.generation import TextGenerator


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tok = sample_tokenizer(root / "tokenizer.json")
    return {"tokenizer": tok, "ckpt": random_checkpoint(root / "train", tok, 10, 0),
            "ckpt2": random_checkpoint(root / "train", tok, 20, 1), "root": root}


@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory):
    """One SQLite tracking/registry store for the module (creating one costs seconds of migrations)."""
    root = tmp_path_factory.mktemp("mlflow")
    return {"uri": f"sqlite:///{root / 'mlflow.db'}", "artifacts": (root / "artifacts").as_uri()}


@pytest.fixture(scope="module")
def generator(tiny):
    return TextGenerator.from_files(tiny["ckpt"], tiny["tokenizer"])


@pytest.fixture(scope="module")
def client(generator):
    return TestClient(create_app(generator, "crucible-test", max_tokens_limit=64, max_n=4))


# ------------------------------------------------------------------------------------- gate

def test_gate():
    """The absolute threshold every challenger meets; against a champion the yardstick decides."""
    from tasks.deploy.yardstick import decide

    cfg = DeployConfig(max_val_loss=6.0, min_improvement=0.05)
    assert gate(cfg, {"val_loss": 5.0})["passed"]
    r = gate(cfg, {"val_loss": 6.0})
    assert not r["passed"] and "max_val_loss" in r["reason"]
    for bad in ({}, {"val_loss": float("nan")}, {"val_loss": float("inf")}, {"val_loss": None}, {"val_loss": "3"}):
        r = gate(cfg, bad)
        assert not r["passed"] and "val_loss" in r["reason"]
    champ = {"old": 3.0, "new": 3.0, "wikitext": 4.0}
    assert decide(cfg, {**champ, "new": 2.9}, champ, {}, {})["passed"]  # 0.1 better on the new data
    r = decide(cfg, {**champ, "new": 2.98}, champ, {}, {})
    assert not r["passed"] and "new" in r["reason"] and ">= 0.05" in r["reason"]  # 0.02 < δ
    assert not decide(cfg, {**champ, "new": 2.9, "old": 3.03}, champ, {}, {})["passed"]  # forgets 0.03 > ε
    assert decide(cfg, {**champ, "new": 2.9, "old": 3.01}, champ, {}, {})["passed"]  # within ε
    assert not decide(cfg, {**champ, "new": 2.9}, champ, {"lambada_acc": 0.1}, {"lambada_acc": 0.2})["passed"]
    r = decide(cfg, {"wikitext": 1.0}, {"wikitext": 2.0}, {}, {})  # nothing of its own data to improve on
    assert not r["passed"] and "no held-out text" in r["reason"]
    strict = DeployConfig(max_val_loss=6.0, min_improvement=0.0)
    assert not decide(strict, champ, champ, {}, {})["passed"]  # equal is not better


# --------------------------------------------------------------------------------- registry

def test_registry_champion_alias_and_gate(tiny, mlflow_store):
    from mlflow import MlflowClient

    from tasks.deploy.registry import ALIAS, CHALLENGER, get_champion, promote, register

    uri = mlflow_store["uri"]
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert get_champion(uri, "crucible-test") is None

    # the training run the checkpoint came from; its artifacts stay inside the temporary store
    exp = client.create_experiment("train", artifact_location=mlflow_store["artifacts"])
    train_run = client.create_run(exp).info.run_id
    ev1 = {"val_loss": 5.5, "perplexity": math.exp(5.5), "step": 10, "checkpoint": str(tiny["ckpt"]),
           "task_metrics": {"lambada_acc": 0.25}}
    reg = register(uri, "crucible-test", tiny["ckpt"], tiny["tokenizer"], ev1, train_run,
                   extra_tags={"data.licences": "CC0"})
    # registered as challenger; champion only after promote
    assert reg["model_name"] == "crucible-test" and reg["version"] == 1 and reg["alias"] == CHALLENGER
    assert get_champion(uri, "crucible-test") is None
    assert str(client.get_model_version_by_alias("crucible-test", CHALLENGER).version) == "1"
    promote(uri, "crucible-test", 1, "checked by the test")
    assert client.get_registered_model("crucible-test").aliases == {ALIAS: 1}  # challenger alias dropped
    mv = client.get_model_version_by_alias("crucible-test", "champion")
    assert mv.tags["eval.lambada_acc"] == "0.25" and mv.tags["data.licences"] == "CC0"
    assert mv.tags["deployment.status"] == "champion" and mv.tags["deployment.verified"] == "checked by the test"
    assert str(mv.version) == "1" and mv.run_id == train_run
    assert float(mv.tags["val_loss"]) == 5.5 and mv.tags["train_run_id"] == train_run
    assert mv.tags["content_hash"] == reg["content_hash"] and len(reg["content_hash"]) == 64
    champ = get_champion(uri, "crucible-test")
    assert champ["version"] == 1 and champ["val_loss"] == 5.5

    # a second version becomes champion (registered without a training run id)
    reg2 = register(uri, "crucible-test", tiny["ckpt2"], tiny["tokenizer"], {"val_loss": 5.1, "step": 20}, None)
    assert client.get_model_version("crucible-test", "2").tags["export_sha256"]  # verifies a download
    assert reg2["version"] == 2 and get_champion(uri, "crucible-test")["version"] == 1
    promote(uri, "crucible-test", 2, "checked by the test")
    assert get_champion(uri, "crucible-test")["val_loss"] == 5.1
    assert str(client.get_model_version_by_alias("crucible-test", "champion").version) == "2"
    assert client.get_model_version("crucible-test", "1").tags["deployment.status"] == "superseded"
    assert client.get_model_version("crucible-test", "2").tags["deployment.status"] == "champion"
    assert not list(Path.cwd().glob("mlruns")) and not list(Path.cwd().glob("mlflow.db")), \
        "nothing may land in the working directory"

    # the registered version's copy (weights-only export + tokenizer + signed manifest, no MLmodel, no
    # loader code) loads with the project's loader: same greedy text
    from tasks.deploy.registry import load_registered

    assert sorted(f.path.rsplit("/", 1)[-1] for f in client.list_artifacts(
        reg["run_id"], reg["source"].rsplit("/artifacts/", 1)[1])) == ["checkpoint", "crucible-model.json",
                                                                       "tokenizer.json"]
    lm = load_registered(uri, "crucible-test", 1, registered_copy=True)
    out = lm.predict(["The Linux kernel"], {"max_tokens": 6, "temperature": 0.0})
    gen = TextGenerator.from_files(tiny["ckpt"], tiny["tokenizer"])
    want = gen.complete(gen.encode("The Linux kernel"), max_tokens=6, temperature=0.0)[0].text
    assert list(out) == [want]


def _pipeline_cfg(tmp_path: Path, **deploy) -> PipelineConfig:
    return CrucibleConfig.model_validate({
        "name": "t", "run_root": str(tmp_path / "runs"),
        "sources": [{"name": "s", "uri": "x.jsonl", "format": "jsonl", "licence": "CC0", "provenance": "test"}],
        "deploy": {"max_val_loss": 8.0, **deploy},
        "stack": {"state_dir": str(tmp_path / "state")}, "storage": {"cache_dir": str(tmp_path / "cache")},
    })


def _supervised(cfg: PipelineConfig) -> dict:
    """What the flows hand deploy_if_better: the stack's model-server supervisor."""
    return {"serve_model": serve_model, "verify_model": verify_model, "server_status": lambda: server_status(cfg.stack)}


@pytest.fixture(scope="module")
def trained(run, base):
    """The session's real training run: step 10 and the better step 20, with their tokenizer."""
    from lm_helpers import tokenizer_artifact

    ckpts = {int(Path(c).name.split("-")[-1]): c for c in run["checkpoints"]}
    return {"tokenizer": Path(tokenizer_artifact(base)["path"]), 10: ckpts[10], 20: ckpts[20]}


def _gated_cfg(tmp_path: Path, name: str, **deploy) -> PipelineConfig:
    cfg = _pipeline_cfg(tmp_path, **{"serve": False, "model_name": name, **deploy})
    return cfg.model_copy(update={"evaluate": cfg.evaluate.model_copy(update={
        "wikitext": cfg.evaluate.wikitext.model_copy(update={"limit": 2})})})


def _training_run(mlflow_store, experiment: str):
    """(tracking uri, client, a training run's id) in the test's MLflow store, as a gate records on."""
    from mlflow import MlflowClient

    uri = mlflow_store["uri"]
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    exp = client.create_experiment(experiment, artifact_location=mlflow_store["artifacts"])
    return uri, client, client.create_run(exp).info.run_id


def test_gate_compares_with_the_champion_on_the_yardstick_not_val_loss(trained, tmp_path, mlflow_store):
    """Cross-run val_loss figures are not comparable, so the gate ignores them: a challenger claiming
    a far lower val_loss (step 10) is refused because it is worse on the yardstick than the champion
    (step 20); the other way round, a challenger with a higher val_loss is promoted. Both models'
    bits per byte and the set's hash are on the gate record (training run, version tags, files)."""
    from tasks.core.hashing import sha256_file

    uri, client, train_run = _training_run(mlflow_store, "train-gated")
    tok, name = trained["tokenizer"], "crucible-gated"
    cfg = _gated_cfg(tmp_path, name)
    ev20 = {"val_loss": 6.0, "step": 20, "checkpoint": trained[20], "run_name": "test",
            "task_metrics": {"hellaswag_acc_norm": 0.3}}
    first = deploy_if_better(cfg, uri, ev20, tok, train_run, **_supervised(cfg))
    assert first["passed"] and first["version"] == 1 and first["content_hash"] and first["endpoint"] is None
    assert "no champion yet" in first["reason"] and "yardstick" not in first
    # challenger -> verified (loaded back from the registry and run) -> champion
    assert first["alias"] == "champion" and "loaded from the registry" in first["verified"]
    assert client.get_registered_model(name).aliases == {"champion": 1}
    tags = client.get_model_version(name, "1").tags
    assert tags["train_run_id"] == train_run and tags["val_loss"] == "6.0" and tags["step"] == "20"
    assert tags["eval.hellaswag_acc_norm"] == "0.3" and tags["deployment.status"] == "champion"
    assert tags["data.licences"] == "CC0" and tags["data.sources"].startswith("s (CC0; test)")
    assert tags["lineage.checkpoint_node"] == f"dataset:file:{Path(trained[20]).resolve()}"

    claims_better = {"val_loss": 1.0, "step": 10, "checkpoint": trained[10]}
    second = deploy_if_better(cfg, uri, claims_better, tok, train_run, **_supervised(cfg))
    assert not second["passed"] and second["version"] is None and second["champion_version"] == 1
    assert second["reason"].startswith("yardstick refuses: new "), second["reason"]
    y = second["yardstick"]
    assert sha256_file(y["path"]) == y["sha256"] and y["champion_version"] == 1
    assert set(y["challenger_bpb"]) == set(y["champion_bpb"]) == {"old", "new", "wikitext"}
    assert y["challenger_bpb"]["new"] > y["champion_bpb"]["new"]
    # the verdict, the set's hash and both models' numbers are on the training run
    run = client.get_run(train_run).data
    assert run.tags["gate.step-10.passed"] == "false" and run.tags["gate.step-10.reason"] == second["reason"]
    assert run.tags["gate.step-10.yardstick_sha256"] == y["sha256"] and run.tags["gate.step-20.passed"] == "true"
    assert run.metrics["gate_champion_bpb_new"] == pytest.approx(y["champion_bpb"]["new"])
    assert {(m.step, m.value) for m in client.get_metric_history(train_run, "gate_passed")} == {(20, 1.0), (10, 0.0)}
    assert client.get_registered_model(name).aliases == {"champion": 1}
    # the champion's scores on this set are kept on its version and reused by the next gate
    champ_tags = client.get_model_version(name, "1").tags
    assert float(champ_tags[f"yardstick.{y['sha256'][:16]}.new"]) == pytest.approx(y["champion_bpb"]["new"], abs=1e-6)
    again = deploy_if_better(cfg, uri, claims_better, tok, train_run, **_supervised(cfg))
    record = read_gate_record(Path(y["path"]).parent / "gate-step-10.json")  # signed (tests/test_signed_records.py)
    assert not again["passed"] and record["champion"]["scores"] == "reused from its registry tags"
    # The champion's own checkpoint again (as when the triggered deploy-model flow got there first):
    # reported as deployed, no new version.
    same = deploy_if_better(cfg, uri, ev20, tok, None, **_supervised(cfg))
    assert same["passed"] and same["version"] == 1 and "already the champion" in same["reason"]
    assert same["content_hash"] == first["content_hash"]

    # the other way round: the champion claims the lower val_loss, the better model is promoted
    other = _gated_cfg(tmp_path, "crucible-gated-2")
    assert deploy_if_better(other, uri, claims_better, tok, None, **_supervised(other))["version"] == 1
    promoted = deploy_if_better(other, uri, ev20, tok, None, **_supervised(other))
    assert promoted["passed"] and promoted["version"] == 2 and promoted["reason"].startswith("yardstick: new ")
    v2 = client.get_model_version("crucible-gated-2", "2").tags
    assert v2["gate.yardstick_sha256"] == promoted["yardstick"]["sha256"] and v2["gate.champion_version"] == "1"
    assert float(v2["gate.challenger.bpb_new"]) < float(v2["gate.champion.bpb_new"])


def test_gate_scores_a_champion_whose_files_are_gone_from_its_verified_registered_copy(trained, tmp_path,
                                                                                      mlflow_store):
    import shutil

    from mlflow import MlflowClient

    from tasks.core.hashing import sha256_tree

    uri = mlflow_store["uri"]
    copy = tmp_path / "gone" / "train" / "checkpoints" / "step-000010"
    shutil.copytree(trained[10], copy)
    from tasks.train.checkpoint import apply_retention

    apply_retention(copy.parent.parent, copy, None)  # a run of its own, with its manifest
    cfg = _gated_cfg(tmp_path, "crucible-gone")
    first = deploy_if_better(cfg, uri, {"val_loss": 5.0, "step": 10, "checkpoint": str(copy)}, trained["tokenizer"],
                             None, **_supervised(cfg))
    assert first["version"] == 1
    shutil.rmtree(tmp_path / "gone")
    # a continued cycle starts from the verified registered copy (weights only: not with AdamW moments)
    from tasks.continued.cycle import CycleError, find_champion

    found = find_champion(cfg, uri)
    assert ".champions" in str(found.checkpoint) and found.checkpoint_sha256 == MlflowClient(
        tracking_uri=uri).get_model_version("crucible-gone", "1").tags["export_sha256"]
    with_moments = cfg.model_copy(update={"continue_": cfg.continue_.model_copy(update={"init_optimizer": True})})
    with pytest.raises(CycleError, match="init_optimizer"):
        find_champion(with_moments, uri)
    res = deploy_if_better(cfg, uri, {"val_loss": 5.0, "step": 20, "checkpoint": trained[20]}, trained["tokenizer"],
                           None, **_supervised(cfg))
    record = read_gate_record(Path(res["yardstick"]["path"]).parent / "gate-step-20.json")
    assert record["champion"]["scores"].startswith("scored from ") and ".champions" in record["champion"]["scores"]
    assert res["passed"] and res["version"] == 2, res["reason"]
    # a registered copy that no longer matches its signed manifest is not scored (on a new set, so no
    # score kept on the version applies): the challenger is refused. Forged tags are no way round it:
    # a rewritten checkpoint tag is dropped (so the copy is the only way), a rewritten hash too
    from urllib.parse import urlparse

    v2 = MlflowClient(tracking_uri=uri).get_model_version("crucible-gone", "2")
    weights = next(p for p in (Path(urlparse(v2.source).path) / "checkpoint").iterdir() if p.suffix == ".safetensors")
    weights.write_bytes(weights.read_bytes()[:-8] + bytes(8))
    MlflowClient(tracking_uri=uri).set_model_version_tag("crucible-gone", "2", "checkpoint", str(tmp_path / "gone"))
    MlflowClient(tracking_uri=uri).set_model_version_tag("crucible-gone", "2", "export_sha256", sha256_tree(
        weights.parent))
    other_set = cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update={"yardstick_docs": 8})})
    refused = deploy_if_better(other_set, uri, {"val_loss": 5.0, "step": 10, "checkpoint": trained[10]},
                               trained["tokenizer"], None, **_supervised(other_set))
    assert not refused["passed"] and "cannot be scored" in refused["reason"], refused["reason"]
    assert "no signed hashes" in refused["reason"] or "signed manifest" in refused["reason"], refused["reason"]


def test_challenger_that_cannot_be_served_is_rejected_and_champion_stays(trained, tmp_path, mlflow_store):
    from mlflow import MlflowClient

    uri = mlflow_store["uri"]
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    name = "crucible-unservable"
    unserved = _gated_cfg(tmp_path, name)
    ok = deploy_if_better(unserved, uri, {"val_loss": 6.0, "step": 10, "checkpoint": trained[10]},
                          trained["tokenizer"], None, **_supervised(unserved))
    assert ok["version"] == 1 and ok["alias"] == "champion"
    with socket.socket() as busy:  # another process holds the verification server's port: it must fail
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        cfg = _gated_cfg(tmp_path, name, serve=True, port=free_port(), verify_port=busy.getsockname()[1])
        res = deploy_if_better(cfg, uri, {"val_loss": 5.0, "step": 20, "checkpoint": trained[20]},
                               trained["tokenizer"], None, **_supervised(cfg))
    assert not res["passed"] and res["version"] is None and "failed verification" in res["reason"]
    assert "in use" in res["reason"]
    assert client.get_registered_model(name).aliases == {"champion": 1}  # no challenger left behind
    # the live server was never touched: verification runs in a server of its own
    assert server_status(cfg.stack) is None and res["endpoint"] is None
    v2 = client.get_model_version(name, "2").tags
    assert v2["deployment.status"] == "rejected" and v2["deployment.reason"] == res["reason"]


# ----------------------------------------------------------------------------------- server

def test_completion_answers_in_openai_shape(client):
    r = client.post("/v1/completions", json={"model": "crucible-test", "prompt": "The Linux kernel",
                                             "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == "crucible-test" and body["id"].startswith("cmpl-")
    (choice,) = body["choices"]
    assert set(choice) == {"text", "index", "logprobs", "finish_reason"}
    assert isinstance(choice["text"], str) and choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    u = body["usage"]
    assert u["prompt_tokens"] > 0 and 0 < u["completion_tokens"] <= 5
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def test_greedy_and_seeded_sampling_match_gpt_generate(generator, client):
    """The server's sampling loop draws exactly as GPT.generate (used by the evaluate stage)."""
    ids = generator.encode("Debian is")
    x = torch.tensor([ids])
    for temperature, seed in ((0.0, None), (0.8, 7)):
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        out = generator.model.generate(x, 8, temperature=temperature, eos_id=generator.eos_id, generator=g)
        new = [t for t in out[0, len(ids):].tolist() if t != generator.eos_id]
        body = client.post("/v1/completions", json={"prompt": "Debian is", "max_tokens": 8,
                                                    "temperature": temperature, "seed": seed}).json()
        assert body["choices"][0]["text"] == generator.decode(new)


def test_batch_prompts_n_echo_stop(client, generator):
    body = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 3,
                                                "seed": 1}).json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    again = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 3,
                                                 "seed": 1}).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in body["choices"]]  # seeded

    echo = client.post("/v1/completions", json={"prompt": "In Python", "max_tokens": 2, "echo": True,
                                                 "temperature": 0}).json()
    assert echo["choices"][0]["text"].startswith("In Python")

    free = client.post("/v1/completions", json={"prompt": "The", "max_tokens": 12, "temperature": 0}).json()
    text = free["choices"][0]["text"]
    if len(text) >= 3:  # stop at a substring the greedy completion is known to contain
        stop = text[1:3]
        cut = client.post("/v1/completions", json={"prompt": "The", "max_tokens": 12, "temperature": 0,
                                                   "stop": [stop]}).json()["choices"][0]
        assert cut["text"] == text[:text.find(stop)] and cut["finish_reason"] == "stop"

    ids = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}).json()
    assert ids["usage"]["prompt_tokens"] == 3 and len(ids["choices"]) == 1
    empty = client.post("/v1/completions", json={"prompt": "", "max_tokens": 2}).json()
    assert empty["usage"]["prompt_tokens"] == 0 and len(empty["choices"]) == 1
    zero = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}).json()
    assert zero["choices"][0] == {"text": "", "index": 0, "logprobs": None, "finish_reason": "length"}


@pytest.mark.parametrize("payload,param", [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 65}, "max_tokens"),  # over the server's limit
    ({"prompt": "x", "temperature": 3}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 5}, "n"),
    ({"prompt": 42}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10 ** 9]}, "prompt"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "stream": "sometimes"}, "stream"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"),
    ({"prompt": "x", "logprobs": -1}, "logprobs"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_request_gets_400_with_openai_error(client, payload, param):
    r = client.post("/v1/completions", json=payload)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_malformed_bodies_and_unknown_model(client):
    for content in (b"{not json", b"[1, 2]", b"", b"null"):
        r = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
        assert r.status_code == 400, (content, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/completions", json={"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()
    # and the server still answers afterwards
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_models_and_health(client, tiny):
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["crucible-test"]
    assert models["data"][0]["object"] == "model"
    assert client.get("/v1/models/crucible-test").json()["id"] == "crucible-test"
    assert client.get("/v1/models/other").status_code == 404
    h = client.get("/health").json()
    assert h["status"] == "ok" and h["model"] == "crucible-test" and h["step"] == 10
    # anyone who reaches the port reads /health and the model card: no filesystem paths in them
    for body in (h, client.get("/v1/models").json()):
        assert "/" + Path(tiny["ckpt"]).parts[1] not in json.dumps(body), body


def test_wrong_tokenizer_is_refused(tiny, tmp_path):
    other = tmp_path / "tokenizer.json"
    other.write_text(Path(tiny["tokenizer"]).read_text().replace('"<|pad|>"', '"<|PAD|>"'))
    with pytest.raises(ValueError, match="not the one"):
        TextGenerator.from_files(tiny["ckpt"], other)


# ------------------------------------------------------------------- the server as a service

def test_model_server_process_start_refresh_status_down(tiny, tmp_path, monkeypatch, mlflow_store):
    import os
    import stat

    from tasks.deploy.registry import register
    from infra.services.model_server.supervisor import admin_key_file, client_headers

    monkeypatch.delenv(stack.STATE_DIR_ENV, raising=False)
    stack_cfg = StackConfig(state_dir=str(tmp_path / "state"), prefect_port=free_port(),
                            mlflow_port=free_port(), start_timeout=120, stop_timeout=10)
    deploy_cfg = DeployConfig(model_name="crucible-proc", port=free_port(), threads=1)
    uri = mlflow_store["uri"]
    v1, v2 = (register(uri, "crucible-proc", c, tiny["tokenizer"], {"val_loss": 5.0}, None)["version"]
              for c in (tiny["ckpt"], tiny["ckpt2"]))

    t0 = time.monotonic()
    first = start_or_refresh_server(stack_cfg, deploy_cfg, tiny["ckpt"], tiny["tokenizer"], "crucible-test",
                                    version=v1, tracking_uri=uri)
    print(f"\nmodel server healthy after {time.monotonic() - t0:.1f}s")
    assert first["endpoint"] == f"http://127.0.0.1:{deploy_cfg.port}/v1"
    st = stack.status(stack_cfg)["model_server"]
    assert st == {"url": first["endpoint"], "healthy": True, "pid": first["pid"]}

    keyed = client_headers(stack_cfg, deploy_cfg)  # the stack's server always needs the clients' key
    r = httpx.post(f"{first['endpoint']}/completions", json={"prompt": "The Linux kernel", "max_tokens": 4},
                   timeout=30, headers=keyed)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    assert httpx.post(f"{first['endpoint']}/completions", json={"max_tokens": "x"}, timeout=30,
                      headers=keyed).status_code == 400
    assert httpx.get(f"{first['endpoint']}/models", timeout=10, headers=keyed).json()["data"][0]["id"] == "crucible-test"

    # refresh with a new registered version: resolved in MLflow by the running process and swapped
    # in (POST /v1/admin/reload with the admin token, a 0600 file in the state directory)
    key = admin_key_file(stack_cfg)
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert httpx.post(f"{first['endpoint']}/admin/reload", json={"version": v2}, timeout=30).status_code == 401
    second = start_or_refresh_server(stack_cfg, deploy_cfg, tiny["ckpt2"], tiny["tokenizer"], "crucible-test",
                                     version=v2, tracking_uri=uri)
    assert second["reloaded"] and second["pid"] == first["pid"]
    health = httpx.get(f"{second['endpoint'].removesuffix('/v1')}/health", timeout=10).json()
    assert health["step"] == 20 and health["version"] == v2
    assert stack.read_spec(stack_cfg, "model_server").info["checkpoint"] == str(Path(tiny["ckpt2"]).resolve())
    assert key.read_text().strip() not in stack.log_path(stack_cfg, "model_server").read_text()

    # without reload_in_place: a new process serves it, the old one is gone
    restart_cfg = deploy_cfg.model_copy(update={"reload_in_place": False})
    third = start_or_refresh_server(stack_cfg, restart_cfg, tiny["ckpt"], tiny["tokenizer"], "crucible-test")
    assert not third["reloaded"] and third["pid"] != first["pid"] and stack.group_pids(first["pid"]) == []
    assert httpx.get(f"{third['endpoint'].removesuffix('/v1')}/health", timeout=10).json()["step"] == 10
    second = third

    assert stack.down(stack_cfg)["model_server"] in ("stopped", "killed")
    assert stack.group_pids(second["pid"]) == []
    st = stack.status(stack_cfg)["model_server"]  # still listed (deployed), but stopped
    assert st["healthy"] is False and st["pid"] is None


def test_a_store_runs_checkpoint_is_gated_registered_and_served_by_its_uri(trained, tmp_path, mlflow_store,
                                                                          monkeypatch):
    """An object-store run's checkpoints named by their URIs (as the train stage names them): gated
    on the yardstick (scored on the store), registered with the URI as its checkpoint tag and the
    same content hash as the local files', verified from the registry; the model server gets a
    fetched copy with the run's signed manifest (it verifies it as it loads); no working copy."""
    from mlflow import MlflowClient

    from s3_helpers import moto_s3
    from tasks.core import storage
    from tasks.deploy import servable
    from tasks.deploy.registry import model_content_hash
    from tasks.train.checkpoint import UnverifiedCheckpoint, load_model_for_inference

    monkeypatch.setattr(storage, "_STORES", {})
    uri = mlflow_store["uri"]
    name, tok = "crucible-store", Path(trained["tokenizer"])
    with moto_s3(tmp_path / "moto", buckets=["runs"]) as s3:
        checkpoints = Path(trained[20]).parent
        for p in checkpoints.rglob("*"):
            if p.is_file():
                s3.client.upload_file(str(p), "runs", f"crucible/r1/train/checkpoints/{p.relative_to(checkpoints).as_posix()}")
        s3.client.upload_file(str(tok), "runs", "crucible/r1/tokenizer/tokenizer.json")
        store = storage.open_store("s3://runs/crucible", s3.options, str(tmp_path / "cache"))
        at = {step: f"s3://runs/crucible/r1/train/checkpoints/{Path(trained[step]).name}" for step in (10, 20)}
        tok_uri = "s3://runs/crucible/r1/tokenizer/tokenizer.json"
        cfg = _gated_cfg(tmp_path, name)
        cfg = cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"options": s3.options,
                                                                                "cache_dir": str(tmp_path / "cache")})})
        first = deploy_if_better(cfg, uri, {"val_loss": 6.0, "step": 20, "checkpoint": at[20], "run_name": "test"},
                                 tok_uri, None, **_supervised(cfg))
        assert first["passed"] and first["alias"] == "champion" and "loaded from the registry" in first["verified"]
        assert first["content_hash"] == model_content_hash(trained[20], tok)
        tags = MlflowClient(tracking_uri=uri, registry_uri=uri).get_model_version(name, "1").tags
        assert tags["checkpoint"] == at[20] and tags["tokenizer"] == tok_uri
        assert tags["lineage.checkpoint_node"] == "dataset:s3://runs:crucible/r1/train/checkpoints/" + Path(at[20]).name
        second = deploy_if_better(cfg, uri, {"val_loss": 1.0, "step": 10, "checkpoint": at[10]}, tok_uri, None,
                                  **_supervised(cfg))  # scored against the champion, both read on the store
        assert not second["passed"] and second["yardstick"]["challenger_bpb"] and second["yardstick"]["champion_bpb"]
        assert not list(store.local_root.rglob("*.safetensors"))

        served = servable(cfg, at[20], tok_uri)
        ckpt, local_tok = served.checkpoint, served.tokenizer
        assert ckpt.is_relative_to(tmp_path / "cache" / "served") and local_tok.read_bytes() == tok.read_bytes()
        assert served.content_hash == first["content_hash"] and ckpt.parents[2].name == served.content_hash[:32]
        model, meta = load_model_for_inference(ckpt)  # verified against the fetched signed manifest
        assert meta["step"] == 20
        # keyed by content: a re-deploy that does not verify never replaces the live folder
        s3.client.put_object(Bucket="runs", Key=f"crucible/r1/train/checkpoints/{Path(at[20]).name}/extra.bin",
                             Body=b"x")
        folders = sorted((tmp_path / "cache" / "served").iterdir())
        with pytest.raises(UnverifiedCheckpoint):
            servable(cfg, at[20], tok_uri)
        assert load_model_for_inference(ckpt)[1]["step"] == 20
        assert sorted((tmp_path / "cache" / "served").iterdir()) == folders  # nothing replaced, nothing left


def test_what_is_registered_is_what_the_signed_report_names(tmp_path, mlflow_store, monkeypatch):
    """Attack: after the gate, a writer of the run folder swaps in another run's genuine checkpoint of
    the same step with that run's signed manifest. The content hash, the registered export and what
    is served all come from one local copy verified against the report's checkpoint_sha256, so the
    registered copy holds the evaluated weights (or nothing is registered)."""
    import shutil

    from tasks.core import fs
    from tasks.deploy import yardstick
    from tasks.deploy.registry import get_champion, registered_files
    from tasks.train.checkpoint import load_model_for_inference

    tok = sample_tokenizer(tmp_path / "tok")
    evaluated = random_checkpoint(tmp_path / "live" / "train", tok, 20, seed=1)
    other = random_checkpoint(tmp_path / "other" / "train", tok, 20, seed=2)
    name, uri = "crucible-swapped", mlflow_store["uri"]
    real_gate = yardstick.gate_evaluation

    def gate_then_swap(*a, **kw):
        verdict = real_gate(*a, **kw)
        live = Path(evaluated).parent
        shutil.rmtree(live)
        shutil.copytree(Path(other).parent, live)  # checkpoint and its run's signed manifest
        return verdict

    monkeypatch.setattr(yardstick, "gate_evaluation", gate_then_swap)
    want = fs.tree_sha256(evaluated)
    evaluation = {"val_loss": 5.0, "step": 20, "checkpoint": str(evaluated), "checkpoint_sha256": want}
    cfg = _gated_cfg(tmp_path, name)
    res = deploy_if_better(cfg, uri, evaluation, tok, None, server_status=lambda: server_status(cfg.stack))
    assert fs.tree_sha256(evaluated) != want  # the swap happened
    # registered only (deploy.serve false): pruned
    assert [p.name for p in (tmp_path / "cache" / "served").iterdir()] == [".locks"]
    if res["version"] is not None:
        champion = get_champion(uri, name)
        ckpt, _, copy_hash = registered_files(uri, name, champion, tmp_path / "champions")
        registered, _ = load_model_for_inference(ckpt, expected_tree_sha256=copy_hash)
        theirs, _ = load_model_for_inference(other)
        assert not torch.equal(registered.tok_emb.weight, theirs.tok_emb.weight)



def test_the_gate_scores_the_bytes_the_signed_report_names(trained, tmp_path, mlflow_store, monkeypatch):
    """A writer of the run folder who swaps in another run's genuine checkpoint and manifest after the
    evaluation would pass a manifest check, so the gate would promote a model on another model's score.
    The challenger is scored only as the bytes the signed report attests (its checkpoint_sha256)."""
    from tasks.core import fs
    from tasks.deploy import yardstick

    uri, _, train_run = _training_run(mlflow_store, "train-swap")
    tok, name = trained["tokenizer"], "crucible-gate-swap"
    cfg = _gated_cfg(tmp_path, name)
    ev20 = {"val_loss": 6.0, "step": 20, "checkpoint": trained[20], "run_name": "test"}
    assert deploy_if_better(cfg, uri, ev20, tok, train_run, **_supervised(cfg))["version"] == 1
    real_score, seen = yardstick.score, []

    def recording_score(checkpoint, *a, **kw):
        seen.append((str(checkpoint), kw.get("expected_tree_sha256")))
        return real_score(checkpoint, *a, **kw)

    monkeypatch.setattr(yardstick, "score", recording_score)
    attested = fs.tree_sha256(trained[10])
    ev10 = {"val_loss": 5.0, "step": 10, "checkpoint": trained[10], "checkpoint_sha256": attested}
    second = deploy_if_better(cfg, uri, ev10, tok, train_run, **_supervised(cfg))
    assert not second["passed"] and seen  # scored, and worse than the champion
    assert seen[0] == (str(trained[10]), attested)  # the challenger: checked against the report's hash


def test_the_yardstick_refuses_document_starts_that_are_not_the_indexed_ones(base, tmp_path):
    """Attack: a writer of the run folder (or the store) swaps the val split's doc_starts.npy, so the
    yardstick's held-out documents are cut elsewhere (half documents, or spans chosen to flatter one
    model). The file must hash to the doc_starts_sha256 of the signed index, else the set is refused."""
    import shutil

    import numpy as np

    from lm_helpers import tokenizer_artifact, tokens_artifact
    from tasks.deploy.yardstick import _held_out
    from tasks.evaluate.evaluate import TokensChanged
    from tasks.tokenizer.bpe import load_tokenizer

    shutil.copytree(Path(tokens_artifact(base)["index_path"]).parent, tmp_path / "tokens")
    index = tmp_path / "tokens" / "index.json"
    tok = load_tokenizer(tokenizer_artifact(base)["path"])
    genuine = _held_out(index, tok, 4, 10_000)
    assert len(genuine) == 4
    starts_file = tmp_path / "tokens" / json.loads(index.read_text())["splits"]["val"]["doc_starts"]
    starts = np.load(starts_file)
    np.save(starts_file, (starts + np.arange(len(starts)) % 2 * 3).astype(np.int64))  # every other start moved
    with pytest.raises(TokensChanged, match="doc_starts"):
        _held_out(index, tok, 4, 10_000)


def _served_copies(cfg, tmp_path: Path, tok, *names: str) -> list:
    """A served/ copy (tasks.deploy.servable) of a random checkpoint per name, no deploy holding it."""
    from tasks.deploy import servable

    return [servable(cfg, random_checkpoint(tmp_path / n / "train", tok, 10, seed), tok)
            for seed, n in enumerate(names, 1)]


def _record_model_server(cfg, copy) -> None:
    """The stack's signed model-server spec, serving `copy` (as serve_model and `crucible up` leave it)."""
    from infra.services.model_server.supervisor import server_spec

    stack.write_spec(cfg.stack, server_spec(cfg.deploy, copy.checkpoint, copy.tokenizer, "m", cfg.stack, version=1))


def test_served_copies_no_server_uses_are_pruned_by_deploy(tmp_path, mlflow_store, monkeypatch):
    """served/ holds one verified copy per content hash. deploy prunes what no model server uses: a
    `.tmp-` folder a killed deploy left, a champion's copy the live server moved on from and a refused
    challenger's go; the copy the stack's model-server spec serves (what `crucible up` restarts from;
    there is no other record of it, as after an upgrade) and a copy another deploy holds (its lock, however
    old) stay; a deploy holds its own copy locked from start to end."""
    from contextlib import ExitStack

    from tasks.deploy import prune_served, servable, yardstick

    tok = sample_tokenizer(tmp_path / "tok")
    cfg = _gated_cfg(tmp_path, "crucible-pruned")
    status = _supervised(cfg)["server_status"]
    live, old = _served_copies(cfg, tmp_path, tok, "live", "old")
    root = tmp_path / "cache" / "served"
    (root / ".tmp-killed").mkdir()
    (root / ".tmp-killed" / "part").write_bytes(b"x")
    _record_model_server(cfg, live)
    assert status()["serves"] and not (root / ".live").exists()
    real_gate, seen = yardstick.gate_evaluation, []

    def gate_and_prune(*a, **kw):  # another deploy's prune while this one is gated
        seen.append(prune_served(cfg, status))
        return real_gate(*a, **kw)

    monkeypatch.setattr(yardstick, "gate_evaluation", gate_and_prune)
    bad = random_checkpoint(tmp_path / "bad" / "train", tok, 10, 4)
    with ExitStack() as other_deploy:
        in_flight = servable(cfg, random_checkpoint(tmp_path / "next" / "train", tok, 10, 3), tok,
                             in_flight=other_deploy)
        refused = deploy_if_better(cfg, mlflow_store["uri"], {"val_loss": 99.0, "step": 10, "checkpoint": str(bad)},
                                   tok, None, server_status=status)
        assert not refused["passed"]
        (mid_deploy,) = seen
        assert sorted(mid_deploy) == sorted([".tmp-killed", old.content_hash[:32]]), mid_deploy  # not its own
        left = sorted(p.name for p in root.iterdir())
        assert left == sorted([".locks", live.content_hash[:32], in_flight.content_hash[:32]]), left
    assert live.checkpoint.is_dir() and in_flight.checkpoint.is_dir()
    assert prune_served(cfg, status) == [in_flight.content_hash[:32]]  # its deploy ended
    assert sorted(p.name for p in root.iterdir()) == [".locks", live.content_hash[:32]]
    assert sorted(p.name for p in (root / ".locks").iterdir()) == [live.content_hash[:32] + ".lock"]


def test_served_copies_stay_when_what_the_server_uses_cannot_be_told(tmp_path, monkeypatch, caplog):
    """With no server status (or a server without a readable spec) deploy cannot tell the live copy
    from the others: nothing is pruned, and that is logged. A copy that cannot be removed is logged,
    never reported as pruned."""
    import shutil

    from tasks.deploy import prune_served

    tok = sample_tokenizer(tmp_path / "tok")
    cfg = _gated_cfg(tmp_path, "crucible-unknown")
    (a,) = _served_copies(cfg, tmp_path, tok, "a")
    root = tmp_path / "cache" / "served"
    unreadable_spec = {"url": "http://127.0.0.1:1/v1", "healthy": True, "pid": 1, "serves": None}
    with caplog.at_level("WARNING", logger="tasks.deploy"):
        assert prune_served(cfg, None) == [] and prune_served(cfg, lambda: unreadable_spec) == []
    assert a.checkpoint.is_dir() and "cannot be told" in caplog.text
    caplog.clear()
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **kw: None)  # a copy that will not go
    with caplog.at_level("WARNING", logger="tasks.deploy"):
        assert prune_served(cfg, lambda: None) == []
    assert a.checkpoint.is_dir() and "could not remove" in caplog.text
    monkeypatch.undo()
    assert prune_served(cfg, lambda: None) == [a.content_hash[:32]] and not root.joinpath(a.content_hash[:32]).exists()


def test_a_champion_whose_token_index_predates_signing_is_gated_on_it(trained, base, tmp_path, mlflow_store):
    """A champion registered before token indexes were signed: its index is unsigned, but the registry's
    signed tag holds the sha256 of its bytes (data.tokens_index_sha256). The yardstick re-derives trust
    from that tag (the bytes read must hash to it) and builds its "old" part, rather than refusing every
    challenger; with no signed hash behind it, the same index is refused, the reason naming the remedy."""
    import hashlib
    import shutil

    from lm_helpers import tokens_artifact
    from tasks.deploy.registry import set_version_tags
    from tasks.deploy.yardstick import UntrustedTokenIndex, _held_out
    from tasks.tokenizer.bpe import load_tokenizer

    uri, tok, name = mlflow_store["uri"], trained["tokenizer"], "crucible-pre-signing"
    cfg = _gated_cfg(tmp_path, name)
    status = _supervised(cfg)["server_status"]
    ev20 = {"val_loss": 6.0, "step": 20, "checkpoint": trained[20], "run_name": "test"}
    assert deploy_if_better(cfg, uri, ev20, tok, None, server_status=status)["version"] == 1
    old = tmp_path / "pre-signing-tokens"
    shutil.copytree(Path(tokens_artifact(base)["index_path"]).parent, old)
    index = json.loads((old / "index.json").read_text())
    index.pop("signature")
    (old / "index.json").write_text(json.dumps(index))  # as the tokens stage wrote it before signing
    sha = hashlib.sha256((old / "index.json").read_bytes()).hexdigest()
    set_version_tags(uri, name, 1, {"data.tokens_index": str(old / "index.json"), "data.tokens_index_sha256": sha})
    gated = deploy_if_better(cfg, uri, {"val_loss": 5.0, "step": 10, "checkpoint": trained[10]}, tok, None,
                             server_status=status)
    assert "yardstick" in gated, gated["reason"]  # scored, not refused for the champion's index
    assert set(gated["yardstick"]["champion_bpb"]) == {"old", "new", "wikitext"}
    with pytest.raises(UntrustedTokenIndex, match="is unsigned.*re-run the tokens stage"):
        _held_out(old / "index.json", load_tokenizer(tok), 2, 100)
    # the cycle's yardstick stage gets the pool as the flow hands it: with its vouched hashes, the
    # pre-signing member is scored; as a bare list (the hashes dropped) it is refused before anything runs
    import dataclasses

    from tasks.continued.mix import vouched_pool
    from tasks.core.layout import RunLayout
    from tasks.core.sections import stage_config
    from tasks.core.stage import StageContext, StageInputs
    from tasks.registry import STAGES

    stage = STAGES["yardstick"]
    ctx = StageContext(layout=RunLayout.for_run(tmp_path, "cycle"), run_name="cycle", tracking_uri=uri, experiment="x")
    pool = vouched_pool(old / "index.json", sha)
    inputs = StageInputs(evaluation={"val_loss": 5.0, "step": 10, "checkpoint": trained[10]}, tokenizer=str(tok),
                         tokens_index=tokens_artifact(base)["index_path"], replay=pool)
    assert stage.run(stage_config(stage, cfg), inputs, ctx).data["set"]["parts"]["old"] > 0
    with pytest.raises(TypeError, match="vouched sha256"):
        stage.run(stage_config(stage, cfg), dataclasses.replace(inputs, replay=list(pool)), ctx)
    # Attack: the champion's index deleted (or replaced) so that the set has no "old" part and its
    # no-forgetting check silently drops out: the signed hash says there was one, so the gate refuses
    from tasks.deploy.registry import get_champion
    from tasks.deploy.yardstick import gate_evaluation

    shutil.rmtree(old)
    refused, _ = gate_evaluation(cfg, uri, {"val_loss": 5.0, "step": 10, "checkpoint": trained[10]}, tok,
                                 get_champion(uri, name))
    assert not refused["passed"] and "no-forgetting check" in refused["reason"], refused["reason"]


def test_a_champion_pool_member_gone_or_replaced_refuses_the_gate(base, tmp_path):
    """Attack on the "old" part of a continued champion: a member of its mix's pool deleted, or replaced
    by another genuine signed index, would drop (or fail) the no-forgetting check on that data. The
    champion's signed index hash vouches for the pool, so either is a refusal (a TokensChanged, which
    the gate records as its reason), never a set without that member."""
    import shutil

    from lm_helpers import tokens_artifact
    from tasks.continued.mix import build_mix
    from tasks.core.hashing import sha256_file
    from tasks.deploy.yardstick import ChampionDataRefused, champion_pool
    from tasks.tokens.binfile import TokensChanged

    def copy(dest):
        shutil.copytree(Path(tokens_artifact(base)["index_path"]).parent, dest)
        return dest / "index.json"

    new, member = copy(tmp_path / "new"), copy(tmp_path / "member")
    mixed = Path(build_mix(new, {str(member): sha256_file(member)}, 0.25, 0, tmp_path / "mix")["index_path"])
    tags = {"data.tokens_index": str(mixed), "data.tokens_index_sha256": sha256_file(mixed)}
    assert str(member) in champion_pool(tags)  # intact: every member
    index = json.loads(member.read_text())
    index["sources"] = list(reversed(index["sources"]))  # still a genuine-looking index, other bytes
    member.write_text(json.dumps(index))
    with pytest.raises(ChampionDataRefused, match="not the ones its mix recorded") as replaced:
        champion_pool(tags)
    assert isinstance(replaced.value, TokensChanged)
    member.unlink()
    with pytest.raises(ChampionDataRefused, match=rf"are gone.*{member}"):
        champion_pool(tags)
    mixed.unlink()
    with pytest.raises(ChampionDataRefused, match="is gone or is not the one"):
        champion_pool(tags)
    assert champion_pool({"data.tokens_index": str(mixed)}) == {}  # no signed hash: nothing vouched, nothing owed


def test_a_run_whose_token_index_predates_signing_is_refused_with_the_remedy(tmp_path, mlflow_store):
    """A run resumed from before token indexes were signed passes the absolute gate (no champion yet);
    its version would be tagged with its index's hash, which nothing the stack signed vouches for: the
    deploy is a recorded refusal naming the remedy, not an exception after the gate passed."""
    from tasks.deploy.registry import get_champion

    tok = sample_tokenizer(tmp_path / "tok")
    ckpt = random_checkpoint(tmp_path / "resumed" / "train", tok, 10, 1)
    (tmp_path / "resumed" / "tokens").mkdir()
    (tmp_path / "resumed" / "tokens" / "index.json").write_text(json.dumps({"splits": {}}))  # unsigned
    name = "crucible-unsigned-run"
    cfg = _gated_cfg(tmp_path, name)
    res = deploy_if_better(cfg, mlflow_store["uri"], {"val_loss": 5.0, "step": 10, "checkpoint": str(ckpt)}, tok,
                           None, server_status=_supervised(cfg)["server_status"])
    assert not res["passed"] and res["version"] is None, res
    assert "is unsigned" in res["reason"] and "re-run the tokens stage" in res["reason"], res["reason"]
    assert get_champion(mlflow_store["uri"], name) is None


def test_a_signing_key_problem_fails_the_gate_instead_of_refusing_the_checkpoint(tmp_path, monkeypatch):
    """The gate refuses a checkpoint whose token data cannot be trusted; a signing key that is not
    private is the stack's failure, not the data's: it is raised, never recorded as a verdict."""
    from tasks.core import signing
    from tasks.deploy import yardstick
    from tasks.deploy.yardstick import UntrustedTokenIndex, _held_out, gate_evaluation
    from tasks.tokenizer.bpe import load_tokenizer

    tok = sample_tokenizer(tmp_path / "tok")
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"splits": {}}))
    with pytest.raises(UntrustedTokenIndex, match="re-run the tokens stage"):  # the data's problem: a refusal
        _held_out(index, load_tokenizer(tok), 2, 100)
    key = tmp_path / "secrets" / "signing.key"
    key.parent.mkdir()
    key.write_text("k" * 43 + "\n")
    key.chmod(0o644)
    monkeypatch.setenv(signing.SIGNING_KEY_FILE_ENV, str(key))
    monkeypatch.setattr(yardstick, "against_champion", lambda *a, **kw: _held_out(index, load_tokenizer(tok), 2, 100))
    cfg = _gated_cfg(tmp_path, "crucible-key")
    with pytest.raises(signing.SignatureError, match="not private") as raised:
        gate_evaluation(cfg, "sqlite:///unused.db", {"val_loss": 5.0, "checkpoint": "x"}, tok, {"version": 1})
    assert not isinstance(raised.value, UntrustedTokenIndex)
