"""The MLflow model registry side of deployment: who is champion, and registering a new one.

A registered version is an MLflow pyfunc model (tasks/deploy/mlflow_model.py, "models from code")
whose artifacts are an inference-only export of the checkpoint (model weights, no optimizer state)
and the tokenizer. Evaluation results, the training run id and the data lineage (sources and
licences, tokenizer / val-split hashes, the run's lineage log) are model-version tags, so the gate
can read the champion's val_loss back without touching runs.

Aliases: a version that passed the gate is registered as `challenger`; only once it is verified
(served, or loaded and run) does `promote` move `champion` to it (and drop `challenger`). A
challenger that fails verification is `reject`ed (tagged with the reason); the champion stays.
Only MlflowClient with an explicit tracking URI is used (no global state).
"""
from __future__ import annotations

import json
import logging
import re
import tempfile
import warnings
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tasks.core.hashing import sha256_file, sha256_text, sha256_tree

log = logging.getLogger(__name__)

ALIAS = "champion"
CHALLENGER = "challenger"
REGISTRY_EXPERIMENT = "crucible-registry"
MODEL_CODE = Path(__file__).with_name("mlflow_model.py")
# What loading the pyfunc needs besides the crucible package itself (pinned as in pyproject.toml).
PIP_REQUIREMENTS = ["torch==2.13.0", "tokenizers==0.23.3", "mlflow==3.17.2", "numpy>=2,<3"]
_EXPECTED_WARNINGS = re.compile(r"type hints|input example|assuming the intent is to (save|load) in a single process")
EVAL_TAGS = ("val_loss", "perplexity", "step", "val_tokens", "report_path", "run_name",
             "tokenizer_sha256", "val_sha256")


def _client(tracking_uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _missing(e: MlflowException) -> bool:
    if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND") or e.get_http_status_code() == 404:
        return True
    # a registered model without the alias: MLflow answers INVALID_PARAMETER_VALUE "alias ... not found"
    return e.error_code == "INVALID_PARAMETER_VALUE" and "alias" in e.message and "not found" in e.message


class UnverifiedModel(RuntimeError):
    """A registered version whose files cannot be verified (gone, changed, or a copy that does not match)."""


def get_version(tracking_uri: str, model_name: str, version: int | None = None, alias: str | None = None) -> dict:
    """A registered version by number or alias, in get_champion's shape; raises LookupError if there is none."""
    client = _client(tracking_uri)
    try:
        mv = (client.get_model_version(model_name, str(version)) if version is not None
              else client.get_model_version_by_alias(model_name, alias))
    except MlflowException as e:
        if _missing(e):
            raise LookupError(f"{model_name} has no version {version if version is not None else repr(alias)}") from None
        raise
    return {"version": int(mv.version), "run_id": mv.run_id, "source": mv.source, "tags": dict(mv.tags)}


def get_champion(tracking_uri: str, model_name: str) -> dict | None:
    """The version with alias `champion`: {version, val_loss, run_id, source, tags}; None if the
    model or the alias does not exist. val_loss is None if the version has no val_loss tag."""
    try:
        mv = _client(tracking_uri).get_model_version_by_alias(model_name, ALIAS)
    except MlflowException as e:
        if _missing(e):
            return None
        raise
    try:
        val_loss = float(mv.tags["val_loss"])
    except (KeyError, TypeError, ValueError):
        val_loss = None
    return {"version": int(mv.version), "val_loss": val_loss, "run_id": mv.run_id, "source": mv.source,
            "tags": dict(mv.tags)}


def model_content_hash(ckpt_dir: str | Path, tokenizer_path: str | Path) -> str:
    """sha256 identifying what was registered: the checkpoint directory's tree hash and the
    tokenizer file's hash (reproducible: does not depend on the export)."""
    return content_hash_of(sha256_tree(ckpt_dir), sha256_file(tokenizer_path))


def content_hash_of(checkpoint_tree_sha256: str, tokenizer_sha256: str) -> str:
    """model_content_hash from the two hashes already computed."""
    return sha256_text(f"checkpoint {checkpoint_tree_sha256}\ntokenizer {tokenizer_sha256}\n")


def export_for_inference(ckpt_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the checkpoint's model weights only (DCP, key "model") plus its metadata JSON;
    `tasks.train.checkpoint.load_model_for_inference` reads the export like the original."""
    import torch.distributed.checkpoint as dcp

    from tasks.train.checkpoint import META_FILE, load_model_for_inference

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings(record=True) as caught:  # DCP warns that there is no process group
        warnings.simplefilter("always")
        model, meta = load_model_for_inference(ckpt_dir)
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(out), no_dist=True)
    for w in caught:
        if not _EXPECTED_WARNINGS.search(str(w.message)):
            log.warning("while exporting %s: %s", ckpt_dir, w.message)
    meta = {**meta, "exported_from": str(Path(ckpt_dir).resolve()), "contents": "model weights only"}
    (out / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def _artifact_run(client: MlflowClient, tracking_uri: str, model_name: str) -> str:
    """A run to hold the model's files when no training run id is given."""
    exp = client.get_experiment_by_name(REGISTRY_EXPERIMENT)
    if exp is not None:
        exp_id = exp.experiment_id
    else:
        location = None
        if tracking_uri.startswith("sqlite:///"):  # keep artifacts beside the database, not in ./mlruns
            location = (Path(tracking_uri[len("sqlite:///"):]).resolve().parent / "mlartifacts").as_uri()
        exp_id = client.create_experiment(REGISTRY_EXPERIMENT, artifact_location=location)
    run = client.create_run(exp_id, run_name=f"register-{model_name}", tags={"crucible.stage": "register"})
    return run.info.run_id


def register(tracking_uri: str, model_name: str, ckpt_dir: str | Path, tokenizer_path: str | Path,
             eval_result: dict, run_id: str | None, extra_tags: dict | None = None,
             content_hash: str | None = None) -> dict:
    """Log the checkpoint + tokenizer as a pyfunc model, register it as a new version of
    `model_name`, tag it with the evaluation results (val_loss, perplexity, step, eval.<metric> for
    every task metric), the training run id and `extra_tags` (data lineage), and point the alias
    `challenger` at it (`promote` makes it champion). The files are logged under the training run
    (`run_id`); without one, under a run of the experiment "crucible-registry".

    Returns {"model_name", "version", "alias", "content_hash", "source", "run_id"}.
    """
    import mlflow.pyfunc
    from mlflow.models import infer_signature

    from tasks.deploy.generation import PYFUNC_PARAMS

    ckpt_dir, tokenizer_path = Path(ckpt_dir).resolve(), Path(tokenizer_path).resolve()
    client = _client(tracking_uri)
    content_hash = content_hash or model_content_hash(ckpt_dir, tokenizer_path)  # given: the caller hashed them
    own_run = run_id is None
    target_run = run_id or _artifact_run(client, tracking_uri, model_name)
    artifact_path = f"registered_model/{ckpt_dir.name}-{content_hash[:12]}"
    status = "FAILED"
    try:
        with tempfile.TemporaryDirectory(prefix="crucible-register-") as tmp:
            export = export_for_inference(ckpt_dir, Path(tmp) / "checkpoint")
            # what a download of the registered copy is verified against (tasks/deploy/yardstick.py)
            copy_hashes = {"export_sha256": sha256_tree(export), "tokenizer_sha256": sha256_file(tokenizer_path)}
            model_dir = Path(tmp) / "model"
            # MLflow resets warning filters inside save_model, so its advice to add type hints and an
            # input example (the signature is given explicitly, see mlflow_model.py) is caught here
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                mlflow.pyfunc.save_model(
                    path=str(model_dir), python_model=str(MODEL_CODE),
                    artifacts={"checkpoint": str(export), "tokenizer": str(tokenizer_path)},
                    pip_requirements=PIP_REQUIREMENTS, model_config={"export_sha256": copy_hashes["export_sha256"]},
                    signature=infer_signature(["The Linux kernel"], ["is a free"], params=PYFUNC_PARAMS),
                    metadata={"crucible_content_hash": content_hash, "source_checkpoint": str(ckpt_dir),
                              "requires": "the crucible package (tasks.train, tasks.deploy) importable"})
            for w in caught:
                if not _EXPECTED_WARNINGS.search(str(w.message)):
                    log.warning("while saving the model: %s", w.message)
            client.log_artifacts(target_run, str(model_dir), artifact_path)
        status = "FINISHED"
    finally:
        if own_run:
            client.set_terminated(target_run, status=status)
    source = f"{client.get_run(target_run).info.artifact_uri.rstrip('/')}/{artifact_path}"

    try:
        client.create_registered_model(model_name, tags={"crucible.model": "gpt"},
                                       description="Crucible GPT; alias `champion` is the served version.")
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    tags = {f"eval.{k}" if k not in ("val_loss", "perplexity", "step") else k: str(eval_result[k])
            for k in EVAL_TAGS if eval_result.get(k) is not None}
    tags.update({f"eval.{k}": str(v) for k, v in (eval_result.get("task_metrics") or {}).items() if v is not None})
    tags.update({k: str(v)[:5000] for k, v in (extra_tags or {}).items() if v is not None})
    tags.update(copy_hashes)
    tags.update({"train_run_id": str(run_id or ""), "content_hash": content_hash,
                 "checkpoint": str(ckpt_dir), "tokenizer": str(tokenizer_path), "deployment.status": CHALLENGER})
    mv = client.create_model_version(model_name, source=source, run_id=target_run, tags=tags,
                                     description=f"checkpoint {ckpt_dir.name}, val_loss {eval_result.get('val_loss')}")
    client.set_registered_model_alias(model_name, CHALLENGER, mv.version)
    return {"model_name": model_name, "version": int(mv.version), "alias": CHALLENGER, "content_hash": content_hash,
            "source": source, "run_id": target_run}


def _drop_challenger(client: MlflowClient, model_name: str, version: int) -> None:
    """Remove the alias `challenger` if it still points at `version` (a later one may own it)."""
    try:
        mv = client.get_model_version_by_alias(model_name, CHALLENGER)
    except MlflowException as e:
        if _missing(e):
            return
        raise
    if int(mv.version) == int(version):
        client.delete_registered_model_alias(model_name, CHALLENGER)


def promote(tracking_uri: str, model_name: str, version: int, verified: str) -> None:
    """Move `champion` to a verified challenger; `verified` says how (tag deployment.verified)."""
    client = _client(tracking_uri)
    previous = get_champion(tracking_uri, model_name)
    client.set_model_version_tag(model_name, str(version), "deployment.verified", verified)
    # status tag first: whoever finds the version by the alias already sees it as champion
    client.set_model_version_tag(model_name, str(version), "deployment.status", ALIAS)
    client.set_registered_model_alias(model_name, ALIAS, str(version))
    if previous is not None and previous["version"] != int(version):  # one version tagged champion
        client.set_model_version_tag(model_name, str(previous["version"]), "deployment.status", "superseded")
    _drop_challenger(client, model_name, version)


def reject(tracking_uri: str, model_name: str, version: int, reason: str) -> None:
    """A challenger that failed verification: tagged rejected with the reason; champion unchanged."""
    client = _client(tracking_uri)
    client.set_model_version_tag(model_name, str(version), "deployment.status", "rejected")
    client.set_model_version_tag(model_name, str(version), "deployment.reason", reason[:5000])
    _drop_challenger(client, model_name, version)


def set_version_tags(tracking_uri: str, model_name: str, version: int, tags: dict) -> None:
    client = _client(tracking_uri)
    for key, value in tags.items():
        client.set_model_version_tag(model_name, str(version), key, str(value)[:5000])


def registered_files(tracking_uri: str, model_name: str, version: dict, cache_dir: str | Path
                   ) -> tuple[Path, Path, str | None]:
    """(checkpoint, tokenizer, copy hash) of a registered version (a get_champion / get_version
    dict), verified: its own files if they still hash to the registered content hash (copy hash
    None: its run's manifest vouches for it), else its registered copy from MLflow, verified against the hashes recorded when it was
    registered (copy hash: export_sha256, for loading it). Raises UnverifiedModel when neither
    verifies."""
    tags = version["tags"]
    ckpt, tok = Path(tags.get("checkpoint", "")), Path(tags.get("tokenizer", ""))
    if tags.get("checkpoint") and ckpt.is_dir() and tok.is_file():
        if content_hash_of(sha256_tree(ckpt), sha256_file(tok)) == tags.get("content_hash"):
            return ckpt, tok, None
        log.warning("version %s's files %s / %s no longer match its content hash", version["version"], ckpt, tok)
    if not (tags.get("export_sha256") and tags.get("tokenizer_sha256")):
        raise UnverifiedModel(f"version {version['version']}'s files ({ckpt}, {tok}) are gone or changed and "
                              "it was registered without the hashes that would verify its registered copy")
    local = Path(cache_dir) / f"{model_name}-v{version['version']}"
    if not (local / "verified").is_file():
        import mlflow.artifacts

        local.mkdir(parents=True, exist_ok=True)
        mlflow.artifacts.download_artifacts(artifact_uri=version["source"], dst_path=str(local),
                                            tracking_uri=tracking_uri)
    arts = next(local.rglob("artifacts"), None)
    ckpt = arts / "checkpoint" if arts else local / "missing"
    toks = [p for p in arts.iterdir() if p.is_file()] if arts else []
    if (not ckpt.is_dir() or len(toks) != 1 or sha256_tree(ckpt) != tags["export_sha256"]
            or sha256_file(toks[0]) != tags["tokenizer_sha256"]):
        raise UnverifiedModel(f"the registered copy of version {version['version']} ({version['source']}) "
                              "does not match the hashes recorded at registration")
    (local / "verified").write_text("checked against export_sha256 and tokenizer_sha256\n")
    return ckpt, toks[0], tags["export_sha256"]


def record_gate(tracking_uri: str, run_id: str | None, step: int | None, decision: dict,
                yardstick: dict | None = None) -> None:
    """The gate's verdict on the training run: tags gate.step-N.passed / .reason and the metric
    gate_passed (1/0) at the checkpoint's step; gated on the yardstick, also the set's hash, the
    champion's version and both models' bits per byte (metrics gate_<who>_bpb_<part>). Nothing
    without a run id."""
    if not run_id:
        return
    import time

    from mlflow.entities import Metric, RunTag

    key = f"gate.step-{int(step) if step is not None else 'unknown'}"
    now, at = int(time.time() * 1000), int(step or 0)
    metrics = [Metric("gate_passed", float(bool(decision["passed"])), now, at)]
    tags = [RunTag(f"{key}.passed", str(bool(decision["passed"])).lower()),
            RunTag(f"{key}.reason", str(decision["reason"])[:5000])]
    if yardstick:
        tags += [RunTag(f"{key}.yardstick_sha256", yardstick["set"]["sha256"]),
                 RunTag(f"{key}.champion_version", str(yardstick["champion"]["version"]))]
        metrics += [Metric(f"gate_{who}_bpb_{part}", float(v), now, at)
                    for who in ("challenger", "champion") for part, v in yardstick[who]["bits_per_byte"].items()]
    _client(tracking_uri).log_batch(run_id, metrics=metrics, tags=tags)


def verify_registered(tracking_uri: str, model_name: str, version: int) -> str:
    """Load version `version` back from the registry as a pyfunc and generate one token; returns
    what was checked. Raises if the model cannot be loaded or does not answer."""
    import mlflow.artifacts
    import mlflow.pyfunc

    source = _client(tracking_uri).get_model_version(model_name, str(version)).source
    with tempfile.TemporaryDirectory(prefix="crucible-verify-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        local = mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=tmp, tracking_uri=tracking_uri)
        out = mlflow.pyfunc.load_model(local).predict(["The"], params={"max_tokens": 1, "temperature": 0.0})
    if len(out) != 1 or not isinstance(out[0], str):
        raise RuntimeError(f"the registered model answered {out!r}")
    return "loaded from the registry and generated"
