"""The stack's MLflow server is a trust anchor (the champion alias, the registry tags the deploy gate
reads, the registered artifacts): an outsider on the host must not be able to write it. Attacks by
plain HTTP against a real stack-started MLflow (tag, alias, new version, artifact upload through the
proxied artifact API) are refused; the pipeline's own client, given only the stack's environment (the
credentials by file path), does the same writes."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from infra import stack
from infra.settings import StackConfig
from tasks.core.constants import MLFLOW_PASSWORD_FILE_ENV, MLFLOW_USERNAME
from tasks.core.net import free_port

MODEL = "auth-target"
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mlflow_only(tmp_path_factory):
    """Only the stack's MLflow server (as `up` starts it), and a registered version to attack."""
    cfg = StackConfig(state_dir=str(tmp_path_factory.mktemp("mlflow-auth") / "state"), mlflow_port=free_port(),
                      start_timeout=240, stop_timeout=15)
    (stack.state_dir(cfg) / "mlflow" / "artifacts").mkdir(parents=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(MLFLOW_PASSWORD_FILE_ENV, raising=False)  # the stack's own login, not the session's (conftest)
        try:
            with stack.stack_lock(cfg):
                stack.start_services(cfg, [stack.mlflow_spec(cfg)])
            yield cfg
        finally:
            stack.stop_service(cfg, stack.MLFLOW, forget=True)


def _stack_client(cfg, monkeypatch):
    """An MlflowClient with nothing but the stack's client environment (what every flow run gets)."""
    from mlflow import MlflowClient

    for name, value in stack.client_env(cfg).items():
        monkeypatch.setenv(name, value)
    uri = stack.mlflow_tracking_uri(cfg)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _login(cfg) -> tuple[str, str]:
    """The stack's MLflow login, as `crucible login` prints it from the secrets folder."""
    out = subprocess.run([sys.executable, "-m", "infra.cli", "--state-dir", str(stack.state_dir(cfg)), "login", "--json",
                          "--set", f"stack.mlflow_port={cfg.mlflow_port}"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    login = json.loads(out.stdout)
    assert login["mlflow"]["url"] == stack.mlflow_tracking_uri(cfg) and login["mlflow"]["user"] == MLFLOW_USERNAME
    prefect_auth = stack.state_dir(cfg) / "secrets" / stack.PREFECT_AUTH  # read, not made, by both sides
    assert ("prefect" in login) == prefect_auth.is_file()
    if prefect_auth.is_file():
        assert login["prefect"]["auth_string"] == "crucible:" + prefect_auth.read_text().strip()
    return login["mlflow"]["user"], login["mlflow"]["password"]


def test_login_without_a_stack_says_so(tmp_path):
    # a shell of its own: none of the session's shared secrets (tests/conftest.py) in its environment
    env = {k: v for k, v in os.environ.items() if k not in ("CRUCIBLE_SIGNING_KEY_FILE", "CRUCIBLE_MLFLOW_PASSWORD_FILE")}
    out = subprocess.run([sys.executable, "-m", "infra.cli", "--state-dir", str(tmp_path / "none"), "login"], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1 and "no stack has been started" in out.stderr and "crucible up" in out.stderr
    assert not (tmp_path / "none" / "secrets").exists()  # nothing generated that no server holds


def _writes(uri: str, run_id: str, experiment_id: str) -> list[tuple[str, str, dict]]:
    """(method, url, body) of each write an attacker would make against the registry and the store."""
    api = f"{uri}/api/2.0/mlflow"
    return [
        ("POST", f"{api}/model-versions/set-tag", {"name": MODEL, "version": "1", "key": "export_sha256", "value": "0" * 64}),
        ("POST", f"{api}/registered-models/alias", {"name": MODEL, "alias": "champion", "version": "1"}),
        ("POST", f"{api}/model-versions/create", {"name": MODEL, "source": f"mlflow-artifacts:/{experiment_id}/{run_id}/artifacts",
                                                 "run_id": run_id}),
        ("PUT", f"{uri}/api/2.0/mlflow-artifacts/artifacts/{experiment_id}/{run_id}/artifacts/planted/MLmodel",
         None),
        ("POST", f"{api}/runs/set-tag", {"run_id": run_id, "key": "data.tokens_index", "value": "/tmp/planted"}),
    ]


def _send(client: httpx.Client, method: str, url: str, body: dict | None, **kw) -> httpx.Response:
    if body is None:  # the artifact upload: a file's bytes
        return client.request(method, url, content=b"loader_module: planted\n", **kw)
    return client.request(method, url, json=body, **kw)


def test_anonymous_writes_to_the_stacks_mlflow_are_refused(mlflow_only, monkeypatch, tmp_path):
    cfg = mlflow_only
    uri = stack.mlflow_tracking_uri(cfg)
    # the pipeline's client, with the stack's environment only, registers a version (as deploy does)
    client = _stack_client(cfg, monkeypatch)
    experiment_id = client.create_experiment("auth")
    run_id = client.create_run(experiment_id).info.run_id
    (tmp_path / "model.txt").write_text("weights\n")
    client.log_artifact(run_id, str(tmp_path / "model.txt"), "model")
    client.create_registered_model(MODEL)
    client.create_model_version(MODEL, f"runs:/{run_id}/model", run_id)

    anon = httpx.Client(timeout=30, trust_env=False)
    for method, url, body in _writes(uri, run_id, experiment_id):  # the attack, as it worked before auth
        r = _send(anon, method, url, body)
        assert r.status_code in (401, 403), (method, url, r.status_code, r.text[:300])
    user, password = _login(cfg)
    wrong = httpx.Client(timeout=30, trust_env=False, auth=(user, password[:-1] + ("x" if password[-1] != "x" else "y")))
    for who in (anon, wrong):
        for method, url, body in _writes(uri, run_id, experiment_id):
            r = _send(who, method, url, body)
            assert r.status_code in (401, 403), (method, url, r.status_code, r.text[:300])
        # reads too: the UI asks for the login (HTTP Basic), the registry's tags are not public
        r = who.get(f"{uri}/api/2.0/mlflow/registered-models/get", params={"name": MODEL})
        assert r.status_code == 401 and r.headers["WWW-Authenticate"].startswith("Basic"), r.status_code
        assert who.get(f"{uri}/", follow_redirects=True).status_code == 401
    # nothing was written
    mv = client.get_model_version(MODEL, "1")
    assert "export_sha256" not in mv.tags and not mv.aliases
    assert [v.version for v in client.search_model_versions(f"name='{MODEL}'")] == ["1"]
    assert "data.tokens_index" not in client.get_run(run_id).data.tags
    assert not (stack.state_dir(cfg) / "mlflow" / "artifacts" / experiment_id / run_id / "artifacts" / "planted").exists()
    # the stack's health check needs no login
    assert anon.get(f"{uri}/health").status_code == 200

    # a user the admin adds gets no permission by default (default_permission NO_PERMISSIONS): no
    # reads, no writes, until granted
    admin = httpx.Client(timeout=30, trust_env=False, auth=(user, password))
    r = admin.post(f"{uri}/api/2.0/mlflow/users/create", json={"username": "visitor", "password": "visitor-password-1"})
    assert r.status_code == 200, r.text
    visitor = httpx.Client(timeout=30, trust_env=False, auth=("visitor", "visitor-password-1"))
    assert visitor.get(f"{uri}/api/2.0/mlflow/registered-models/get", params={"name": MODEL}).status_code == 403
    for method, url, body in _writes(uri, run_id, experiment_id):
        assert _send(visitor, method, url, body).status_code == 403, (method, url)

    # the same writes with the stack's login work (raw HTTP, as the UI does)
    for method, url, body in _writes(uri, run_id, experiment_id):
        r = _send(admin, method, url, body)
        assert r.status_code == 200, (method, url, r.status_code, r.text[:300])
    mv = client.get_model_version(MODEL, "1")
    assert mv.tags["export_sha256"] == "0" * 64 and mv.aliases == ["champion"]
    # and through the pipeline's client (tag, alias, artifact round trip)
    client.set_model_version_tag(MODEL, "1", "checked", "yes")
    client.set_registered_model_alias(MODEL, "challenger", "2")
    assert client.get_model_version_by_alias(MODEL, "challenger").version == "2"
    got = client.download_artifacts(run_id, "model/model.txt", str(tmp_path))
    assert open(got).read() == "weights\n"

    # the login is a 0600 secret of the state directory, handed to the server and the clients by path:
    # never in a spec, a client environment or the server's log
    creds = stack.mlflow_password_file(cfg)
    assert oct(creds.stat().st_mode & 0o777) == "0o600" and creds.parent == stack.state_dir(cfg) / "secrets"
    spec_text = (stack.state_dir(cfg) / "run" / "mlflow.json").read_text()
    basic = base64.b64encode(f"{user}:{password}".encode()).decode()
    for text in (spec_text, str(stack.client_env(cfg)), stack.log_path(cfg, stack.MLFLOW).read_text()):
        assert password not in text and basic not in text


def test_up_says_when_the_password_file_no_longer_matches_mlflows_user_store(mlflow_only):
    """MLflow sets the admin's password only when it creates the user: a password file replaced later
    would fail every client mid-run, so `up` checks the login and names both files."""
    cfg = mlflow_only
    stack.check_mlflow_login(cfg)  # the stack's own file: taken
    path = stack.mlflow_password_file(cfg)
    kept = path.read_text()
    try:
        path.write_text("another-password-entirely\n")
        with pytest.raises(stack.StackError, match="MLflow refuses the stack's login") as err:
            stack.check_mlflow_login(cfg)
        assert str(path) in str(err.value) and "auth.db" in str(err.value) and "another-password" not in str(err.value)
    finally:
        path.write_text(kept)
