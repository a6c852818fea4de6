"""The lineage service: ingestion, Marquez-shaped graph and browsing API, trace, provenance report.

The event log is written by Crucible's own emitter (infra.services.lineage.sample drives it through
two `pretrain` runs, the second resuming training from the first's checkpoint)."""
import sqlite3
import threading
import uuid
from urllib.parse import quote

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from infra.services.lineage import create_app
from infra.services.lineage.fastjson import dumps_bytes, loads
from infra.services.lineage.sample import DEFAULT_SOURCES, FILTER_DROPS, PRODUCER, write_sample_log
from infra.services.lineage.store import LineageStore, Node, split_node_id
from lineage_helpers import start_service
from tasks.core.net import free_port
from tasks.lineage import JobRef, LineageEmitter, dataset_for_path
from tasks.lineage.replay import ReplayError, replay
from tasks.lineage.validate import read_events
from tasks.registry import PRETRAIN_FLOWS

LICENCES = {s["name"]: s["licence"] for s in DEFAULT_SOURCES}
RAW_FILES = sum(len(s["files"]) for s in DEFAULT_SOURCES)


TOKEN = "write-t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    work = tmp_path_factory.mktemp("lineage")
    log, pipelines = write_sample_log(work, pipelines=2)
    return work, log, pipelines


@pytest.fixture(scope="module")
def client(sample, tmp_path_factory):
    _, log, _ = sample
    app = create_app(tmp_path_factory.mktemp("db") / "lineage.db", prefect_ui_url="http://127.0.0.1:4200",
                     write_token=TOKEN)
    with TestClient(app, headers=AUTH) as c:
        result = replay(log, "http://testserver", client=c, batch_size=17)
        assert result["ingested"] == result["events"] == len(read_events(log))
        yield c


def _graph(client, node, **params):
    resp = client.get("/api/v1/lineage", params={"nodeId": node, **params})
    assert resp.status_code == 200, resp.text
    return {n["id"]: n for n in resp.json()["graph"]}


def test_upstream_of_model_version_reaches_raw_files_with_enough_depth(client, sample):
    _, _, (first, second) = sample
    model = second.model_version_node
    assert model == "dataset:mlflow://127.0.0.1:5000:models/crucible-tiny/2"
    raw_ids = {second.file_node(f) for f in second.raw_files}
    # deploy -> train_bpe (tokenizer) -> quality_filter -> filter_and_dedup -> ingest_sources -> raw: 5 job hops
    shallow = _graph(client, model, depth=4, direction="upstream")
    assert not raw_ids & set(shallow)
    graph = _graph(client, model, depth=5, direction="upstream")
    assert raw_ids <= set(graph)
    for rid in raw_ids:
        node = graph[rid]
        assert node["type"] == "DATASET" and node["data"]["facets"]["crucible_source"]["licence"] in LICENCES.values()
        assert node["inEdges"] == [] and node["outEdges"][0]["destination"] == "job:crucible:curate.ingest_sources"
    full = _graph(client, model)  # Marquez default: depth 20, both directions
    assert raw_ids <= set(full) and model in full
    node = full[model]
    assert node["type"] == "DATASET" and node["outEdges"] == []
    assert node["inEdges"] == [{"origin": "job:crucible:deploy.gate_register_serve", "destination": model}]
    # every edge is listed on both of its ends
    for n in full.values():
        for e in n["outEdges"]:
            assert e["origin"] == n["id"] and e in full[e["destination"]]["inEdges"]
        assert n["type"] in ("DATASET", "JOB")
    job = full["job:crucible:train.torchrun_train"]["data"]
    assert job["name"] == "train.torchrun_train" and job["latestRun"]["state"] == "COMPLETED"
    # continued training: model v2's lineage goes through both training runs and the first checkpoint
    assert set(job["crucible"]["runs"]) == {first.runs["train.torchrun_train"], second.runs["train.torchrun_train"]}
    assert second.file_node(first.checkpoints[-1]) in full


def test_sample_runs_every_registered_stage(sample):
    """The sample log follows the stage registry: one lineage job `<flow>.<task>` per pretrain stage."""
    _, _, (first, _) = sample
    assert {f"{flow.name}.{stage.task}" for flow in PRETRAIN_FLOWS for stage in flow.stages} <= set(first.runs)


def test_lineage_is_run_and_version_precise(client, sample):
    _, _, (first, second) = sample
    graph = _graph(client, first.model_version_node, direction="upstream")
    for n in graph.values():
        if n["type"] == "JOB":
            assert set(n["data"]["crucible"]["runs"]) <= set(first.runs.values()), n["id"]
    assert second.file_node(second.tokenizer) not in graph
    # downstream of pipeline 1's last checkpoint: its evaluation, its deploy, and pipeline 2's training
    down = _graph(client, second.file_node(first.checkpoints[-1]), direction="downstream")
    assert {first.model_version_node, second.model_version_node} <= set(down)
    assert second.file_node(first.raw_files[0]) not in down


def test_node_ids_with_uri_namespaces_parse(client, sample):
    known = ["file", "crucible", "mlflow://127.0.0.1:5000", "s3://bucket"]
    cases = {
        "dataset:mlflow://127.0.0.1:5000:models/crucible-tiny/1": Node("DATASET", "mlflow://127.0.0.1:5000",
                                                                       "models/crucible-tiny/1"),
        "dataset:file:/abs/path/with:colon.txt": Node("DATASET", "file", "/abs/path/with:colon.txt"),
        "dataset:s3://bucket:corpus/part-0.parquet": Node("DATASET", "s3://bucket", "corpus/part-0.parquet"),
        "job:crucible:train.torchrun_train": Node("JOB", "crucible", "train.torchrun_train"),
    }
    for value, expected in cases.items():
        assert split_node_id(value, known)[0] == expected
        assert split_node_id(value)[0] == expected  # also without knowing the namespaces
    assert split_node_id("dataset:mlflow:///srv/runs/mlflow.db:models/m/3")[0] == Node(
        "DATASET", "mlflow:///srv/runs/mlflow.db", "models/m/3")
    for bad in ("model:x:y", "dataset-no-colon", "dataset:file"):
        with pytest.raises(ValueError):
            split_node_id(bad)
    assert client.get("/api/v1/lineage", params={"nodeId": "nonsense"}).status_code == 400
    assert client.get("/api/v1/lineage", params={"nodeId": "dataset:file:/nope"}).status_code == 404
    _, _, (first, _) = sample
    resp = client.get("/api/v1/crucible/node", params={"nodeId": first.model_version_node})
    assert resp.status_code == 200 and resp.json()["namespace"] == "mlflow://127.0.0.1:5000"


def test_namespaces_jobs_datasets_runs(client, sample):
    _, _, (first, second) = sample
    names = {n["name"] for n in client.get("/api/v1/namespaces").json()["namespaces"]}
    assert names == {"crucible", "file", "mlflow://127.0.0.1:5000"}
    ns = quote("mlflow://127.0.0.1:5000", safe="")
    models = client.get(f"/api/v1/namespaces/{ns}/datasets").json()
    assert [d["name"] for d in models["datasets"]] == ["models/crucible-tiny/1", "models/crucible-tiny/2"]
    assert models["totalCount"] == 2 and models["datasets"][0]["currentVersion"]
    # unencoded namespace in the path works too
    assert client.get("/api/v1/namespaces/mlflow://127.0.0.1:5000/datasets").json()["totalCount"] == 2
    assert client.get(f"/api/v1/namespaces/{ns}").json()["name"] == "mlflow://127.0.0.1:5000"
    jobs = client.get("/api/v1/namespaces/crucible/jobs").json()["jobs"]
    by_name = {j["name"]: j for j in jobs}
    assert {"pretrain", "curate.filter_and_dedup", "deploy.gate_register_serve"} <= set(by_name)
    filt = by_name["curate.filter_and_dedup"]
    assert filt["latestRun"]["id"] == second.runs["curate.filter_and_dedup"]
    assert filt["parentJobName"] == "curate" and filt["inputs"] and filt["outputs"]
    tok = str(first.tokenizer.resolve())
    ds = client.get(f"/api/v1/namespaces/file/datasets/{quote(tok, safe='')}").json()
    assert ds["name"] == tok and ds["facets"]["version"]["datasetVersion"] == ds["currentVersion"]
    assert client.get(f"/api/v1/namespaces/file/datasets{tok}").json()["name"] == tok  # unencoded path
    versions = client.get(f"/api/v1/namespaces/file/datasets/{quote(tok, safe='')}/versions").json()["versions"]
    assert len(versions) == 1 and versions[0]["createdByRun"]["id"] == first.runs["train_tokenizer.train_bpe"]
    runs = client.get("/api/v1/namespaces/crucible/jobs/train.torchrun_train/runs").json()
    assert runs["totalCount"] == 2
    run = client.get(f"/api/v1/jobs/runs/{second.runs['train.torchrun_train']}").json()
    assert run["state"] == "COMPLETED" and run["durationMs"] is not None
    assert {v["name"] for v in run["inputVersions"]} == {str(second.tokens_index.resolve()),
                                                         str(first.checkpoints[-1].resolve())}
    assert len(run["outputVersions"]) == 2 and all(v["version"] for v in run["outputVersions"])
    assert run["facets"]["parent"]["job"]["name"] == "train"
    assert client.get("/api/v1/jobs/runs/not-a-run").status_code == 404
    assert client.get("/api/v1/namespaces/nope/jobs").status_code == 404
    events = client.get("/api/v1/events/lineage", params={"limit": 5}).json()
    assert events["totalCount"] == len(read_events(sample[1])) and len(events["events"]) == 5 and "eventType" in events["events"][0]


def test_search(client, sample):
    res = client.get("/api/v1/search", params={"q": "crucible-tiny"}).json()
    assert res["totalCount"] == 2
    assert {r["nodeId"] for r in res["results"]} == {
        "dataset:mlflow://127.0.0.1:5000:models/crucible-tiny/1", "dataset:mlflow://127.0.0.1:5000:models/crucible-tiny/2"}
    res = client.get("/api/v1/search", params={"q": "FILTER_AND", "filter": "job"}).json()
    assert [r["nodeId"] for r in res["results"]] == ["job:crucible:curate.filter_and_dedup"]
    res = client.get("/api/v1/search", params={"q": "docs-crawl", "sort": "updated_at", "limit": 1}).json()
    assert res["totalCount"] == 2 and len(res["results"]) == 1 and res["results"][0]["licence"] == LICENCES["docs_crawl"]


def test_trace_lists_every_raw_source_with_its_licence(client, sample):
    _, _, (first, second) = sample
    trace = client.get("/api/v1/crucible/trace", params={"nodeId": second.model_version_node}).json()
    assert len(trace["sources"]) == RAW_FILES and trace["unlicensed"] == [] and not trace["truncated"]
    assert {s["source"]: s["licence"] for s in trace["sources"]} == LICENCES
    assert {lic: names for lic, names in trace["licences"].items()} == {v: [k] for k, v in LICENCES.items()}
    src = next(s for s in trace["sources"] if s["source"] == "wget_sample")
    assert src["rows"] == 150 and src["version"] and src["readBy"] == ["curate.ingest_sources"]
    assert src["nodeId"] == second.file_node(second.raw_files[2])


def test_trace_cut_by_depth_lists_no_false_sources(client, sample):
    _, _, (first, second) = sample
    # 2 job hops up from model v2 stops inside the pipeline: no raw file reached, none invented
    trace = client.get("/api/v1/crucible/trace", params={"nodeId": second.model_version_node, "depth": 2}).json()
    assert trace["truncated"] and trace["sources"] == [] and trace["unlicensed"] == []


def test_trace_flags_sources_without_licence(tmp_path):
    app = create_app(tmp_path / "l.db", write_token=TOKEN)
    em = LineageEmitter(tmp_path / "l.jsonl", "crucible", PRODUCER)
    known, unknown, out = tmp_path / "known.txt", tmp_path / "scraped.txt", tmp_path / "mixed.parquet"
    for p in (known, unknown, out):
        p.write_text(p.name)
    with em.run(JobRef("curate.ingest_sources", str(uuid.uuid4())), inputs=[
            dataset_for_path(known, source={"name": "k", "licence": "CC0-1.0", "provenance": "made here"}),
            dataset_for_path(unknown)]) as run:
        run.outputs.append(dataset_for_path(out, output=True))
    with TestClient(app, headers=AUTH) as c:
        replay(tmp_path / "l.jsonl", "http://testserver", client=c)
        trace = c.get("/api/v1/crucible/trace", params={"nodeId": f"dataset:file:{out.resolve()}"}).json()
        assert trace["licences"] == {"CC0-1.0": ["k"]}
        assert trace["unlicensed"] == [f"dataset:file:{unknown.resolve()}"]
        report = c.get("/api/v1/crucible/report", params={"nodeId": f"dataset:file:{out.resolve()}"}).json()
        assert any("without a licence" in w for w in report["warnings"])


def test_provenance_report_json_and_markdown(client, sample):
    _, _, (first, second) = sample
    params = {"nodeId": second.model_version_node}
    rep = client.get("/api/v1/crucible/report", params={**params, "format": "json"}).json()
    assert rep["subject"]["version"] and rep["subject"]["producedBy"][0]["job"] == "deploy.gate_register_serve"
    assert {"label": "MLflow model version",
            "url": "http://127.0.0.1:5000/#/models/crucible-tiny/versions/2"} in rep["subject"]["links"]
    assert {s["licence"] for s in rep["sources"]} == set(LICENCES.values())
    filt = [s for s in rep["filterStages"] if s["job"] == "curate.filter_and_dedup"]
    assert len(filt) == 2 and filt[-1]["dropped"] == FILTER_DROPS
    assert filt[-1]["rowsIn"] - sum(FILTER_DROPS.values()) == filt[-1]["rowsOut"]
    assert [t["config"]["crucible_config"]["vocab_size"] for t in rep["tokenizer"]] == [4096, 4096]
    assert rep["training"][-1]["config"]["crucible_config"]["train"]["resume"] is True
    assert rep["evaluation"] and rep["evaluation"][0]["results"]["crucible_eval"]["val_loss"] == pytest.approx(5.9)
    kinds = [s["kind"] for s in rep["stages"]]
    assert {"ingest", "curate", "tokenizer", "tokens", "train", "evaluate", "deploy"} <= set(kinds)
    assert rep["pipelineRuns"][0]["root"] and rep["pipelineRuns"][0]["job"] == "pretrain"
    assert rep["pipelineRuns"][0]["links"][0]["url"].startswith("http://127.0.0.1:4200/login?redirect=/runs/flow-run/")
    assert rep["warnings"] == []
    assert any(a["name"] == "models/crucible-tiny/2" for a in rep["artifacts"])
    md = client.get("/api/v1/crucible/report", params={**params, "format": "md", "download": "true"})
    assert md.status_code == 200 and md.headers["content-type"].startswith("text/markdown")
    assert "attachment" in md.headers["content-disposition"]
    text = md.text
    for heading in ("## Sources and licences", "## Stages", "## Filter stages", "## Tokenizer", "## Training",
                    "## Evaluation", "## Artifacts"):
        assert heading in text
    for licence in LICENCES.values():
        assert licence.replace("|", "\\|") in text
    assert "| langid | 120 |" in text and '"vocab_size": 4096' in text and "val_loss" in text
    assert client.get("/api/v1/crucible/report", params={**params, "format": "pdf"}).status_code == 422


def test_report_without_optional_facets(tmp_path):
    """Only what today's emitter writes (no stats/config/eval facets): the report still works."""
    log, (p,) = write_sample_log(tmp_path, pipelines=1, stats=False)
    with TestClient(create_app(tmp_path / "l.db", write_token=TOKEN), headers=AUTH) as c:
        replay(log, "http://testserver", client=c)
        rep = c.get("/api/v1/crucible/report", params={"nodeId": p.model_version_node}).json()
        assert len(rep["sources"]) == RAW_FILES
        ingest = next(s for s in rep["stages"] if s["kind"] == "ingest")
        assert ingest["rowsIn"] == 150 * RAW_FILES and ingest["dropped"] == {}
        assert rep["tokenizer"][0]["config"] == {} and rep["evaluation"][0]["results"] == {}
        md = c.get("/api/v1/crucible/report", params={"nodeId": p.model_version_node, "format": "md"}).text
        assert "No drop counts were recorded" in md and "No configuration facet was recorded." in md


def test_ingest_is_idempotent(client, sample, tmp_path):
    _, log, _ = sample
    before = client.get("/api/v1/crucible/stats").json()
    again = replay(log, "http://testserver", client=client, batch_size=1000)
    assert again["ingested"] == 0 and again["duplicates"] == again["events"]
    event = read_events(log)[5]
    resp = client.post("/api/v1/lineage", json=event)
    assert resp.status_code == 201 and resp.json() == {"received": 1, "ingested": 0, "duplicates": 1}
    assert client.get("/api/v1/crucible/stats").json() == before
    # the same event at another time is another event
    store = LineageStore(tmp_path / "x.db")
    assert store.ingest(event) is True and store.ingest(event) is False
    assert store.ingest({**event, "eventTime": "2030-01-01T00:00:00Z"}) is True
    assert store.ingest_batch([event, event]) == {"received": 2, "ingested": 0, "duplicates": 2}


def test_event_times_in_other_iso_forms_are_stored_normalised(tmp_path):
    """A lowercase 't' (which the schema's date-time check lets through), a space or a week date is
    stored as the UTC form with 'T' (text order = time order), so the same event sent with 't' then
    'T' is one event."""
    from infra.services.lineage.store import utc_time

    canonical_time = "2026-01-01T00:00:00.000000Z"
    for value in ("2026-01-01t00:00:00.000000Z", "2026-01-01 00:00:00.000000Z", "2026-01-01 00:00:00.000000+00:00",
                  "2026-01-01X00:00:00.000000Z", "2026-W01-4T00:00:00.000000Z", canonical_time,
                  "2026-01-01T00:00:00.000000+00:00"):
        assert utc_time(value) == canonical_time, value
    store = LineageStore(tmp_path / "l.db")
    event = {"eventType": "START", "eventTime": "2026-01-01t00:00:00.000000Z", "producer": PRODUCER,
             "run": {"runId": str(uuid.uuid4())}, "job": {"namespace": "crucible", "name": "j"}}
    assert store.ingest(event) is True
    assert store.ingest({**event, "eventTime": canonical_time}) is False
    assert [r["event_time"] for r in store.query("SELECT event_time FROM events")] == [canonical_time]
    row = store.query("SELECT started_at FROM runs WHERE run_id = ?", (event["run"]["runId"],))[0]
    assert row["started_at"] == canonical_time


def test_close_stops_the_checkpointer_thread(tmp_path, monkeypatch):
    from infra.services.lineage import store as store_module

    monkeypatch.setattr(store_module, "CHECKPOINT_EVENTS", 1)
    store = LineageStore(tmp_path / "l.db")
    base = {"eventType": "START", "eventTime": "2026-01-01T00:00:00Z", "producer": PRODUCER,
            "job": {"namespace": "crucible", "name": "j"}}
    assert store.ingest({**base, "run": {"runId": str(uuid.uuid4())}}) is True
    checkpointer = store._checkpointer
    assert checkpointer is not None and checkpointer.is_alive()
    store.close()
    assert not checkpointer.is_alive()
    # a later ingestion (another connection of this thread) checkpoints again, on a new thread
    assert store.ingest({**base, "run": {"runId": str(uuid.uuid4())}}) is True
    assert store._checkpointer is not None and store._checkpointer.is_alive()
    again = store._checkpointer
    store.close()
    assert not again.is_alive()


def test_bad_events_are_refused_whole(tmp_path):
    with TestClient(create_app(tmp_path / "l.db", write_token=TOKEN), headers=AUTH) as c:
        good = {"eventType": "START", "eventTime": "2026-01-01T00:00:00Z", "producer": PRODUCER,
                "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent",
                "run": {"runId": str(uuid.uuid4())}, "job": {"namespace": "crucible", "name": "j"}}
        assert c.post("/api/v1/lineage", content=b"{not json").status_code == 400
        bad = {**good, "run": {}}
        resp = c.post("/api/v1/lineage", json=[good, bad])
        assert resp.status_code == 400 and "event 1" in resp.json()["detail"]
        assert c.get("/api/v1/crucible/stats").json()["events"] == 0  # nothing of that batch stored
        # every event is checked against the spec by default: 400 naming the failing field, nothing stored
        bad_type = c.post("/api/v1/lineage", json={**good, "eventType": "DONE"})
        assert bad_type.status_code == 400 and "eventType" in bad_type.json()["detail"], bad_type.text
        assert c.get("/api/v1/crucible/stats").json()["events"] == 0
        assert c.post("/api/v1/lineage", json=good).status_code == 201
        for malformed in ({"run": "x"}, {"inputs": {"a": 1}, "outputs": []}, {"inputs": ["s"]}):  # 400, never 500
            assert c.post("/api/v1/lineage", json={**good, **malformed}).status_code == 400


def test_out_of_order_events_keep_the_final_state(tmp_path):
    store = LineageStore(tmp_path / "l.db")
    run_id = str(uuid.uuid4())
    base = {"run": {"runId": run_id}, "job": {"namespace": "crucible", "name": "j"}, "producer": PRODUCER}
    store.ingest({**base, "eventType": "COMPLETE", "eventTime": "2026-01-01T00:00:05Z",
                  "outputs": [{"namespace": "file", "name": "/o", "facets": {"version": {"datasetVersion": "v2"}}}]})
    store.ingest({**base, "eventType": "START", "eventTime": "2026-01-01T00:00:01+00:00",
                  "inputs": [{"namespace": "file", "name": "/i"}]})
    row = store.query("SELECT * FROM runs WHERE run_id = ?", (run_id,))[0]
    assert (row["state"], row["started_at"], row["ended_at"]) == (
        "COMPLETED", "2026-01-01T00:00:01.000000Z", "2026-01-01T00:00:05.000000Z")
    walk = store.walk(Node("DATASET", "file", "/o"), 5, "upstream")
    assert ("file", "/i") in walk.datasets and walk.runs == {run_id: ("crucible", "j")}


def test_server_entry_and_replay_over_http(sample, tmp_path):
    _, log, (_, second) = sample
    port = free_port()
    (tmp_path / "token").write_text(TOKEN + "\n")
    proc, base = start_service(tmp_path / "l.db", port, token_file=tmp_path / "token")
    try:
        with pytest.raises(ReplayError, match="401"):  # no token
            replay(log, base, batch_size=25)
        result = replay(log, base, batch_size=25, token=TOKEN)
        n = len(read_events(log))
        assert result["mode"] == "batch" and result["requests"] == -(-n // 25) and result["ingested"] == n
        resp = httpx.get(f"{base}/api/v1/lineage", params={"nodeId": second.model_version_node, "depth": 20})
        assert second.file_node(second.raw_files[0]) in {n["id"] for n in resp.json()["graph"]}
        assert httpx.get(f"{base}/").text.startswith("<!doctype html>")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_replay_falls_back_to_one_event_per_request_for_marquez(sample):
    """Marquez takes one event per POST; a server that refuses arrays gets them one by one."""
    _, log, _ = sample
    got = []
    marquez = FastAPI()

    @marquez.post("/api/v1/lineage", status_code=201)
    def lineage(event: dict) -> None:
        got.append(event)

    with TestClient(marquez) as c:
        result = replay(log, "http://testserver/api/v1/lineage", client=c, batch_size=50)
    assert result["mode"] == "single" and len(got) == result["events"] == len(read_events(log))
    assert [e["run"]["runId"] for e in got] == [e["run"]["runId"] for e in read_events(log)]


def test_writes_need_the_write_token_and_reads_can_too(tmp_path):
    """An unauthenticated or invalid write changes nothing in the store; a service without a write
    token refuses writes; with a read token, API reads need it (or the write token), the page does not."""
    good = {"eventType": "START", "eventTime": "2026-01-01T00:00:00Z", "producer": PRODUCER,
            "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent",
            "run": {"runId": str(uuid.uuid4())}, "job": {"namespace": "crucible", "name": "j"}}
    with TestClient(create_app(tmp_path / "l.db", write_token=TOKEN)) as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
            assert c.post("/api/v1/lineage", json=good, headers=headers).status_code == 401
        assert c.get("/api/v1/crucible/stats").json()["events"] == 0  # reads are public by default
        assert c.post("/api/v1/lineage", json=good, headers=AUTH).status_code == 201
        assert c.get("/api/v1/crucible/stats").json()["events"] == 1
    with TestClient(create_app(tmp_path / "open.db")) as c:
        r = c.post("/api/v1/lineage", json=good)
        assert r.status_code == 403 and "no token" in r.json()["detail"]
    with TestClient(create_app(tmp_path / "private.db", write_token=TOKEN, read_token="read-t0ken")) as c:
        assert c.get("/api/v1/crucible/stats").status_code == 401
        assert c.get("/api/v1/namespaces").status_code == 401
        assert c.get("/api/v1/crucible/stats", headers={"Authorization": "Bearer read-t0ken"}).status_code == 200
        assert c.get("/api/v1/crucible/stats", headers=AUTH).status_code == 200
        assert c.post("/api/v1/lineage", json=good, headers={"Authorization": "Bearer read-t0ken"}).status_code == 401
        assert c.get("/healthz").status_code == 200 and c.get("/").status_code == 200


def _graph_bytes(client, node: str, direction: str) -> bytes:
    resp = client.get("/api/v1/lineage", params={"nodeId": node, "depth": 20, "direction": direction})
    assert resp.status_code == 200, resp.text
    return resp.content


def test_graph_answers_follow_every_write_to_a_dataset(tmp_path):
    """The graph view reuses each dataset's encoded object only while its stored row is unchanged,
    whether this service or another process wrote the change."""
    db, log, src, out = tmp_path / "l.db", tmp_path / "l.jsonl", tmp_path / "in.txt", tmp_path / "out.txt"
    src.write_text("input")
    em = LineageEmitter(log, "crucible", PRODUCER)

    def emit(n: int) -> None:
        out.write_text(f"output {n}")
        with em.run(JobRef("curate.ingest_sources", str(uuid.uuid4())), inputs=[dataset_for_path(src)]) as run:
            run.outputs.append(dataset_for_path(out, output=True, doc=f"pass {n}"))

    out_id = f"dataset:file:{out.resolve()}"
    with TestClient(create_app(db, write_token=TOKEN), headers=AUTH) as c:
        def served() -> dict:
            graph = loads(_graph_bytes(c, f"dataset:file:{src.resolve()}", "downstream"))["graph"]
            return next(n["data"] for n in graph if n["id"] == out_id)

        for n, writer in enumerate(("service", "service", "another process")):
            emit(n)
            if writer == "service":
                replay(log, "http://testserver", client=c)
            else:
                LineageStore(db).ingest_batch(read_events(log))
            data = served()
            assert data["description"] == f"pass {n}" and data["facets"]["documentation"]["description"] == f"pass {n}"
            assert data["currentVersion"] == dataset_for_path(out).facets["version"].datasetVersion
            assert data["crucible"]["hop"] == 1 and len(data["crucible"]["versions"]) == n + 1
            # a repeated answer (from the cache) is the same, byte for byte, and JSON as dumps writes it
            again = _graph_bytes(c, f"dataset:file:{src.resolve()}", "downstream")
            assert again == _graph_bytes(c, f"dataset:file:{src.resolve()}", "downstream") == dumps_bytes(loads(again))


def test_a_database_from_before_revisions_is_migrated_when_opened(sample, tmp_path):
    """A store written before `datasets.revision` and the walks' covering index opens, gains them
    and answers the same graphs; writes after that carry revisions."""
    _, log, (_, second) = sample
    db = tmp_path / "l.db"
    LineageStore(db).ingest_batch(read_events(log))
    queries = [(second.model_version_node, "upstream"), (second.file_node(second.raw_files[0]), "downstream")]

    def graphs() -> list[bytes]:
        with TestClient(create_app(db)) as c:
            return [_graph_bytes(c, node, direction) for node, direction in queries]

    def schema() -> tuple[list[str], set[str]]:
        with sqlite3.connect(db) as conn:
            return ([r[1] for r in conn.execute("PRAGMA table_info(datasets)")],
                    {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'index'")})

    expected = graphs()
    with sqlite3.connect(db) as conn:  # back to the schema as it was
        conn.executescript("DROP INDEX datasets_revision; DROP INDEX run_io_by_dataset;"
                           " ALTER TABLE datasets DROP COLUMN revision;"
                           " CREATE INDEX run_io_dataset ON run_io (namespace, name, direction);")
    columns, indexes = schema()
    assert columns == ["namespace", "name", "facets", "current_version", "version_time", "created_at",
                       "updated_at", "last_modified_at"] and "run_io_dataset" in indexes
    assert graphs() == expected
    columns, indexes = schema()
    assert columns[-1] == "revision" and {"datasets_revision", "run_io_by_dataset"} <= indexes
    assert "run_io_dataset" not in indexes
    store = LineageStore(db)
    event = next(e for e in read_events(log) if e.get("outputs"))
    assert store.ingest({**event, "eventTime": "2030-01-01T00:00:00Z"})
    revised = {(r["namespace"], r["name"]) for r in store.query("SELECT * FROM datasets WHERE revision > 0")}
    assert revised == {(d["namespace"], d["name"]) for d in event.get("inputs", []) + event["outputs"]}


def _pages(client, node: str, **params) -> list[dict]:
    """Every page of a graph query, following page.nextCursor from the first."""
    pages, cursor = [], None
    while True:
        resp = client.get("/api/v1/lineage", params={"nodeId": node, **params, **({"cursor": cursor} if cursor else {})})
        assert resp.status_code == 200, resp.text
        pages.append(resp.json())
        cursor = pages[-1]["page"]["nextCursor"]
        if cursor is None:
            return pages


def test_graph_pages_list_every_node_once_with_their_fan_out_groups(client, sample):
    """A bounded answer pages through the whole graph: each node once, each edge once (within a page
    or to an earlier page), and each "N more" group counts the nodes of its fan-out still to come
    (at least that many while the walk has not been taken to its end); its cursor opens a page of them."""
    _, _, (first, second) = sample
    for node, direction in ((second.file_node(second.raw_files[0]), "downstream"),
                            (second.model_version_node, "both")):
        everything = _pages(client, node, direction=direction, limit=100_000, maxBytes=1 << 30)
        assert len(everything) == 1 and everything[0]["page"]["nodes"] == everything[0]["page"]["totalNodes"]
        full = {n["id"]: n for n in everything[0]["graph"]}
        full_edges = {(e["origin"], e["destination"]) for n in full.values() for e in n["outEdges"]}
        assert len(full) > 30 and not everything[0]["groups"]
        walk = client.app.state.store.walk(split_node_id(node)[0], 20, direction)  # taken whole, at once
        assert full_edges == walk.edges and len(full) == len(walk.jobs) + len(walk.datasets)
        for n in full.values():  # the same hops, runs and versions as the whole walk's
            info = (walk.jobs if n["type"] == "JOB" else walk.datasets)[split_node_id(n["id"])[0].key]
            listed = n["data"]["crucible"]["runs" if n["type"] == "JOB" else "versions"]
            assert (n["data"]["crucible"]["hop"], listed) == (info["hop"], sorted(info["runs" if n["type"] == "JOB"
                                                                                        else "versions"]))
        pages = _pages(client, node, direction=direction, limit=6, fanout=2)
        assert len(pages) == -(-len(full) // 6) and all(p["page"]["nodes"] <= 6 for p in pages)
        seen = [n["id"] for p in pages for n in p["graph"]]
        assert len(seen) == len(set(seen)) and set(seen) == set(full)
        edges = [(e["origin"], e["destination"]) for p in pages for e in
                 [e for n in p["graph"] for e in n["outEdges"]] + p["page"]["earlierEdges"]]
        assert len(edges) == len(set(edges)) and set(edges) == full_edges
        groups = 0
        for i, p in enumerate(pages):
            later = [n for q in pages[i + 1:] for n in q["graph"]]
            for g in p["groups"]:
                groups += 1
                # (a node both read and written by its parent, e.g. a resumed checkpoint, is in one of its groups)
                hidden = [n["id"] for n in later if n["data"]["crucible"]["via"] == g["parent"]]
                counted = sum(x["count"] for x in p["groups"] if x["parent"] == g["parent"])
                assert 0 < g["count"] <= counted <= len(hidden) and (g["atLeast"] or counted == len(hidden)), g
                assert sum(g["types"].values()) == g["count"]
                # its cursor opens a page of its nodes, the group again for the rest
                opened = client.get("/api/v1/lineage", params={"nodeId": node, "direction": direction, "limit": 6,
                                                               "fanout": 2, "cursor": g["cursor"]}).json()
                members = [n["id"] for n in opened["graph"]]
                assert set(members) <= set(hidden) and 0 < len(members) <= 6
                assert all(n["data"]["crucible"]["via"] == g["parent"] for n in opened["graph"])
                assert opened["page"]["group"] == g["id"] and {x["id"] for x in opened["groups"]} <= {g["id"]}
                # the group as the walk has found it by now: at least what the page said
                assert len(members) + sum(x["count"] for x in opened["groups"]) >= g["count"]
        assert groups  # a fan-out wider than 2 was cut
    other = client.get("/api/v1/lineage", params={"nodeId": first.model_version_node, "cursor": pages[0]["page"]["nextCursor"],
                                                  "limit": 6, "fanout": 2, "direction": "both"})
    assert other.status_code == 400 and "another query" in other.json()["detail"]


def test_default_graph_answer_stays_under_2mb_and_names_what_it_left_out(tmp_path):
    """One raw file read by 700 runs, each writing a file with 4 kB of facets: the whole graph is
    ~3 MB; the default answer holds at most 200 nodes in at most 2 MB, and the job's "N more"
    group counts the outputs left for later pages."""
    store = LineageStore(tmp_path / "l.db")
    doc = {"documentation": {"_producer": PRODUCER, "_schemaURL": "https://openlineage.io/spec/facets/1-0-1/"
                             "DocumentationDatasetFacet.json", "description": "x" * 4000}}
    store.ingest_batch([{
        "eventType": "COMPLETE", "eventTime": f"2026-01-01T00:{i // 60:02d}:{i % 60:02d}Z", "producer": PRODUCER,
        "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent",
        "run": {"runId": str(uuid.UUID(int=i + 1))}, "job": {"namespace": "crucible", "name": "fan.out"},
        "inputs": [{"namespace": "file", "name": "/raw"}],
        "outputs": [{"namespace": "file", "name": f"/out/{i:04d}", "facets": doc}]} for i in range(700)])
    with TestClient(create_app(tmp_path / "l.db")) as c:
        full = c.get("/api/v1/lineage", params={"nodeId": "dataset:file:/raw", "limit": 100_000, "maxBytes": 1 << 30})
        assert len(full.content) > 2_800_000 and full.json()["page"]["totalNodes"] == 702
        resp = c.get("/api/v1/lineage", params={"nodeId": "dataset:file:/raw"})
        answer = resp.json()
        assert len(resp.content) <= 2_000_000 and answer["page"]["maxBytes"] == 2_000_000
        assert answer["page"]["nodes"] == len(answer["graph"]) <= 200 and answer["page"]["nextCursor"]
        (group,) = answer["groups"]
        assert group["parent"] == "job:crucible:fan.out" and group["direction"] == "downstream"
        assert group["count"] == group["types"]["DATASET"] == 702 - len(answer["graph"])
        small = c.get("/api/v1/lineage", params={"nodeId": "dataset:file:/raw", "maxBytes": 100_000})
        assert len(small.content) <= 100_000 and 1 < small.json()["page"]["nodes"] < 25


def test_a_page_walks_only_as_far_as_it_shows(tmp_path):
    """A raw file read by 700 runs of one job, each output read by a run of a second job: 1,403
    nodes. The first default page places ~200 of them and finds only what their fan-outs reach
    (the counts say "at least"); following the cursors lists the same graph as one unbounded
    answer, every node and edge once."""
    store = LineageStore(tmp_path / "l.db")

    def event(i: int, job: str, inputs: list[str], outputs: list[str]) -> dict:
        return {"eventType": "COMPLETE", "eventTime": f"2026-01-01T{i // 3600:02d}:{i // 60 % 60:02d}:{i % 60:02d}Z",
                "producer": PRODUCER, "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent",
                "run": {"runId": str(uuid.UUID(int=i + 1))}, "job": {"namespace": "crucible", "name": job},
                "inputs": [{"namespace": "file", "name": n} for n in inputs],
                "outputs": [{"namespace": "file", "name": n} for n in outputs]}

    store.ingest_batch([event(i, "split", ["/raw"], [f"/part/{i:03d}"]) for i in range(700)] +
                       [event(1000 + i, "clean", [f"/part/{i:03d}"], [f"/clean/{i:03d}"]) for i in range(700)])
    with TestClient(create_app(tmp_path / "l.db")) as c:
        first = c.get("/api/v1/lineage", params={"nodeId": "dataset:file:/raw", "direction": "downstream"}).json()
        assert first["page"]["nodes"] == 200 and not first["page"]["complete"]
        assert 200 < first["page"]["totalNodes"] < 1403 and all(g["atLeast"] for g in first["groups"])
        whole = c.get("/api/v1/lineage", params={"nodeId": "dataset:file:/raw", "direction": "downstream",
                                                 "limit": 100_000}).json()
        assert whole["page"]["complete"] and whole["page"]["totalNodes"] == whole["page"]["nodes"] == 1403
        assert not whole["groups"] and not whole["page"]["truncated"]
        edges = {(e["origin"], e["destination"]) for n in whole["graph"] for e in n["outEdges"]}
        assert len(edges) == 1 + 700 * 3  # raw->split, split->700 parts, 700 parts->clean, clean->700
        walk = store.walk(Node("DATASET", "file", "/raw"), 20, "downstream")  # the whole walk at once
        assert edges == walk.edges and len(walk.jobs) + len(walk.datasets) == 1403
        pages = _pages(c, "dataset:file:/raw", direction="downstream")
        assert [n["id"] for p in pages for n in p["graph"]] == [n["id"] for n in whole["graph"]]
        paged = [(e["origin"], e["destination"]) for p in pages for e in
                 [e for n in p["graph"] for e in n["outEdges"]] + p["page"]["earlierEdges"]]
        assert len(paged) == len(set(paged)) and set(paged) == edges
        assert pages[-1]["page"]["complete"] and not pages[-1]["groups"]


def test_ingesting_process_keeps_the_walk_index_current(sample, tmp_path):
    """A store that ingests a batch adds its run_io rows to the walks' index itself (no read-back
    by the next walk), unless another process wrote in between; either way walks agree with a
    store that reads the whole database afresh."""
    _, log, (_, second) = sample
    events = read_events(log)
    db = tmp_path / "l.db"
    mine, other = LineageStore(db), LineageStore(db)
    half = len(events) // 2
    mine.ingest_batch(events[:half // 2])
    top = lambda: mine.query("SELECT max(id) FROM events")[0][0]  # noqa: E731
    assert mine._io_index.loaded and mine._io_index.seen == top()  # advanced by the ingest, before any walk
    other.ingest_batch(events[half // 2:half])  # another process: mine's index is now behind
    mine.ingest_batch(events[half:])
    assert mine._io_index.seen < top()  # not advanced past the other's writes: left to the next walk
    model = split_node_id(second.model_version_node)[0]
    for direction in ("upstream", "downstream", "both"):
        walk, fresh = mine.walk(model, 20, direction), LineageStore(db).walk(model, 20, direction)
        assert (walk.edges, walk.jobs, walk.datasets) == (fresh.edges, fresh.jobs, fresh.datasets)
    assert mine._io_index.seen == top()
    raw = split_node_id(second.file_node(second.raw_files[0]))[0]
    again = LineageStore(db)
    again.ingest_batch(events)  # all duplicates: nothing to add
    assert again._io_index.seen == 0 and not again._io_index.loaded
    again.warm()
    assert again._io_index.loaded and again._io_index.seen == top()
    assert again.walk(raw, 20, "downstream").edges == mine.walk(raw, 20, "downstream").edges


def test_checkpoints_run_on_their_own_thread(sample, tmp_path, monkeypatch):
    """Every CHECKPOINT_EVENTS stored events the store's checkpointer thread copies the WAL into the
    database (not the writer, whose own autocheckpoint stays the bound); a fresh reader sees it all."""
    import time

    from infra.services.lineage import store as store_module

    _, log, _ = sample
    events = read_events(log)
    monkeypatch.setattr(store_module, "CHECKPOINT_EVENTS", 10)
    store = LineageStore(tmp_path / "l.db")
    store.ingest_batch(events[:5])
    assert store._checkpointer is None  # fewer events than CHECKPOINT_EVENTS: not woken
    store.ingest_batch(events[5:])
    deadline = time.monotonic() + 30
    while not store.checkpoints and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store._checkpointer.is_alive() and store._checkpointer is not threading.current_thread()
    busy, frames, copied = store.checkpoints[-1]
    assert busy == 0 and frames > 0 and copied == frames
    assert LineageStore(tmp_path / "l.db").counts()["events"] == len(events)


def test_replay_reads_ahead_while_the_server_stores_a_batch():
    """replay's batches come from a reader thread that runs ahead of the POSTs, in order; a read
    error is raised at its place; leaving early stops the reader."""
    import threading
    import time

    from tasks.lineage.replay import _prefetched

    produced = []

    def items():
        for i in range(5):
            produced.append(i)
            yield i
        raise ValueError("a bad line")

    it = _prefetched(items(), depth=2)
    assert next(it) == 0
    deadline = time.monotonic() + 10
    while len(produced) < 3 and time.monotonic() < deadline:  # read ahead with nobody asking
        time.sleep(0.01)
    assert len(produced) >= 3
    got = []
    with pytest.raises(ValueError, match="a bad line"):
        for i in it:
            got.append(i)
    assert got == [1, 2, 3, 4]

    endless = _prefetched(iter(int, 1))  # never ends
    assert next(endless) == 0
    endless.close()
    assert not any(t.name == "replay-reader" for t in threading.enumerate())


def test_replay_keeps_two_batches_in_flight_and_stops_at_a_refused_one(sample):
    """After the first batch (alone: it tells whether the server takes arrays), replay posts the next
    batch while the server still stores the previous one; counts add up, and a refused batch raises
    with nothing posted past the batches already in flight."""
    import threading
    import time

    _, log, _ = sample
    n = len(read_events(log))
    lock, state = threading.Lock(), {"now": 0, "most": 0, "posted": 0}

    def handler(refuse_at: int | None):
        def handle(request: httpx.Request) -> httpx.Response:
            with lock:
                state["posted"] += 1
                number = state["posted"]
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
            time.sleep(0.05)  # storing
            with lock:
                state["now"] -= 1
            if number == refuse_at:
                return httpx.Response(400, json={"detail": "refused"})
            events = loads(request.content)
            return httpx.Response(201, json={"received": len(events), "ingested": len(events), "duplicates": 0})
        return handle

    with httpx.Client(transport=httpx.MockTransport(handler(None))) as c:
        result = replay(log, "http://lineage", client=c, batch_size=5, in_flight=2)
    assert result["ingested"] == result["events"] == n and result["requests"] == state["posted"] == -(-n // 5)
    assert state["most"] == 2
    state.update(now=0, most=0, posted=0)
    with httpx.Client(transport=httpx.MockTransport(handler(None))) as c:
        replay(log, "http://lineage", client=c, batch_size=5, in_flight=1)
    assert state["most"] == 1
    state.update(now=0, most=0, posted=0)
    with httpx.Client(transport=httpx.MockTransport(handler(3))) as c, pytest.raises(ReplayError, match="400"):
        replay(log, "http://lineage", client=c, batch_size=5, in_flight=2)
    assert state["posted"] <= 4 < -(-n // 5)


def test_replay_verifies_by_the_fast_encoding_and_falls_back_to_canonical_json(tmp_path, monkeypatch):
    """Lines are verified over orjson's sorted encoding when it is canonical()'s (the emitter's
    lines), over canonical() when the two differ (a float written 1e-07 by json, 1e-7 by orjson);
    an altered line is refused either way."""
    import json

    from tasks.lineage import signed
    from tasks.lineage.replay import iter_events

    base = {"eventType": "START", "eventTime": "2026-01-01T00:00:00Z", "producer": PRODUCER,
            "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent",
            "job": {"namespace": "crucible", "name": "j"}}
    plain = signed.sign_event({**base, "run": {"runId": str(uuid.uuid4())}})
    tiny_float = signed.sign_event({**base, "run": {"runId": str(uuid.uuid4()), "facets": {"x": {"v": 1e-7}}}})
    altered = json.loads(json.dumps(plain))
    altered["job"]["name"] = "other"
    with_null = signed.sign_event({**base, "run": {"runId": str(uuid.uuid4()), "facets": {"x": {"v": None}}}})
    nan_for_null = json.dumps(with_null).replace('"v": null', '"v": NaN')  # orjson would write NaN as null
    assert "NaN" in nan_for_null
    log = tmp_path / "lineage.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in (plain, tiny_float, altered)) + nan_for_null + "\n")
    fast = []
    real = signed._signs_sorted_orjson
    monkeypatch.setattr(signed, "_signs_sorted_orjson", lambda *a: fast.append(real(*a)) or fast[-1])
    refused: list[int] = []
    got = list(iter_events(log, refused))
    assert [e["run"]["runId"] for e in got] == [plain["run"]["runId"], tiny_float["run"]["runId"]]
    assert refused == [3, 4] and fast == [True, False, False, False]


def test_validation_remembers_only_facets_that_passed(monkeypatch):
    """A facet seen valid before is not checked again (same encoding, same schema); the same facet
    made invalid, or under another schema, is checked and refused."""
    from tasks.lineage import validate

    monkeypatch.setattr(validate, "_VALID_FACETS", set())
    doc = {"_producer": PRODUCER, "_schemaURL": "https://openlineage.io/spec/facets/1-1-0/"
                                                "DocumentationJobFacet.json#/$defs/DocumentationJobFacet",
           "description": "d"}
    event = {"eventType": "START", "eventTime": "2026-01-01T00:00:00Z", "producer": PRODUCER,
             "schemaURL": "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent",
             "run": {"runId": str(uuid.uuid4())},
             "job": {"namespace": "crucible", "name": "j", "facets": {"documentation": doc}}}
    assert validate.event_errors(event) == []
    assert [url for _, url, _ in validate._VALID_FACETS] == [doc["_schemaURL"]]
    assert validate.event_errors(event) == []
    bad = {**doc, "description": 5}
    errors = validate.event_errors({**event, "job": {**event["job"], "facets": {"documentation": bad}}})
    assert any("description" in e for e in errors), errors
    other = {**doc, "_schemaURL": "https://openlineage.io/spec/facets/2-0-4/JobTypeJobFacet.json#/$defs/JobTypeJobFacet"}
    assert validate.event_errors({**event, "job": {**event["job"], "facets": {"jobType": other}}})
    assert len(validate._VALID_FACETS) == 1
    with_null = {**doc, "description": "n", "x": None}  # orjson writes NaN as null too: never kept
    assert validate.event_errors({**event, "job": {**event["job"], "facets": {"documentation": with_null}}}) == []
    assert len(validate._VALID_FACETS) == 1


def test_the_service_serves_with_the_collector_tuned_for_ingestion(tmp_path, monkeypatch):
    """The server process runs with a gen0 threshold far above the default 700 (a posted batch is
    ~100,000 acyclic containers), the measured 100,000; gen1 and gen2 as they were (not measured);
    cycles still collected."""
    import gc

    import uvicorn

    from infra.services.lineage import __main__ as service_main

    seen = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.append((gc.get_threshold(), gc.isenabled())))
    before = gc.get_threshold()
    try:
        assert service_main.main(["--db", str(tmp_path / "l.db")]) == 0
    finally:
        gc.set_threshold(*before)
        gc.unfreeze()
    assert seen == [((100_000, *before[1:]), True)], (seen, before)
