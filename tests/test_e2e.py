"""End to end: `crucible run configs/tiny.yaml` through a real local stack (Prefect server, MLflow
server, model server), on real data, exactly as the README tells a new user to run it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from contextlib import contextmanager, suppress
from pathlib import Path

import httpx
import pytest

from infra import stack
from infra.settings import StackConfig
from tasks.config import DeployConfig
from tasks.core.net import free_port
from tasks.lineage.validate import event_errors, read_events

REPO = Path(__file__).resolve().parent.parent
CRUCIBLE = [sys.executable, "-m", "infra.cli"]
SUBFLOWS = {"curate", "train_tokenizer", "prepare_tokens", "train", "evaluate", "deploy"}

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    overrides = [
        f"stack.state_dir={tmp / 'state'}", f"stack.prefect_port={free_port()}",
        f"stack.mlflow_port={free_port()}", f"deploy.port={free_port()}", f"run_root={tmp / 'runs'}",
        f"lineage.service_port={free_port()}", f"stack.worker_port={free_port()}",
        "lineage.http_timeout=30",  # the lineage service answers slowly while training holds both cores
        "stack.triggered_timeout=600",  # fall back to evaluating directly well before the 1500 s limit
    ]
    sets = [a for o in overrides for a in ("--set", o)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    summary_path = tmp / "summary.json"
    proc = subprocess.run(CRUCIBLE + ["run", str(REPO / "configs" / "tiny.yaml"), *sets, "--summary", str(summary_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    (tmp / "run.log").write_text(proc.stdout + proc.stderr)
    try:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
        summary = json.loads(summary_path.read_text())
        status = json.loads(subprocess.run(CRUCIBLE + ["status", "--json", "--config", str(REPO / "configs" / "tiny.yaml"),
                                                       *sets], cwd=REPO, env=env, capture_output=True, text=True,
                                                      timeout=60).stdout)
        # the stack's Prefect API needs its auth string (a 0600 secret in the state dir): a raw client sends it
        headers = stack.prefect_headers(StackConfig(state_dir=str(tmp / "state")))
        _wait_for_triggered_runs(status, headers)
        yield {"summary": summary, "status": status, "stdout": proc.stdout, "env": env, "sets": sets,
               "prefect_headers": headers}
    finally:
        subprocess.run(CRUCIBLE + ["down", "--config", str(REPO / "configs" / "tiny.yaml"), *sets],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


FINAL = {"COMPLETED": "COMPLETE", "FAILED": "FAIL", "CRASHED": "FAIL", "CANCELLED": "ABORT"}


def _prefect_runs(status: dict, headers: dict) -> tuple[list[dict], list[dict]]:
    """Every flow run and task run in the stack's Prefect (a fresh stack: all of them are the demo's)."""
    api = status["prefect"]["url"].rstrip("/") + "/api"
    flow_runs = httpx.post(f"{api}/flow_runs/filter", headers=headers, json={"limit": 200}, timeout=30).json()
    task_runs = httpx.post(f"{api}/task_runs/filter", headers=headers, json={"limit": 200}, timeout=30).json()
    assert len(flow_runs) < 200 and len(task_runs) < 200
    return flow_runs, task_runs


def _wait_for_triggered_runs(status: dict, headers: dict, timeout: float = 120) -> None:
    """The pretrain flow returns once it has the triggered runs' results; the runs themselves finish
    (their COMPLETE events, their final state) a moment later."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(r["state_type"] in FINAL for r in _prefect_runs(status, headers)[0]):
            return
        time.sleep(2)


def test_summary_has_every_stage_and_links(run):
    s = run["summary"]
    assert s["status"] == "COMPLETED"
    assert set(s["stages"]) >= {"ingest", "curate", "tokenizer", "tokens", "train", "evaluate", "deploy"}
    assert set(s["timings_s"]) >= {"ingest", "curate", "tokenizer", "tokens", "train", "evaluate", "deploy"}
    # energy, CO2e and cost of every stage (the triggered evaluations and deployments included), summed
    assert set(s["energy"]["stages"]) >= {"ingest", "curate", "tokenizer", "tokens", "train", "evaluate", "deploy"}
    assert all(e["kwh"] > 0 and e["co2e_kg"] > 0 and e["cost_usd"] > 0 for e in s["energy"]["stages"].values())
    assert s["energy"]["total"]["kwh"] == pytest.approx(sum(e["kwh"] for e in s["energy"]["stages"].values()))
    assert s["prefect_ui_url"].startswith("http://127.0.0.1:") and s["flow_run_id"] in s["prefect_ui_url"]
    assert s["mlflow"]["tracking_uri"].startswith("http://127.0.0.1:")
    assert s["prefect_ui_url"] in run["stdout"]


def test_flow_and_all_subflows_completed_in_prefect(run):
    api = run["status"]["prefect"]["url"].rstrip("/")
    api = api if api.endswith("/api") else api + "/api"
    root_id = run["summary"]["flow_run_id"]
    # the stack's Prefect API refuses a client without its auth string (server.api.auth_string)
    assert httpx.get(f"{api}/flow_runs/{root_id}", timeout=30).status_code == 401
    root = httpx.get(headers=run["prefect_headers"], url=f"{api}/flow_runs/{root_id}", timeout=30).json()
    assert root["state"]["type"] == "COMPLETED"
    children = httpx.post(headers=run["prefect_headers"], url=f"{api}/flow_runs/filter", json={
        "flow_runs": {"parent_flow_run_id": {"operator": "and_", "any_": [root_id]}}}, timeout=30).json()
    if not children:  # parent_flow_run_id filter shape differs across versions; fall back to task-run parents
        children = [r for r in httpx.post(headers=run["prefect_headers"], url=f"{api}/flow_runs/filter", json={}, timeout=30).json() if r["id"] != root_id]
    flows = {f["id"]: f["name"] for f in httpx.post(headers=run["prefect_headers"], url=f"{api}/flows/filter", json={}, timeout=30).json()}
    names = {flows[c["flow_id"]]: c["state"]["type"] for c in children}
    assert SUBFLOWS <= set(names), names
    assert all(names[n] == "COMPLETED" for n in SUBFLOWS), names


def test_curation_counts_add_up_and_shrink(run):
    ingest, curate = run["summary"]["stages"]["ingest"], run["summary"]["stages"]["curate"]
    assert ingest["docs_in"] == ingest["docs_out"] + sum(ingest["dropped"].values()) + sum(ingest["quarantined"].values())
    assert curate["docs_in"] == ingest["docs_out"]
    assert curate["docs_out"] + sum(curate["dropped"].values()) == curate["docs_in"]
    assert 0 < curate["docs_out"] < curate["docs_in"]
    reasons = set(curate["dropped"])
    for family in ("langid", "gopher_quality", "gopher_repetition", "c4", "fineweb", "exact_dedup", "minhash_dedup"):
        assert any(r.startswith(family) for r in reasons), (family, reasons)


def test_quality_stage_ran_and_counts_add_up(run):
    curate, quality = run["summary"]["stages"]["curate"], run["summary"]["stages"]["quality"]
    assert quality["enabled"] and quality["docs_in"] == curate["docs_out"]
    assert quality["docs_out"] + sum(quality["dropped"].values()) == quality["docs_in"]
    for step in quality["steps"]:
        assert step["docs_in"] == step["docs_out"] + sum(step["dropped"].values()), step
    assert set(quality["models"]) == {"classifier", "kenlm"}
    assert 0 < quality["models"]["classifier"]["heldout"]["roc_auc"] <= 1
    assert all(Path(m["model"]).is_file() for m in quality["models"].values())
    assert run["summary"]["stages"]["tokens"]["splits"]["train"]["docs"] + \
        run["summary"]["stages"]["tokens"]["splits"]["val"]["docs"] == quality["docs_out"]


def test_tokenizer_round_trips_curated_text(run):
    from tokenizers import Tokenizer
    import pyarrow.parquet as pq

    tok = Tokenizer.from_file(run["summary"]["stages"]["tokenizer"]["path"])
    texts = pq.read_table(run["summary"]["stages"]["curate"]["shards"][0], columns=["text"]).column("text").to_pylist()
    assert texts
    for text in texts[:50]:
        assert tok.decode(tok.encode(text).ids, skip_special_tokens=False) == text


def test_training_loss_fell_and_checkpoint_reloads(run):
    from tasks.train.checkpoint import load_model_for_inference

    train = run["summary"]["stages"]["train"]
    assert train["steps"] > 0 and train["final_loss"] < train["first_loss"]
    assert train["checkpoints"] and all(Path(c).exists() for c in train["checkpoints"])
    model, meta = load_model_for_inference(Path(train["checkpoints"][-1]))
    assert sum(p.numel() for p in model.parameters()) > 0


def test_eval_metrics_in_mlflow_and_champion_alias(run):
    from mlflow.tracking import MlflowClient

    s = run["summary"]
    client = MlflowClient(tracking_uri=s["mlflow"]["tracking_uri"])
    evals = s["stages"]["evaluate"]["checkpoints"]
    assert evals and all(e["val_loss"] > 0 for e in evals)
    train_run = client.get_run(s["stages"]["train"]["mlflow_run_id"])
    assert "val_loss" in train_run.data.metrics
    history = client.get_metric_history(train_run.info.run_id, "val_loss")
    # Each checkpoint has val_loss at its step, once: with the stack's worker running them, the
    # event-triggered flows evaluate (and deploy); the pretrain flow only collects their results.
    assert sorted(m.step for m in history) == sorted(e["step"] for e in evals)
    assert all(e["evaluated_by"] == "evaluate-checkpoint (event-triggered)" for e in evals)
    assert s["stages"]["deploy"]["deployed_by"] == "deploy-model (event-triggered)"
    dep = s["stages"]["deploy"]
    mv = client.get_model_version_by_alias(dep["model_name"], "champion")
    assert str(mv.version) == str(dep["version"])


def test_checkpoint_table_artifact_compares_every_checkpoint(run):
    from tasks.evaluate.compare import table_key

    s = run["summary"]
    api = run["status"]["prefect"]["url"].rstrip("/") + "/api"
    arts = httpx.post(headers=run["prefect_headers"], url=f"{api}/artifacts/filter", timeout=30,
                      json={"artifacts": {"key": {"any_": [table_key(s["run_name"])]}}}).json()
    assert arts and all(a["type"] == "table" for a in arts)
    rows = json.loads(max(arts, key=lambda a: a["created"])["data"])
    evals = s["stages"]["evaluate"]["checkpoints"]
    assert [r["step"] for r in rows] == sorted(e["step"] for e in evals)
    assert all(r["val_loss"] and r["perplexity"] and r["gate"] for r in rows)
    assert sum(r["best"] for r in rows) == 1


def test_training_plan_stage_prices_the_run(run):
    """The train subflow prices the run with the planner before torchrun starts: a summary stage,
    a plan.json and a Prefect markdown artifact."""
    plan = run["summary"]["stages"]["plan"]
    assert plan["tokens"] == 200 * 8 * 128 * 2 and plan["params"] > 0 and plan["gpu_hours"] > 0
    assert json.loads(Path(plan["path"]).read_text())["plan"]["tokens"] == plan["tokens"]
    api = run["status"]["prefect"]["url"].rstrip("/") + "/api"
    arts = httpx.post(headers=run["prefect_headers"], url=f"{api}/artifacts/filter", timeout=30,
                      json={"artifacts": {"key": {"any_": ["training-plan"]}}}).json()
    assert arts and arts[0]["type"] == "markdown" and f"{plan['params']:,} parameters" in arts[0]["data"]


def test_long_stages_report_progress_to_prefect(run):
    """Ingest and curate each keep a Prefect progress artifact, at 100 % once the stage is done."""
    api = run["status"]["prefect"]["url"].rstrip("/") + "/api"
    for stage in ("ingest", "curate"):
        arts = httpx.post(headers=run["prefect_headers"], url=f"{api}/artifacts/filter", timeout=30,
                          json={"artifacts": {"key": {"any_": [f"{stage}-progress"]}}}).json()
        assert arts, f"no {stage}-progress artifact"
        latest = max(arts, key=lambda a: a["updated"])
        assert latest["type"] == "progress" and float(latest["data"]) == 100.0, latest
        assert stage in latest["description"]


def test_served_model_answers_completions(run):
    endpoint = run["summary"]["stages"]["deploy"]["endpoint"]
    assert endpoint.startswith("http://127.0.0.1:") and endpoint.endswith("/v1")
    assert run["status"]["model_server"]["healthy"]
    body = {"prompt": "The Linux kernel", "max_tokens": 8}
    assert httpx.post(f"{endpoint}/completions", json=body, timeout=60).status_code == 401  # never open
    # the clients' key the stack generated into its secrets folder, as the README's curl lines send it
    from infra.services.model_server.supervisor import client_headers

    state = next(s.split("=", 1)[1] for s in run["sets"] if s.startswith("stack.state_dir="))
    keyed = client_headers(StackConfig(state_dir=state), DeployConfig())
    r = httpx.post(f"{endpoint}/completions", json=body, timeout=60, headers=keyed)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"] and isinstance(body["choices"][0]["text"], str)
    assert body["usage"]["completion_tokens"] > 0
    models = httpx.get(f"{endpoint}/models", timeout=10, headers=keyed).json()
    assert any(m["id"] == run["summary"]["stages"]["deploy"]["model_name"] for m in models["data"])


def test_lineage_start_complete_for_every_task_run(run):
    events = read_events(run["summary"]["lineage_log"])
    by_run: dict[str, list[str]] = defaultdict(list)
    for e in events:
        assert event_errors(e) == [], (e["job"]["name"], event_errors(e)[:3])
        by_run[e["run"]["runId"]].append(e["eventType"])
    for run_id, types in by_run.items():
        assert types[0] == "START" and types[-1] == "COMPLETE", (run_id, types)
    task_events = [e for e in events if e["job"]["facets"]["jobType"]["jobType"] == "TASK"]
    names = Counter(e["job"]["name"] for e in task_events if e["eventType"] == "COMPLETE")
    # with the stack up the event-triggered flows evaluate and deploy (their jobs), and the pretrain
    # flow's evaluate/deploy tasks only collect their results: jobs of their own, producing nothing
    for job in ("curate.ingest_sources", "curate.filter_and_dedup", "train_tokenizer.train_bpe",
                "prepare_tokens.encode_and_pack", "train.torchrun_train", "evaluate-checkpoint.evaluate",
                "evaluate.await_evaluation", "deploy.await_deployment"):
        assert names[job] >= 1, (job, names)
    assert not names["evaluate.evaluate_checkpoint"] and not names["deploy.gate_register_serve"], names
    assert not [e for e in task_events if e["job"]["name"] in ("evaluate.await_evaluation", "deploy.await_deployment")
                and e["outputs"]]
    root_id = run["summary"]["flow_run_id"]
    for e in events:
        if e["run"]["runId"] != root_id:
            assert e["run"]["facets"]["parent"]["root"]["run"]["runId"] == root_id
    # torchrun is a job run of its own, child of the train task run: token shards in, checkpoints out
    train = run["summary"]["stages"]["train"]
    torchrun = [e for e in events if e["job"]["name"] == "train.torchrun_train.torchrun"]
    assert [e["eventType"] for e in torchrun] == ["START", "COMPLETE"]
    train_task_runs = {e["run"]["runId"] for e in task_events if e["job"]["name"] == "train.torchrun_train"}
    assert torchrun[0]["run"]["runId"] == train["lineage_run_id"] not in train_task_runs
    assert torchrun[0]["run"]["facets"]["parent"]["run"]["runId"] in train_task_runs
    assert torchrun[0]["job"]["facets"]["jobType"]["integration"] == "TORCH"
    assert any(i["name"].endswith("/tokens/train.bin") for i in torchrun[1]["inputs"])
    assert {o["name"] for o in torchrun[1]["outputs"]} >= set(train["checkpoints"])
    # every evaluation reads the val shard and the suite's evaluation data (licence, content hash)
    evals = [e for e in task_events if e["job"]["name"] == "evaluate-checkpoint.evaluate" and e["eventType"] == "COMPLETE"]
    for e in evals:
        data = {i["facets"]["crucible_source"]["source"]: i for i in e["inputs"]
                if i["facets"].get("crucible_source", {}).get("use") == "evaluation"}
        assert set(data) == {"wikitext", "lambada", "hellaswag"}, e["inputs"]
        assert all(d["facets"]["version"]["datasetVersion"] and d["facets"]["crucible_source"]["licence"]
                   for d in data.values())
        assert any(i["name"].endswith("/tokens/val.bin") for i in e["inputs"])
    # The served model traces back to raw sources with licences.
    outputs = {o["name"] for e in events for o in e.get("outputs", [])}
    assert any(n.startswith("models/") for n in outputs)
    raw = [i for e in events for i in e.get("inputs", []) if "crucible_source" in i.get("facets", {})]
    assert {i["facets"]["crucible_source"]["source"] for i in raw} >= {"docs_crawl", "cc_main_2019_30"}


def _datasets(events: list[dict]) -> dict[str, list[dict]]:
    """Every dataset occurrence in the log, by name."""
    out: dict[str, list[dict]] = defaultdict(list)
    for e in events:
        for ds in (e.get("inputs") or []) + (e.get("outputs") or []):
            out[ds["name"]].append(ds)
    return out


def _produced(events: list[dict]) -> dict[str, dict]:
    """Each output dataset as its producer's COMPLETE event describes it, by name."""
    return {ds["name"]: ds for e in events if e["eventType"] == "COMPLETE" for ds in e.get("outputs") or []}


def test_every_consumed_file_is_a_lineage_dataset_with_facets(run):
    s = run["summary"]
    run_dir = Path(s["run_dir"])
    events = read_events(s["lineage_log"])
    datasets = _datasets(events)
    produced = _produced(events)
    expected = {
        "ingest shards": sorted(run_dir.glob("ingest/shard-*.parquet")),
        "curated shards": sorted(run_dir.glob("curate/shard-*.parquet")),
        "quarantine / dropped": [p for p in (run_dir / "ingest" / "quarantine.jsonl", run_dir / "curate" / "dropped.jsonl")
                                 if p.exists()],
        "tokenizer": [run_dir / "tokenizer" / "tokenizer.json"],
        "token shards": [run_dir / "tokens" / n for n in ("train.bin", "val.bin", "index.json")],
        "checkpoints": sorted(p for p in run_dir.glob("train/checkpoints/step-*") if p.is_dir()),
        "eval reports": sorted(run_dir.glob("evaluate/**/*.json")),  # triggered ones in evaluate/triggered/
        "evaluation data": sorted({Path(t["data"]) for e in s["stages"]["evaluate"]["checkpoints"]
                                   for t in e["tasks"].values() if "data" in t}),
        "training log": [run_dir / "train" / "train_log.jsonl"],
    }
    for what, paths in expected.items():
        if what != "quarantine / dropped":
            assert paths, f"the run wrote no {what}"
        missing = [str(p) for p in paths if str(p.resolve()) not in datasets]
        assert not missing, f"{what} not in the lineage log: {missing}"

    # Parquet shards carry their schema and row counts; the rows add up to the stages' counts
    for stage in ("ingest", "curate"):
        rows = 0
        for shard in s["stages"][stage]["shards"]:
            facets = produced[str(Path(shard).resolve())]["facets"]
            assert "text" in [f["name"] for f in facets["schema"]["fields"]]
            assert facets["documentation"]["description"]
            rows += facets["dataQualityMetrics"]["rowCount"]
        assert rows == s["stages"][stage]["docs_out"], stage

    # licences propagate: every output downstream of the raw files lists the licences of its raw sources
    # (the ingested files; evaluation data and the quality models' training files are labelled, not sources)
    raw = [i for e in events if e["job"]["name"] == "curate.ingest_sources" for i in e.get("inputs", [])
           if "crucible_source" in i.get("facets", {}) and not i["facets"]["crucible_source"]["derived"]]
    all_licences = {i["facets"]["crucible_source"]["licence"] for i in raw}
    assert len(all_licences) >= 2
    model = [o for e in events for o in e.get("outputs", []) if o["namespace"].startswith("mlflow://")]
    assert model and set(model[0]["facets"]["crucible_source"]["licences"]) == all_licences
    for what in ("curated shards", "tokenizer", "token shards", "checkpoints", "eval reports"):
        for p in expected[what]:
            src = produced[str(p.resolve())]["facets"]["crucible_source"]
            assert produced[str(p.resolve())]["facets"]["documentation"]["description"], p
            assert src["derived"] and src["licences"] and set(src["licences"]) <= all_licences, (what, p)

    # jobs say where their code is and what they do; runs link to MLflow and Prefect
    for e in events:
        job = e["job"]["facets"]
        assert job["sourceCodeLocation"]["type"] == "git" and len(job["sourceCodeLocation"]["version"]) == 40
        assert job["documentation"]["description"] and job["ownership"]["owners"]
        links = e["run"]["facets"]["crucible_links"]
        assert links["mlflow_run_id"] and links["prefect_flow_run_url"].startswith("http://127.0.0.1:")
        if e["job"]["facets"]["jobType"]["jobType"] == "TASK":
            assert e["run"]["runId"] in links["prefect_task_run_url"]


def test_lineage_service_in_the_stack_answers_the_model_upstream_graph(run):
    s = run["summary"]
    assert run["status"]["lineage"]["healthy"]
    base = run["status"]["lineage"]["url"]
    events = read_events(s["lineage_log"])
    # every event arrived over HTTP while the run went on (the triggered flows' runs sent their own)
    triggered = [e for e in events if e["job"]["name"].startswith(("evaluate-checkpoint", "deploy-model"))]
    assert triggered and s["lineage"]["http"]["sent"] == len(events) - len(triggered)
    assert s["lineage"]["http"]["failed"] == 0
    assert httpx.get(f"{base}/api/v1/crucible/stats", timeout=30).json()["events"] == len(events)
    dep = s["stages"]["deploy"]
    node = s["lineage"]["output_node"]
    assert node.endswith(f":models/{dep['model_name']}/{dep['version']}")
    graph = httpx.get(f"{base}/api/v1/lineage", params={"nodeId": node, "direction": "upstream"}, timeout=60).json()
    ids = {n["id"] for n in graph["graph"]}
    raw = {f"dataset:file:{f}" for info in s["stages"]["ingest"]["sources"].values() for f in info["files"]}
    assert raw and raw <= ids, raw - ids
    trace = httpx.get(f"{base}/api/v1/crucible/trace", params={"nodeId": node}, timeout=60).json()
    # ... and to the files the quality models trained on, each with its licence
    quality_files = {f"dataset:file:{f['path']}" for m in s["stages"]["quality"]["models"].values()
                     for f in m["training_files"]}
    assert {src["nodeId"] for src in trace["sources"]} == raw | quality_files and trace["unlicensed"] == []
    assert s["lineage"]["page_url"].startswith(base + "/#node=")
    assert s["lineage"]["page_url"] in run["stdout"]


def test_prefect_runs_link_to_the_lineage_page(run):
    s = run["summary"]
    api = run["status"]["prefect"]["url"].rstrip("/") + "/api"
    base = run["status"]["lineage"]["url"]
    # link artifacts (Prefect stores them as markdown links) pointing at the lineage service's page
    links = [a for a in httpx.post(headers=run["prefect_headers"], url=f"{api}/artifacts/filter", json={}, timeout=30).json()
             if isinstance(a.get("data"), str) and f"]({base}/#node=" in a["data"]]  # progress artifacts hold numbers
    by_flow = [a for a in links if a.get("flow_run_id") == s["flow_run_id"] and a.get("task_run_id") is None]
    assert len(by_flow) == 1 and f"]({s['lineage']['page_url']})" in by_flow[0]["data"], by_flow
    assert by_flow[0]["key"] == "lineage-model-version"
    task_links = [a for a in links if a.get("task_run_id")]
    assert len(task_links) >= 7, task_links  # one per stage task run
    deploy_link = [a for a in task_links if "deploy" in a["data"]]
    assert deploy_link and s["lineage"]["output_node"].split(":models/")[1] in deploy_link[0]["data"]


def test_every_prefect_run_is_one_lineage_run_in_the_same_state(run):
    """Every flow run (pretrain, its subflows, the event-triggered evaluate-checkpoint and
    deploy-model runs) and every task run of the demo is exactly one OpenLineage run, with the
    Prefect run's id as its run id and its final state as its last event. The only other run is the
    torchrun job (a job run of its own under the train task run)."""
    s = run["summary"]
    flow_runs, task_runs = _prefect_runs(run["status"], run["prefect_headers"])
    # a subflow call shows up as a task run in its parent flow run too: the subflow run is its run
    subflow_calls = {r["parent_task_run_id"] for r in flow_runs if r.get("parent_task_run_id")}
    prefect = {r["id"]: r["state_type"] for r in flow_runs + task_runs if r["id"] not in subflow_calls}
    lineage: dict[str, list[str]] = defaultdict(list)
    for e in read_events(s["lineage_log"]):
        lineage[e["run"]["runId"]].append(e["eventType"])
    deployments = Counter(r.get("deployment_id") is not None for r in flow_runs)
    assert deployments[True] >= 3, flow_runs  # >= 2 evaluate-checkpoint runs and a deploy-model run
    assert set(lineage) - set(prefect) == {s["stages"]["train"]["lineage_run_id"]}
    missing = {i: state for i, state in prefect.items() if i not in lineage}
    assert not missing, missing
    for run_id, state in prefect.items():
        types = lineage[run_id]
        assert types.count("START") >= 1 and types[-1] == FINAL[state], (run_id, state, types)
    # the served model is a dataset of its own: the model server's endpoint, the version it serves
    dep = s["stages"]["deploy"]
    served = [o for e in read_events(s["lineage_log"]) if e["job"]["name"] == "deploy-model"
              and e["eventType"] == "COMPLETE" for o in e["outputs"] if "crucible_serving" in o["facets"]]
    assert served and served[-1]["namespace"] == dep["endpoint"].removesuffix("/v1")
    assert served[-1]["name"] == f"models/{dep['model_name']}"
    assert served[-1]["facets"]["version"]["datasetVersion"] == str(dep["version"])


def _printed(stdout: str, label: str) -> str:
    """The rest of the line `crucible run` printed as `  <label> : ...`."""
    lines = [line.split(" : ", 1)[1] for line in stdout.splitlines() if line.strip().startswith(label + " ")]
    assert lines, (label, stdout[-3000:])
    return lines[-1].strip()


def test_training_run_lists_the_token_shards_it_read_as_mlflow_datasets(run):
    """mlflow.log_input for every stage: the train run's datasets are the token shards and their index
    (context input, content hash as digest, lineage node) and its checkpoints (context output); the
    tokens run's inputs are the curated corpus shards."""
    from mlflow.tracking import MlflowClient

    from tasks.core.hashing import sha256_tree
    from tasks.lineage.artifacts import token_split_paths

    s = run["summary"]
    client = MlflowClient(tracking_uri=s["mlflow"]["tracking_uri"])
    train = client.get_run(s["stages"]["train"]["mlflow_run_id"]).inputs.dataset_inputs
    tags = [{t.key: t.value for t in d.tags} for d in train]
    inputs = {t["crucible.lineage_node"]: d.dataset for d, t in zip(train, tags) if t["mlflow.data.context"] == "input"}
    shards = token_split_paths(s["stages"]["tokens"]["index_path"])
    assert {p.name for p in shards} >= {"train.bin", "val.bin"}
    for path in [Path(s["stages"]["tokens"]["index_path"]), *shards]:
        ds = inputs[f"dataset:file:{path.resolve()}"]
        assert ds.name == f"{path.parent.name}/{path.name}" and ds.digest == sha256_tree(path)[:36]
        # MLflow keeps one dataset per name and digest: the same bytes logged from an earlier run's
        # folder keep that first URI; the run's own file is its lineage node (above)
        assert json.loads(ds.source)["uri"].endswith(f"/{ds.name}") and ds.source_type == "local"
    outputs = [t["crucible.lineage_node"] for t in tags if t["mlflow.data.context"] == "output"]
    assert outputs and all("checkpoint" in node or "step" in node for node in outputs), outputs
    corpus = client.get_run(s["stages"]["tokens"]["mlflow_run_id"]).inputs.dataset_inputs
    assert {f"dataset:file:{Path(p).resolve()}" for p in s["stages"]["quality"]["shards"]} <= {
        t.value for d in corpus for t in d.tags if t.key == "crucible.lineage_node"}
    experiment = client.get_experiment_by_name(s["mlflow"]["experiment"])
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"


def test_printed_links_open_in_a_fresh_browser_after_one_login(run, tmp_path):
    """The Prefect flow-run link and the MLflow run links `crucible run` printed, opened in a new
    Chromium profile, lead to their pages after the one login the output tells of (`crucible login`)."""
    from browser_helpers import CHROMEDRIVER, CHROMIUM, artifacts_dir, chromium

    if not (CHROMIUM and CHROMEDRIVER):
        pytest.skip("chromium and chromedriver not installed (apt-get install -y chromium chromium-driver)")
    import base64

    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    s, out = run["summary"], run["stdout"]
    assert "crucible login" in _printed(out, "Log in")
    flow_url = _printed(out, "Prefect flow run")
    mlflow_url, train_url = _printed(out, "MLflow run").split()[0], _printed(out, "MLflow train run").split()[0]
    login = subprocess.run(CRUCIBLE + ["login", "--json", "--config", str(REPO / "configs" / "tiny.yaml"), *run["sets"]],
                           cwd=REPO, env=run["env"], capture_output=True, text=True, timeout=120)
    assert login.returncode == 0, login.stderr
    login = json.loads(login.stdout)
    api = run["status"]["prefect"]["url"].rstrip("/") + "/api"
    flow_name = httpx.get(f"{api}/flow_runs/{s['flow_run_id']}", headers=run["prefect_headers"], timeout=30).json()["name"]
    shots = artifacts_dir(tmp_path, "printed_links")
    browser = chromium(tmp_path / "chromium-profile")

    @contextmanager
    def step(name: str):
        try:
            yield
        finally:  # passed or failed, the page as the step left it (a failing step's is the one that matters)
            with suppress(Exception):  # a dead browser must not hide the step's own error
                browser.save_screenshot(str(shots / f"{name}.png"))

    try:
        wait = WebDriverWait(browser, 120)  # a loaded 2-core machine renders slowly
        body = lambda: browser.find_element(By.TAG_NAME, "body").text  # noqa: E731
        with step("prefect_flow_run"):  # the link shows Prefect's login form; with the auth string, the page
            browser.get(flow_url)
            wait.until(lambda d: d.find_element(By.CSS_SELECTOR, "input[type=password]")).send_keys(
                login["prefect"]["auth_string"])
            browser.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
            wait.until(lambda d: d.current_url.endswith(f"/runs/flow-run/{s['flow_run_id']}") and flow_name in body())
        # MLflow answers with HTTP Basic: the browser's login dialog, which headless Chromium cannot
        # show; the user and password `crucible login` printed go in as the dialog would send them
        basic = base64.b64encode(f"{login['mlflow']['user']}:{login['mlflow']['password']}".encode()).decode()
        browser.execute_cdp_cmd("Network.enable", {})
        browser.execute_cdp_cmd("Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {basic}"}})
        with step("mlflow_pipeline_run"):
            browser.get(mlflow_url)
            wait.until(lambda d: s["run_name"] in body() and s["mlflow"]["run_id"] in body())
            assert "Evaluation runs" not in body()  # the model-training view, not the GenAI one
        with step("mlflow_train_run"):  # the train run's page lists the datasets it read: the first, then "+N"
            browser.get(train_url)
            wait.until(lambda d: s["stages"]["train"]["mlflow_run_id"] in body() and "tokens/index.json" in body())
            browser.find_element(By.XPATH, "//*[normalize-space(text())='Datasets']/following::*"
                                           "[starts-with(normalize-space(text()), '+')][1]").click()
            wait.until(lambda d: "tokens/train.bin" in body() and "tokens/val.bin" in body())
    finally:
        browser.quit()
    for name in ("prefect_flow_run.png", "mlflow_pipeline_run.png", "mlflow_train_run.png"):
        assert (shots / name).stat().st_size > 10_000
