"""The local stack with real processes: a Prefect server, an MLflow server, the lineage service and the
Prefect worker of the stack's work pool on free ports in a temporary state directory (so a
developer's own stack on the default ports is not disturbed)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from infra import stack
from infra.settings import LineageConfig, StackConfig
from tasks.core.constants import MLFLOW_USERNAME
from tasks.core.net import free_port

REPO = Path(__file__).resolve().parent.parent


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


@pytest.fixture
def stack_cfg(tmp_path):
    return StackConfig(state_dir=str(tmp_path / "state"), prefect_port=free_port(), mlflow_port=free_port(),
                       worker_port=free_port(), start_timeout=240, stop_timeout=15)


@pytest.fixture
def lineage_cfg():
    return LineageConfig(service_port=free_port())


@pytest.fixture(autouse=True)
def _no_state_dir_env(monkeypatch):
    monkeypatch.delenv(stack.STATE_DIR_ENV, raising=False)


SERVICES = ("prefect", "mlflow", "lineage", "worker")


def test_up_idempotent_status_down(stack_cfg, lineage_cfg):
    state = stack.state_dir(stack_cfg)
    # a stale pid file from a crashed earlier stack is cleaned up, not trusted
    (state / "run").mkdir(parents=True)
    (state / "run" / "prefect.pid").write_text(f"{_dead_pid()}\n")

    t0 = time.monotonic()
    first = stack.up(stack_cfg, lineage_cfg=lineage_cfg)
    cold = time.monotonic() - t0
    print(f"\ncold `up`: {cold:.1f}s (prefect {first['prefect']['seconds']}s, mlflow {first['mlflow']['seconds']}s, "
          f"lineage {first['lineage']['seconds']}s)")
    for name in SERVICES:
        assert first[name]["healthy"] and first[name]["started"], first
        assert stack.pid_alive(first[name]["pid"])
        assert (state / "run" / f"{name}.pid").read_text().strip() == str(first[name]["pid"])
        assert (state / "logs" / f"{name}.log").stat().st_size > 0

    st = stack.status(stack_cfg, lineage_cfg)
    assert set(st) == set(SERVICES)
    assert {n: (s["healthy"], s["pid"]) for n, s in st.items()} == \
        {n: (True, first[n]["pid"]) for n in SERVICES}
    assert st["prefect"]["url"] == f"http://127.0.0.1:{stack_cfg.prefect_port}"
    assert st["mlflow"]["url"] == stack.mlflow_tracking_uri(stack_cfg)
    assert st["lineage"]["url"] == f"http://127.0.0.1:{lineage_cfg.service_port}" == stack.lineage_url(lineage_cfg)

    # the services really are what they claim: Prefect's API and MLflow's REST API on those ports,
    # with their databases under the state directory
    assert httpx.get(f"{stack.prefect_api_url(stack_cfg)}/health", timeout=10).json() is True
    # (MLflow's only with the stack's login: its password file is 0600, and in no spec)
    get_default = dict(url=f"{stack.mlflow_tracking_uri(stack_cfg)}/api/2.0/mlflow/experiments/get-by-name",
                       params={"experiment_name": "Default"}, timeout=10)
    assert httpx.get(**get_default).status_code == 401
    password = stack.mlflow_password_file(stack_cfg).read_text().strip()
    r = httpx.get(**get_default, auth=(MLFLOW_USERNAME, password))
    assert r.status_code == 200 and r.json()["experiment"]["name"] == "Default"
    assert oct(stack.mlflow_password_file(stack_cfg).stat().st_mode & 0o777) == "0o600"
    assert not any(password in p.read_text() for p in (state / "run").glob("*.json"))
    assert (state / "prefect" / "prefect.db").exists() and (state / "mlflow" / "mlflow.db").exists()
    # the lineage service takes events and answers the Marquez-shaped API, its SQLite store in the state dir
    lineage = stack.lineage_url(lineage_cfg)
    event = {"eventType": "COMPLETE", "eventTime": "2026-01-01T00:00:00Z", "producer": "https://example.com/p",
             "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent",
             "run": {"runId": "0195f7a3-0000-7000-8000-000000000001"}, "job": {"namespace": "crucible", "name": "j"},
             "inputs": [], "outputs": [{"namespace": "file", "name": "/tmp/out.bin"}]}
    # writes need the stack's write token (a 0600 file in the state dir): without it, nothing is stored
    assert httpx.post(f"{lineage}/api/v1/lineage", json=event, timeout=10).status_code == 401
    token_file = stack.secret_file(stack_cfg, stack.LINEAGE_WRITE_TOKEN)
    assert oct(token_file.stat().st_mode & 0o777) == "0o600"
    assert token_file.read_text().strip() not in stack.read_spec(stack_cfg, "lineage").cmd  # passed by path
    r = httpx.post(f"{lineage}/api/v1/lineage", json=event, timeout=10,
                   headers={"Authorization": f"Bearer {token_file.read_text().strip()}"})
    assert r.status_code == 201 and r.json()["ingested"] == 1, r.text
    assert httpx.get(f"{lineage}/api/v1/namespaces/crucible/jobs/j", timeout=10).json()["latestRun"]["state"] \
        == "COMPLETED"
    assert (state / "lineage.db").exists()
    assert "--prefect-ui" in stack.process_cmdline(first["lineage"]["pid"])  # the page links Prefect runs
    # the worker polls the stack's process pool, where `up` registered the event-triggered deployments
    assert set(first["worker"]["deployments"]) == {"evaluate-checkpoint/evaluate-checkpoint", "deploy-model/deploy-model"}
    assert stack.deployment_pools(stack_cfg, stack.EVENT_DEPLOYMENTS) == dict.fromkeys(stack.EVENT_DEPLOYMENTS, "crucible")
    deadline = time.monotonic() + 60  # /health answers from the worker's start; READY once it has polled
    while (pool := httpx.get(f"{stack.prefect_api_url(stack_cfg)}/work_pools/crucible", timeout=10,
                             headers=stack.prefect_headers(stack_cfg)).json())["status"] != "READY":
        assert time.monotonic() < deadline, pool
        time.sleep(1)
    assert pool["type"] == "process"

    # `crucible status --json` prints exactly {service: {url, healthy, pid}}
    out = subprocess.run([sys.executable, "-m", "infra.cli", "--state-dir", str(state), "status", "--json",
                          "--set", f"stack.prefect_port={stack_cfg.prefect_port}",
                          "--set", f"stack.mlflow_port={stack_cfg.mlflow_port}",
                          "--set", f"lineage.service_port={lineage_cfg.service_port}"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == st

    # idempotent: a second `up` leaves the healthy services alone
    t0 = time.monotonic()
    again = stack.up(stack_cfg, lineage_cfg=lineage_cfg)
    assert time.monotonic() - t0 < 30  # nothing restarted: only health checks
    for name in SERVICES:
        assert again[name]["pid"] == first[name]["pid"] and not again[name]["started"]
    assert "deployments" not in again["worker"]  # registered already: not again

    # a port clash with a different config is refused while the stack runs
    moved = stack_cfg.model_copy(update={"mlflow_port": free_port()})
    with pytest.raises(stack.StackError, match="crucible down"):
        stack.up(moved, lineage_cfg=lineage_cfg)
    with pytest.raises(stack.StackError, match="lineage is already running"):
        stack.up(stack_cfg, lineage_cfg=lineage_cfg.model_copy(update={"service_port": free_port()}))

    pgids = [first[n]["pid"] for n in SERVICES]
    assert all(stack.group_pids(g) for g in pgids)
    result = stack.down(stack_cfg)
    assert all(result[n] in ("stopped", "killed") for n in SERVICES), result
    assert result["model_server"] == "not running"
    assert list(result) == ["model_server", "worker", "lineage", "mlflow", "prefect"]  # stop order
    st = stack.status(stack_cfg, lineage_cfg)
    assert all(not s["healthy"] and s["pid"] is None for s in st.values()), st
    assert all(stack.group_pids(g) == [] for g in pgids), "processes left behind after down"
    assert not list((state / "run").glob("*.pid"))
    assert stack.port_free("127.0.0.1", stack_cfg.prefect_port)
    assert stack.port_free("127.0.0.1", stack_cfg.mlflow_port)
    assert stack.port_free("127.0.0.1", lineage_cfg.service_port)
    assert stack.down(stack_cfg) == {"model_server": "not running", "worker": "not running",
                                     "lineage": "not running", "mlflow": "not running", "prefect": "not running"}


def test_port_taken_by_another_process_is_a_clear_error(stack_cfg, lineage_cfg):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        taken = s.getsockname()[1]
        cfg = stack_cfg.model_copy(update={"mlflow_port": taken})
        with pytest.raises(stack.StackError, match=rf"port 127\.0\.0\.1:{taken} is in use.*stack\.mlflow_port"):
            stack.up(cfg, lineage_cfg=lineage_cfg)
        with pytest.raises(stack.StackError, match=rf"port 127\.0\.0\.1:{taken} is in use.*lineage\.service_port"):
            stack.up(stack_cfg, lineage_cfg=lineage_cfg.model_copy(update={"service_port": taken}))
    # nothing was launched: the check runs before any service starts
    assert stack.status(cfg)["prefect"]["pid"] is None
    assert not list((stack.state_dir(cfg) / "run").glob("*.pid"))


def _spec(cfg, name: str, code: str, port: int) -> stack.ServiceSpec:
    return stack.ServiceSpec(name=name, cmd=[sys.executable, "-c", code], host="127.0.0.1", port=port,
                             health_path="/health", url=f"http://127.0.0.1:{port}", marker=["-c"])


def test_service_that_dies_reports_its_log_tail(stack_cfg):
    spec = _spec(stack_cfg, "broken", "import sys; print('boom: no database'); sys.exit(3)", free_port())
    with pytest.raises(stack.StackError, match="(?s)broken exited during start-up.*boom: no database"):
        stack.start_services(stack_cfg, [spec], timeout=30)
    assert stack.running_pid(stack_cfg, "broken") is None


def test_service_that_never_gets_healthy_times_out_and_is_killed(stack_cfg):
    # ignores SIGTERM, so the SIGKILL escalation is exercised too
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('hung', flush=True); time.sleep(60)"
    spec = _spec(stack_cfg, "hung", code, free_port())
    cfg = stack_cfg.model_copy(update={"stop_timeout": 1.0})
    t0 = time.monotonic()
    with pytest.raises(stack.StackError, match="(?s)hung not healthy after 2s.*hung"):
        stack.start_services(cfg, [spec], timeout=2)
    assert time.monotonic() - t0 < 15
    pid = json.loads((stack.state_dir(cfg) / "run" / "hung.json").read_text())  # spec kept for the record
    assert pid["name"] == "hung"
    assert not (stack.state_dir(cfg) / "run" / "hung.pid").exists()
    assert not [p for p in os.listdir("/proc") if p.isdigit() and "time.sleep(60)" in stack.process_cmdline(int(p))
                and "SIG_IGN" in stack.process_cmdline(int(p))]


def test_a_service_spec_planted_in_the_state_dir_is_never_run(stack_cfg, tmp_path):
    """run/<svc>.json says how a service is started and probed; `status` runs its probe and `up`
    restarts a recorded model server from it. A spec written there by anyone but the stack (a probe
    that runs their command, an empty marker that claims any pid) is refused: never run, never
    trusted to own a pid."""
    marker = tmp_path / "PWNED"
    run = stack.state_dir(stack_cfg) / "run"
    run.mkdir(parents=True)
    planted = {"name": "prefect", "cmd": ["true"], "host": "127.0.0.1", "port": free_port(), "health_path": "/",
               "url": "http://127.0.0.1/", "marker": [], "env": {},
               "probe": [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]}
    (run / "prefect.json").write_text(json.dumps(planted))
    (run / "prefect.pid").write_text(f"{os.getpid()}\n")  # a live process that is no service
    assert stack.read_spec(stack_cfg, "prefect") is None
    assert stack.running_pid(stack_cfg, "prefect") is None
    stack.status(stack_cfg)
    assert not marker.exists(), "the planted probe ran"
    # the stack's own record still counts
    genuine = stack.ServiceSpec(**{**planted, "probe": []})
    stack.write_spec(stack_cfg, genuine)
    assert stack.read_spec(stack_cfg, "prefect") == genuine


def test_launched_services_sign_with_the_stacks_key(stack_cfg, monkeypatch):
    """A service the stack starts (a model server restarted by `crucible up`, whatever shell runs it)
    signs and verifies with the stack's key, not one found relative to its working directory."""
    from tasks.core.signing import SIGNING_KEY_FILE_ENV

    monkeypatch.delenv(SIGNING_KEY_FILE_ENV)
    env = stack.service_env(stack_cfg, _spec(stack_cfg, "probe", "pass", free_port()))
    assert env[SIGNING_KEY_FILE_ENV] == str(stack.state_dir(stack_cfg) / "secrets" / "signing.key")
    assert env[stack.STATE_DIR_ENV] == str(stack.state_dir(stack_cfg))


def test_marquez_compose_file_binds_loopback_and_uses_official_images():
    import yaml

    compose = yaml.safe_load((REPO / "infra" / "docker-compose.marquez.yml").read_text())
    services = compose["services"]
    images = {name: s["image"].split(":")[0] for name, s in services.items()}
    assert images == {"marquez-db": "postgres", "marquez-api": "marquezproject/marquez",
                      "marquez-web": "marquezproject/marquez-web"}
    assert all(":" in s["image"] and not s["image"].endswith(":latest") for s in services.values())  # pinned
    ports = [p for s in services.values() for p in s.get("ports", [])]
    assert ports and all(p.startswith("127.0.0.1:") for p in ports), ports
    assert "ports" not in services["marquez-db"]  # the database stays on the compose network
    # the README says how to point the HTTP transport at it and how to replay a log into it
    readme = (REPO / "README.md").read_text()
    assert "lineage.http_url=http://127.0.0.1:9000" in readme and "crucible lineage replay" in readme
