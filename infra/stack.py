"""The embedded local stack: Prefect server, MLflow tracking server, the lineage service, the Prefect
worker that runs the stack's deployments and (once a model has been deployed) the model server, as
background processes under one state directory.

    <state>/
    ├── prefect/            PREFECT_HOME of the server (SQLite database prefect.db)
    ├── mlflow/mlflow.db    MLflow backend store (runs, registry)
    ├── mlflow/artifacts/   MLflow artifact store, served by the tracking server (mlflow-artifacts:/)
    ├── mlflow/auth.db      MLflow's users and permissions (its basic-auth app; SQLite with PostgreSQL too)
    ├── secrets/            0600 secrets, generated on first use (mlflow-password: the login every MLflow
                            client sends, by file path; `crucible login` prints the UIs' logins)
    ├── postgres/data/      stack.database=postgres: the PostgreSQL cluster holding both instead
                            of prefect.db and mlflow.db (infra/database.py)
    ├── lineage.db          the lineage service's SQLite store (lineage.service_db)
    ├── run/<svc>.pid       pid of a running service (its process-group leader)
    ├── run/<svc>.json      how the service was started (command, port, health URL)
    ├── logs/<svc>.log      the service's stdout+stderr, appended across restarts
    └── stack.lock          serialises up/down/deploy between concurrent `crucible` processes

Every service is started with `start_new_session=True`, so it has its own process group and
outlives the command that started it; stopping sends SIGTERM to the whole group and SIGKILL after
a timeout. The state directory is `stack.state_dir` (relative to the working directory) unless
the environment variable CRUCIBLE_STATE_DIR is set.

The specs of the core services (Prefect, MLflow, the lineage service, the worker) are built here from
the config; the model server's spec comes from its supervisor (infra/services/model_server), which
records it with `write_spec` and starts it with `start_services`.

The worker (`prefect worker start`) polls the stack's `process` work pool `crucible`, to which `up`
registers the deployments (`python -m flows.deployments`): pretrain (on demand, with the config
`crucible up` was given), the event-triggered evaluate-checkpoint and deploy-model, and the scheduled
continue-pretraining. Each of their flow runs is a process the worker starts, with the worker's
environment: the stack's clients' (`flow_run_env`).

With `stack.ray: cluster` (`crucible up --ray`) the stack also runs a Ray head and worker nodes
(section "Ray cluster" below); their sessions live in their own temp dir, not /tmp/ray.

Only the standard library (and stdlib-only tasks.core modules) is imported at module level, so
`crucible status` stays fast.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from infra import artifact_store, database  # stdlib only at import: MLflow's object store, PostgreSQL
from tasks.core.constants import (EVENT_DEPLOYMENTS, LINEAGE_TOKEN_FILE_ENV, LINEAGE_URL_ENV, MLFLOW_AUTH_PROVIDER,
                                  MLFLOW_PASSWORD_FILE_ENV, MLFLOW_USERNAME, REPO_ROOT, WORK_POOL)
from tasks.core.io import atomic_write_text
from tasks.core.signing import SIGNING_KEY_FILE_ENV, SIGNING_KEY_NAME, ensure_key_file
from tasks.tracking.links import prefect_page  # stdlib only

STATE_DIR_ENV = "CRUCIBLE_STATE_DIR"
PREFECT = "prefect"
MLFLOW = "mlflow"
MODEL_SERVER = "model_server"
LINEAGE = "lineage"
WORKER = "worker"  # the Prefect worker of the work pool that runs the stack's deployments (flows/deployments.py)
POSTGRES = "postgres"  # the embedded PostgreSQL cluster of stack.database=postgres (infra/database.py)
CORE_SERVICES = (PREFECT, MLFLOW, LINEAGE, WORKER, POSTGRES)
STOP_ORDER = (MODEL_SERVER, WORKER, LINEAGE, MLFLOW, PREFECT, POSTGRES)  # the database last
LOG_TAIL_LINES = 40

# Children started by this process, kept so they can be reaped (no zombies in long-lived parents
# such as pytest) and so Popen does not warn about dropping a running child.
_CHILDREN: dict[int, subprocess.Popen] = {}


class StackError(RuntimeError):
    """A service could not be started or stopped; the message says which and why."""


@dataclass
class ServiceSpec:
    """How to run and probe one service. Persisted as run/<name>.json."""

    name: str
    cmd: list[str]
    host: str
    port: int
    health_path: str
    url: str  # what a user opens: UI or API base
    marker: list[str]  # substrings of the leader's command line: guards against pid reuse
    env: dict[str, str] = field(default_factory=dict)  # added to os.environ; never secrets
    info: dict[str, Any] = field(default_factory=dict)  # extra description shown by status
    # a command whose exit status 0 means healthy, for a service without an HTTP health URL
    # (PostgreSQL: pg_isready); empty: GET health_url
    probe: list[str] = field(default_factory=list)

    @property
    def health_url(self) -> str:
        return f"http://{connect_host(self.host)}:{self.port}{self.health_path}"

    @classmethod
    def from_dict(cls, d: dict) -> "ServiceSpec":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})


# --------------------------------------------------------------------------------------- paths

def state_dir(stack_cfg) -> Path:
    """Absolute state directory: $CRUCIBLE_STATE_DIR, else stack.state_dir (relative to cwd)."""
    raw = os.environ.get(STATE_DIR_ENV) or stack_cfg.state_dir
    return Path(raw).expanduser().resolve()


def _run_dir(stack_cfg) -> Path:
    return state_dir(stack_cfg) / "run"


def log_path(stack_cfg, name: str) -> Path:
    return state_dir(stack_cfg) / "logs" / f"{name}.log"


def _pid_path(stack_cfg, name: str) -> Path:
    return _run_dir(stack_cfg) / f"{name}.pid"


def _spec_path(stack_cfg, name: str) -> Path:
    return _run_dir(stack_cfg) / f"{name}.json"


def connect_host(host: str) -> str:
    """Where a client connects to a service bound to `host` (a wildcard bind: loopback)."""
    return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host


def prefect_api_url(stack_cfg) -> str:
    return f"http://{connect_host(stack_cfg.host)}:{stack_cfg.prefect_port}/api"


def prefect_ui_url(stack_cfg) -> str:
    return f"http://{connect_host(stack_cfg.host)}:{stack_cfg.prefect_port}"


def mlflow_tracking_uri(stack_cfg) -> str:
    return f"http://{connect_host(stack_cfg.host)}:{stack_cfg.mlflow_port}"


def _lineage_cfg(lineage_cfg):
    if lineage_cfg is None:
        from infra.settings import LineageConfig  # pydantic only; keeps the defaults in one place

        return LineageConfig()
    return lineage_cfg


def lineage_url(lineage_cfg=None) -> str:
    """Base URL of the lineage service (its page, and its API under /api/v1)."""
    lineage_cfg = _lineage_cfg(lineage_cfg)
    return f"http://{connect_host(lineage_cfg.service_host)}:{lineage_cfg.service_port}"


def lineage_db(stack_cfg, lineage_cfg=None) -> Path:
    db = Path(_lineage_cfg(lineage_cfg).service_db).expanduser()
    return db if db.is_absolute() else state_dir(stack_cfg) / db


LINEAGE_WRITE_TOKEN = "lineage-write.token"
LINEAGE_READ_TOKEN = "lineage-read.token"
PREFECT_AUTH = "prefect-auth"  # Prefect's server.api.auth_string, "crucible:<token>"


def secret_file(stack_cfg, name: str) -> Path:
    """A secret of the stack in its state directory (mode 0600), generated on first use. Its path,
    never its value, goes into environments and service specs."""
    path = state_dir(stack_cfg) / "secrets" / name
    if not path.is_file() or not path.read_text().strip():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(32) + "\n")
    return path


def secret(stack_cfg, name: str) -> str:
    value = secret_file(stack_cfg, name).read_text().strip()
    return f"crucible:{value}" if name == PREFECT_AUTH else value


def signing_key_file(stack_cfg) -> Path:
    """The stack's signing key (tasks/core/signing.py): the file $CRUCIBLE_SIGNING_KEY_FILE names when
    this process already has one (a stack started from a process that signs keeps its key), else
    <state>/secrets/signing.key. Its path, never the key, goes to the stack's processes."""
    return ensure_key_file(signing_key_path(stack_cfg))


def _kept_secret_path(stack_cfg, env: str, name: str) -> Path:
    """The file $`env` names when this process already has one (a stack started from a process that
    holds it keeps it), else <state>/secrets/`name`; not created (a command that only reads the
    stack's state must not make secrets appear)."""
    explicit = os.environ.get(env)
    return Path(explicit).expanduser().resolve() if explicit else state_dir(stack_cfg) / "secrets" / name


def signing_key_path(stack_cfg) -> Path:
    return _kept_secret_path(stack_cfg, SIGNING_KEY_FILE_ENV, SIGNING_KEY_NAME)


MLFLOW_PASSWORD = "mlflow-password"  # the stack's MLflow login (user MLFLOW_USERNAME, an admin of MLflow's auth app)
MLFLOW_FLASK_KEY = "mlflow-flask.key"  # MLflow's basic-auth app signs its CSRF tokens with it (same in every worker)
MLFLOW_AUTH_CONFIG = "mlflow-auth.ini"  # MLFLOW_AUTH_CONFIG_PATH of the server: who may do what


def mlflow_password_file(stack_cfg) -> Path:
    """The stack's MLflow password: the file $CRUCIBLE_MLFLOW_PASSWORD_FILE names when this process
    already has one (as for the signing key: a stack started from a client keeps its login), else
    <state>/secrets/mlflow-password. Its path, never the password, goes to the stack's clients."""
    return ensure_key_file(mlflow_password_path(stack_cfg))


def mlflow_password_path(stack_cfg) -> Path:
    return _kept_secret_path(stack_cfg, MLFLOW_PASSWORD_FILE_ENV, MLFLOW_PASSWORD)


def mlflow_client_env(stack_cfg) -> dict[str, str]:
    """What an MLflow client of the stack needs: the request-auth plugin that sends the stack's login
    (tasks/tracking/auth.py) and the password file's path."""
    return {"MLFLOW_TRACKING_AUTH": MLFLOW_AUTH_PROVIDER, MLFLOW_PASSWORD_FILE_ENV: str(mlflow_password_file(stack_cfg))}


def mlflow_auth_config(stack_cfg) -> Path:
    return state_dir(stack_cfg) / "secrets" / MLFLOW_AUTH_CONFIG


def _mlflow_server_auth_env(stack_cfg) -> dict[str, str]:
    """At the MLflow server's launch: write its basic-auth config and return its secrets, for its
    environment only (never its spec or log). Every request but /health and static files needs the
    login; a user an admin adds later gets no permission until granted one (NO_PERMISSIONS). The
    user store is SQLite in the state directory in PostgreSQL mode too: it checks the password kept
    beside it in secrets/, so the two cannot disagree (MLflow sets the admin's password only when it
    creates the user, and a PostgreSQL server may outlive, or be shared by, state directories)."""
    config = mlflow_auth_config(stack_cfg)
    config.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write_text(config, "[mlflow]\n"
                      "default_permission = NO_PERMISSIONS\n"
                      f"database_uri = sqlite:///{state_dir(stack_cfg) / 'mlflow' / 'auth.db'}\n"
                      f"admin_username = {MLFLOW_USERNAME}\n"
                      "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                      "grant_default_workspace_access = false\n", fsync=False)
    return {"MLFLOW_AUTH_ADMIN_PASSWORD": mlflow_password_file(stack_cfg).read_text().strip(),
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secret(stack_cfg, MLFLOW_FLASK_KEY)}


def check_mlflow_login(stack_cfg, timeout: float = 30.0) -> None:
    """StackError unless the running MLflow server takes the stack's login. MLflow sets the user's
    password only when it creates the user, so a password file replaced after the first start (or
    another one named by $CRUCIBLE_MLFLOW_PASSWORD_FILE) would otherwise fail every client later."""
    import base64

    login = base64.b64encode(f"{MLFLOW_USERNAME}:{mlflow_password_file(stack_cfg).read_text().strip()}".encode())
    req = urllib.request.Request(f"{mlflow_tracking_uri(stack_cfg)}/api/2.0/mlflow/users/current",
                                 headers={"Authorization": f"Basic {login.decode()}"})
    try:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=timeout).close()
    except urllib.error.HTTPError as e:
        if e.code not in (401, 403):
            raise StackError(f"MLflow's login check answered HTTP {e.code}") from None
        db = state_dir(stack_cfg) / "mlflow" / "auth.db"
        raise StackError(f"MLflow refuses the stack's login: its user store {db} holds another password for user "
                         f"{MLFLOW_USERNAME!r} than {mlflow_password_file(stack_cfg)}. Put back the password file it "
                         f"was created with, or stop the stack and delete {db} (users added since are lost).") from None
    except OSError as e:
        raise StackError(f"MLflow's login check failed: {e}") from None


def prefect_auth_env(stack_cfg) -> dict[str, str]:
    """Prefect's auth settings for the stack's server (server.api.auth_string) and its clients
    (api.auth_string). Put into a process's environment when it starts, never into a spec or log."""
    value = secret(stack_cfg, PREFECT_AUTH)
    return {"PREFECT_SERVER_API_AUTH_STRING": value, "PREFECT_API_AUTH_STRING": value}


def prefect_headers(stack_cfg) -> dict[str, str]:
    """The Authorization header a raw HTTP client of the stack's Prefect API sends."""
    from tasks.core.net import prefect_api_headers

    return prefect_api_headers(secret(stack_cfg, PREFECT_AUTH))


RUN_ROOTS_FILE = "run-roots.json"
# run-roots.json and run-stores.json decide where an event's checkpoint may come from: signed, so a
# root or store written there by anyone but the stack is refused (tasks/core/signing.py)
RUN_ROOTS_PURPOSE = "run-roots"
RUN_STORES_PURPOSE = "run-stores"


def _read_signed_list(stack_cfg, name: str, purpose: str, field: str) -> list:
    """The list under `field` of a signed state file: [] when there is none, or when it is unsigned or
    forged (logged as refused; the stack's next registration rewrites it)."""
    from tasks.core.signing import SignatureError, read_signed

    try:
        value = read_signed(state_dir(stack_cfg) / name, purpose).get(field)
    except (OSError, SignatureError):
        return []
    return list(value) if isinstance(value, list) else []


def _write_signed_list(stack_cfg, name: str, purpose: str, field: str, items: list) -> None:
    from tasks.core.signing import write_signed

    path = state_dir(stack_cfg) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    write_signed(path, {field: items}, purpose)


def register_run_root(stack_cfg, run_root: str | Path) -> None:
    """Record a run root the stack's event-triggered flows may load checkpoints from (what
    `crucible run` does for its config): an event naming a checkpoint anywhere else is refused."""
    roots = run_roots(stack_cfg)
    root = Path(run_root).expanduser().resolve()
    if root not in roots:
        _write_signed_list(stack_cfg, RUN_ROOTS_FILE, RUN_ROOTS_PURPOSE, "roots",
                           sorted(str(r) for r in roots + [root]))


RUN_CONFIGS_DIR = "run-configs"
RUN_CONFIG_PURPOSE = "run-config"


def run_config_file(stack_cfg, run_dir: str | Path) -> Path:
    run_dir = Path(run_dir).expanduser().resolve()
    tag = hashlib.sha256(str(run_dir).encode()).hexdigest()[:16]
    return state_dir(stack_cfg) / RUN_CONFIGS_DIR / f"{run_dir.name}-{tag}.json"


def register_run_config(stack_cfg, run_dir: str | Path, config: dict) -> Path:
    """The stack's signed copy of a run's resolved config (the pretrain flow registers it when it opens
    the run). The triggered flows take the run's config from it only, never from the run directory's
    config.json, which any writer of that directory could point elsewhere (lineage.http_url at itself
    to receive the write token, evaluate.wikitext.path at any file, a looser gate)."""
    from tasks.core.signing import write_signed

    path = run_config_file(stack_cfg, run_dir)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    record = {"run_dir": str(Path(run_dir).expanduser().resolve()), "config": config}
    return write_signed(path, record, RUN_CONFIG_PURPOSE)


def registered_run_config(stack_cfg, run_dir: str | Path) -> dict:
    """The registered config of the run in `run_dir`; SignatureError (logged as refused) when there is
    none, or it is unsigned, altered or another run's."""
    from tasks.core.signing import SignatureError, read_signed

    path, run_dir = run_config_file(stack_cfg, run_dir), str(Path(run_dir).expanduser().resolve())
    try:
        record = read_signed(path, RUN_CONFIG_PURPOSE)
    except FileNotFoundError:
        raise SignatureError(f"refused: the stack has no registered config of the run {run_dir} "
                             f"({path}; the pretrain flow registers it when it opens the run)") from None
    if record.get("run_dir") != run_dir or not isinstance(record.get("config"), dict):
        raise SignatureError(f"refused: {path} is the registered config of {record.get('run_dir')}, not of {run_dir}")
    return record["config"]


RUN_STORES_FILE = "run-stores.json"


def register_run_store(stack_cfg, store) -> None:
    """Record a remote run_root's store (its URI, option references and cache dir; never a secret:
    storage.options holds ${ENV} references only): the triggered flows open it to take an event's
    checkpoint object (training writes checkpoints to the store) into the working copy."""
    stores = {s["root"]: s for s in run_stores(stack_cfg)}
    entry = {"root": store.root, "options": store.options, "cache_dir": store.cache_dir}
    if stores.get(store.root) != entry:
        stores[store.root] = entry
        _write_signed_list(stack_cfg, RUN_STORES_FILE, RUN_STORES_PURPOSE, "stores",
                           sorted(stores.values(), key=lambda s: s["root"]))


def run_stores(stack_cfg) -> list[dict]:
    return [s for s in _read_signed_list(stack_cfg, RUN_STORES_FILE, RUN_STORES_PURPOSE, "stores")
            if isinstance(s, dict)]


def run_roots(stack_cfg) -> list[Path]:
    return [Path(p) for p in _read_signed_list(stack_cfg, RUN_ROOTS_FILE, RUN_ROOTS_PURPOSE, "roots")]


def use_stack(stack_cfg, lineage_cfg=None) -> None:
    """Point this process's clients (Prefect, MLflow, lineage) at the stack, with its Prefect auth."""
    os.environ.update(client_env(stack_cfg, lineage_cfg))
    os.environ.update({"PREFECT_API_AUTH_STRING": prefect_auth_env(stack_cfg)["PREFECT_API_AUTH_STRING"]})


def client_env(stack_cfg, lineage_cfg=None) -> dict[str, str]:
    """Environment a client process (e.g. `crucible run`) needs to talk to this stack (secrets by
    file path only)."""
    return {
        LINEAGE_URL_ENV: lineage_url(lineage_cfg),
        LINEAGE_TOKEN_FILE_ENV: str(secret_file(stack_cfg, LINEAGE_WRITE_TOKEN)),
        "PREFECT_API_URL": prefect_api_url(stack_cfg),
        "PREFECT_UI_URL": prefect_ui_url(stack_cfg),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "true",
        "MLFLOW_TRACKING_URI": mlflow_tracking_uri(stack_cfg),
        "MLFLOW_DISABLE_TELEMETRY": "true",
        # MLflow's own "View run ... at" lines name the GenAI view; Crucible prints the run pages itself
        "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
        **mlflow_client_env(stack_cfg),  # the login by the password file's path
        STATE_DIR_ENV: str(state_dir(stack_cfg)),
        SIGNING_KEY_FILE_ENV: str(signing_key_file(stack_cfg)),
        **artifact_store.client_env(),  # artifacts through the MLflow server, never straight from its store
        **(ray_client_env(stack_cfg) if stack_cfg.ray == "cluster" else {}),
    }


def _bin(name: str) -> str:
    """A console script of this interpreter's environment (the venv), else from PATH."""
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        raise StackError(f"`{name}` is not installed in {sys.prefix}; run infra/setup.sh")
    return found


# ---------------------------------------------------------------------------- service specs

def prefect_spec(stack_cfg) -> ServiceSpec:
    home = state_dir(stack_cfg) / "prefect"
    api = prefect_api_url(stack_cfg)
    return ServiceSpec(
        name=PREFECT,
        cmd=[_bin("prefect"), "server", "start", "--host", stack_cfg.host, "--port", str(stack_cfg.prefect_port)],
        host=stack_cfg.host, port=stack_cfg.prefect_port, health_path="/api/health",
        url=prefect_ui_url(stack_cfg), marker=["prefect", "server", "start"],
        env={
            "PREFECT_HOME": str(home),
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": database.prefect_database_url(stack_cfg, state_dir(stack_cfg)),
            **database.server_env(stack_cfg, state_dir(stack_cfg)),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "true",
            "PREFECT_API_URL": api,
            "PREFECT_UI_API_URL": api,
            "PREFECT_SERVER_API_HOST": stack_cfg.host,
            "PREFECT_SERVER_API_PORT": str(stack_cfg.prefect_port),
            "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        },
        info={"api_url": api},
    )


def mlflow_spec(stack_cfg) -> ServiceSpec:
    root = state_dir(stack_cfg)  # SQLite file or PostgreSQL (stack.database), artifacts (stack.artifacts_root)
    return ServiceSpec(
        name=MLFLOW,
        cmd=[_bin("mlflow"), "server",
             "--backend-store-uri", database.mlflow_backend_uri(stack_cfg, root),
             # artifacts are proxied by the server (--serve-artifacts is the default), so clients
             # log to mlflow-artifacts:/ over HTTP and never need the path or bucket below (an object
             # store's endpoint and credentials reach the server's environment at launch: _launch)
             "--artifacts-destination", database.mlflow_artifacts_root(stack_cfg, root),
             "--host", stack_cfg.host, "--port", str(stack_cfg.mlflow_port),
             "--workers", str(stack_cfg.mlflow_workers),
             # MLflow's auth app: the registry's tags and aliases decide what is served (_launch gives
             # it its config and secrets; /health stays open for the health check)
             "--app-name", "basic-auth"],
        host=stack_cfg.host, port=stack_cfg.mlflow_port, health_path="/health",
        url=mlflow_tracking_uri(stack_cfg), marker=["mlflow", "server"],
        env={
            # the GenAI job runner (a dozen huey consumers) is not used by the pipeline
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "MLFLOW_DISABLE_TELEMETRY": "true",
            "DO_NOT_TRACK": "true",
            "MLFLOW_AUTH_CONFIG_PATH": str(mlflow_auth_config(stack_cfg)),
            **database.server_env(stack_cfg, root),
        },
    )


def repo_pythonpath() -> str:
    """PYTHONPATH for a service that runs this repository's code from the state directory."""
    return os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)


def lineage_spec(stack_cfg, lineage_cfg=None) -> ServiceSpec:
    """The lineage service (infra/services/lineage): FastAPI + SQLite, Marquez-shaped API and page."""
    lineage_cfg = _lineage_cfg(lineage_cfg)
    db = lineage_db(stack_cfg, lineage_cfg)
    return ServiceSpec(
        name=LINEAGE,
        cmd=[sys.executable, "-m", "infra.services.lineage", "--db", str(db),
             "--host", lineage_cfg.service_host, "--port", str(lineage_cfg.service_port),
             "--prefect-ui", prefect_ui_url(stack_cfg), "--mlflow-ui", mlflow_tracking_uri(stack_cfg),
             "--write-token-file", str(secret_file(stack_cfg, LINEAGE_WRITE_TOKEN))]
            + ([] if lineage_cfg.public_reads else ["--read-token-file", str(secret_file(stack_cfg, LINEAGE_READ_TOKEN))]),
        host=lineage_cfg.service_host, port=lineage_cfg.service_port, health_path="/healthz",
        url=lineage_url(lineage_cfg), marker=["infra.services.lineage", "--db"],
        # the service is this repository's code: importable from the state directory too
        env={"PYTHONPATH": repo_pythonpath(), "DO_NOT_TRACK": "true"},
        info={"db": str(db), "api_url": lineage_url(lineage_cfg) + "/api/v1"},
    )


def flow_run_env(stack_cfg, lineage_cfg=None) -> dict[str, str]:
    """The environment of the worker, which its flow runs inherit (a process pool's jobs get the
    worker's own), and of the process registering the deployments: the stack's clients' (with
    Prefect's auth added at launch, never here) and this repository importable from anywhere."""
    return {**client_env(stack_cfg, lineage_cfg), "PYTHONPATH": repo_pythonpath(), "PYTHONUNBUFFERED": "1",
            "PREFECT_HOME": str(state_dir(stack_cfg) / "prefect-client")}


def prefect_worker_spec(stack_cfg, lineage_cfg=None) -> ServiceSpec:
    """`prefect worker start` for the stack's `process` work pool: it runs every flow run of the
    deployments registered there (flows/deployments.py), each in a process of its own, at most
    stack.worker_limit at once. Health: the worker's webserver (GET /health answers 200 while the
    worker polls the pool; PREFECT_WORKER_WEBSERVER_*). Started after the deployments are
    registered, stopped before Prefect."""
    host, port = stack_cfg.host, stack_cfg.worker_port
    env = {
        **flow_run_env(stack_cfg, lineage_cfg),
        "PREFECT_WORKER_WEBSERVER_HOST": host,
        "PREFECT_WORKER_WEBSERVER_PORT": str(port),
        # a triggered run waits up to one poll for the worker to pick it up (Prefect's default: 10 s);
        # /health turns 503 after 30 polls' time without one (60 s)
        "PREFECT_WORKER_QUERY_SECONDS": "2",
    }
    return ServiceSpec(
        name=WORKER,
        cmd=[_bin("prefect"), "worker", "start", "--pool", WORK_POOL, "--type", "process", "--name", f"{WORK_POOL}-worker",
             "--limit", str(stack_cfg.worker_limit), "--with-healthcheck", "--install-policy", "never",
             "--no-create-pool-if-not-found"],  # `up` creates the pool when it registers the deployments
        host=host, port=port, health_path="/health", url=prefect_page(prefect_ui_url(stack_cfg), f"/work-pools/work-pool/{WORK_POOL}"),
        marker=["prefect", "worker", "start", "--pool"], env=env, info={"pool": WORK_POOL})


def deployment_pools(stack_cfg, names: tuple[str, ...] | list[str]) -> dict[str, str | None]:
    """{deployment: its work pool} for each of `names` registered with the stack's Prefect (a
    missing one is left out). Raises OSError when Prefect does not answer."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback
    out = {}
    for name in names:
        req = urllib.request.Request(f"{prefect_api_url(stack_cfg)}/deployments/name/{name}",
                                     headers=prefect_headers(stack_cfg))
        try:
            with opener.open(req, timeout=30) as resp:
                out[name] = json.loads(resp.read()).get("work_pool_name")
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
    return out


def worker_runs(stack_cfg, lineage_cfg, deployments: tuple[str, ...]) -> bool:
    """The stack's worker is healthy and each of these deployments is registered to its pool."""
    if not service_status(stack_cfg, WORKER, prefect_worker_spec(stack_cfg, lineage_cfg))["healthy"]:
        return False
    pools = deployment_pools(stack_cfg, deployments)
    return all(pools.get(name) == WORK_POOL for name in deployments)


def register_deployments(stack_cfg, lineage_cfg=None, pipeline: tuple | None = None) -> dict:
    """`python -m flows.deployments` against the stack's Prefect, in this process's working
    directory (pretrain runs there), with the worker's environment: the event-triggered
    deployments (or their removal, stack.triggers off) and, given `pipeline` = (config path,
    overrides), pretrain and the scheduled continue-pretraining with that config. Returns its
    {"pool", "registered", "removed"}."""
    cmd = [sys.executable, "-m", "flows.deployments", *([] if stack_cfg.triggers else ["--no-triggers"])]
    if pipeline is not None:
        path, overrides = pipeline
        cmd += ["--config", str(path), *(a for o in overrides for a in ("--set", o))]
    env = {**os.environ, **flow_run_env(stack_cfg, lineage_cfg), **prefect_auth_env(stack_cfg)}
    proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env,
                          timeout=stack_cfg.start_timeout)
    if proc.returncode != 0:
        raise StackError(f"registering the deployments failed ({' '.join(cmd[1:])}):\n"
                         + "\n".join((proc.stdout + proc.stderr).splitlines()[-LOG_TAIL_LINES:]))
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _up_worker(stack_cfg, lineage_cfg, pipeline: tuple | None, timeout: float | None) -> dict:
    """The deployments, then the worker (caller holds stack_lock). They are registered when `up`
    has a pipeline config, when the worker starts (it used to be stopped: the code may have
    changed), or when the event-triggered ones are not as stack.triggers asks."""
    starting = running_pid(stack_cfg, WORKER) is None
    try:
        pools = deployment_pools(stack_cfg, EVENT_DEPLOYMENTS)
    except OSError:
        pools = {}
    events_as_asked = (all(pools.get(n) == WORK_POOL for n in EVENT_DEPLOYMENTS) if stack_cfg.triggers
                       else not pools)
    registered = None
    if pipeline is not None or starting or not events_as_asked:
        registered = register_deployments(stack_cfg, lineage_cfg, pipeline)
    out = start_services(stack_cfg, [prefect_worker_spec(stack_cfg, lineage_cfg)], timeout)
    if registered is not None:
        out[WORKER]["deployments"] = registered["registered"]
    return out


# ------------------------------------------------------------------------------ processes

def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, process group) from /proc, or None if there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = text[text.rindex(")") + 2:].split()
    return fields[0], int(fields[2])


def _reap(pid: int) -> None:
    proc = _CHILDREN.get(pid)
    if proc is not None:
        if proc.poll() is not None:
            _CHILDREN.pop(pid, None)
        return
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def pid_alive(pid: int) -> bool:
    """True if pid is a live (not zombie) process."""
    _reap(pid)
    if Path("/proc").is_dir():
        st = _proc_stat(pid)
        return st is not None and st[0] not in ("Z", "X")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def process_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _owned(pid: int, marker: list[str]) -> bool:
    """Alive and its command line looks like the service (not an unrelated reused pid)."""
    if not pid_alive(pid):
        return False
    if not Path("/proc").is_dir():
        return True
    cmd = process_cmdline(pid)
    return all(m in cmd for m in marker)


def group_pids(pgid: int) -> list[int]:
    """Live processes in process group pgid."""
    if not Path("/proc").is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _proc_stat(int(entry))
            if st and st[1] == pgid and st[0] not in ("Z", "X"):
                out.append(int(entry))
    return out


def _read_pid(stack_cfg, name: str) -> int | None:
    try:
        return int(_pid_path(stack_cfg, name).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


SPEC_PURPOSE = "service-spec"


def read_spec(stack_cfg, name: str) -> ServiceSpec | None:
    """The stack's record of how the service runs; None when there is none, or (logged as refused) when
    it is unsigned or forged: a spec is a command line `up` runs, a probe `status` runs and the marker
    that decides which pid is the service's, so only one the stack signed is taken."""
    from tasks.core.signing import SignatureError, read_signed

    try:
        return ServiceSpec.from_dict(read_signed(_spec_path(stack_cfg, name), SPEC_PURPOSE))
    except (FileNotFoundError, ValueError, TypeError, SignatureError):
        return None


def write_spec(stack_cfg, spec: ServiceSpec) -> None:
    """Record how the service is run (run/<name>.json, signed): what `up`, `status` and pid checks read."""
    from tasks.core.signing import write_signed

    write_signed(_spec_path(stack_cfg, spec.name), asdict(spec), SPEC_PURPOSE)


def running_pid(stack_cfg, name: str) -> int | None:
    """The pid of the service if its pid file names a live process of that service."""
    pid = _read_pid(stack_cfg, name)
    if pid is None:
        return None
    spec = read_spec(stack_cfg, name)
    if spec is None or not spec.marker:  # only the stack's signed record says which pid is the service
        return None
    return pid if _owned(pid, spec.marker) else None


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """GET url answers 2xx. Proxies from the environment are bypassed: this is loopback."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError, ValueError):
        return False


def service_healthy(spec: ServiceSpec, timeout: float = 2.0) -> bool:
    """The service's probe command exits 0 or, without one, its health URL answers 2xx."""
    if not spec.probe:
        return http_ok(spec.health_url, timeout=timeout)
    try:
        return subprocess.run(spec.probe, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=timeout + 2).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def stack_lock(stack_cfg) -> Iterator[None]:
    """Exclusive lock over the state directory, so concurrent up/down/deploy do not race."""
    path = state_dir(stack_cfg) / "stack.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def service_env(stack_cfg, spec: ServiceSpec) -> dict[str, str]:
    """The environment a service starts with (secrets added here, never recorded in its spec)."""
    # every service may be an MLflow client (the model server downloads registered models) and may sign
    # or verify records: the stack's key by path, whatever the environment of the process starting it
    env = {**os.environ, STATE_DIR_ENV: str(state_dir(stack_cfg)), SIGNING_KEY_FILE_ENV: str(signing_key_file(stack_cfg)),
           **artifact_store.client_env(), **mlflow_client_env(stack_cfg), **spec.env}
    if spec.name == PREFECT or "PREFECT_API_URL" in spec.env:  # the server and its clients share its auth
        env.update(prefect_auth_env(stack_cfg))
    if spec.name == MLFLOW:  # stack.artifacts_options resolved: secrets stay out of the spec and the log
        env.update(artifact_store.server_env(stack_cfg))
        env.update(_mlflow_server_auth_env(stack_cfg))
    return env


def _launch(stack_cfg, spec: ServiceSpec) -> int:
    """Start the service in its own session; write its spec and pid file. Returns the pid."""
    log = log_path(stack_cfg, spec.name)
    log.parent.mkdir(parents=True, exist_ok=True)
    cwd = state_dir(stack_cfg)
    env = service_env(stack_cfg, spec)
    with open(log, "ab") as logf:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        logf.write(f"\n=== crucible: starting {spec.name} at {stamp}: {' '.join(spec.cmd)}\n".encode())
        logf.flush()
        proc = subprocess.Popen(spec.cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True, close_fds=True)
    _CHILDREN[proc.pid] = proc
    write_spec(stack_cfg, spec)
    atomic_write_text(_pid_path(stack_cfg, spec.name), f"{proc.pid}\n", fsync=False)
    return proc.pid


def _wait_healthy(stack_cfg, pending: dict[str, tuple[ServiceSpec, int]], timeout: float) -> dict[str, float]:
    """Poll until each (spec, pid) answers its health URL. On failure, stop what was started and
    raise StackError with the log tail. Returns seconds until healthy per service."""
    t0 = time.monotonic()
    ready: dict[str, float] = {}
    while len(ready) < len(pending):
        for name, (spec, pid) in pending.items():
            if name in ready:
                continue
            if service_healthy(spec, timeout=1.0):
                ready[name] = round(time.monotonic() - t0, 2)
            elif not pid_alive(pid):
                _abort(stack_cfg, pending, ready)
                raise StackError(f"{name} exited during start-up (port {spec.port}). "
                                 f"Last lines of {log_path(stack_cfg, name)}:\n{log_tail(log_path(stack_cfg, name))}")
        if len(ready) == len(pending):
            break
        if time.monotonic() - t0 > timeout:
            late = [n for n in pending if n not in ready]
            _abort(stack_cfg, pending, ready)
            tails = "\n".join(f"--- {n}: {log_path(stack_cfg, n)}\n{log_tail(log_path(stack_cfg, n))}" for n in late)
            raise StackError(f"{', '.join(late)} not healthy after {timeout:.0f}s "
                             f"({', '.join(pending[n][0].health_url for n in late)}).\n{tails}")
        time.sleep(0.2)
    return ready


def _abort(stack_cfg, pending: dict[str, tuple[ServiceSpec, int]], ready: dict[str, float]) -> None:
    """Start-up failed: stop the services this call started that are not healthy."""
    for name in pending:
        if name not in ready:
            stop_service(stack_cfg, name)


def _check_port(spec: ServiceSpec, stack_cfg) -> None:
    if port_free(spec.host, spec.port):
        return
    what = "a service answering its health check" if service_healthy(spec, 1.0) else "another process"
    hint = {PREFECT: "stack.prefect_port", MLFLOW: "stack.mlflow_port", MODEL_SERVER: "deploy.port",
            LINEAGE: "lineage.service_port", WORKER: "stack.worker_port",
            POSTGRES: "stack.postgres_port"}.get(spec.name)
    raise StackError(
        f"cannot start {spec.name}: port {spec.host}:{spec.port} is in use by {what} that this stack "
        f"(state dir {state_dir(stack_cfg)}) did not start. Stop it, or choose another port"
        + (f" (e.g. --set {hint}=...)" if hint else "") + ".")


def _clean_stale(stack_cfg, name: str) -> None:
    """Pid file without its process: stop leftovers of its process group, remove the pid file."""
    pid = _read_pid(stack_cfg, name)
    if pid is None:
        _pid_path(stack_cfg, name).unlink(missing_ok=True)
        return
    if running_pid(stack_cfg, name) is None:
        if _group_is_ours(stack_cfg, name, pid):
            _kill_group(pid, timeout=5.0)  # leftovers whose leader died
        _pid_path(stack_cfg, name).unlink(missing_ok=True)


def _group_is_ours(stack_cfg, name: str, pgid: int) -> bool:
    """May the process group `pgid` recorded for `name` be signalled? Yes if its leader is the
    service, or if the leader is gone: Linux does not hand out a pid that is still some group's
    id, so surviving members of that group are the service's own children. No if the pid now
    belongs to an unrelated live process."""
    if not pid_alive(pgid):
        return True
    spec = read_spec(stack_cfg, name)
    return _owned(pgid, spec.marker if spec else [])


def start_services(stack_cfg, specs: list[ServiceSpec], timeout: float | None = None,
                   restart: bool = False) -> dict[str, dict]:
    """Start each service unless a healthy instance of it already runs (restart=True: always
    restart). Waits for all to be healthy. Caller holds stack_lock. Returns per service
    {url, healthy, pid, started, seconds}."""
    timeout = stack_cfg.start_timeout if timeout is None else timeout
    out: dict[str, dict] = {}
    pending: dict[str, tuple[ServiceSpec, int]] = {}
    waiting_existing: dict[str, tuple[ServiceSpec, int]] = {}
    to_start: list[ServiceSpec] = []
    for spec in specs:
        pid = running_pid(stack_cfg, spec.name)
        if pid is not None and restart:
            stop_service(stack_cfg, spec.name)
            pid = None
        if pid is not None:
            old = read_spec(stack_cfg, spec.name)
            if old and (old.host, old.port) != (spec.host, spec.port):
                raise StackError(f"{spec.name} is already running (pid {pid}) on {old.host}:{old.port}, but the "
                                 f"config asks for {spec.host}:{spec.port}; run `crucible down` first")
            if service_healthy(old or spec):
                out[spec.name] = {"url": spec.url, "healthy": True, "pid": pid, "started": False, "seconds": 0.0}
            else:  # alive but not (yet) healthy: perhaps still starting from another `up`
                waiting_existing[spec.name] = (old or spec, pid)
            continue
        _clean_stale(stack_cfg, spec.name)
        to_start.append(spec)
    for spec in to_start:  # every port is checked before anything is launched
        _check_port(spec, stack_cfg)
    for spec in to_start:
        pending[spec.name] = (spec, _launch(stack_cfg, spec))
    everything = {**waiting_existing, **pending}
    if everything:
        ready = _wait_healthy(stack_cfg, everything, timeout)
        for name, (spec, pid) in everything.items():
            out[name] = {"url": spec.url, "healthy": True, "pid": pid, "started": name in pending,
                         "seconds": ready[name]}
    return out


def _kill_group(pgid: int, timeout: float) -> str:
    """SIGTERM the process group, SIGKILL whatever remains after timeout. Returns what happened."""
    if not group_pids(pgid):
        _reap(pgid)
        return "not running"
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pgid)
        if not group_pids(pgid):
            return "stopped"
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and group_pids(pgid):
        _reap(pgid)
        time.sleep(0.05)
    _reap(pgid)
    return "killed"


def stop_service(stack_cfg, name: str, timeout: float | None = None, forget: bool = False) -> str:
    """Stop one service (its whole process group). forget=True also drops its spec, so `up` will
    not bring it back. Returns "stopped", "killed" or "not running"."""
    timeout = stack_cfg.stop_timeout if timeout is None else timeout
    pid = _read_pid(stack_cfg, name)
    result = "not running"
    if pid is not None:
        if _group_is_ours(stack_cfg, name, pid):
            result = _kill_group(pid, timeout)
        _pid_path(stack_cfg, name).unlink(missing_ok=True)
    if forget:
        _spec_path(stack_cfg, name).unlink(missing_ok=True)
    return result


def service_status(stack_cfg, name: str, spec: ServiceSpec | None = None) -> dict:
    """{url, healthy, pid}. A running service is described by how it was started; a stopped one
    by `spec` (from the config) if given."""
    pid = running_pid(stack_cfg, name)
    spec = (read_spec(stack_cfg, name) or spec) if pid is not None else (spec or read_spec(stack_cfg, name))
    url = spec.url if spec else None
    healthy = bool(spec) and pid is not None and service_healthy(spec, timeout=10)
    return {"url": url, "healthy": healthy, "pid": pid}


# ------------------------------------------------------------------------------- database

def postgres_spec(stack_cfg) -> ServiceSpec:
    """The embedded PostgreSQL server (infra/database.py), healthy once pg_isready says so."""
    root, port = state_dir(stack_cfg), stack_cfg.postgres_port
    data = database.data_dir(root)
    return ServiceSpec(
        name=POSTGRES, cmd=database.postgres_command(stack_cfg, root), host=database.LOCAL_HOST, port=port,
        health_path="", url=f"postgresql://{database.SUPERUSER}@{database.LOCAL_HOST}:{port}",
        marker=["postgres", "-D", str(data)], probe=database.probe_command(stack_cfg),
        info={"data_dir": str(data), "databases": list(database.DATABASES),
              "os_user": database.os_user_name(stack_cfg)})


def _start_database(stack_cfg, timeout: float | None) -> dict[str, dict]:
    """`up`'s first step with stack.database=postgres (caller holds stack_lock): create and start the
    embedded cluster (or take stack.postgres_url's server), then make sure its databases exist.
    Returns start_services' entry for the embedded server ({} otherwise)."""
    if not database.uses_postgres(stack_cfg):
        return {}
    root, out = state_dir(stack_cfg), {}
    try:
        if database.embedded(stack_cfg):
            database.ensure_cluster(stack_cfg, root, secret(stack_cfg, database.PASSWORD_SECRET))
            wait = min(stack_cfg.start_timeout if timeout is None else timeout, database.START_TIMEOUT)
            try:
                out = start_services(stack_cfg, [postgres_spec(stack_cfg)], wait)
            except StackError as e:
                raise StackError(f"{database.describe(stack_cfg, root)} did not start: {e}") from None
        database.ensure_databases(stack_cfg, root)
    except database.DatabaseError as e:  # the CLI reports a StackError in one line
        raise StackError(str(e)) from None
    return out


def _database_recorded(stack_cfg) -> bool:
    """The embedded PostgreSQL was started in this state directory (whatever the config says now)."""
    return _pid_path(stack_cfg, POSTGRES).exists() or _spec_path(stack_cfg, POSTGRES).exists()


def _database_status(stack_cfg) -> dict[str, dict]:
    """The embedded PostgreSQL's status: configured (stack.database=postgres without
    stack.postgres_url) or still recorded as started."""
    if database.embedded(stack_cfg):
        try:
            spec = postgres_spec(stack_cfg)
        except database.DatabaseError as e:  # no PostgreSQL programs or OS user: said, not a traceback
            return {POSTGRES: {"url": None, "healthy": False, "pid": running_pid(stack_cfg, POSTGRES), "error": str(e)}}
        return {POSTGRES: service_status(stack_cfg, POSTGRES, spec)}
    return {POSTGRES: service_status(stack_cfg, POSTGRES)} if _database_recorded(stack_cfg) else {}


# ------------------------------------------------------------------------------- public API

def up(stack_cfg, timeout: float | None = None, lineage_cfg=None, pipeline: tuple | None = None) -> dict:
    """Start Prefect, MLflow, the lineage service, the worker with its deployments (and the last
    deployed model server) unless already healthy. `lineage_cfg`: the config's `lineage` section
    (port, database); defaults if None.

    Idempotent: healthy services are left alone, stale pid files are cleaned. Waits until every
    service is healthy; raises StackError with the log tail otherwise. Returns
    {service: {url, healthy, pid, started, seconds}} plus "seconds" for the whole call.
    pipeline: (config path, overrides) of the config the pretrain deployment runs (and, with
    continue.schedule, the scheduled continue-pretraining deployment): registered with it now.
    """
    t0 = time.monotonic()
    root = state_dir(stack_cfg)
    for sub in ("prefect", "mlflow/artifacts", "run", "logs"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    with stack_lock(stack_cfg):
        # an object-store artifacts_root is checked before anything starts, not at MLflow's first upload
        if running_pid(stack_cfg, MLFLOW) is None:
            try:
                artifact_store.check(stack_cfg)
            except artifact_store.ArtifactStoreError as e:  # the CLI reports a StackError in one line
                raise StackError(str(e)) from None
        # stack.database=postgres: the database answers (and has its databases) before its clients start
        database_started = _start_database(stack_cfg, timeout)
        specs = [prefect_spec(stack_cfg), mlflow_spec(stack_cfg), lineage_spec(stack_cfg, lineage_cfg)]
        out: dict = {}
        model = read_spec(stack_cfg, MODEL_SERVER)
        if model is not None:  # a model was deployed: serve it again (started alongside the others)
            missing = [p for p in model.info.get("requires", []) if not Path(p).exists()]
            if missing:
                out[MODEL_SERVER] = {"url": model.url, "healthy": False, "pid": None, "started": False,
                                     "error": f"deployed files are gone: {missing}"}
            else:
                specs.append(model)
        out = {**database_started, **start_services(stack_cfg, specs, timeout), **out}
        check_mlflow_login(stack_cfg)  # every MLflow client of the stack sends it
        if stack_cfg.ray == "cluster":  # a Ray head, then its worker nodes (before the flow runs that use it)
            out.update(up_ray(stack_cfg, timeout))
        # the deployments register with Prefect, so they and the worker come once Prefect is healthy
        out.update(_up_worker(stack_cfg, lineage_cfg, pipeline, timeout))
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


def down(stack_cfg, timeout: float | None = None) -> dict[str, str]:
    """Stop the model server, the worker (its flow runs too), then the lineage service, MLflow and
    Prefect (SIGTERM to each process group, SIGKILL after stack.stop_timeout). The model server's
    deployment record is kept, so `up` serves the champion again. Returns {service: "stopped" |
    "killed" | "not running"}."""
    if not state_dir(stack_cfg).is_dir():
        return {name: "not running" for name in STOP_ORDER}
    with stack_lock(stack_cfg):
        # Prefect's, MLflow's and the lineage service's specs are rebuilt from the config on `up`;
        # the model server's is the deployment record and is kept.
        out = down_ray(stack_cfg, timeout)  # Ray worker nodes, then the head: before the database
        out.update({name: stop_service(stack_cfg, name, timeout, forget=name in CORE_SERVICES) for name in STOP_ORDER
                    if name != POSTGRES or _database_recorded(stack_cfg)})
        return out


def status(stack_cfg, lineage_cfg=None) -> dict[str, dict]:
    """{service: {url, healthy, pid}} for prefect, mlflow, lineage, worker and, once deployed, model_server."""
    out = {
        PREFECT: service_status(stack_cfg, PREFECT, prefect_spec(stack_cfg)),
        MLFLOW: service_status(stack_cfg, MLFLOW, mlflow_spec(stack_cfg)),
        LINEAGE: service_status(stack_cfg, LINEAGE, lineage_spec(stack_cfg, lineage_cfg)),
        WORKER: service_status(stack_cfg, WORKER, prefect_worker_spec(stack_cfg, lineage_cfg)),
    }
    out.update(_database_status(stack_cfg))
    if read_spec(stack_cfg, MODEL_SERVER) is not None or _read_pid(stack_cfg, MODEL_SERVER) is not None:
        out[MODEL_SERVER] = service_status(stack_cfg, MODEL_SERVER)
    out.update(ray_status(stack_cfg))  # with stack.ray: cluster, or while a cluster is recorded
    return out

# ------------------------------------------------------------------------- Ray cluster

# The stack's Ray cluster (`crucible up --ray`, or `stack.ray: cluster`): a head node and
# `stack.ray_workers` worker nodes, each a `ray start --block` process supervised like the other
# services of infra/stack.py (own process group, pid file, spec, log, SIGTERM then SIGKILL).
#
#     ray_head       ray start --head --port <ray_port> --num-cpus <ray_head_cpus> --node-name head
#     ray_worker_1   ray start --address <head> --num-cpus <n> --node-name worker-1 --resources {"worker-1": 1}
#     ...
#
# Every node advertises `connect_host(stack.host)` (127.0.0.1 by default). Ray's GCS and raylets
# listen on every interface whatever that address is (`ray start` swaps 127.0.0.1 for the host's
# address; the single-node switch that keeps loopback, which a run's own local Ray uses, refuses
# worker nodes), so the cluster requires Ray's token
# authentication: the token is a 0600 secret of the stack (secrets/ray-auth.token), and a driver
# needs RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH (`ray_client_env`; `crucible run` sets them).
#
# Health: each node's dashboard agent answers GET /api/healthz (public, no token) once the GCS
# says the node is alive; on the head it also checks the GCS. A node's agent listens on
# `ray_agent_port` (head) and `ray_agent_port + i` (worker i). Workers are started one at a time:
# two `ray start` on one machine at the same moment can pick the same raylet socket name.
# They are stopped before the head. A run attaches to the head's GCS address (`address`).

RAY_HEAD = "ray_head"
RAY_WORKER = "ray_worker_"  # + node number: ray_worker_1, ray_worker_2, ...
RAY_TOKEN = "ray-auth.token"
HEALTH_PATH = "/api/healthz"


def ray_address(stack_cfg) -> str:
    """The head's GCS address, what `ray.address` names to attach a driver on this machine."""
    return f"{connect_host(stack_cfg.host)}:{stack_cfg.ray_port}"


def ray_client_env(stack_cfg) -> dict[str, str]:
    """What a driver of the stack's cluster needs in its environment (the token by path only)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(secret_file(stack_cfg, RAY_TOKEN))}


def ray_temp_dir(stack_cfg) -> Path:
    """The cluster's own Ray temp dir (sessions, logs, sockets), one per state directory. Not Ray's
    default /tmp/ray: a `ray start --head` records its address there (ray_current_cluster), and a
    plain `ray.init()` anywhere on the machine would then attach to this cluster, or fail on the
    stale record after it stopped. Short, because it holds Unix sockets (107-byte path limit)."""
    tag = hashlib.sha256(str(state_dir(stack_cfg)).encode()).hexdigest()[:10]
    return Path(tempfile.gettempdir()) / f"crucible-ray-{tag}"


def _node_env(stack_cfg) -> dict[str, str]:
    return {**ray_client_env(stack_cfg), "RAY_USAGE_STATS_ENABLED": "0",
            # `down` stops the whole stack: no point draining a node (up to 30 s) before it stops
            "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}


def worker_cpus(stack_cfg) -> int:
    """CPUs of each worker node: stack.ray_worker_cpus, else the machine's shared out (≥ 1)."""
    return stack_cfg.ray_worker_cpus or max(1, (os.cpu_count() or 1) // stack_cfg.ray_workers)


def _node_args(stack_cfg, name: str, cpus: int, agent_port: int) -> list[str]:
    return ["--block", "--temp-dir", str(ray_temp_dir(stack_cfg)), "--node-ip-address", connect_host(stack_cfg.host),
            "--num-cpus", str(cpus),
            "--node-name", name, "--dashboard-agent-listen-port", str(agent_port),
            "--object-store-memory", str(stack_cfg.ray_object_store_mb << 20), "--disable-usage-stats"]


def head_spec(stack_cfg) -> ServiceSpec:
    host = connect_host(stack_cfg.host)
    return ServiceSpec(
        name=RAY_HEAD,
        cmd=[_bin("ray"), "start", "--head", "--port", str(stack_cfg.ray_port),
             "--ray-client-server-port", str(stack_cfg.ray_client_port), "--include-dashboard", "false",
             *_node_args(stack_cfg, "head", stack_cfg.ray_head_cpus, stack_cfg.ray_agent_port)],
        host=host, port=stack_cfg.ray_agent_port, health_path=HEALTH_PATH, url=f"ray://{host}:{stack_cfg.ray_client_port}",
        marker=["ray", "start", "--head", "--node-name head "], env=_node_env(stack_cfg),
        info={"address": ray_address(stack_cfg), "node": "head", "cpus": stack_cfg.ray_head_cpus})


def worker_spec(stack_cfg, i: int) -> ServiceSpec:
    """Worker node i (1-based): `worker-i`, with the custom resource {"worker-i": 1} so a task can
    be pinned to it."""
    name, cpus, port = f"worker-{i}", worker_cpus(stack_cfg), stack_cfg.ray_agent_port + i
    host = connect_host(stack_cfg.host)
    return ServiceSpec(
        name=f"{RAY_WORKER}{i}",
        cmd=[_bin("ray"), "start", "--address", ray_address(stack_cfg), "--resources", json.dumps({name: 1}),
             *_node_args(stack_cfg, name, cpus, port)],
        host=host, port=port, health_path=HEALTH_PATH, url=f"http://{host}:{port}{HEALTH_PATH}",
        marker=["ray", "start", "--address", f"--node-name {name} "], env=_node_env(stack_cfg),
        info={"address": ray_address(stack_cfg), "node": name, "cpus": cpus, "resources": {name: 1}})


def recorded_workers(stack_cfg) -> list[str]:
    """Service names of the worker nodes with a pid file or spec, in number order (including
    ones a smaller stack.ray_workers no longer asks for)."""
    names = {p.stem for p in _run_dir(stack_cfg).glob(f"{RAY_WORKER}*") if p.suffix in (".pid", ".json")}
    return sorted(names, key=lambda n: int(n[len(RAY_WORKER):]) if n[len(RAY_WORKER):].isdigit() else 0)


def up_ray(stack_cfg, timeout: float | None = None) -> dict[str, dict]:
    """Start the head, then each worker node in turn, unless already healthy (caller holds
    stack_lock). Returns {service: {url, healthy, pid, started, seconds}}."""
    if running_pid(stack_cfg, RAY_HEAD) is None:
        for port, setting in ((stack_cfg.ray_port, "stack.ray_port"), (stack_cfg.ray_client_port, "stack.ray_client_port")):
            if not port_free(connect_host(stack_cfg.host), port) or not port_free("0.0.0.0", port):
                raise StackError(f"cannot start the Ray head: port {port} is in use by another process "
                                 f"(another Ray cluster?). Stop it, or choose another port (e.g. --set {setting}=...).")
    out = start_services(stack_cfg, [head_spec(stack_cfg)], timeout)
    for i in range(1, stack_cfg.ray_workers + 1):
        out.update(start_services(stack_cfg, [worker_spec(stack_cfg, i)], timeout))
    out[RAY_HEAD]["address"] = ray_address(stack_cfg)
    return out


def down_ray(stack_cfg, timeout: float | None = None) -> dict[str, str]:
    """Stop the worker nodes (highest first), then the head. Their specs are rebuilt by `up`.
    {} when no node is recorded (the stack never ran a cluster)."""
    workers = recorded_workers(stack_cfg)
    if not workers and read_spec(stack_cfg, RAY_HEAD) is None and _read_pid(stack_cfg, RAY_HEAD) is None:
        return {}
    out = {name: stop_service(stack_cfg, name, timeout, forget=True) for name in reversed(workers)}
    out[RAY_HEAD] = stop_service(stack_cfg, RAY_HEAD, timeout, forget=True)
    if all(running_pid(stack_cfg, name) is None for name in out):  # sessions and logs of a stopped cluster
        shutil.rmtree(ray_temp_dir(stack_cfg), ignore_errors=True)
    return out


def ray_status(stack_cfg) -> dict[str, dict]:
    """Status of the head and every worker node ({} when no cluster is configured or recorded).
    The head's entry also says how many nodes are alive: each node's health check asks the GCS
    whether that node is alive, so this costs one local HTTP request per node."""
    recorded = read_spec(stack_cfg, RAY_HEAD) is not None or _read_pid(stack_cfg, RAY_HEAD) is not None
    if stack_cfg.ray != "cluster" and not recorded:
        return {}
    numbers = {int(n[len(RAY_WORKER):]) for n in recorded_workers(stack_cfg) if n[len(RAY_WORKER):].isdigit()}
    if stack_cfg.ray == "cluster":
        numbers |= set(range(1, stack_cfg.ray_workers + 1))
    out = {RAY_HEAD: service_status(stack_cfg, RAY_HEAD, head_spec(stack_cfg))}
    for i in sorted(numbers):
        out[f"{RAY_WORKER}{i}"] = service_status(stack_cfg, f"{RAY_WORKER}{i}", worker_spec(stack_cfg, i))
    alive = sum(1 for s in out.values() if s["healthy"])
    out[RAY_HEAD].update(address=ray_address(stack_cfg), nodes=f"{alive} of {len(out)} Ray nodes alive")
    return out


def free_agent_ports(workers: int) -> int:
    """A `stack.ray_agent_port` p with p .. p+workers free now (the head's and each worker node's
    health endpoint), for a cluster started beside others (tests, benchmarks)."""
    from tasks.core.net import free_port

    for _ in range(50):
        p = free_port()
        if all(port_free("127.0.0.1", p + i) for i in range(workers + 1)):
            return p
    raise StackError(f"no {workers + 1} consecutive free ports for the Ray nodes' health endpoints")


def up_ray_on_free_ports(state: str, attempts: int = 3, **settings):
    """A cluster (`up_ray`) on ports free now, for one started beside others (tests, benchmarks):
    its StackConfig. Ray picks some ports of its own at random, so one may take a chosen port
    before its node starts: that start is stopped and tried again on other ports."""
    from infra.settings import StackConfig
    from tasks.core.net import free_port

    for attempt in range(1, attempts + 1):
        cfg = StackConfig(state_dir=state, ray="cluster", ray_port=free_port(), ray_client_port=free_port(),
                          ray_agent_port=free_agent_ports(settings.get("ray_workers", 2)), **settings)
        try:
            with stack_lock(cfg):
                for sub in ("run", "logs"):
                    (state_dir(cfg) / sub).mkdir(parents=True, exist_ok=True)
                up_ray(cfg)
            return cfg
        except StackError as e:
            down_ray(cfg)
            if attempt == attempts:
                raise
            print(f"Ray cluster start failed ({e}); again on other ports", file=sys.stderr)


def cluster_address(stack_cfg) -> str | None:
    """The address of the stack's Ray cluster when its head is running, else None."""
    return ray_address(stack_cfg) if running_pid(stack_cfg, RAY_HEAD) is not None else None


def attach_cluster(cfg) -> dict[str, str]:
    """While the stack's Ray cluster is up, a pipeline config without its own ray.address runs on it:
    the address goes into `cfg` (so MLflow and the run's config.json record it). Returns what a
    driver of that cluster needs in its environment ({} when none runs)."""
    address = cluster_address(cfg.stack)
    if address is None:
        return {}
    if cfg.ray.address is None:
        cfg.ray.address = address
    return ray_client_env(cfg.stack)
