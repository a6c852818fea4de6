"""Trust boundaries (issues 16 and 24): nothing found in run storage is unpickled, and nothing is
loaded before it is verified against a record only the stack's signing key can write.

A checkpoint whose files were replaced by a pickle that writes a marker file, either in place of a
real checkpoint's or as a copy placed beside a run's real checkpoints, must be refused by every entry
point that loads checkpoints, and the marker must never be written. Checkpoints are safetensors and
JSON (issue 24): even a planted file that some record vouched for can at worst fail to parse. The
run's checkpoint manifest and each meta file are signed: rewriting a hash in the manifest (the
issue's attack) or dropping its signature gets the whole run's checkpoints refused."""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from fastapi.testclient import TestClient

from attack_helpers import WritesMarker
from tasks.core.hashing import sha256_file


@pytest.fixture(scope="module")
def poisoned(run, base, tmp_path_factory):
    """A copy of the session's training run in which step 20's tensor files are marker-writing pickles
    (`tampered`), plus a poisoned copy of step 20 placed beside the run's checkpoints (`planted`)."""
    from lm_helpers import tokenizer_artifact, tokens_artifact

    root = tmp_path_factory.mktemp("poisoned")
    train = root / "run" / "train"
    shutil.copytree(Path(run["checkpoints"][-1]).parent.parent, train)
    marker = root / "PWNED"
    payload = pickle.dumps(WritesMarker(str(marker)))
    ckpts = train / "checkpoints"
    tampered = ckpts / "step-000020"
    planted = ckpts / "step-000099"
    shutil.copytree(tampered, planted)
    for d in (tampered, planted):
        for shard in d.glob("*.safetensors"):
            shard.write_bytes(payload)
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
    """A registered copy is checked against its signed manifest (and the version's signed hashes)
    before the project's loader reads it; it holds no loader code (tasks/deploy/mlflow_model.py)."""
    from mlflow import MlflowClient

    from tasks.deploy.generation import TextGenerator
    from tasks.deploy.mlflow_model import download_verified, verify_model_dir
    from tasks.deploy.registry import RegisteredModel, UnverifiedModel, get_version, register

    p = poisoned
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = MlflowClient(tracking_uri=uri).create_experiment("t", artifact_location=(tmp_path / "art").as_uri())
    run_id = MlflowClient(tracking_uri=uri).create_run(exp).info.run_id
    register(uri, "trust", p["good"], p["tokenizer"], {"val_loss": 5.0, "step": 10}, run_id)
    version = get_version(uri, "trust", 1)
    ckpt, tok, copy_hash = download_verified(uri, version, tmp_path / "dl", "the registered copy")
    gen = TextGenerator.from_files(ckpt, tok, expected_tree_sha256=copy_hash)
    assert RegisteredModel(gen).predict(["The"], {"max_tokens": 1}) is not None
    (next(ckpt.glob("*.safetensors"))).write_bytes(pickle.dumps(WritesMarker(str(p["marker"]))))
    with pytest.raises(UnverifiedModel, match="not the file its signed manifest records"):
        verify_model_dir(ckpt.parent, version["tags"], "the registered copy")
    with pytest.raises(Exception, match="does not verify|content hash"):  # the loader's own check too
        TextGenerator.from_files(ckpt, tok, expected_tree_sha256=copy_hash)
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
    (tmp_path / f"job-1{JOB_SUFFIX}").write_bytes(pickle.dumps(WritesMarker(str(marker))))
    (tmp_path / "job-1.pkl").write_bytes(pickle.dumps(WritesMarker(str(marker))))  # the old format
    assert store.load("job-1", "key") is None and not marker.exists()


def test_a_planted_job_result_or_stage_manifest_is_not_reused(tmp_path):
    """A resumable stage reuses a finished job's result, or a whole finished output, on a re-run.
    Its key is derived from the config and inputs, which a writer of the run directory can read: a
    job result or manifest.json written by them (their parts, their hashes, the right key) would
    make the stage take their documents and counts as its own. Both are signed by the stage, and a
    planted one is redone, never reused."""
    from tasks.core.resume import JOB_SUFFIX, MANIFEST, JobStore, verify_manifest

    store = JobStore(tmp_path / "_parts")
    store.dir.mkdir()
    part = tmp_path / "_parts" / "part-0.parquet"
    part.write_bytes(b"genuine rows")
    store.save("job-0", "key", {"parts": [str(part)], "docs": 3})
    assert store.load("job-0", "key") == {"parts": [str(part)], "docs": 3}
    # the attacker swaps the part and writes the result file as the stage would, hashes and all
    part.write_bytes(b"their rows")
    (store.dir / f"job-0{JOB_SUFFIX}").write_text(json.dumps(
        {"key": "key", "part_sha256": {str(part): sha256_file(part)}, "result": {"parts": [str(part)], "docs": 999}}))
    assert store.load("job-0", "key") is None

    out = tmp_path / "out"
    out.mkdir()
    (out / "shard-0.parquet").write_bytes(b"their shard")
    (out / MANIFEST).write_text(json.dumps({"key": "run-key", "summary": {"docs_out": 999}, "files": [
        {"path": "shard-0.parquet", "sha256": sha256_file(out / "shard-0.parquet"), "docs": 999}]}))
    assert verify_manifest(out, "run-key") is None


def test_a_forged_evaluation_event_is_refused(tmp_path, tmp_path_factory):
    """deploy-model treats crucible.eval.completed as a claim: the report must be the one the
    evaluate flow recorded for that checkpoint, the checkpoint unchanged since, and (with a run id)
    the hash and val_loss logged on the training run must match. The outsider's replay of a real
    event with a forged report naming another checkpoint is refused."""
    from mlflow import MlflowClient

    from tasks.config import PipelineConfig
    from tasks.core.io import write_json_atomic
    from tasks.core.layout import RunLayout
    from tasks.deploy.triggered import evaluation_claim_problem, write_gate
    from tasks.evaluate import evaluate_checkpoint
    from tasks.evaluate.evaluate import write_report
    from test_triggers import _make_run

    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_dir, (step10, step20) = _make_run(tmp_path_factory.getbasetemp() / "lm", tmp_path, store)
    cfg = PipelineConfig.model_validate_json((run_dir / "config.json").read_text())
    client = MlflowClient(tracking_uri=store)
    run_id = client.create_run(client.create_experiment("t", artifact_location=(tmp_path / "a").as_uri())).info.run_id
    layout = RunLayout(run_dir)
    reports = {}
    for ckpt in (step10, step20):
        report = evaluate_checkpoint(cfg, ckpt, layout.tokenizer_file, layout.tokens_index,
                                     layout.triggered_eval_report(ckpt), tracking_uri=store, run_id=run_id)
        reports[ckpt] = write_gate(report, {"passed": True, "reason": "test"})
    genuine, problem = evaluation_claim_problem(step10, reports[step10]["report_path"], run_id, store)
    assert problem is None and genuine["checkpoint_sha256"]

    # a forged report elsewhere, claiming a far better val_loss for step 20
    forged = {**reports[step20], "val_loss": 0.01, "report_path": str(tmp_path / "forged.json")}
    write_json_atomic(tmp_path / "forged.json", forged)
    assert "recorded at" in evaluation_claim_problem(step20, tmp_path / "forged.json", run_id, store)[1]
    # the recorded report edited in place: refused, its signature does not verify (tests/test_signed_records.py)
    edited = {**reports[step20], "val_loss": 0.01}
    write_json_atomic(Path(reports[step20]["report_path"]), edited)
    assert "refused" in evaluation_claim_problem(step20, edited["report_path"], run_id, store)[1]
    # even signed (by a holder of the key), its val_loss is not the one logged on the training run
    write_report(edited)
    assert "not the one logged" in evaluation_claim_problem(step20, edited["report_path"], run_id, store)[1]
    # a run id that never evaluated this checkpoint
    other = client.create_run(client.get_run(run_id).info.experiment_id).info.run_id
    assert "records no evaluation" in evaluation_claim_problem(step10, reports[step10]["report_path"], other, store)[1]
    # ... nor a run an outsider tagged with the checkpoint's hash: the tag is unsigned
    from tasks.evaluate.evaluate import eval_hash_tag

    client.set_tag(other, eval_hash_tag(10), genuine["checkpoint_sha256"])
    client.log_metric(other, "val_loss", genuine["val_loss"], step=10)
    assert "records no evaluation" in evaluation_claim_problem(step10, reports[step10]["report_path"], other, store)[1]
    # a report whose gate failed, and a checkpoint that changed since it was evaluated
    write_report({**reports[step20], "gate": {"passed": False, "reason": "worse"}})
    assert "did not pass" in evaluation_claim_problem(step20, reports[step20]["report_path"], None, store)[1]
    (step10 / "extra.bin").write_bytes(b"x")
    assert "changed since" in evaluation_claim_problem(step10, reports[step10]["report_path"], None, store)[1]


def test_a_checkpoint_in_a_store_working_copy_is_loaded_from_the_copy_that_was_verified(tmp_path, monkeypatch):
    """An object-store run's working copy is synced into by other processes: a .metadata replaced
    there right after the check (a sync landing: a new file renamed into place, as RunStore's
    downloads do) must not be what DCP unpickles."""
    from lm_helpers import random_checkpoint, sample_tokenizer
    from tasks.core import storage
    from tasks.train import checkpoint

    monkeypatch.setattr(storage, "_STORES", {})
    store = storage.open_store("s3://runs/crucible", {}, str(tmp_path / "cache"))  # registered, not contacted
    run_dir = store.local_root / "run-1"
    run_dir.mkdir(parents=True)
    ckpt = random_checkpoint(run_dir / "train", sample_tokenizer(tmp_path / "tok.json"), step=5, seed=0)
    marker = tmp_path / "PWNED"
    real_check = checkpoint.checkpoint_problem

    def check_then_sync_lands(*args, **kwargs):
        problem = real_check(*args, **kwargs)
        landed = ckpt / ".tmp-sync-.metadata"
        landed.write_bytes(pickle.dumps(WritesMarker(str(marker))))
        os.replace(landed, ckpt / ".metadata")
        return problem

    monkeypatch.setattr(checkpoint, "checkpoint_problem", check_then_sync_lands)
    model, meta = checkpoint.load_model_for_inference(ckpt)
    assert meta["step"] == 5 and not marker.exists(), "the bytes unpickled were not the bytes verified"


def test_a_local_checkpoint_swapped_after_its_check_is_not_what_loads(tmp_path, monkeypatch):
    """A run directory's writer renames other weights into place right after the check (hashing a
    large checkpoint takes seconds, and inotify says when): the weights loaded are still the ones
    verified, for a plain local run as for a store's working copy."""
    import torch

    from lm_helpers import random_checkpoint, sample_tokenizer
    from tasks.train import checkpoint

    tok = sample_tokenizer(tmp_path / "tok.json")
    ckpt = random_checkpoint(tmp_path / "run" / "train", tok, step=5, seed=0)
    theirs = random_checkpoint(tmp_path / "other" / "train", tok, step=5, seed=1)
    verified, _ = checkpoint.load_model_for_inference(ckpt)
    real_check = checkpoint.checkpoint_problem

    def check_then_swap(*args, **kwargs):
        problem = real_check(*args, **kwargs)
        for shard in Path(theirs).glob("*.safetensors"):
            landed = Path(ckpt) / f".swap-{shard.name}"
            shutil.copy(shard, landed)
            os.replace(landed, Path(ckpt) / shard.name)
        return problem

    monkeypatch.setattr(checkpoint, "checkpoint_problem", check_then_swap)
    model, _ = checkpoint.load_model_for_inference(ckpt)
    assert all(torch.equal(a, b) for a, b in zip(verified.state_dict().values(), model.state_dict().values())), \
        "the weights loaded were not the weights verified"


# ---------------------------------------------------------------- issue 24: no pickle, signed manifests

def _payload(marker: Path) -> bytes:
    payload = pickle.dumps(WritesMarker(str(marker)))
    probe = marker.with_name(marker.name + "-probe")
    pickle.loads(pickle.dumps(WritesMarker(str(probe))))  # the payload is live: unpickling runs it
    assert probe.exists()
    probe.unlink()
    return payload


def _revouch(train: Path, ckpt: Path) -> None:
    """Sign a manifest that vouches for `ckpt`'s files as they are now, with the stack's key: as if every
    check were passed (a key holder fooled). The loaders must then at worst fail to parse a planted file."""
    from tasks.core.signing import read_signed, write_signed
    from tasks.train.checkpoint import MANIFEST, MANIFEST_PURPOSE

    path = train / "checkpoints" / MANIFEST
    manifest = read_signed(path, MANIFEST_PURPOSE)
    for e in manifest["checkpoints"]:
        if e["path"] == ckpt.name:
            e["files"] = {str(f.relative_to(ckpt)): sha256_file(f) for f in sorted(ckpt.rglob("*")) if f.is_file()}
    write_signed(path, manifest, MANIFEST_PURPOSE)


def _never_runs(fn, marker: Path, refused: bool = False) -> None:
    """Call a loader: it may succeed or fail (a planted file at worst fails to parse), but the pickle
    never runs; with `refused`, it must refuse the checkpoint as unverified."""
    from tasks.train.checkpoint import UnverifiedCheckpoint

    try:
        fn()
    except UnverifiedCheckpoint:
        pass
    except Exception:  # noqa: BLE001 - a parse error is a fine outcome, the pickle's running is not
        assert not refused, "expected UnverifiedCheckpoint"
    else:
        assert not refused, "expected UnverifiedCheckpoint"
    assert not marker.exists(), "the pickle ran"


def test_a_pickle_planted_in_any_checkpoint_file_never_runs_on_any_entry_point(run, base, tmp_path):
    """Every file a checkpoint loader reads (each rank's safetensors shard, the meta file, each rank's
    RNG JSON, the manifest, and an old-format `.metadata`) replaced by a marker-writing pickle: every
    entry point (resume's latest_checkpoint and restore, rollback's load_checkpoint, continued
    pretraining's init_from_checkpoint, load_model_for_inference, the model server's TextGenerator and
    the HF export) refuses it while it does not verify, and never runs it even once a signed manifest
    or a tree hash vouches for it."""
    import torch

    from lm_helpers import tokenizer_artifact
    from tasks.core.hashing import sha256_tree
    from tasks.deploy.export import export_hf
    from tasks.deploy.generation import TextGenerator
    from tasks.train.checkpoint import (MANIFEST, init_from_checkpoint, latest_checkpoint, load_checkpoint,
                                        load_model_for_inference, read_meta, restore_checkpoint)
    from tasks.train.model import GPT, GPTConfig

    marker = tmp_path / "PWNED"
    payload = _payload(marker)
    src = Path(run["checkpoints"][-1]).parent.parent
    tok = Path(tokenizer_artifact(base)["path"])
    shape = GPTConfig(**read_meta(run["checkpoints"][0])["model"])
    names = sorted(str(f.relative_to(run["checkpoints"][0])) for f in Path(run["checkpoints"][0]).rglob("*")
                   if f.is_file())
    assert len([n for n in names if n.endswith(".safetensors")]) == 2 and "rng/rank-00001.json" in names  # 2 ranks
    assert not [n for n in names if n.endswith((".metadata", ".distcp", ".pt", ".pkl"))], names

    def entry_points(train: Path, ckpt: Path, refused: bool) -> None:
        def fresh():
            model = GPT(shape)
            return model, torch.optim.AdamW(model.parameters())

        _never_runs(lambda: load_model_for_inference(ckpt), marker, refused)
        _never_runs(lambda: TextGenerator.from_files(ckpt, tok), marker, refused)
        _never_runs(lambda: load_checkpoint(*fresh(), ckpt), marker, refused)
        for rank in (0, 1):
            _never_runs(lambda: restore_checkpoint(*fresh(), ckpt, rank=rank), marker, refused)
        _never_runs(lambda: export_hf(ckpt, tok, tmp_path / "hf-out"), marker, refused)
        _never_runs(lambda: latest_checkpoint(train), marker)
        # a tree hash that matches the planted directory (a forged registry tag): verified, still only parsed
        _never_runs(lambda: init_from_checkpoint(*fresh(), ckpt, sha256_tree(ckpt), with_optimizer=True), marker)

    for i, name in enumerate([*names, ".metadata", MANIFEST]):
        train = tmp_path / f"run-{i}" / "train"
        shutil.copytree(src, train)
        ckpt = train / "checkpoints" / "step-000010"
        planted = train / "checkpoints" / MANIFEST if name == MANIFEST else ckpt / name
        planted.write_bytes(payload)
        entry_points(train, ckpt, refused=True)  # its hash, or the manifest's signature, does not verify
        if name != MANIFEST:
            _revouch(train, ckpt)
            entry_points(train, ckpt, refused=name == "crucible_checkpoint.json")  # the meta's own signature
        shutil.rmtree(train.parent)
    assert not marker.exists()


def test_a_pickle_planted_in_an_hf_export_never_runs(run, base, tmp_path):
    """The HF export's loader (load_exported) reads JSON and safetensors only."""
    from lm_helpers import tokenizer_artifact
    from tasks.deploy.export import export_hf, load_exported

    marker = tmp_path / "PWNED"
    payload = _payload(marker)
    good = tmp_path / "hf"
    export_hf(run["checkpoints"][-1], Path(tokenizer_artifact(base)["path"]), good)
    load_exported(good)
    for f in sorted(p.name for p in good.iterdir()):
        copy = tmp_path / f"hf-{f}"
        shutil.copytree(good, copy)
        (copy / f).write_bytes(payload)
        _never_runs(lambda: load_exported(copy), marker)
    assert not marker.exists()


def _attack_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A run (train dir) with one checkpoint: (train dir, checkpoint)."""
    from lm_helpers import random_checkpoint, sample_tokenizer

    train = tmp_path / "run" / "train"
    return train, random_checkpoint(train, sample_tokenizer(tmp_path / "tok.json"), step=5, seed=0)


def test_a_manifest_whose_hash_was_rewritten_is_refused(tmp_path):
    """The issue's attack: a writer of the run directory replaces the checkpoint's files with a pickle
    (in `.metadata`, which DCP used to unpickle, and in every tensor file) and rewrites their sha256s
    in checkpoints.json. The manifest's signature no longer verifies: every entry point refuses the
    run's checkpoints and the pickle never runs."""
    import torch

    from tasks.train.checkpoint import (MANIFEST, UnverifiedCheckpoint, latest_checkpoint, load_checkpoint,
                                        load_model_for_inference, read_meta, verify_checkpoint)
    from tasks.train.model import GPT, GPTConfig

    train, ckpt = _attack_checkpoint(tmp_path)
    marker = tmp_path / "PWNED"
    payload = _payload(marker)
    model = GPT(GPTConfig(**json.loads((ckpt / "crucible_checkpoint.json").read_text())["model"]))
    manifest_path = train / "checkpoints" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    entry = next(e for e in manifest["checkpoints"] if e["path"] == ckpt.name)
    for name in [".metadata", *(f for f in entry["files"] if f.endswith((".safetensors", ".distcp")))]:
        (ckpt / name).write_bytes(payload)
        entry["files"][name] = sha256_file(ckpt / name)  # the hash rewritten to match the planted file
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")

    with pytest.raises(UnverifiedCheckpoint, match="checkpoint manifest .* signature that does not verify"):
        load_model_for_inference(ckpt)
    assert not marker.exists(), "the pickle ran"
    with pytest.raises(UnverifiedCheckpoint, match="signature that does not verify"):
        load_checkpoint(model, torch.optim.AdamW(model.parameters()), ckpt)
    with pytest.raises(UnverifiedCheckpoint, match="signature that does not verify"):
        latest_checkpoint(train)  # a resume stops with the reason instead of starting over
    assert not verify_checkpoint(ckpt)
    assert read_meta(ckpt)["step"] == 5  # the meta file itself is untouched and still verifies
    assert not marker.exists(), "the pickle ran"


def test_an_unsigned_or_forged_manifest_or_meta_file_is_refused(tmp_path):
    """A manifest without its signature (e.g. written by hand, or by an older version), or with a
    signature made with another key, is refused with the reason; so is a meta file that was edited
    (a model shape or tokenizer hash a loader trusts) or unsigned."""
    from tasks.train.checkpoint import (MANIFEST, UnverifiedCheckpoint, checkpoint_problem, load_model_for_inference,
                                        read_meta)

    train, ckpt = _attack_checkpoint(tmp_path)
    load_model_for_inference(ckpt)  # genuine: loads
    manifest_path = train / "checkpoints" / MANIFEST
    genuine = json.loads(manifest_path.read_text())
    assert genuine["signature"].startswith("hmac-sha256:")

    unsigned = {k: v for k, v in genuine.items() if k != "signature"}
    manifest_path.write_text(json.dumps(unsigned))
    with pytest.raises(UnverifiedCheckpoint, match="checkpoint manifest .* is unsigned"):
        load_model_for_inference(ckpt)
    assert "is unsigned" in checkpoint_problem(ckpt)
    manifest_path.write_text(json.dumps({**genuine, "signature": "hmac-sha256:" + "0" * 64}))
    with pytest.raises(UnverifiedCheckpoint, match="does not verify"):
        load_model_for_inference(ckpt)
    manifest_path.write_text(json.dumps(genuine))
    load_model_for_inference(ckpt)

    meta_path = ckpt / "crucible_checkpoint.json"
    meta = json.loads(meta_path.read_text())
    for forged in ({**meta, "tokenizer_sha256": "0" * 64}, {k: v for k, v in meta.items() if k != "signature"}):
        meta_path.write_text(json.dumps(forged))
        with pytest.raises(UnverifiedCheckpoint, match="checkpoint meta file"):
            read_meta(ckpt)
        # the manifest's hash of the meta file no longer matches either; a copy loaded by its tree hash
        # (a registered model, a champion) is refused for the meta's signature alone
        from tasks.core.hashing import sha256_tree

        with pytest.raises(UnverifiedCheckpoint, match="checkpoint meta file"):
            load_model_for_inference(ckpt, expected_tree_sha256=sha256_tree(ckpt))


def test_a_private_copy_left_by_a_killed_loader_is_swept(tmp_path):
    """A loader killed mid-load leaves its private copy (hard links) beside the checkpoint; the next
    load removes it, so it cannot keep the bytes of checkpoints retention deleted. A live loader's
    copy stays."""
    import subprocess
    import sys

    from lm_helpers import random_checkpoint, sample_tokenizer
    from tasks.train import checkpoint

    ckpt = random_checkpoint(tmp_path / "run" / "train", sample_tokenizer(tmp_path / "tok.json"), step=5, seed=0)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    left = Path(ckpt).parent.parent / f".crucible-verified-{dead.pid}-abc"
    live = Path(ckpt).parent.parent / f".crucible-verified-{os.getpid()}-xyz"
    for d in (left, live):
        shutil.copytree(ckpt, d / Path(ckpt).name)
    checkpoint.load_model_for_inference(ckpt)
    assert not left.exists() and live.exists()
