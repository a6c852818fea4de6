"""The model server as a background service of the local stack (see infra/stack.py).

`start_or_refresh_server` (re)starts `python -m infra.services.model_server` on
deploy.host:deploy.port with its pid file, spec and log under the stack's state directory, in its
own session so it outlives `crucible run`. The spec is kept after `crucible down`, so `crucible up` serves the last
deployed model again.

A refresh of a running server (deploy.reload_in_place, the default) posts the new registered
version to its /v1/admin/reload with the admin token (a secret generated into the state directory,
file mode 0600, never the clients' key): the server resolves and verifies the version in MLflow;
requests in flight finish on the old model, nothing is dropped, and the recorded spec is updated.
Only when the server is not running, runs with different settings, the version is unknown or the
reload fails, is it (re)started (a few seconds without an answer on the port).

Clients need a key by default: the stack generates it into its secrets folder
(model-server.api-key, 0600) and passes the server its path (deploy.api_key_env instead names a
variable holding an operator's own key). Before the stack trusts a health answer from the port, or
the supervisor sends the server anything (a reload, the clients' key), the server proves it holds
the admin key (identity.py: a fresh nonce answered with an HMAC bound to the port): a local process
that took the port while the server restarted is never taken for it, and receives no secret.

`verify_model` serves a challenger in a separate, temporary server process (deploy.verify_port,
default any free port) and checks that it answers; the live server swaps only after promotion.
`serve_model` and `verify_model` are what flows hand to the deploy stage (tasks.deploy.deploy_if_better).
"""
from __future__ import annotations

import http.client
import json
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path

from infra import stack
from infra.services.model_server import identity
from tasks.deploy import api_headers, check_served

SERVER_MODULE = "infra.services.model_server"
VERIFY_SERVER = "model-server-verify"
ADMIN_KEY_FILE = "model-server.admin-key"
CLIENT_KEY_FILE = "model-server.api-key"
log = logging.getLogger(__name__)


def admin_key_file(stack_cfg) -> Path:
    """The admin token of the stack's model servers (a 0600 secret in the state directory)."""
    return stack.secret_file(stack_cfg, ADMIN_KEY_FILE)


def admin_headers(stack_cfg) -> dict:
    return {"Authorization": f"Bearer {admin_key_file(stack_cfg).read_text().strip()}"}


def client_key_file(stack_cfg) -> Path:
    """The clients' key of the stack's model server (a 0600 secret in the state directory)."""
    return stack.secret_file(stack_cfg, CLIENT_KEY_FILE)


def client_headers(stack_cfg, deploy_cfg) -> dict:
    """What a client of the stack's model server sends: the key deploy.api_key_env names, else the
    stack's generated one."""
    if deploy_cfg.api_key_env:
        return api_headers(deploy_cfg)
    return {"Authorization": f"Bearer {client_key_file(stack_cfg).read_text().strip()}"}


def identity_probe(host: str, port: int, stack_cfg) -> list[str]:
    """The stack's health probe of a model server (ServiceSpec.probe): exit 0 only if the process on
    the port proves it holds the admin key. Run by path: the check needs only the standard library."""
    return [sys.executable, str(Path(identity.__file__).resolve()), "--host", stack.connect_host(host),
            "--port", str(port), "--admin-key-file", str(admin_key_file(stack_cfg))]


def endpoint_url(deploy_cfg) -> str:
    return f"http://{stack.connect_host(deploy_cfg.host)}:{deploy_cfg.port}/v1"


def server_spec(deploy_cfg, ckpt_dir: str | Path, tokenizer_path: str | Path, model_name: str,
                stack_cfg=None, version: int | None = None, tracking_uri: str | None = None,
                client_key: Path | None = None) -> stack.ServiceSpec:
    """The live model server's spec; with `stack_cfg`, its admin API takes the stack's admin token
    (with which it proves its identity to the health probe), clients need the stack's key (or the
    one deploy.api_key_env names, or the file `client_key`) and, with `tracking_uri`, reloads
    resolve in that registry."""
    ckpt_dir, tokenizer_path = str(Path(ckpt_dir).resolve()), str(Path(tokenizer_path).resolve())
    admin = (["--admin-key-file", str(admin_key_file(stack_cfg)),
              "--cache-dir", str(stack.state_dir(stack_cfg) / "registered-copies")] if stack_cfg is not None else [])
    if client_key is not None:
        client = ["--api-key-file", str(client_key)]
    elif deploy_cfg.api_key_env:
        client = ["--api-key-env", deploy_cfg.api_key_env]
    else:  # the stack's server is never open: a generated key, passed as a path
        client = ["--api-key-file", str(client_key_file(stack_cfg))] if stack_cfg is not None else []
    return stack.ServiceSpec(
        name=stack.MODEL_SERVER,
        cmd=[sys.executable, "-m", SERVER_MODULE, "--checkpoint", ckpt_dir, "--tokenizer", tokenizer_path,
             "--model-name", model_name, "--host", deploy_cfg.host, "--port", str(deploy_cfg.port),
             "--threads", str(deploy_cfg.threads), "--max-tokens-limit", str(deploy_cfg.max_tokens_limit),
             "--max-n", str(deploy_cfg.max_n), "--max-batch", str(deploy_cfg.max_batch),
             "--max-body-bytes", str(deploy_cfg.max_body_bytes), "--max-streams", str(deploy_cfg.max_streams),
             "--max-requests", str(deploy_cfg.max_requests), "--request-timeout", str(deploy_cfg.request_timeout)]
            + (["--version", str(version)] if version is not None else [])
            + (["--tracking-uri", tracking_uri] if tracking_uri else []) + admin + client,
        host=deploy_cfg.host, port=deploy_cfg.port, health_path="/health", url=endpoint_url(deploy_cfg),
        marker=[SERVER_MODULE],
        # importable even if the repo is not pip-installed; the server runs from the state dir
        env={"PYTHONPATH": stack.repo_pythonpath(), "PYTHONUNBUFFERED": "1"},
        info={"model_name": model_name, "version": version, "checkpoint": ckpt_dir, "tokenizer": tokenizer_path,
              "requires": [ckpt_dir, tokenizer_path]},
        probe=identity_probe(deploy_cfg.host, deploy_cfg.port, stack_cfg) if stack_cfg is not None else [],
    )


def serve_model(cfg, checkpoint_dir: str | Path, tokenizer_path: str | Path, model_name: str,
                version: int | None = None, tracking_uri: str | None = None) -> dict:
    """Serve `checkpoint_dir` (registered `version` of `model_name`) as the stack's model server, per
    the config's `stack` and `deploy` sections: start_or_refresh_server's {"endpoint", "pid", ...}."""
    return start_or_refresh_server(cfg.stack, cfg.deploy, checkpoint_dir, tokenizer_path, model_name,
                                   version=version, tracking_uri=tracking_uri)


def verify_model(cfg, checkpoint_dir: str | Path, tokenizer_path: str | Path, model_name: str,
                 version: int | None = None, tracking_uri: str | None = None) -> str:
    """Serve a challenger in a temporary server process of its own (deploy.verify_port; 0: any
    free port), check that it reports its step and completes a prompt, and stop it. The live server
    is not touched. Returns what was checked; raises when it does not answer."""
    from tasks.core.net import free_port
    from tasks.train.checkpoint import read_meta

    dcfg = cfg.deploy
    port = dcfg.verify_port or free_port()
    # one service name per verification: two deploys verifying at once never stop each other's server
    name = f"{VERIFY_SERVER}-{port}"
    # a clients' key of its own, used once and removed: never the live server's, even if the check's
    # request were to reach another process; the server proves its identity (admin key) before it
    key = stack.state_dir(cfg.stack) / "secrets" / f"{name}.api-key"
    key.unlink(missing_ok=True)
    key = stack.secret_file(cfg.stack, key.name)
    live = server_spec(dcfg.model_copy(update={"port": port}), checkpoint_dir, tokenizer_path, model_name,
                       cfg.stack, version=version, client_key=key)
    spec = replace(live, name=name, url=f"http://{stack.connect_host(dcfg.host)}:{port}/v1")
    try:
        with stack.stack_lock(cfg.stack):
            stack.start_services(cfg.stack, [spec], restart=True)
        checked = check_served(dcfg, spec.url, read_meta(checkpoint_dir).get("step"),
                               headers={"Authorization": f"Bearer {key.read_text().strip()}"})
    finally:
        with stack.stack_lock(cfg.stack):
            stack.stop_service(cfg.stack, name, forget=True)
        key.unlink(missing_ok=True)
    return f"{checked.replace('served at', 'served by a verification server at')}; then stopped"


def start_or_refresh_server(stack_cfg, deploy_cfg, ckpt_dir: str | Path, tokenizer_path: str | Path,
                            model_name: str, timeout: float | None = None, version: int | None = None,
                            tracking_uri: str | None = None) -> dict:
    """(Re)start the model server for this checkpoint and wait until GET /health answers.

    Returns {"endpoint": "http://127.0.0.1:8600/v1", "pid": int, "log": path, "seconds": float}.
    Raises infra.stack.StackError (with the server's log tail) if it does not become healthy.
    """
    spec = server_spec(deploy_cfg, ckpt_dir, tokenizer_path, model_name, stack_cfg, version, tracking_uri)
    for p in spec.info["requires"]:
        if not Path(p).exists():
            raise FileNotFoundError(f"cannot serve {model_name}: {p} does not exist")
    with stack.stack_lock(stack_cfg):
        if getattr(deploy_cfg, "reload_in_place", False):
            reloaded = _reload_in_place(stack_cfg, deploy_cfg, spec)
            if reloaded is not None:
                return reloaded
        res = stack.start_services(stack_cfg, [spec], timeout=timeout, restart=True)[stack.MODEL_SERVER]
    return {"endpoint": spec.url, "pid": res["pid"], "log": str(stack.log_path(stack_cfg, stack.MODEL_SERVER)),
            "seconds": res["seconds"], "reloaded": False}


def _settings(cmd: list[str]) -> list[str]:
    """The command line without the checkpoint and tokenizer values: what a reload cannot change."""
    out, skip = [], False
    for a in cmd:
        if skip:
            skip = False
            continue
        if a in ("--checkpoint", "--tokenizer", "--version"):
            skip = True
            continue
        out.append(a)
    return out


def _reload_in_place(stack_cfg, deploy_cfg, spec: stack.ServiceSpec) -> dict | None:
    """POST the new registered version to the running server, over a connection on which it first
    proved its identity (so the admin key goes to no other process); None if it cannot be reloaded
    in place."""
    pid = stack.running_pid(stack_cfg, stack.MODEL_SERVER)
    old = stack.read_spec(stack_cfg, stack.MODEL_SERVER)
    if pid is None or old is None or _settings(old.cmd) != _settings(spec.cmd) or spec.info.get("version") is None:
        return None
    t0 = time.perf_counter()
    verified = identity.verified_connection(stack.connect_host(spec.host), spec.port,
                                            admin_key_file(stack_cfg).read_text().strip(), timeout=10)
    if verified is None:
        log.warning("the process on port %s did not prove it is the model server; restarting it", spec.port)
        return None
    conn = verified[0]
    try:
        conn.sock.settimeout(300)
        conn.request("POST", "/v1/admin/reload", body=json.dumps({"version": spec.info["version"]}),
                     headers={**admin_headers(stack_cfg), "Content-Type": "application/json"})
        r = conn.getresponse()
        status, text = r.status, r.read(1 << 16).decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        log.warning("reload in place failed (%s); restarting the model server", e)
        return None
    finally:
        conn.close()
    if status != 200:
        log.warning("reload in place refused (%s %s); restarting the model server", status, text[:300])
        return None
    stack.write_spec(stack_cfg, spec)  # record the new checkpoint, so `crucible up` after a restart serves it
    return {"endpoint": spec.url, "pid": pid, "log": str(stack.log_path(stack_cfg, stack.MODEL_SERVER)),
            "seconds": round(time.perf_counter() - t0, 3), "reloaded": True}


def server_status(stack_cfg) -> dict | None:
    """{url, healthy, pid, serves} of the model server, or None if no model has been deployed. `serves`:
    the files its recorded (signed) spec serves, what `crucible up` restarts it from and deploy's prune
    of served/ copies keeps (tasks.deploy.prune_served); None when there is no readable spec."""
    status = stack.status(stack_cfg).get(stack.MODEL_SERVER)
    if status is None:
        return None
    spec = stack.read_spec(stack_cfg, stack.MODEL_SERVER)
    return {**status, "serves": list(spec.info.get("requires") or ()) if spec is not None else None}
