"""The MLflow model registry side of deployment: who is champion, and registering a new one.

A registered version's files are plain artifacts: an inference-only export of the checkpoint (model
weights, no optimizer state), the tokenizer and a signed manifest of every file's sha256
(tasks/deploy/mlflow_model.py). There is no MLmodel and no loader code: nothing in the artifact store
runs when a version is loaded; `load_registered` (below) verifies the manifest's
signature and every hash before it reads a byte of the weights. Evaluation results, the training run
id and the data lineage (sources and licences, tokenizer / val-split hashes, the token index) are
model-version tags, so the gate can read the champion back without touching runs.

The registry is not a trust anchor by itself (anyone who can reach MLflow can write a tag or move an
alias), so every tag the pipeline writes is signed with the stack's key (tasks/core/signing.py): its
signature is the companion tag `sig.<name>`, binding the tag's name and value to the model name and
version, so a signed tag cannot be moved to another tag or version. `get_version` / `get_champion`
return only the tags that verify (`tags`); the others are refused, logged and named in
`untrusted_tags`. An alias counts only if the version's signed `deployment.status` names it: an
alias moved by someone else is refused, and the champion is the version whose signed status says so.
Tags the gate writes on the training run (`record_gate`) are signed the same way (bound to the run).

Aliases: a version that passed the gate is registered as `challenger`; only once it is verified
(served, or loaded and run) does `promote` move `champion` to it (and drop `challenger`). A
challenger that fails verification is `reject`ed (tagged with the reason); the champion stays.
Only MlflowClient with an explicit tracking URI is used (no global state).
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tasks.core import fs
from tasks.core.hashing import sha256_file, sha256_text
from tasks.core.storage import stored
from tasks.core.signing import SignatureError, sign_value, verify_value
# UnverifiedModel is raised here too (callers import it from this module)
from tasks.deploy.mlflow_model import UnverifiedModel, download_verified, verify_model_dir, write_model_dir

log = logging.getLogger(__name__)

ALIAS = "champion"
CHALLENGER = "challenger"
REGISTRY_EXPERIMENT = "crucible-registry"
SIG = "sig."  # a signed tag's signature is the tag sig.<name>
TAG_PURPOSE = "registry-tag"
RUN_TAG_PURPOSE = "run-tag"
EVAL_TAGS = ("val_loss", "perplexity", "step", "val_tokens", "report_path", "run_name",
             "tokenizer_sha256", "val_sha256")
MAX_TAG = 5000  # MLflow's limit on a tag's value: what is signed is what is stored


def _client(tracking_uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _missing(e: MlflowException) -> bool:
    if e.error_code in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND") or e.get_http_status_code() == 404:
        return True
    # a registered model without the alias: MLflow answers INVALID_PARAMETER_VALUE "alias ... not found"
    return e.error_code == "INVALID_PARAMETER_VALUE" and "alias" in e.message and "not found" in e.message


def _tag_purpose(model_name: str, version: int | str) -> str:
    return f"{TAG_PURPOSE} {model_name} v{int(version)}"


def _tag_values(tags: dict) -> dict:
    """Tags as MLflow stores them (strings of at most MAX_TAG characters; None left out)."""
    return {str(k): str(v)[:MAX_TAG] for k, v in tags.items() if v is not None}


def _signatures(tags: dict, purpose: str) -> dict:
    """sig.<name> -> signature of each tag's stored value."""
    return {SIG + k: sign_value(k, v, purpose) for k, v in _tag_values(tags).items()}


def _verified(raw: dict, purpose: str, what: str) -> tuple[dict, list[str]]:
    """(tags whose signature verifies, names of the others): unsigned or forged tags are refused."""
    trusted, unsigned, forged = {}, [], []
    for k, v in raw.items():
        if k.startswith(SIG):
            continue
        if raw.get(SIG + k) is None:
            unsigned.append(k)
            continue
        try:
            trusted[k] = verify_value(k, v, raw[SIG + k], purpose)  # logs a forged one as refused
        except SignatureError:
            forged.append(k)
    if unsigned:
        log.warning("refused: %s has unsigned tags, not used: %s", what, ", ".join(sorted(unsigned)))
    return trusted, sorted(unsigned + forged)


def signed_version_tags(model_name: str, version: int | str, tags: dict) -> dict:
    """The tags with their signatures (sig.<name>), bound to this model name and version."""
    return {**_tag_values(tags), **_signatures(tags, _tag_purpose(model_name, version))}


def verified_version_tags(model_name: str, version: int | str, raw: dict) -> tuple[dict, list[str]]:
    """(the version's tags that verify, names of the refused ones)."""
    return _verified(raw, _tag_purpose(model_name, version), f"{model_name} version {version}")


def signed_run_tags(run_id: str, tags: dict) -> dict:
    """Run tags with their signatures (sig.<name>), bound to the run."""
    return {**_tag_values(tags), **_signatures(tags, f"{RUN_TAG_PURPOSE} {run_id}")}


def verified_run_tags(tracking_uri: str, run_id: str, names: tuple[str, ...] | None = None) -> tuple[dict, list[str]]:
    """(the run's tags that verify, names of the refused ones): what the pipeline may read back;
    `names`: only those tags (a run also carries tags nobody reads back, which are not refused)."""
    raw = _client(tracking_uri).get_run(run_id).data.tags
    # MLflow's own system tags (mlflow.*) are not the pipeline's records: not reported as refused
    raw = {k: v for k, v in raw.items() if not k.startswith("mlflow.")
           and (names is None or k in names or k.removeprefix(SIG) in names)}
    return _verified(raw, f"{RUN_TAG_PURPOSE} {run_id}", f"run {run_id}")


def _version(model_name: str, mv) -> dict:
    """get_version's shape of an MLflow ModelVersion: only verified tags."""
    tags, refused = verified_version_tags(model_name, mv.version, dict(mv.tags))
    try:
        val_loss = float(tags["val_loss"])
    except (KeyError, TypeError, ValueError):
        val_loss = None
    return {"version": int(mv.version), "val_loss": val_loss, "run_id": mv.run_id, "source": mv.source,
            "tags": tags, "untrusted_tags": refused}


def _by_alias(client: MlflowClient, model_name: str, alias: str) -> dict | None:
    """The version `alias` points at, if its signed deployment.status names the alias; else None
    (logged as refused: someone else moved the alias, or it points at an unsigned version)."""
    try:
        mv = client.get_model_version_by_alias(model_name, alias)
    except MlflowException as e:
        if _missing(e):
            return None
        raise
    found = _version(model_name, mv)
    if found["tags"].get("deployment.status") == alias:
        return found
    log.warning("refused: alias %r of %s points at version %s, whose signed deployment.status is %r, not %r",
                alias, model_name, found["version"], found["tags"].get("deployment.status"), alias)
    return None


def get_version(tracking_uri: str, model_name: str, version: int | None = None, alias: str | None = None) -> dict:
    """A registered version by number or alias, in get_champion's shape (verified tags only, the
    refused ones named in `untrusted_tags`); raises LookupError if there is none. An alias counts
    only if the version's signed deployment.status names it (`champion`: see get_champion)."""
    client = _client(tracking_uri)
    if version is None and alias == ALIAS:
        found = get_champion(tracking_uri, model_name)
    elif version is None:
        found = _by_alias(client, model_name, alias)
    else:
        try:
            found = _version(model_name, client.get_model_version(model_name, str(version)))
        except MlflowException as e:
            if not _missing(e):
                raise
            found = None
    if found is None:
        raise LookupError(f"{model_name} has no version {version if version is not None else repr(alias)} "
                          "that verifies")
    return found


def get_champion(tracking_uri: str, model_name: str) -> dict | None:
    """The champion: {version, val_loss, run_id, source, tags, untrusted_tags}, tags verified; None
    if there is none. The alias `champion` counts only if its version's signed deployment.status is
    champion; otherwise (moved by someone else, deleted) the champion is the version whose signed
    status says so (the newest, should an old signed status have been put back). val_loss is None if
    the version has no verified val_loss tag."""
    client = _client(tracking_uri)
    found = _by_alias(client, model_name, ALIAS)
    if found is not None:
        return found
    try:
        versions = client.search_model_versions(f"name = '{model_name}'")
    except MlflowException as e:
        if _missing(e):
            return None
        raise
    signed = [v for v in (_version(model_name, mv) for mv in versions) if v["tags"].get("deployment.status") == ALIAS]
    if not signed:
        return None
    best = max(signed, key=lambda v: v["version"])
    log.warning("%s: the alias %r is not on a verified champion; the champion is version %s (its signed "
                "deployment.status)", model_name, ALIAS, best["version"])
    return best


def model_content_hash(ckpt_dir: str | Path, tokenizer_path: str | Path) -> str:
    """sha256 identifying what was registered: the checkpoint directory's tree hash and the
    tokenizer file's hash (reproducible: does not depend on the export). Either may be an object of
    an open store (an object-store run's checkpoint: hashed there, its objects streamed)."""
    return content_hash_of(fs.tree_sha256(*stored(ckpt_dir)), fs.sha256(*stored(tokenizer_path)))


def _still_there(ckpt: Path | str, tok: Path | str) -> bool:
    """A version's own checkpoint and tokenizer are still there (on a store: one this process has
    open; any other process, e.g. the model server, takes the registered copy)."""
    if any(fs.is_remote(x) and stored(x)[1] is None for x in (ckpt, tok)):
        return False
    try:
        return bool(fs.files(*stored(ckpt))) and fs.is_file(*stored(tok))
    except (OSError, ValueError, ImportError) as e:  # a store this process cannot read: its registered copy
        log.warning("cannot read %s here (%s): using its registered copy", ckpt, e)
        return False


def content_hash_of(checkpoint_tree_sha256: str, tokenizer_sha256: str) -> str:
    """model_content_hash from the two hashes already computed."""
    return sha256_text(f"checkpoint {checkpoint_tree_sha256}\ntokenizer {tokenizer_sha256}\n")


def export_for_inference(ckpt_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the checkpoint's model weights only, in the checkpoint format (safetensors, signed meta
    file: tasks.train.checkpoint.save_model_copy), once the checkpoint verifies;
    `tasks.train.checkpoint.load_model_for_inference` reads the export like the original."""
    return _export(ckpt_dir, out_dir)[0]


def _export(ckpt_dir: str | Path, out_dir: str | Path, expected_tree_sha256: str | None = None,
            exported_from: str | Path | None = None) -> tuple[Path, str, dict]:
    """`export_for_inference` (the checkpoint verified against `expected_tree_sha256` when given):
    (export, the tree hash of the verified copy exported, its meta)."""
    from tasks.train.checkpoint import load_verified_model, save_model_copy

    at, options = stored(ckpt_dir)  # a checkpoint on a store: downloaded to a temp folder and verified there
    model, meta, tree = load_verified_model(at, expected_tree_sha256=expected_tree_sha256, storage_options=options)
    meta = {**meta, "exported_from": str(fs.canonical(exported_from or ckpt_dir)), "contents": "model weights only"}
    return save_model_copy(model, meta, out_dir), tree, meta


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
             content_hash: str | None = None, copy: tuple[Path, str, Path] | None = None) -> dict:
    """Log the checkpoint's weights-only export + tokenizer + signed manifest as plain artifacts
    (tasks/deploy/mlflow_model.py), register them as a new version of `model_name`, tag it (signed)
    with the evaluation results (val_loss, perplexity, step, eval.<metric> for every task metric),
    the training run id and `extra_tags` (data lineage), and point the alias `challenger` at it
    (`promote` makes it champion). The files are logged under the training run (`run_id`); without
    one, under a run of the experiment "crucible-registry".

    `copy`: (checkpoint, its tree hash, tokenizer), a local copy of both verified by the caller
    (deploy.servable), registered in their place. What is registered is what is hashed: the export's
    verified copy and the tokenizer bytes read once give the content hash, which must equal
    `content_hash` when given; the tokenizer must be the one the checkpoint's signed meta names.

    Returns {"model_name", "version", "alias", "content_hash", "source", "run_id"}.
    """

    ckpt_dir, tokenizer_path = fs.canonical(ckpt_dir), fs.canonical(tokenizer_path)
    client = _client(tracking_uri)
    own_run = run_id is None
    target_run = run_id or _artifact_run(client, tracking_uri, model_name)
    status = "FAILED"
    try:
        with tempfile.TemporaryDirectory(prefix="crucible-register-") as tmp:
            model_dir = Path(tmp) / "model"
            tok_file = Path(tmp) / "tokenizer.json"
            source, tree, tok_source = copy or (ckpt_dir, None, tokenizer_path)
            fs.write_bytes(tok_file, fs.read_bytes(*stored(tok_source)))  # a store run's: read there, once
            export, tree, meta = _export(source, Path(tmp) / "export", tree, exported_from=ckpt_dir)
            tok_sha = sha256_file(tok_file)
            if meta.get("tokenizer_sha256") and meta["tokenizer_sha256"] != tok_sha:
                raise ValueError(f"tokenizer {tokenizer_path} is not the one checkpoint {ckpt_dir} was trained with")
            registered = content_hash_of(tree, tok_sha)
            if content_hash and content_hash != registered:
                raise UnverifiedModel(f"{ckpt_dir} and {tokenizer_path} are not the model hashed for registration "
                                      f"(content hash {registered[:16]}..., not {content_hash[:16]}...)")
            content_hash = registered
            artifact_path = f"registered_model/{fs.name_of(ckpt_dir)}-{content_hash[:12]}"
            manifest = write_model_dir(model_dir, export, tok_file, content_hash, ckpt_dir)
            # what a download of the registered copy is verified against (tasks/deploy/yardstick.py)
            copy_hashes = {k: manifest[k] for k in ("export_sha256", "tokenizer_sha256")}
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
    tags.update(extra_tags or {})
    tags.update(copy_hashes)
    tags.update({"train_run_id": str(run_id or ""), "content_hash": content_hash,
                 "checkpoint": str(ckpt_dir), "tokenizer": str(tokenizer_path), "deployment.status": CHALLENGER})
    tags = _tag_values(tags)
    mv = client.create_model_version(model_name, source=source, run_id=target_run, tags=tags,
                                     description=f"checkpoint {fs.name_of(ckpt_dir)}, val_loss {eval_result.get('val_loss')}")
    # the version number binds the signatures, so they follow once MLflow has given it
    for key, sig in _signatures(tags, _tag_purpose(model_name, mv.version)).items():
        client.set_model_version_tag(model_name, str(mv.version), key, sig)
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
    # status tag first: whoever finds the version by the alias already sees it as champion
    set_version_tags(tracking_uri, model_name, version, {"deployment.verified": verified, "deployment.status": ALIAS})
    client.set_registered_model_alias(model_name, ALIAS, str(version))
    if previous is not None and previous["version"] != int(version):  # one version tagged champion
        set_version_tags(tracking_uri, model_name, previous["version"], {"deployment.status": "superseded"})
    _drop_challenger(client, model_name, version)


def reject(tracking_uri: str, model_name: str, version: int, reason: str) -> None:
    """A challenger that failed verification: tagged rejected with the reason; champion unchanged."""
    set_version_tags(tracking_uri, model_name, version, {"deployment.status": "rejected", "deployment.reason": reason})
    _drop_challenger(_client(tracking_uri), model_name, version)


def set_version_tags(tracking_uri: str, model_name: str, version: int, tags: dict) -> None:
    """Set model-version tags, each signed (sig.<name>, bound to the model name and version)."""
    client = _client(tracking_uri)
    for key, value in signed_version_tags(model_name, version, tags).items():
        client.set_model_version_tag(model_name, str(version), key, value)


def registered_files(tracking_uri: str, model_name: str, version: dict, cache_dir: str | Path
                     ) -> tuple[Path, Path, str]:
    """(checkpoint, tokenizer, tree hash) of a registered version (a get_champion / get_version
    dict: verified tags only), verified: its own files if they still hash to the signed content hash
    (tree hash: the one checked against it), else its registered copy from MLflow, verified against
    its signed manifest and the signed hashes recorded at registration (tree hash: export_sha256).
    Load the checkpoint with that hash as expected_tree_sha256 and the tokenizer against the signed
    tokenizer_sha256: a read of the files after this check may find others. Raises UnverifiedModel
    when neither verifies."""

    tags, number = version["tags"], version["version"]
    ckpt, tok = fs.location(tags.get("checkpoint", "")), fs.location(tags.get("tokenizer", ""))
    if tags.get("checkpoint") and tags.get("content_hash") and _still_there(ckpt, tok):
        tree = fs.tree_sha256(*stored(ckpt))
        if content_hash_of(tree, fs.sha256(*stored(tok))) == tags["content_hash"]:
            return ckpt, tok, tree
        log.warning("version %s's files %s / %s no longer match its content hash", number, ckpt, tok)
    if not all(tags.get(k) for k in ("export_sha256", "tokenizer_sha256")):
        refused = f" (refused, unsigned or forged: {', '.join(version['untrusted_tags'])})" \
            if version.get("untrusted_tags") else ""
        raise UnverifiedModel(f"version {number}'s files ({ckpt}, {tok}) are gone or changed and it has no "
                              f"signed hashes that would verify its registered copy{refused}")
    what = f"the registered copy of {model_name} version {number} ({version['source']})"
    local = Path(cache_dir) / f"{model_name}-v{number}"
    cached = local / version["source"].rstrip("/").rsplit("/", 1)[-1]
    if cached.is_dir():  # downloaded before: verified again, as anyone may have written the cache
        try:
            return verify_model_dir(cached, tags, what)
        except UnverifiedModel as e:
            log.warning("%s; downloading it again", e)
    shutil.rmtree(local, ignore_errors=True)
    local.mkdir(parents=True, exist_ok=True)
    return download_verified(tracking_uri, version, local, what)


def record_gate(tracking_uri: str, run_id: str | None, step: int | None, decision: dict,
                yardstick: dict | None = None) -> None:
    """The gate's verdict on the training run: tags gate.step-N.passed / .reason and the metric
    gate_passed (1/0) at the checkpoint's step; gated on the yardstick, also the set's hash, the
    champion's version and both models' bits per byte (metrics gate_<who>_bpb_<part>). The tags are
    signed (sig.<name>, bound to the run: verified_run_tags reads them back). Nothing without a run id."""
    if not run_id:
        return
    import time

    from mlflow.entities import Metric, RunTag

    key = f"gate.step-{int(step) if step is not None else 'unknown'}"
    now, at = int(time.time() * 1000), int(step or 0)
    metrics = [Metric("gate_passed", float(bool(decision["passed"])), now, at)]
    tags = {f"{key}.passed": str(bool(decision["passed"])).lower(), f"{key}.reason": decision["reason"]}
    if yardstick:
        tags |= {f"{key}.yardstick_sha256": yardstick["set"]["sha256"],
                 f"{key}.champion_version": yardstick["champion"]["version"]}
        metrics += [Metric(f"gate_{who}_bpb_{part}", float(v), now, at)
                    for who in ("challenger", "champion") for part, v in yardstick[who]["bits_per_byte"].items()]
    _client(tracking_uri).log_batch(run_id, metrics=metrics,
                                    tags=[RunTag(k, v) for k, v in signed_run_tags(run_id, tags).items()])


def verify_registered(tracking_uri: str, model_name: str, version: int) -> str:
    """Load version `version`'s registered copy back from the registry with the project's loader
    (signed manifest and hashes verified before anything is read; no code from the artifact store
    runs) and generate one token; returns what was checked. Raises if it does not verify, cannot
    be loaded or does not answer."""
    out = load_registered(tracking_uri, model_name, version, registered_copy=True).predict(
        ["The"], {"max_tokens": 1, "temperature": 0.0})
    if len(out) != 1 or not isinstance(out[0], str):
        raise RuntimeError(f"the registered model answered {out!r}")
    return "loaded from the registry and generated"


@dataclass
class RegisteredModel:
    """A verified registered version, loaded: predict(prompts, params) -> completions."""
    generator: object
    version: int | None = None

    def predict(self, prompts, params: dict | None = None) -> list[str]:
        from tasks.deploy.generation import PYFUNC_PARAMS

        p = {**PYFUNC_PARAMS, **(params or {})}
        gen = self.generator
        prompts = [prompts] if isinstance(prompts, str) else [str(x) for x in prompts]
        seed = None if p["seed"] is None or int(p["seed"]) < 0 else int(p["seed"])
        return [gen.complete(gen.encode(text), max_tokens=int(p["max_tokens"]), temperature=float(p["temperature"]),
                             top_p=float(p["top_p"]), seed=seed)[0].text for text in prompts]


def load_registered(tracking_uri: str, model_name: str, version: int | None = None, alias: str | None = None,
                    cache_dir: str | Path | None = None, registered_copy: bool = False) -> RegisteredModel:
    """Load a registered version (by number or alias) with the project's loader: verified tags only
    (tasks.deploy.registry.get_version), its own checkpoint if it still hashes to the signed content
    hash, else (or with registered_copy) its registered copy, verified before it is read."""
    from tasks.deploy.generation import TextGenerator

    found = get_version(tracking_uri, model_name, version, alias)
    with tempfile.TemporaryDirectory(prefix="crucible-registered-") as tmp:
        if registered_copy:
            ckpt, tok, copy_hash = download_verified(tracking_uri, found, tmp,
                                                     f"the registered copy of {model_name} version {found['version']}")
        else:
            ckpt, tok, copy_hash = registered_files(tracking_uri, model_name, found, cache_dir or tmp)
        gen = TextGenerator.from_files(ckpt, tok, expected_tree_sha256=copy_hash)  # weights are in memory now
    return RegisteredModel(gen, found["version"])
