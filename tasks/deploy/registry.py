"""The MLflow model registry side of deployment: who is champion, and registering a new one.

A registered version is an MLflow pyfunc model (tasks/deploy/mlflow_model.py, "models from code")
whose artifacts are an inference-only export of the checkpoint (model weights, no optimizer state)
and the tokenizer. Evaluation results and the training run id are model-version tags, so the gate
can read the champion's val_loss back without touching runs. The alias `champion` marks the
version being served. Only MlflowClient with an explicit tracking URI is used (no global state).
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
    return e.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND") or e.get_http_status_code() == 404


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


def champion_val_loss(tracking_uri: str, model_name: str) -> float | None:
    champ = get_champion(tracking_uri, model_name)
    return champ["val_loss"] if champ else None


def model_content_hash(ckpt_dir: str | Path, tokenizer_path: str | Path) -> str:
    """sha256 identifying what was registered: the checkpoint directory's tree hash and the
    tokenizer file's hash (reproducible: does not depend on the export)."""
    return sha256_text(f"checkpoint {sha256_tree(ckpt_dir)}\ntokenizer {sha256_file(tokenizer_path)}\n")


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
             eval_result: dict, run_id: str | None) -> dict:
    """Log the checkpoint + tokenizer as a pyfunc model, register it as a new version of
    `model_name`, tag it with the evaluation results and the training run id, and point the alias
    `champion` at it. The files are logged under the training run (`run_id`); without one, under a
    run of the experiment "crucible-registry".

    Returns {"model_name", "version", "alias", "content_hash", "source", "run_id"}.
    """
    import mlflow.pyfunc
    from mlflow.models import infer_signature

    from tasks.deploy.generation import PYFUNC_PARAMS

    ckpt_dir, tokenizer_path = Path(ckpt_dir).resolve(), Path(tokenizer_path).resolve()
    client = _client(tracking_uri)
    content_hash = model_content_hash(ckpt_dir, tokenizer_path)
    own_run = run_id is None
    target_run = run_id or _artifact_run(client, tracking_uri, model_name)
    artifact_path = f"registered_model/{ckpt_dir.name}-{content_hash[:12]}"
    status = "FAILED"
    try:
        with tempfile.TemporaryDirectory(prefix="crucible-register-") as tmp:
            export = export_for_inference(ckpt_dir, Path(tmp) / "checkpoint")
            model_dir = Path(tmp) / "model"
            # MLflow resets warning filters inside save_model, so its advice to add type hints and an
            # input example (the signature is given explicitly, see mlflow_model.py) is caught here
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                mlflow.pyfunc.save_model(
                    path=str(model_dir), python_model=str(MODEL_CODE),
                    artifacts={"checkpoint": str(export), "tokenizer": str(tokenizer_path)},
                    pip_requirements=PIP_REQUIREMENTS,
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
    tags.update({"train_run_id": str(run_id or ""), "content_hash": content_hash,
                 "checkpoint": str(ckpt_dir), "tokenizer": str(tokenizer_path)})
    mv = client.create_model_version(model_name, source=source, run_id=target_run, tags=tags,
                                     description=f"checkpoint {ckpt_dir.name}, val_loss {eval_result.get('val_loss')}")
    client.set_registered_model_alias(model_name, ALIAS, mv.version)
    return {"model_name": model_name, "version": int(mv.version), "alias": ALIAS, "content_hash": content_hash,
            "source": source, "run_id": target_run}
