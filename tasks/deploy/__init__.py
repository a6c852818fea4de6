"""Deployment: gate a checkpoint on its evaluation, register it in MLflow (alias `challenger`,
then `champion` once verified) and serve it behind an OpenAI-compatible API.

    gate.py          gate(deploy_cfg, eval_result) -> {passed, reason}: the absolute threshold
    yardstick.py     the gate against the champion: both scored on one pinned set in bits per byte
    registry.py      get_champion / register / promote / reject / record_gate (MLflow model registry)
    generation.py    KV-cached sampling shared by the model server and load_registered
    export.py        Hugging Face-compatible export (Llama layout) + model card
    triggered.py     the event-triggered flows' signed records, read once their flow run completed
    stage.py         the deploy stage of the pretrain flow

The model server and its supervisor are a service of the stack (infra/services/model_server):
deploy_if_better is handed `serve_model` / `verify_model` / `server_status` callables instead of
importing it.
Event-triggered evaluation/deployment lives in flows/triggers.py.

Importing this package is cheap (no MLflow, no torch); the heavy modules load on first use.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from contextlib import ExitStack
from typing import Callable, NamedTuple

from tasks.core.constants import LINEAGE_NAMESPACE
from tasks.core.layout import RunLayout
from tasks.deploy.gate import gate

log = logging.getLogger(__name__)

__all__ = ["gate", "deploy_if_better", "prune_served", "api_headers", "ServeModel", "VerifyModel", "ServerStatus"]

# (cfg, checkpoint_dir, tokenizer_path, model_name, version, tracking_uri) -> {"endpoint", "pid", ...}:
# the live model server serves a registered version
ServeModel = Callable[..., dict]
# same arguments -> what was checked: a temporary server of its own serves the challenger and answers
VerifyModel = Callable[..., str]
# () -> {"url", "pid", "healthy", "serves"} of the stack's model server, None when none was ever deployed;
# "serves": the files its recorded spec serves (what `crucible up` restarts it from), None when unknown
ServerStatus = Callable[[], dict | None]


def api_headers(deploy_cfg) -> dict:
    """The bearer token the model server expects (deploy.api_key_env), if one is set."""
    if deploy_cfg.api_key_env and os.environ.get(deploy_cfg.api_key_env):
        return {"Authorization": f"Bearer {os.environ[deploy_cfg.api_key_env]}"}
    return {}


def lineage_tags(cfg, evaluation: dict, tokenizer_path: Path | str, namespace: str = LINEAGE_NAMESPACE) -> dict:
    """Model-version tags naming the data the model came from: the sources and their licences, the
    run's lineage log and the checkpoint's lineage node (open it in the lineage service), the
    tokenizer / val-split hashes (from the evaluation report) and the token index's hash.
    `namespace`: the lineage namespace of the run's jobs (the stack's lineage.namespace)."""
    import hashlib

    from tasks.core import fs
    from tasks.core.storage import stored
    from tasks.lineage.emitter import file_node

    ckpt = fs.canonical(evaluation["checkpoint"])  # an object-store run's: its URI
    tags = {"data.sources": "; ".join(f"{s.name} ({s.licence}; {s.provenance})" for s in cfg.sources),
            "data.licences": ", ".join(sorted({s.licence for s in cfg.sources})),
            "lineage.namespace": namespace, "lineage.checkpoint_node": file_node(ckpt),
            "lineage.tokenizer_node": file_node(tokenizer_path), "run_name": evaluation.get("run_name")}
    if RunLayout.is_run_checkpoint(ckpt):
        layout = RunLayout.of_checkpoint(ckpt)
        tags["lineage.run_dir"] = str(layout.run_dir)
        if layout.lineage_log.is_file():
            tags["lineage.log"] = str(layout.lineage_log)
        # what training read: the cycle's mix for a continued run (its replay pool), else tokens/index.json
        from tasks.deploy.yardstick import UntrustedTokenIndex, index_refusals, trained_on

        if (index := trained_on(ckpt)) is not None:
            from tasks.tokens.binfile import read_signed_index
            from tasks.train.checkpoint import read_meta, trained_index_problem

            # the hash of bytes the stack signed (UntrustedTokenIndex otherwise): the registry signs this
            # tag, and the next cycle's replay pool trusts whatever index hashes to it
            with index_refusals():
                _, raw = read_signed_index(*stored(index))
            digest = hashlib.sha256(raw).hexdigest()
            # signed is not enough: another run's genuine signed index copied into this run's tokens/ verifies too
            if problem := trained_index_problem(read_meta(*stored(ckpt)), digest):
                raise UntrustedTokenIndex(f"token index {index}: {problem}")
            tags["data.tokens_index"] = str(index)
            tags["data.tokens_index_sha256"] = digest
    return tags


def yardstick_tags(yardstick: dict) -> dict:
    """Model-version tags of a yardstick gate: the set's hash and both models' bits per byte per part."""
    tags = {"gate.yardstick_sha256": yardstick["set"]["sha256"], "gate.reason": yardstick["decision"]["reason"],
            "gate.champion_version": yardstick["champion"]["version"]}
    for who in ("challenger", "champion"):
        tags |= {f"gate.{who}.bpb_{part}": f"{v:.6f}" for part, v in yardstick[who]["bits_per_byte"].items()}
    return tags


def check_served(deploy_cfg, endpoint: str, step, headers: dict | None = None) -> str:
    """The server answers /health with the new checkpoint's step and completes a prompt (sending
    `headers`, default api_headers: the stack passes its generated clients' key)."""
    import httpx

    headers = api_headers(deploy_cfg) if headers is None else headers
    health = httpx.get(f"{endpoint.removesuffix('/v1')}/health", timeout=30, trust_env=False).json()
    if step is not None and health.get("step") not in (None, step):
        raise RuntimeError(f"the server reports step {health.get('step')}, not the challenger's {step}")
    r = httpx.post(f"{endpoint}/completions", headers=headers, timeout=120, trust_env=False,
                   json={"prompt": "The", "max_tokens": 1, "temperature": 0})
    if r.status_code != 200 or not r.json().get("choices"):
        raise RuntimeError(f"the server answered {r.status_code}: {r.text[:300]}")
    return f"served at {endpoint} and answered a completion"


def deploy_if_better(cfg, tracking_uri: str, evaluation: dict, tokenizer_path: Path | str,
                     train_run_id: str | None = None, serve_model: ServeModel | None = None,
                     server_status: ServerStatus | None = None, verify_model: VerifyModel | None = None,
                     lineage_namespace: str = LINEAGE_NAMESPACE) -> dict:
    """Gate `evaluation` (an evaluate-stage report: checkpoint, val_loss, ...): below
    deploy.max_val_loss and, with a champion, better than it on the fixed yardstick
    (tasks/deploy/yardstick.gate_evaluation). Pass: register it as `challenger` (tagged with the
    eval results, training run, data lineage and yardstick scores), verify it (deploy.serve:
    `verify_model` serves it in a temporary server of its own, which must answer; else it is
    loaded back from the registry and run), `promote` it to `champion`, and only then swap the
    live server to it (`serve_model`). Fail: the verdict is recorded on the training run
    (record_gate) and the champion stays, still served. A challenger failing verification is
    rejected (tagged with the reason).

    serve_model / verify_model(cfg, checkpoint_dir, tokenizer_path, model_name, version,
    tracking_uri): the stack's model-server supervisor (None: nothing is served here, as with
    deploy.serve=false). server_status() -> {"url", "pid", "healthy"} | None reports the
    running server (None: no endpoint is reported when nothing new is served). lineage_namespace:
    the run's (tagged on the version).

    Returns {"passed", "reason", "model_name", "val_loss", "checkpoint", "champion_version",
    "champion_val_loss", "version", "alias", "content_hash", "source", "endpoint", "pid",
    "verified"}. When the gate or verification fails, version/alias are None and `endpoint` is
    the running server's (still the previous champion) if there is one. Afterwards, whatever
    happened, the served/ copies no model server uses are pruned (prune_served).
    """
    try:
        # the copy this deploy works on is locked until it ends: prune_served (ours or another deploy's) skips it
        with ExitStack() as in_flight:
            return _deploy_if_better(cfg, tracking_uri, evaluation, tokenizer_path, train_run_id, serve_model,
                                     server_status, verify_model, lineage_namespace, in_flight)
    finally:
        prune_served(cfg, server_status)


def _deploy_if_better(cfg, tracking_uri: str, evaluation: dict, tokenizer_path: Path | str, train_run_id: str | None,
                      serve_model: ServeModel | None, server_status: ServerStatus | None,
                      verify_model: VerifyModel | None, lineage_namespace: str, in_flight: ExitStack) -> dict:
    from tasks.deploy.registry import get_champion, record_gate, register
    from tasks.deploy.yardstick import UntrustedTokenIndex, gate_evaluation, score_tags

    dcfg = cfg.deploy
    champion = get_champion(tracking_uri, dcfg.model_name)
    # one local copy, verified against the signed report's hash, is hashed, registered and served
    copy = servable(cfg, evaluation["checkpoint"], tokenizer_path, evaluation.get("checkpoint_sha256"), in_flight)
    content_hash = copy.content_hash
    if champion and champion["tags"].get("content_hash") == content_hash:
        # The same checkpoint was already promoted (e.g. by the event-triggered deploy-model flow
        # while this run was still going): report it as deployed rather than failing the gate.
        current = server_status() if server_status else None
        return {
            "passed": True, "reason": f"already the champion (version {champion['version']})",
            "model_name": dcfg.model_name, "val_loss": evaluation.get("val_loss"),
            "checkpoint": evaluation.get("checkpoint"), "champion_version": champion["version"],
            "champion_val_loss": champion["val_loss"], "version": int(champion["version"]), "alias": "champion",
            "content_hash": content_hash, "source": champion.get("source"),
            "endpoint": current["url"] if current and current["healthy"] else None,
            "pid": current["pid"] if current else None, "verified": champion["tags"].get("deployment.verified"),
        }
    # against a champion: both scored on the fixed yardstick (a cycle's yardstick stage or the
    # triggered evaluation may have done it already against this champion)
    decision, yardstick = gate_evaluation(cfg, tracking_uri, evaluation, tokenizer_path, champion)
    tags = {}
    if decision["passed"]:
        try:  # what the version will be tagged with; a token index the stack cannot vouch for refuses it
            tags = lineage_tags(cfg, evaluation, tokenizer_path, lineage_namespace)
        except UntrustedTokenIndex as e:
            decision = {**decision, "passed": False, "reason": f"refused after the gate passed: {e}"}
    result = {
        "passed": decision["passed"], "reason": decision["reason"], "model_name": dcfg.model_name,
        "val_loss": evaluation.get("val_loss"), "checkpoint": evaluation.get("checkpoint"),
        "champion_version": champion["version"] if champion else None,
        "champion_val_loss": champion["val_loss"] if champion else None,
        "version": None, "alias": None, "content_hash": None, "source": None, "endpoint": None, "pid": None,
        "verified": None,
    }
    if yardstick:
        result["yardstick"] = {"sha256": yardstick["set"]["sha256"], "path": yardstick["set"]["path"],
                               "checks": decision["checks"], "champion_version": yardstick["champion"]["version"],
                               "champion_content_hash": yardstick["champion"]["content_hash"],
                               "challenger_bpb": yardstick["challenger"]["bits_per_byte"],
                               "champion_bpb": yardstick["champion"]["bits_per_byte"]}
    log.info("deploy gate for %s: %s", evaluation.get("checkpoint"), decision["reason"])
    record_gate(tracking_uri, train_run_id, evaluation.get("step"), decision, yardstick)
    if not decision["passed"]:
        result.update(_live_server(server_status))
        return result

    if yardstick:
        tags |= yardstick_tags(yardstick)
        tags |= score_tags(yardstick["set"]["sha256"], yardstick["challenger"]["bits_per_byte"])
    reg = register(tracking_uri, dcfg.model_name, evaluation["checkpoint"], tokenizer_path,
                   {k: v for k, v in evaluation.items() if k != "yardstick"}, train_run_id, extra_tags=tags,
                   content_hash=content_hash, copy=(copy.checkpoint, copy.tree_sha256, copy.tokenizer))
    result.update({k: reg[k] for k in ("version", "alias", "content_hash", "source")})
    if dcfg.serve and (serve_model is None or verify_model is None):
        raise ValueError("deploy.serve is true but no model server was handed to deploy_if_better (serve_model, "
                         "verify_model); pass the stack's supervisor (infra.services.model_server.supervisor) "
                         "or set deploy.serve=false")
    return _verify_promote_serve(cfg, tracking_uri, copy, reg["version"], result,
                                 serve_model, verify_model, server_status)


class Deployable(NamedTuple):
    """One verified local copy of a challenger: what deploy hashes, registers and serves."""
    checkpoint: Path  # <folder>/train/checkpoints/step-N, with its run's signed manifest beside it
    tokenizer: Path
    tree_sha256: str  # of the copy, verified (the signed report's checkpoint_sha256 when it names one)
    tokenizer_sha256: str
    content_hash: str  # registry.content_hash_of(tree_sha256, tokenizer_sha256): also the folder's key


def servable(cfg, checkpoint: str | Path, tokenizer_path: str | Path,
             expected_tree_sha256: str | None = None, in_flight: ExitStack | None = None) -> Deployable:
    """The checkpoint and tokenizer as ONE local copy, verified once, for everything deploy does with
    them (content hash, export into the registry, the model server, a process of the stack that keeps
    loading them): reading the source again at each step could read other bytes each time (a store's
    objects or a run folder swapped in between). The checkpoint (a store's objects downloaded, local
    files hard-linked) and its run's signed manifest are laid out as a run's train/checkpoints/ in
    storage.cache_dir/served/<content hash>/ (the server verifies them against it as it loads); the
    copy must hash to `expected_tree_sha256` (a signed report's checkpoint_sha256), else verify against
    that manifest; the tokenizer is read once and must be the one the checkpoint's signed meta names.
    A folder of that content already there (the live one, perhaps) is used, never replaced.
    `in_flight`: holds the copy's shared lock until it closes (prune_served leaves the copy alone
    meanwhile); without it the lock is released on return."""
    import hashlib
    import shutil
    import uuid

    from tasks.core import fs
    from tasks.core.layout import CHECKPOINTS_DIR
    from tasks.core.storage import stored
    from tasks.deploy.registry import content_hash_of
    from tasks.train.checkpoint import (MANIFEST, UnverifiedCheckpoint, checkpoint_problem, manifest_tree_sha256,
                                        read_meta)

    root = _served_root(cfg)
    tmp = root / f".tmp-{uuid.uuid4().hex}"
    # locked before the folder exists: a prune never takes it for a killed deploy's
    filling = _copy_lock(root, tmp.name, exclusive=True, wait=True)
    try:
        (at, options), (tok_at, tok_options) = stored(checkpoint), stored(tokenizer_path)
        local = tmp / "train" / CHECKPOINTS_DIR / fs.name_of(at)
        manifest = fs.join(fs.parent_of(at), MANIFEST)
        if fs.is_remote(at):
            fs.download(at, local, options)
            fs.download_file(manifest, local.parent / MANIFEST, options)
        else:  # a rename into the run folder afterwards leaves the linked bytes as they were
            shutil.copytree(at, local, ignore=shutil.ignore_patterns(".tmp-*"), copy_function=fs.link_or_copy)
            fs.link_or_copy(manifest, local.parent / MANIFEST)
        if problem := checkpoint_problem(local, expected_tree_sha256=expected_tree_sha256):
            raise UnverifiedCheckpoint(f"refusing to deploy {checkpoint}: " + problem.replace(str(local), str(at)))
        tree = expected_tree_sha256 or manifest_tree_sha256(local)
        data = fs.read_bytes(tok_at, tok_options)
        tok_sha = hashlib.sha256(data).hexdigest()
        if (want := read_meta(local).get("tokenizer_sha256")) and want != tok_sha:
            raise ValueError(f"tokenizer {tokenizer_path} is not the one checkpoint {checkpoint} was trained with")
        fs.write_bytes(tmp / "tokenizer.json", data)
        content_hash = content_hash_of(tree, tok_sha)
        folder = root / content_hash[:32]
        # shared: deploys of the same content use the copy at once; a prune waits for none of them
        held = _copy_lock(root, folder.name, exclusive=False, wait=True)
        try:
            if not folder.is_dir():
                try:
                    os.replace(tmp, folder)
                except OSError:  # another deploy of the same content put it there first
                    if not folder.is_dir():
                        raise
        except BaseException:
            os.close(held)
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _unlock(root, tmp.name, filling, remove=True)
    if in_flight is not None:
        in_flight.callback(os.close, held)
    else:
        os.close(held)
    return Deployable(folder / local.relative_to(tmp), folder / "tokenizer.json", tree, tok_sha, content_hash)


def _served_root(cfg) -> Path:
    from tasks.core.storage import default_cache_dir

    return (Path(cfg.storage.cache_dir).expanduser() if cfg.storage.cache_dir else default_cache_dir()) / "served"


LOCKS = ".locks"  # in served/: <copy's folder name>.lock, flocked shared by each deploy using that copy


def _copy_lock(root: Path, name: str, exclusive: bool, wait: bool) -> int | None:
    """A descriptor holding an flock on served/.locks/<name>.lock; None when `wait` is false and another
    holds it. The lock taken is on the file that is at that path then (a prune unlinks a removed
    copy's lock file, and one who opened it before that takes the lock again on the new file)."""
    import fcntl

    path = root / LOCKS / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        try:
            if os.path.samestat(os.stat(path), os.fstat(fd)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # unlinked by a prune while we waited: lock the file there now


def _unlock(root: Path, name: str, fd: int, remove: bool = False) -> None:
    """Release a _copy_lock; `remove` (its holder exclusively, the copy gone): the lock file too."""
    try:
        if remove:
            (root / LOCKS / f"{name}.lock").unlink(missing_ok=True)
    finally:
        os.close(fd)


def _live_copies(root: Path, server_status: ServerStatus | None) -> set[str] | None:
    """The served/ folders the stack's model server uses, per its recorded (signed) spec, the one
    `crucible up` restarts it from; set() when no model server was ever deployed; None when that
    cannot be told (no server_status handed in, or a server without a readable spec)."""
    if server_status is None:
        return None
    try:
        status = server_status()
    except Exception as e:  # noqa: BLE001 - unknown: nothing may be pruned
        log.warning("deploy: the model server's status could not be read: %s", e)
        return None
    if status is None:
        return set()
    if not status.get("serves"):
        return None
    real, live = root.resolve(), set()
    for p in status["serves"]:
        if Path(p).resolve().is_relative_to(real):
            live.add(Path(p).resolve().relative_to(real).parts[0])
    return live


def prune_served(cfg, server_status: ServerStatus | None) -> list[str]:
    """Remove the served/ copies no model server uses; the names removed. Kept: the copies the stack's
    model server uses (its recorded spec, `server_status()["serves"]`) and every copy a deploy holds
    (servable's lock: being filled, verified, registered or served). So copies a killed deploy left,
    refused challengers', registered-only ones and champions' copies the live server moved on from
    go. When what the server uses cannot be told (no `server_status`, a server without a readable
    spec), nothing is removed (logged). A failure is logged, never raised: deploy's outcome stands."""
    import shutil

    root = _served_root(cfg)
    if not root.is_dir():
        return []
    removed, held = [], {}
    try:
        names = {p.name for p in root.iterdir() if p.name != LOCKS and p.is_dir() and not p.is_symlink()}
        names |= {p.name.removesuffix(".lock") for p in (root / LOCKS).glob("*.lock")}  # a killed deploy's
        for name in sorted(names):
            if (fd := _copy_lock(root, name, exclusive=True, wait=False)) is not None:
                held[name] = fd  # else in flight: a deploy holds it
        # read once every candidate is locked: a deploy swaps the server to its copy before it lets go of it
        live = _live_copies(root, server_status)
        if live is None:
            if any((root / n).is_dir() for n in held):
                log.warning("deploy: not pruning %s: which copy the model server uses cannot be told (no "
                            "server status, or no readable spec of it)", root)
            return []
        for name in sorted(set(held) - live):
            folder = root / name
            was_there = folder.is_dir()
            shutil.rmtree(folder, ignore_errors=True)
            if folder.exists():  # reported as removed only when it is gone
                log.warning("deploy: could not remove the unused served copy %s", folder)
                continue
            _unlock(root, name, held.pop(name), remove=True)
            if was_there:
                removed.append(name)
    except OSError as e:
        log.warning("deploy: could not prune %s: %s", root, e)
    finally:
        for name, fd in held.items():
            os.close(fd)
    if removed:
        log.info("deploy: pruned %d served cop%s no server uses: %s", len(removed), "y" if len(removed) == 1 else "ies",
                 ", ".join(removed))
    return removed


def _live_server(server_status: ServerStatus | None) -> dict:
    """{endpoint, pid} of the running model server (still the champion's), or {}."""
    current = server_status() if server_status else None
    return {"endpoint": current["url"], "pid": current["pid"]} if current and current["healthy"] else {}


def _verify_promote_serve(cfg, tracking_uri: str, copy: Deployable, version: int,
                          result: dict, serve_model: ServeModel | None, verify_model: VerifyModel | None,
                          server_status: ServerStatus | None) -> dict:
    """A registered challenger: verified apart from the live server (which keeps serving the
    champion), then promoted, and only then served live. A failed verification rejects it."""
    from tasks.deploy.registry import promote, reject

    dcfg = cfg.deploy
    name = dcfg.model_name
    try:
        if dcfg.serve:
            checkpoint, tokenizer_path = copy.checkpoint, copy.tokenizer
            verified = verify_model(cfg, checkpoint, tokenizer_path, name, version, tracking_uri)
        else:
            from tasks.deploy.registry import verify_registered

            verified = verify_registered(tracking_uri, name, version)
    except Exception as e:  # noqa: BLE001 - any failure to load or serve keeps the champion
        why = f"challenger version {version} failed verification: {type(e).__name__}: {e}"
        log.warning("deploy: %s; the champion stays", why)
        reject(tracking_uri, name, version, why)
        result.update(passed=False, reason=why, version=None, alias=None, **_live_server(server_status))
        return result
    promote(tracking_uri, name, version, verified)
    result.update(alias="champion", verified=verified)
    if dcfg.serve:  # only now does the live server swap to it
        try:
            served = serve_model(cfg, checkpoint, tokenizer_path, name, version, tracking_uri)
            result.update(endpoint=served["endpoint"], pid=served["pid"])
        except Exception as e:  # noqa: BLE001 - it is the verified champion; the server is what failed
            log.error("deploy: version %s is champion, but the model server could not serve it: %s", version, e)
            result["reason"] += f"; promoted, but the model server could not serve it: {type(e).__name__}: {e}"
    return result
