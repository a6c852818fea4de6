"""The stack's Prefect work pool end to end: `crucible up --config` creates the `process` pool
`crucible`, starts its worker and registers the deployments to it; a flow run of `pretrain` created
through the Prefect API, as the UI's Run creates it (the deployment's default parameters: the config
`crucible up` was given), is picked up by the worker and runs the whole lean pipeline, the
checkpoints' evaluation and deployment by the event-triggered flows on the same worker included.
The same deployments registered to a Kubernetes pool with infra/k8s's base job template render a
Job that runs them from the image's installed package."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from infra import stack
from infra.settings import load_config
from tasks.core.net import free_port
from test_e2e import CRUCIBLE, REPO
from test_postgres import LEAN, lean_config

pytestmark = pytest.mark.e2e
DEPLOYMENTS = {"pretrain/pretrain": "flows.pretrain.pretrain",
               "evaluate-checkpoint/evaluate-checkpoint": "flows.triggers.evaluate_checkpoint_flow",
               "deploy-model/deploy-model": "flows.triggers.deploy_model_flow"}
TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


@pytest.fixture(scope="module")
def pool_stack():
    """`crucible up --config lean.yaml` run in a temporary directory (the config's run_root `runs` is
    relative: the pretrain deployment's runs work there); the stack is stopped afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="crucible-work-pool-"))
    config = lean_config(tmp / "lean.yaml")
    overrides = [f"stack.state_dir={tmp / 'state'}", f"stack.prefect_port={free_port()}",
                 f"stack.mlflow_port={free_port()}", f"stack.worker_port={free_port()}",
                 f"lineage.service_port={free_port()}", f"deploy.port={free_port()}", "run_root=runs",
                 *[o for o in LEAN if not o.startswith("stack.triggers")]]  # the triggered flows run too
    sets = [a for o in overrides for a in ("--set", o)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "CRUCIBLE_"))}
    env["PYTHONPATH"] = str(REPO)
    cfg = load_config(config, overrides)
    try:
        t0 = time.monotonic()
        up = subprocess.run(CRUCIBLE + ["up", "--config", str(config), *sets, "--json"], cwd=tmp, env=env,
                            capture_output=True, text=True, timeout=400)
        assert up.returncode == 0, (up.stdout + up.stderr)[-4000:]
        print(f"\n`crucible up --config` with the worker and its deployments: {time.monotonic() - t0:.1f}s")
        yield {"tmp": tmp, "cfg": cfg, "up": json.loads(up.stdout), "api": stack.prefect_api_url(cfg.stack),
               "headers": stack.prefect_headers(cfg.stack), "config": config, "sets": sets, "env": env}
    finally:
        subprocess.run(CRUCIBLE + ["down", "--config", str(config), *sets], cwd=tmp, env=env, capture_output=True,
                       text=True, timeout=120)
        shutil.rmtree(tmp, ignore_errors=True)


def _get(pool_stack, path: str) -> dict:
    r = httpx.get(pool_stack["api"] + path, headers=pool_stack["headers"], timeout=30, trust_env=False)
    r.raise_for_status()
    return r.json()


def test_up_creates_the_pool_starts_the_worker_and_registers_the_deployments(pool_stack):
    worker = pool_stack["up"]["worker"]
    assert worker["healthy"] and worker["started"] and set(worker["deployments"]) == set(DEPLOYMENTS), worker
    assert _get(pool_stack, "/work_pools/crucible")["type"] == "process"
    state = str(stack.state_dir(pool_stack["cfg"].stack))
    for name, entrypoint in DEPLOYMENTS.items():
        d = _get(pool_stack, f"/deployments/name/{name}")
        # a module entrypoint, imported by the flow run: no code is pulled or copied
        assert (d["work_pool_name"], d["entrypoint"], d["pull_steps"]) == ("crucible", entrypoint, []), d
        assert d["job_variables"]["command"] == f"{sys.executable} -m prefect.engine"  # the worker's process group
        assert d["job_variables"]["working_dir"] == (str(pool_stack["tmp"]) if name == "pretrain/pretrain" else state)
        assert d["tags"] == ["crucible"] and d["description"]
    pretrain = _get(pool_stack, "/deployments/name/pretrain/pretrain")
    assert pretrain["parameters"]["config"] == pool_stack["cfg"].model_dump(mode="json")  # the UI Run's defaults
    assert _get(pool_stack, "/deployments/name/deploy-model/deploy-model")["global_concurrency_limit"]["limit"] == 1
    status = subprocess.run(CRUCIBLE + ["status", "--json", "--config", str(pool_stack["config"]), *pool_stack["sets"]],
                            cwd=pool_stack["tmp"], env=pool_stack["env"], capture_output=True, text=True, timeout=60)
    assert json.loads(status.stdout)["worker"] == {"url": worker["url"], "healthy": True, "pid": worker["pid"]}


def test_a_run_of_the_pretrain_deployment_runs_the_pipeline_on_the_worker(pool_stack):
    """What the UI's Run button does: POST create_flow_run on the deployment with no parameters."""
    t0 = time.monotonic()
    dep = _get(pool_stack, "/deployments/name/pretrain/pretrain")
    r = httpx.post(f"{pool_stack['api']}/deployments/{dep['id']}/create_flow_run", json={}, timeout=30,
                   headers=pool_stack["headers"], trust_env=False)
    assert r.status_code == 201, r.text
    run_id = r.json()["id"]
    deadline = time.monotonic() + 300  # the lean run takes ~1 min on 2 cores; a run no worker takes stays SCHEDULED
    while (run := _get(pool_stack, f"/flow_runs/{run_id}"))["state_type"] not in TERMINAL:
        assert time.monotonic() < deadline, f"flow run still {run['state_type']}: is the worker polling the pool?"
        time.sleep(2)
    took = time.monotonic() - t0
    log = stack.log_path(pool_stack["cfg"].stack, stack.WORKER).read_text()
    assert run["state_type"] == "COMPLETED", (run["state"], log[-4000:])
    assert run["work_pool_name"] == "crucible" and f"submitting flow run '{run_id}'" in log
    print(f"\npretrain deployment run on the worker: {took:.1f}s")

    # relative run_root: the run lives where `crucible up` ran (the deployment's working_dir)
    (summary_path,) = (pool_stack["tmp"] / "runs").glob("*/summary.json")
    s = json.loads(summary_path.read_text())
    assert s["status"] == "COMPLETED" and s["flow_run_id"] == run_id
    assert list(s["stages"]) == ["ingest", "curate", "quality", "tokenizer", "tokens", "plan", "train", "evaluate",
                                 "deploy"]
    # the flow run had the stack's environment from the worker: its MLflow server, its lineage service
    # with the write token, its Prefect; the event-triggered flows (on the same worker, trusting the
    # run root `crucible up` registered) evaluated and deployed the checkpoints
    stack_cfg, lineage_cfg = pool_stack["cfg"].stack, pool_stack["cfg"].lineage
    assert s["mlflow"]["tracking_uri"] == stack.mlflow_tracking_uri(stack_cfg)
    assert s["lineage"]["http"]["url"] == stack.lineage_url(lineage_cfg) + "/api/v1/lineage"
    assert s["lineage"]["http"]["sent"] > 0 and not s["lineage"]["http"]["failed"], s["lineage"]
    assert s["prefect_ui_url"].startswith(stack.prefect_ui_url(stack_cfg))
    checkpoints = s["stages"]["evaluate"]["checkpoints"]
    assert checkpoints and {c["evaluated_by"] for c in checkpoints} == {"evaluate-checkpoint (event-triggered)"}
    assert s["stages"]["deploy"]["deployed_by"] == "deploy-model (event-triggered)"
    ids = {_get(pool_stack, f"/deployments/name/{n}")["id"]: n for n in DEPLOYMENTS}
    runs = httpx.post(f"{pool_stack['api']}/flow_runs/filter", headers=pool_stack["headers"], timeout=30,
                      trust_env=False, json={"flow_runs": {"deployment_id": {"any_": list(ids)}}}).json()
    assert {ids[r["deployment_id"]] for r in runs if r["state_type"] == "COMPLETED"} == set(DEPLOYMENTS)
    assert {r["work_pool_name"] for r in runs} == {"crucible"}


def test_the_same_deployments_on_the_kubernetes_pool_run_from_the_image(pool_stack, tmp_path):
    """infra/k8s's pool: created from its base job template, the deployments registered to it
    (`python -m flows.deployments --pool crucible-kubernetes`) carry no process-pool job variables, and a
    flow run of pretrain becomes a Job running `prefect flow-run execute`, which imports the module
    entrypoint from the installed package (here: from outside the repository, without PYTHONPATH)."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    template = json.loads((REPO / "infra" / "k8s" / "prefect" / "base-job-template.json").read_text())
    r = httpx.post(f"{pool_stack['api']}/work_pools/", headers=pool_stack["headers"], timeout=30, trust_env=False,
                   json={"name": "crucible-kubernetes", "type": "kubernetes", "base_job_template": template})
    assert r.status_code == 201, r.text
    env = {**pool_stack["env"], **stack.flow_run_env(pool_stack["cfg"].stack, pool_stack["cfg"].lineage),
           **stack.prefect_auth_env(pool_stack["cfg"].stack)}
    proc = subprocess.run([sys.executable, "-m", "flows.deployments", "--pool", "crucible-kubernetes", "--config",
                           str(pool_stack["config"]), *pool_stack["sets"]], cwd=pool_stack["tmp"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(json.loads(proc.stdout.splitlines()[-1])["registered"]) == set(DEPLOYMENTS)
    pretrain = _get(pool_stack, "/deployments/name/pretrain/pretrain")
    assert (pretrain["work_pool_name"], pretrain["entrypoint"], pretrain["job_variables"]) == (
        "crucible-kubernetes", "flows.pretrain.pretrain", {})
    with temporary_settings({PREFECT_API_URL: pool_stack["api"],
                             PREFECT_API_AUTH_STRING: stack.prefect_auth_env(pool_stack["cfg"].stack)["PREFECT_API_AUTH_STRING"]}):
        from prefect.client.orchestration import get_client

        async def job():
            async with get_client() as client:
                config = await KubernetesWorkerJobConfiguration.from_template_and_values(
                    template, pretrain["job_variables"], client=client)
                deployment = await client.read_deployment(pretrain["id"])
            config.prepare_for_flow_run(FlowRun(flow_id=pretrain["flow_id"], deployment_id=pretrain["id"]),
                                        deployment=deployment)
            return config.job_manifest

        manifest = asyncio.run(job())
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["args"] == ["prefect", "flow-run", "execute"], container
    load = subprocess.run([sys.executable, "-c", "from prefect.flows import load_flow_from_entrypoint as load; "
                                                 f"print(load({pretrain['entrypoint']!r}).name)"],
                          cwd=tmp_path, env={k: v for k, v in env.items() if k != "PYTHONPATH"},
                          capture_output=True, text=True, timeout=120)
    assert load.returncode == 0 and load.stdout.split()[-1] == "pretrain", load.stderr[-2000:]
