"""stack.database=postgres: Prefect's server and MLflow's tracking store on a real PostgreSQL cluster
that `crucible up` creates and runs (infra/database.py), read back through their APIs and straight
from PostgreSQL, with MLflow's artifacts on an S3 bucket (moto's server, IAM authentication on) that
only the tracking server holds credentials for (infra/artifact_store.py); and a PostgreSQL that is
down, or an artifact bucket that is missing or refuses the key, stops `up` / `run` quickly, naming it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from infra import database, stack
from s3_helpers import KEY_VAR, SECRET_VAR, moto_s3
from infra.settings import StackConfig, load_config
from tasks.config import ConfigError
from tasks.core.net import free_port
from test_e2e import CRUCIBLE, REPO, _prefect_runs

TINY = str(REPO / "configs" / "tiny.yaml")
# the demo at its smallest: JSONL sources only (no HTML extraction), no quality models, a
# 1-layer model for 4 steps, evaluated and registered by the pretrain flow itself (no triggered flows)
LEAN = ["model.n_layer=1", "model.n_head=2", "model.d_model=32", "model.seq_len=32", "train.max_steps=4",
        "train.nproc_per_node=1", "train.micro_batch_size=4", "train.checkpoint_every=4", "train.warmup_steps=1",
        "tokenizer.vocab_size=400", "tokenizer.reference=false", "tokenizer.probes.enabled=false",
        "curate.decontam.enabled=false", "quality.classifier.enabled=false", "quality.kenlm.enabled=false",
        "evaluate.lambada.enabled=false", "evaluate.hellaswag.enabled=false", "evaluate.calibration.enabled=false",
        "deploy.serve=false", "stack.triggers=false"]


def lean_config(path: Path) -> Path:
    """tiny.yaml with its JSONL sources only, written to `path` (the LEAN overrides do the rest)."""
    raw = yaml.safe_load(Path(TINY).read_text())
    raw["sources"] = [s for s in raw["sources"] if s["format"] == "jsonl"]
    path.write_text(yaml.safe_dump(raw))
    return path


ARTIFACTS = "mlflow-artifacts"  # the bucket of stack.artifacts_root


def _client_env() -> dict[str, str]:
    """This environment without the stack's, PostgreSQL's and the standard AWS credentials: the S3
    key reaches MLflow's server only through stack.artifacts_options' ${ENV} references."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PREFECT_", "MLFLOW_", "PG", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))}


@pytest.fixture(scope="module")
def s3():
    """One moto S3 server for the module (the demo's artifact store and the bucket checks)."""
    tmp = Path(tempfile.mkdtemp(prefix="crucible-pg-s3-"))
    try:
        with moto_s3(tmp, buckets=[ARTIFACTS]) as server:
            yield server
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def test_postgres_url_with_a_password_is_refused():
    with pytest.raises(ConfigError, match="stack.postgres_url") as err:
        load_config(TINY, ["stack.database=postgres", "stack.postgres_url=postgresql://u:hunter2@db:5432"])
    assert "hunter2" not in str(err.value)  # the error is printed: it must not echo the password
    assert load_config(TINY, ["stack.postgres_url=postgresql://u@db:5432"]).stack.postgres_url


def test_postgres_down_fails_up_and_run_within_30s_naming_the_setting(tmp_path):
    """Nothing answers at stack.postgres_url: `up` and `run` stop before Prefect or MLflow start,
    name PostgreSQL and the settings, and write nothing under run_root."""
    down_url = f"postgresql://crucible@127.0.0.1:{free_port()}"
    sets = [a for o in [f"stack.prefect_port={free_port()}", f"stack.mlflow_port={free_port()}",
                        f"lineage.service_port={free_port()}", f"run_root={tmp_path / 'runs'}", "stack.triggers=false",
                        "stack.database=postgres", f"stack.postgres_url={down_url}", "stack.database_timeout=3"]
            for a in ("--set", o)]
    state = tmp_path / "state"
    for command in (["up", "--config", TINY], ["run", TINY]):
        t0 = time.monotonic()
        proc = subprocess.run(CRUCIBLE + ["--state-dir", str(state), *command, *sets], cwd=REPO, env=_client_env(),
                              capture_output=True, text=True, timeout=120)
        took = time.monotonic() - t0
        assert proc.returncode != 0 and took < 30, (command, took, proc.stdout, proc.stderr)
        err = proc.stderr.splitlines()[-1]
        assert err.startswith("crucible: PostgreSQL at 127.0.0.1:") and "is not reachable" in err, proc.stderr
        assert "stack.database=postgres" in err and f"stack.postgres_url={down_url}" in err, err
        assert "Connection refused" in err
    assert not any((state / "run").glob("*.pid")), "a service was started against a database that is down"
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    assert not list(state.rglob("*.db")) or {p.name for p in state.rglob("*.db")} <= {"lineage.db"}


def test_artifact_bucket_missing_or_key_refused_fails_up_within_30s(s3, tmp_path, monkeypatch):
    """stack.artifacts_root's bucket is checked with the server's options before anything starts:
    a missing bucket or a wrong key fails `up` in seconds naming the setting, never the secret."""
    monkeypatch.setenv("WRONG_KEY", "AKIAWRONGWRONGWRONG0")
    monkeypatch.setenv("WRONG_SECRET", "not-the-secret-at-all")
    wrong_key = {**s3.options, "key": "${WRONG_KEY}", "secret": "${WRONG_SECRET}"}
    for root, options, says in (("s3://no-such-bucket/mlflow", s3.options, "bucket 'no-such-bucket' does not exist"),
                                (f"s3://{ARTIFACTS}/mlflow", wrong_key, "access denied")):
        cfg = StackConfig(state_dir=str(tmp_path / "state"), prefect_port=free_port(), mlflow_port=free_port(),
                          worker_port=free_port(), artifacts_root=root, artifacts_options=options)
        t0 = time.monotonic()
        with pytest.raises(stack.StackError) as err:
            stack.up(cfg)
        assert time.monotonic() - t0 < 30
        msg = str(err.value)
        assert msg.startswith(f"stack.artifacts_root {root}: ") and says in msg, msg
        assert "run_root" not in msg and "not-the-secret" not in msg and os.environ[SECRET_VAR] not in msg
        assert not any((tmp_path / "state" / "run").glob("*.pid")), "a service started before the check"


# ------------------------------------------------------------------------ the demo on PostgreSQL

@pytest.fixture(scope="module")
def pg_demo(s3):
    """The lean demo through `crucible run` with stack.database=postgres and MLflow's artifacts in the
    S3 bucket; the stack stays up for the tests."""
    tmp = Path(tempfile.mkdtemp(prefix="crucible-pg-demo-"))
    tmp.chmod(0o711)
    config = lean_config(tmp / "lean.yaml")
    raw = yaml.safe_load(config.read_text())
    raw["stack"] = {"artifacts_root": f"s3://{ARTIFACTS}/mlflow", "artifacts_options": s3.options}
    config.write_text(yaml.safe_dump(raw))
    overrides = [f"stack.state_dir={tmp / 'state'}", f"stack.prefect_port={free_port()}",
                 f"stack.mlflow_port={free_port()}", f"lineage.service_port={free_port()}",
                 f"stack.postgres_port={free_port()}", f"stack.worker_port={free_port()}", f"run_root={tmp / 'runs'}",
                 "stack.database=postgres", *LEAN]
    sets = [a for o in overrides for a in ("--set", o)]
    cfg = load_config(config, overrides)
    summary_path = tmp / "summary.json"
    t0 = time.monotonic()
    try:
        proc = subprocess.run(CRUCIBLE + ["run", str(config), *sets, "--summary", str(summary_path)], cwd=REPO,
                              env=_client_env(), capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        summary = json.loads(summary_path.read_text())
        print(f"\nlean demo on PostgreSQL: {time.monotonic() - t0:.0f}s, stages {summary['timings_s']}")
        status = json.loads(subprocess.run(CRUCIBLE + ["status", "--json", "--config", str(config), *sets], cwd=REPO,
                                           env=_client_env(), capture_output=True, text=True, timeout=60).stdout)
        yield {"summary": summary, "status": status, "stack": cfg.stack, "s3": s3,
               "headers": stack.prefect_headers(cfg.stack)}
    finally:
        stack.down(cfg.stack)
        shutil.rmtree(tmp, ignore_errors=True)


def _rows(stack_cfg, db: str, query: str) -> list[tuple]:
    """Rows straight from the stack's PostgreSQL."""
    conn = database.connect(stack_cfg, stack.state_dir(stack_cfg), db)
    try:
        with conn.cursor() as cur:
            cur.execute(query)
            return cur.fetchall()
    finally:
        conn.close()


@pytest.mark.e2e
def test_demo_state_lives_in_postgres(pg_demo):
    from mlflow.tracking import MlflowClient

    s, stack_cfg = pg_demo["summary"], pg_demo["stack"]
    assert s["status"] == "COMPLETED"
    assert pg_demo["status"]["postgres"]["healthy"] and pg_demo["status"]["prefect"]["healthy"]
    # neither server made a SQLite store
    state = stack.state_dir(stack_cfg)
    assert not list(state.rglob("prefect.db")) and not list(state.rglob("mlflow.db"))

    # MLflow: the runs and the registered champion, through the API and in the `mlflow` database
    client = MlflowClient(tracking_uri=s["mlflow"]["tracking_uri"])
    train_run_id = s["stages"]["train"]["mlflow_run_id"]
    api_runs = {r.info.run_id for e in client.search_experiments() for r in client.search_runs([e.experiment_id])}
    assert train_run_id in api_runs and len(api_runs) >= 3
    assert "val_loss" in client.get_run(train_run_id).data.metrics
    db_runs = {run_id for (run_id,) in _rows(stack_cfg, "mlflow", "SELECT run_uuid FROM runs")}
    assert db_runs == api_runs
    dep = s["stages"]["deploy"]
    champion = client.get_model_version_by_alias(dep["model_name"], "champion")
    assert str(champion.version) == str(dep["version"])
    assert (dep["model_name"], int(dep["version"])) in _rows(
        stack_cfg, "mlflow", "SELECT name, version FROM registered_model_aliases WHERE alias = 'champion'")
    assert (dep["model_name"], int(dep["version"])) in _rows(stack_cfg, "mlflow",
                                                             "SELECT name, version FROM model_versions")

    # Prefect: the pretrain flow run and its subflows, through the API and in the `prefect` database
    flow_runs, task_runs = _prefect_runs(pg_demo["status"], pg_demo["headers"])
    api_states = {r["id"]: r["state_type"] for r in flow_runs}
    assert api_states[s["flow_run_id"]] == "COMPLETED" and len(api_states) >= 6
    db_states = dict(_rows(stack_cfg, "prefect", "SELECT id::text, state_type::text FROM flow_run"))
    assert db_states == api_states
    db_tasks = {task_id for (task_id,) in _rows(stack_cfg, "prefect", "SELECT id::text FROM task_run")}
    assert db_tasks == {r["id"] for r in task_runs}


@pytest.mark.e2e
def test_demo_artifacts_live_in_the_bucket(pg_demo, tmp_path, monkeypatch):
    """The runs' logged artifacts and the registered model are objects in stack.artifacts_root's
    bucket (none in the state directory), behind mlflow-artifacts:/ URIs; the registered version
    downloads through the tracking server into a process without any S3 credential or endpoint."""
    import mlflow.artifacts
    from mlflow.tracking import MlflowClient

    from tasks.core.hashing import sha256_tree

    s, s3, uri = pg_demo["summary"], pg_demo["s3"], pg_demo["summary"]["mlflow"]["tracking_uri"]
    client = MlflowClient(tracking_uri=uri)
    dep = s["stages"]["deploy"]
    mv = client.get_model_version(dep["model_name"], str(dep["version"]))
    assert mv.source.startswith("mlflow-artifacts:/"), mv.source  # proxied: no client ever sees the bucket
    model_prefix = "mlflow/" + mv.source.removeprefix("mlflow-artifacts:").strip("/") + "/"
    model_keys = s3.keys(ARTIFACTS, model_prefix)
    # plain files and a signed manifest, no MLmodel (no loader code: tasks/deploy/mlflow_model.py)
    assert model_prefix + "crucible-model.json" in model_keys and model_prefix + "MLmodel" not in model_keys
    assert any(k.startswith(model_prefix + "checkpoint/") for k in model_keys), model_keys
    # the pipeline loaded it back from the registry (verify_registered) before making it champion
    assert mv.tags["deployment.verified"] == "loaded from the registry and generated"
    # a run's logged artifacts (the train stage's train.json, the model's copy), listed through the
    # server, are the bucket's objects under the run
    train = client.get_run(s["stages"]["train"]["mlflow_run_id"]).info
    assert train.artifact_uri == f"mlflow-artifacts:/{train.experiment_id}/{train.run_id}/artifacts"
    prefix = f"mlflow/{train.experiment_id}/{train.run_id}/artifacts/"
    run_keys = s3.keys(ARTIFACTS, prefix)
    assert prefix + "train.json" in run_keys, run_keys
    assert {f.path for f in client.list_artifacts(train.run_id)} == {k[len(prefix):].split("/")[0] for k in run_keys}
    state = stack.state_dir(pg_demo["stack"])
    # only the basic-auth app's user store lives there (SQLite beside the password file it checks)
    assert not [p for p in (state / "mlflow").rglob("*") if p.is_file() and p.name != "auth.db"], \
        "MLflow wrote artifacts to the state dir"
    # the server got the key from stack.artifacts_options' references at launch: not in its spec or log
    for written in (state / "run" / "mlflow.json", stack.log_path(pg_demo["stack"], "mlflow")):
        assert s3.secret not in written.read_text() and s3.key not in written.read_text(), written

    # a client with the stack's environment and no S3 credential or endpoint downloads the version
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_S3_ENDPOINT_URL", KEY_VAR, SECRET_VAR):
        monkeypatch.delenv(name, raising=False)
    for name, value in stack.client_env(pg_demo["stack"]).items():
        monkeypatch.setenv(name, value)
    t0 = time.monotonic()
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{dep['model_name']}/{dep['version']}",
                                                     dst_path=str(tmp_path), tracking_uri=uri))
    took = time.monotonic() - t0
    assert took < 30, f"downloading the registered model took {took:.0f}s"
    got = {p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file()}
    assert got - {"registered_model_meta"} == {k[len(model_prefix):] for k in model_keys}  # (that one: MLflow's note)
    assert sha256_tree(local / "checkpoint") == mv.tags["export_sha256"]


@pytest.mark.e2e
def test_down_stops_postgres_last(pg_demo):
    api = httpx.Client(base_url=pg_demo["status"]["prefect"]["url"], timeout=30, trust_env=False)
    result = stack.down(pg_demo["stack"])
    assert list(result)[-1] == "postgres" and result["postgres"] == "stopped", result  # SIGTERM sufficed
    assert result["prefect"] == result["mlflow"] == "stopped"
    assert not stack.status(pg_demo["stack"])["postgres"]["healthy"]
    with pytest.raises(httpx.TransportError):
        api.get("/api/health")
